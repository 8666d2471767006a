"""A non-editable install (``pip install .``) runs as the checkout does: the wheel carries conf/
(through the link sparsetrain/_conf), so a run composes, trains and writes its folder from
anywhere, with no checkout on the path."""

import subprocess
import sys

import pytest
from conftest import ROOT, cli_env, read_json


@pytest.mark.slow  # builds and installs the wheel
def test_a_wheel_carries_the_configs_and_trains_from_anywhere(tmp_path):
    wheel_dir, target, work = tmp_path / "wheel", tmp_path / "site", tmp_path / "elsewhere"
    work.mkdir()
    pip = [sys.executable, "-m", "pip"]
    build = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheel_dir),
                            str(ROOT)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheel_dir.glob("sparsetrain-*.whl")
    install = subprocess.run([*pip, "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    assert (target / "sparsetrain" / "_conf" / "scheme" / "topk.yaml").is_file()
    assert not (target / "sparsetrain" / "_conf").is_symlink()  # the files themselves
    env = cli_env(PYTHONPATH=str(target))
    where = subprocess.run([sys.executable, "-c", "import sparsetrain, sparsetrain.config.schema as s; "
                            "print(sparsetrain.__file__); print(s.CONF_DIR)"],
                           capture_output=True, text=True, env=env, cwd=work, timeout=120)
    assert where.returncode == 0, where.stderr[-3000:]
    assert where.stdout.splitlines() == [str(target / "sparsetrain" / "__init__.py"),
                                         str(target / "sparsetrain" / "_conf")]
    run = work / "run"
    proc = subprocess.run([sys.executable, "-m", "sparsetrain.run", "debug=tiny", "scheme=blockk",
                           "train.max_steps=2", f"hydra.run.dir={run}"],
                          capture_output=True, text=True, env=env, cwd=work, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_json(run / "summary.json")["status"] == "completed"
