"""The report's summary table and provenance header, like-for-like comparisons across
schemes and figure details (legible text, figure widths, shared colour scales, scale-exponent
range, heat-map labels)."""

import json
import math
import os
import re
from collections import defaultdict

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from megatron.analysis import synthetic
from megatron.analysis.accumulators import N_SCALE, SCALE_MIN
from megatron.analysis.cli import main
from megatron.analysis.plots import (COLUMN_IN, DPI, HEAT_FONT_PT, SMALL_PT, _cell_text,
                                     _cells_fit, exponent_span, smallest_text_pt)
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
    assert HEAT_FONT_PT >= 9
    assert _cell_text("sqnr_db", 30.46) == "30"
    assert _cell_text("mse", -4.0312) == "-4.0"
    assert _cell_text("mse", -0.04) == "0.0"                  # never "-0.0"
    assert _cell_text("flushed_fraction", 9.96) == "10"
    assert [_cell_text("saturated_fraction", v) for v in (0.0, 0.0038, 0.7277, 17.2)] == [
        "0", "0.004", "0.7", "17"]
    assert _cells_fit([["30", "0.004"]], (40.0, 23.0))
    assert not _cells_fit([["0.004"]], (20.0, 23.0))          # too narrow: numbers dropped


# -- the summary table -------------------------------------------------------------------------

SUMMARY_HEADERS = ["quant type", "worst site (lowest SQNR)", "saturated", "flushed to zero",
                   "median SQNR dB", "worst SQNR dB", "loss gap to bf16"]


def _site_sqnr(root, scheme):
    """{site label: SQNR dB} of a scheme's quantized operands, from its record files: one site
    per (layer, module, tensor name), sums of x^2 and (q - x)^2 over all its records."""
    directory = os.path.join(root, scheme)
    manifest = next(f for f in os.listdir(directory) if f.startswith("manifest-"))
    sums = defaultdict(lambda: [0.0, 0.0])
    for line in open(os.path.join(directory, manifest)):
        entry = json.loads(line)
        m = entry["metadata"]
        if m["format"] == "none":
            continue
        record = torch.load(os.path.join(directory, entry["file"]), weights_only=True)
        x, q = record["tensor"].double(), record["quantized"].double()
        site = f"L{m['layer_idx']}.{m['module'].rsplit('.', 1)[-1]} {m['tensor_name']}"
        sums[site][0] += float((x * x).sum())
        sums[site][1] += float(((q - x) ** 2).sum())
    return {site: 10 * math.log10(x2 / e2) for site, (x2, e2) in sums.items() if e2 > 0}


def test_summary_table_heads_every_report(analysed):
    root, out, doc = analysed
    table = doc["summary"]
    assert table["headers"] == SUMMARY_HEADERS
    rows = {row[0]: dict(zip(table["headers"], row)) for row in table["rows"]}
    assert sorted(rows) == sorted(SCHEMES)
    assert rows["bf16"] == {**{h: None for h in SUMMARY_HEADERS}, "quant type": "bf16",
                            "loss gap to bf16": "baseline"}
    for scheme in ("FA_linear_mxfp8", "linear_mxfp4"):
        row, sites = rows[scheme], _site_sqnr(root, scheme)
        worst = min(sites, key=sites.get)
        assert row["worst site (lowest SQNR)"] == worst
        assert row["worst SQNR dB"] == pytest.approx(sites[worst], rel=1e-9)
        assert row["median SQNR dB"] == pytest.approx(np.median(list(sites.values())),
                                                      rel=1e-9)
        quantization = doc["quant_types"][scheme]["quantized"]["quantization"]
        assert row["saturated"] == quantization["saturated_fraction"] > 0
        assert row["flushed to zero"] == quantization["flushed_fraction"] > 0
        assert row["loss gap to bf16"] is None            # this scheme logged no loss
    # First in statistics.txt, and right under the header of report.html.
    text = (out / "statistics.txt").read_text()
    assert text.index("== Summary ==") < text.index("== Run ==")
    bf16_line = next(line for line in text.split("== Summary ==")[1].splitlines()
                     if line.startswith("bf16 "))
    assert bf16_line.split()[1:] == ["\u2014"] * 5 + ["baseline"]
    html = (out / "report.html").read_text()
    assert html.index("<table id='summary'") < html.index("<nav>") < html.index("id='run'")
    assert "the worst site has the lowest SQNR" in html


def test_summary_loss_gap_comes_with_its_noise_statement(tmp_path):
    logs = {}
    for name, offset in (("bf16", 0.0), ("FA_linear_mxfp4", 0.05)):
        lines = [f" [2026-11-22 05:19:44] iteration {it:8d}/      40 | lm loss: "
                 f"{6.0 + offset + 0.01 * ((it * 7) % 5):.6E} |" for it in range(1, 41)]
        logs[name] = tmp_path / f"{name}.log"
        logs[name].write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    assert main(["--loss-logs"] + [f"{n}={p}" for n, p in logs.items()] + [
        "--output-dir", str(out), "--no-progress", "--log-level", "ERROR"]) == 0
    doc = load_json(str(out / "statistics.json"))
    rows = {row[0]: row for row in doc["summary"]["rows"]}
    gap = next(r for r in doc["losses"]["table"] if r["run"] == "FA_linear_mxfp4")
    cell = rows["FA_linear_mxfp4"][-1]
    assert cell.startswith(f"{gap['gap_to_baseline']:+.3g} \u00b1 {gap['gap_spread']:.2g} (")
    assert cell.endswith("beyond the curves' spread" if not gap["gap_within_noise"]
                         else "within the curves' spread")
    assert rows["bf16"][-1] == "baseline"
    assert any("not seed-to-seed noise" in note for note in doc["summary"]["notes"])


# -- legible figures -----------------------------------------------------------------------

def _tensorboard(directory):
    from torch.utils.tensorboard import SummaryWriter

    for scheme in ("FA_linear_mxfp8", "FA_linear_hifp8"):
        writer = SummaryWriter(log_dir=str(directory / scheme))
        for step in (10, 20, 30):
            for layer in (1, 2):
                for operand in ("fprop.input", "dgrad.grad_output"):
                    tag = f"quant/L{layer}.linear_fc1/{operand}"
                    writer.add_scalar(f"{tag}/sqnr_db", 30.0 - step / 10 - layer, step)
                    for metric in ("saturated_pct", "flushed_pct", "amax"):
                        writer.add_scalar(f"{tag}/{metric}", step / 10 + layer, step)
        writer.close()


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """Every figure of a report (capture, loss logs, telemetry) as drawn: {file: Figure}."""
    root = tmp_path_factory.mktemp("legible")
    synthetic.write_capture(str(root / "tensors"), ("bf16", "FA_linear_mxfp8", "linear_mxfp4"),
                            layers=2, seq=8, batch=1, hidden=32, ffn=32,
                            modules=("linear_fc1",))
    synthetic.write_capture(str(root / "tensors"), ("FA_linear_hifp8",), layers=2, seq=8,
                            batch=1, hidden=32, ffn=32, modules=("linear_fc1",))
    _tensorboard(root / "tb")
    for name in ("bf16", "FA_linear_mxfp8"):
        (root / f"{name}.log").write_text("".join(
            f" [2026-11-22 05:19:44] iteration {it:8d}/      20 | lm loss: {7 - it / 10:.6E} |\n"
            for it in range(1, 21)))
    figures, save = {}, Figure.savefig

    def keep(fig, fname, *args, **kwargs):
        figures[os.path.basename(str(fname))] = fig
        return save(fig, fname, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Figure, "savefig", keep)
        assert main(["--tensor-dir", str(root / "tensors"), "--tensorboard-dir",
                     str(root / "tb"), "--loss-logs", f"bf16={root / 'bf16.log'}",
                     f"FA_linear_mxfp8={root / 'FA_linear_mxfp8.log'}", "--output-dir",
                     str(root / "out"), "--workers", "1", "--no-progress",
                     "--log-level", "ERROR"]) == 0
    return figures


def test_no_figure_text_is_smaller_than_the_smallest_size(drawn):
    assert SMALL_PT >= 9
    assert {"loss_curves.png", "telemetry_over_iterations.png", "telemetry_layers.png",
            "hifp8_regions.png", "error_heatmap_FA_linear_mxfp8.png"} <= set(drawn)
    small = {name: smallest_text_pt(fig) for name, fig in drawn.items()}
    assert {name: size for name, size in small.items() if size < SMALL_PT} == {}


def test_figures_fit_the_report_column(drawn):
    """The report shows figures at their own size: fixed layouts fit its text column; only the
    heat maps grow with the number of operands (and scroll)."""
    column_px = COLUMN_IN * DPI
    wide = {name: fig.get_size_inches()[0] * DPI for name, fig in drawn.items()
            if fig.get_size_inches()[0] * DPI > column_px + 0.5}
    assert all(name.startswith("error_heatmap_") for name in wide), wide


def test_heat_maps_share_one_colour_scale_per_metric(drawn):
    maps = {name: [ax.images[0] for ax in fig.axes if ax.images]
            for name, fig in drawn.items() if name.startswith("error_heatmap_")}
    assert len(maps) == 3
    scales = {name: [(im.norm.vmin, im.norm.vmax) for im in images]
              for name, images in maps.items()}
    assert len(set(map(tuple, scales.values()))) == 1, scales
    # The shared SQNR scale spans every scheme's operands: MXFP4 is the worst, HiF8 the best.
    (low, high), data = scales["error_heatmap_linear_mxfp4.png"][0], {
        name: images[0].get_array() for name, images in maps.items()}
    assert low == pytest.approx(np.nanmin(data["error_heatmap_linear_mxfp4.png"]))
    assert high == pytest.approx(max(np.nanmax(d) for d in data.values()))
    assert low < np.nanmin(data["error_heatmap_FA_linear_hifp8.png"])
    # Cell numbers are drawn at HEAT_FONT_PT (these cells are large enough for them).
    numbers = [t for t in drawn["error_heatmap_linear_mxfp4.png"].axes[0].texts
               if re.fullmatch(r"-?\d+(\.\d)?", t.get_text())]
    assert numbers and {t.get_fontsize() for t in numbers} == {HEAT_FONT_PT}


def test_compared_panels_share_their_axes(drawn):
    for name in ("absolute_distributions.png", "value_distributions.png",
                 "mx_scale_exponents.png"):
        axes = [ax for ax in drawn[name].axes if ax.get_visible()]
        assert len(axes) > 1
        assert all(axes[0].get_shared_y_axes().joined(axes[0], ax) for ax in axes), name
    telemetry = drawn["telemetry_layers.png"].axes
    sqnr = [ax for ax in telemetry if "SQNR" in ax.get_title()]
    assert len(sqnr) == 2 and sqnr[0].get_shared_y_axes().joined(*sqnr)
