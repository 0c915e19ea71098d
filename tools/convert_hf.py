#!/usr/bin/env python
"""HuggingFace Llama 3.x models to checkpoints of this project and back.

    python tools/convert_hf.py import HF_DIR CKPT_DIR [--tensor-model-parallel-size T] \
        [--pipeline-model-parallel-size P]
    python tools/convert_hf.py export CKPT_DIR HF_DIR

The logic lives in megatron/training/hf_llama.py (``python -m megatron.training.hf_llama``
does the same where the package is installed); the tensor and config mapping in
megatron/training/hf_llama_mapping.py.
"""

import os
import sys

# Runnable from a checkout without installing the package, from any working directory.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _CHECKOUT not in sys.path:
    sys.path.insert(0, _CHECKOUT)

from megatron.training.hf_llama import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
