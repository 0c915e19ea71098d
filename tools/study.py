#!/usr/bin/env python
"""Multi-seed scheme study: train schemes x seeds at one budget, compare with paired 95% intervals.

    python tools/study.py --output-dir runs/study                # the default CPU study
    python tools/study.py --schemes bf16 FA_linear_mxfp4 --seeds 3 --tokens 2000000

The logic lives in megatron/training/study.py (``python -m megatron.training.study`` does the
same where the package is installed; pass --pretrain-script there).
"""

import os
import sys

# Runnable from a checkout without installing the package, from any working directory.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _CHECKOUT not in sys.path:
    sys.path.insert(0, _CHECKOUT)

from megatron.training.study import main  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a == "--pretrain-script" or a.startswith("--pretrain-script=") for a in argv):
        argv = ["--pretrain-script", os.path.join(_CHECKOUT, "pretrain_gpt.py")] + argv
    sys.exit(main(argv))
