#!/usr/bin/env python
"""Analyse tensor captures and loss logs of low-precision training runs.

    python tools/visualization/tensor_visualizer.py --tensor-dir enhanced_tensor_logs \
        --output-dir reports/analysis --workers 2 \
        --loss-logs bf16=runs/bf16/train.log FA_linear_mxfp8=runs/mxfp8/tensorboard

writes statistics.json, statistics.txt, records.csv, figures/*.png and report.html into the
output directory (see docs/analysis.md). Exit code 0 when anything was produced, 1 (with a
one-line error) when nothing could be read.
"""

from __future__ import annotations

import sys
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parents[2])
if _REPO_ROOT not in sys.path:  # runnable as a script from anywhere
    sys.path.insert(0, _REPO_ROOT)

from megatron.analysis.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
