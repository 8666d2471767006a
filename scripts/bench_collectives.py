#!/usr/bin/env python3
"""Same as ``python -m sparsetrain.benchmarks.collectives`` (the implementation; see its docstring):
kept so that ``scripts/bench_collectives.py ...`` command lines in the docs still work."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sparsetrain.benchmarks.collectives import *  # noqa: E402,F401,F403
from sparsetrain.benchmarks.collectives import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
