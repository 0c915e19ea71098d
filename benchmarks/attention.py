"""Peak memory and iteration time of attention paths on llama-tiny (CPU), side by side.

For each sequence length and scheme, two training runs of `pretrain_gpt.py` (mock data,
vocab 1024, micro-batch 1), each in its own process so that its peak RSS is its own:

    before  --quant-attention-impl unfused   full [b, heads, s, s] scores kept for backward
    after   (default)                        fused SDPA when attention is not quantized,
                                             chunked exact attention when it is

and prints peak RSS, median iteration time, the after/before ratios and whether the losses
agree. Targets (issue "Real scale"): RSS growth from seq 1024 to 4096 at most 0.6 GiB for bf16
and FA_linear_mxfp8 + PV; quantized attention at 4096 no slower than before; bf16 attention
at least 2x faster than before.

    python benchmarks/attention.py [--seq-lengths 1024 2048 4096] [--iters 3] [--bf16]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = os.path.join(REPO_ROOT, "pretrain_gpt.py")

SCHEMES = {
    "bf16": ["--quant-scheme", "bf16"],
    "FA_mxfp8": ["--quant-scheme", "FA_mxfp8"],
    "FA_linear_mxfp8+PV": ["--quant-scheme", "FA_linear_mxfp8", "--attn-pv-quant", "mxfp8"],
}
_ITER = re.compile(r"iteration\s+(\d+)/.*elapsed time per iteration \(ms\): ([\d.]+).*"
                   r"lm loss: (\S+)")


def run(seq: int, scheme_args, impl: str, iters: int, bf16: bool):
    """(peak RSS bytes, median ms per iteration after the first, [losses])."""
    cmd = [sys.executable, PRETRAIN, "--model-preset", "llama-tiny", "--mock-data",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
           "--seq-length", str(seq), "--max-position-embeddings", str(max(seq, 4096)),
           "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-3",
           "--train-iters", str(iters), "--log-interval", "1", "--eval-interval", "100000",
           "--eval-iters", "0", "--num-workers", "0", "--seed", "1234", *scheme_args]
    if impl == "unfused":
        cmd += ["--quant-attention-impl", "unfused"]
    if bf16:
        cmd.append("--bf16")
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=REPO_ROOT)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"run failed ({' '.join(cmd)}):\n{output[-3000:]}")
    rows = [(int(i), float(ms), float(loss)) for i, ms, loss in _ITER.findall(output)]
    times = [ms for i, ms, _ in rows if i > 1] or [rows[-1][1]]
    return usage.ru_maxrss * 1024, statistics.median(times), [loss for _, _, loss in rows]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[1024, 2048, 4096],
                        help="Sequence lengths (default: %(default)s).")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES),
                        help="Schemes (default: all).")
    parser.add_argument("--iters", type=int, default=3,
                        help="Training iterations per run; the first is not timed.")
    parser.add_argument("--bf16", action="store_true", help="Train in bf16 (default fp32).")
    args = parser.parse_args(argv)

    gib = 2 ** 30
    results = {}
    print(f"llama-tiny, mock data, vocab 1024, micro-batch 1, {args.iters} iterations, "
          f"{'bf16' if args.bf16 else 'fp32'}; one process per run")
    print(f"{'scheme':<20}{'seq':>6}{'RSS before':>12}{'RSS after':>11}{'ratio':>7}"
          f"{'ms before':>11}{'ms after':>10}{'speed-up':>10}  max |loss diff|")
    for scheme in args.schemes:
        for seq in args.seq_lengths:
            before = run(seq, SCHEMES[scheme], "unfused", args.iters, args.bf16)
            after = run(seq, SCHEMES[scheme], "auto", args.iters, args.bf16)
            results[(scheme, seq)] = (before, after)
            diff = max(abs(a - b) for a, b in zip(before[2], after[2]))
            print(f"{scheme:<20}{seq:>6}{before[0] / gib:>11.2f}G{after[0] / gib:>10.2f}G"
                  f"{after[0] / before[0]:>7.2f}{before[1]:>11.0f}{after[1]:>10.0f}"
                  f"{before[1] / after[1]:>9.2f}x  {diff:.2e}", flush=True)
    lo, hi = min(args.seq_lengths), max(args.seq_lengths)
    print(f"\nRSS growth from seq {lo} to {hi} (target <= 0.60 GiB after):")
    for scheme in args.schemes:
        growth = [(results[(scheme, hi)][i][0] - results[(scheme, lo)][i][0]) / gib
                  for i in (0, 1)]
        print(f"  {scheme:<20} before {growth[0]:+.2f} GiB, after {growth[1]:+.2f} GiB")


if __name__ == "__main__":
    main()
