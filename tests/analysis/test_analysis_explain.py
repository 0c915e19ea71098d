"""The report explains its alarming numbers where it shows them, shows HiF8 sections only
where HiF8 ran, and names the output layer `output`, never `L0`."""

import pytest
import torch

from megatron.analysis import synthetic
from megatron.analysis.cli import main
from megatron.analysis.statistics import load_json

ARGS = ["--no-progress", "--workers", "1", "--log-level", "ERROR"]


def _analyse(root, out, *extra):
    assert main(["--output-dir", str(out)] + ARGS + list(extra)) == 0
    return load_json(str(out / "statistics.json"))


@pytest.fixture(scope="module")
def floor_mxfp4(tmp_path_factory):
    root = tmp_path_factory.mktemp("floor")
    synthetic.write_capture(str(root / "tensors"), ("bf16", "linear_mxfp4"), layers=2, seq=8,
                            hidden=64, ffn=64, attention=False,
                            modules=("linear_fc1", "linear_proj"))
    out = root / "out"
    doc = _analyse(root, out, "--tensor-dir", str(root / "tensors"))
    return doc, out


def test_mx_floor_saturation_is_explained_under_the_summary(floor_mxfp4):
    doc, out = floor_mxfp4
    row = next(r for r in doc["summary"]["rows"] if r[0] == "linear_mxfp4")
    assert row[2] >= 0.01                               # the alarming share
    (saturation,) = [t for t in doc["summary"]["explanations"] if "saturated" in t]
    site = doc["quant_types"]["linear_mxfp4"]["quantized_sites"]["most_saturated"]["site"]
    assert saturation.startswith("linear_mxfp4: ") and site in saturation
    assert "floor(log2 amax) - 2" in saturation and "[4, 8)" in saturation
    assert "top 50%" in saturation and "--mx-scale-mode rceil" in saturation
    (flushed,) = [t for t in doc["summary"]["explanations"] if "flushed to zero" in t]
    assert "16 to 32 times below" in flushed
    html = (out / "report.html").read_text()
    glance = html.split("<section id='glance'>")[1].split("</section>")[0]
    assert "What the alarming numbers mean" in glance and "--mx-scale-mode rceil" in glance


def test_tables_further_down_repeat_it_in_one_sentence(floor_mxfp4):
    doc, out = floor_mxfp4
    notes = doc["explanations"]
    assert any("--mx-scale-mode rceil" in t for t in notes["tensors_linear_mxfp4"])
    assert any(t.startswith("linear_mxfp4 saturated: ") for t in notes["format_comparison"])
    assert notes["figure:error_heatmap_linear_mxfp4.png"]
    html = (out / "report.html").read_text()
    table = html.split("<h2 id='tensors_linear_mxfp4'>")[1].split("<h2")[0]
    assert "What the alarming numbers mean" in table
    heat = html.split("<figure id='error_heatmap_linear_mxfp4'>")[1].split("</figure>")[0]
    assert "Saturated cells: MX floor scale rule" in heat
    text = (out / "statistics.txt").read_text()
    assert text.count("What the alarming numbers mean:") >= 3


def test_an_rceil_capture_has_nothing_to_explain_about_saturation(tmp_path):
    synthetic.write_capture(str(tmp_path / "tensors"), ("linear_mxfp4",), layers=1, seq=8,
                            hidden=64, ffn=64, attention=False, scale_mode="rceil",
                            modules=("linear_fc1",))
    doc = _analyse(tmp_path, tmp_path / "out", "--tensor-dir", str(tmp_path / "tensors"),
                   "--no-figures")
    assert doc["mx_scale_modes"] == {"linear_mxfp4": "rceil"}
    assert doc["quant_types"]["linear_mxfp4"]["quantized"]["quantization"][
        "saturated_fraction"] == 0
    assert not any("saturated" in t for t in doc["summary"]["explanations"])


def test_telemetry_saturation_is_explained_under_the_telemetry_table(tmp_path):
    """The demo's case: about 22% of linear_proj's wgrad input saturated under MXFP8."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path / "tb" / "FA_linear_mxfp8"))
    for step in (5, 10):
        for metric, value in (("saturated_pct", 22.0), ("flushed_pct", 0.0),
                              ("sqnr_db", 28.0), ("scale_exp_min", -20.0)):
            writer.add_scalar(f"quant/L4.linear_proj/wgrad.input/{metric}", value, step)
    writer.close()
    doc = _analyse(tmp_path, tmp_path / "out", "--tensorboard-dir", str(tmp_path / "tb"))
    (text,) = doc["explanations"]["telemetry"]
    assert "22% of L4.linear_proj wgrad.input saturated" in text
    assert "E4M3 (mxfp8_e4m3) stops at 448" in text and "top 25%" in text
    assert "--mx-scale-mode rceil" in text
    html = (tmp_path / "out" / "report.html").read_text()
    assert "E4M3 (mxfp8_e4m3) stops at 448" in html.split("<h2 id='telemetry'>")[1]


def test_no_hifp8_sections_for_runs_without_hifp8(floor_mxfp4):
    doc, out = floor_mxfp4
    assert doc["hifp8_scaling"] == {}
    html = (out / "report.html").read_text()
    text = (out / "statistics.txt").read_text()
    assert "HiF8" not in html and "HiF8" not in text
    assert "hifp8_regions.png" not in {f["file"] for f in doc["figures"]}
    assert not (out / "figures" / "hifp8_regions.png").exists()


def test_hifp8_sections_where_hifp8_ran(tmp_path):
    synthetic.write_capture(str(tmp_path / "tensors"), ("bf16", "linear_hifp8"), layers=1,
                            seq=8, hidden=32, ffn=32, attention=False, modules=("linear_fc1",))
    doc = _analyse(tmp_path, tmp_path / "out", "--tensor-dir", str(tmp_path / "tensors"))
    html = (tmp_path / "out" / "report.html").read_text()
    assert "<h2 id='hifp8_regions'>HiF8 precision regions</h2>" in html
    assert "hifp8_regions.png" in {f["file"] for f in doc["figures"]}


def _stats(seed):
    from megatron.analysis.ranges import format_ranges
    from megatron.analysis.summarize import summarize_tensors
    from megatron.quantization.formats import fake_quantize

    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(seed)) * (1 + seed)
    return summarize_tensors(x, fake_quantize(x, "mxfp4", axis=-1), format_ranges("mxfp4"))


def test_the_output_layer_is_named_output_not_l0():
    from megatron.analysis.naming import display_site, layer_label
    from megatron.analysis.statistics import quantized_layers, quantized_sites
    from megatron.analysis.workers import GroupKey

    def key(layer, module):
        return GroupKey("s", "mxfp4", "linear", layer, module, "input", "forward", "pre",
                        "fprop", "input")

    groups = {key(0, "output_layer"): _stats(0), key(2, "linear_fc1"): _stats(1),
              key(1, "linear_fc1"): _stats(2)}
    assert layer_label(0) == "output" and layer_label(3) == "L3"
    assert [row["label"] for row in quantized_layers(groups)] == ["L1", "L2", "output"]
    sites = {s for s in (quantized_sites(groups)["worst"]["site"],
                         quantized_layers(groups)[-1]["worst"]["site"])}
    assert "output_layer input" in sites and not any(s.startswith("L0") for s in sites)
    assert display_site("L0.output_layer") == "output_layer"
    assert display_site("L10.linear_fc1") == "L10.linear_fc1"


@pytest.mark.parametrize("log_value,run_value,shown", [
    ("()", [], "none"), ("(1, 2)", [1, 2], "--quant-skip-layers [1, 2]")])
def test_a_sequence_reads_the_same_from_a_log_and_a_run_file(log_value, run_value, shown):
    """A training log prints a tuple `()`, a run file stores a list `[]`: the Run table shows
    one value, not "differs"."""
    from types import SimpleNamespace

    from megatron.analysis.provenance import build

    capture = SimpleNamespace(quant_scheme="bf16",
                              runs=[{"args": {"quant_skip_layers": run_value}}])
    curve = SimpleNamespace(name="bf16", args={"quant_skip_layers": log_value})
    overrides = build([capture], [curve], ["bf16"], {})["fields"]["overrides"]
    assert overrides["value"] == shown and overrides["by_value"] is None
