"""Overhead of --quant-stats-interval on llama-tiny (CPU): step time with telemetry every N
iterations against none, measured side by side in one process.

Runs alternate (off, on, off, on, ...) on the same model, data and settings so that drifts of
the machine's speed hit both; each run's figure is its MEAN step time after warm-up (a median
would hide the measured iterations). Two figures of the overhead: mean(on) / mean(off) - 1
across runs, and, within the telemetry runs, (measured step / unmeasured step - 1) / N, which
compares neighbouring iterations and so is much less exposed to the machine's drifts (on a
shared 2-core VM, runs of the same setting differ by 10-20%). Target: <= 5% at interval 10.

    python benchmarks/telemetry.py [--interval 10] [--iters 40] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import pretrain_gpt  # noqa: E402
from megatron.training.training import pretrain  # noqa: E402
from step_timer import StepTimer  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", default="FA_linear_mxfp8", help="Quantization scheme.")
    parser.add_argument("--interval", type=int, default=10, help="--quant-stats-interval.")
    parser.add_argument("--iters", type=int, default=40, help="Timed iterations per run.")
    parser.add_argument("--warmup", type=int, default=3, help="Untimed first iterations.")
    parser.add_argument("--repeats", type=int, default=2, help="Runs of each setting.")
    parser.add_argument("--seq-length", type=int, default=256, help="Tokens per sample.")
    parser.add_argument("--vocab-size", type=int, default=8192,
                        help="8192: the BPE of the CPU study path (the output layer is cheap, "
                             "the worst case for the overhead); 128256: the Llama 3 vocabulary.")
    args = parser.parse_args(argv)

    total = args.warmup + args.iters
    base = ["--model-preset", "llama-tiny", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(args.vocab_size), "--seq-length", str(args.seq_length), "--bf16",
            "--micro-batch-size", "4", "--global-batch-size", "4", "--lr", "1e-3",
            "--train-iters", str(total), "--log-interval", "1000", "--eval-iters", "0",
            "--num-workers", "0", "--quant-scheme", args.scheme]
    means = {"off": [], "on": []}
    measured, plain = [], []
    for _ in range(args.repeats):
        for setting in ("off", "on"):
            flags = ["--quant-stats-interval", str(args.interval)] if setting == "on" else []
            timer = StepTimer()
            pretrain(pretrain_gpt.forward_step, base + flags, callbacks=[timer])
            timed = {it: t for it, t in timer.times.items() if it > args.warmup}
            means[setting].append(statistics.mean(timed.values()))
            if setting == "on":
                run_measured = [t for it, t in timed.items() if it % args.interval == 0]
                run_plain = [t for it, t in timed.items() if it % args.interval]
                measured += run_measured
                plain += run_plain
                print(f"telemetry run: unmeasured steps {1000 * statistics.mean(run_plain):.1f} "
                      f"ms, measured steps "
                      f"{1000 * statistics.mean(run_measured or [float('nan')]):.1f} ms")
    off, on = statistics.mean(means["off"]), statistics.mean(means["on"])
    print(f"\nllama-tiny, {args.scheme}, bf16, vocabulary {args.vocab_size}, "
          f"{args.seq_length} x 4 tokens per step, torch "
          f"threads {os.environ.get('OMP_NUM_THREADS', 'default')}, {args.repeats} runs of "
          f"{args.iters} timed iterations per setting")
    print(f"mean step, telemetry off            : {1000 * off:8.1f} ms "
          f"(runs: {', '.join(f'{1000 * m:.1f}' for m in means['off'])})")
    print(f"mean step, every {args.interval:<3d} iterations    : {1000 * on:8.1f} ms "
          f"(runs: {', '.join(f'{1000 * m:.1f}' for m in means['on'])})")
    across = 100.0 * (on / off - 1.0)
    print(f"overhead across runs (noisy)        : {across:+.1f}%")
    if not (measured and plain):
        print("no measured iteration was timed: raise --iters above --interval")
        return
    ratio = statistics.mean(measured) / statistics.mean(plain)
    within = 100.0 * (ratio - 1.0) / args.interval
    print(f"a measured step / an unmeasured one : {ratio:.2f}x "
          f"({len(measured)} measured, {len(plain)} unmeasured steps)")
    print(f"overhead at interval {args.interval} (within runs): {within:+.1f}% "
          f"(target <= 5%): {'met' if within <= 5.0 else 'NOT met'}")


if __name__ == "__main__":
    main()
