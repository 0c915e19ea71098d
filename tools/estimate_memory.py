#!/usr/bin/env python
"""Per-GPU memory estimate of a training layout, before launching it.

    python tools/estimate_memory.py --world-size 8 --model-preset llama31-8b --seq-length 8192 \
        --micro-batch-size 1 --bf16 --tensor-model-parallel-size 2 --sequence-parallel \
        --use-distributed-optimizer --quant-scheme FA_linear_mxfp8

Takes pretrain_gpt.py's flags plus --world-size and --gpu-memory-gib (default 80). The logic
lives in megatron/training/memory_estimate/ (``python -m megatron.training.memory_estimate``
does the same where the package is installed).
"""

import os
import sys

# Runnable from a checkout without installing the package, from any working directory.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _CHECKOUT not in sys.path:
    sys.path.insert(0, _CHECKOUT)

from megatron.training.memory_estimate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
