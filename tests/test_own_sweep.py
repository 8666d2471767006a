"""A researcher's own sweep, read right (issue 39): folders, values and commands as they typed them."""

from __future__ import annotations

from conftest import TINY, run_cli


def test_a_sweep_with_hydra_run_dir_stops_with_one_line_naming_hydra_sweep_dir(tmp_path):
    """Hydra ignores hydra.run.dir in a sweep and writes a new dated folder: resuming a sweep that
    way would rerun it from scratch."""
    proc = run_cli(*TINY, "-m", "seed=0,1", "hydra.run.dir=multirun/opt_sweep", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == ("error: hydra.run.dir=multirun/opt_sweep is ignored by a sweep (-m); "
                                   "use hydra.sweep.dir=multirun/opt_sweep")
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()  # nothing ran
