"""Capture and telemetry of real training runs under the FP4 / FP8 recipes: every quantized
record is reproduced bit for bit by megatron.quantization.gemm.quantize_operand from its
metadata alone, the metadata says what the recipe did (NVFP4: BF16 last layer, 16x16 weight
tiles, Hadamard-rotated wgrad operands, stochastically rounded gradients; FP8 delayed: the
amax of the operand's previous quantization), and the telemetry of the same run equals the
capture's statistics of the same tensors (the new NVFP4 / FP8 metrics included)."""

import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import pretrain_gpt
from megatron.quantization.config import Fp8Settings, MatmulQuantConfig
from megatron.quantization.gemm import format_options, quantize_operand
from megatron.tensor_capture.format import short_module_name
from megatron.tensor_capture.load import load_record, read_manifest
from megatron.tensor_capture.replay import (
    operand_config, operand_keywords, operand_metadata, requantize)
from megatron.tensor_capture.telemetry import site_label
from megatron.training.training import pretrain

from conftest import TINY_MOCK_ARGS

RESULTS = ("output", "grad_input", "grad_weight", "grad_a", "grad_b")
GRADIENTS = {("dgrad", "grad_output"), ("wgrad", "grad_output")}


def _scalars(directory):
    ea = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: {e.step: e.value for e in ea.Scalars(tag)} for tag in ea.Tags()["scalars"]}


def _run(tmp_path_factory, name, flags, mode="full"):
    out = tmp_path_factory.mktemp(name)
    args = TINY_MOCK_ARGS + ["--train-iters", "3", "--bf16", "--save-tensors",
                             "--tensor-save-dir", str(out / "capture"), "--control-iter", "2",
                             "--collect-micro-batches", "2", "--tensor-save-mode", mode,
                             "--quant-stats-interval", "1", "--tensorboard-dir",
                             str(out / "tb")] + flags
    result = pretrain(pretrain_gpt.forward_step, args)
    assert (result.exit_code, result.iteration) == (0, 2)
    # One capture directory, named by the run's label (recipe_nvfp4, linear_fp8, ...).
    (directory,) = [p for p in (out / "capture").iterdir() if p.is_dir()]
    return read_manifest(str(directory)), _scalars(out / "tb")


@pytest.fixture(scope="module")
def nvfp4_run(tmp_path_factory):
    return _run(tmp_path_factory, "nvfp4", ["--quant-recipe", "nvfp4"])


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    return _run(tmp_path_factory, "fp8", ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"])


def bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def _reproduce_every_quantized_record(entries):
    """quantize_operand(hp, fmt, axis, config, weight=, amax=, seed=) from the metadata equals
    the recorded q; returns {(iteration, micro_batch, site, gemm, operand): record}."""
    records = {}
    for entry in entries:
        meta = entry["metadata"]
        record = load_record(entry["path"])
        assert record["metadata"] == meta
        key = (meta["iteration"], meta["micro_batch"], meta["site"], meta["gemm"],
               meta["operand"])
        records[key] = record
        if meta["format"] == "none":
            assert "quantized" not in record
            continue
        config = operand_config(meta)
        keywords = operand_keywords(meta)
        q = quantize_operand(record["tensor"], meta["format"], meta["axis"], config,
                             **keywords)
        assert torch.equal(bits(q), bits(record["quantized"])), entry["file"]
        assert torch.equal(bits(requantize(record["tensor"], meta)), bits(q))
        if meta["format"] == "nvfp4" or meta["format"].startswith("fp8_"):
            assert record["scales"].dtype == torch.float32       # kept beside q
    return records


def test_nvfp4_recipe_capture_reproduces_and_describes_the_recipe(nvfp4_run):
    entries, _ = nvfp4_run
    records = _reproduce_every_quantized_record(entries)
    quantized = [e["metadata"] for e in entries if e["metadata"]["format"] != "none"]
    assert {m["format"] for m in quantized} == {"nvfp4"}
    # The recipe's BF16 tail: 2 layers, the last one stays in BF16; attention too.
    assert {m["layer_idx"] for m in quantized} == {1}
    assert not any(m["format"] != "none" for m in (e["metadata"] for e in entries)
                   if m["layer_idx"] == 2 or m["site_kind"] != "linear")
    assert {m["layer_idx"] for m in (e["metadata"] for e in entries)} >= {1, 2}
    for meta in quantized:
        slot = (meta["gemm"], meta["operand"])
        assert ("stochastic_seed" in meta) == (slot in GRADIENTS), slot
        assert meta.get("rht_block") == (16 if meta["gemm"] == "wgrad" else None), slot
        assert meta["block_2d"] == (meta["operand"] == "weight"), slot
        assert meta["tensor_amax"] == pytest.approx(
            float(records[(meta["iteration"], meta["micro_batch"], meta["site"], meta["gemm"],
                           meta["operand"])]["tensor"].float().abs().max()), rel=0, abs=0)
    seeds = [m["stochastic_seed"] for m in quantized if "stochastic_seed" in m]
    assert len(seeds) == len(set(seeds)) > 0 and all(0 <= s < 2 ** 63 for s in seeds)
    for (iteration, mb, site, gemm, operand), record in records.items():
        meta = record["metadata"]
        if gemm == "fprop" and operand == "weight" and meta["format"] == "nvfp4":
            # 16x16 tiles: the weight's fprop and dgrad copies are the same numbers
            dgrad = records[(iteration, mb, site, "dgrad", "weight")]
            assert torch.equal(bits(record["quantized"]), bits(dgrad["quantized"]))
            assert torch.equal(record["scales"], dgrad["scales"])
            assert list(record["scales"].shape) == [-(-n // 16) for n in record["tensor"].shape]
        if gemm == "wgrad" and meta["format"] == "nvfp4":
            # the rotated token axis is zero-padded to the Hadamard block
            assert meta["axis"] == 0 and record["tensor"].shape[0] % 16 == 0


def test_nvfp4_variants_in_the_capture(tmp_path_factory):
    """NVFP4 4/6 (mse, bound 256) on weights and activations and per-token scales of the
    activations: every record reproduces from its metadata, which names the variant per
    operand (weights and inputs 4/6, inputs row-scaled without a tensor amax, gradients
    plain); the telemetry of the same run equals the capture's statistics."""
    entries, scalars = _run(tmp_path_factory, "nvfp4-variants", [
        "--quant-scheme", "linear_nvfp4", "--quant-weight-2d", "--nvfp4-4over6", "all",
        "--nvfp4-4over6-err-mode", "mse", "--nvfp4-row-scaled-activation"])
    _reproduce_every_quantized_record(entries)
    quantized = [e["metadata"] for e in entries if e["metadata"]["format"] == "nvfp4"]
    assert len(quantized) > 20
    for meta in quantized:
        slot = (meta["gemm"], meta["operand"])
        if slot in GRADIENTS:
            assert "nvfp4_4over6" not in meta and "row_scaled" not in meta, slot
            assert meta["tensor_amax"] > 0
            continue
        assert (meta["nvfp4_4over6"], meta["nvfp4_4over6_bound"]) == ("mse", 256), slot
        assert meta.get("row_scaled", False) == (meta["operand"] == "input"), slot
        assert ("tensor_amax" in meta) == (meta["operand"] == "weight"), slot
    assert assert_telemetry_equals(_expected_telemetry(entries), scalars) > 50


def test_fp8_delayed_capture_reproduces_and_records_the_history(fp8_run):
    entries, _ = fp8_run
    records = _reproduce_every_quantized_record(entries)
    quantized = [e["metadata"] for e in entries if e["metadata"]["format"] != "none"]
    formats = {(m["gemm"], m["operand"]): m["format"] for m in quantized}
    assert formats == {("fprop", "input"): "fp8_e4m3", ("fprop", "weight"): "fp8_e4m3",
                       ("dgrad", "grad_output"): "fp8_e5m2", ("dgrad", "weight"): "fp8_e4m3",
                       ("wgrad", "grad_output"): "fp8_e5m2", ("wgrad", "input"): "fp8_e4m3"}
    by_slot = defaultdict(list)
    for meta in quantized:
        assert meta["fp8_scaling"] == "delayed" and meta["fp8_margin"] == 0
        assert meta["fp8_pow2_scale"] is False and meta["block_2d"] is False
        assert "stochastic_seed" not in meta and "rht_block" not in meta
        by_slot[(meta["site"], meta["gemm"], meta["operand"])].append(meta)
    for slot, metas in by_slot.items():
        # History length 1, most recent: each quantization scales with the amax of the one
        # before it (the first with 0, i.e. scale 1).
        metas.sort(key=lambda m: (m["iteration"], m["micro_batch"]))
        assert [(m["iteration"], m["micro_batch"]) for m in metas] == \
            [(1, 0), (1, 1), (2, 0), (2, 1)]
        previous = 0.0
        for meta in metas:
            assert meta["tensor_amax"] == previous, slot
            record = records[(meta["iteration"], meta["micro_batch"]) + slot]
            previous = float(record["tensor"].float().abs().max())


def _expected_telemetry(entries):
    """{(iteration, site, gemm.operand): {metric: value}} from the capture's statistics."""
    groups = defaultdict(list)
    for entry in entries:
        meta = entry["metadata"]
        if meta["operand"] in RESULTS or meta["format"] == "none":
            continue
        site = site_label(meta["layer_idx"], short_module_name(meta["site"]), meta["site_kind"])
        groups[(meta["iteration"], site, f"{meta['gemm']}.{meta['operand']}")].append(entry)
    expected = {}
    for key, group in groups.items():
        xs, qs = [], []
        for entry in group:
            record = load_record(entry["path"])
            xs.append(record["tensor"].double().numpy().ravel())
            qs.append(record["quantized"].double().numpy().ravel())
        x, q = np.concatenate(xs), np.concatenate(qs)
        errors = [e["quant_error"] for e in group]
        counts = [e["tensor_info"]["numel"] for e in group]
        signal, error = np.sum(x * x), np.sum((q - x) ** 2)
        values = {"amax": np.abs(x).max(), "sqnr_db": 10 * math.log10(signal / error),
                  "flushed_pct": 100 * np.sum((x != 0) & (q == 0)) / np.count_nonzero(x),
                  "saturated_pct": 100 * sum(e["saturated_fraction"] * n
                                             for e, n in zip(errors, counts)) / sum(counts)}
        if all("tensor_scale" in e for e in errors):     # row-scaled operands have none
            values.update(tensor_scale_min=min(e["tensor_scale"] for e in errors),
                          tensor_scale_max=max(e["tensor_scale"] for e in errors))
        if "blocks" in errors[0]:
            blocks = sum(e["blocks"] for e in errors)
            for name in ("zero", "subnormal"):
                values[f"block_scale_{name}_pct"] = 100 * sum(
                    e[f"block_scale_{name}_fraction"] * e["blocks"] for e in errors) / blocks
            values["block_scale_min"] = min(e["block_scale_min"] for e in errors)
            values["block_scale_max"] = max(e["block_scale_max"] for e in errors)
        expected[key] = values
    return expected


def assert_telemetry_equals(expected, scalars) -> int:
    """Every expected {(iteration, site, operand): {metric: value}} equals the logged scalar
    quant/<site>/<operand>/<metric> (TensorBoard stores float32); returns how many."""
    checked = 0
    for (iteration, site, operand), values in expected.items():
        for metric, value in values.items():
            got = scalars[f"quant/{site}/{operand}/{metric}"][iteration]
            assert got == pytest.approx(value, rel=2e-6, abs=1e-5), (site, operand, metric)
            checked += 1
    return checked


@pytest.mark.parametrize("run", ["nvfp4_run", "fp8_run"])
def test_telemetry_equals_the_capture_of_the_same_tensors(run, request):
    entries, scalars = request.getfixturevalue(run)
    expected = _expected_telemetry(entries)
    assert assert_telemetry_equals(expected, scalars) > 100
    if run == "nvfp4_run":
        assert "quant/worst/block_scale_zero_pct" in scalars
        # the BF16 last layer reports amax only
        assert {t.split("/")[-1] for t in scalars if t.startswith("quant/L2.")} == {"amax"}


def test_stats_mode_matches_full_mode(nvfp4_run, tmp_path_factory):
    """Stats mode computes its statistics in the writer thread from host copies, with the
    same format options: the same numbers as full mode (stochastic draws included)."""
    full, _ = nvfp4_run
    stats, _ = _run(tmp_path_factory, "nvfp4-stats", ["--quant-recipe", "nvfp4"], mode="stats")
    key = lambda m: (m["iteration"], m["micro_batch"], m["site"], m["gemm"], m["operand"])  # noqa
    full = {key(e["metadata"]): e for e in full}
    assert len(stats) == len(full)
    for entry in stats:
        other = full[key(entry["metadata"])]
        assert entry["file"] is None
        meta = {k: v for k, v in entry["metadata"].items() if k not in ("save_time", "run_id")}
        assert meta == {k: v for k, v in other["metadata"].items()
                        if k not in ("save_time", "run_id")}
        assert entry["tensor_info"] == other["tensor_info"]
        assert entry["quant_error"] == other["quant_error"]


def test_replay_config_round_trip():
    """The config rebuilt from metadata quantizes like the site config it describes."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(48, 160, generator=g) * 0.02).bfloat16()
    for fp8 in (Fp8Settings(recipe="tensorwise", margin=1),
                Fp8Settings(recipe="blockwise", pow2_scale=True)):
        config = MatmulQuantConfig(weight_2d=True, fp8=fp8)
        for fmt, axis in (("nvfp4", 1), ("fp8_e4m3", 0)):
            options = format_options(config, fmt, 2, weight=True)
            meta = dict(operand_metadata(config, fmt, w, options, {"weight": True}),
                        format=fmt, axis=axis, scale_mode="floor")
            q = quantize_operand(w, fmt, axis, config, weight=True)
            assert torch.equal(bits(requantize(w, meta)), bits(q)), (fmt, fp8)


def test_capture_size_estimate_counts_the_scales():
    """Full-mode records of NVFP4 / FP8-blockwise operands also hold their float32 scales."""
    from megatron.quantization.config import OperandFormats
    from megatron.quantization.observers import GemmSite
    from megatron.tensor_capture.estimate import SiteShape, scale_bytes
    from megatron.tensor_capture.records import site_info

    for fmt, recipe, per_element in (("nvfp4", "tensorwise", 4 / 16),
                                     ("fp8_e4m3", "blockwise", 4 / 128)):
        config = MatmulQuantConfig(fprop=OperandFormats(fmt, fmt),
                                   fp8=Fp8Settings(recipe=recipe))
        site = GemmSite("decoder.layers.0.mlp.linear_fc1", "linear", 1, config)
        shape = SiteShape(site_info(site), config, {"...": 256, "tokens": 256,
                                                    "in_features": 128, "out_features": 384})
        got = {role.tensor_name: scales for role, _, _, scales in shape.records_with_scales()}
        assert got["input"] == 256 * 128 * per_element and got["weight"] == 384 * 128 * per_element
        assert got["output"] == got["grad_output"] == 0          # results, unquantized dgrad
    tensorwise = MatmulQuantConfig(fp8=Fp8Settings(recipe="tensorwise"))
    assert scale_bytes(tensorwise, "fp8_e5m2", 1000) == 4     # one per-tensor scale
    assert scale_bytes(MatmulQuantConfig(), "mxfp8_e4m3", 1000) == 0


def test_mxfp4_rht_sr_recipe_and_a_recipe_file_in_the_capture(tmp_path_factory, tmp_path):
    """The other named recipe and a recipe file, as a capture shows them: backward-only MXFP4
    with every backward operand rotated (block 64) and stochastically rounded; a file's
    per-path configs (fc1 in NVFP4 with 16x16 weights, layer 2 in BF16)."""
    entries, _ = _run(tmp_path_factory, "mxfp4rhtsr", ["--quant-recipe", "mxfp4_rht_sr"])
    _reproduce_every_quantized_record(entries)
    quantized = [e["metadata"] for e in entries if e["metadata"]["format"] != "none"]
    assert {m["gemm"] for m in quantized} == {"dgrad", "wgrad"}      # forward in BF16
    assert {m["format"] for m in quantized} == {"mxfp4"}
    assert all("stochastic_seed" in m and m["rht_block"] == 64 for m in quantized)
    assert {m["layer_idx"] for m in quantized} == {1, 2}              # no BF16 layers
    assert "recipe_mxfp4_rht_sr" in {e["metadata"]["quant_type"] for e in entries}

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("configs:\n  fp4: {format: nvfp4, weight_2d: true}\n  hp: {format: none}\n"
                      "matchers:\n"
                      "  last: {config: hp, type: glob, pattern: 'decoder.layers.1.*', enabled: true}\n"
                      "  fc1: {config: fp4, type: glob, pattern: '*linear_fc1', enabled: true}\n")
    entries, _ = _run(tmp_path_factory, "recipefile", ["--quant-recipe-file", str(recipe)])
    _reproduce_every_quantized_record(entries)
    quantized = [e["metadata"] for e in entries if e["metadata"]["format"] != "none"]
    assert {(m["layer_idx"], m["site"].rsplit(".", 1)[-1]) for m in quantized} == {
        (1, "linear_fc1")}
    assert {m["block_2d"] for m in quantized if m["operand"] == "weight"} == {True}
    assert not any("stochastic_seed" in m or "rht_block" in m for m in quantized)
