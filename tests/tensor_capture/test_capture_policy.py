"""Capture flags, selection policy, schedules, capture rule files, naming and the GEMM
observer (no training run)."""

import os
import re

import pytest
import torch

from megatron.quantization.formats import fake_quantize
from megatron.quantization.config import MatmulQuantConfig, OperandFormats
from megatron.quantization.gemm import SiteState, quantized_linear
from megatron.quantization.observers import GemmSite, observer_for
from megatron.quantization.runtime import QuantRuntime
from megatron.tensor_capture import format as naming
from megatron.tensor_capture.hooks import CaptureObserver
from megatron.tensor_capture.policy import (
    CapturePolicy, CaptureRule, Schedule, parse_kinds, parse_layers)
from megatron.tensor_capture.records import site_info
from megatron.tensor_capture.roles import tensor_names
from megatron.tensor_capture.stats import compute_stats
from megatron.training.arguments import ConfigError, parse_args, validate_args

from conftest import REPO_ROOT, TINY_MOCK_ARGS

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
        assert config.directory == os.path.join("./enhanced_tensor_logs",
                                                args.quant_config.label)
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


def _output_layer_site(config=None):
    """The output layer's GEMM site as the model builds it (layer number None: layer 0)."""
    return site_info(GemmSite("output_layer", "output_layer", None,
                              config or MatmulQuantConfig()))


def _layer_site(layer=1):
    path = f"decoder.layers.{layer - 1}.mlp.linear_fc1"
    return site_info(GemmSite(path, "linear", layer, MatmulQuantConfig()))


class TestOutputLayer:
    """The output layer ([tokens, vocabulary]: 128256 columns with the Llama 3 tokenizer, most
    of a capture) is captured only when asked for: --tensor-save-layers naming 0, a
    --tensor-save-filter or a rule's `layers` matching `output_layer`, or a rule's `modules`
    listing it."""

    ROLE = tensor_names("linear")["grad_output"]

    def captured(self, policy, info):
        return policy.captures_layer(info.layer) and \
            policy.rule_for(info, self.ROLE, False) is not None

    def test_left_out_by_default_and_the_transformer_layers_kept(self):
        policy = CapturePolicy()
        assert not self.captured(policy, _output_layer_site())
        assert self.captured(policy, _layer_site(1))
        assert "output layer: not captured" in policy.describe()

    def test_even_when_quantized(self):
        config = MatmulQuantConfig(fprop=OperandFormats("mxfp8", "mxfp8"))
        assert not self.captured(CapturePolicy(), _output_layer_site(config))

    @pytest.mark.parametrize("ask", [
        dict(layers=frozenset({0})),
        dict(layers=frozenset({0, 1})),
        dict(name_filter=re.compile(r"_L1_|output_layer")),
        dict(rules=(CaptureRule(modules=frozenset({"output_layer"})),)),
        dict(rules=(CaptureRule(layers=re.compile(r"output_layer")),)),
    ])
    def test_captured_when_asked(self, ask):
        policy = CapturePolicy(**ask)
        assert self.captured(policy, _output_layer_site())
        assert "output layer: not captured" not in policy.describe()

    def test_only_the_rule_that_names_it_decides(self):
        everything = CaptureRule(name="everything", mode="full")
        logits = CaptureRule(name="logits", modules=frozenset({"output_layer"}), mode="stats")
        policy = CapturePolicy(rules=(everything, logits))
        assert policy.rule_for(_output_layer_site(), self.ROLE, False).name == "logits"
        assert policy.rule_for(_layer_site(2), self.ROLE, False).name == "everything"

    def test_the_flags(self, monkeypatch):
        policy = lambda extra: CapturePolicy(  # noqa: E731
            layers=validated(["--save-tensors"] + extra, monkeypatch).capture_config.layers)
        assert not self.captured(policy([]), _output_layer_site())
        assert self.captured(policy(["--tensor-save-layers", "0", "1-2"]), _output_layer_site())

    def test_the_estimate_leaves_it_out(self):
        from megatron.tensor_capture.estimate import SiteShape, estimate_bytes

        policy = CapturePolicy()
        dims = {"...": 8, "tokens": 8, "in_features": 16, "out_features": 128256}
        shapes = [SiteShape(_output_layer_site(), MatmulQuantConfig(), dims)]

        def plan(info, role, quantized):
            rule = policy.rule_for(info, role, quantized)
            return None if rule is None else (rule.mode, 1)

        assert estimate_bytes(shapes, plan, 1, 2) == 0


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
                axis, extra=None):
        self.calls.append((role.tensor_name, iteration, micro_batch, fmt, q is not None))


def test_backward_keeps_the_micro_batch_of_its_forward():
    """Pipeline order: forward mb0, forward mb1, backward mb0, backward mb1."""
    config = MatmulQuantConfig(fprop=OperandFormats("mxfp8", "mxfp8"),
                               dgrad=OperandFormats("mxfp8", "mxfp8"))
    runtime = QuantRuntime()
    path = "decoder.layers.0.mlp.linear_fc1"
    site = GemmSite(path, "linear", 1, config, SiteState(path, config, runtime))
    recorder = FakeRecorder()
    observer = CaptureObserver(CapturePolicy(micro_batches=2), recorder)
    runtime.add_observer(observer)
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
        runtime.remove_observer(observer)
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


# ---------------------------------------------------------------------------------------------
# Schedules and capture rules (--tensor-save-iters / --tensor-save-interval / --tensor-save-config)
# ---------------------------------------------------------------------------------------------

REPO_DOCS = os.path.join(REPO_ROOT, "docs")
QKV = site_info(GemmSite("decoder.layers.0.self_attention.linear_qkv", "linear", 1,
                         MatmulQuantConfig()))
FC1 = site_info(GemmSite("decoder.layers.1.mlp.linear_fc1", "linear", 2, MatmulQuantConfig()))
ATTN = site_info(GemmSite("decoder.layers.1.self_attention.core_attention.qk", "attn_qk", 2,
                          MatmulQuantConfig()))
LINEAR, ATTENTION = tensor_names("linear"), tensor_names("attention")


def capture_args(extra, tmp_path=None, config=None, name="capture.yaml"):
    extra = list(extra)
    if config is not None:
        path = tmp_path / name
        path.write_text(config)
        extra += ["--tensor-save-config", str(path)]
    return validate_args(parse_args(ARGS + ["--save-tensors"] + extra), check_paths=False)


def one_line_error(extra, tmp_path=None, config=None, name="capture.yaml"):
    with pytest.raises(ConfigError) as caught:
        capture_args(extra, tmp_path, config, name)
    message = str(caught.value)
    assert "\n" not in message
    return message


class TestSchedule:
    def test_defaults_capture_the_first_iteration_and_stop(self):
        config = capture_args([]).capture_config
        assert config.control_iter == 1 and config.rules[0].schedule.empty

    def test_a_schedule_alone_does_not_stop_the_run(self):
        args = capture_args(["--tensor-save-iters", "3,1", "--tensor-save-interval", "2"])
        config = args.capture_config
        assert config.control_iter is None and args.tensor_save_iters == [1, 3]
        assert config.rules[0].schedule == Schedule(frozenset({1, 3}), 2)
        policy = CapturePolicy(control_iter=None, rules=config.rules)
        assert [i for i in range(1, 4) if policy.captures_iteration(i)] == [1, 2, 3]
        assert policy.last_iteration is None
        assert capture_args(["--tensor-save-iters", "2", "--control-iter", "1"]) \
            .capture_config.control_iter == 1

    @pytest.mark.parametrize("extra,message", [
        (["--tensor-save-iters", "x"], r"^--tensor-save-iters 'x' is not a positive integer "
                                       r"iteration; valid: 1\.\.3 \(1-based"),
        (["--tensor-save-iters", "1", "0"], r"^--tensor-save-iters '0' is not a positive"),
        (["--tensor-save-iters", "2.5"], r"^--tensor-save-iters '2\.5' is not a positive"),
        (["--tensor-save-iters", "2", "7"], r"^--tensor-save-iters 7 is beyond --train-iters 3; "
                                            r"valid: 1\.\.3$"),
        (["--tensor-save-interval", "-2"], r"^--tensor-save-interval '-2' is not a positive "
                                           r"integer interval"),
        (["--tensor-save-interval", "4"], r"^--tensor-save-interval 4 is beyond --train-iters 3"),
        (["--control-iter", "5"], r"^--control-iter 5 is beyond --train-iters 3; valid: 0 or "
                                  r"1\.\.3$"),
    ])
    def test_bad_iterations(self, extra, message):
        assert re.search(message, one_line_error(extra))

    def test_schedule_without_save_tensors_is_a_warning(self):
        args = validate_args(parse_args(ARGS + ["--tensor-save-iters", "2", "--control-iter",
                                                "9"]), check_paths=False)
        assert args.capture_config is None
        assert args.capture_warnings == [
            "warning: --tensor-save-iters, --control-iter given without --save-tensors (or "
            "$TENSOR_SAVE_ENABLED=1): nothing is captured"]
        assert capture_args(["--tensor-save-iters", "2"]).capture_warnings == []

    def test_global_iterations_after_a_resume(self):
        rule = CaptureRule(schedule=Schedule(frozenset({5, 1000}), 0))
        policy = CapturePolicy(control_iter=None, start_iteration=990, rules=(rule,))
        assert [i for i in (5, 990, 999, 1000, 1001) if policy.captures_iteration(i)] == [1000]
        assert policy.unreachable() == {5}
        assert policy.rule_at(1000, QKV, LINEAR["input"], False) is rule
        assert policy.rule_at(999, QKV, LINEAR["input"], False) is None
        # The --control-iter window counts from the resumed iteration; schedules add to it.
        both = CapturePolicy(control_iter=2, start_iteration=990, rules=(rule,))
        assert [i for i in range(989, 1002) if both.captures_iteration(i)] == [991, 992, 1000]
        assert both.iteration_count(rule, 1010) == 3 and both.last_iteration == 992

    def test_schedule_counts(self):
        schedule = Schedule(frozenset({3, 4, 7}), 4)
        assert schedule.count(1, 12) == len({3, 4, 7, 8, 12}) and schedule.count(5, 6) == 0
        every = CapturePolicy(control_iter=0, start_iteration=10)
        assert every.iteration_count(every.rules[0], 15) == 5


class TestCaptureFile:
    def test_the_documented_example(self, tmp_path):
        text = open(os.path.join(REPO_DOCS, "capture-format.md"), encoding="utf-8").read()
        example = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
        args = capture_args(["--train-iters", "2000"], tmp_path, example)
        config = args.capture_config
        attention, mlp, rest = config.rules
        assert (config.mode, config.micro_batches, config.control_iter) == ("mixed", 2, None)
        assert (attention.name, attention.mode, attention.schedule) == \
            ("attention-full", "full", Schedule(frozenset({1000}), 0))
        assert (mlp.mode, mlp.schedule) == ("stats", Schedule(frozenset({1, 10}), 500))
        assert mlp.stats == {"absmax", "zero_fraction", "sqnr_db", "saturated_fraction",
                             "scale_exponent_hist"}
        assert rest.mode == "off"
        policy = CapturePolicy(control_iter=None, rules=config.rules)
        assert policy.rule_at(1000, ATTN, ATTENTION["query"], False) is attention
        assert policy.rule_at(500, ATTN, ATTENTION["query"], False) is None
        assert policy.rule_at(500, FC1, LINEAR["input"], False) is mlp
        assert policy.rule_at(1000, FC1, LINEAR["weight"], False) is mlp
        assert policy.rule_for(QKV, LINEAR["input"], False) is None     # rest: off
        assert policy.rule_for(FC1, LINEAR["grad_weight"], False) is None

    def test_flags_override_the_file(self, tmp_path):
        config = "mode: full\niterations: [2]\nrules:\n  - modules: [linear_fc1]\n" \
                 "  - mode: off\n"
        args = capture_args(["--tensor-save-mode", "stats", "--tensor-save-iters", "3",
                             "--tensor-save-kinds", "input"], tmp_path, config)
        fc1, rest = args.capture_config.rules
        assert (fc1.mode, rest.mode) == ("stats", "off")        # off stays off
        assert fc1.schedule == rest.schedule == Schedule(frozenset({3}), 0)
        assert fc1.kinds.names == {("linear", "input")} and not fc1.kinds.quantized
        assert args.tensor_save_mode == "stats" and args.capture_config.control_iter is None
        assert capture_args(["--collect-micro-batches", "3"], tmp_path,
                            "micro_batches: 2\n").capture_config.micro_batches == 3

    def test_json_files(self, tmp_path):
        config = '{"mode": "stats", "interval": 1, "stats": ["absmax"]}'
        rule, = capture_args([], tmp_path, config, "capture.json").capture_config.rules
        assert (rule.mode, rule.schedule.interval, rule.stats) == ("stats", 1, {"absmax"})

    @pytest.mark.parametrize("config,message", [
        ("modes: full\n", r"capture\.yaml: unknown key 'modes'; valid: mode, iterations, "
                          r"interval, kinds, stats, micro_batches, rules$"),
        ("rules:\n  - modul: [linear_fc1]\n", r"rules\[0\]: unknown key 'modul'; valid: name, "
                                                r"layers, modules, kinds"),
        ("rules:\n  - modules: [linear_fc1, mlp]\n",
         r"rules\[0\]\.modules: unknown module 'mlp'; valid: linear_qkv, .*output_layer$"),
        ("rules:\n  - {}\n  - kinds: [attention.weights]\n",
         r"--tensor-save-config .*capture\.yaml: rules\[1\]\.kinds 'attention\.weights': "
         r"unknown kind; valid: \[attention\.\|linear\.\]"),
        ("stats: [absmax, l1_norm]\n", r"stats: unknown statistic 'l1_norm'; valid: min, max, "
                                       r".*hifp8_regions, tensor_scale, "
                                       r".*block_scale_subnormal_fraction$"),
        ("mode: fast\n", r"mode: 'fast' is not a mode; valid: full, stats, off$"),
        ("rules:\n  - layers: '(layers'\n", r"rules\[0\]\.layers: '\(layers' is not a valid "
                                            r"regular expression"),
        ("rules:\n  - layers: [1, 2]\n", r"rules\[0\]\.layers: \[1, 2\] is not a regular "
                                         r"expression on the module path"),
        ("iterations: [1, 0]\n", r"iterations: 0 is not a positive integer iteration; "
                                 r"valid: 1\.\.3"),
        ("iterations: [two]\n", r"iterations: 'two' is not a positive integer iteration"),
        ("rules:\n  - iterations: 1.5\n", r"rules\[0\]\.iterations: 1\.5 is not a positive"),
        ("iterations: [true]\n", r"iterations: True is not a positive integer iteration"),
        ("rules:\n  - iterations: [2, 9]\n", r"rules\[0\]\.iterations: iteration 9 is beyond "
                                             r"--train-iters 3; valid: 1\.\.3$"),
        ("interval: 5\n", r"interval: interval 5 is beyond --train-iters 3"),
        ("micro_batches: 0\n", r"micro_batches: 0 is not a positive number of micro-batches"),
        ("rules: []\n", r"rules: expected a non-empty list of rules"),
        ("- mode: full\n", r"capture\.yaml: expected a mapping of keys \(mode, iterations"),
        ("mode: [full\n", r"capture\.yaml: not valid YAML \(line 2, column 1: "),
    ])
    def test_mistakes_are_one_line(self, tmp_path, config, message):
        assert re.search(message, one_line_error([], tmp_path, config)), message

    def test_unreadable_and_invalid_json_files(self, tmp_path):
        assert re.search(r"nowhere\.yaml: cannot read it \(No such file or directory\)",
                         one_line_error(["--tensor-save-config", str(tmp_path / "nowhere.yaml")]))
        assert "capture.json: not valid JSON (" in \
            one_line_error([], tmp_path, '{"mode": "full",}', "capture.json")

    def test_metric_names_are_the_statistics_written(self):
        x = torch.randn(64, 64)
        names = set()
        for fmt, options in (("mxfp8_e4m3", {}), ("hifp8", {}), ("nvfp4", {}),
                             ("fp8_e4m3", {"scaling": "tensor"}),
                             ("fp8_e4m3", {"scaling": "block", "block": (1, 128)})):
            info, error, _ = compute_stats(x, fake_quantize(x, fmt, axis=1, **options), fmt, 1,
                                           options=options)
            names |= set(info) | set(error)
        assert set(naming.METRICS) == names - {"shape", "dtype", "numel", "device",
                                               "requires_grad", "is_leaf"}
        entry = naming.keep_metrics(naming.manifest_entry(None, 0, {}, info, error),
                                    {"absmax", "sqnr_db"})
        assert set(entry["tensor_info"]) == {"shape", "dtype", "numel", "device",
                                             "requires_grad", "is_leaf", "absmax"}
        assert set(entry["quant_error"]) == {"sqnr_db"}
