#!/usr/bin/env python
"""Build the embedded real-text datasets (wikipedia, dolma) from installed packages, offline.

    python tools/build_corpus.py --dataset all --workers 2

The logic lives in megatron/training/build_corpus.py (``python -m
megatron.training.build_corpus`` does the same where the package is installed).
"""

import os
import sys

# Runnable from a checkout without installing the package, from any working directory.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _CHECKOUT not in sys.path:
    sys.path.insert(0, _CHECKOUT)

from megatron.training.build_corpus import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
