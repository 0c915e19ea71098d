"""The NVFP4 variants in the GEMM sites: --nvfp4-4over6 / -err-mode / -e4m3-use-256 and
--nvfp4-row-scaled-activation give each linear operand the options TransformerEngine gives its
role (weights, activations; gradients never), the start-up table says so per operand, and the
combinations TE refuses are refused with one line."""

import json

import pytest
import torch

from megatron.quantization.config import SettingError
from megatron.quantization.describe import describe_config
from megatron.quantization.formats import fake_quantize
from megatron.quantization.gemm import quantized_linear
from megatron.quantization.schemes import quant_config


def linear_operands(argv, x, w, dy):
    """{(gemm, operand): (hp, q, axis)} of one quantized_linear forward and backward."""
    config = quant_config(argv, num_layers=2).linear
    seen = {}

    def observer(gemm, operand, hp, q, fmt, axis, **extra):
        if q is not None:
            seen[(gemm, operand)] = (hp.detach().clone(), q.detach().clone(), axis)
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    quantized_linear(x, w, None, config, observer).backward(dy)
    return seen


@pytest.fixture(scope="module")
def tensors():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 64, generator=g) * torch.exp2(torch.randint(-6, 6, (6, 5, 1),
                                                                     generator=g).float())
    return x, torch.randn(48, 64, generator=g) * 0.05, torch.randn(6, 5, 48, generator=g)


def expected(hp, axis, **options):
    return fake_quantize(hp, "nvfp4", axis=axis, **options)


@pytest.mark.parametrize("scope, use_256, row_scaled", [
    ("all", "all", True), ("weights", "all", False), ("activations", "weights", True),
    ("all", "none", False), ("none", "all", True)])
def test_each_operand_gets_its_roles_options(tensors, scope, use_256, row_scaled):
    argv = ["--quant-scheme", "linear_nvfp4", "--nvfp4-4over6", scope,
            "--nvfp4-4over6-err-mode", "mse", "--nvfp4-4over6-e4m3-use-256", use_256]
    argv += ["--nvfp4-row-scaled-activation"] if row_scaled else []
    seen = linear_operands(argv, *tensors)
    assert set(seen) == {("fprop", "input"), ("fprop", "weight"), ("dgrad", "grad_output"),
                         ("dgrad", "weight"), ("wgrad", "grad_output"), ("wgrad", "input")}

    def options(role):
        out = {}
        if scope in ("all", role + "s"):
            out.update(four_over_six="mse",
                       four_over_six_bound=256 if use_256 in ("all", role + "s") else 448)
        if row_scaled and role == "activation":
            out["row_scaled"] = True
        return out

    for (gemm, operand), (hp, q, axis) in seen.items():
        role = {"input": "activation", "weight": "weight"}.get(operand)
        want = expected(hp, axis, **(options(role) if role else {}))
        assert torch.equal(q, want), (gemm, operand)
    # the variants change the activations' and weights' bits, not the gradients'
    if scope == "all" or row_scaled:
        plain = linear_operands(["--quant-scheme", "linear_nvfp4"], *tensors)
        assert not torch.equal(plain["fprop", "input"][1], seen["fprop", "input"][1])
        assert torch.equal(plain["dgrad", "grad_output"][1], seen["dgrad", "grad_output"][1])


def test_weights_in_tiles_take_4over6_per_tile(tensors):
    seen = linear_operands(["--quant-scheme", "linear_nvfp4", "--quant-weight-2d",
                            "--nvfp4-4over6", "weights"], *tensors)
    for gemm, axis in (("fprop", 1), ("dgrad", 0)):
        hp, q, got_axis = seen[gemm, "weight"]
        assert got_axis == axis
        assert torch.equal(q, expected(hp, axis, block_2d=True, four_over_six="mae",
                                       four_over_six_bound=256))


def test_the_start_up_table_marks_each_operand():
    text = describe_config(quant_config(
        ["--quant-scheme", "linear_nvfp4", "--nvfp4-4over6", "weights",
         "--nvfp4-row-scaled-activation"], num_layers=2))
    assert "NVFP4 4/6 (mae; tensor bound 256) of weights, per-token scales of activations" \
        in text
    lines = {line.split()[0]: line for line in text.splitlines()[2:5]}
    assert "input: nvfp4 (rows)" in lines["fprop"] and "weight: nvfp4 (4/6)" in lines["fprop"]
    assert "grad_output: nvfp4 " in lines["dgrad"] + " " and "(4/6)" in lines["dgrad"]
    assert "input: nvfp4 (rows)" in lines["wgrad"] and lines["wgrad"].endswith("nvfp4")


def test_attention_operands_never_take_the_variants():
    config = quant_config(["--quant-scheme", "FA_linear_nvfp4", "--nvfp4-4over6", "all",
                           "--nvfp4-row-scaled-activation"], num_layers=2)
    text = describe_config(config)
    attention = text[text.index("attention QK^T"):text.index("output layer")]
    assert "4/6" not in attention and "rows" not in attention


@pytest.mark.parametrize("argv, message", [
    (["--quant-recipe", "nvfp4", "--nvfp4-4over6", "activations"],
     "4/6 of the activations with the Hadamard transform on wgrad"),
    (["--quant-recipe", "nvfp4", "--nvfp4-row-scaled-activation"],
     "row scaling of the activations with the Hadamard transform on wgrad"),
    (["--quant-scheme", "linear_nvfp4", "--quant-stochastic-rounding", "all",
      "--nvfp4-4over6", "weights"], "4/6 of the weights with stochastic rounding"),
    (["--quant-scheme", "linear_nvfp4", "--nvfp4-4over6", "all", "--quant-kernels", "triton"],
     "--quant-kernels triton with the --nvfp4-\\* variants"),
    (["--quant-scheme", "linear_nvfp4", "--nvfp4-4over6", "some"],
     "--nvfp4-4over6: invalid choice: 'some'.*'none', 'weights', 'activations', 'all'"),
])
def test_refused_combinations(argv, message):
    with pytest.raises(SettingError, match=message):
        quant_config(argv, num_layers=4)


def test_allowed_with_the_recipe_where_te_allows_it():
    """TE's defaults allow 4/6 of the weights with the NVFP4 recipe (weights have no RHT or
    SR there), and --quant-stochastic-rounding grad leaves weights and activations alone."""
    quant_config(["--quant-recipe", "nvfp4", "--nvfp4-4over6", "weights"], num_layers=4)
    quant_config(["--quant-scheme", "linear_nvfp4", "--quant-stochastic-rounding", "grad",
                  "--nvfp4-4over6", "all", "--nvfp4-row-scaled-activation"], num_layers=2)


def test_a_variant_without_nvfp4_sites_is_noted():
    config = quant_config(["--quant-scheme", "linear_mxfp8", "--nvfp4-4over6", "all"],
                          num_layers=2)
    assert any("--nvfp4-* variants change nothing" in n for n in config.notes)


def test_recipe_file_configs_set_the_variants(tmp_path):
    """A recipe-file config takes the TE field names as keys, per config."""
    recipe = {"configs": {"fp4": {"format": "nvfp4", "nvfp4_4over6": "all",
                                  "nvfp4_4over6_err_mode": "mse",
                                  "row_scaled_activation": True},
                          "plain": {"format": "nvfp4"}},
              "matchers": {"first": {"config": "fp4", "type": "glob",
                                     "pattern": "decoder.layers.0.*", "enabled": True},
                           "rest": {"config": "plain", "type": "glob", "pattern": "*linear_*",
                                    "enabled": True}}}
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    config = quant_config(["--quant-recipe-file", str(path)], num_layers=2)
    configs = config.rules.configs
    assert configs["fp4"].nvfp4.four_over_six == "all"
    assert configs["fp4"].nvfp4.row_scaled_activation
    assert not configs["plain"].nvfp4.enabled
    bad = dict(recipe, configs={"fp4": {"format": "nvfp4", "nvfp4_4over6": "both"},
                                "plain": {"format": "nvfp4"}})
    path.write_text(json.dumps(bad))
    with pytest.raises(SettingError, match="nvfp4_4over6.*'both'"):
        quant_config(["--quant-recipe-file", str(path)], num_layers=2)
