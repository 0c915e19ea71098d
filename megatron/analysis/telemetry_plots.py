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

from megatron.analysis.plots import COLUMN_IN, drawn_or_problem, save_figure, style  # noqa: E402
from megatron.analysis.telemetry import site_operands  # noqa: E402

_LEGEND_LAYERS = 8     # more layers: a colour bar instead of a legend per panel
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
    fig, axes = plt.subplots(len(_OVER_ITERATIONS) + 1, 1, figsize=(COLUMN_IN, 11.5),
                             sharex=True, layout="constrained")
    handles = {}
    for ax, (metric, label, worst_is_max) in zip(axes, _OVER_ITERATIONS):
        rows = sites[sites["metric"] == metric]
        for scheme, mine in rows.groupby("scheme", sort=True):
            by_step = mine.groupby("step")["value"]
            worst = by_step.max() if worst_is_max else by_step.min()
            color = colors.get(scheme)
            (line,) = ax.plot(worst.index, worst.values, color=color, lw=1.6, marker=".",
                              label=scheme)
            handles.setdefault(scheme, line)
            mean = by_step.mean()
            ax.plot(mean.index, mean.values, color=color, lw=1.2, ls="--")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, lw=0.5)
    amax = sites[sites["metric"] == "amax"]
    ax = axes[-1]
    tops = []
    for scheme, mine in amax.groupby("scheme", sort=True):
        top = mine.groupby("step")["value"].max()
        tops.extend(v for v in top.values if v > 0)
        (line,) = ax.plot(top.index, top.values, color=colors.get(scheme), lw=1.4, marker=".",
                          label=scheme)
        handles.setdefault(scheme, line)
    # log only over more than a decade: within one, a log axis may show no labelled tick
    if ax.lines and tops and max(tops) > 10 * min(tops):
        ax.set_yscale("log")
    ax.set_ylabel("largest amax")
    ax.grid(alpha=0.3, lw=0.5)
    axes[-1].set_xlabel("iteration")
    styles = [plt.Line2D([], [], color="black", lw=1.6, marker=".", label="worst operand"),
              plt.Line2D([], [], color="black", lw=1.2, ls="--", label="mean over operands")]
    fig.legend(handles=list(handles.values()) + styles, loc="outside lower center", ncol=4,
               frameon=False)
    fig.suptitle("Quantization telemetry during training (worst operand and mean over operands)")
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
    metrics = (("sqnr_db", "lowest SQNR [dB]", False),
               ("flushed_pct", "highest flushed [%]", True))
    # One row per scheme; the panels of one metric (a column) share their vertical scale.
    fig, axes = plt.subplots(len(quantized), len(metrics),
                             figsize=(COLUMN_IN, 1.4 + 3.4 * len(quantized)), squeeze=False,
                             sharex=True, sharey="col", layout="constrained")
    cmap = plt.get_cmap("viridis")
    for row, scheme in enumerate(quantized):
        mine = sites[sites["scheme"] == scheme]
        layers = sorted(int(v) for v in mine["layer"].dropna().unique())
        for col, (metric, label, worst_is_max) in enumerate(metrics):
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
            ax.set_title(f"{scheme}: {label}")
            ax.grid(alpha=0.3, lw=0.5)
            if ax.lines and len(layers) <= _LEGEND_LAYERS:
                ax.legend()
        if len(layers) > _LEGEND_LAYERS:       # a legend that long would hide the lines
            bar = fig.colorbar(plt.cm.ScalarMappable(
                cmap=cmap, norm=plt.Normalize(layers[0], layers[-1])), ax=axes[row, :])
            bar.set_label("layer")
    for ax in axes[-1, :]:
        ax.set_xlabel("iteration")
    fig.suptitle("Worst operand of each layer against iteration")
    return {"file": save_figure(fig, outdir, "telemetry_layers.png"),
            "title": "Worst operand per layer against iteration",
            "caption": "Per quantized scheme (rows) and layer (lines, dark = first layer): "
                       "the lowest SQNR and the highest flushed-to-zero share among the layer's "
                       "quantized operands at each logged iteration; the panels of one metric "
                       "share their scale. The legend names the operand that is worst at the "
                       f"last iteration (above {_LEGEND_LAYERS} layers a colour bar gives the "
                       "layer instead)."}


def make_all(frame, outdir: str, colors: Dict[str, tuple]) -> List[dict]:
    os.makedirs(outdir, exist_ok=True)
    with style():
        figures = [drawn_or_problem(lambda: over_iterations(frame, outdir, colors),
                                    "over_iterations"),
                   drawn_or_problem(lambda: per_layer(frame, outdir), "per_layer")]
    return [f for f in figures if f is not None]

