"""Analysis of captures holding NVFP4, MXFP6 and FP8 records (synthetic, quantized as training
quantizes them): loading, validation of the new metadata, statistics with the scales, the
report's NVFP4 block-scale figure and table, manifest-only mode and the notebook frame."""

import copy
import json
import math
import os
import shutil

import pytest
import torch

from megatron.analysis import analyze, load_frame, load_tensors, Options, synthetic
from megatron.analysis.loading import Problems, read_capture
from megatron.analysis.ranges import describe, format_ranges
from megatron.analysis.statistics import load_json
from megatron.analysis.validation import check_manifest_item
from megatron.tensor_capture.load import read_manifest
from megatron.tensor_capture.replay import requantize

COMMON = dict(layers=2, seq=16, batch=1, hidden=32, ffn=64)
SCHEMES = ("bf16", "FA_linear_nvfp4", "FA_linear_mxfp6_e2m3", "linear_fp8")


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture")
    synthetic.write_capture(str(root), SCHEMES[:3], weight_2d=True, stochastic=True, **COMMON)
    synthetic.write_capture(str(root), SCHEMES[3:], fp8_recipe="delayed", **COMMON)
    return str(root)


@pytest.fixture(scope="module")
def analysed(capture, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("report"))
    result = analyze(Options(tensor_dirs=[capture], output_dir=out, workers=2,
                             progress=False))
    assert result.produced and result.error is None
    return out, load_json(os.path.join(out, "statistics.json"))


def test_synthetic_records_reproduce_like_training(capture):
    """The synthetic capture follows the format: every quantized record's q is rebuilt from
    its metadata (stochastic rounding, 2-D tiles and delayed amaxes included)."""
    seen = set()
    for scheme in SCHEMES[1:]:
        for entry in read_manifest(os.path.join(capture, scheme)):
            meta = entry["metadata"]
            if meta["format"] == "none":
                continue
            record = torch.load(entry["path"], weights_only=True)
            assert torch.equal(requantize(record["tensor"], meta), record["quantized"])
            seen |= {k for k in ("stochastic_seed", "tensor_amax", "fp8_scaling") if k in meta}
            if meta.get("block_2d"):
                seen.add("block_2d")
    assert seen == {"stochastic_seed", "tensor_amax", "fp8_scaling", "block_2d"}


def test_statistics_carry_the_scales(analysed):
    out, doc = analysed
    assert doc["problems"] == []
    assert doc["consistency"]["records_checked"] > 100
    assert doc["consistency"]["records_mismatched"] == 0
    for fmt in ("nvfp4", "mxfp6_e2m3", "fp8_e4m3"):
        assert doc["formats"][fmt]["kind"] == format_ranges(fmt).kind
        assert doc["formats"][fmt]["description"] == describe(fmt)
    assert "E4M3 scale per block of 16" in doc["formats"]["nvfp4"]["scale"]
    sections = doc["quant_types"]
    nvfp4 = sections["FA_linear_nvfp4"]["quantized"]["quantization"]
    blocks = nvfp4["nvfp4_block_scales"]
    # The synthetic gradients hold nearly vanished rows: zero and subnormal block scales.
    assert blocks["zero_fraction"] > 0 and blocks["subnormal_fraction"] > 0
    assert blocks["zero_fraction"] + blocks["subnormal_fraction"] + \
        blocks["normal_fraction"] == pytest.approx(1.0)
    assert blocks["exponent_hist"]["min"] >= -9
    assert nvfp4["scales"]["block_scale_max"] == 448.0          # the tensor amax's block
    assert 0 < nvfp4["scales"]["tensor_scale_min"] <= nvfp4["scales"]["tensor_scale_max"]
    fp8 = sections["linear_fp8"]["quantized"]["quantization"]
    assert fp8["saturated_fraction"] > 0                  # delayed: the top quarter saturates
    assert "nvfp4_block_scales" not in fp8 and fp8["scales"]["blocks"] == 0
    mx = sections["FA_linear_mxfp6_e2m3"]["quantized"]["quantization"]
    assert mx["scale_exponent"] is not None and "scales" not in mx
    rows = {(r["quant_type"], r["format"], r["tensor_class"], r["operation"]): r
            for r in doc["scales"]}
    gradient = rows[("FA_linear_nvfp4", "nvfp4", "gradient", "backward")]
    assert gradient["nvfp4_block_scales"]["zero_fraction"] > 0
    assert rows[("linear_fp8", "fp8_e4m3", "activation", "forward")]["tensor_scale_min"] > 0


def test_report_draws_the_nvfp4_block_scales(analysed):
    out, doc = analysed
    files = {f["file"] for f in doc["figures"]}
    assert {"nvfp4_block_scales.png", "value_distributions.png", "mx_scale_exponents.png",
            "error_heatmap_FA_linear_nvfp4.png", "error_heatmap_linear_fp8.png"} <= files
    assert os.path.getsize(os.path.join(out, "figures", "nvfp4_block_scales.png")) > 10000
    html = open(os.path.join(out, "report.html"), encoding="utf-8").read()
    assert "NVFP4 block scales" in html and "Scales of NVFP4 and FP8 operands" in html
    text = open(os.path.join(out, "statistics.txt"), encoding="utf-8").read()
    assert "subnormal scale" in text and "FA_linear_nvfp4" in text


def test_manifest_only_mode_gives_the_same_block_counts(capture, analysed, tmp_path):
    _, doc = analysed
    result = analyze(Options(tensor_dirs=[capture], output_dir=str(tmp_path), workers=1,
                             progress=False, manifest_only=True, figures=False))
    quick = result.statistics["quant_types"]["FA_linear_nvfp4"]["quantized"]["quantization"]
    full = doc["quant_types"]["FA_linear_nvfp4"]["quantized"]["quantization"]
    assert quick["nvfp4_block_scales"] == full["nvfp4_block_scales"]
    assert quick["scales"] == full["scales"]
    assert quick["saturated_fraction"] == pytest.approx(full["saturated_fraction"])


def test_frame_columns_and_tensors(capture):
    frame = load_frame(capture, schemes=["FA_linear_nvfp4"])
    grads = frame[(frame.format == "nvfp4") & frame.tensor_name.str.startswith("grad_output")]
    assert grads.stochastic_seed.notna().all() and grads.tensor_amax.notna().all()
    assert (frame[frame.tensor_name == "weight"].block_2d == True).all()  # noqa: E712
    assert frame[frame.format == "nvfp4"].tensor_scale.notna().all()
    record = load_tensors(grads.head(1))[0]
    assert torch.equal(requantize(record["hp"], record["metadata"]), record["quantized"])


# -- validation of the new metadata ------------------------------------------------------------

def _line(capture, scheme, fmt, **where):
    for entry in read_manifest(os.path.join(capture, scheme)):
        meta = entry["metadata"]
        if meta["format"] == fmt and all(meta.get(k) == v for k, v in where.items()):
            entry.pop("path", None)
            return entry
    raise AssertionError(f"no {fmt} line in {scheme}")


BAD_FIELDS = [
    ("nvfp4", "stochastic_seed", -1), ("nvfp4", "stochastic_seed", 2 ** 63),
    ("nvfp4", "stochastic_seed", 1.5), ("nvfp4", "stochastic_seed", "7"),
    ("nvfp4", "tensor_amax", -1.0), ("nvfp4", "tensor_amax", "big"),
    ("nvfp4", "tensor_amax", True), ("nvfp4", "block_2d", 1), ("fp8_e4m3", "fp8_scaling", "x"),
    ("fp8_e4m3", "fp8_margin", math.nan), ("fp8_e4m3", "fp8_pow2_scale", "no"),
    ("fp8_e4m3", "fp8_block", [1, 64]), ("nvfp4", "rht_block", 24), ("nvfp4", "rht_block", "16"),
]


@pytest.mark.parametrize("fmt,key,value", BAD_FIELDS)
def test_bad_new_metadata_fields_are_named(capture, fmt, key, value):
    scheme = "FA_linear_nvfp4" if fmt == "nvfp4" else "linear_fp8"
    entry = copy.deepcopy(_line(capture, scheme, fmt, tensor_name="grad_output"))
    assert check_manifest_item(entry) is None
    entry["metadata"][key] = value
    why = check_manifest_item(entry)
    assert why is not None and why.startswith(f"metadata.{key}"), why


@pytest.mark.parametrize("change,message", [
    (lambda m: m.update(fp8_scaling="tensor"), "fp8_scaling = 'tensor' on a nvfp4 record"),
    (lambda m: (m.pop("tensor_amax"), m.pop("block_2d"), m.update(format="hifp8")),
     "stochastic_seed on a hifp8"),
    (lambda m: m.update(block_2d=True), "block_2d = true on a tensor of shape"),
    (lambda m: m.update(rht_block=128), "rht_block = 128 but the rotated axis"),
    (lambda m: (m.pop("tensor_amax"), m.update(format="mxfp4", tensor_amax=1.0)),
     "tensor_amax = 1.0 on a mxfp4 record"),
])
def test_contradicting_fields_are_explained(capture, change, message):
    entry = copy.deepcopy(_line(capture, "FA_linear_nvfp4", "nvfp4", tensor_name="grad_output"))
    change(entry["metadata"])
    why = check_manifest_item(entry)
    assert why is not None and message in why, why


def test_fp8_fields_must_agree(capture):
    entry = copy.deepcopy(_line(capture, "linear_fp8", "fp8_e4m3", tensor_name="input"))
    meta = entry["metadata"]
    del meta["tensor_amax"]
    assert "tensor_amax is missing" in check_manifest_item(entry)
    meta.update(fp8_scaling="block", tensor_amax=1.0)
    assert "fp8_block is missing" in check_manifest_item(entry)
    meta["fp8_block"] = [1, 128]
    assert "tensor_amax = 1.0 on a fp8_e4m3 record with fp8_scaling 'block'" in \
        check_manifest_item(entry)


def test_a_bad_line_skips_only_its_record(capture, tmp_path):
    """A non-finite tensor_amax is valid (written "nan"); a negative one skips the record."""
    directory = str(tmp_path / "FA_linear_nvfp4")
    shutil.copytree(os.path.join(capture, "FA_linear_nvfp4"), directory)
    manifest = next(os.path.join(directory, f) for f in os.listdir(directory)
                    if f.startswith("manifest-"))
    with open(manifest) as f:
        lines = [json.loads(line) for line in f]
    targets = [i for i, e in enumerate(lines) if e["metadata"]["format"] == "nvfp4"][:2]
    lines[targets[0]]["metadata"]["tensor_amax"] = "nan"
    lines[targets[1]]["metadata"]["tensor_amax"] = -2.0
    with open(manifest, "w") as f:
        f.write("".join(json.dumps(e) + "\n" for e in lines))
    problems = Problems()
    loaded = read_capture(directory, problems)
    assert len(loaded.entries) == len(lines) - 1
    assert [p["message"].split(": ", 1)[1] for p in problems.items] == \
        ["metadata.tensor_amax = -2.0: expected a number >= 0 (inf or nan for an operand "
         "holding them); record skipped"]
    decoded = next(e for e in loaded.entries if e.source.endswith(f":{targets[0] + 1}"))
    assert math.isnan(decoded.metadata["tensor_amax"])
