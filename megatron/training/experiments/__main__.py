"""python -m megatron.training.experiments: see cli.py."""

import sys

from megatron.training.experiments.cli import main

if __name__ == "__main__":
    sys.exit(main())
