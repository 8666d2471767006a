"""``python -m sparsetrain.run [overrides]``: the command line, which lives in ``launch.cli``."""

from sparsetrain.launch.cli import main

if __name__ == "__main__":
    main()
