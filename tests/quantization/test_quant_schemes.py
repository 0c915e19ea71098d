"""Named schemes and overrides -> the per-GEMM QuantConfig, and the argument group."""

import pytest

from megatron.quantization.schemes import (
    SCHEMES,
    SEED_SCHEMES,
    SchemeError,
    RecipeSettings,
    build_quant_config,
    parse_layer_list,
    scheme_from_env,
)
from megatron.training.arguments import ConfigError, parse_args, validate_args

from conftest import TINY_MOCK_ARGS


def test_the_ten_schemes():
    assert SEED_SCHEMES == ("bf16", "FA_mxfp8", "FA_mxfp4", "FA_hifp8", "linear_mxfp8",
                            "linear_mxfp4", "linear_hifp8", "FA_linear_mxfp8", "FA_linear_mxfp4",
                            "FA_linear_hifp8")
    newer = {f"{prefix}_{fmt}" for prefix in ("FA", "linear", "FA_linear")
             for fmt in ("nvfp4", "mxfp6_e2m3", "mxfp6_e3m2", "fp8")}
    assert set(SCHEMES) == set(SEED_SCHEMES) | newer and SCHEMES[:4] == SEED_SCHEMES[:4]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_scheme_sites(scheme):
    cfg = build_quant_config(scheme, num_layers=4)
    fmt = scheme if scheme == "bf16" else scheme.split("_", 2 if scheme.startswith("FA_linear") else 1)[-1]
    # FP8 schemes: E4M3 everywhere under --fp8-format e4m3; the default hybrid differs only
    # in the gradient operands (tested in test_recipes.py).
    if fmt == "fp8":
        cfg = build_quant_config(scheme, num_layers=4, recipe_settings=RecipeSettings(
            fp8_format="e4m3"))
    element = {"mxfp8": "mxfp8_e4m3", "mxfp4": "mxfp4", "hifp8": "hifp8", "bf16": None,
               "nvfp4": "nvfp4", "mxfp6_e2m3": "mxfp6_e2m3", "mxfp6_e3m2": "mxfp6_e3m2",
               "fp8": "fp8_e4m3"}[fmt]
    assert cfg.linear.enabled == ("linear" in scheme)
    assert cfg.attn_qk.enabled == scheme.startswith("FA")
    assert not cfg.attn_pv.enabled and not cfg.output_layer.enabled
    for site in (cfg.linear, cfg.attn_qk):
        if site.enabled:
            # Every GEMM, both operands; MXFP8 gradients in E4M3 by default.
            for gemm in ("fprop", "dgrad", "wgrad"):
                ops = getattr(site, gemm)
                assert (ops.a, ops.b) == (element, element)


def test_mxfp8_gradient_format_and_backward_switch():
    cfg = build_quant_config("linear_mxfp8", 2, grad_format="e5m2")
    assert (cfg.linear.fprop.a, cfg.linear.fprop.b) == ("mxfp8_e4m3", "mxfp8_e4m3")
    assert (cfg.linear.dgrad.a, cfg.linear.dgrad.b) == ("mxfp8_e5m2", "mxfp8_e4m3")
    assert (cfg.linear.wgrad.a, cfg.linear.wgrad.b) == ("mxfp8_e4m3", "mxfp8_e5m2")
    fwd = build_quant_config("linear_mxfp8", 2, backward=False)
    assert fwd.linear.fprop.a == "mxfp8_e4m3"
    assert (fwd.linear.dgrad.a, fwd.linear.wgrad.b) == ("none", "none")
    # MXFP4 and HiFP8 quantize gradients in their own format.
    fp4 = build_quant_config("linear_mxfp4", 2, grad_format="e5m2")
    assert fp4.linear.dgrad.a == "mxfp4"


def test_overrides_win_and_are_noted():
    cfg = build_quant_config("FA_mxfp8", 4, linear_quant="hifp8", attn_pv_quant="mxfp4",
                             attn_qk_quant="none", scale_mode="rceil")
    assert cfg.linear.fprop.a == "hifp8" and cfg.attn_pv.fprop.b == "mxfp4"
    assert not cfg.attn_qk.enabled and cfg.attn_pv.scale_mode == "rceil"
    assert len(cfg.notes) == 3 and any("--attn-qk-quant none overrides" in n for n in cfg.notes)
    text = cfg.describe(4)
    assert "attention PV" in text and "probs: mxfp4" in text and "rceil" in text


def test_skip_layers_and_output_layer():
    cfg = build_quant_config("linear_mxfp8", 6, skip_layers=["1", "-1"], output_layer=True)
    assert cfg.skip_layers == {1, 6}
    assert not cfg.for_site("linear", 1).enabled and not cfg.for_site("linear", 6).enabled
    assert cfg.for_site("linear", 3).enabled and cfg.for_site("output_layer", None).enabled


def test_parse_layer_list():
    assert parse_layer_list(["2-4", "1,-1"], 8) == {1, 2, 3, 4, 8}
    assert parse_layer_list(["-2--1"], 8) == {7, 8}
    with pytest.raises(SchemeError, match="layer 9 is out of range for 8 layers"):
        parse_layer_list(["9"], 8)
    with pytest.raises(SchemeError, match="'first' is not a layer number"):
        parse_layer_list(["first"], 8)


def test_environment_seeds_the_default():
    assert scheme_from_env({}) == "bf16"
    assert scheme_from_env({"CUSTOM_QUANT_TYPE": "linear_hifp8"}) == "linear_hifp8"
    assert scheme_from_env({"CUSTOM_QUANT_TYPE": "mxfp4"}) == "FA_linear_mxfp4"
    with pytest.raises(SchemeError, match="CUSTOM_QUANT_TYPE='fp6'"):
        scheme_from_env({"CUSTOM_QUANT_TYPE": "fp6"})


def test_flags_and_environment(monkeypatch):
    monkeypatch.setenv("CUSTOM_QUANT_TYPE", "FA_hifp8")
    args = validate_args(parse_args(TINY_MOCK_ARGS + ["--train-iters", "2"]), check_paths=False)
    assert args.quant_scheme == "FA_hifp8" and args.quant_scheme_source == "CUSTOM_QUANT_TYPE"
    args = validate_args(parse_args(TINY_MOCK_ARGS + ["--train-iters", "2", "--quant-scheme",
                                                      "linear_mxfp4", "--no-quant-backward"]),
                         check_paths=False)
    assert args.quant_scheme == "linear_mxfp4" and args.quant_config.linear.dgrad.a == "none"
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
    cfg = build_quant_config("FA_linear_mxfp4", 4, gemm_formats={"wgrad": "none"})
    for site in (cfg.linear, cfg.attn_qk):
        assert _formats(site) == {"fprop": ("mxfp4", "mxfp4"), "dgrad": ("mxfp4", "mxfp4"),
                                  "wgrad": ("none", "none")}
    assert not cfg.attn_pv.enabled                        # kept in high precision: stays so
    text = cfg.describe(4)
    assert "wgrad  input: none" in text and "--quant-wgrad none" in text
    # An MXFP8 dgrad/wgrad keeps the gradient element format for dY.
    cfg = build_quant_config("linear_mxfp4", 2, grad_format="e5m2",
                             gemm_formats={"fprop": "mxfp8", "dgrad": "mxfp8"})
    assert _formats(cfg.linear) == {"fprop": ("mxfp8_e4m3", "mxfp8_e4m3"),
                                    "dgrad": ("mxfp8_e5m2", "mxfp8_e4m3"),
                                    "wgrad": ("mxfp4", "mxfp4")}
    # An explicit backward GEMM format wins over --no-quant-backward.
    cfg = build_quant_config("linear_hifp8", 2, backward=False, gemm_formats={"wgrad": "hifp8"})
    assert _formats(cfg.linear) == {"fprop": ("hifp8", "hifp8"), "dgrad": ("none", "none"),
                                    "wgrad": ("hifp8", "hifp8")}
    cfg = build_quant_config("bf16", 2, gemm_formats={"fprop": "mxfp8"})
    assert not cfg.enabled and "change nothing" in cfg.describe(2)
    with pytest.raises(SchemeError, match="--quant-wgrad 'fp7' is not a format"):
        build_quant_config("linear_mxfp4", 2, gemm_formats={"wgrad": "fp7"})


def test_hifp8_scaling_flag(capsys):
    cfg = build_quant_config("FA_linear_hifp8", 2, hifp8_scaling="tensor")
    assert cfg.linear.hifp8_scaling == cfg.attn_qk.hifp8_scaling == "tensor"
    assert "HiFP8 per-tensor scaling" in cfg.describe(2)
    assert "MX scale mode" not in cfg.describe(2)
    with pytest.raises(SchemeError, match="unknown HiFP8 scaling 'block'"):
        build_quant_config("FA_linear_hifp8", 2, hifp8_scaling="block")
    args = validate_args(parse_args(TINY_MOCK_ARGS + [
        "--train-iters", "1", "--quant-scheme", "linear_mxfp8", "--quant-dgrad", "none",
        "--hifp8-scaling", "tensor"]), check_paths=False)
    assert _formats(args.quant_config.linear)["dgrad"] == ("none", "none")
    with pytest.raises(SystemExit):
        parse_args(TINY_MOCK_ARGS + ["--train-iters", "1", "--quant-fprop", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
