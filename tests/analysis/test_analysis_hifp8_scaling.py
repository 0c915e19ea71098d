"""HiF8 operands quantized with a per-tensor power-of-two scale: records carry
`hifp8_scaling: "tensor"` and `hifp8_scale_exponent` k; the analysis reports the region shares
of the values as the grid saw them (hp * 2^k) beside those of the unscaled values, and counts
saturation on the scaled grid. Every HiF8 panel and table follows the run's scaling: the
figures drawn during the analysis are kept (Figure.savefig is wrapped) and their data compared
with expectations computed here from the records."""

import json
import math
import os

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from matplotlib.patches import StepPatch

from megatron.analysis import load_frame, synthetic
from megatron.analysis.binning import NBINS, bin_index_of_value
from megatron.analysis.cli import main
from megatron.analysis.hifp8 import grid_histogram, hifp8_seen_by_grid
from megatron.analysis.ranges import format_ranges
from megatron.analysis.statistics import load_json
from megatron.analysis.summarize import summarize_tensors
from megatron.quantization.formats import fake_quantize

SCHEMES = ("bf16", "linear_hifp8")
COMMON = dict(layers=2, seq=8, batch=2, hidden=64, ffn=64, attention=False,
              modules=("linear_fc1", "linear_fc2"))
# HiF8's regions from small to large magnitude, the two sides of the taper apart (the
# documented bounds; the figure's bar order).
SIDED = ((0.0, 2.0 ** -23), (2.0 ** -23, 2.0 ** -15), (2.0 ** -15, 2.0 ** -7),
         (2.0 ** -7, 2.0 ** -3), (2.0 ** -3, 2.0 ** 4), (2.0 ** 4, 2.0 ** 8),
         (2.0 ** 8, 40960.0), (40960.0, math.inf))


def _analyse(root, out, *extra):
    """The analysis of `root` into `out`; returns {figure file: its Figure} as drawn."""
    figures = {}
    save = Figure.savefig

    def keep(fig, fname, *args, **kwargs):
        figures[os.path.basename(str(fname))] = fig
        return save(fig, fname, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Figure, "savefig", keep)
        code = main(["--tensor-dir", str(root), "--output-dir", str(out), "--workers", "1",
                     "--no-progress", "--log-level", "WARNING", *extra])
    assert code == 0
    return figures


FIGURES = {}


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture")
    synthetic.write_capture(str(root), ("bf16",), **COMMON)
    synthetic.write_capture(str(root), ("linear_hifp8",), hifp8_scaling="tensor", **COMMON)
    out = tmp_path_factory.mktemp("report")
    FIGURES.update(_analyse(root, out))
    return root, out, load_json(os.path.join(out, "statistics.json"))


@pytest.fixture(scope="module")
def unscaled(tmp_path_factory):
    """The same runs with HiF8 unscaled (--hifp8-scaling none): (statistics, figures)."""
    root = tmp_path_factory.mktemp("capture_unscaled")
    synthetic.write_capture(str(root), SCHEMES, **COMMON)
    out = tmp_path_factory.mktemp("report_unscaled")
    figures = _analyse(root, out, "--no-progress")
    return load_json(os.path.join(out, "statistics.json")), figures


def _records(root, scheme):
    directory = os.path.join(root, scheme)
    manifest = next(f for f in os.listdir(directory) if f.startswith("manifest-"))
    for line in open(os.path.join(directory, manifest)):
        entry = json.loads(line)
        yield torch.load(os.path.join(directory, entry["file"]), weights_only=True)


def _regions(magnitudes):
    """HiF8 regions of finite nonzero magnitudes, from the format's documented bounds."""
    mag = magnitudes[np.isfinite(magnitudes) & (magnitudes != 0)]
    bounds = {"underflow": (0, 2.0 ** -23), "denormal": (2.0 ** -23, 2.0 ** -15)}
    share = {name: np.mean((mag >= lo) & (mag < hi)) for name, (lo, hi) in bounds.items()}
    share["mant1"] = np.mean(((mag >= 2.0 ** -15) & (mag < 2.0 ** -7)) |
                             ((mag >= 2.0 ** 8) & (mag < 40960)))
    share["mant2"] = np.mean(((mag >= 2.0 ** -7) & (mag < 2.0 ** -3)) |
                             ((mag >= 2.0 ** 4) & (mag < 2.0 ** 8)))
    share["mant3"] = np.mean((mag >= 2.0 ** -3) & (mag < 2.0 ** 4))
    share["overflow"] = np.mean(mag >= 40960)
    return share


def test_synthetic_scaled_records_reproduce(analysed):
    root, _, _ = analysed
    scaled = [r for r in _records(root, "linear_hifp8") if r["metadata"]["format"] == "hifp8"]
    assert scaled
    for record in scaled:
        meta, x = record["metadata"], record["tensor"]
        assert meta["hifp8_scaling"] == "tensor"
        k = meta["hifp8_scale_exponent"]
        amax = float(x.double().abs().max())
        assert 8 <= amax * 2.0 ** k < 16            # the default target binade [2^3, 2^4)
        expected = (fake_quantize(x.double() * 2.0 ** k, "hifp8", saturate=True)
                    * 2.0 ** -k).to(x.dtype)
        assert torch.equal(record["quantized"], expected)


def test_grid_and_unscaled_regions(analysed):
    root, _, doc = analysed
    records = [r for r in _records(root, "linear_hifp8") if r["metadata"]["format"] == "hifp8"]
    hp = np.concatenate([r["tensor"].double().abs().numpy().ravel() for r in records])
    seen = np.concatenate([(r["tensor"].double().abs() * 2.0 ** r["metadata"]
                            ["hifp8_scale_exponent"]).numpy().ravel() for r in records])
    quantized = doc["quant_types"]["linear_hifp8"]["by_format"]["hifp8"]
    assert quantized["hifp8_scaled_records"] == len(records)
    for name, value in _regions(seen).items():
        assert quantized["hifp8_grid_regions"][name] == pytest.approx(value, abs=1e-12)
    for name, value in _regions(hp).items():
        assert quantized["hifp8_regions"][name] == pytest.approx(value, abs=1e-12)
    # Scaling moves values into the 3-bit region: the point of the scale.
    assert quantized["hifp8_grid_regions"]["mant3"] > quantized["hifp8_regions"]["mant3"]
    assert doc["consistency"]["records_mismatched"] == 0 and doc["problems"] == []


def test_reports_show_both_views(analysed):
    _, out, _ = analysed
    text = (out / "statistics.txt").read_text()
    html = (out / "report.html").read_text()
    for page in (text, html):
        assert "HiF8 grid (scaled x2^k, " in page and "unscaled values" in page
    figures = {f["file"]: f for f in load_json(str(out / "statistics.json"))["figures"]}
    assert "as the HiF8 grid saw them" in figures["hifp8_regions.png"]["caption"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_saturation_is_counted_on_the_scaled_grid(dtype):
    """k = 2: 20000 * 4 = 80000 overflows HiF8 and is clamped to 32768 = 4 * 8192."""
    x = torch.tensor([20000.0, 9000.0, 1.0, -0.5, 0.0, -12000.0], dtype=dtype)
    k = 2
    q = (fake_quantize(x.double() * 2.0 ** k, "hifp8", saturate=True) * 2.0 ** -k).to(dtype)
    stats = summarize_tensors(x, q, hifp8_seen_by_grid(format_ranges("hifp8"), k))
    expected = int(np.sum(np.abs(q.double().numpy()) * 2.0 ** k >= 32768))
    assert expected == 3                       # 20000, 9000 and -12000 (times 4 >= 32768)
    assert stats.saturated == expected
    unscaled = summarize_tensors(x, q, format_ranges("hifp8"))
    assert unscaled.saturated == 0             # |q| < 32768: the unscaled rule misses them


def test_grid_histogram_is_the_histogram_of_the_scaled_values():
    hist = np.zeros(NBINS, dtype=np.int64)
    values = [2.0 ** -30, 1.5 * 2.0 ** -3, 3.0, 2.0 ** 140]
    for v in values:
        hist[bin_index_of_value(v)] += 1
    for k in (5, -7):
        expected = np.zeros(NBINS, dtype=np.int64)
        for v in values:
            expected[min(NBINS - 1, max(0, bin_index_of_value(v) + 4 * k))] += 1
        shifted = grid_histogram(hist, k)
        assert shifted.tolist() == expected.tolist()
        assert shifted.sum() == hist.sum()
    # The bin of 1.5 * 2^-3 moved by k = 3 is the bin of 1.5 itself.
    assert np.flatnonzero(grid_histogram(hist, 3))[1] == bin_index_of_value(1.5)


def test_frame_carries_the_scaling_columns(analysed):
    root, _, _ = analysed
    frame = load_frame(str(root), schemes=["linear_hifp8"])
    hif8 = frame[frame.format == "hifp8"]
    assert len(hif8) > 0 and set(hif8.hifp8_scaling) == {"tensor"}
    records = {r["metadata"]["counter"]: r["metadata"] for r in _records(root, "linear_hifp8")}
    paths = dict(zip(hif8.path, hif8.hifp8_scale_exponent))
    for meta in records.values():
        if meta["format"] == "hifp8":
            match = [p for p in paths if f"_{meta['counter']:06d}_" in os.path.basename(p)]
            assert paths[match[0]] == meta["hifp8_scale_exponent"]
    assert frame[frame.format == "none"].hifp8_scaling.isna().all()


def test_manifest_only_mode_reads_both_views_from_the_writer(analysed, tmp_path):
    """The writer's hifp8_regions of a scaled record are the grid's, hifp8_regions_unscaled
    those of the values as captured; --manifest-only must not mix them up."""
    root, _, full = analysed
    code = main(["--tensor-dir", str(root), "--output-dir", str(tmp_path), "--manifest-only",
                 "--no-figures", "--no-progress", "--workers", "1", "--log-level", "WARNING"])
    assert code == 0
    fast = load_json(str(tmp_path / "statistics.json"))
    ours = full["quant_types"]["linear_hifp8"]["by_format"]["hifp8"]
    theirs = fast["quant_types"]["linear_hifp8"]["by_format"]["hifp8"]
    assert theirs["records_with_tensors"] == 0
    assert theirs["hifp8_scaled_records"] == ours["hifp8_scaled_records"]
    for view in ("hifp8_regions", "hifp8_grid_regions"):
        for name, value in ours[view].items():
            assert theirs[view][name] == pytest.approx(value, abs=1e-9)


# -- every HiF8 panel and table follows the run's scaling ------------------------------------

def _cls(tensor_name):
    return ("gradient" if tensor_name.startswith("grad") else
            "weight" if tensor_name.startswith("weight") else "activation")


def _k_of_amax(amax):
    """The per-tensor rule of --hifp8-scaling tensor: amax * 2^k in [8, 16)."""
    _, e = math.frexp(amax)
    return 3 + 1 - e


def _sided(magnitudes):
    mag = magnitudes[np.isfinite(magnitudes) & (magnitudes != 0)]
    return np.array([np.mean((mag >= lo) & (mag < hi)) for lo, hi in SIDED])


def _hif8_ids(root):
    return {(r["metadata"]["layer_idx"], os.path.basename(r["metadata"]["module"]),
             r["metadata"]["tensor_name"])
            for r in _records(root, "linear_hifp8") if r["metadata"]["format"] == "hifp8"}


def _bf16_cast_magnitudes(root, scaled):
    """|x| (times each record's own 2^k when `scaled`) of the bf16 records of the tensors
    HiF8 quantized, per (tensor class, operation)."""
    ids = _hif8_ids(root)
    out = {}
    for r in _records(root, "bf16"):
        m = r["metadata"]
        if (m["layer_idx"], os.path.basename(m["module"]), m["tensor_name"]) not in ids:
            continue
        x = r["tensor"].double().abs().numpy().ravel()
        k = _k_of_amax(float(x.max())) if scaled else 0
        out.setdefault((_cls(m["tensor_name"]), m["operation"]), []).append(x * 2.0 ** k)
    return {key: np.concatenate(parts) for key, parts in out.items()}


def _bars(fig):
    """{row label: the 8 sided region shares drawn} of the HiF8 regions figure."""
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    return {label: np.array([c.patches[j].get_width() / 100.0 for c in ax.containers])
            for j, label in enumerate(labels)}


def test_regions_figure_casts_the_reference_with_the_runs_scaling(analysed):
    root, _, _ = analysed
    bars = _bars(FIGURES["hifp8_regions.png"])
    expected = _bf16_cast_magnitudes(root, scaled=True)
    assert expected
    for (cls, op), magnitudes in expected.items():
        label = f"bf16 · {cls} ({'fwd' if op == 'forward' else 'bwd'}) · if cast, x·2^k"
        np.testing.assert_allclose(bars[label], _sided(magnitudes), atol=1e-12)
    # No reference row reads the other run's tensors unscaled in a scaled run.
    assert not [label for label in bars if label.endswith("· if cast")]


def test_regions_figure_of_an_unscaled_run_casts_unscaled(analysed, unscaled):
    root, _, _ = analysed
    _, figures = unscaled
    bars = _bars(figures["hifp8_regions.png"])
    assert not [label for label in bars if "x·2^k" in label]
    assert [label for label in bars if label.endswith("· if cast")]


def _binned_density(magnitudes):
    """{(E, quarter): fraction per binade} of the histogram layout (bin (E, q) holds
    [2^E (1 + q/4), 2^E (1 + (q+1)/4))), computed here with frexp."""
    mag = magnitudes[np.isfinite(magnitudes) & (magnitudes != 0)]
    mant, exp = np.frexp(mag)
    quarter = np.floor((2.0 * mant - 1.0) * 4).astype(int)
    keys, counts = np.unique(np.stack([exp - 1, quarter]), axis=1, return_counts=True)
    out = {}
    for (e, q), count in zip(keys.T, counts):
        width = math.log2(1 + (q + 1) / 4) - math.log2(1 + q / 4)
        out[(int(e), int(q))] = count / mag.size / width
    return out


def test_value_distribution_panel_shows_what_the_grid_saw(analysed):
    root, _, _ = analysed
    fig = FIGURES["value_distributions.png"]
    ax = next(a for a in fig.axes if a.get_title().startswith("hifp8 "))
    assert "per-tensor scale" in ax.get_title()
    curves = [p for p in ax.patches if isinstance(p, StepPatch)]
    assert len(curves) == 2                      # forward and backward operands
    for op in ("forward", "backward"):
        seen = np.concatenate([
            r["tensor"].double().abs().numpy().ravel() * 2.0 ** r["metadata"]
            ["hifp8_scale_exponent"] for r in _records(root, "linear_hifp8")
            if r["metadata"]["format"] == "hifp8" and r["metadata"]["operation"] == op])
        expected = _binned_density(seen)
        curve = next(c for c in curves if (c.get_linestyle() in ("-", "solid"))
                     == (op == "forward"))
        values, edges, _ = curve.get_data()
        drawn = {}
        for value, left in zip(values, edges[:-1]):
            if np.isfinite(value):
                e = math.floor(left + 1e-12)
                drawn[(e, round((2.0 ** (left - e) - 1) * 4))] = value
        assert drawn.keys() == expected.keys()
        for key, value in expected.items():
            assert drawn[key] == pytest.approx(value, rel=1e-9)
        assert edges[-1] <= 4.0                  # amax * 2^k < 16 for every record


def test_magnitude_figure_shades_hifp8_regions_only_when_unscaled(analysed, unscaled):
    def legend_texts(fig):
        return [t.get_text() for legend in fig.legends for t in legend.get_texts()]

    _, out, doc = analysed
    captions = {f["file"]: f["caption"] for f in doc["figures"]}
    assert "3-bit mantissa" not in legend_texts(FIGURES["absolute_distributions.png"])
    assert "No HiF8 regions are shaded" in captions["absolute_distributions.png"]
    assert "per-tensor HiF8 scaling" in captions["layer_absmax.png"]
    plain, figures = unscaled
    assert "3-bit mantissa" in legend_texts(figures["absolute_distributions.png"])
    plain_captions = {f["file"]: f["caption"] for f in plain["figures"]}
    assert "without scaling keeps" in plain_captions["absolute_distributions.png"]
    assert "per-tensor" not in plain_captions["layer_absmax.png"]
    assert "no per-tensor scaling" in plain_captions["value_distributions.png"]


def test_regions_table_casts_the_other_schemes_with_the_runs_scaling(analysed, unscaled):
    root, out, doc = analysed
    assert doc["hifp8_scaling"] == {"linear_hifp8": "tensor"}
    by_class = doc["comparison"]["by_tensor_class"]["bf16"]
    magnitudes = {}
    for r in _records(root, "bf16"):
        x = r["tensor"].double().abs().numpy().ravel()
        magnitudes.setdefault(_cls(r["metadata"]["tensor_name"]), []).append(
            x * 2.0 ** _k_of_amax(float(x.max())))
    for cls, parts in magnitudes.items():
        seen = np.concatenate(parts)
        for name, value in _regions(seen).items():
            assert by_class[cls]["hifp8_tensor_scaled_regions"][name] == \
                pytest.approx(value, abs=1e-12)
    text = (out / "statistics.txt").read_text()
    rows = [line for line in text.splitlines() if line.startswith("bf16 ")
            and "if cast with a per-tensor scale" in line]
    assert len(rows) == len(magnitudes)
    plain, _ = unscaled
    assert plain["hifp8_scaling"] == {"linear_hifp8": "none"}
    from megatron.analysis.tables import hifp8_table
    views = {row[2][0] for row in hifp8_table(plain).rows}
    assert "if cast with a per-tensor scale" not in views
