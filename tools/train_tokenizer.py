#!/usr/bin/env python
"""Train a small byte-level BPE tokenizer (and re-tokenize an embedded dataset with it).

    python tools/train_tokenizer.py --dataset wikipedia --vocab-size 8192

The logic lives in megatron/training/train_tokenizer.py (``python -m
megatron.training.train_tokenizer`` does the same where the package is installed).
"""

import os
import sys

# Runnable from a checkout without installing the package, from any working directory.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _CHECKOUT not in sys.path:
    sys.path.insert(0, _CHECKOUT)

from megatron.training.train_tokenizer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
