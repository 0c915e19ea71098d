"""HiF8 operands quantized with a per-tensor power-of-two scale: records carry
`hifp8_scaling: "tensor"` and `hifp8_scale_exponent` k; the analysis reports the region shares
of the values as the grid saw them (hp * 2^k) beside those of the unscaled values, and counts
saturation on the scaled grid."""

import json
import os

import numpy as np
import pytest
import torch

from megatron.analysis import load_frame, synthetic
from megatron.analysis.binning import NBINS, bin_index_of_value
from megatron.analysis.cli import main
from megatron.analysis.hifp8 import grid_histogram, hifp8_seen_by_grid
from megatron.analysis.ranges import format_ranges
from megatron.analysis.statistics import load_json
from megatron.analysis.summarize import summarize_tensors
from megatron.quantization.formats import fake_quantize

SCHEMES = ("bf16", "linear_hifp8")


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture")
    common = dict(layers=2, seq=8, batch=2, hidden=64, ffn=64, attention=False,
                  modules=("linear_fc1", "linear_fc2"))
    synthetic.write_capture(str(root), ("bf16",), **common)
    synthetic.write_capture(str(root), ("linear_hifp8",), hifp8_scaling="tensor", **common)
    out = tmp_path_factory.mktemp("report")
    code = main(["--tensor-dir", str(root), "--output-dir", str(out), "--workers", "1",
                 "--no-progress", "--log-level", "WARNING"])
    assert code == 0
    return root, out, load_json(os.path.join(out, "statistics.json"))


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
