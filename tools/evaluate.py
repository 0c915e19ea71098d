"""Evaluate one checkpoint under several quantization schemes on identical batches.

    python tools/evaluate.py (--load CKPT_DIR | --load-hf HF_DIR) --schemes S1 [S2 ...] \
        --output-dir OUT [--dump-logits FILE.npz] [--sweep sites] [--gradients] \
        [pretrain_gpt.py data and batch flags, e.g. --mock-data --seq-length 64 \
         --micro-batch-size 2 --eval-iters 4 --bf16]

See README.md ("Evaluating a checkpoint") and docs/evaluation.md (the outputs).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.evaluation.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
