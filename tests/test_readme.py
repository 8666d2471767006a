"""The README's code must run as written."""

import re
import subprocess
import sys

from conftest import ROOT


def test_core_library_snippet_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "no python block in README.md"
    for code in blocks:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        assert "sent" in proc.stdout
