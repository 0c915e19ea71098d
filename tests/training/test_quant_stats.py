"""--quant-stats-interval: telemetry in TensorBoard equals the statistics of the same tensors
in a full capture of the same run; the chunked attention path reports exactly what the
full-scores path does; W&B and bad input.

Expected values are computed here with numpy from the captured tensors (amax, flushed %,
SQNR, relative error) and from the capture's per-record statistics, weighted by their
element counts (saturated %, MX scale exponents, HiFP8 regions).
"""

import math
import sys
from collections import defaultdict

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import pretrain_gpt
from megatron.quantization.runtime import observing
from megatron.tensor_capture.format import short_module_name
from megatron.tensor_capture.load import load_record, read_manifest
from megatron.tensor_capture.telemetry import QuantTelemetry, site_label
from megatron.training.training import pretrain

from conftest import TINY_MOCK_ARGS
from test_capture_new_formats import assert_telemetry_equals
from test_attention_paths import _inputs, _module

SCHEME = "FA_linear_mxfp4"
ROLES = {"attn_qk": {"a": "query", "b": "key", "grad_output": "grad_scores"},
         "attn_pv": {"a": "probs", "b": "value", "grad_output": "grad_context"}}
RESULTS = ("output", "grad_input", "grad_weight", "grad_a", "grad_b")


def _scalars(directory):
    ea = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: {e.step: e.value for e in ea.Scalars(tag)} for tag in ea.Tags()["scalars"]}


@pytest.fixture(scope="module")
def measured_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("quant_stats")
    args = TINY_MOCK_ARGS + [
        "--train-iters", "6", "--bf16", "--quant-scheme", SCHEME, "--attn-pv-quant", "hifp8",
        "--hifp8-scaling", "tensor", "--quant-stats-interval", "2",
        "--tensorboard-dir", str(out / "tb"), "--save-tensors", "--tensor-save-dir",
        str(out / "capture"), "--tensor-save-iters", "2", "4", "6",
        "--collect-micro-batches", "2", "--tensor-save-layers", "2"]
    result = pretrain(pretrain_gpt.forward_step, args)
    assert result.exit_code == 0 and result.iteration == 6
    return _scalars(out / "tb"), read_manifest(str(out / "capture" / SCHEME))


def _expected(entries):
    """{(iteration, site, operand): {metric: value}} from the capture."""
    groups = defaultdict(list)
    for entry in entries:
        meta = entry["metadata"]
        if meta["operand"] in RESULTS:
            continue
        site = site_label(meta["layer_idx"], short_module_name(meta["site"]), meta["site_kind"])
        role = ROLES.get(meta["site_kind"], {}).get(meta["operand"], meta["operand"])
        groups[(meta["iteration"], site, f"{meta['gemm']}.{role}")].append(entry)
    expected = {}
    for key, group in groups.items():
        xs, qs, errors = [], [], []
        for entry in group:
            record = load_record(entry["path"])
            xs.append(record["tensor"].double().numpy().ravel())
            if record.get("quantized") is not None:
                qs.append(record["quantized"].double().numpy().ravel())
                errors.append(entry["quant_error"])
        x = np.concatenate(xs)
        values = {"amax": np.abs(x).max()}
        if qs:
            q = np.concatenate(qs)
            counts = [len(v) for v in xs]
            nonzeros = [np.count_nonzero(v) for v in xs]
            values["flushed_pct"] = 100 * np.sum((x != 0) & (q == 0)) / np.count_nonzero(x)
            signal, error = np.sum(x * x), np.sum((q - x) ** 2)
            values["sqnr_db"] = 10 * math.log10(signal / error)
            values["rel_error"] = math.sqrt(error / signal)
            values["saturated_pct"] = 100 * sum(
                e["saturated_fraction"] * n for e, n in zip(errors, counts)) / sum(counts)
            if "scale_exponent_hist" in errors[0]:
                hists = [e["scale_exponent_hist"] for e in errors]
                values["scale_exp_min"] = min(h["min"] for h in hists)
                values["scale_exp_max"] = max(h["min"] + len(h["counts"]) - 1 for h in hists)
            if "hifp8_regions" in errors[0]:
                for region in errors[0]["hifp8_regions"]:
                    values[f"hifp8_{region}_pct"] = 100 * sum(
                        e["hifp8_regions"][region] * n for e, n in zip(errors, nonzeros)) \
                        / sum(nonzeros)
        expected[key] = values
    return expected


def test_tags_at_the_measured_iterations_only(measured_run):
    scalars, _ = measured_run
    quant = {tag: steps for tag, steps in scalars.items() if tag.startswith("quant/")}
    assert quant and all(set(steps) == {2, 4, 6} for steps in quant.values())
    sites = {tag.split("/")[1] for tag in quant}
    assert {"L1.linear_qkv", "L2.linear_fc2", "L1.core_attention.qk", "L2.core_attention.pv",
            "L0.output_layer", "worst"} <= sites
    assert "quant/L2.linear_fc2/fprop.input/flushed_pct" in quant
    assert "quant/L1.core_attention.pv/wgrad.probs/hifp8_mant3_pct" in quant
    assert "quant/L2.core_attention.qk/dgrad.grad_scores/scale_exp_max" in quant
    # The output layer stays in high precision here: amax only.
    assert {t.split("/")[-1] for t in quant if t.startswith("quant/L0.")} == {"amax"}


def test_telemetry_equals_the_capture_of_the_same_tensors(measured_run):
    scalars, entries = measured_run
    expected = _expected(entries)
    assert {site for _, site, _ in expected} >= {"L2.linear_qkv", "L2.linear_fc1",
                                                 "L2.core_attention.qk", "L2.core_attention.pv"}
    assert assert_telemetry_equals(expected, scalars) > 400
    worst = max(v for (it, _, _), vals in expected.items() if it == 4
                for k, v in vals.items() if k == "flushed_pct")
    assert scalars["quant/worst/flushed_pct"][4] >= worst - 1e-4


@pytest.mark.parametrize("qk,pv", [("mxfp4", "hifp8"), ("nvfp4", "fp8")])
def test_chunked_attention_reports_what_the_full_scores_path_does(world_size_one, qk, pv):
    """Telemetry accepts pieces: on the chunked path it sees each chunk of Q, P, dS, dO once
    and K, V once, which adds up to the statistics of the whole operands (tensor-scaled
    operands -- HiFP8 scaled, NVFP4, FP8 per tensor -- come with the whole operand's scale, so
    their block scales, tensor scales and saturation are those of the whole)."""
    results = {}
    for chunk_rows in (64, None):
        module = _module(world_size_one, qk, pv, chunk_rows=chunk_rows or 64,
                         hifp8_scaling="tensor")
        if chunk_rows is None:
            module.attention = module.attention.replace(impl="unfused")
        telemetry = QuantTelemetry({})
        with observing(module, telemetry):
            telemetry.begin()
            leaves = [t.clone().requires_grad_() for t in _inputs(72, 2, 4, 2, 32, torch.float32)]
            module(*leaves, None).sum().backward()
            results[chunk_rows] = telemetry.reduce()
    chunked, whole = results[64], results[None]
    assert chunked.keys() == whole.keys() and len(chunked) == 12
    for key, values in whole.items():
        assert chunked[key].keys() == values.keys()
        for metric, value in values.items():
            assert chunked[key][metric] == pytest.approx(value, rel=1e-6, abs=1e-12), \
                (key, metric)


def test_wandb_is_optional_and_receives_the_scalars(tmp_path, monkeypatch, capsys):
    base = TINY_MOCK_ARGS + ["--train-iters", "2", "--quant-scheme", SCHEME,
                             "--quant-stats-interval", "2", "--wandb-project", "lowp"]
    monkeypatch.setitem(sys.modules, "wandb", None)     # find_spec: not installed
    result = pretrain(pretrain_gpt.forward_step, base)
    assert result.exit_code == 0 and result.iteration == 2
    warning = [l for l in capsys.readouterr().out.splitlines() if "--wandb-project" in l]
    assert warning == ["warning: --wandb-project lowp: the wandb package is not installed "
                       "(pip install wandb); logging to TensorBoard and the log only"]
    monkeypatch.undo()

    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "wandb.py").write_text(
        "calls = []\n"
        "class Run:\n"
        "    def log(self, values, step): calls.append(('log', step, dict(values)))\n"
        "    def finish(self): calls.append(('finish',))\n"
        "def init(**kwargs):\n"
        "    calls.append(('init', kwargs))\n"
        "    return Run()\n")
    monkeypatch.syspath_prepend(str(stub))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    result = pretrain(pretrain_gpt.forward_step, base + ["--wandb-exp-name", "run1"])
    import wandb
    assert wandb.calls[0][0] == "init" and wandb.calls[0][1]["project"] == "lowp"
    assert wandb.calls[0][1]["name"] == "run1" and wandb.calls[-1] == ("finish",)
    logged = {tag for call in wandb.calls if call[0] == "log" and call[1] == 2 for tag in call[2]}
    assert "lm loss" in logged and "quant/L1.linear_fc1/fprop.input/sqnr_db" in logged


def test_bad_interval_is_one_line(capsys):
    from megatron.training.arguments import ConfigError, parse_args, validate_args
    from megatron.training.quant_stats import stats_interval_warnings
    with pytest.raises(ConfigError, match=r"--quant-stats-interval -1: must be >= 0"):
        validate_args(parse_args(TINY_MOCK_ARGS + ["--train-iters", "1",
                                                   "--quant-stats-interval", "-1"]),
                      check_paths=False)
    # not an integer: argparse's own error, as one line instead of the whole usage
    with pytest.raises(SystemExit) as stopped:
        parse_args(TINY_MOCK_ARGS + ["--quant-stats-interval", "1.5"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err == "error: argument --quant-stats-interval: invalid int value: '1.5' " \
                  "(see --help)\n"
    beyond = validate_args(parse_args(TINY_MOCK_ARGS + ["--train-iters", "2",
                                                        "--quant-stats-interval", "10"]),
                           check_paths=False)
    assert stats_interval_warnings(beyond) == [
        "warning: --quant-stats-interval 10 is beyond --train-iters 2: no iteration is "
        "measured (valid: 1..2)", NOWHERE.format(10)]


NOWHERE = ("warning: --quant-stats-interval {}: the per-operand metrics are only written to "
           "TensorBoard/W&B, and neither is on; the log line keeps only the summary (give "
           "--tensorboard-dir DIR to keep them)")


def test_interval_without_tensorboard_warns_once(tmp_path, capsys):
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.quant_stats import stats_interval_warnings
    base = TINY_MOCK_ARGS + ["--train-iters", "2", "--quant-stats-interval", "1"]
    assert stats_interval_warnings(validate_args(parse_args(base), check_paths=False)) == [
        NOWHERE.format(1)]
    with_tb = validate_args(parse_args(base + ["--tensorboard-dir", str(tmp_path / "tb")]),
                            check_paths=False)
    assert stats_interval_warnings(with_tb) == []
    # printed once at start-up by a real run, which still trains to the end
    result = pretrain(pretrain_gpt.forward_step, base + ["--quant-scheme", SCHEME])
    assert result.exit_code == 0 and result.iteration == 2
    out = capsys.readouterr().out.splitlines()
    assert [l for l in out if l.startswith("warning: --quant-stats-interval")] == [
        NOWHERE.format(1)]
