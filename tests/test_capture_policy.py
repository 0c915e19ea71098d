"""Capture flags, selection policy, naming and the GEMM observer (no training run)."""

import os

import pytest
import torch

from megatron.quantization.gemm import MatmulQuantConfig, OperandFormats, quantized_linear
from megatron.quantization.observers import (
    GemmSite, observer_for, register_observer, unregister_observer)
from megatron.tensor_capture import format as naming
from megatron.tensor_capture.hooks import CaptureObserver
from megatron.tensor_capture.policy import CapturePolicy, parse_kinds, parse_layers
from megatron.training.arguments import ConfigError, parse_args, validate_args

from conftest import TINY_MOCK_ARGS

ARGS = TINY_MOCK_ARGS + ["--train-iters", "3"]


def validated(extra, monkeypatch=None, env=None):
    if monkeypatch is not None:
        for key in ("TENSOR_SAVE_ENABLED", "TENSOR_SAVE_DIR"):
            monkeypatch.delenv(key, raising=False)
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
    return validate_args(parse_args(ARGS + extra), check_paths=False)


class TestArguments:
    def test_defaults(self, monkeypatch):
        args = validated([], monkeypatch)
        assert args.save_tensors is False
        assert args.tensor_save_dir == "./enhanced_tensor_logs"
        assert (args.control_iter, args.collect_micro_batches) == (1, 1)
        assert args.tensor_save_mode == "full" and not args.tensor_save_continue_on_error
        assert args.capture_config is None          # capture is off
        args = validated(["--save-tensors"], monkeypatch)
        config = args.capture_config
        assert config.layers is None and config.name_filter is None
        assert config.directory == os.path.join("./enhanced_tensor_logs", args.quant_scheme)
        assert (config.queue_records, config.queue_bytes) == (256, 1 << 30)

    def test_environment_seeds_defaults_and_flags_win(self, monkeypatch):
        env = {"TENSOR_SAVE_ENABLED": "1", "TENSOR_SAVE_DIR": "/tmp/from-env"}
        args = validated([], monkeypatch, env)
        assert args.save_tensors is True and args.tensor_save_dir == "/tmp/from-env"
        args = validated(["--no-save-tensors", "--tensor-save-dir", "/tmp/flag"], monkeypatch,
                         env)
        assert args.save_tensors is False and args.tensor_save_dir == "/tmp/flag"
        args = validated(["--save-tensors"], monkeypatch, {"TENSOR_SAVE_ENABLED": "0"})
        assert args.save_tensors is True

    @pytest.mark.parametrize("extra,env,message", [
        (["--control-iter", "-1"], {}, r"--control-iter -1 is invalid; valid: 0"),
        (["--collect-micro-batches", "0"], {}, r"--collect-micro-batches 0 is invalid"),
        (["--tensor-save-mode", "fast"], {}, r"--tensor-save-mode 'fast' is invalid; valid: "
                                             r"full, stats"),
        (["--tensor-save-layers", "9"], {}, r"layer 9 is out of range for 2 layers; valid: 0 \(output "
                                            r"layer\), 1..2"),
        (["--tensor-save-layers", "x"], {}, r"'x' is not a layer number or range"),
        (["--tensor-save-filter", "("], {}, r"--tensor-save-filter '\(' is not a valid regular"),
        (["--tensor-save-kinds", "attention.weight"], {}, r"'attention.weight': unknown kind; "
                                                          r"valid: \[attention.\|linear.\]"),
        (["--tensor-save-kinds", "mlp.input"], {}, r"unknown component 'mlp'"),
        (["--tensor-save-queue-size", "0"], {}, r"--tensor-save-queue-size 0 is invalid"),
        ([], {"TENSOR_SAVE_ENABLED": "maybe"}, r"TENSOR_SAVE_ENABLED='maybe' is not a boolean; "
                                               r"valid: 1, true"),
    ])
    def test_bad_values_name_value_and_valid_choices(self, monkeypatch, extra, env, message):
        with pytest.raises(ConfigError, match=message):
            validated(extra, monkeypatch, env)

    def test_every_flag_has_help(self):
        from megatron.training.arguments import build_parser

        group = next(g for g in build_parser()._action_groups if g.title == "tensor capture")
        assert len(group._group_actions) >= 12
        assert all(a.help and len(a.help) > 20 for a in group._group_actions)


class TestPolicy:
    def test_kinds(self):
        default = parse_kinds(None)
        assert ("attention", "query") in default.names and ("linear", "weight") in default.names
        assert ("linear", "grad_weight") not in default.names
        assert default.quantized == {"attention", "linear"}
        picked = parse_kinds(["attention.query,linear.grad_weight", "backward"])
        assert ("attention", "query") in picked.names and ("linear", "grad_weight") in picked.names
        assert ("attention", "grad_key") in picked.names and ("linear", "input") not in picked.names
        assert picked.quantized == frozenset()
        assert parse_kinds(["output"]).names == {("attention", "output"), ("linear", "output")}
        assert parse_kinds(["attn"]) == parse_kinds(["attention.default"])

    def test_layers(self):
        assert parse_layers(None, 4) is None
        assert parse_layers(["1-2", "-1", "0"], 4) == {0, 1, 2, 4}
        assert parse_layers(["2,3"], 4) == {2, 3}
        with pytest.raises(ValueError, match="empty range"):
            parse_layers(["3-1"], 4)

    def test_iterations_and_micro_batches(self):
        policy = CapturePolicy(control_iter=2, micro_batches=2, start_iteration=10)
        assert [policy.captures_iteration(i) for i in (10, 11, 12, 13)] == [False, True, True,
                                                                            False]
        assert policy.last_iteration == 12
        assert policy.captures_micro_batch(1) and not policy.captures_micro_batch(2)
        every = CapturePolicy(control_iter=0)
        assert every.captures_iteration(1000) and every.last_iteration is None


class TestNaming:
    def test_short_module_names(self):
        short = naming.short_module_name
        assert short("decoder.layers.0.self_attention.linear_qkv") == "linear_qkv"
        assert short("decoder.layers.0.self_attention.core_attention.qk") == "core_attention"
        assert short("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1", 8) == \
            "expert11_linear_fc1"
        assert short("decoder.layers.1.mlp.shared_experts.linear_fc2") == \
            "shared_experts_linear_fc2"
        assert short("output_layer") == "output_layer"

    def test_file_name(self):
        meta = {"layer_type": "attention", "layer_idx": 3, "operation": "forward",
                "phase": "pre", "component": "FA", "quant_type": "FA_mxfp8",
                "tensor_name": "query", "iteration": 2, "micro_batch": 1, "world_size": 4,
                "tp_rank": 1, "pp_rank": 0, "dp_rank": 1}
        name = naming.record_file_name("20250101_000000", 7, meta, "core_attention")
        assert name == ("20250101_000000_000007_attention_L3_forward_pre_FA_FA_mxfp8_query_"
                        "core_attention_it2_mb1_tp1_pp0_dp1.pt")
        meta["world_size"] = 1
        assert naming.record_file_name("r", 7, meta, "m").endswith("_it2_mb1.pt")

    def test_run_ids_never_collide(self, tmp_path):
        ids = [naming.claim_run_id(str(tmp_path), "20250101_000000") for _ in range(3)]
        assert ids == ["20250101_000000", "20250101_000000-2", "20250101_000000-3"]
        assert all(os.path.exists(naming.run_file(str(tmp_path), i)) for i in ids)


class FakeRecorder:
    def __init__(self):
        self.calls = []

    def capture(self, info, config, role, iteration, micro_batch, gemm, operand, hp, q, fmt,
                axis):
        self.calls.append((role.tensor_name, iteration, micro_batch, fmt, q is not None))


def test_backward_keeps_the_micro_batch_of_its_forward():
    """Pipeline order: forward mb0, forward mb1, backward mb0, backward mb1."""
    config = MatmulQuantConfig(fprop=OperandFormats("mxfp8", "mxfp8"),
                               dgrad=OperandFormats("mxfp8", "mxfp8"))
    site = GemmSite("decoder.layers.0.mlp.linear_fc1", "linear", 1, config)
    recorder = FakeRecorder()
    observer = CaptureObserver(CapturePolicy(micro_batches=2), recorder)
    register_observer(observer)
    try:
        observer.begin_iteration(5)
        weight = torch.randn(64, 32, requires_grad=True)
        outputs = []
        for mb in range(2):
            observer.micro_batch = mb
            x = torch.randn(4, 32, requires_grad=True)
            outputs.append(quantized_linear(x, weight, None, config, observer_for(site)))
        observer.micro_batch = 7          # later forwards must not leak into backward
        for y in outputs:
            y.sum().backward()
        observer.end_iteration()
        assert observer_for(site) is None      # outside a captured iteration: declined
    finally:
        unregister_observer(observer)
    by_mb = {mb: [c for c in recorder.calls if c[2] == mb] for mb in (0, 1)}
    for mb, calls in by_mb.items():
        # wgrad runs unquantized here, so it adds no re-quantized copies.
        assert [c[0] for c in calls] == ["input", "weight", "output", "grad_output",
                                         "weight_dgrad", "grad_input"], mb
        assert all(c[1] == 5 for c in calls)
        assert [c[4] for c in calls] == [True, True, False, True, True, False]


def test_unwritable_capture_directory_fails_before_training(tmp_path, monkeypatch):
    monkeypatch.delenv("TENSOR_SAVE_DIR", raising=False)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"--tensor-save-dir .*a-file/bf16: directory is not "
                                          r"writable"):
        validate_args(parse_args(ARGS + ["--save-tensors", "--quant-scheme", "bf16",
                                         "--tensor-save-dir", str(blocker)]))
    validate_args(parse_args(ARGS + ["--save-tensors", "--quant-scheme", "bf16",
                                     "--tensor-save-dir", str(tmp_path / "new")]))
    assert (tmp_path / "new" / "bf16").is_dir()
