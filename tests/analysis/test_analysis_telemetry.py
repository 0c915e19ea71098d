"""Quantization telemetry from TensorBoard event files written here with SummaryWriter,
following the contract of --quant-stats-interval (quant/<site>/<gemm>.<operand>/<metric>)."""

import math
import os

import pandas as pd
import pytest

from megatron.analysis import load_scalars_frame, load_stats_frame
from megatron.analysis.cli import main
from megatron.analysis.statistics import load_json
from megatron.analysis.telemetry import parse_tag, summary

LINEAR = ("fprop.input", "fprop.weight", "dgrad.grad_output", "dgrad.weight",
          "wgrad.grad_output", "wgrad.input")
QK = ("fprop.query", "fprop.key", "dgrad.grad_scores", "dgrad.key", "wgrad.query",
      "wgrad.grad_scores")
PV = ("fprop.probs", "fprop.value", "dgrad.grad_context", "dgrad.value", "wgrad.probs",
      "wgrad.grad_context")
SITES = {"L1.linear_qkv": LINEAR, "L1.core_attention.qk": QK, "L1.core_attention.pv": PV,
         "L2.linear_fc2": LINEAR, "L0.output_layer": LINEAR, "L3.expert5_linear_fc1": LINEAR}
COMMON = ("saturated_pct", "flushed_pct", "sqnr_db", "rel_error", "amax")
MX = ("scale_exp_min", "scale_exp_max")
HIF8 = tuple(f"hifp8_{r}_pct" for r in ("underflow", "denormal", "mant1", "mant2", "mant3",
                                        "overflow"))
SCHEMES = {"bf16": ("amax",), "FA_linear_mxfp8": COMMON + MX, "FA_linear_hifp8": COMMON + HIF8}
STEPS = (10, 20, 30)


def value(scheme, site, operand, metric, step):
    """A distinct, reproducible value per scalar (SQNR falls with depth and time)."""
    seed = (sum(map(ord, scheme + site + operand + metric)) % 97) / 97.0
    if metric == "sqnr_db":
        return 30.0 - 0.1 * step - 3.0 * seed
    return round(seed * step, 4)


@pytest.fixture(scope="module")
def tensorboard(tmp_path_factory):
    from torch.utils.tensorboard import SummaryWriter

    root = tmp_path_factory.mktemp("tensorboard")
    expected = []
    for scheme, metrics in SCHEMES.items():
        writer = SummaryWriter(log_dir=str(root / scheme))
        for step in STEPS:
            writer.add_scalar("lm loss", 7.0 - step / 100, step)
            writer.add_scalar("learning-rate", 1e-3, step)
            for site, operands in SITES.items():
                for operand in operands:
                    for metric in metrics:
                        v = value(scheme, site, operand, metric, step)
                        writer.add_scalar(f"quant/{site}/{operand}/{metric}", v, step)
                        expected.append((scheme, step, site, operand, metric, v))
            if scheme != "bf16":
                for metric in ("saturated_pct", "flushed_pct"):
                    writer.add_scalar(f"quant/worst/{metric}", 50.0 + step, step)
            writer.add_scalar("quant/not-a-site/fprop.input/amax", 1.0, step)
        if scheme == "FA_linear_hifp8":       # an operand that held NaN/Inf at the last step
            writer.add_scalar("quant/L2.linear_fc2/wgrad.grad_output/nonfinite", 1.0, 30)
        writer.close()
    # A resumed run appends a second event file; its later value of a step wins.
    writer = SummaryWriter(log_dir=str(root / "FA_linear_mxfp8"))
    writer.add_scalar("quant/L1.linear_qkv/fprop.input/sqnr_db", -5.0, 30)
    writer.close()
    return str(root), expected


def test_tag_contract():
    assert parse_tag("quant/L2.linear_fc2/dgrad.grad_output/sqnr_db") == (
        "L2.linear_fc2", 2, "linear_fc2", "dgrad", "grad_output", "sqnr_db")
    assert parse_tag("quant/L1.core_attention.qk/wgrad.grad_scores/amax")[:3] == (
        "L1.core_attention.qk", 1, "core_attention.qk")
    assert parse_tag("quant/worst/flushed_pct") == ("worst", None, None, None, None,
                                                    "flushed_pct")
    for bad in ("lm loss", "quant/L1.linear_qkv/amax", "quant/Lx.fc/fprop.input/amax",
                "quant/L1.fc/bprop.input/amax", "quant/L1.fc/fprop/amax"):
        assert parse_tag(bad) is None


def test_stats_frame_holds_every_scalar(tensorboard):
    root, expected = tensorboard
    frame = load_stats_frame(root)
    assert list(frame.columns) == ["scheme", "step", "site", "layer", "module", "gemm",
                                   "operand", "metric", "value"]
    sites = frame[frame.site != "worst"]
    assert len(sites) == len(expected) + 1             # + the nonfinite flag
    assert len(sites[sites.metric == "nonfinite"]) == 1
    got = {(r.scheme, r.step, r.site, f"{r.gemm}.{r.operand}", r.metric): r.value
           for r in sites.itertuples()}
    assert len(got) == len(sites)
    for scheme, step, site, operand, metric, v in expected:
        if (scheme, site, operand, metric, step) == ("FA_linear_mxfp8", "L1.linear_qkv",
                                                     "fprop.input", "sqnr_db", 30):
            v = -5.0                                  # the resumed run's value
        assert got[(scheme, step, site, operand, metric)] == pytest.approx(v, rel=1e-6)
    qk = frame[frame.site == "L1.core_attention.qk"]
    assert set(qk.layer) == {1} and set(qk.module) == {"core_attention.qk"}
    assert set(frame[frame.site == "L3.expert5_linear_fc1"].module) == {"expert5_linear_fc1"}
    assert set(frame[frame.site == "L0.output_layer"].layer) == {0}
    worst = frame[frame.site == "worst"]
    assert len(worst) == 2 * 2 * len(STEPS) and worst.layer.isna().all()
    assert set(frame[frame.scheme == "bf16"].metric) == {"amax"}
    assert frame.attrs["unparsed_tags"] == ["quant/not-a-site/fprop.input/amax"]
    assert "lm loss" not in set(frame.metric)


def test_scalars_frame_and_filters(tensorboard, tmp_path):
    root, _ = tensorboard
    scalars = load_scalars_frame(root, schemes=["bf16"])
    assert set(scalars.tag) == {"lm loss", "learning-rate"}
    assert scalars[scalars.tag == "lm loss"].value.tolist() == pytest.approx(
        [7.0 - s / 100 for s in STEPS])
    only = load_stats_frame(root, schemes=["FA_linear_hifp8"], metrics=["hifp8_mant3_pct"])
    assert set(only.scheme) == {"FA_linear_hifp8"} and set(only.metric) == {"hifp8_mant3_pct"}
    # Event files directly in the directory: the scheme is the directory's name.
    direct = load_stats_frame(os.path.join(root, "bf16"))
    assert set(direct.scheme) == {"bf16"} and len(direct) > 0
    assert load_stats_frame(str(tmp_path)).empty


def test_summary_names_the_worst_operands(tensorboard):
    root, expected = tensorboard
    frame = load_stats_frame(root)
    doc = summary(frame, [root])
    mx = doc["schemes"]["FA_linear_mxfp8"]
    last = [e for e in expected if e[0] == "FA_linear_mxfp8" and e[1] == 30
            and e[4] == "sqnr_db"]
    assert mx["steps"] == [10, 30] and mx["points"] == 3
    assert mx["quantized_operands"] == sum(len(o) for o in SITES.values())
    assert mx["worst_sqnr_db_at_last_step"] == {"value": -5.0, "site": "L1.linear_qkv",
                                                "operand": "fprop.input", "step": 30}
    values = [e[5] for e in last if (e[2], e[3]) != ("L1.linear_qkv", "fprop.input")] + [-5.0]
    assert mx["mean_sqnr_db_at_last_step"] == pytest.approx(sum(values) / len(values), rel=1e-6)
    saturated = max((e for e in expected if e[0] == "FA_linear_mxfp8"
                     and e[4] == "saturated_pct"), key=lambda e: e[5])
    assert mx["max_saturated_pct"]["value"] == pytest.approx(saturated[5], rel=1e-6)
    assert doc["schemes"]["bf16"]["quantized_operands"] == 0
    zero = summary(frame.assign(value=frame.value.where(frame.metric != "flushed_pct", 0.0)),
                   [root])
    assert zero["schemes"]["FA_linear_mxfp8"]["max_flushed_pct"] == {
        "value": 0.0, "site": None, "operand": None, "step": None}   # nothing to single out
    assert mx["nonfinite"] is None
    assert doc["schemes"]["FA_linear_hifp8"]["nonfinite"] == {
        "operands": 1, "first_step": 30, "site": "L2.linear_fc2",
        "operand": "wgrad.grad_output"}


def test_report_from_telemetry_alone(tensorboard, tmp_path):
    root, _ = tensorboard
    out = tmp_path / "out"
    code = main(["--tensorboard-dir", root, "--output-dir", str(out), "--workers", "1",
                 "--no-progress", "--log-level", "ERROR"])
    assert code == 0
    doc = load_json(str(out / "statistics.json"))
    assert set(doc["telemetry"]["schemes"]) == set(SCHEMES)
    assert [p["kind"] for p in doc["problems"]] == ["bad_telemetry_tag"]
    files = [f["file"] for f in doc["figures"]]
    # the per-layer picture of the first screen, from the telemetry's last iteration
    assert files == ["layer_overview.png", "telemetry_over_iterations.png",
                     "telemetry_layers.png"]
    assert [f["file"] for f in doc["figures"] if f.get("glance")] == ["layer_overview.png"]
    assert "last logged iteration" in doc["figures"][0]["caption"]
    layers = doc["telemetry"]["schemes"]["FA_linear_mxfp8"]["layers_at_last_step"]
    assert [row["label"] for row in layers] == ["L1", "L2", "L3", "output"]
    assert all(os.path.getsize(out / "figures" / f) > 0 for f in files)
    assert not (out / "records.csv").exists() and "records.csv" not in doc["outputs"]
    text = (out / "statistics.txt").read_text()
    row = next(line for line in text.splitlines() if line.startswith("FA_linear_mxfp8 "))
    assert "L1.linear_qkv fprop.input" in row and "10-30 (3)" in row
    hifp8 = next(line for line in text.splitlines() if line.startswith("FA_linear_hifp8 "))
    assert "1 operand(s), first L2.linear_fc2 wgrad.grad_output at it 30" in hifp8
    assert "records.csv" not in (out / "report.html").read_text()
    assert doc["provenance"]["schemes"] == sorted(SCHEMES)


def test_a_directory_without_telemetry_is_reported(tmp_path, capsys):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path / "tb" / "bf16"))
    writer.add_scalar("lm loss", 7.0, 1)
    writer.close()
    code = main(["--tensorboard-dir", str(tmp_path / "tb"), str(tmp_path / "missing"),
                 "--output-dir", str(tmp_path / "out"), "--log-level", "ERROR"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert "no quantization telemetry" in err


def test_frame_types(tensorboard):
    frame = load_stats_frame(tensorboard[0], schemes=["FA_linear_mxfp8"])
    assert frame.step.dtype == "int64" and frame.value.dtype == "float64"
    assert isinstance(frame.layer.dtype, pd.Int64Dtype)
    assert not frame.value.map(math.isnan).any()
