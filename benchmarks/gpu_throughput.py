"""Training throughput of the simulated schemes against bf16, side by side in one process:
tokens/s, ms per iteration and peak device memory per quantization mode, so a first hour on a
GPU node says whether the simulation is within the targets (linear schemes <= 1.3x a bf16
step, quantized attention <= 2x). Modes (--quant-kernels):

    eager    plain PyTorch quantization and the chunked attention path
    auto     the default: on CUDA with triton installed, the fused Triton kernels (QDQ, and
             quantized attention where the kernel covers the scheme); eager elsewhere
    compile  fake quantization through torch.compile

    python benchmarks/gpu_throughput.py                    # GPU: llama32-1b, 2 layers, seq 8192
    python benchmarks/gpu_throughput.py --tiny             # any machine: llama-tiny, seq 256

Mock data; every run trains --warmup + --iters iterations from the same initialisation, and
the figure is the median step time after warm-up. Peak memory is torch.cuda's
max_memory_allocated of the run (0 on a CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

import pretrain_gpt  # noqa: E402
from megatron.training.training import pretrain  # noqa: E402
from step_timer import StepTimer  # noqa: E402

SCHEMES = (("bf16", []), ("linear_mxfp8", ["--quant-scheme", "linear_mxfp8"]),
           ("FA_linear_mxfp8", ["--quant-scheme", "FA_linear_mxfp8", "--attn-pv-quant", "mxfp8"]),
           ("recipe_nvfp4", ["--quant-recipe", "nvfp4"]))
TARGETS = {"linear_mxfp8": 1.3, "recipe_nvfp4": 1.3, "FA_linear_mxfp8": 2.0}
GPU_MODEL = ["--model-preset", "llama32-1b", "--num-layers", "2", "--seq-length", "8192",
             "--micro-batch-size", "1", "--global-batch-size", "1"]
TINY_MODEL = ["--model-preset", "llama-tiny", "--seq-length", "256", "--micro-batch-size", "4",
              "--global-batch-size", "4", "--tokenizer-type", "NullTokenizer",
              "--vocab-size", "8191"]


MODES = ("eager", "auto", "compile")


def run(model, scheme_flags, mode: str, iters: int, warmup: int):
    """(median seconds per step, peak bytes) of one training."""
    argv = [*model, *scheme_flags, "--mock-data", "--bf16", "--lr", "1e-4",
            "--train-iters", str(iters + warmup), "--log-interval", "1000", "--eval-iters", "0",
            "--num-workers", "0", "--quant-kernels", mode]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    timer = StepTimer()
    pretrain(pretrain_gpt.forward_step, argv, callbacks=[timer])
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    return statistics.median(timer.after(warmup)), peak


def table(results, tokens):
    """Rows (scheme, mode, tokens/s, ms, ratio to the bf16 run, peak GiB, target)."""
    base = next(value for (name, _), value in results.items() if name == "bf16")
    rows = []
    for (name, mode), (seconds, peak) in results.items():
        ratio = seconds / base[0]
        target = TARGETS.get(name)
        verdict = "" if target is None else f"<= {target}x: {'met' if ratio <= target else 'NOT met'}"
        rows.append((name, mode, tokens / seconds, seconds * 1e3, ratio, peak / 2 ** 30, verdict))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true",
                   help="llama-tiny at seq 256 (default on a machine without CUDA).")
    p.add_argument("--iters", type=int, default=10, help="Timed iterations per run.")
    p.add_argument("--warmup", type=int, default=3,
                   help="Untimed first iterations (compilation happens here).")
    p.add_argument("--schemes", nargs="+", default=[s for s, _ in SCHEMES],
                   choices=[s for s, _ in SCHEMES], help="Schemes to time.")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                   help="Quantization modes (--quant-kernels) to time each scheme in.")
    args = p.parse_args(argv)
    tiny = args.tiny or not torch.cuda.is_available()
    model = TINY_MODEL if tiny else GPU_MODEL
    tokens = 4 * 256 if tiny else 8192
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    results = {}
    for name, flags in SCHEMES:
        if name not in args.schemes:
            continue
        for mode in args.modes:
            if name == "bf16" and mode != args.modes[0]:
                continue        # nothing to quantize: one bf16 run is the baseline of all modes
            results[(name, mode)] = run(model, flags, mode, args.iters, args.warmup)
            print(f"[bench] {name} {mode}: {results[(name, mode)][0] * 1e3:.1f} ms/iteration",
                  flush=True)
    print(f"\n{'llama-tiny, seq 256' if tiny else 'llama32-1b (2 layers), seq 8192'}, "
          f"{tokens} tokens per iteration, bf16 training, {device}")
    print(f"{'scheme':<18}{'mode':<9}{'tokens/s':>10}{'ms/it':>9}{'x bf16':>8}{'peak GiB':>10}"
          f"  target")
    for name, mode, rate, ms, ratio, gib, verdict in table(results, tokens):
        print(f"{name:<18}{mode:<9}{rate:>10.0f}{ms:>9.1f}{ratio:>8.2f}{gib:>10.2f}  {verdict}")


if __name__ == "__main__":
    main()
