"""python -m megatron.training.memory_estimate <flags>: the per-GPU memory estimate."""

import sys

from megatron.training.memory_estimate.report import main

if __name__ == "__main__":
    sys.exit(main())
