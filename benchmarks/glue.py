"""The glue around the quantization kernels, counted on any machine: the aten ops that one
training step runs outside the Triton kernel launches, beyond the bf16 step's, per quantized
operand.

On a GPU every such op is at least one more kernel launch and one more pass over memory (a
copy, a 0-d tensor scale, a noise tensor, a transform), which is what makes a simulated recipe
cost more than its GEMMs. The count is the same on any device, because the glue is the same
aten ops; so it is measured here under Triton's interpreter (TRITON_INTERPRET=1, set by this
script before triton is imported) with --quant-kernels triton, on a 2-layer llama-tiny
(bf16, seq 64, micro-batch 2). Ops that the interpreter itself runs inside a launch (copying
the arguments to the host and back) are not glue and are not counted.

    python benchmarks/glue.py                         # every configuration
    python benchmarks/glue.py --configs bf16 linear_nvfp4

Per configuration: the aten ops of the measured step (the second; the first warms caches),
how many of them copy a tensor's data (aten::copy_, _to_copy, clone), the kernel launches,
the quantized operands (calls of gemm.quantize_operand), and per operand the ops and copies
beyond the bf16 step. Target: at
most 6 ops and no copy per quantized operand. A configuration the kernels do not cover is
reported with the reason.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import pretrain_gpt  # noqa: E402
from megatron.quantization import gemm  # noqa: E402
from megatron.training.training import TrainingCallback, pretrain  # noqa: E402

CONFIGS = {
    "bf16": [],
    "linear_mxfp8": ["--quant-scheme", "linear_mxfp8"],
    "linear_mxfp4": ["--quant-scheme", "linear_mxfp4"],
    "linear_nvfp4": ["--quant-scheme", "linear_nvfp4"],
    "linear_hifp8": ["--quant-scheme", "linear_hifp8"],
    "recipe_nvfp4": ["--quant-recipe", "nvfp4"],
    "recipe_mxfp4_rht_sr": ["--quant-recipe", "mxfp4_rht_sr"],
    "fp8_tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "fp8_delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
    "fp8_blockwise": ["--fp8-format", "hybrid", "--fp8-recipe", "blockwise"],
}
MODEL = ["--model-preset", "llama-tiny", "--num-layers", "2", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "2", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "512", "--mock-data", "--bf16", "--lr", "1e-4",
         "--log-interval", "1000", "--eval-iters", "0", "--num-workers", "0",
         "--quant-kernels", "triton", "--train-iters", "2"]
TARGET_OPS, TARGET_COPIES = 6, 0
COPY_OPS = ("aten.copy_", "aten._to_copy", "aten.clone")


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while `on`, except inside a kernel launch."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.on = False
        self.in_launch = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on and not self.in_launch:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class _MeasuredStep(TrainingCallback):
    """Switches the counter on for one iteration."""

    def __init__(self, counter: _OpCounter, iteration: int):
        self.counter, self.iteration = counter, iteration

    def on_iteration_start(self, iteration):
        self.counter.on = iteration == self.iteration

    def on_iteration_end(self, iteration):
        self.counter.on = False


def count_step(flags):
    """(op counts, kernel launches, quantized operands) of the second training step."""
    import triton.runtime.interpreter as interpreter

    counter = _OpCounter()
    tally = Counter()
    launch, quantize_operand = interpreter.GridExecutor.__call__, gemm.quantize_operand

    def counted_launch(self, *args, **kwargs):
        tally["launches"] += counter.on
        counter.in_launch += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            counter.in_launch -= 1

    def counted_operand(*args, **kwargs):
        tally["operands"] += counter.on and not counter.in_launch
        return quantize_operand(*args, **kwargs)

    interpreter.GridExecutor.__call__ = counted_launch
    gemm.quantize_operand = counted_operand
    try:
        with counter:
            pretrain(pretrain_gpt.forward_step, MODEL + flags,
                     callbacks=[_MeasuredStep(counter, 2)])
    finally:
        interpreter.GridExecutor.__call__ = launch
        gemm.quantize_operand = quantize_operand
    return counter.ops, tally["launches"], tally["operands"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                   help="Configurations to count (bf16 is always counted as the baseline).")
    p.add_argument("--top", type=int, default=0,
                   help="Also list the N most frequent ops of each configuration.")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    names = ["bf16"] + [c for c in args.configs if c != "bf16"]
    rows = {}
    for name in names:
        try:
            rows[name] = count_step(CONFIGS[name])
        except (ValueError, RuntimeError) as error:     # a configuration the kernels refuse
            rows[name] = str(error).splitlines()[0][:200]
        print(f"[glue] {name}: counted", flush=True)
    base_ops, _, _ = rows["bf16"]
    print("\naten ops of one training step outside the kernel launches (llama-tiny, 2 layers, "
          "bf16, seq 64, micro-batch 2; TRITON_INTERPRET=1, --quant-kernels triton)")
    print(f"{'configuration':<22}{'ops':>8}{'copies':>7}{'launches':>10}{'operands':>10}"
          f"{'ops/operand':>13}{'copies/operand':>16}  target")
    for name, row in rows.items():
        if isinstance(row, str):
            print(f"{name:<22}not covered: {row}")
            continue
        ops, launches, operands = row
        total, copies = sum(ops.values()), sum(ops[op] for op in COPY_OPS)
        if operands:
            extra = (total - sum(base_ops.values())) / operands
            extra_copies = (copies - sum(base_ops[op] for op in COPY_OPS)) / operands
            met = extra <= TARGET_OPS and extra_copies <= TARGET_COPIES
            tail = (f"{extra:>13.1f}{extra_copies:>16.1f}  <= {TARGET_OPS} ops, "
                    f"{TARGET_COPIES} copies: {'met' if met else 'NOT met'}")
        else:
            tail = f"{'-':>13}{'-':>16}"
        print(f"{name:<22}{total:>8}{copies:>7}{launches:>10}{operands:>10}{tail}")
        if args.top:
            extra_ops = ops - base_ops
            print("    " + ", ".join(f"{op} {n}" for op, n in extra_ops.most_common(args.top)))


if __name__ == "__main__":
    main()
