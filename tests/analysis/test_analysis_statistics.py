"""The visualiser on a format-exact synthetic capture: outputs exist, and every statistic in
statistics.json equals an independent float64 recomputation from the record tensors."""

import csv
import json
import math
import os
from collections import defaultdict

import numpy as np
import pytest
import torch

from megatron.analysis import synthetic
from megatron.analysis.cli import main
from megatron.analysis.statistics import load_json

QUANT_SCHEMES = ("bf16", "FA_linear_mxfp8", "linear_mxfp4", "FA_linear_hifp8")
MX = {"mxfp8_e4m3": (8, 448.0), "mxfp8_e5m2": (15, 57344.0), "mxfp4": (2, 6.0)}


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture")
    synthetic.write_capture(str(root), QUANT_SCHEMES, layers=2, iterations=(1, 2), seq=8,
                            hidden=64, ffn=96, seed=3)
    # One rceil run, so the recomputed scale rule is checked for both modes.
    synthetic.write_capture(str(root), ("linear_mxfp8",), layers=1, iterations=(1,), seq=8,
                            hidden=64, ffn=96, seed=4, scale_mode="rceil",
                            dtype=torch.float32, attention=False)
    out = tmp_path_factory.mktemp("report")
    code = main(["--tensor-dir", str(root), "--output-dir", str(out), "--workers", "2",
                 "--no-progress", "--log-level", "WARNING"])
    assert code == 0
    return root, out, load_json(os.path.join(out, "statistics.json"))


def test_outputs_written(analysed):
    _, out, doc = analysed
    for name in ("statistics.json", "statistics.txt", "report.html", "records.csv"):
        assert os.path.getsize(os.path.join(out, name)) > 0
    assert doc["schema_version"] == 2
    assert set(doc["quant_types"]) == set(QUANT_SCHEMES) | {"linear_mxfp8"}
    pngs = sorted(os.listdir(os.path.join(out, "figures")))
    for name in ("value_distributions.png", "mx_scale_exponents.png", "hifp8_regions.png",
                 "forward_backward.png", "format_overview.png",
                 "error_heatmap_FA_linear_mxfp8.png", "error_heatmap_FA_linear_hifp8.png"):
        assert name in pngs
    assert {f["file"] for f in doc["figures"]} == set(pngs)
    html = open(os.path.join(out, "report.html")).read()
    assert html.count("data:image/png;base64,") == len(pngs)
    assert "src='figures/" not in html          # self-contained
    text = open(os.path.join(out, "statistics.txt")).read()
    assert "Quantization error by format" in text and "HiF8 precision regions" in text
    # The capture's own error metrics agree with the recomputation.
    assert doc["consistency"]["records_mismatched"] == 0
    assert doc["consistency"]["records_checked"] > 0
    assert doc["problems"] == []


def test_outputs_name_the_scheme_quant_type(analysed):
    """The outputs keep the original system's name of the scheme, `quant_type`."""
    _, out, doc = analysed
    schemes = set(QUANT_SCHEMES) | {"linear_mxfp8"}
    with open(os.path.join(out, "records.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert next(iter(rows[0])) == "quant_type"
    assert {r["quant_type"] for r in rows} == schemes
    assert "quant_scheme" not in rows[0]
    assert {g["quant_type"] for g in doc["groups"]} == schemes
    assert {h["quant_type"] for h in doc["histograms"]} <= schemes
    assert {r["quant_type"] for r in doc["format_comparison"]} < schemes
    assert "quant_types_requested" in doc["inputs"]
    assert not any("quant_scheme" in key for g in doc["groups"] for key in g)


# -- independent reference: plain float64 numpy over each record --------------------------------

def _block_scales(x, axis, fmt, scale_mode):
    """(per-element scale exponent, per-block exponents) via float64 log2 over padded blocks."""
    emax, max_normal = MX[fmt]
    moved = np.moveaxis(x, axis, -1)
    length = moved.shape[-1]
    pad = (-length) % 32
    padded = np.concatenate([moved, np.zeros(moved.shape[:-1] + (pad,))], axis=-1)
    blocks = np.abs(padded.reshape(-1, 32))
    amax = blocks.max(axis=1)
    with np.errstate(divide="ignore"):
        if scale_mode == "rceil":
            e = np.ceil(np.log2(amax / max_normal))
        else:
            e = np.floor(np.log2(amax)) - emax
    e = np.clip(np.where(amax == 0, -127, e), -127, 127)
    per_elem = np.repeat(e, 32).reshape(padded.shape)[..., :length]
    return np.moveaxis(per_elem, -1, axis), e


def _reference(records):
    """Metrics of a list of (x, q, metadata) computed directly in float64."""
    xs = np.concatenate([r[0].ravel() for r in records])
    finite = xs[np.isfinite(xs)]
    out = {"elements": xs.size, "mean": finite.mean(), "std": finite.std(),
           "absmax": np.abs(finite).max(), "min": finite.min(), "max": finite.max(),
           "zero_fraction": np.mean(xs == 0),
           "kurtosis": np.mean(finite ** 4) / np.mean(finite ** 2) ** 2}
    mag = np.abs(finite[finite != 0])
    out["hifp8_regions"] = {
        "underflow": np.mean(mag < 2.0 ** -23),
        "denormal": np.mean((mag >= 2.0 ** -23) & (mag < 2.0 ** -15)),
        "mant1": np.mean(((mag >= 2.0 ** -15) & (mag < 2.0 ** -7)) |
                         ((mag >= 2.0 ** 8) & (mag < 40960))),
        "mant2": np.mean(((mag >= 2.0 ** -7) & (mag < 2.0 ** -3)) |
                         ((mag >= 2.0 ** 4) & (mag < 2.0 ** 8))),
        "mant3": np.mean((mag >= 2.0 ** -3) & (mag < 2.0 ** 4)),
        "overflow": np.mean(mag >= 40960)}
    quantized = [r for r in records if r[1] is not None]
    if not quantized:
        return out, None
    x2 = e2 = 0.0
    n = nonzero = flushed = saturated = 0
    scale_counts = defaultdict(int)
    for x, q, meta in quantized:
        d = q - x
        x2 += float(np.sum(x * x))
        e2 += float(np.sum(d * d))
        n += x.size
        nz = x != 0
        nonzero += int(nz.sum())
        flushed += int((nz & (q == 0)).sum())
        fmt = meta["format"]
        if fmt in MX:
            per_elem, blocks = _block_scales(x, meta["axis"], fmt, meta["scale_mode"])
            saturated += int((np.abs(x) > MX[fmt][1] * 2.0 ** per_elem).sum())
            for e in blocks:
                scale_counts[int(e)] += 1
        elif fmt == "hifp8":
            saturated += int((np.abs(q) >= 32768).sum())
    quant = {"mse": e2 / n, "sqnr_db": 10 * math.log10(x2 / e2),
             "relative_error": math.sqrt(e2 / x2), "flushed_fraction": flushed / nonzero,
             "saturated_fraction": saturated / n, "nonfinite_fraction": 0.0}
    if scale_counts:
        lo, hi = min(scale_counts), max(scale_counts)
        quant["scale_exponent"] = {"min": lo, "max": hi, "hist": {
            "min": lo, "counts": [scale_counts.get(e, 0) for e in range(lo, hi + 1)]}}
    return out, quant


def _load_groups(root, doc):
    """Records of every scheme's directory, keyed like statistics.json groups."""
    by_key = defaultdict(list)
    for scheme in doc["quant_types"]:
        directory = os.path.join(root, scheme)
        for line in open(next(os.path.join(directory, f) for f in os.listdir(directory)
                              if f.startswith("manifest-"))):
            entry = json.loads(line)
            rec = torch.load(os.path.join(directory, entry["file"]), weights_only=True)
            m = rec["metadata"]
            x = rec["tensor"].to(torch.float64).numpy()
            q = rec["quantized"].to(torch.float64).numpy() if "quantized" in rec else None
            key = (scheme, m["format"], m["layer_idx"], m["module"].rsplit(".", 1)[-1],
                   m["tensor_name"], m["operation"], m["gemm"])
            by_key[key].append((x, q, m))
    return by_key


def _close(actual, expected, rel=1e-9, abs_=1e-12):
    assert actual == pytest.approx(expected, rel=rel, abs=abs_)


def _check(metrics, ref, quant_ref):
    for name in ("elements", "mean", "std", "absmax", "min", "max", "zero_fraction", "kurtosis"):
        _close(metrics[name], ref[name], rel=1e-7)
    for name, value in ref["hifp8_regions"].items():
        _close(metrics["hifp8_regions"][name], value)
    if quant_ref is None:
        assert metrics["quantization"] is None
        return
    q = metrics["quantization"]
    for name in ("mse", "sqnr_db", "relative_error"):
        _close(q[name], quant_ref[name], rel=1e-6)   # float32 products of float32 captures
    for name in ("flushed_fraction", "saturated_fraction", "nonfinite_fraction"):
        _close(q[name], quant_ref[name])
    if "scale_exponent" in quant_ref:
        se = q["scale_exponent"]
        assert (se["min"], se["max"]) == (quant_ref["scale_exponent"]["min"],
                                          quant_ref["scale_exponent"]["max"])
        assert se["hist"] == quant_ref["scale_exponent"]["hist"]


def test_group_statistics_match_float64_recomputation(analysed):
    root, _, doc = analysed
    records = _load_groups(str(root), doc)
    groups = {(g["quant_type"], g["format"], g["layer"],
               g["module"] if g["module"] != "core_attention" else "core_attention",
               g["tensor_name"], g["operation"], g["gemm"]): g for g in doc["groups"]}
    assert len(groups) == len(records)
    for key, recs in records.items():
        ref, quant_ref = _reference(recs)
        _check(groups[key]["metrics"], ref, quant_ref)


def test_aggregate_statistics_match_float64_recomputation(analysed):
    root, _, doc = analysed
    records = _load_groups(str(root), doc)
    for scheme, section in doc["quant_types"].items():
        mine = [r for k, recs in records.items() if k[0] == scheme for r in recs]
        ref, quant_ref = _reference(mine)
        _check(section["overall"], ref, quant_ref)
        for fmt, metrics in section["by_format"].items():
            subset = [r for k, recs in records.items() if k[0] == scheme and k[1] == fmt
                      for r in recs]
            _check(metrics, *_reference(subset))
        for op, metrics in section["by_operation"].items():
            subset = [r for k, recs in records.items() if k[0] == scheme and k[5] == op
                      for r in recs]
            _check(metrics, *_reference(subset))


def test_histograms_match_recomputation(analysed):
    root, _, doc = analysed
    records = _load_groups(str(root), doc)
    for entry in doc["histograms"]:
        if entry["kind"] != "abs":
            continue
        xs = np.concatenate([r[0].ravel() for k, recs in records.items()
                             if (k[0], k[1], k[5]) == (entry["quant_type"], entry["format"],
                                                       entry["operation"]) for r in recs])
        mag = np.abs(xs[np.isfinite(xs) & (xs != 0)])
        mant, exp = np.frexp(mag)                    # mag = mant * 2^exp, mant in [0.5, 1)
        index = (exp - 1 - doc["histogram_layout"]["e_min"]) * 4 + np.floor((2 * mant - 1) * 4)
        counts = np.bincount(index.astype(np.int64))
        lo = entry["first_bin"]
        expected = counts[lo:lo + len(entry["counts"])]
        assert counts[:lo].sum() == 0 and counts[lo + len(entry["counts"]):].sum() == 0
        assert entry["counts"] == expected.tolist()
        binade = lo // 4 + doc["histogram_layout"]["e_min"]
        assert entry["first_edge_log2"] == pytest.approx(binade + math.log2(1 + (lo % 4) / 4))


def test_manifest_only_mode_agrees(analysed, tmp_path):
    root, _, doc = analysed
    code = main(["--tensor-dir", str(root), "--output-dir", str(tmp_path), "--manifest-only",
                 "--no-figures", "--no-progress", "--workers", "1", "--log-level", "WARNING"])
    assert code == 0
    fast = load_json(os.path.join(tmp_path, "statistics.json"))
    for scheme, section in doc["quant_types"].items():
        full_q = section["overall"]["quantization"]
        fast_q = fast["quant_types"][scheme]["overall"]["quantization"]
        if full_q is None:
            assert fast_q is None
            continue
        for name in ("mse", "sqnr_db", "saturated_fraction", "flushed_fraction"):
            assert fast_q[name] == pytest.approx(full_q[name], rel=1e-6, abs=1e-9)
        assert fast_q.get("scale_exponent") == full_q.get("scale_exponent")
        assert fast["quant_types"][scheme]["overall"]["mean"] == pytest.approx(
            section["overall"]["mean"], rel=1e-6, abs=1e-12)
