"""Figures of the analysis: one function per figure, each returning its description.

Every function takes the merged per-group `Stats` (and options), writes one PNG into `outdir`
and returns `{"file", "title", "caption"}` (or None when there is nothing to draw). Colours
are fixed per scheme across figures. Uses matplotlib's Agg backend (no display needed).

Legibility: report.html shows every figure at its own pixel size, so a figure of a fixed
layout is COLUMN_IN wide (the report's text column at DPI) and no text is smaller than
SMALL_PT (`style()` sets the sizes; `smallest_text_pt` measures them). Panels and figures that
are compared share their scales: the per-scheme error heat maps use one colour scale per
metric (`heat_limits`), panels of one quantity share their axes. HiF8 panels read the values
with the run's HiF8 scaling (megatron.analysis.hifp8).
"""

from __future__ import annotations

import math
import os
import re
from typing import Dict, List, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.text import Text  # noqa: E402
from matplotlib.ticker import FixedFormatter, MaxNLocator  # noqa: E402

from megatron.analysis import forking  # noqa: E402
from megatron.analysis.accumulators import (  # noqa: E402
    E4M3_EXP_MAX, E4M3_EXP_MIN, SCALE_MIN, Stats)
from megatron.analysis.binning import bin_edges_log2  # noqa: E402
from megatron.analysis.comparison import Common, common_tensors, tensor_id  # noqa: E402
from megatron.analysis.hifp8 import (  # noqa: E402
    SIDED_REGIONS, TENSOR, UNSCALED, cast_views, run_scaled, scheme_scalings,
    sided_counts_from_hist, zones_log2)
from megatron.analysis.naming import layer_label  # noqa: E402
from megatron.analysis.ranges import format_ranges, known_formats  # noqa: E402
from megatron.analysis.statistics import merge_by, tensor_class  # noqa: E402
from megatron.analysis.workers import GroupKey  # noqa: E402

DPI = 110
COLUMN_IN = 10.4          # the report's text column (about 1150 px at DPI)
FONT_PT = 10.0            # titles, axis and tick labels
SMALL_PT = 9.0            # the smallest text of any figure: legends, cell numbers, dense labels
_RC = {"font.size": FONT_PT, "axes.titlesize": FONT_PT + 1, "axes.labelsize": FONT_PT,
       "xtick.labelsize": FONT_PT, "ytick.labelsize": FONT_PT, "legend.fontsize": SMALL_PT,
       "legend.title_fontsize": SMALL_PT, "figure.titlesize": FONT_PT + 2}
_EDGES = bin_edges_log2()
_WIDTHS = np.diff(_EDGES)
_CLASSES = ("activation", "weight", "gradient")
_MANTISSA_COLORS = {3: "#b7e4c7", 2: "#d8f3dc", 1: "#fff3b0", 0: "#ffd6a5", None: "#e9ecef"}
_REGION_COLORS = ["#adb5bd", "#f4a261", "#e9c46a", "#a7c957", "#2a9d8f", "#6a994e",
                  "#bc6c25", "#d62828"]


def _format_order(names) -> List[str]:
    order = known_formats()
    return sorted(names, key=lambda f: (order.index(f) if f in order else len(order), f))


_MODULE_ORDER = ("linear_qkv", "linear_q_proj", "linear_kv_down_proj", "linear_kv_up_proj",
                 "core_attention", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")
_TENSOR_ORDER = ("input", "weight", "query", "key", "probs", "value", "grad_output",
                 "grad_scores", "weight_dgrad", "key_dgrad", "value_dgrad", "input_wgrad",
                 "query_wgrad", "probs_wgrad", "grad_output_wgrad", "grad_scores_wgrad")


def _rank(value: str, order) -> tuple:
    return (order.index(value) if value in order else len(order), value)


def style():
    """The font sizes of every analysis figure, as a matplotlib rc context."""
    return plt.rc_context(_RC)


def smallest_text_pt(fig) -> float:
    """The smallest font size (pt) of the visible, non-empty texts of `fig`, tick labels
    included (inf without text)."""
    fig.canvas.draw()
    sizes = [t.get_fontsize() for t in fig.findobj(Text)
             if t.get_visible() and t.get_text().strip() and t.get_figure() is not None]
    return min(sizes, default=math.inf)


def _layer_ticks(ax, layers, output: str = "output") -> None:
    """Layer tick labels on the x axis (L1, L2, ..., `output` for layer 0), thinned to at most
    16 so that they never overlap."""
    shown = layers[::max(1, math.ceil(len(layers) / 16))]
    ax.set_xticks(shown, [output if layer == 0 else f"L{layer}" for layer in shown])


def scheme_colors(quant_schemes: Sequence[str]) -> Dict[str, tuple]:
    cmap = plt.get_cmap("tab10")
    return {scheme: cmap(i % 10) for i, scheme in enumerate(sorted(quant_schemes))}


def mpl_escape(text: str) -> str:
    """`text` as matplotlib shows it literally: run and scheme names are user input, and a
    `$` in one would start mathtext (and fail to render). Idempotent."""
    return re.sub(r"(?<!\\)\$", r"\\$", text)


def escape_figure_text(fig) -> None:
    """Every text of `fig` (titles, labels, legends, annotations, fixed tick labels) through
    mpl_escape: the one place labels are escaped, for every figure of the analysis."""
    for artist in fig.findobj(Text):
        text = artist.get_text()
        if "$" in text:
            artist.set_text(mpl_escape(text))
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            formatter = axis.get_major_formatter()
            if isinstance(formatter, FixedFormatter):
                formatter.seq = [mpl_escape(str(t)) for t in formatter.seq]


def save_figure(fig, outdir: str, name: str) -> str:
    # Minor ticks cost most of the drawing time (log axes) and add little here.
    for ax in fig.axes:
        ax.minorticks_off()
    path = os.path.join(outdir, name)
    try:
        escape_figure_text(fig)
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)
    return name


def drawn_or_problem(draw, what: str):
    """draw() (a figure dict or None); a figure that fails to draw costs only itself: it
    returns {"problem": one line} instead, for the caller's problem list."""
    try:
        return draw()
    except Exception as exc:  # noqa: BLE001 - any drawing error costs this figure only
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return {"problem": f"figure {what} could not be drawn ({type(exc).__name__}: "
                           f"{reason}); the report goes on without it"}


def _density(hist: np.ndarray):
    """Fraction of binned values per binade (bins have unequal log2 widths)."""
    total = hist.sum()
    return hist / total / _WIDTHS if total else hist.astype(float)


def _nonzero_span(hists: List[np.ndarray], pad: float = 1.0):
    lo, hi = math.inf, -math.inf
    for h in hists:
        if h is None or not h.any():
            continue
        nz = np.flatnonzero(h)
        lo = min(lo, _EDGES[nz[0]])
        hi = max(hi, _EDGES[nz[-1] + 1])
    if not math.isfinite(lo):
        return None
    return lo - pad, hi + pad


def _step(ax, hist, **kwargs):
    """Density as a step line over the populated bins only (empty bins left as gaps)."""
    nz = np.flatnonzero(hist)
    lo, hi = nz[0], nz[-1] + 1
    y = _density(hist)[lo:hi]
    ax.stairs(np.where(y > 0, y, np.nan), _EDGES[lo:hi + 1], **kwargs)


def _label(op: str) -> str:
    return {"forward": "fwd", "backward": "bwd"}.get(op, op)


# -- value distributions ----------------------------------------------------------------------

def _mx_zones(ax, fmt, xlim):
    """Shade flush / subnormal / saturation zones of an MX element format (scaled domain)."""
    r = format_ranges(fmt)
    lo_sub, lo_norm, hi = (math.log2(r.min_subnormal), math.log2(r.min_normal),
                           math.log2(r.max_normal))
    ax.axvspan(xlim[0], lo_sub - 1, color="#ced4da", alpha=0.6, lw=0)
    ax.axvspan(lo_sub - 1, lo_norm, color="#ffe8a3", alpha=0.7, lw=0)
    ax.axvspan(hi, xlim[1], color="#ffb3b3", alpha=0.6, lw=0)
    ax.axvline(hi, color="#c1121f", lw=1, ls="--")
    ax.axvline(lo_norm, color="#b08900", lw=1, ls=":")
    return [Patch(color="#ced4da", label=f"flushed to 0 (< {_pow2(r.min_subnormal / 2)})"),
            Patch(color="#ffe8a3", label=f"element subnormals (< {_pow2(r.min_normal)})"),
            Patch(color="#ffb3b3", label=f"saturated (> {_pow2(r.max_normal)})")]


def _pow2(value: float) -> str:
    """2^k for powers of two, the plain number otherwise."""
    exp = math.log2(value)
    return f"2^{int(exp)}" if exp == int(exp) and abs(exp) > 2 else f"{value:g}"


def _hifp8_zones(ax, xlim, alpha=0.55):
    handles = []
    for lo, hi, label, bits in zones_log2():
        lo, hi = max(lo, xlim[0]), min(hi, xlim[1])
        if hi <= lo:
            continue
        color = {"underflow": "#ced4da", "overflow": "#ffb3b3"}.get(label,
                                                                     _MANTISSA_COLORS[bits])
        ax.axvspan(lo, hi, color=color, alpha=alpha, lw=0)
    for bits, text in ((3, "3-bit mantissa"), (2, "2-bit mantissa"), (1, "1-bit mantissa"),
                       (0, "denormal (2^-22..2^-16)")):
        handles.append(Patch(color=_MANTISSA_COLORS[bits], label=text))
    handles += [Patch(color="#ced4da", label="underflow (< 2^-23)"),
                Patch(color="#ffb3b3", label="overflow (>= 40960)")]
    return handles


def _hifp8_seen(stats: Stats):
    """The |x| histogram of a HiF8 group as the grid saw it (hp * 2^k for records scaled per
    tensor; the values as they are otherwise)."""
    return stats.grid_hist if stats.grid_hist is not None else stats.hist


def value_distributions(groups: Dict[GroupKey, Stats], outdir: str, colors) -> Optional[dict]:
    """Per format: histogram of log2|x| (MX: relative to the block scale; HiF8: as its grid saw
    the values, i.e. with the run's per-tensor scale) with range zones."""
    fmts = _format_order({k.format for k in groups if k.format != "none"})
    if not fmts:
        return None
    merged = merge_by(groups, lambda k: (k.format, k.quant_scheme, k.operation),
                      lambda k: k.format != "none")
    ncols = min(2, len(fmts))
    nrows = math.ceil(len(fmts) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(COLUMN_IN, 5.0 * nrows), squeeze=False,
                             sharey=True, layout="constrained")
    hifp8_scaled = False
    for ax, fmt in zip(axes.flat, fmts):
        r = format_ranges(fmt)
        mx = r.kind == "mx"
        hifp8 = r.kind == "hifp8"
        hists = {(scheme, op): (s.scaled_hist if mx else _hifp8_seen(s) if hifp8 else s.hist)
                 for (f, scheme, op), s in merged.items() if f == fmt}
        scaled = hifp8 and any(s.hifp8_scaled for (f, _, _), s in merged.items() if f == fmt)
        hifp8_scaled |= scaled
        span = _nonzero_span(list(hists.values())) or (-30, 20)
        if mx:
            xlim = (max(span[0], math.log2(r.min_subnormal) - 12), math.log2(r.max_normal) + 2)
            zone_handles = _mx_zones(ax, fmt, xlim)
            ax.set_xlabel("log2(|x| / block scale 2^e)   [binades]")
        else:
            xlim = (max(span[0], -30), max(span[1], 17))
            zone_handles = _hifp8_zones(ax, xlim) if hifp8 else []
            ax.set_xlabel("log2(|x| * 2^k)   [binades]" if scaled else "log2|x|   [binades]")
        line_handles = []
        for (scheme, op), hist in sorted(hists.items()):
            if hist is None or not hist.any():
                continue
            _step(ax, hist, color=colors[scheme], lw=1.6, ls="-" if op == "forward" else "--")
            line_handles.append(plt.Line2D([], [], color=colors[scheme],
                                           ls="-" if op == "forward" else "--",
                                           label=f"{scheme} ({_label(op)})"))
        ax.set_xlim(*xlim)
        ax.set_yscale("log")
        ax.set_ylim(bottom=1e-7)
        if ax in axes[:, 0]:                  # the rows share their vertical scale
            ax.set_ylabel("fraction of nonzero values per binade")
        kind = "MX element domain" if mx else {
            "hifp8": ("HiF8 grid, per-tensor scale 2^k" if scaled else "HiF8, per element"),
            "nvfp4": "absolute; E4M3 block + FP32 tensor scales",
            "fp8": "absolute; FP32 scales"}.get(r.kind, r.kind)
        ax.set_title(f"{fmt} ({kind})")
        ax.grid(alpha=0.3, lw=0.5)
        # Below the axes: the curves' upper-left corner is where data usually is.
        ax.legend(handles=line_handles + zone_handles, loc="upper center",
                  bbox_to_anchor=(0.5, -0.16), ncol=2 if ncols > 1 else 3, frameon=False)
    for ax in list(axes.flat)[len(fmts):]:
        ax.set_visible(False)
    fig.suptitle("Value distributions of quantized operands, with each format's range")
    caption = ("Histogram of log2 magnitudes of the high-precision operands of each "
               "format (solid: forward, dashed: backward; the panels share the vertical "
               "scale). MX panels are in the element domain (|x| divided by the block's "
               "shared scale), where grey marks values flushed to zero, yellow the element "
               "subnormals and red the saturated values; ")
    kinds = {format_ranges(fmt).kind for fmt in fmts}
    if hifp8_scaled:
        caption += ("the HiF8 panel shows the operands as HiF8's grid saw them, each record "
                    "times its per-tensor scale 2^k (--hifp8-scaling tensor), shaded by "
                    "mantissa width of the tapered format; ")
    elif "hifp8" in kinds:
        caption += ("HiF8 panels are absolute (no per-tensor scaling in these runs), shaded "
                    "by mantissa width of the tapered format; ")
    if kinds & {"nvfp4", "fp8"}:
        caption += ("NVFP4 and FP8 panels are absolute (their scales are in the NVFP4 "
                    "block-scale figure and the scales table).")
    caption = caption.rstrip("; ") + "."
    return {"file": save_figure(fig, outdir, "value_distributions.png"),
            "title": "Value distributions per format", "caption": caption}


def absolute_distributions(groups, outdir: str, colors,
                           hifp8_scalings: Optional[Dict[str, str]] = None) -> Optional[dict]:
    """log2|x| per tensor class for every scheme, with HiF8's tapered regions for scale when
    the HiF8 runs did not scale per tensor (with a per-tensor scale the regions move with each
    tensor's amax, so no absolute shading applies)."""
    merged = merge_by(groups, lambda k: (tensor_class(k.tensor_name), k.quant_scheme, k.operation))
    present = [c for c in _CLASSES if any(k[0] == c for k in merged)]
    if not present:
        return None
    scalings = scheme_scalings(groups) if hifp8_scalings is None else hifp8_scalings
    # HiF8's regions only where a run used HiF8, and only without per-tensor scaling.
    shade = bool(scalings) and UNSCALED in cast_views(scalings)
    span = _nonzero_span([s.hist for s in merged.values()]) or (-30, 20)
    xlim = (max(span[0], -60), min(max(span[1], 0), 130))
    fig, axes = plt.subplots(len(present), 1, figsize=(COLUMN_IN, 1.9 + 2.7 * len(present)),
                             squeeze=False, sharex=True, sharey=True, layout="constrained")
    handles: Dict[str, object] = {}
    zone_handles = []
    for ax, cls in zip(axes.flat, present):
        hists = {(scheme, op): s.hist for (c, scheme, op), s in merged.items() if c == cls}
        if shade:
            zone_handles = _hifp8_zones(ax, xlim, alpha=0.35)
        for (scheme, op), hist in sorted(hists.items()):
            if hist is None or not hist.any():
                continue
            _step(ax, hist, color=colors[scheme], lw=1.4, ls="-" if op == "forward" else "--")
            handles.setdefault(scheme, plt.Line2D([], [], color=colors[scheme], lw=2,
                                                  label=scheme))
        ax.set_xlim(*xlim)
        ax.set_yscale("log")
        ax.set_ylim(bottom=1e-7)
        ax.set_title(f"{cls} tensors", loc="left")
        ax.set_ylabel("fraction per binade")
        ax.grid(alpha=0.3, lw=0.5)
    axes.flat[-1].set_xlabel("log2|x|   [binades]")
    styles = [plt.Line2D([], [], color="black", ls="-", label="forward"),
              plt.Line2D([], [], color="black", ls="--", label="backward")]
    fig.legend(handles=list(handles.values()) + styles + zone_handles,
               loc="outside lower center", ncol=4, frameon=False,
               title="background: HiF8 regions (unscaled)" if shade else None)
    title = "Magnitudes of the tensors every scheme captured"
    background = ""                 # without HiF8 runs, nothing to say about HiF8
    if shade:
        title += " (background: HiF8 regions)"
        background = ("The background (legend below) shows where HiF8 without scaling "
                      "keeps 3, 2 or 1 mantissa bits.")
    elif scalings:
        background = ("No HiF8 regions are shaded: the HiF8 runs scaled each operand by its "
                      "own 2^k (--hifp8-scaling tensor), which moves the regions with the "
                      "tensor's amax; the HiF8 precision regions figure reads the values as "
                      "the grid saw them.")
    fig.suptitle(title)
    return {"file": save_figure(fig, outdir, "absolute_distributions.png"),
            "title": "Absolute magnitude distributions",
            "caption": "log2|x| of the captured tensors by class (activations incl. attention "
                       "operands, weights, gradients), per quant type; solid forward, dashed "
                       "backward; the panels share both axes. Only tensors (layer, module, "
                       "tensor name) that every scheme captured are drawn, so the curves "
                       "compare the same tensors. " + background}


# -- error heat maps --------------------------------------------------------------------------

_HEAT_METRICS = (
    ("sqnr_db", "SQNR [dB]", "viridis", False),
    ("mse", "log10 MSE", "magma_r", True),
    ("saturated_fraction", "saturated [%]", "Reds", False),
    ("flushed_fraction", "flushed to zero [%]", "Blues", False),
)


# Cell size of the heat maps (inches) and the room taken by labels and colour bars. A map
# that would be wider than _HEAT_MAX_IN gets narrower cells, whose numbers are left out when
# they no longer fit at HEAT_FONT_PT (never drawn smaller).
_HEAT_CELL_IN = (0.55, 0.32)
_HEAT_MARGIN_IN = 3.0
_HEAT_MAX_IN = 24.0
HEAT_FONT_PT = SMALL_PT


def _cell_text(metric: str, value: float) -> str:
    """Short cell labels: whole dB, one decimal of log10 MSE, percentages with one decimal
    (one significant digit below 0.1%)."""
    if not np.isfinite(value):
        return ""
    if metric == "sqnr_db":
        return f"{value:.0f}"
    if metric == "mse":
        return f"{round(value, 1) + 0.0:.1f}"      # + 0.0: no "-0.0"
    if value == 0:
        return "0"
    if value < 0.1:
        return f"{value:.1g}"
    return f"{value:.1f}" if round(value, 1) < 10 else f"{value:.0f}"   # 9.96: "10", not "10.0"


def _cells_fit(texts, cell_pt) -> bool:
    """Whether every label fits its cell at HEAT_FONT_PT (digits are ~0.6 em wide)."""
    longest = max((len(t) for row in texts for t in row), default=0)
    return (longest * 0.6 * HEAT_FONT_PT + 4 <= cell_pt[0]
            and HEAT_FONT_PT * 1.3 <= cell_pt[1])


def ink(rgba) -> str:
    """Black or white text, whichever reads on a cell of this colour."""
    r, g, b = rgba[:3]
    return "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black"


def short_module(module: str) -> str:
    """A module name short enough for a heat-map label: `linear_fc1` -> `fc1`."""
    return module.replace("linear_", "").replace("core_attention", "attn")


def _column_label(module: str, tensor: str) -> str:
    return f"{short_module(module)}: {tensor}"


def _heat_grid(groups, quant_scheme: str):
    """(layers, columns, {metric: layers x columns values}) of one scheme's quantized operands
    as the heat maps show them (dB, log10 MSE, percentages); None without any."""
    mine = {k: v for k, v in groups.items()
            if k.quant_scheme == quant_scheme and k.format != "none"}
    if not mine:
        return None
    merged = merge_by(mine, lambda k: (k.layer, k.operation, k.module, k.tensor_name))
    layers = sorted({k[0] for k in merged})
    columns = sorted({(k[1], k[2], k[3]) for k in merged},
                     key=lambda c: (0 if c[0] == "forward" else 1, _rank(c[1], _MODULE_ORDER),
                                    _rank(c[2], _TENSOR_ORDER)))
    grid = {name: np.full((len(layers), len(columns)), np.nan) for name, *_ in _HEAT_METRICS}
    for (layer, op, module, tensor), stats in merged.items():
        q = stats.metrics()["quantization"] or {}
        i, j = layers.index(layer), columns.index((op, module, tensor))
        for name, _, _, log in _HEAT_METRICS:
            v = q.get(name)
            if v is None:
                continue
            if name == "sqnr_db" and math.isinf(v):
                v = np.nan
            elif log:
                v = math.log10(v) if v > 0 else np.nan
            elif name.endswith("fraction"):
                v = 100.0 * v
            grid[name][i, j] = v
    return layers, columns, grid


def heat_limits(groups) -> Dict[str, tuple]:
    """One (vmin, vmax) per heat-map metric over every scheme's heat map, so that a colour
    means the same value in all of them (percentages start at 0)."""
    grids = [_heat_grid(groups, scheme) for scheme in sorted({k.quant_scheme for k in groups})]
    limits = {}
    for name, *_ in _HEAT_METRICS:
        values = [g[2][name][np.isfinite(g[2][name])] for g in grids if g is not None]
        values = np.concatenate(values) if values else np.empty(0)
        low = 0.0 if name.endswith("fraction") or not values.size else float(values.min())
        high = float(values.max()) if values.size else 1.0
        limits[name] = (low, high if high > low else low + 1.0)
    return limits


def error_heatmap(groups, outdir: str, quant_scheme: str,
                  limits: Optional[Dict[str, tuple]] = None) -> Optional[dict]:
    """Layers x quantized operands, for SQNR, MSE, saturated and flushed fractions, on the
    colour scales every scheme's heat map shares (`limits`, default `heat_limits(groups)`)."""
    heat = _heat_grid(groups, quant_scheme)
    if heat is None:
        return None
    layers, columns, grid = heat
    limits = limits or heat_limits(groups)
    width = min(_HEAT_MAX_IN, max(COLUMN_IN, _HEAT_CELL_IN[0] * len(columns) + _HEAT_MARGIN_IN))
    panel_h = 0.9 + _HEAT_CELL_IN[1] * len(layers)
    fig, axes = plt.subplots(len(_HEAT_METRICS), 1, figsize=(width, panel_h * 4 + 2.2),
                             sharex=True, layout="constrained")
    cell_pt = ((width - _HEAT_MARGIN_IN) * 72 / len(columns), _HEAT_CELL_IN[1] * 72)
    split = sum(1 for c in columns if c[0] == "forward")
    for ax, (name, label, cmap, _) in zip(axes, _HEAT_METRICS):
        data = grid[name]
        vmin, vmax = limits[name]
        im = ax.imshow(data, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax,
                       interpolation="nearest")
        fig.colorbar(im, ax=ax, label=label, pad=0.01, fraction=0.04)
        ax.set_yticks(range(len(layers)),     # rows are tall enough for every label
                      [layer_label(layer) for layer in layers])
        ax.set_ylabel("layer")
        ax.set_title(label)
        if 0 < split < len(columns):
            ax.axvline(split - 0.5, color="black", lw=2.5)
        texts = [[_cell_text(name, v) for v in row] for row in data]
        if _cells_fit(texts, cell_pt):
            for i in range(data.shape[0]):
                for j in range(data.shape[1]):
                    if texts[i][j]:
                        ax.text(j, i, texts[i][j], ha="center", va="center",
                                fontsize=HEAT_FONT_PT, color=ink(im.cmap(im.norm(data[i, j]))))
    axes[-1].set_xticks(range(len(columns)),
                        [f"{_label(op)} · {_column_label(m, t)}" for op, m, t in columns],
                        rotation=60, ha="right", fontsize=SMALL_PT)
    axes[-1].set_xlabel("quantized operand (forward | backward, separated by the black line)")
    fig.suptitle(f"{quant_scheme}: quantization error per layer and operand "
                 "(colour scales shared by every scheme)")
    safe = quant_scheme.replace("/", "_")
    return {"file": save_figure(fig, outdir, f"error_heatmap_{safe}.png"),
            "title": f"Quantization error heat map: {quant_scheme}",
            "caption": "Per layer (rows) and quantized operand (columns; forward operands left "
                       "of the black line, backward right): SQNR in dB (higher is better), "
                       "log10 of the mean squared error, and the percentages of elements "
                       "saturated at the format's largest value and of nonzero elements "
                       "flushed to zero. Every scheme's heat map uses the same colour scale "
                       "per metric, so equal colours are equal values across schemes. Blank: "
                       "not captured or exact. Cell numbers are rounded (whole dB, one decimal "
                       "of log10 MSE and of percentages, one significant digit under 0.1%) "
                       f"and drawn at {HEAT_FONT_PT:g} pt, or left out when the cells are too "
                       "small to hold them at that size."}


# -- MX scale exponents -----------------------------------------------------------------------

def scale_exponents(groups, outdir: str, colors) -> Optional[dict]:
    """Histogram of MX shared (E8M0) exponents per tensor class, per scheme and operation."""
    merged = merge_by(groups, lambda k: (tensor_class(k.tensor_name), k.quant_scheme, k.format,
                                         k.operation),
                      lambda k: format_ranges(k.format).kind == "mx")
    merged = {k: v for k, v in merged.items() if v.scale_hist is not None and v.scale_hist.any()}
    if not merged:
        return None
    present = [c for c in _CLASSES if any(k[0] == c for k in merged)]
    fig, axes = plt.subplots(1, len(present), figsize=(COLUMN_IN, 4.8), squeeze=False,
                             sharey=True, layout="constrained")
    exps = np.arange(SCALE_MIN, SCALE_MIN + 255)
    edges = np.append(exps, exps[-1] + 1) - 0.5
    handles = {}
    top = 0.0                                 # the panels share their vertical scale
    for ax, cls in zip(axes.flat, present):
        mine = {k: v for k, v in merged.items() if k[0] == cls}
        lo, hi = exponent_span([s.scale_hist for s in mine.values()])
        for (_, scheme, fmt, op), s in mine.items():
            h = s.scale_hist
            ls = "-" if op == "forward" else "--"
            label = f"{scheme} {fmt} ({_label(op)})"
            if s.nan_blocks:
                label += f", {s.nan_blocks} NaN blocks"
            spike = int(h[0])
            if spike and lo > SCALE_MIN:
                label += f", {spike:,} blocks at -127 (off scale)"
            share = h / h.sum()
            top = max(top, float(share[lo - SCALE_MIN:hi - SCALE_MIN + 1].max()))
            line = ax.stairs(share, edges, color=colors[scheme], lw=1.5, ls=ls, label=label)
            handles.setdefault(label, line)
        ax.set_xlim(lo - 2, hi + 2)
        for limit in (-127, 127):
            if lo - 2 <= limit <= hi + 2:
                line = ax.axvline(limit, color="#c1121f", ls=":", lw=1,
                                  label=f"E8M0 limit {limit:+d} (clamped)")
                handles.setdefault(line.get_label(), line)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
        ax.set_title(f"{cls} operands")
        ax.set_xlabel("block exponent e (scale 2^e)")
        ax.grid(alpha=0.3, lw=0.5)
    axes[0, 0].set_ylim(0, top * 1.08 or 1.0)
    axes[0, 0].set_ylabel("fraction of blocks")
    fig.legend(handles=list(handles.values()), loc="outside lower center",
               ncol=min(2, len(handles)), frameon=False)
    fig.suptitle("MX shared-exponent (E8M0 scale) histograms")
    return {"file": save_figure(fig, outdir, "mx_scale_exponents.png"),
            "title": "MX scale exponents",
            "caption": "Distribution of the per-block shared exponents (unbiased E8M0) of MX "
                       "operands, recomputed from the captured tensors with the run's scale "
                       "rule; solid forward, dashed backward; the panels share the vertical "
                       "scale. A wide spread means a large "
                       "dynamic range across blocks. Blocks at -127 (all zeros, e.g. masked "
                       "attention gradients, or tiny values) are left off the axis, which "
                       "spans the other exponents; the legend gives their count."}


def exponent_span(hists) -> tuple:
    """(lowest, highest) exponent to draw: the populated range without the -127 spike of
    all-zero blocks (unless nothing else is populated)."""
    total = np.sum(hists, axis=0)
    nz = np.flatnonzero(total[1:]) + 1          # bin 0 is e = -127
    if nz.size == 0:
        return SCALE_MIN, SCALE_MIN
    return SCALE_MIN + int(nz[0]), SCALE_MIN + int(nz[-1])


# -- NVFP4 block scales -----------------------------------------------------------------------

_BLOCK_SHARE_COLORS = (("zero", "#d62828"), ("subnormal", "#f4a261"), ("normal", "#2a9d8f"))


def nvfp4_block_scales(groups, outdir: str) -> Optional[dict]:
    """NVFP4's E4M3 block scales per scheme, tensor class and pass: the shares of blocks whose
    scale is zero, subnormal (below 2^-6) or normal, and the histogram of the nonzero scales'
    exponents."""
    merged = merge_by(groups, lambda k: (k.quant_scheme, tensor_class(k.tensor_name),
                                         k.operation),
                      lambda k: format_ranges(k.format).kind == "nvfp4")
    rows = []
    for (scheme, cls, op), st in merged.items():
        if not st.nvfp4_blocks:
            continue
        total = float(st.nvfp4_blocks)
        shares = {"zero": st.nvfp4_zero_blocks / total,
                  "subnormal": st.nvfp4_subnormal_blocks / total}
        shares["normal"] = max(0.0, 1.0 - shares["zero"] - shares["subnormal"])
        rows.append((f"{scheme} · {cls} ({_label(op)})", shares, st.nvfp4_scale_hist,
                     int(st.nvfp4_blocks), (_rank(cls, _CLASSES), op != "forward", scheme)))
    if not rows:
        return None
    rows.sort(key=lambda r: (r[4][2], r[4][0], r[4][1]))
    fig, (bars, hists) = plt.subplots(2, 1, figsize=(COLUMN_IN, 5.6 + 0.5 * len(rows)),
                                      layout="constrained",
                                      gridspec_kw={"height_ratios": [1.0 + 0.5 * len(rows),
                                                                     3.6]})
    y = np.arange(len(rows))
    left = np.zeros(len(rows))
    for name, color in _BLOCK_SHARE_COLORS:
        share = np.array([r[1][name] for r in rows])
        bars.barh(y, 100 * share, left=100 * left, color=color, edgecolor="white", lw=0.4,
                  label={"zero": "scale 0 (block -> 0)", "subnormal": "subnormal (< 2^-6)",
                         "normal": "normal"}[name])
        for j, v in enumerate(share):
            if v >= 0.08:
                bars.text(100 * (left[j] + v / 2), j, f"{100 * v:.3g}%", ha="center",
                          va="center", fontsize=SMALL_PT)
        left += share

    def row_label(r):
        small = ", ".join(f"{name} {100 * r[1][name]:.2g}%" for name in ("zero", "subnormal")
                          if r[1][name] > 0)
        return f"{r[0]}\n{r[3]:,} blocks" + (f": {small}" if small else "")

    bars.set_yticks(y, [row_label(r) for r in rows], fontsize=SMALL_PT)
    bars.invert_yaxis()
    bars.set_xlim(0, 100)
    bars.set_xlabel("share of blocks [%]")
    bars.legend(ncol=3, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    exps = np.arange(E4M3_EXP_MIN, E4M3_EXP_MAX + 1)
    hists.axvspan(E4M3_EXP_MIN - 0.5, -6.5, color="#ffe8a3", alpha=0.7, lw=0,
                  label="E4M3 subnormal scales")
    cmap = plt.get_cmap("tab10")
    for i, (label, _, hist, _, _) in enumerate(rows):
        if hist is None or not hist.any():
            continue
        hists.stairs(hist / hist.sum(), np.append(exps, exps[-1] + 1) - 0.5, color=cmap(i % 10),
                     lw=1.5, ls="-" if "(fwd)" in label else "--", label=label)
    hists.set_xlim(E4M3_EXP_MIN - 0.5, E4M3_EXP_MAX + 0.5)
    hists.xaxis.set_major_locator(MaxNLocator(integer=True))
    hists.set_xlabel("floor(log2 s) of the nonzero E4M3 block scales s (448 = 1.75 * 2^8)")
    hists.set_ylabel("fraction of nonzero-scale blocks")
    hists.grid(alpha=0.3, lw=0.5)
    hists.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.suptitle("NVFP4 block scales (E4M3): zero and subnormal shares, exponent spread")
    return {"file": save_figure(fig, outdir, "nvfp4_block_scales.png"),
            "title": "NVFP4 block scales",
            "caption": "Top: share of the NVFP4 blocks (16 elements, or 16x16 weight tiles) "
                       "whose E4M3 scale rounded to 0 (the whole block became 0; all-zero "
                       "blocks count here too), is subnormal (below 2^-6: few significant "
                       "bits, and elements may saturate at 6 times the scale) or normal, per "
                       "quant type, tensor class and pass. Below: distribution of the "
                       "exponents of the nonzero block scales; the per-tensor float32 scale "
                       "2688 / amax puts the block with the tensor's amax at 448 (exponent 8), "
                       "so the spread shows how far blocks sit below the tensor's largest."}


# -- HiFP8 regions ----------------------------------------------------------------------------

def hifp8_regions(groups, outdir: str,
                  hifp8_scalings: Optional[Dict[str, str]] = None) -> Optional[dict]:
    """Stacked bars: share of values in each HiF8 precision region, per tensor class.

    Rows: the HiF8-quantized operands of every HiFP8 scheme (those scaled per tensor twice:
    as the grid saw them, hp * 2^k, and unscaled), then the same tensors of one reference
    scheme (bf16 if captured) as they would land if cast to HiF8 with the HiF8 runs' scaling:
    unscaled, and/or with a per-tensor scale from each record's amax (`cast_views`).
    """
    scalings = scheme_scalings(groups) if hifp8_scalings is None else hifp8_scalings
    casts = cast_views(scalings)
    hif8_ids = {tensor_id(k) for k in groups if k.format == "hifp8"}
    merged = merge_by(groups, lambda k: (k.quant_scheme, tensor_class(k.tensor_name), k.operation,
                                         k.format == "hifp8"),
                      lambda k: not hif8_ids or tensor_id(k) in hif8_ids)
    merged = {k: v for k, v in merged.items() if v.hist is not None and v.hist.any()}
    hif8_schemes = sorted({k[0] for k in merged if k[3]})
    if not hif8_schemes:
        return None             # no run used HiF8: its regions would answer nothing asked
    others = sorted({k[0] for k in merged if not k[3]} - set(hif8_schemes))
    reference = "bf16" if "bf16" in others else (others[0] if others else None)
    rows = []
    for (scheme, cls, op, is_hif8), s in merged.items():
        head = f"{scheme} · {cls} ({_label(op)})"
        if is_hif8 and s.hifp8_scaled:
            views = [(f"{head} · grid saw x·2^k", s.grid_hist),
                     (f"{head} · unscaled", s.hist)]
        elif is_hif8:
            views = [(f"{head} · HiF8 operands", s.hist)]
        elif scheme == reference:
            views = [(f"{head} · if cast, x·2^k" if cast == TENSOR else f"{head} · if cast",
                      s.cast_hist if cast == TENSOR else s.hist) for cast in reversed(casts)]
        else:
            continue
        for order, (label, hist) in enumerate(views):
            if hist is None or not hist.any():
                continue
            counts = sided_counts_from_hist(hist)
            rows.append((label, counts / counts.sum(), is_hif8, _rank(cls, _CLASSES), op, order))
    if not rows:
        return None
    rows.sort(key=lambda r: (not r[2], r[0].split(" · ")[0], r[3], r[4] != "forward", r[5]))
    fig, ax = plt.subplots(figsize=(COLUMN_IN, 2.0 + 0.36 * len(rows)), layout="constrained")
    y = np.arange(len(rows))
    left = np.zeros(len(rows))
    for i, (label, *_rest) in enumerate(SIDED_REGIONS):
        share = np.array([r[1][i] for r in rows])
        ax.barh(y, share * 100, left=left * 100, color=_REGION_COLORS[i], label=label,
                edgecolor="white", lw=0.4)
        for j, v in enumerate(share):
            if v >= 0.06:
                ax.text((left[j] + v / 2) * 100, j, f"{100 * v:.0f}%", ha="center",
                        va="center", fontsize=SMALL_PT)
        left += share
    ax.set_yticks(y, [r[0] for r in rows], fontsize=SMALL_PT)
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of finite nonzero values [%]")
    ax.legend(ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    scaled = run_scaled(scalings)
    fig.suptitle("HiF8 precision regions of captured values\n" +
                 ("(per-tensor scaled: as the grid saw them, x·2^k, and unscaled)" if scaled
                  else "(no scaling)"))
    caption = ("Share of finite nonzero values in each region of HiF8's tapered format: "
               "3-bit mantissa for |x| in [2^-3, 2^4), 2-bit and 1-bit further out on the "
               "small and large side, denormals [2^-23, 2^-15), underflow below 2^-23 and "
               "overflow from 40960. ")
    if scaled:
        caption += ("Operands quantized with a per-tensor scale 2^k (--hifp8-scaling tensor) "
                    "appear twice: as the HiF8 grid saw them ('grid saw x·2^k') and unscaled. "
                    "Rows marked 'if cast, x·2^k' show the same tensors of a run that did not "
                    "use HiF8 with the same scaling rule (k from each record's amax, so that "
                    "amax·2^k lies in [8, 16)), for a like-for-like comparison")
        caption += ("; 'if cast' rows without it are unscaled (a HiF8 run here did not "
                    "scale)." if UNSCALED in casts else ".")
    else:
        caption += ("Rows marked 'if cast' show the same tensors of a run that did not use "
                    "HiF8, cast without scaling as the HiF8 runs here were, for comparison.")
    return {"file": save_figure(fig, outdir, "hifp8_regions.png"),
            "title": "HiF8 precision regions", "caption": caption}


# -- forward vs backward ----------------------------------------------------------------------

def forward_backward(groups, outdir: str, colors) -> Optional[dict]:
    """SQNR and saturated/flushed shares of quantized operands per GEMM, per scheme."""
    merged = merge_by(groups, lambda k: (k.quant_scheme, k.gemm or k.operation),
                      lambda k: k.format != "none")
    if not merged:
        return None
    schemes = sorted({k[0] for k in merged})
    gemms = [g for g in ("fprop", "dgrad", "wgrad") if any(k[1] == g for k in merged)]
    gemms += sorted({k[1] for k in merged} - set(gemms))
    fig, axes = plt.subplots(1, 3, figsize=(COLUMN_IN, 4.6), layout="constrained")
    width = 0.8 / max(1, len(schemes))
    x = np.arange(len(gemms))
    for i, scheme in enumerate(schemes):
        vals = {name: [] for name in ("sqnr_db", "saturated_fraction", "flushed_fraction")}
        for g in gemms:
            s = merged.get((scheme, g))
            q = (s.metrics()["quantization"] or {}) if s is not None else {}
            for name in vals:
                v = q.get(name)
                vals[name].append(np.nan if v is None or (isinstance(v, float)
                                                          and math.isinf(v)) else v)
        pos = x - 0.4 + width * (i + 0.5)
        axes[0].bar(pos, vals["sqnr_db"], width, color=colors[scheme], label=scheme)
        axes[1].bar(pos, 100 * np.array(vals["saturated_fraction"], float), width,
                    color=colors[scheme], label=scheme)
        axes[2].bar(pos, 100 * np.array(vals["flushed_fraction"], float), width,
                    color=colors[scheme], label=scheme)
    titles = ("SQNR [dB]", "saturated [%]", "flushed to zero [%]")
    gemm_names = {"fprop": "fprop\n(forward)", "dgrad": "dgrad\n(backward)",
                  "wgrad": "wgrad\n(backward)"}
    for ax, title in zip(axes, titles):
        ax.set_xticks(x, [gemm_names.get(g, g) for g in gemms])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3, lw=0.5)
    axes[0].set_ylabel("dB")
    axes[1].set_ylabel("% of finite elements")
    axes[2].set_ylabel("% of nonzero elements")
    fig.legend(handles=[Patch(color=colors[scheme], label=scheme) for scheme in schemes],
               loc="outside lower center", ncol=min(4, len(schemes)), frameon=False)
    fig.suptitle("Forward vs backward: quantization error per GEMM")
    return {"file": save_figure(fig, outdir, "forward_backward.png"),
            "title": "Forward vs backward",
            "caption": "Quantization error of the operands of the forward GEMM (fprop) and "
                       "of the two backward GEMMs (dgrad: output gradient and weight; wgrad: "
                       "input and output gradient, blocked along tokens), per quant type."}


def forward_backward_layers(groups, outdir: str, colors) -> Optional[dict]:
    """Per layer: SQNR of forward vs backward quantized operands, per scheme."""
    merged = merge_by(groups, lambda k: (k.quant_scheme, k.operation, k.layer),
                      lambda k: k.format != "none")
    if not merged:
        return None
    fig, ax = plt.subplots(figsize=(COLUMN_IN, 4.6), layout="constrained")
    for scheme in sorted({k[0] for k in merged}):
        for op, ls, marker in (("forward", "-", "o"), ("backward", "--", "s")):
            pts = sorted((k[2], s.metrics()["quantization"]["sqnr_db"])
                         for k, s in merged.items() if k[0] == scheme and k[1] == op)
            pts = [(l, v) for l, v in pts if v is not None and math.isfinite(v)]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=ls, marker=marker,
                        color=colors[scheme], label=f"{scheme} ({_label(op)})")
    _layer_ticks(ax, sorted({k[2] for k in merged}))
    ax.set_xlabel("layer")
    ax.set_ylabel("SQNR [dB]")
    ax.grid(alpha=0.3, lw=0.5)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title("SQNR of quantized operands per layer: forward vs backward")
    return {"file": save_figure(fig, outdir, "forward_backward_layers.png"),
            "title": "Forward vs backward per layer",
            "caption": "SQNR of all quantized operands of each layer, forward (solid) and "
                       "backward (dashed), per quant type."}


# -- per-layer maxima -------------------------------------------------------------------------

def layer_absmax(groups, outdir: str, colors,
                 hifp8_scalings: Optional[Dict[str, str]] = None) -> Optional[dict]:
    """Largest |x| per layer and tensor class (outlier growth across depth)."""
    merged = merge_by(groups, lambda k: (tensor_class(k.tensor_name), k.quant_scheme, k.layer))
    present = [c for c in _CLASSES if any(k[0] == c for k in merged)]
    if not present:
        return None
    scalings = scheme_scalings(groups) if hifp8_scalings is None else hifp8_scalings
    fig, axes = plt.subplots(1, len(present), figsize=(COLUMN_IN, 4.6), squeeze=False,
                             layout="constrained")
    handles = {}
    for ax, cls in zip(axes.flat, present):
        values = []
        for scheme in sorted({k[1] for k in merged if k[0] == cls}):
            pts = sorted((k[2], s.absmax) for k, s in merged.items()
                         if k[0] == cls and k[1] == scheme and s.absmax > 0)
            if pts:
                (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                                  color=colors[scheme], label=scheme)
                handles.setdefault(scheme, line)
                values += [p[1] for p in pts]
        _layer_ticks(ax, sorted({k[2] for k in merged if k[0] == cls}), output="out")
        if values and max(values) / min(values) > 20:   # log only when it spans decades
            ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel("max |x|")
        ax.set_title(f"{cls} tensors")
        ax.grid(alpha=0.3, lw=0.5)
    fig.legend(handles=list(handles.values()), loc="outside lower center",
               ncol=min(len(handles), 4), frameon=False)
    fig.suptitle("Largest magnitude per layer")
    hifp8 = ""                      # without HiF8 runs, nothing to say about HiF8
    if run_scaled(scalings):
        hifp8 = ("; with per-tensor HiF8 scaling (--hifp8-scaling tensor) they lower the "
                 "tensor's scale 2^k and push its small values toward HiF8's 1-bit and "
                 "denormal binades")
    elif scalings:
        hifp8 = "; they push HiF8 values into its 1-bit-mantissa binades"
    return {"file": save_figure(fig, outdir, "layer_absmax.png"),
            "title": "Largest magnitude per layer",
            "caption": "Maximum |x| over all captured iterations and micro-batches, per layer "
                       "and tensor class: growing outliers are what saturates MX blocks"
                       f"{hifp8}."}


# -- format overview --------------------------------------------------------------------------

def format_overview(groups, outdir: str, colors) -> Optional[dict]:
    """Headline: SQNR per scheme and format, forward and backward."""
    merged = merge_by(groups, lambda k: (k.quant_scheme, k.format, k.operation),
                      lambda k: k.format != "none")
    if not merged:
        return None
    labels = sorted({(k[0], k[1]) for k in merged})
    fig, ax = plt.subplots(figsize=(max(COLUMN_IN, 1.3 * len(labels) + 3), 4.6),
                           layout="constrained")
    x = np.arange(len(labels))
    for j, (op, hatch) in enumerate((("forward", None), ("backward", "//"))):
        vals = []
        for scheme, fmt in labels:
            s = merged.get((scheme, fmt, op))
            v = (s.metrics()["quantization"] or {}).get("sqnr_db") if s else None
            vals.append(np.nan if v is None or math.isinf(v) else v)
        bars = ax.bar(x - 0.2 + 0.4 * j, vals, 0.4, color=[colors[scheme] for scheme, _ in labels],
                      hatch=hatch, edgecolor="black", lw=0.5, label=op)
        for b, v in zip(bars, vals):
            if np.isfinite(v):
                ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.1f}", ha="center",
                        va="bottom", fontsize=SMALL_PT)
    ax.set_xticks(x, [f"{scheme}\n{fmt}" for scheme, fmt in labels], fontsize=SMALL_PT)
    ax.set_ylabel("SQNR [dB]")
    ax.set_xlabel("quant type / element format")
    ax.grid(axis="y", alpha=0.3, lw=0.5)
    ax.legend(handles=[Patch(facecolor="white", edgecolor="black", label="forward"),
                       Patch(facecolor="white", edgecolor="black", hatch="//",
                             label="backward")])
    ax.set_title("Signal-to-quantization-noise ratio per format (all quantized operands)")
    return {"file": save_figure(fig, outdir, "format_overview.png"),
            "title": "SQNR per format",
            "caption": "SQNR = 10 log10(sum x^2 / sum (q - x)^2) over all quantized operands "
                       "of each quant type and element format, forward (plain) and backward "
                       "(hatched). Each 6 dB is one more effective bit."}


# Figures in report order: (function, passes colours, one per scheme, groups drawn, run-level
# inputs it takes as keywords). Groups: "all"; "shared": the tensors every scheme captured;
# "quantized": the operands every quantized scheme quantized (figures that put schemes side by
# side compare like with like). Run-level inputs are computed once from all groups: the HiF8
# scaling of the runs (`hifp8_scalings`) and the heat maps' shared colour scales (`limits`).
_FIGURES = (
    ("format_overview", True, False, "quantized", ()),
    ("value_distributions", True, False, "quantized", ()),
    ("absolute_distributions", True, False, "shared", ("hifp8_scalings",)),
    ("error_heatmap", False, True, "all", ("limits",)),
    ("scale_exponents", True, False, "quantized", ()),
    ("nvfp4_block_scales", False, False, "all", ()),
    ("hifp8_regions", False, False, "all", ("hifp8_scalings",)),
    ("forward_backward", True, False, "quantized", ()),
    ("forward_backward_layers", True, False, "quantized", ()),
    ("layer_absmax", True, False, "shared", ("hifp8_scalings",)),
)
_RESTRICTED = {
    "shared": " Drawn over the tensors (layer, module, tensor name) every scheme captured; "
              "the others are listed in the report's comparison section.",
    "quantized": " Drawn over the operands every quantized scheme quantized; the others are "
                 "listed in the report's comparison section.",
}
_SHARED = {}   # the groups, inherited by forked figure workers instead of being pickled


def _render(task):
    what = task[0] if task[1] in (True, False) else f"{task[0]} ({task[1]})"
    return drawn_or_problem(lambda: _render_one(task), what)


def _render_one(task):
    name, arg, which, extra = task
    groups, outdir, colors = _SHARED[which], _SHARED["outdir"], _SHARED["colors"]
    fn = globals()[name]
    kwargs = {key: _SHARED[key] for key in extra}
    with style():
        if name == "error_heatmap":
            figure = fn(groups, outdir, arg, **kwargs)
        elif arg is True:
            figure = fn(groups, outdir, colors, **kwargs)
        else:
            figure = fn(groups, outdir, **kwargs)
    if figure is not None and which in _RESTRICTED and len(groups) < len(_SHARED["all"]):
        figure["caption"] += _RESTRICTED[which]
    return figure


def make_all(groups, outdir: str, quant_schemes: Sequence[str], workers: int = 1,
             color_names: Optional[Sequence[str]] = None,
             common: Optional[Common] = None) -> List[dict]:
    """Every capture figure, in report order (losses are drawn by losses.plot_losses).

    Figures are independent, so with workers > 1 they are drawn in forked processes.
    `color_names`: every name that gets a colour (schemes and loss runs), so one scheme
    has the same colour in every figure. `common`: the tensors shared by the schemes
    (default: computed from `groups`).
    """
    os.makedirs(outdir, exist_ok=True)
    common = common or common_tensors(groups)
    _SHARED.update(all=groups, shared=common.all_schemes(groups),
                   quantized=common.quantized_operands(groups), outdir=outdir,
                   colors=scheme_colors(color_names or quant_schemes),
                   hifp8_scalings=scheme_scalings(groups), limits=heat_limits(groups))
    tasks = []
    for name, with_colors, per_scheme, which, extra in _FIGURES:
        if per_scheme:
            tasks.extend((name, scheme, which, extra) for scheme in sorted(quant_schemes))
        else:
            tasks.append((name, with_colors, which, extra))
    try:
        if workers > 1 and forking.fork_available():   # the groups reach children by fork
            with forking.pool(workers) as pool:
                figures = list(pool.map(_render, tasks))
        else:
            figures = [_render(task) for task in tasks]
    finally:
        _SHARED.clear()
    return [f for f in figures if f is not None]
