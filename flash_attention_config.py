#!/usr/bin/env python
"""Launch an attention-only quantization study (everything else stays in bf16).

    python flash_attention_config.py --list
    python flash_attention_config.py --model llama31-8b --dataset wikipedia \\
        --fa-quantization qk_pv_mxfp8 --dry-run

--fa-quantization qk_<fmt> quantizes the attention QK^T GEMMs (--quant-scheme FA_<fmt>),
qk_pv_<fmt> also the PV GEMMs (adds --attn-pv-quant <fmt>), and none trains in bf16. All other
flags are those of train_config.py; the commands come from the experiment matrix,
megatron/training/experiments/.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_config import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(fa=True))
