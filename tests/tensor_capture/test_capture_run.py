"""Tensor capture in real training runs: completeness, exactness, modes, TP=2.

Faults (full disk, continue-on-error) are in test_faults.py."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

import pretrain_gpt
from megatron.quantization.attention import QuantDotProductAttention
from megatron.quantization.formats import fake_quantize
from megatron.quantization.layers import QuantizedLinearMixin
from megatron.tensor_capture.load import (
    load_record, read_manifest, read_runs, read_summaries)
from megatron.training.errors import ConfigError
from megatron.training.training import TrainingCallback, pretrain

from conftest import REPO_ROOT, TINY_MOCK_ARGS, child_env

SCHEME = "FA_linear_mxfp8"
# 2 micro-batches of 2 per iteration (global batch 4).
RUN_ARGS = TINY_MOCK_ARGS + ["--train-iters", "5", "--quant-scheme", SCHEME, "--save-tensors",
                             "--control-iter", "2", "--collect-micro-batches", "2"]


class ModelGrabber(TrainingCallback):
    def on_train_start(self, model_chunks, iteration):
        self.chunks = model_chunks


def run(argv):
    grabber = ModelGrabber()
    result = pretrain(pretrain_gpt.forward_step, argv, callbacks=[grabber])
    return result, grabber.chunks


def expected_records(chunks, iterations, micro_batches):
    """(layer, module, tensor_name, iteration, micro_batch) implied by the model's GEMM sites
    and their quantization configs: what a complete capture must contain (the output layer
    only when asked for, which these runs do not)."""
    per_site = []
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, QuantizedLinearMixin):
                if module.quant_site.kind == "output_layer":
                    continue         # captured only when asked for (--tensor-save-layers 0)
                cfg = module.quant_site.config
                names = ["input", "weight", "output", "grad_output", "grad_input"]
                names += [n for n, fmt in (("weight_dgrad", cfg.dgrad.b),
                                           ("input_wgrad", cfg.wgrad.a),
                                           ("grad_output_wgrad", cfg.wgrad.b)) if fmt != "none"]
                per_site.append((module.quant_site.layer_number or 0, name.split(".")[-1], names))
            elif isinstance(module, QuantDotProductAttention):
                qk, pv = module.qk_site.config, module.pv_site.config
                names = ["query", "key", "value", "output", "grad_output", "grad_query",
                         "grad_key", "grad_value"]
                names += [n for n, fmt in (
                    ("grad_scores", qk.dgrad.a), ("key_dgrad", qk.dgrad.b),
                    ("query_wgrad", qk.wgrad.a), ("grad_scores_wgrad", qk.wgrad.b),
                    ("probs", pv.fprop.a), ("value_dgrad", pv.dgrad.b),
                    ("probs_wgrad", pv.wgrad.a), ("grad_output_wgrad", pv.wgrad.b))
                    if fmt != "none"]
                per_site.append((module.qk_site.layer_number, "core_attention", names))
    return {(layer, module, n, it, mb) for layer, module, names in per_site for n in names
            for it in iterations for mb in range(micro_batches)}


def key_of(meta):
    """(layer, module, tensor_name, iteration, micro_batch) of a record's metadata."""
    prefix = (f"{meta['layer_type']}_L{meta['layer_idx']}_{meta['operation']}_{meta['phase']}_"
              f"{meta['component']}_{meta['tensor_name']}_")
    assert meta["name"].startswith(prefix)
    return (meta["layer_idx"], meta["name"][len(prefix):], meta["tensor_name"],
            meta["iteration"], meta["micro_batch"])


def bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def np_stats(tensor, quantized):
    a = tensor.to(torch.float64).numpy().ravel()
    info = {"mean": a.mean(), "std": a.std(), "min": a.min(), "max": a.max(),
            "zero_fraction": np.count_nonzero(a == 0) / a.size}
    if quantized is None:
        return info, None
    d = quantized.to(torch.float64).numpy().ravel() - a
    return info, {"mse": np.mean(d ** 2), "relative_error": np.sqrt(np.sum(d ** 2) /
                                                                     np.sum(a ** 2))}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    result, chunks = run(RUN_ARGS + ["--tensor-save-dir", str(out)])
    return result, chunks, out / SCHEME


def test_full_capture_is_complete_and_exact(full_run):
    result, chunks, directory = full_run
    assert (result.exit_code, result.exit_reason, result.iteration) == (0, "control-iter", 2)
    entries = read_manifest(str(directory))
    keys = [key_of(e["metadata"]) for e in entries]
    assert len(keys) == len(set(keys))
    assert set(keys) == expected_records(chunks, (1, 2), 2)
    on_disk = {n for n in os.listdir(directory) if n.endswith(".pt")}
    assert on_disk == {e["file"] for e in entries}

    by_key = {}
    for entry in entries:
        record = load_record(entry["path"])            # weights_only=True
        meta, tensor = record["metadata"], record["tensor"]
        assert record["format_version"] == 1 and meta == entry["metadata"]
        assert record["tensor_info"]["shape"] == list(tensor.shape)
        assert meta["quant_type"] == SCHEME and meta["run_id"] in entry["file"]
        if meta["format"] != "none":
            q = fake_quantize(tensor, meta["format"], axis=meta["axis"],
                              scale_mode=meta["scale_mode"], saturate=meta.get("saturate"))
            assert torch.equal(bits(q), bits(record["quantized"])), entry["file"]
        else:
            assert "quantized" not in record
        # Statistics against numpy float64 on the saved tensors.
        info, err = np_stats(tensor, record.get("quantized"))
        for k, v in info.items():
            assert entry["tensor_info"][k] == pytest.approx(v, rel=1e-9, abs=1e-300), k
        for k, v in (err or {}).items():
            assert entry["quant_error"][k] == pytest.approx(v, rel=1e-9, abs=1e-300), k
        by_key[key_of(meta)] = record

    # Re-quantized copies hold the same data as their first record.
    first = by_key[(1, "linear_fc1", "input", 2, 1)]["tensor"]
    again = by_key[(1, "linear_fc1", "input_wgrad", 2, 1)]
    assert torch.equal(first.reshape(-1, first.shape[-1]), again["tensor"])
    assert again["metadata"]["axis"] == 0
    # Attention layout: queries reshape to [b, groups, heads_per_group, sq, head_dim].
    query = by_key[(2, "core_attention", "query", 1, 0)]
    dims = query["metadata"]["dims"]
    assert (dims["b"], dims["groups"], dims["heads_per_group"], dims["sq"]) == (2, 2, 2, 64)
    query["tensor"].view(dims["b"], dims["groups"], dims["heads_per_group"], dims["sq"], -1)
    # Both micro-batches are distinct data.
    assert not torch.equal(by_key[(1, "linear_qkv", "input", 1, 0)]["tensor"],
                           by_key[(1, "linear_qkv", "input", 1, 1)]["tensor"])

    runs, summaries = read_runs(str(directory)), read_summaries(str(directory))
    assert len(runs) == 1 and runs[0]["mode"] == "full" and runs[0]["control_iter"] == 2
    assert summaries[0]["records"] == len(entries) and summaries[0]["error"] is None
    assert summaries[0]["bytes"] == sum(e["bytes"] for e in entries)


def test_stats_mode_writes_no_data_and_matches_full_mode(full_run, tmp_path):
    _, _, full_dir = full_run
    result, _ = run(RUN_ARGS + ["--tensor-save-dir", str(tmp_path), "--tensor-save-mode",
                                "stats"])
    assert result.exit_code == 0 and result.exit_reason == "control-iter"
    directory = tmp_path / SCHEME
    assert not list(directory.glob("*.pt"))
    stats = {key_of(e["metadata"]): e for e in read_manifest(str(directory))}
    full = {key_of(e["metadata"]): e for e in read_manifest(str(full_dir))}
    assert stats.keys() == full.keys()
    for key, entry in stats.items():
        assert entry["file"] is None and entry["bytes"] == 0
        assert entry["tensor_info"] == full[key]["tensor_info"], key
        assert entry["quant_error"] == full[key]["quant_error"], key


def test_hifp8_pv_bf16_selection_and_filters(tmp_path):
    """bf16 training with HiFP8 (saturating, recorded) and PV quantized in MXFP4 (adds the
    probs operands); the layer / kind / name selections narrow the capture."""
    args = TINY_MOCK_ARGS + ["--train-iters", "3", "--bf16", "--quant-scheme", "FA_linear_hifp8",
                             "--attn-pv-quant", "mxfp4", "--save-tensors",
                             "--tensor-save-dir", str(tmp_path), "--tensor-save-layers", "2"]
    result, _ = run(args)
    assert result.exit_code == 0 and result.iteration == 1
    entries = read_manifest(str(tmp_path / "FA_linear_hifp8"))
    assert {e["metadata"]["layer_idx"] for e in entries} == {2}
    assert {e["metadata"]["micro_batch"] for e in entries} == {0}
    names = {e["metadata"]["tensor_name"] for e in entries
             if e["metadata"]["site_kind"] == "attn_pv"}
    assert {"probs", "probs_wgrad", "value_dgrad", "grad_output_wgrad"} <= names
    for entry in entries:
        meta = entry["metadata"]
        if meta["format"] == "none":
            continue
        record = load_record(entry["path"])
        assert record["tensor"].dtype == torch.bfloat16
        assert meta.get("saturate") is (True if meta["format"] == "hifp8" else None)
        q = fake_quantize(record["tensor"], meta["format"], axis=meta["axis"],
                          scale_mode=meta["scale_mode"], saturate=meta.get("saturate"))
        assert torch.equal(bits(q), bits(record["quantized"]))
        key = "hifp8_regions" if meta["format"] == "hifp8" else "scale_exponent_hist"
        assert key in entry["quant_error"]

    narrow = tmp_path / "narrow"
    result, _ = run(TINY_MOCK_ARGS + [
        "--train-iters", "3", "--quant-scheme", SCHEME, "--save-tensors", "--tensor-save-mode",
        "stats", "--tensor-save-dir", str(narrow), "--tensor-save-kinds", "attention.query",
        "linear.grad_weight", "--tensor-save-filter", r"_L1_|output_layer"])
    assert result.exit_code == 0
    got = {(e["metadata"]["layer_idx"], e["metadata"]["tensor_name"])
           for e in read_manifest(str(narrow / SCHEME))}
    assert got == {(1, "query"), (1, "grad_weight"), (0, "grad_weight")}


def test_unwritable_directory(tmp_path):
    """Found while checking the flags, before the model is built or anything trains."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="--tensor-save-dir .*not writable \\(Not a directory\\)"):
        run(RUN_ARGS + ["--tensor-save-dir", str(blocker / "logs")])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tensor_parallel_ranks_write_distinct_files(tmp_path):
    env = child_env(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_free_port()), os.path.join(REPO_ROOT, "pretrain_gpt.py"),
           *TINY_MOCK_ARGS, "--train-iters", "3", "--tensor-model-parallel-size", "2",
           "--quant-scheme", SCHEME, "--save-tensors", "--collect-micro-batches", "2",
           "--tensor-save-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "exiting at iteration 1: control-iter" in proc.stdout
    directory = tmp_path / SCHEME
    assert len(list(directory.glob("manifest-*-rank0000[01].jsonl"))) == 2
    assert len(read_runs(str(directory))) == 1 and len(read_summaries(str(directory))) == 2
    entries = read_manifest(str(directory))
    files = [e["file"] for e in entries]
    assert len(files) == len(set(files)) == len(list(directory.glob("*.pt")))
    per_rank = {}
    for entry in entries:
        meta = entry["metadata"]
        assert entry["file"].endswith(f"_tp{meta['tp_rank']}_pp0_dp0.pt")
        assert meta["rank"] == meta["tp_rank"] and meta["world_size"] == 2
        per_rank.setdefault(meta["rank"], set()).add(key_of(meta))
    assert per_rank[0] == per_rank[1] and len(per_rank[0]) > 100
    # Each rank holds its own shard: the column-parallel weights differ.
    weights = [load_record(e["path"]) for e in entries
               if e["metadata"]["name"] == "linear_L1_forward_pre_linear_weight_linear_qkv"]
    assert len(weights) == 4 and weights[0]["tensor"].shape[0] == 128   # 256 / TP
    shards = {w["metadata"]["tp_rank"]: w["tensor"] for w in weights}
    assert not torch.equal(shards[0], shards[1])
    for record in weights:
        meta = record["metadata"]
        q = fake_quantize(record["tensor"], meta["format"], axis=meta["axis"],
                          scale_mode=meta["scale_mode"])
        assert torch.equal(bits(q), bits(record["quantized"]))


def test_schedule_captures_global_iterations_and_does_not_stop(tmp_path, capsys):
    """--tensor-save-iters 2 5 on a 6-iteration run, then the same schedule after resuming
    from iteration 3: iteration numbers are global."""
    args = TINY_MOCK_ARGS + ["--train-iters", "6", "--quant-scheme", SCHEME, "--save-tensors",
                             "--tensor-save-iters", "2", "5", "--tensor-save-layers", "1"]
    ckpt = tmp_path / "ckpt"
    result, _ = run(args + ["--tensor-save-dir", str(tmp_path / "a"), "--save", str(ckpt),
                            "--save-interval", "3"])
    assert (result.exit_code, result.exit_reason, result.iteration) == (0, "train-iters", 6)
    entries = read_manifest(str(tmp_path / "a" / SCHEME))
    assert {e["metadata"]["iteration"] for e in entries} == {2, 5}
    assert all(os.path.exists(e["path"]) for e in entries)
    assert read_runs(str(tmp_path / "a" / SCHEME))[0]["control_iter"] is None

    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")   # resume from iteration 3
    capsys.readouterr()
    result, _ = run(args + ["--tensor-save-dir", str(tmp_path / "b"), "--load", str(ckpt)])
    assert (result.exit_code, result.iteration) == (0, 6)
    assert {e["metadata"]["iteration"] for e in read_manifest(str(tmp_path / "b" / SCHEME))} \
        == {5}
    assert "note: iteration 2 is not after the resumed iteration 3, so not captured" in \
        capsys.readouterr().out


def test_capture_rules_choose_mode_iterations_and_statistics(tmp_path):
    config = tmp_path / "capture.yaml"
    config.write_text(
        "rules:\n"
        "  - name: attention\n"
        "    layers: 'layers\\.1\\.'\n"
        "    modules: [core_attention]\n"
        "    kinds: [attention.query]\n"
        "    mode: full\n"
        "    iterations: [1]\n"
        "  - name: mlp\n"
        "    modules: [linear_fc1]\n"
        "    kinds: [input]\n"
        "    mode: stats\n"
        "    interval: 2\n"
        "    stats: [absmax, sqnr_db]\n"
        "  - mode: off\n")
    result, _ = run(TINY_MOCK_ARGS + [
        "--train-iters", "3", "--quant-scheme", SCHEME, "--save-tensors",
        "--tensor-save-dir", str(tmp_path), "--tensor-save-config", str(config)])
    assert (result.exit_code, result.exit_reason, result.iteration) == (0, "train-iters", 3)
    entries = read_manifest(str(tmp_path / SCHEME))
    got = {(e["metadata"]["iteration"], e["metadata"]["name"], e["file"] is not None)
           for e in entries}
    assert got == {(1, "attention_L2_forward_pre_FA_query_core_attention", True),
                   (2, "linear_L1_forward_pre_linear_input_linear_fc1", False),
                   (2, "linear_L2_forward_pre_linear_input_linear_fc1", False)}
    for entry in entries:
        if entry["file"] is None:
            assert set(entry["tensor_info"]) == {"shape", "dtype", "numel", "device",
                                                 "requires_grad", "is_leaf", "absmax"}
            assert set(entry["quant_error"]) == {"sqnr_db"}
        else:
            assert "mse" in entry["quant_error"] and "std" in entry["tensor_info"]
            load_record(entry["path"])
    run_file = read_runs(str(tmp_path / SCHEME))[0]
    assert run_file["mode"] == "mixed" and [r["name"] for r in run_file["rules"]] == \
        ["attention", "mlp", "rule 2"]
