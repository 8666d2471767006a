"""A researcher's own sweep, read right (issue 39): folders, values and commands as they typed them."""

from __future__ import annotations

import pytest
from conftest import TINY, run_cli


def test_a_sweep_with_hydra_run_dir_stops_with_one_line_naming_hydra_sweep_dir(tmp_path):
    """Hydra ignores hydra.run.dir in a sweep and writes a new dated folder: resuming a sweep that
    way would rerun it from scratch."""
    proc = run_cli(*TINY, "-m", "seed=0,1", "hydra.run.dir=multirun/opt_sweep", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == ("error: hydra.run.dir=multirun/opt_sweep is ignored by a sweep (-m); "
                                   "use hydra.sweep.dir=multirun/opt_sweep")
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()  # nothing ran


def test_a_value_that_is_not_a_number_says_what_the_key_takes():
    """ratio=1% got OmegaConf's conversion text; other bad values say what is allowed."""
    from sparsetrain.config import ConfigError, check_overrides

    wanted = {
        "ratio=1%": "ratio='1%' is not allowed: give a number in (0, 1], e.g. ratio=0.01",
        "ratio=0.5%": "ratio='0.5%' is not allowed: give a number in (0, 1], e.g. ratio=0.005",
        "world_size=two": "world_size='two' is not allowed: give an integer >= 1, e.g. world_size=2",
        "optim.lr=fast": "optim.lr='fast' is not allowed: give a number, e.g. optim.lr=0.1",
        "train.max_steps=x": "train.max_steps='x' is not allowed: give an integer",  # default null: no example
    }
    for item, line in wanted.items():
        with pytest.raises(ConfigError) as info:
            check_overrides([item])
        assert str(info.value) == line
    with pytest.raises(ConfigError, match="ratio='2%' is not allowed: give a number"):  # each value of a sweep
        check_overrides(["-m", "ratio=0.01,2%"])


@pytest.mark.slow  # checked in-process above; test_cli.py has a refusal through the command line in the fast tier
def test_ratio_in_percent_stops_with_one_line_from_the_command_line(tmp_path):
    proc = run_cli(*TINY, "ratio=1%", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == "error: ratio='1%' is not allowed: give a number in (0, 1], e.g. ratio=0.01"


def test_make_run_echoes_a_command_one_can_paste(monkeypatch):
    """`make run` echoed `$ -m sparsetrain.run ...`: the interpreter was left out."""
    import sparsetrain.benchmarks.compare as compare

    seen = []
    monkeypatch.setattr(compare.sys, "executable", str(compare.ROOT / ".venv" / "bin" / "python"))
    monkeypatch.setattr(compare.subprocess, "call", lambda cmd, cwd: seen.append(cmd) or 0)
    monkeypatch.setattr(compare, "table", lambda sweep: "")
    printed = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: printed.append(" ".join(map(str, a))))
    compare.main(["train.max_steps=2"])
    line = printed[0]
    assert line.startswith("$ .venv/bin/python -m sparsetrain.run -m scheme=none,topk,randk,blockk "), line
    assert " train.max_steps=2 hydra.sweep.dir=outputs/compare/" in line and str(compare.ROOT) not in line
    assert seen[0][0] == compare.sys.executable  # what runs is unchanged
    assert compare.shown(["/elsewhere/python", "a=b c"]) == "/elsewhere/python 'a=b c'"  # outside: as is
