"""Figures of the quantization telemetry (TensorBoard `quant/...` scalars) against iteration.

- `telemetry_over_iterations.png`: per scheme, the worst operand and the mean over operands
  of SQNR, saturated % and flushed % (quantized operands), and the largest amax (all schemes);
- `telemetry_layers.png`: per quantized scheme and layer, the worst operand of that layer
  (lowest SQNR, highest flushed %) against iteration.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from megatron.analysis.plots import drawn_or_problem, save_figure  # noqa: E402
from megatron.analysis.telemetry import site_operands  # noqa: E402

# (metric, axis label, worst = max?)
_OVER_ITERATIONS = (
    ("sqnr_db", "SQNR [dB]", False),
    ("saturated_pct", "saturated [%]", True),
    ("flushed_pct", "flushed to zero [%]", True),
)


def _finite(frame):
    """Rows with a finite value (exact operands have SQNR inf, which is never the worst)."""
    return frame[frame["value"].map(math.isfinite)]


def over_iterations(frame, outdir: str, colors: Dict[str, tuple]) -> Optional[dict]:
    sites = _finite(site_operands(frame))
    if sites.empty:
        return None
    fig, axes = plt.subplots(len(_OVER_ITERATIONS) + 1, 1, figsize=(10, 11), sharex=True,
                             layout="constrained")
    for ax, (metric, label, worst_is_max) in zip(axes, _OVER_ITERATIONS):
        rows = sites[sites["metric"] == metric]
        for scheme, mine in rows.groupby("scheme", sort=True):
            by_step = mine.groupby("step")["value"]
            worst = by_step.max() if worst_is_max else by_step.min()
            color = colors.get(scheme)
            ax.plot(worst.index, worst.values, color=color, lw=1.6, marker=".",
                    label=f"{scheme}: worst operand")
            mean = by_step.mean()
            ax.plot(mean.index, mean.values, color=color, lw=1.2, ls="--",
                    label=f"{scheme}: mean over operands")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, lw=0.5)
        if ax.lines:
            ax.legend(fontsize=7, ncol=2)
    amax = sites[sites["metric"] == "amax"]
    ax = axes[-1]
    tops = []
    for scheme, mine in amax.groupby("scheme", sort=True):
        top = mine.groupby("step")["value"].max()
        tops.extend(v for v in top.values if v > 0)
        ax.plot(top.index, top.values, color=colors.get(scheme), lw=1.4, marker=".",
                label=scheme)
    if ax.lines:
        # log only over more than a decade: within one, a log axis may show no labelled tick
        if tops and max(tops) > 10 * min(tops):
            ax.set_yscale("log")
        ax.legend(fontsize=7, ncol=3)
    ax.set_ylabel("largest amax")
    ax.grid(alpha=0.3, lw=0.5)
    axes[-1].set_xlabel("iteration")
    fig.suptitle("Quantization telemetry during training (worst operand and mean over operands)",
                 fontsize=12)
    return {"file": save_figure(fig, outdir, "telemetry_over_iterations.png"),
            "title": "Quantization telemetry against iteration",
            "caption": "From the TensorBoard scalars training writes with "
                       "--quant-stats-interval: per scheme, the worst quantized operand over "
                       "all sites (solid: lowest SQNR, highest saturated and flushed shares) "
                       "and the mean over operands (dashed), at each logged iteration; "
                       "bottom, the largest amax of any operand (every scheme, bf16 too)."}


def _layer_worst(rows, metric: str, worst_is_max: bool):
    """Per (layer, step): the worst value and its operand label."""
    rows = rows[rows["metric"] == metric]
    if rows.empty:
        return rows
    pick = rows.groupby(["layer", "step"])["value"].idxmax() if worst_is_max else \
        rows.groupby(["layer", "step"])["value"].idxmin()
    return rows.loc[pick.values]


def per_layer(frame, outdir: str) -> Optional[dict]:
    sites = _finite(site_operands(frame))
    quantized = sorted(sites[sites["metric"] == "sqnr_db"]["scheme"].unique())
    if not quantized:
        return None
    metrics = (("sqnr_db", "lowest SQNR in the layer [dB]", False),
               ("flushed_pct", "highest flushed share in the layer [%]", True))
    fig, axes = plt.subplots(len(metrics), len(quantized),
                             figsize=(6.2 * len(quantized), 8.4), squeeze=False, sharex=True,
                             layout="constrained")
    cmap = plt.get_cmap("viridis")
    for col, scheme in enumerate(quantized):
        mine = sites[sites["scheme"] == scheme]
        layers = sorted(int(v) for v in mine["layer"].dropna().unique())
        for row, (metric, label, worst_is_max) in enumerate(metrics):
            ax = axes[row, col]
            worst = _layer_worst(mine, metric, worst_is_max)
            for i, layer in enumerate(layers):
                points = worst[worst["layer"] == layer].sort_values("step")
                if points.empty:
                    continue
                last = points.iloc[-1]
                color = cmap(i / max(1, len(layers) - 1))
                ax.plot(points["step"], points["value"], color=color, lw=1.3, marker=".",
                        label=f"L{layer} (last: {last['module']} {last['gemm']}."
                              f"{last['operand']})")
            ax.set_title(f"{scheme}", fontsize=10)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3, lw=0.5)
            if ax.lines:
                ax.legend(fontsize=6.5, ncol=1 if len(layers) <= 8 else 2)
        axes[-1, col].set_xlabel("iteration")
    fig.suptitle("Worst operand of each layer against iteration", fontsize=12)
    return {"file": save_figure(fig, outdir, "telemetry_layers.png"),
            "title": "Worst operand per layer against iteration",
            "caption": "Per quantized scheme (columns) and layer (lines, dark = first layer): "
                       "the lowest SQNR and the highest flushed-to-zero share among the layer's "
                       "quantized operands at each logged iteration; the legend names the "
                       "operand that is worst at the last iteration."}


def make_all(frame, outdir: str, colors: Dict[str, tuple]) -> List[dict]:
    os.makedirs(outdir, exist_ok=True)
    figures = [drawn_or_problem(lambda: over_iterations(frame, outdir, colors),
                                "over_iterations"),
               drawn_or_problem(lambda: per_layer(frame, outdir), "per_layer")]
    return [f for f in figures if f is not None]

