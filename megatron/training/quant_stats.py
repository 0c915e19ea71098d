"""--quant-stats-interval: quantization telemetry of the running training, as scalars.

Every N iterations the QuantTelemetry observer (megatron/tensor_capture/telemetry.py)
measures every GEMM operand during the step; after it, one reduction over all ranks gives
per-(site, operand) metrics, written as `quant/<site>/<gemm>.<operand>/<metric>` (e.g.
`quant/L2.linear_fc2/fprop.input/flushed_pct`) plus `quant/worst/saturated_pct` and
`quant/worst/flushed_pct` (and, when NVFP4 operands were measured,
`quant/worst/block_scale_zero_pct` and `quant/worst/block_scale_subnormal_pct`), and
summarised in the next log line by the worst site.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

from megatron.quantization.runtime import runtimes
from megatron.tensor_capture.callback import collect_sites
from megatron.tensor_capture.telemetry import QuantTelemetry, site_label
from megatron.training.wandb_writer import wandb_problem

Results = Dict[Tuple[str, str], Dict[str, float]]


def stats_interval_warnings(args) -> List[str]:
    """Lines when --quant-stats-interval is on but no iteration of this run is measured, or
    its per-operand metrics have nowhere to go (neither TensorBoard nor W&B)."""
    interval, last = args.quant_stats_interval, args.train_iters
    lines = []
    if interval and last is not None and interval > last:
        lines.append(f"warning: --quant-stats-interval {interval} is beyond --train-iters "
                     f"{last}: no iteration is measured (valid: 1..{last})")
    wandb_on = getattr(args, "wandb_project", None) and wandb_problem(args) is None
    if interval and not getattr(args, "tensorboard_dir", None) and not wandb_on:
        lines.append(f"warning: --quant-stats-interval {interval}: the per-operand metrics are "
                     "only written to TensorBoard/W&B, and neither is on; the log line keeps "
                     "only the summary (give --tensorboard-dir DIR to keep them)")
    return lines


# Metrics whose largest value over the operands is tagged quant/worst/<metric> (the NVFP4
# block-scale shares only where NVFP4 operands were measured).
WORST_METRICS = ("saturated_pct", "flushed_pct", "block_scale_zero_pct",
                 "block_scale_subnormal_pct")


def scalar_tags(results: Results) -> Dict[str, float]:
    """{tag: value} for TensorBoard / W&B, worst-case tags included."""
    tags = {f"quant/{site}/{operand}/{metric}": value
            for (site, operand), values in sorted(results.items())
            for metric, value in values.items()}
    for metric in WORST_METRICS:
        worst = worst_operand(results, metric)
        if worst is not None:
            tags[f"quant/worst/{metric}"] = worst[1]
    return tags



def worst_operand(results: Results, metric: str) -> Optional[Tuple[str, float]]:
    """('site operand', value) with the largest `metric`, or None if nothing has it."""
    candidates = [(f"{site} {operand}", values[metric])
                  for (site, operand), values in results.items() if metric in values]
    return max(candidates, key=lambda c: c[1]) if candidates else None


def summary(results: Results, iteration: int) -> str:
    """The log-line part: the worst saturated and flushed operands of a measured iteration
    (and the NVFP4 operands with the largest shares of zero / subnormal block scales)."""
    parts = []
    for metric, label in (("saturated_pct", "saturated"), ("flushed_pct", "flushed"),
                          ("block_scale_zero_pct", "zero-scale blocks"),
                          ("block_scale_subnormal_pct", "subnormal-scale blocks")):
        worst = worst_operand(results, metric)
        if worst is not None:
            parts.append(f"{label} {worst[1]:.3g}% ({worst[0]})")
    if not parts:
        return f"quant stats (it {iteration}): nothing quantized"
    return f"quant worst (it {iteration}): " + ", ".join(parts)


class QuantStatsCallback:
    """A training callback (see training.TrainingCallback) measuring every `interval`-th
    iteration and handing {tag: value} and the summary to `emit(iteration, tags, summary)`."""

    def __init__(self, interval: int, emit: Callable[[int, Dict[str, float], str], None],
                 ep_rank: int = 0):
        self.interval = interval
        self.emit = emit
        self.ep_rank = ep_rank
        self.telemetry: Optional[QuantTelemetry] = None
        self.runtimes = []

    def on_train_start(self, model_chunks, iteration: int) -> None:
        labels = {name: site_label(info.layer, info.module, info.kind)
                  for name, info in collect_sites(model_chunks, self.ep_rank).items()}
        self.telemetry = QuantTelemetry(labels)
        self.runtimes = runtimes(model_chunks)
        for runtime in self.runtimes:
            runtime.add_observer(self.telemetry)

    def on_iteration_start(self, iteration: int) -> None:
        if iteration % self.interval == 0:
            self.telemetry.begin()

    def on_micro_batch_start(self, iteration: int, micro_batch: int) -> None:
        pass

    def on_iteration_end(self, iteration: int) -> Optional[str]:
        if self.telemetry is not None and self.telemetry.active:
            results = self.telemetry.reduce()
            self.emit(iteration, scalar_tags(results), summary(results, iteration))
        return None

    def on_train_end(self, exit_reason: str) -> None:
        if self.telemetry is not None:
            for runtime in self.runtimes:
                runtime.remove_observer(self.telemetry)
            self.telemetry = None
