#!/usr/bin/env python3
"""Same as ``python -m sparsetrain.benchmarks.step_device`` (the implementation; see its docstring):
kept so that ``scripts/bench_step_device.py ...`` command lines in the docs still work."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sparsetrain.benchmarks.step_device import *  # noqa: E402,F401,F403
from sparsetrain.benchmarks.step_device import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
