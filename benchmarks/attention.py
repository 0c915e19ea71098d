"""Peak memory and iteration time of attention paths on llama-tiny (CPU), side by side.

Default mode: for each sequence length and scheme, two training runs of `pretrain_gpt.py`
(mock data, vocab 1024, micro-batch 1), each in its own process so that its peak RSS is its
own:

    before  --quant-attention-impl unfused   full [b, heads, s, s] scores kept for backward
    after   (default)                        fused SDPA when attention is not quantized,
                                             chunked exact attention when it is

and prints peak RSS, median iteration time, the after/before ratios and whether the losses
agree. Targets (issue "Real scale"): RSS growth from seq 1024 to 4096 at most 0.6 GiB for bf16
and FA_linear_mxfp8 + PV; quantized attention at 4096 no slower than before; bf16 attention
at least 2x faster than before.

`--vs-bf16`: the cost of quantized attention against bf16 at each sequence length (default
4096), three runs in one invocation:

    bf16                        fused SDPA
    FA_linear_mxfp8+PV previous K and V quantized in every chunk, every causal key block
                                computed, weights quantized at every micro-batch (the
                                attention and gemm switches; the formats are today's)
    FA_linear_mxfp8+PV          the default: each operand quantized once, the key blocks the
                                causal mask hides from a whole chunk left out

with ms per iteration, the ratio to bf16, and the attention GEMM FLOPs per iteration (the
skipped key blocks not counted) with the share of key blocks skipped. Target: the
quantized/bf16 ratio at most 0.7 times the previous one.

    python benchmarks/attention.py [--seq-lengths 1024 2048 4096] [--iters 3] [--bf16]
    python benchmarks/attention.py --vs-bf16 [--seq-lengths 4096] [--iters 3]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import warnings

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = os.path.join(REPO_ROOT, "pretrain_gpt.py")
sys.path.insert(0, REPO_ROOT)

from megatron.training.child_env import with_repository_path  # noqa: E402

SCHEMES = {
    "bf16": ["--quant-scheme", "bf16"],
    "FA_mxfp8": ["--quant-scheme", "FA_mxfp8"],
    "FA_linear_mxfp8+PV": ["--quant-scheme", "FA_linear_mxfp8", "--attn-pv-quant", "mxfp8"],
}
# Run in the child before pretrain_gpt.py: the chunked path and the linear layers as they were
# before each operand was quantized once (same results, more work): the run's resolved
# QuantConfig with operand sharing, causal block skipping and the weight cache off.
_PREVIOUS = ("from megatron.training import quant_arguments as qa; resolve = qa.resolve; "
             "qa.resolve = lambda *a, **k: (lambda q: q.replace(backend=q.backend.replace("
             "weight_cache=False, attention=q.backend.attention.replace(share_operands=False, "
             "skip_masked_blocks=False))))(resolve(*a, **k))")
# llama-tiny as these runs use it (micro-batch 1): attention shapes for the FLOP count.
TINY = dict(layers=4, heads=8, groups=2, head_dim=32)
_ITER = re.compile(r"iteration\s+(\d+)/.*elapsed time per iteration \(ms\): ([\d.]+).*"
                   r"lm loss: (\S+)")


def run(seq: int, scheme_args, impl: str, iters: int, bf16: bool, previous: bool = False):
    """(peak RSS bytes, median ms per iteration after the first, [losses]); `previous` runs
    the chunked path and the linear layers without the reuse of quantized operands."""
    entry = [PRETRAIN]
    if previous:
        entry = ["-c", f"{_PREVIOUS}; import runpy, sys; sys.argv = sys.argv[1:]; "
                 "runpy.run_path(sys.argv[0], run_name='__main__')", PRETRAIN]
    cmd = [sys.executable, *entry, "--model-preset", "llama-tiny", "--mock-data",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
           "--seq-length", str(seq), "--max-position-embeddings", str(max(seq, 4096)),
           "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-3",
           "--train-iters", str(iters), "--log-interval", "1", "--eval-interval", "100000",
           "--eval-iters", "0", "--num-workers", "0", "--seed", "1234", *scheme_args]
    if impl == "unfused":
        cmd += ["--quant-attention-impl", "unfused"]
    if bf16:
        cmd.append("--bf16")
    env = with_repository_path(REPO_ROOT)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=REPO_ROOT)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"run failed ({' '.join(cmd)}):\n{output[-3000:]}")
    rows = [(int(i), float(ms), float(loss)) for i, ms, loss in _ITER.findall(output)]
    times = [ms for i, ms, _ in rows if i > 1] or [rows[-1][1]]
    return usage.ru_maxrss * 1024, statistics.median(times), [loss for _, _, loss in rows]


def attention_flops(seq: int, skip: bool, layers: int = TINY["layers"],
                    heads: int = TINY["heads"], groups: int = TINY["groups"],
                    head_dim: int = TINY["head_dim"], batch: int = 1):
    """(GEMM FLOPs of the chunked attention in one training iteration, share of the
    (chunk, 32-key block) pairs skipped), causal self-attention of `seq` tokens.

    Per chunk of `rows` query rows that sees `keys` keys: forward QK^T 2*rows*d*keys and PV
    2*rows*seq*dv (PV and dS @ K reduce over all keys, zero-padded), backward the recomputed
    QK^T, dP and dV (2*rows*keys*dv each), dQ 2*rows*seq*d and dK 2*rows*d*keys."""
    with warnings.catch_warnings():      # megatron-core's notes on missing TE / Apex
        warnings.simplefilter("ignore")
        from megatron.quantization.attention import (
            CHUNK_BYTES, MX_ROWS, chunk_bounds, chunk_key_extent, default_chunk_rows)
    bg, rows = batch * groups, heads // groups * seq
    bounds = chunk_bounds(rows, default_chunk_rows(bg, seq, CHUNK_BYTES))
    extents = [chunk_key_extent(r0, r1, seq, seq) if skip else seq for r0, r1 in bounds]
    d = dv = head_dim
    flops = sum(2 * (r1 - r0) * (d * keys * 3 + seq * dv + keys * dv * 2 + seq * d)
                for (r0, r1), keys in zip(bounds, extents))
    blocks = -(-seq // MX_ROWS)
    skipped = sum(blocks - -(-keys // MX_ROWS) for keys in extents) / (blocks * len(bounds))
    return flops * bg * layers, skipped


def vs_bf16(args) -> None:
    """bf16 against FA_linear_mxfp8 + PV, previous and current, at each sequence length."""
    scheme = SCHEMES["FA_linear_mxfp8+PV"]
    print(f"llama-tiny, mock data, vocab 1024, micro-batch 1, {args.iters} iterations (the "
          f"first not timed), {'bf16' if args.bf16 else 'fp32'}; one process per run")
    print(f"{'run':<30}{'seq':>6}{'ms/iter':>10}{'x bf16':>8}{'attn GFLOP/iter':>17}"
          f"{'key blocks skipped':>20}  losses")
    for seq in args.seq_lengths:
        arms = [("bf16", SCHEMES["bf16"], False), ("FA_linear_mxfp8+PV previous", scheme, True),
                ("FA_linear_mxfp8+PV", scheme, False)]
        times = {}
        for name, scheme_args, previous in arms:
            _, ms, losses = run(seq, scheme_args, "auto", args.iters, args.bf16, previous)
            times[name] = ms
            flops = skipped = None
            if name != "bf16":
                flops, skipped = attention_flops(seq, skip=not previous)
            print(f"{name:<30}{seq:>6}{ms:>10.0f}{ms / times['bf16']:>7.2f}x"
                  f"{'' if flops is None else f'{flops / 1e9:.1f}':>17}"
                  f"{'' if skipped is None else f'{skipped:.1%}':>20}  "
                  f"{' '.join(f'{x:.6f}' for x in losses)}", flush=True)
        before = times["FA_linear_mxfp8+PV previous"] / times["bf16"]
        after = times["FA_linear_mxfp8+PV"] / times["bf16"]
        print(f"seq {seq}: quantized/bf16 {before:.2f}x previous -> {after:.2f}x now "
              f"({after / before:.2f} of the previous ratio; target <= 0.70)", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lengths", type=int, nargs="+",
                        help="Sequence lengths (default: 1024 2048 4096; 4096 with --vs-bf16).")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES),
                        help="Schemes (default: all).")
    parser.add_argument("--iters", type=int, default=3,
                        help="Training iterations per run; the first is not timed.")
    parser.add_argument("--bf16", action="store_true", help="Train in bf16 (default fp32).")
    parser.add_argument("--vs-bf16", action="store_true",
                        help="Time bf16 against FA_linear_mxfp8 + PV, previous and current "
                             "(default sequence length 4096).")
    args = parser.parse_args(argv)
    if args.vs_bf16:
        args.seq_lengths = args.seq_lengths or [4096]
        vs_bf16(args)
        return
    args.seq_lengths = args.seq_lengths or [1024, 2048, 4096]

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
