"""Named recipes (--quant-recipe NAME): Megatron-Bridge's mixed-precision recipes and
TransformerEngine's quantizer-factory combinations, each checked against what its source
defines (formats per GEMM operand, scaling, BF16 layers, backward sources), every one trained a
step of llama-tiny on the CPU with its formats in the start-up table, and the flags that would
contradict one refused."""

import pytest
import torch

import pretrain_gpt
from conftest import TINY_MOCK_ARGS
from megatron.evaluation.specs import arm_config
from megatron.quantization.config import RECIPE_NAMES, QuantSettings, SettingError
from megatron.quantization.describe import describe_config
from megatron.quantization.formats import fake_quantize
from megatron.quantization.gemm import quantized_linear
from megatron.quantization.schemes import quant_config
from megatron.training.training import pretrain

E4M3, E5M2, MX8 = "fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3"
FP8_HYBRID = ((E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2))
NVFP4 = (("nvfp4", "nvfp4"),) * 3
NONE2 = ("none", "none")

# name: ((fprop, dgrad, wgrad) operand formats, BF16 layers of 16, what else it defines)
EXPECTED = {
    "bf16_with_mxfp8_mixed": (((MX8, MX8),) * 3, set(), dict(scale_mode="rceil")),
    "bf16_with_fp8_current_scaling_mixed": (FP8_HYBRID, {1, 16}, dict(fp8="tensorwise")),
    "bf16_with_fp8_delayed_scaling_mixed": (FP8_HYBRID, set(), dict(fp8="delayed")),
    "bf16_with_fp8_subchannel_scaling_mixed": (FP8_HYBRID, set(), dict(fp8="blockwise",
                                                                       weight_2d=True)),
    "bf16_with_nvfp4_mixed": (NVFP4, set(), dict(weight_2d=True, rht=("wgrad",),
                                                 stochastic={"dgrad.a", "wgrad.b"})),
    "nemotron_3_super_bf16_with_nvfp4_mixed": (NVFP4, set(range(3, 17)), dict(weight_2d=True)),
    "mxfp8_fwd_nvfp4_bwd": (((MX8, MX8), ("nvfp4", "nvfp4"), ("nvfp4", "nvfp4")), set(),
                            dict(rht=("wgrad",), sources={"weight"}, weight_2d=False)),
    "high_precision_fwd_mxfp8_bwd": ((NONE2, (MX8, MX8), (MX8, MX8)), set(), {}),
    "mxfp8_fwd_high_precision_bwd": (((MX8, MX8), NONE2, NONE2), set(),
                                     dict(override="dequantized")),
    "nvfp4_1d_weight": (NVFP4, set(), dict(weight_2d=False, sources={"weight"})),
    "nvfp4_4over6": (NVFP4, set(), dict(weight_2d=True, rht=(), stochastic=set(),
                                        four_over_six="all")),
    "nvfp4_row_scaled_fwd_high_precision_bwd": ((("nvfp4", "nvfp4"), NONE2, NONE2), set(),
                                                dict(row_scaled=True,
                                                     override="dequantized")),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_preset_is_what_its_source_defines(name):
    formats, bf16, other = EXPECTED[name]
    q = quant_config(["--quant-recipe", name], num_layers=16)
    lin = q.linear
    assert tuple((getattr(lin, g).a, getattr(lin, g).b) for g in ("fprop", "dgrad", "wgrad")) \
        == formats
    assert set(q.skip_layers) == bf16
    assert not q.attn_qk.enabled and not q.attn_pv.enabled
    checks = {"scale_mode": lambda v: lin.mx.scale_mode == v,
              "fp8": lambda v: lin.fp8.scaling == v and lin.fp8.format == "hybrid",
              "weight_2d": lambda v: lin.weight_2d == v,
              "rht": lambda v: lin.rht.gemms == v,
              "stochastic": lambda v: lin.stochastic == v,
              "sources": lambda v: lin.dequantized_sources == v,
              "override": lambda v: lin.gemm.backward_override == v,
              "four_over_six": lambda v: lin.nvfp4.four_over_six == v,
              "row_scaled": lambda v: lin.nvfp4.row_scaled_activation == v}
    for key, value in other.items():
        assert checks[key](value), (name, key)
    if name == "bf16_with_fp8_delayed_scaling_mixed":
        assert (lin.fp8.amax_history_len, lin.fp8.amax_compute_algo, lin.fp8.margin) == (
            1024, "max", 0)


def test_every_named_recipe_is_covered_here():
    assert set(RECIPE_NAMES) == set(EXPECTED) | {"nvfp4", "mxfp4_rht_sr"}


def test_the_weight_of_mxfp8_fwd_nvfp4_bwd_is_requantized_from_the_mxfp8_copy():
    """TE's HybridQuantizer(row=MXFP8, col=NVFP4 1-D, columnwise_source=rowwise_dequantized):
    the dgrad weight is NVFP4 (blocks along N) of the MXFP8-dequantized weight (blocks along K,
    rceil), not of the weight itself; wgrad's X is quantized from the original (rotated) X."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 64, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(48, 64, generator=g) * 0.05).bfloat16().requires_grad_()
    config = quant_config(["--quant-recipe", "mxfp8_fwd_nvfp4_bwd"], num_layers=2).linear
    seen = {}

    def observer(gemm, operand, hp, q, fmt, axis, **extra):
        seen[(gemm, operand)] = (hp.detach(), q)
    quantized_linear(x, w, None, config, observer).backward(torch.randn(4, 8, 48).bfloat16())
    mx_w = fake_quantize(w.detach(), "mxfp8_e4m3", axis=1, scale_mode="rceil")
    assert torch.equal(seen["fprop", "weight"][1], mx_w)
    hp, q = seen["dgrad", "weight"]
    assert torch.equal(hp, mx_w) and torch.equal(q, fake_quantize(mx_w, "nvfp4", axis=0))
    assert not torch.equal(q, fake_quantize(w.detach(), "nvfp4", axis=0))
    # wgrad's input is the original X (rotated, zero-padded to the block), not the MXFP8 copy
    hp_x, _ = seen["wgrad", "input"]
    assert hp_x.shape == (32, 64)
    assert not torch.equal(hp_x, x.detach().reshape(32, 64))     # rotated


@pytest.mark.parametrize("argv, message", [
    (["--quant-recipe", "bf16_with_mxfp8_mixed", "--mx-scale-mode", "even"],
     "--quant-recipe bf16_with_mxfp8_mixed sets --mx-scale-mode rceil; drop --mx-scale-mode "
     "even"),
    (["--quant-recipe", "bf16_with_fp8_current_scaling_mixed", "--fp8-format", "e4m3"],
     "sets --fp8-format hybrid; drop --fp8-format e4m3"),
    (["--quant-recipe", "nvfp4_4over6", "--nvfp4-4over6-err-mode", "mse"],
     "sets --nvfp4-4over6-err-mode mae"),
    (["--quant-recipe", "mxfp8_fwd_high_precision_bwd", "--quant-backward-override",
      "high_precision"], "sets --quant-backward-override dequantized"),
])
def test_a_flag_that_contradicts_the_preset_is_refused(argv, message):
    with pytest.raises(SettingError, match=message):
        quant_config(argv, num_layers=4)


def test_a_preset_takes_the_settings_it_leaves_open():
    """What a preset does not define stays the run's: the accumulator model, 4/6 on the
    weights of an NVFP4 preset, the MX gradient format of a preset that does not set it."""
    lin = quant_config(["--quant-recipe", "bf16_with_nvfp4_mixed", "--quant-accumulation-bits",
                        "13", "--nvfp4-4over6", "weights"], num_layers=4).linear
    assert lin.gemm.accumulation_bits == 13 and lin.nvfp4.four_over_six == "weights"
    lin = quant_config(["--quant-recipe", "mxfp8_fwd_nvfp4_bwd", "--mx-grad-format", "e5m2"],
                       num_layers=4).linear
    assert lin.mx.grad_format == "e5m2"


def test_evaluation_specs_name_every_preset():
    """tools/evaluate.py's recipe_<name> specs reach every preset."""
    for name in RECIPE_NAMES:
        config = arm_config(f"recipe_{name}", QuantSettings(), num_layers=16, seed=0)
        assert config.recipe == name
        assert config.linear == quant_config(["--quant-recipe", name], num_layers=16).linear


@pytest.mark.parametrize("name", sorted(RECIPE_NAMES))
def test_every_preset_trains_and_shows_its_formats(name, capsys):
    result = pretrain(pretrain_gpt.forward_step, TINY_MOCK_ARGS + [
        "--train-iters", "1", "--quant-recipe", name])
    assert result.exit_reason == "train-iters"
    assert all(torch.isfinite(torch.tensor(list(result.losses.values()))))
    out = capsys.readouterr().out
    assert f"quantization: recipe {name}" in out
    table = describe_config(quant_config(["--quant-recipe", name], num_layers=2))
    for line in table.splitlines()[3:6]:          # the fprop, dgrad and wgrad lines
        assert line.strip() in out, (name, line)


# -- flags a preset would otherwise drop without a word -------------------------------------


def test_the_scheme_variable_does_not_add_sites_to_a_named_recipe():
    # $CUSTOM_QUANT_TYPE is --quant-scheme's default; every preset keeps attention in BF16.
    config = quant_config(["--quant-recipe", "nvfp4"], environ={"CUSTOM_QUANT_TYPE": "mxfp8"})
    assert (config.attn_qk.fprop.a, config.attn_pv.fprop.a) == ("none", "none")
    assert config.linear.fprop.a == "nvfp4"
    assert any("CUSTOM_QUANT_TYPE=FA_linear_mxfp8 is not used" in n for n in config.notes)


@pytest.mark.parametrize("argv, message", [
    (["--quant-recipe", "nvfp4", "--fp8-format", "e4m3"],
     "--quant-recipe nvfp4 with --fp8-format e4m3: the recipe decides"),
    (["--quant-recipe", "bf16_with_mxfp8_mixed", "--fp8-format", "hybrid", "--fp8-recipe",
      "tensorwise"], "with --fp8-format hybrid --fp8-recipe tensorwise: the recipe decides"),
    (["--quant-recipe", "bf16_with_nvfp4_mixed", "--no-quant-backward"],
     "with --no-quant-backward: the recipe sets these"),
    (["--quant-recipe", "nvfp4_4over6", "--quant-kernels", "triton"],
     "--quant-kernels triton with NVFP4 4/6 or per-token scales"),
    (["--quant-recipe", "nvfp4_row_scaled_fwd_high_precision_bwd", "--quant-kernels",
      "compile"], "--quant-kernels compile with NVFP4 4/6 or per-token scales"),
    (["--quant-recipe", "high_precision_fwd_mxfp8_bwd", "--quant-backward-override",
      "dequantized"], "forward GEMM is in high precision"),
    (["--quant-recipe", "mxfp4_rht_sr", "--quant-backward-override", "high_precision"],
     "forward GEMM is in high precision"),
    (["--quant-recipe", "bf16_with_fp8_subchannel_scaling_mixed", "--fp8-format", "hybrid",
      "--fp8-dot-product-attention"], "FP8 attention takes tensorwise, delayed or mxfp8"),
])
def test_flags_a_preset_would_ignore_are_refused(argv, message):
    with pytest.raises(SettingError, match=message.replace("(", r"\(").replace(")", r"\)")):
        quant_config(argv)


def test_an_evaluation_arm_refuses_kernels_its_recipes_variants_lack():
    from megatron.training.errors import ConfigError
    with pytest.raises(ConfigError, match="--quant-kernels triton with NVFP4 4/6"):
        arm_config("recipe_nvfp4_4over6@quant-kernels=triton", QuantSettings(), 2, 0)


def test_fp8_attention_follows_the_presets_scaling():
    # TE's FP8 attention takes the run's recipe: Q, K, V current-scaled under
    # Float8CurrentScaling, delayed with the preset's history (1024, max) under DelayedScaling.
    current = quant_config(["--quant-recipe", "bf16_with_fp8_current_scaling_mixed",
                            "--fp8-format", "hybrid", "--fp8-dot-product-attention"])
    assert current.attn_qk.fp8.scaling == "tensorwise"
    assert not current.attn_qk.delayed("fp8_e4m3", "fprop.a")
    assert current.attn_pv.delayed("fp8_e4m3", "fprop.a")          # P (TE's S) stays delayed
    delayed = quant_config(["--quant-recipe", "bf16_with_fp8_delayed_scaling_mixed",
                            "--fp8-format", "hybrid", "--fp8-dot-product-attention"])
    assert (delayed.attn_qk.fp8.amax_history_len, delayed.attn_qk.fp8.amax_compute_algo) == \
        (1024, "max")
    # Not an FP8 preset: attention takes the run's own FP8 flags.
    nvfp4 = quant_config(["--quant-recipe", "nvfp4", "--fp8-format", "hybrid", "--fp8-recipe",
                          "tensorwise", "--fp8-dot-product-attention"])
    assert nvfp4.attn_qk.fp8.scaling == "tensorwise" and nvfp4.linear.fprop.a == "nvfp4"


def test_fp8_recipe_mxfp8_refuses_another_scale_rule():
    with pytest.raises(SettingError, match="drop --mx-scale-mode ceil"):
        quant_config(["--quant-scheme", "linear_mxfp8", "--mx-scale-mode", "ceil",
                      "--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"])
    assert quant_config(["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8", "--mx-scale-mode",
                         "rceil"]).linear.mx.scale_mode == "rceil"


# -- flags given at their default value ------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--quant-recipe", "bf16_with_mxfp8_mixed", "--mx-scale-mode", "floor"],
     "--quant-recipe bf16_with_mxfp8_mixed sets --mx-scale-mode rceil; drop --mx-scale-mode "
     "floor"),
    (["--quant-recipe", "bf16_with_fp8_delayed_scaling_mixed", "--fp8-amax-compute-algo",
      "most_recent"], "sets --fp8-amax-compute-algo max; drop --fp8-amax-compute-algo "
                      "most_recent"),
    (["--quant-recipe", "bf16_with_fp8_delayed_scaling_mixed", "--fp8-amax-history-len", "1"],
     "sets --fp8-amax-history-len 1024; drop --fp8-amax-history-len 1"),
    (["--quant-recipe", "nvfp4_4over6", "--nvfp4-4over6", "none"],
     "--quant-recipe nvfp4_4over6 sets --nvfp4-4over6 all; drop --nvfp4-4over6 none"),
    (["--quant-recipe", "high_precision_fwd_mxfp8_bwd", "--mx-grad-format", "e4m3",
      "--mx-scale-mode", "floor"], "sets --mx-scale-mode rceil; drop --mx-scale-mode floor"),
])
def test_a_flag_given_at_its_default_that_contradicts_the_preset_is_refused(argv, message):
    # The default is a value like any other once it is given: the preset must not replace it.
    with pytest.raises(SettingError, match=f"{message}$"):
        quant_config(argv, num_layers=4)


def test_a_flag_given_at_the_presets_value_is_accepted():
    lin = quant_config(["--quant-recipe", "bf16_with_mxfp8_mixed", "--mx-scale-mode", "rceil",
                        "--mx-grad-format", "e4m3"], num_layers=4).linear
    assert (lin.mx.scale_mode, lin.mx.grad_format) == ("rceil", "e4m3")
    lin = quant_config(["--quant-recipe", "bf16_with_fp8_delayed_scaling_mixed",
                        "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
                        "--fp8-amax-compute-algo", "max", "--fp8-margin", "0"],
                       num_layers=4).linear
    assert (lin.fp8.amax_history_len, lin.fp8.amax_compute_algo) == (1024, "max")
    lin = quant_config(["--quant-recipe", "nvfp4_4over6", "--nvfp4-4over6", "all"],
                       num_layers=4).linear
    assert lin.nvfp4.four_over_six == "all"


def test_an_evaluation_arm_refuses_a_default_value_its_preset_replaces():
    from megatron.training.errors import ConfigError
    with pytest.raises(ConfigError, match="sets --mx-scale-mode rceil; drop --mx-scale-mode "
                                          "floor"):
        arm_config("recipe_bf16_with_mxfp8_mixed@mx-scale-mode=floor", QuantSettings(), 2, 0)
    config = arm_config("recipe_bf16_with_mxfp8_mixed@mx-scale-mode=rceil", QuantSettings(),
                        2, 0)
    assert config.linear.mx.scale_mode == "rceil"
    # A flag of the run's command line applies to every arm: given at the default, too.
    from megatron.quantization.config import settings_from_flags
    base = settings_from_flags(["--mx-scale-mode", "floor"])
    assert base.given == {"--mx-scale-mode"}
    assert arm_config("linear_mxfp8", base, 2, 0).linear.mx.scale_mode == "floor"
    with pytest.raises(ConfigError, match="drop --mx-scale-mode floor"):
        arm_config("recipe_bf16_with_mxfp8_mixed", base, 2, 0)


def test_fp8_recipe_mxfp8_refuses_the_scale_rule_and_gradient_format_given_at_others():
    with pytest.raises(SettingError, match="rceil scale rule; drop --mx-scale-mode floor"):
        quant_config(["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8", "--mx-scale-mode",
                      "floor"])
    with pytest.raises(SettingError, match="gradients in E5M2; drop --mx-grad-format e4m3"):
        quant_config(["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8", "--mx-grad-format",
                      "e4m3"])
    with pytest.raises(SettingError, match="gradients in E4M3; drop --mx-grad-format e5m2"):
        quant_config(["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--mx-grad-format",
                      "e5m2"])
    mx = quant_config(["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8", "--mx-grad-format",
                       "e5m2"]).linear.mx
    assert (mx.scale_mode, mx.grad_format) == ("rceil", "e5m2")
    mx = quant_config(["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"]).linear.mx
    assert (mx.scale_mode, mx.grad_format) == ("rceil", "e5m2")


def test_a_setting_the_fp8_flags_imply_is_named_with_them_not_as_a_flag_to_drop():
    # --fp8-format hybrid --fp8-recipe mxfp8 imply E5M2 gradients; the preset sets E4M3. The
    # message names the flags given, not --mx-grad-format, which was not.
    argv = ["--quant-recipe", "bf16_with_mxfp8_mixed", "--fp8-format", "hybrid", "--fp8-recipe",
            "mxfp8", "--fp8-dot-product-attention"]
    with pytest.raises(SettingError) as info:
        quant_config(argv)
    assert str(info.value) == (
        "--quant-recipe bf16_with_mxfp8_mixed sets --mx-grad-format e4m3, but --fp8-format "
        "hybrid --fp8-recipe mxfp8 imply --mx-grad-format e5m2; change or drop --fp8-format "
        "hybrid")
    argv[argv.index("hybrid")] = "e4m3"
    assert quant_config(argv).linear.mx.grad_format == "e4m3"
