"""``python -m sparsetrain.run [overrides]``: the command line, which lives in ``launch.cli``."""

from sparsetrain.launch.cli import SweepReport, _failed_sweep_jobs, hydra_main, main  # noqa: F401

if __name__ == "__main__":
    main()
