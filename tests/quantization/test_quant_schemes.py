"""Named schemes and overrides -> the per-GEMM QuantConfig, and the flags (generated from the
settings in megatron/quantization/config.py: one source of truth for flag, help, default and
validation)."""

import argparse
import dataclasses
import re
import typing

import pytest

from megatron.quantization import schemes
from megatron.quantization.config import (
    SCHEMES,
    SEED_SCHEMES,
    QuantSettings,
    SchemeSettings,
    SettingError,
    add_arguments,
    flag_names,
    scheme_from_env,
    settings_from_flags,
)
from megatron.quantization.describe import describe_config
from megatron.quantization.schemes import skip_layer_numbers
from megatron.training.arguments import ConfigError, build_parser, parse_args, validate_args

from conftest import TINY_MOCK_ARGS


def quant(*flags, num_layers=2):
    """What a run with these quantization flags resolves to ($CUSTOM_QUANT_TYPE unset)."""
    return schemes.quant_config(list(flags), num_layers, environ={})


def assert_bad_value(message, flag, value, valid):
    """A bad value of a setting: one line naming the flag, the value and what is valid."""
    assert "\n" not in message
    assert flag in message and str(value) in message, message
    for choice in valid:
        assert str(choice) in message, (choice, message)


def test_the_ten_schemes():
    assert SEED_SCHEMES == ("bf16", "FA_mxfp8", "FA_mxfp4", "FA_hifp8", "linear_mxfp8",
                            "linear_mxfp4", "linear_hifp8", "FA_linear_mxfp8", "FA_linear_mxfp4",
                            "FA_linear_hifp8")
    newer = {f"{prefix}_{fmt}" for prefix in ("FA", "linear", "FA_linear")
             for fmt in ("nvfp4", "mxfp6_e2m3", "mxfp6_e3m2", "fp8")}
    assert set(SCHEMES) == set(SEED_SCHEMES) | newer and SCHEMES[:4] == SEED_SCHEMES[:4]


def _check_sites(cfg, scheme, forward, gradient):
    """Every GEMM of the scheme's sites, both operands: `forward` for activations and weights,
    `gradient` for dY (dgrad's a, wgrad's b)."""
    assert cfg.linear.enabled == ("linear" in scheme)
    assert cfg.attn_qk.enabled == scheme.startswith("FA")
    assert not cfg.attn_pv.enabled and not cfg.output_layer.enabled
    for site in (cfg.linear, cfg.attn_qk):
        if site.enabled:
            assert (site.fprop.a, site.fprop.b) == (forward, forward)
            assert (site.dgrad.a, site.dgrad.b) == (gradient, forward)
            assert (site.wgrad.a, site.wgrad.b) == (forward, gradient)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_scheme_sites(scheme):
    cfg = quant("--quant-scheme", scheme, num_layers=4)
    fmt = scheme if scheme == "bf16" else \
        scheme.split("_", 2 if scheme.startswith("FA_linear") else 1)[-1]
    element = {"mxfp8": "mxfp8_e4m3", "mxfp4": "mxfp4", "hifp8": "hifp8", "bf16": None,
               "nvfp4": "nvfp4", "mxfp6_e2m3": "mxfp6_e2m3", "mxfp6_e3m2": "mxfp6_e3m2",
               "fp8": "fp8_e4m3"}[fmt]
    if fmt != "fp8":
        # Every GEMM, both operands; MXFP8 gradients in E4M3 by default.
        _check_sites(cfg, scheme, element, element)
        return
    # FP8 schemes: the default --fp8-format hybrid puts the gradient operands in E5M2 ...
    _check_sites(cfg, scheme, "fp8_e4m3", "fp8_e5m2")
    # ... and --fp8-format e4m3 puts every operand in E4M3. (That flag implies FP8 linear
    # layers, so it goes with the schemes that have them; with FA_fp8 it is a contradiction.)
    if "linear" in scheme:
        _check_sites(quant("--quant-scheme", scheme, "--fp8-format", "e4m3", num_layers=4),
                     scheme, "fp8_e4m3", "fp8_e4m3")
    else:
        with pytest.raises(SettingError, match="use --quant-scheme FA_linear_fp8"):
            quant("--quant-scheme", scheme, "--fp8-format", "e4m3", num_layers=4)


def test_mxfp8_gradient_format_and_backward_switch():
    cfg = quant("--quant-scheme", "linear_mxfp8", "--mx-grad-format", "e5m2")
    assert (cfg.linear.fprop.a, cfg.linear.fprop.b) == ("mxfp8_e4m3", "mxfp8_e4m3")
    assert (cfg.linear.dgrad.a, cfg.linear.dgrad.b) == ("mxfp8_e5m2", "mxfp8_e4m3")
    assert (cfg.linear.wgrad.a, cfg.linear.wgrad.b) == ("mxfp8_e4m3", "mxfp8_e5m2")
    fwd = quant("--quant-scheme", "linear_mxfp8", "--no-quant-backward")
    assert fwd.linear.fprop.a == "mxfp8_e4m3"
    assert (fwd.linear.dgrad.a, fwd.linear.wgrad.b) == ("none", "none")
    # MXFP4 and HiFP8 quantize gradients in their own format.
    fp4 = quant("--quant-scheme", "linear_mxfp4", "--mx-grad-format", "e5m2")
    assert fp4.linear.dgrad.a == "mxfp4"


def test_overrides_win_and_are_noted():
    cfg = quant("--quant-scheme", "FA_mxfp8", "--linear-quant", "hifp8", "--attn-pv-quant",
                "mxfp4", "--attn-qk-quant", "none", "--mx-scale-mode", "rceil", num_layers=4)
    assert cfg.linear.fprop.a == "hifp8" and cfg.attn_pv.fprop.b == "mxfp4"
    assert not cfg.attn_qk.enabled and cfg.attn_pv.mx.scale_mode == "rceil"
    assert len(cfg.notes) == 3 and any("--attn-qk-quant none overrides" in n for n in cfg.notes)
    text = describe_config(cfg, 4)
    assert "attention PV" in text and "probs: mxfp4" in text and "rceil" in text


def test_skip_layers_and_output_layer():
    cfg = quant("--quant-scheme", "linear_mxfp8", "--quant-skip-layers", "1", "-1",
                "--quant-output-layer", num_layers=6)
    assert cfg.skip_layers == {1, 6}
    assert not cfg.for_site("linear", 1).enabled and not cfg.for_site("linear", 6).enabled
    assert cfg.for_site("linear", 3).enabled and cfg.for_site("output_layer", None).enabled


def test_skip_layer_numbers():
    assert skip_layer_numbers(["2-4", "1,-1"], 8) == {1, 2, 3, 4, 8}
    assert skip_layer_numbers(["-2--1"], 8) == {7, 8}
    with pytest.raises(SettingError, match="layer 9 is out of range for 8 layers"):
        skip_layer_numbers(["9"], 8)
    with pytest.raises(SettingError, match="'first' is not a layer number"):
        skip_layer_numbers(["first"], 8)


def test_environment_seeds_the_default():
    assert scheme_from_env({}) == "bf16"
    assert scheme_from_env({"CUSTOM_QUANT_TYPE": "linear_hifp8"}) == "linear_hifp8"
    assert scheme_from_env({"CUSTOM_QUANT_TYPE": "mxfp4"}) == "FA_linear_mxfp4"
    with pytest.raises(SettingError, match="CUSTOM_QUANT_TYPE='fp6'"):
        scheme_from_env({"CUSTOM_QUANT_TYPE": "fp6"})


def test_flags_and_environment(monkeypatch):
    monkeypatch.setenv("CUSTOM_QUANT_TYPE", "FA_hifp8")
    args = validate_args(parse_args(TINY_MOCK_ARGS + ["--train-iters", "2"]), check_paths=False)
    # args.quant_scheme is what the user typed (nothing); the environment chose the scheme.
    assert args.quant_scheme is None
    assert args.quant_config.scheme == "FA_hifp8" and args.quant_config.label == "FA_hifp8"
    assert args.quant_config.source == "CUSTOM_QUANT_TYPE"
    args = validate_args(parse_args(TINY_MOCK_ARGS + ["--train-iters", "2", "--quant-scheme",
                                                      "linear_mxfp4", "--no-quant-backward"]),
                         check_paths=False)
    assert args.quant_scheme == "linear_mxfp4" and args.quant_config.linear.dgrad.a == "none"
    assert args.quant_config.scheme == "linear_mxfp4"
    assert args.quant_config.source == "--quant-scheme"
    monkeypatch.setenv("CUSTOM_QUANT_TYPE", "int4")
    with pytest.raises(ConfigError, match="CUSTOM_QUANT_TYPE='int4'"):
        validate_args(parse_args(TINY_MOCK_ARGS + ["--train-iters", "2"]), check_paths=False)


def test_bad_names_are_rejected(capsys):
    with pytest.raises(SystemExit):
        parse_args(TINY_MOCK_ARGS + ["--quant-scheme", "linear_fp4"])
    assert "invalid choice: 'linear_fp4'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(TINY_MOCK_ARGS + ["--linear-quant", "mxfp6"])
    with pytest.raises(ConfigError, match="out of range"):
        validate_args(parse_args(TINY_MOCK_ARGS + ["--train-iters", "2", "--quant-scheme",
                                                   "linear_mxfp8", "--quant-skip-layers", "3"]),
                      check_paths=False)


def _formats(site):
    return {g: (getattr(site, g).a, getattr(site, g).b) for g in ("fprop", "dgrad", "wgrad")}


def test_per_gemm_formats_override_the_scheme_at_quantized_sites():
    cfg = quant("--quant-scheme", "FA_linear_mxfp4", "--quant-wgrad", "none", num_layers=4)
    for site in (cfg.linear, cfg.attn_qk):
        assert _formats(site) == {"fprop": ("mxfp4", "mxfp4"), "dgrad": ("mxfp4", "mxfp4"),
                                  "wgrad": ("none", "none")}
    assert not cfg.attn_pv.enabled                        # kept in high precision: stays so
    text = describe_config(cfg, 4)
    assert "wgrad  input: none" in text and "--quant-wgrad none" in text
    # An MXFP8 dgrad/wgrad keeps the gradient element format for dY.
    cfg = quant("--quant-scheme", "linear_mxfp4", "--mx-grad-format", "e5m2",
                "--quant-fprop", "mxfp8", "--quant-dgrad", "mxfp8")
    assert _formats(cfg.linear) == {"fprop": ("mxfp8_e4m3", "mxfp8_e4m3"),
                                    "dgrad": ("mxfp8_e5m2", "mxfp8_e4m3"),
                                    "wgrad": ("mxfp4", "mxfp4")}
    # An explicit backward GEMM format wins over --no-quant-backward.
    cfg = quant("--quant-scheme", "linear_hifp8", "--no-quant-backward", "--quant-wgrad", "hifp8")
    assert _formats(cfg.linear) == {"fprop": ("hifp8", "hifp8"), "dgrad": ("none", "none"),
                                    "wgrad": ("hifp8", "hifp8")}
    cfg = quant("--quant-scheme", "bf16", "--quant-fprop", "mxfp8")
    assert not cfg.enabled and "change nothing" in describe_config(cfg, 2)
    with pytest.raises(SettingError) as info:
        quant("--quant-scheme", "linear_mxfp4", "--quant-wgrad", "fp7")
    assert_bad_value(str(info.value), "--quant-wgrad", "fp7", ("none", "mxfp8", "hifp8"))


def test_hifp8_scaling_flag(capsys):
    cfg = quant("--quant-scheme", "FA_linear_hifp8", "--hifp8-scaling", "tensor")
    assert cfg.linear.hifp8.scaling == cfg.attn_qk.hifp8.scaling == "tensor"
    assert "HiFP8 per-tensor scaling" in describe_config(cfg, 2)
    assert "MX scale mode" not in describe_config(cfg, 2)
    with pytest.raises(SettingError) as info:
        quant("--quant-scheme", "FA_linear_hifp8", "--hifp8-scaling", "block")
    assert_bad_value(str(info.value), "--hifp8-scaling", "block", ("none", "tensor"))
    args = validate_args(parse_args(TINY_MOCK_ARGS + [
        "--train-iters", "1", "--quant-scheme", "linear_mxfp8", "--quant-dgrad", "none",
        "--hifp8-scaling", "tensor"]), check_paths=False)
    assert _formats(args.quant_config.linear)["dgrad"] == ("none", "none")
    with pytest.raises(SystemExit):
        parse_args(TINY_MOCK_ARGS + ["--train-iters", "1", "--quant-fprop", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The settings are the single source of truth of the flags
# ---------------------------------------------------------------------------------------------

def _flag_fields(cls=QuantSettings):
    """(concern path, field) of every setting with a flag, walking the settings tree."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += [((f.name,) + path, g) for path, g in _flag_fields(hints[f.name])]
        elif f.metadata.get("flag"):
            out.append(((), f))
    return out


def _value(settings, path, f):
    for name in path:
        settings = getattr(settings, name)
    return getattr(settings, f.name)


def test_every_setting_with_a_flag_is_found():
    fields = _flag_fields()
    assert [f.metadata["flag"] for _, f in fields] == flag_names()
    assert len(flag_names()) == len(set(flag_names()))
    # A sample of the concerns: the walk reaches nested settings (backend.attention) too.
    assert {"--quant-scheme", "--mx-scale-mode", "--hifp8-scaling", "--fp8-margin",
            "--quant-recipe", "--quant-kernels", "--quant-attention-impl"} <= set(flag_names())


def test_parsing_no_flags_gives_the_defaults():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed = parser.parse_args([])
    # Every generated flag is read back (as_flags names exactly the parser's dests), plus the
    # record of the flags given (none).
    assert set(vars(parsed)) == set(QuantSettings().as_flags()) | {"quant_flags_given"}
    assert parsed.quant_flags_given == ()
    settings = QuantSettings.from_args(parsed, environ={})
    defaults = QuantSettings()
    assert settings.scheme.scheme == "bf16" and settings.scheme.source == "default"
    assert settings == defaults.replace(scheme=SchemeSettings(scheme="bf16"))
    for path, f in _flag_fields():
        if f.metadata["flag"] != "--quant-scheme":
            assert _value(settings, path, f) == _value(defaults, path, f), f.metadata["flag"]
    # The same through the parser of the quantization flags alone.
    assert settings_from_flags([], environ={}) == settings


# Non-default values for every flag, in three runs (a named recipe, a recipe file and the
# per-site flags exclude each other).
NON_DEFAULT_RUNS = [
    ["--quant-scheme", "FA_linear_fp8", "--linear-quant", "mxfp8", "--attn-qk-quant", "hifp8",
     "--attn-pv-quant", "mxfp4", "--no-quant-backward", "--quant-fprop", "nvfp4",
     "--quant-dgrad", "mxfp6_e2m3", "--quant-wgrad", "none", "--quant-skip-layers", "1", "-1",
     "--quant-output-layer", "--mx-scale-mode", "rceil", "--mx-grad-format", "e5m2",
     "--hifp8-scaling", "tensor", "--fp8-format", "e4m3", "--fp8-recipe", "blockwise",
     "--fp8-margin", "2", "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max",
     "--no-fp8-power-2-scales", "--quant-stochastic-rounding", "grad", "--quant-rht", "32",
     "--quant-rht-gemms", "dgrad", "wgrad", "--no-quant-weight-2d", "--first-last-layers-bf16",
     "--num-layers-at-start-in-bf16", "2", "--num-layers-at-end-in-bf16", "0",
     "--quant-kernels", "eager", "--no-quant-weight-cache", "--quant-attention-impl",
     "unfused"],
    ["--quant-recipe", "nvfp4", "--fp8-power-2-scales", "--quant-kernels", "triton"],
    ["--quant-scheme", "linear_mxfp4", "--quant-recipe-file", "recipe.yaml",
     "--quant-weight-2d", "--quant-stochastic-rounding", "all"],
    ["--quant-backward-override", "dequantized", "--quant-accumulation-bits", "13",
     "--quant-accumulation-group", "16", "--quant-accumulation-promotion", "64",
     "--quant-accumulation-gemms", "fprop", "--fp8-format", "hybrid",
     "--fp8-dot-product-attention", "--fp8-attention-backward", "high_precision",
     "--fp8-attention-dp", "high_precision"],
    ["--quant-scheme", "linear_nvfp4", "--nvfp4-4over6", "weights", "--nvfp4-4over6-err-mode",
     "mse", "--nvfp4-4over6-e4m3-use-256", "none", "--nvfp4-row-scaled-activation",
     "--mx-scale-mode", "even", "--quant-schedule", "high_precision_forward@0.8",
     "quantized@95"],
]


def _argv(settings):
    """The command line of a settings object's as_flags(): what a user would type for them
    (--quant-scheme only when the scheme came from that flag)."""
    flags = settings.as_flags()
    argv = []
    fields = {f.metadata["flag"]: f for _, f in _flag_fields()}
    for flag in flag_names():
        value = flags[flag.lstrip("-").replace("-", "_")]
        f = fields[flag]
        if value is None or value == () or value == f.default:
            continue
        if flag == "--quant-scheme" and settings.scheme.source != "--quant-scheme":
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, tuple):
            argv += [flag] + [str(v) for v in value]
        else:
            argv += [flag, str(value)]
    return argv


def test_non_default_settings_round_trip():
    runs = [settings_from_flags(argv, environ={}) for argv in NON_DEFAULT_RUNS]
    first = runs[0]
    # What the flags say, typed (checked by hand, not through the generator).
    assert first.scheme == SchemeSettings(
        scheme="FA_linear_fp8", linear_quant="mxfp8", attn_qk_quant="hifp8",
        attn_pv_quant="mxfp4", backward=False, fprop="nvfp4", dgrad="mxfp6_e2m3", wgrad="none",
        skip_layers=("1", "-1"), output_layer=True, source="--quant-scheme")
    assert (first.mx.scale_mode, first.mx.grad_format, first.hifp8.scaling) == (
        "rceil", "e5m2", "tensor")
    assert (first.fp8.format, first.fp8.recipe, first.fp8.margin, first.fp8.amax_history_len,
            first.fp8.amax_compute_algo, first.fp8.pow2_scale) == (
        "e4m3", "blockwise", 2, 16, "max", False)
    r = first.recipe
    assert (r.stochastic_rounding, r.rht, r.rht_gemms, r.weight_2d, r.bf16_layers) == (
        "grad", 32, ("dgrad", "wgrad"), False, (2, 0))
    b = first.backend
    assert (b.kernels, b.weight_cache, b.attention.impl) == ("eager", False, "unfused")
    assert runs[1].recipe.recipe == "nvfp4" and runs[1].fp8.pow2_scale is True
    assert runs[2].recipe.recipe_file == "recipe.yaml" and runs[2].recipe.weight_2d is True
    assert runs[4].recipe.schedule == ("high_precision_forward@0.8", "quantized@95")
    # Together the runs give every flag a non-default value.
    defaults = QuantSettings()
    for path, f in _flag_fields():
        assert any(_value(s, path, f) != _value(defaults, path, f) for s in runs), \
            f.metadata["flag"]
    for settings in runs:
        read_back = QuantSettings.from_args(argparse.Namespace(**settings.as_flags()),
                                            environ={})
        # as_flags() holds the scheme's value, not where it came from: read back, a value is
        # a given --quant-scheme.
        assert read_back.scheme.source == "--quant-scheme"
        assert read_back.replace(scheme=read_back.scheme.replace(
            source=settings.scheme.source)) == settings
        assert settings_from_flags([], base=settings, environ={}) == settings
        assert settings_from_flags(_argv(settings), environ={}) == settings
        # A flag given on top of a base changes that setting alone.
        changed = settings_from_flags(["--mx-grad-format", "e4m3"], base=settings, environ={})
        assert changed == settings.replace(mx=settings.mx.replace(grad_format="e4m3"))


def _squash(text):
    return re.sub(r"\s+", "", text)


def test_every_flag_is_documented_in_pretrain_help():
    help_text = build_parser().format_help()      # what pretrain_gpt.py --help prints
    squashed = _squash(help_text)
    for _, f in _flag_fields():
        flag, text = f.metadata["flag"], f.metadata["help"]
        assert text and text.strip(), f"{flag} has no help"
        assert re.search(re.escape(flag) + r"[\s,]", help_text), f"{flag} not in --help"
        # argparse re-wraps the text: compare without whitespace.
        assert _squash(text) in squashed, f"{flag}'s help not in --help"
    assert "--no-quant-backward" in help_text and "--no-quant-weight-cache" in help_text


@pytest.mark.parametrize("flag,value,valid", [
    ("--fp8-amax-history-len", "0", "1..65536"),
    ("--fp8-amax-history-len", "1000000000", "1..65536"),
    ("--fp8-margin", "-1", "0..64"),
    ("--num-layers-at-start-in-bf16", "-1", "0.."),
])
def test_bounded_settings_reject_values_out_of_range(flag, value, valid):
    with pytest.raises(SettingError) as info:
        quant("--quant-scheme", "linear_fp8", flag, value)
    message = str(info.value)
    assert "\n" not in message and flag in message and value in message and valid in message
    with pytest.raises(ConfigError) as info:
        validate_args(parse_args(TINY_MOCK_ARGS + ["--train-iters", "1", "--quant-scheme",
                                                   "linear_fp8", flag, value]),
                      check_paths=False)
    assert str(info.value) == message


def test_every_bounded_setting_names_its_range():
    bounded = [f for _, f in _flag_fields()
               if f.metadata.get("minimum") is not None or f.metadata.get("maximum") is not None]
    assert {"--fp8-margin", "--fp8-amax-history-len"} <= {f.metadata["flag"] for f in bounded}
    for f in bounded:
        flag, lo, hi = f.metadata["flag"], f.metadata["minimum"], f.metadata["maximum"]
        for bad in ([lo - 1] if lo is not None else []) + ([hi + 1] if hi is not None else []):
            with pytest.raises(SettingError) as info:
                settings_from_flags([flag, str(bad)], environ={})
            message = str(info.value)
            assert "\n" not in message and f"{flag} {bad}" in message and "valid:" in message
            assert f"{lo if lo is not None else '-inf'}..{hi if hi is not None else 'inf'}" \
                in message


def _validated(extra, monkeypatch):
    monkeypatch.delenv("CUSTOM_QUANT_TYPE", raising=False)
    args = parse_args(TINY_MOCK_ARGS + ["--train-iters", "2"] + extra)
    return validate_args(args, check_paths=False)


def test_run_label(tmp_path, monkeypatch):
    args = _validated(["--quant-recipe", "nvfp4"], monkeypatch)
    assert args.quant_config.label == "recipe_nvfp4" and args.quant_scheme is None
    assert args.quant_config.source == "--quant-recipe"
    args = _validated(["--fp8-format", "hybrid"], monkeypatch)
    assert args.quant_config.label == "linear_fp8" and args.quant_scheme is None
    assert args.quant_config.source == "--fp8-format" and args.quant_config.scheme == "linear_fp8"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("configs: {a: {format: nvfp4}}\nmatchers: {m: {config: a, type: glob, "
                      "pattern: '*linear_fc1', enabled: true}}\n")
    args = _validated(["--quant-recipe-file", str(recipe)], monkeypatch)
    assert args.quant_config.label == "recipe_file" and args.quant_config.scheme == "bf16"
    assert args.quant_config.source == "default and --quant-recipe-file"
    args = _validated([], monkeypatch)
    assert args.quant_config.label == "bf16" and args.quant_config.source == "default"


def test_the_flags_given_are_recorded_at_any_value():
    """QuantSettings.given: the flags on the command line, at their default value too; a
    namespace that no parser of these flags made gives the flags off their defaults."""
    args = validate_args(parse_args(TINY_MOCK_ARGS + [
        "--train-iters", "2", "--mx-scale-mode", "floor", "--no-quant-backward",
        "--quant-output-layer"]), check_paths=False)
    assert args.quant_config.settings.given == {"--mx-scale-mode", "--quant-backward",
                                                "--quant-output-layer"}
    assert settings_from_flags([]).given == frozenset()
    assert settings_from_flags(["--fp8-amax-history-len", "1"]).given == \
        {"--fp8-amax-history-len"}
    base = settings_from_flags(["--mx-scale-mode", "floor"])
    assert settings_from_flags(["--quant-rht", "16"], base=base).given == \
        {"--mx-scale-mode", "--quant-rht"}
    by_hand = argparse.Namespace(mx_scale_mode="even", fp8_margin=0, quant_skip_layers=None)
    assert QuantSettings.from_args(by_hand, environ={}).given == {"--mx-scale-mode"}
    # Not a setting: the recorded flags (as_flags, checkpoints) do not change.
    assert "quant_flags_given" not in settings_from_flags(["--mx-scale-mode", "floor"]).as_flags()


def test_validate_args_refuses_a_default_value_the_preset_replaces():
    with pytest.raises(ConfigError, match="sets --mx-scale-mode rceil; drop --mx-scale-mode "
                                          "floor"):
        validate_args(parse_args(TINY_MOCK_ARGS + [
            "--train-iters", "2", "--quant-recipe", "bf16_with_mxfp8_mixed",
            "--mx-scale-mode", "floor"]), check_paths=False)
