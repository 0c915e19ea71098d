"""Training step time of each quantization scheme relative to bf16 on llama-tiny (CPU).

All schemes run in this one process, one after the other, on the same model, data and
settings; the figure per scheme is the median step time after warm-up. Target: linear_mxfp8
within 1.5x of bf16.

    python benchmarks/train_step.py [--iters 8] [--warmup 2] [--schemes bf16 linear_mxfp8 ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import pretrain_gpt  # noqa: E402
from megatron.quantization.config import SCHEMES  # noqa: E402
from megatron.training.training import pretrain  # noqa: E402
from step_timer import StepTimer  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES,
                        help="Schemes to time (bf16 is always timed first as the reference).")
    parser.add_argument("--iters", type=int, default=8, help="Timed iterations per scheme.")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed first iterations.")
    parser.add_argument("--seq-length", type=int, default=256, help="Sequence length.")
    parser.add_argument("--bf16", action="store_true", help="Train in bf16 (default fp32).")
    args = parser.parse_args(argv)

    base = ["--model-preset", "llama-tiny", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "8192", "--seq-length", str(args.seq_length),
            "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
            "--train-iters", str(args.iters + args.warmup), "--log-interval", "1000",
            "--eval-interval", "100000", "--num-workers", "0"] + (["--bf16"] if args.bf16 else [])
    schemes = ["bf16"] + [s for s in args.schemes if s != "bf16"]
    results = {}
    for scheme in schemes:
        timer = StepTimer()
        pretrain(pretrain_gpt.forward_step, base + ["--quant-scheme", scheme], callbacks=[timer])
        results[scheme] = statistics.median(timer.after(args.warmup))
    ref = results["bf16"]
    print(f"\nllama-tiny, {args.seq_length} x 4 tokens per step, "
          f"{'bf16' if args.bf16 else 'fp32'} training, torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}")
    print(f"{'scheme':<18}{'median step ms':>16}{'x bf16':>9}")
    for scheme, t in results.items():
        print(f"{scheme:<18}{1000 * t:>16.1f}{t / ref:>9.2f}")
    if "linear_mxfp8" in results:
        ratio = results["linear_mxfp8"] / ref
        print(f"\nlinear_mxfp8 / bf16 = {ratio:.2f} (target <= 1.5): "
              f"{'met' if ratio <= 1.5 else 'NOT met'}")


if __name__ == "__main__":
    main()
