"""The documentation's code must run as written: the core library's snippet (docs/library.md,
moved there from README.md) and the DDP hook's (docs/ddp.md)."""

import os
import re
import socket
import subprocess
import sys

from conftest import ROOT

DOCS = ("README.md", "docs/library.md", "docs/ddp.md")


def _blocks():
    blocks = []
    for name in DOCS:
        found = re.findall(r"```python\n(.*?)```", (ROOT / name).read_text(), flags=re.S)
        assert found or name == "README.md", f"no python block in {name}"
        blocks += found
    return blocks


def test_core_library_snippet_runs():
    for code in _blocks():
        if "register_comm_hook" in code:  # a torchrun script: test_ddp_hook_snippet_runs
            continue
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        assert "sent" in proc.stdout


def test_ddp_hook_snippet_runs(tmp_path):
    """The DDP hook example, on 2 gloo ranks with the variables torchrun sets."""
    (code,) = [c for c in _blocks() if "register_comm_hook" in c]
    script = tmp_path / "script.py"
    script.write_text(code)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=ROOT, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120))
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err
        sent, dense = map(int, re.search(rf"rank {rank}: sent (\d+) of (\d+) bytes", out).groups())
        assert 0 < sent < dense / 5


# The README is a front page (issue 63): its results table quotes numbers from the tables it
# links, its links resolve, and it stays short.
README = ROOT / "README.md"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _numbers(text: str) -> list[str]:
    """The numbers in ``text`` as written, a leading '+' dropped (the tables write +1.45 and 2.31)."""
    return NUMBER.findall(text.replace("+", ""))


def test_readme_links_resolve():
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    assert len(links) >= 10
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README links to {link}: no such file"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), flags=re.M)
            assert anchor in {_slug(h) for h in headings}, f"README links to {link}: no such heading"


def test_readme_results_are_in_linked_tables():
    """Each row of the results table: its difference, interval and p stand together in one row of
    the table it links (a number copied from the wrong comparison, or a p adjusted another way,
    fails here)."""
    rows = [line for line in README.read_text().splitlines()
            if line.startswith("|") and "](" in line and line.count("|") == 5]
    assert len(rows) >= 6, "the README's results table is missing"
    for row in rows:
        _, result, estimate, p, details, _ = (cell.strip() for cell in row.split("|"))
        wanted = _numbers(estimate) + _numbers(p)[:1]  # p's first number; a note may follow it
        assert len(wanted) == 4, f"{row}: expected a difference, its interval and a p"
        (link,) = re.findall(r"\]\(([^)#]+)\)", details)
        lines = (ROOT / link).read_text().splitlines()
        assert any(set(wanted) <= set(_numbers(line)) for line in lines), \
            f"{result}: {wanted} are not together in one row of {link}"


def test_readme_is_a_front_page():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands == ["make run", "make test"]
    targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M)
    assert {"run", "test", "test-full", "help"} <= set(targets)
    assert len(text.split()) < 600, "the README is a front page: detail goes to REPRODUCTION.md or docs/"
    assert max(len(line) for line in text.splitlines()) <= 300


def test_performance_md_opens_with_a_summary_and_a_contents_list():
    """docs/performance.md is long: a summary and a contents list come first, the list names every
    section below it and each of its links lands on a heading."""
    text = (ROOT / "docs" / "performance.md").read_text()
    headings = re.findall(r"^(##+) (.+)$", text, flags=re.M)
    assert [h for _, h in headings[:2]] == ["Summary", "Contents"]
    contents = text.split("## Contents\n", 1)[1].strip().split("\n\n", 1)[0]
    listed = re.findall(r"\[(.+?)\]\(#([^)]+)\)", contents)
    assert [name for name, _ in listed] == [h.replace("`", "") for _, h in headings[2:]]
    assert all(anchor == _slug(h) for (_, anchor), (_, h) in zip(listed, headings[2:]))
