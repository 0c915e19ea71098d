"""What gradient-accumulation fusion changes in a bf16 run, side by side in one invocation.

1. Gradient error. llama-tiny in bf16 on mock data, one step of --micro-batches micro-batches:
   every linear weight's main_grad (before the optimizer step) against the float64 sum over
   the micro-batches of its wgrad GEMM's operands, recorded by an observer (the quantized
   operands for a quantized scheme), divided by the step's token count as megatron-core's
   per-token loss divides main_grad (a power of two here, exact). Relative L2 error per weight, median and max over the
   weights, fused (the default) and --no-gradient-accumulation-fusion (each micro-batch's
   dW rounded to bf16 before it is added).
2. Training. The demo's bf16 run (llama-tiny, seq 128, 2 micro-batches of 2, lr 3e-3) for
   --train-iters iterations on mock data, fused and unfused, and the same fused run with
   another seed: the loss difference fused - unfused per iteration next to the seed-to-seed
   difference, which says how large a trajectory change is by itself.

    python benchmarks/wgrad_accumulation.py [--micro-batches 8] [--train-iters 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import pretrain_gpt  # noqa: E402
from megatron.quantization.runtime import runtimes  # noqa: E402
from megatron.training import training  # noqa: E402

MODEL = ["--model-preset", "llama-tiny", "--seq-length", "128", "--micro-batch-size", "2",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8192", "--bf16",
         "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "3",
         "--lr-decay-style", "cosine", "--log-interval", "1000", "--eval-iters", "0",
         "--num-workers", "0"]
SCHEMES = {"bf16": ["--quant-scheme", "bf16"], "linear_mxfp8": ["--quant-scheme", "linear_mxfp8"]}


class WgradOperands(training.TrainingCallback):
    """Observer: the float64 sum of dY^T X of every linear site's wgrad GEMM (a training
    callback that watches the run's model)."""

    def __init__(self):
        self.exact = {}
        self._pending = {}
        self._runtimes = []

    def on_train_start(self, model_chunks, iteration: int) -> None:
        self._runtimes = runtimes(model_chunks)
        for runtime in self._runtimes:
            runtime.add_observer(self)

    def on_train_end(self, exit_reason: str) -> None:
        for runtime in self._runtimes:
            runtime.remove_observer(self)

    def bind(self, site):
        if site.kind != "linear":
            return None

        def observe(gemm, operand, hp, q, fmt, axis, **_):
            if gemm != "wgrad" or operand not in ("grad_output", "input"):
                return
            value = (hp if q is None else q).detach().double()
            self._pending[(site.name, operand)] = value
            if operand == "input":      # reported after grad_output
                g = self._pending.pop((site.name, "grad_output"))
                product = g.t() @ value
                self.exact[site.name] = self.exact.get(site.name, 0) + product
        return observe


def gradient_errors(scheme_flags, fused: bool, micro_batches: int):
    """[relative L2 error of main_grad] over the decoder's linear weights after one step."""
    observer = WgradOperands()
    grads = {}
    real_step = training.train_step

    def step_without_update(forward_step_func, data_iterator, ddp_model, optimizer, scheduler,
                            args):
        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        training.get_forward_backward_func()(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=[ddp_model],
            num_microbatches=args.num_micro_batches, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=False)
        for name, module in ddp_model.module.named_modules():
            if "decoder" in name and getattr(module, "quant_site", None) is not None:
                grads[module.quant_site.name] = module.weight.main_grad.double().clone()
        return 0.0, 0.0, False

    training.train_step = step_without_update
    try:
        argv = MODEL + scheme_flags + ["--train-iters", "1", "--lr-decay-iters", "10",
                                       "--global-batch-size", str(2 * micro_batches)]
        if not fused:
            argv.append("--no-gradient-accumulation-fusion")
        training.pretrain(pretrain_gpt.forward_step, argv, callbacks=[observer])
    finally:
        training.train_step = real_step
    tokens = 2 * micro_batches * 128        # every mock token counts in the per-token loss
    return [float((grads[n] - observer.exact[n] / tokens).norm()
                  / (observer.exact[n] / tokens).norm()) for n in grads]


def losses(extra, iters: int):
    result = training.pretrain(pretrain_gpt.forward_step, MODEL + SCHEMES["bf16"] + [
        "--train-iters", str(iters), "--global-batch-size", "4", "--lr-decay-iters", str(iters),
        *extra])
    return result.losses


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--micro-batches", type=int, default=8,
                   help="Micro-batches of the step whose gradients are measured.")
    p.add_argument("--train-iters", type=int, default=30, help="Iterations of the training runs.")
    args = p.parse_args(argv)

    rows = []
    for name, flags in SCHEMES.items():
        for fused in (True, False):
            errors = gradient_errors(flags, fused, args.micro_batches)
            rows.append((name, "fused" if fused else "unfused", statistics.median(errors),
                         max(errors), len(errors)))
    fused = losses([], args.train_iters)
    unfused = losses(["--no-gradient-accumulation-fusion"], args.train_iters)
    other_seed = losses(["--seed", "1235"], args.train_iters)

    print(f"\n1. linear weight gradients after one step of {args.micro_batches} micro-batches "
          "(llama-tiny, bf16): relative L2 error of main_grad against the float64 sum of the "
          "wgrad products")
    print(f"{'scheme':<14}{'accumulation':<14}{'median':>11}{'max':>11}{'weights':>9}")
    for name, mode, median, worst, count in rows:
        print(f"{name:<14}{mode:<14}{median:>11.2e}{worst:>11.2e}{count:>9}")
    print(f"\n2. training losses, bf16, {args.train_iters} iterations: |fused - unfused| "
          "against |seed 1234 - seed 1235| (fused)")
    its = sorted(fused)
    fusion_gap = [abs(fused[i] - unfused[i]) for i in its]
    seed_gap = [abs(fused[i] - other_seed[i]) for i in its]
    print(f"first iteration: fused {fused[its[0]]:.6f}, unfused {unfused[its[0]]:.6f}")
    print(f"last iteration:  fused {fused[its[-1]]:.6f}, unfused {unfused[its[-1]]:.6f}, "
          f"other seed {other_seed[its[-1]]:.6f}")
    print(f"mean |fused - unfused| {statistics.mean(fusion_gap):.5f} (max "
          f"{max(fusion_gap):.5f}); mean |seed - seed| {statistics.mean(seed_gap):.5f} (max "
          f"{max(seed_gap):.5f})")


if __name__ == "__main__":
    main()
