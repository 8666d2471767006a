#!/usr/bin/env python3
"""Same as ``python -m sparsetrain.launch.netcluster`` (the implementation): kept so that the
command lines in the docs and in older scripts still work."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sparsetrain.launch.netcluster import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
