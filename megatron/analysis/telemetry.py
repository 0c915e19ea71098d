"""Quantization telemetry from TensorBoard: the `quant/...` scalars training writes with
`--quant-stats-interval N`, as a long pandas DataFrame, and its summary for the report.

Tags (step = training iteration):

    quant/<site>/<gemm>.<operand>/<metric>     e.g. quant/L2.linear_fc2/dgrad.grad_output/sqnr_db
    quant/worst/<metric>                       max over sites (saturated_pct, flushed_pct)

`site` is `L{layer}.{module}` (`L1.core_attention.qk`, `L0.output_layer`,
`L3.expert5_linear_fc1`). Quantized operands carry `saturated_pct flushed_pct sqnr_db
rel_error amax`, MX operands (MXFP8, MXFP6, MXFP4) also `scale_exp_min scale_exp_max`, HiF8
operands the `hifp8_*_pct` region shares, NVFP4 operands `block_scale_zero_pct
block_scale_subnormal_pct tensor_scale_min tensor_scale_max block_scale_min block_scale_max`,
FP8 operands `tensor_scale_min tensor_scale_max` (per-tensor scaling) or `block_scale_min
block_scale_max` (blockwise); operands of an unquantized scheme carry only `amax`; an operand
that held NaN/Inf carries `nonfinite` = 1 (and amax) instead.

Event files sit in `{tensorboard_dir}` itself or in one sub-directory per scheme
(`tensorboard/{scheme}/`, as the demo writes them): the scheme is the sub-directory's name, or
the directory's own name when the files sit directly in it, unless the user names the run
(`NAME=DIR`) or a training log names it by the label it recorded (megatron.analysis.naming).
"""

from __future__ import annotations

import math
import os
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from megatron.analysis import naming
from megatron.analysis.events import event_files, read_scalars

QUANT_PREFIX = "quant/"
WORST_SITE = "worst"
NONFINITE = "nonfinite"      # 1.0 when an operand held NaN/Inf (its other metrics are left out)
GEMMS = ("fprop", "dgrad", "wgrad")
FRAME_COLUMNS = ("scheme", "step", "site", "layer", "module", "gemm", "operand", "metric",
                 "value")
SCALAR_COLUMNS = ("scheme", "step", "tag", "value")
_SITE = re.compile(r"^L(?P<layer>\d+)\.(?P<module>[A-Za-z0-9_.]+)$")
_METRIC = re.compile(r"^[A-Za-z0-9_]+$")

Dirs = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


def parse_tag(tag: str) -> Optional[Tuple]:
    """(site, layer, module, gemm, operand, metric) of a quant tag, None if it is not one."""
    if not tag.startswith(QUANT_PREFIX):
        return None
    parts = tag[len(QUANT_PREFIX):].split("/")
    if len(parts) == 2 and parts[0] == WORST_SITE and _METRIC.match(parts[1]):
        return (WORST_SITE, None, None, None, None, parts[1])
    if len(parts) != 3:
        return None
    site, gemm_operand, metric = parts
    match = _SITE.match(site)
    gemm, _, operand = gemm_operand.partition(".")
    if match is None or gemm not in GEMMS or not operand or not _METRIC.match(metric):
        return None
    return (site, int(match.group("layer")), match.group("module"), gemm, operand, metric)


def scheme_directories(tensorboard_dir: str) -> List[Tuple[str, str, List[str]]]:
    """(scheme, run directory, event files) found under one TensorBoard directory."""
    root = os.path.abspath(tensorboard_dir)
    if os.path.isfile(root):
        return [(os.path.basename(os.path.dirname(root)), os.path.dirname(root),
                 event_files(root))]
    if not os.path.isdir(root):
        return []
    out = []
    direct = [f for f in event_files(root) if os.path.dirname(f) == root]
    if direct:
        out.append((os.path.basename(root), root, direct))
    for entry in sorted(os.listdir(root)):
        path = os.path.join(root, entry)
        if os.path.isdir(path):
            files = event_files(path)
            if files:
                out.append((entry, path, files))
    return out


def _as_list(dirs: Dirs) -> List[str]:
    if isinstance(dirs, (str, os.PathLike)):
        return [os.fspath(dirs)]
    return [os.fspath(d) for d in dirs]


def run_directories(dirs: Dirs) -> List[Tuple[str, str, List[str]]]:
    """(scheme, run directory, event files) of each run under the --tensorboard-dir values:
    the scheme is the user's NAME of `NAME=DIR`, else the run directory's name."""
    out = []
    for spec in _as_list(dirs):
        name, directory = naming.split_named(spec)
        for scheme, where, files in scheme_directories(directory):
            out.append((name or scheme, where, files))
    return out


def _selected(dirs: Dirs, schemes: Optional[Iterable[str]],
              names: Optional[Dict[str, str]] = None):
    """(scheme, run directory, files) per run; `names` {run directory (real path): label}
    renames runs."""
    wanted = None if schemes is None else set(schemes)
    names = names or {}
    for scheme, where, files in run_directories(dirs):
        scheme = names.get(os.path.realpath(where), scheme)
        if wanted is None or scheme in wanted:
            yield scheme, where, files


def load_stats_frame(tensorboard_dir: Dirs, schemes: Optional[Iterable[str]] = None,
                     metrics: Optional[Iterable[str]] = None,
                     names: Optional[Dict[str, str]] = None):
    """The quant telemetry as a long DataFrame: one row per (scheme, step, site, gemm,
    operand, metric) with its value. `layer`, `module`, `gemm` and `operand` are missing
    (<NA> / None) for the `worst` site. Tags under `quant/` that do not follow the contract
    are listed in `frame.attrs["unparsed_tags"]`; other tags are left out (see
    `load_scalars_frame`). A value `NAME=DIR` names the run in DIR; `names` {run directory:
    label} renames runs (the labels their training logs recorded). `frame.attrs["runs"]`
    lists the [scheme, run directory] of each run that contributed rows."""
    import pandas as pd

    wanted = None if metrics is None else set(metrics)
    rows, unparsed, runs = [], set(), []
    for scheme, where, files in _selected(tensorboard_dir, schemes, names):
        scalars = read_scalars(files, lambda tag: tag.startswith(QUANT_PREFIX))
        before = len(rows)
        for tag, series in scalars.items():
            parsed = parse_tag(tag)
            if parsed is None:
                unparsed.add(tag)
                continue
            if wanted is not None and parsed[-1] not in wanted:
                continue
            rows.extend((scheme, step) + parsed + (value,) for step, value in series.items())
        if len(rows) > before:
            runs.append([scheme, where])
    frame = pd.DataFrame.from_records(rows, columns=list(FRAME_COLUMNS))
    frame["step"] = frame["step"].astype("int64")
    frame["layer"] = frame["layer"].astype("Int64")
    frame["value"] = frame["value"].astype("float64")
    frame = frame.sort_values(["scheme", "site", "gemm", "operand", "metric", "step"],
                              na_position="first", kind="stable").reset_index(drop=True)
    frame.attrs["unparsed_tags"] = sorted(unparsed)
    frame.attrs["runs"] = runs
    return frame


def load_scalars_frame(tensorboard_dir: Dirs, schemes: Optional[Iterable[str]] = None):
    """The other scalars of the same event files (`lm loss`, `learning-rate`, ...) as a long
    DataFrame (scheme, step, tag, value)."""
    import pandas as pd

    rows = []
    for scheme, _, files in _selected(tensorboard_dir, schemes):
        scalars = read_scalars(files, lambda tag: not tag.startswith(QUANT_PREFIX))
        for tag, series in scalars.items():
            rows.extend((scheme, step, tag, value) for step, value in series.items())
    frame = pd.DataFrame.from_records(rows, columns=list(SCALAR_COLUMNS))
    frame["step"] = frame["step"].astype("int64")
    frame["value"] = frame["value"].astype("float64")
    return frame.sort_values(["scheme", "tag", "step"], kind="stable").reset_index(drop=True)


# -- summary for the report ---------------------------------------------------------------------

def site_operands(frame):
    """Per-site rows (the `worst` tags left out), with a label `site gemm.operand`."""
    sites = frame[frame["site"] != WORST_SITE].copy()
    sites["label"] = sites["site"] + " " + sites["gemm"] + "." + sites["operand"]
    return sites


def _worst(rows, metric: str, largest: bool) -> Optional[dict]:
    values = rows[rows["metric"] == metric]
    values = values[values["value"].map(math.isfinite)]       # exact (inf dB) is never worst
    if values.empty:
        return None
    row = values.loc[values["value"].idxmax() if largest else values["value"].idxmin()]
    if largest and row["value"] == 0:
        # Nothing saturated (or flushed) anywhere: no operand to single out.
        return {"value": 0.0, "site": None, "operand": None, "step": None}
    return {"value": float(row["value"]), "site": row["site"],
            "operand": f"{row['gemm']}.{row['operand']}", "step": int(row["step"])}


def _nonfinite(rows) -> Optional[dict]:
    """Operands that held NaN/Inf (training then reports only the `nonfinite` flag)."""
    flagged = rows[(rows["metric"] == NONFINITE) & (rows["value"] > 0)]
    if flagged.empty:
        return None
    first = flagged.loc[flagged["step"].idxmin()]
    return {"operands": int(flagged["label"].nunique()), "first_step": int(first["step"]),
            "site": first["site"], "operand": f"{first['gemm']}.{first['operand']}"}


def _layers_at(rows) -> List[dict]:
    """Per layer (the output layer last), the operand with the lowest SQNR among `rows`."""
    sqnr = rows[rows["metric"] == "sqnr_db"]
    if sqnr.empty:          # an unquantized scheme (and an empty mask would select columns)
        return []
    sqnr = sqnr[sqnr["value"].map(math.isfinite).astype(bool)]
    out = []
    for layer in sorted({int(n) for n in sqnr["layer"].dropna()}, key=naming.layer_order):
        mine = sqnr[sqnr["layer"] == layer]
        worst = mine.loc[mine["value"].idxmin()]
        operand = f"{worst['gemm']}.{worst['operand']}"
        out.append({"layer": layer, "label": naming.layer_label(layer),
                    "worst": {"site": f"{naming.display_site(worst['site'])} {operand}",
                              "module": worst["module"], "tensor_name": operand,
                              "sqnr_db": float(worst["value"])}})
    return out


def summary(frame, sources: List[str]) -> dict:
    """statistics.json `telemetry`: per scheme, the steps covered and the worst operands."""
    sites = site_operands(frame)
    schemes = {}
    for scheme, rows in sites.groupby("scheme", sort=True):
        last = int(rows["step"].max())
        at_last = rows[rows["step"] == last]
        sqnr_last = at_last[at_last["metric"] == "sqnr_db"]["value"]
        sqnr_last = sqnr_last[sqnr_last.map(math.isfinite)]
        quantized = rows[rows["metric"] == "sqnr_db"]["label"].nunique()
        schemes[scheme] = {
            "steps": [int(rows["step"].min()), last],
            "points": int(rows["step"].nunique()),
            "operands": int(rows["label"].nunique()),
            "quantized_operands": int(quantized),
            "mean_sqnr_db_at_last_step": float(sqnr_last.mean()) if len(sqnr_last) else None,
            "worst_sqnr_db_at_last_step": _worst(at_last, "sqnr_db", largest=False),
            "max_saturated_pct": _worst(rows, "saturated_pct", largest=True),
            "max_flushed_pct": _worst(rows, "flushed_pct", largest=True),
            "max_amax": _worst(rows, "amax", largest=True),
            "nonfinite": _nonfinite(rows),
            # NVFP4 operands: the largest shares of blocks with a zero / subnormal E4M3 scale
            "max_block_scale_zero_pct": _worst(rows, "block_scale_zero_pct", largest=True),
            "max_block_scale_subnormal_pct": _worst(rows, "block_scale_subnormal_pct",
                                                    largest=True),
            # the per-layer picture when there is no capture: worst operand per layer
            "layers_at_last_step": _layers_at(at_last),
        }
    return {"sources": list(sources), "schemes": schemes,
            "unparsed_tags": list(frame.attrs.get("unparsed_tags", []))}
