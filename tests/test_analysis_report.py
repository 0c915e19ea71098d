"""The report's provenance header, like-for-like comparisons across schemes and figure
details (scale-exponent range, heat-map labels)."""

import json
import os
from collections import defaultdict

import numpy as np
import pytest

from megatron.analysis import synthetic
from megatron.analysis.accumulators import N_SCALE, SCALE_MIN
from megatron.analysis.cli import main
from megatron.analysis.plots import HEAT_FONT_PT, _cell_text, _cells_fit, exponent_span
from megatron.analysis.statistics import load_json

SCHEMES = ("bf16", "FA_linear_mxfp8", "linear_mxfp4")
RUN_ARGS = {"model_preset": "llama-tiny", "lr": 0.003, "global_batch_size": 4,
            "micro_batch_size": 2, "seq_length": 8, "bf16": True, "fp16": False,
            "train_iters": 5, "mx_scale_mode": "floor", "seed": 1234,
            "git_describe": "v0.3-2-gabc1234", "quant_wgrad": "none", "quant_fprop": None,
            "quant_backward": True, "hifp8_scaling": "tensor"}
TRAINING_LOG = """\
------------------------ arguments ------------------------
  bf16 ................................... True
  global_batch_size ...................... 4
  hidden_size ............................ 32
  lr ..................................... 0.003
  micro_batch_size ....................... 2
  model_preset ........................... llama-tiny
  num_layers ............................. 1
  seq_length ............................. 8
  train_iters ............................ 30
-------------------- end of arguments ---------------------
 [2026-11-22 05:19:44] iteration        1/      30 | lm loss: 7.0E+00 |
 [2026-11-22 05:19:45] iteration        2/      30 | lm loss: 6.9E+00 |
 [2026-11-22 05:19:46] iteration        3/      30 | lm loss: 6.8E+00 |
"""


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture")
    synthetic.write_capture(str(root), SCHEMES, layers=1, seq=8, batch=1, hidden=32, ffn=32,
                            modules=("linear_fc1",), run_args=RUN_ARGS)
    log = root / "bf16.log"
    log.write_text(TRAINING_LOG)
    out = tmp_path_factory.mktemp("report")
    code = main(["--tensor-dir", str(root), "--loss-logs", f"bf16={log}", "--output-dir",
                 str(out), "--workers", "1", "--no-progress", "--log-level", "ERROR"])
    assert code == 0
    return root, out, load_json(os.path.join(out, "statistics.json"))


def test_provenance_header(analysed):
    _, out, doc = analysed
    prov = doc["provenance"]
    assert prov["schemes"] == sorted(SCHEMES)
    assert prov["captured_iterations"] == {s: "1" for s in SCHEMES}
    fields = prov["fields"]
    assert fields["model"]["value"] == "llama-tiny, 1 layer, hidden 32"
    assert fields["precision"]["value"] == "bf16"
    assert fields["batch"]["value"] == "global 4, micro 2"
    assert fields["lr"]["value"] == "0.003"
    assert fields["overrides"]["value"] == "--quant-wgrad none --hifp8-scaling tensor"
    assert fields["train_iters"]["by_value"] == {
        "30": ["bf16 training"], "5": sorted(f"{s} capture" for s in SCHEMES)}
    assert prov["commit"] == "v0.3-2-gabc1234"
    text = (out / "statistics.txt").read_text()
    html = (out / "report.html").read_text()
    lines = {line.split("  ")[0]: line.split("  ", 1)[1].strip() for line in
             text.split("== Run ==\n")[1].split("\n\n")[0].splitlines()}
    assert lines["model"] == "llama-tiny, 1 layer, hidden 32"
    assert lines["train iterations"].startswith("differs: 30 (bf16 training); 5 (")
    assert "<th>commit</th><td>v0.3-2-gabc1234</td>" in html
    assert "<th>captured iterations</th><td>1 (every scheme)</td>" in html


def _ids_by_scheme(root):
    """(layer, module, tensor name) -> records, and the quantized ones, per scheme, from the
    manifests."""
    captured, quantized = defaultdict(lambda: defaultdict(int)), defaultdict(set)
    for scheme in SCHEMES:
        directory = os.path.join(root, scheme)
        manifest = next(f for f in os.listdir(directory) if f.startswith("manifest-"))
        for line in open(os.path.join(directory, manifest)):
            m = json.loads(line)["metadata"]
            key = (m["layer_idx"], m["module"].rsplit(".", 1)[-1], m["tensor_name"])
            captured[scheme][key] += 1
            if m["format"] != "none":
                quantized[scheme].add(key)
    return captured, quantized


def test_schemes_are_compared_on_the_same_tensors(analysed):
    root, _, doc = analysed
    captured, quantized = _ids_by_scheme(root)
    common = set.intersection(*(set(c) for c in captured.values()))
    comparison = doc["comparison"]
    assert comparison["tensors_in_every_scheme"] == len(common)
    for scheme in SCHEMES:
        left = {k: n for k, n in captured[scheme].items() if k not in common}
        if left:
            item = comparison["left_out"][scheme]
            assert item["records"] == sum(left.values())
            assert item["tensor_names"] == sorted({k[2] for k in left})
        else:
            assert scheme not in comparison["left_out"]
        assert comparison["per_scheme"][scheme]["records"] == sum(
            n for k, n in captured[scheme].items() if k in common)
    assert "bf16" not in comparison["left_out"]                 # bf16 has the fewest tensors
    assert "input_wgrad" in comparison["left_out"]["FA_linear_mxfp8"]["tensor_names"]


def test_format_comparison_is_over_operands_every_quantized_scheme_quantized(analysed):
    root, out, doc = analysed
    _, quantized = _ids_by_scheme(root)
    both = quantized["FA_linear_mxfp8"] & quantized["linear_mxfp4"]
    assert doc["comparison"]["quantized_schemes"] == ["FA_linear_mxfp8", "linear_mxfp4"]
    assert doc["comparison"]["quantized_operands_in_every_quantized_scheme"] == len(both)
    rows = {(r["quant_type"], r["operation"]): r["records"] for r in doc["format_comparison"]}
    for scheme in ("FA_linear_mxfp8", "linear_mxfp4"):
        for op in ("forward", "backward"):
            expected = 0
            directory = os.path.join(root, scheme)
            manifest = next(f for f in os.listdir(directory) if f.startswith("manifest-"))
            for line in open(os.path.join(directory, manifest)):
                m = json.loads(line)["metadata"]
                key = (m["layer_idx"], m["module"].rsplit(".", 1)[-1], m["tensor_name"])
                expected += m["format"] != "none" and m["operation"] == op and key in both
            assert rows[(scheme, op)] == expected
    everything = {(r["quant_type"], r["operation"]): r["records"]
                  for r in doc["format_comparison_all"]}
    # FA_linear_mxfp8 also quantizes attention operands, which linear_mxfp4 does not.
    assert everything[("FA_linear_mxfp8", "forward")] > rows[("FA_linear_mxfp8", "forward")]
    assert everything[("linear_mxfp4", "forward")] == rows[("linear_mxfp4", "forward")]
    left = doc["comparison"]["left_out_quantized"]["FA_linear_mxfp8"]["tensor_names"]
    assert {"query", "key", "grad_scores"} <= set(left)
    text = (out / "statistics.txt").read_text()
    assert "Left out as not quantized by every quantized scheme: FA_linear_mxfp8:" in text


def test_cross_scheme_figures_say_what_they_compare(analysed):
    _, _, doc = analysed
    captions = {f["file"]: f["caption"] for f in doc["figures"]}
    for name in ("format_overview.png", "forward_backward.png", "value_distributions.png"):
        assert "operands every quantized scheme quantized" in captions[name]
    for name in ("absolute_distributions.png", "layer_absmax.png"):
        assert "tensors (layer, module, tensor name) every scheme captured" in captions[name]
    assert "every scheme captured" not in captions["error_heatmap_FA_linear_mxfp8.png"]


def test_scale_exponent_range_leaves_out_the_all_zero_spike():
    hist = np.zeros(N_SCALE, dtype=np.int64)
    hist[0] = 10_000                         # e = -127: all-zero blocks
    hist[-20 - SCALE_MIN] = 5
    hist[-9 - SCALE_MIN] = 7
    assert exponent_span([hist]) == (-20, -9)
    spike_only = np.zeros(N_SCALE, dtype=np.int64)
    spike_only[0] = 3
    assert exponent_span([spike_only]) == (-127, -127)


def test_heat_map_labels_are_readable():
    assert HEAT_FONT_PT >= 8
    assert _cell_text("sqnr_db", 30.46) == "30"
    assert _cell_text("mse", -4.0312) == "-4.0"
    assert [_cell_text("saturated_fraction", v) for v in (0.0, 0.0038, 0.7277, 17.2)] == [
        "0", "0.004", "0.7", "17"]
    assert _cells_fit([["30", "0.004"]], (40.0, 23.0))
    assert not _cells_fit([["0.004"]], (20.0, 23.0))          # too narrow: numbers dropped
