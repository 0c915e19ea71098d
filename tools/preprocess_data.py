#!/usr/bin/env python
"""Tokenize a JSON-lines corpus into Megatron's .bin/.idx files.

The logic lives in megatron/training/preprocess_data.py (``python -m
megatron.training.preprocess_data`` does the same where the package is installed). Example::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --append-eod --workers 2        # -> data/corpus_text_document.{bin,idx}
"""

import os
import sys

# Runnable from a checkout without installing the package, from any working directory.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _CHECKOUT not in sys.path:
    sys.path.insert(0, _CHECKOUT)

from megatron.training.preprocess_data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
