"""--quant-backward-override (TransformerEngine's backward_override): the backward GEMMs of a
quantized linear layer take unquantized operands (high_precision) or the forward's dequantized
X and W (dequantized). Expectations are written with torch's own GEMMs on operands quantized
here along the forward's axes, independently of the layer's backward."""

import pytest
import torch
import torch.nn.functional as F

from megatron.quantization import formats
from megatron.quantization.config import SettingError, settings_from_flags
from megatron.quantization.describe import describe_config
from megatron.quantization.gemm import SiteState, quantized_linear
from megatron.quantization.observers import QuantizationCounter
from megatron.quantization.schemes import quant_config

TOKENS, K, N = (3, 64), 96, 80


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*TOKENS, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.1
    dy = torch.randn(*TOKENS, N, generator=g)
    return x, w, dy


def _grads(config, x, w, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = quantized_linear(x, w, None, config, state=SiteState("layer", config))
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _linear(*flags):
    return quant_config(["--quant-scheme", "linear_mxfp4", *flags], num_layers=2).linear


def test_high_precision_backward_takes_the_unquantized_operands():
    x, w, dy = _tensors()
    y, gx, gw = _grads(_linear("--quant-backward-override", "high_precision"), x, w, dy)
    qx, qw = formats.fake_quantize(x, "mxfp4", axis=-1), formats.fake_quantize(w, "mxfp4", axis=1)
    assert torch.equal(y, F.linear(qx, qw))                       # the forward is unchanged
    assert torch.equal(gx, torch.matmul(dy, w))
    assert torch.equal(gw, torch.matmul(dy.reshape(-1, N).t(), x.reshape(-1, K)))


def test_dequantized_backward_reuses_the_forward_operands():
    x, w, dy = _tensors(1)
    y, gx, gw = _grads(_linear("--quant-backward-override", "dequantized"), x, w, dy)
    # X and W as fprop quantized them: along K (x's last axis, W's axis 1), not again along
    # the backward GEMMs' reduction axes; dY unquantized.
    qx, qw = formats.fake_quantize(x, "mxfp4", axis=-1), formats.fake_quantize(w, "mxfp4", axis=1)
    assert torch.equal(y, F.linear(qx, qw))
    assert torch.equal(gx, torch.matmul(dy, qw))
    assert torch.equal(gw, torch.matmul(dy.reshape(-1, N).t(), qx.reshape(-1, K)))
    # Not the same numbers as quantizing along the backward axes (the default).
    assert not torch.equal(qw, formats.fake_quantize(w, "mxfp4", axis=0))


def test_the_default_backward_quantizes_its_own_operands():
    x, w, dy = _tensors(2)
    _, gx, gw = _grads(_linear(), x, w, dy)
    qg = formats.fake_quantize(dy, "mxfp4", axis=-1)
    assert torch.equal(gx, torch.matmul(qg, formats.fake_quantize(w, "mxfp4", axis=0)))
    assert not torch.equal(gx, torch.matmul(dy, w))


def test_observers_see_the_backward_operands_unquantized():
    x, w, dy = _tensors(3)
    counter = QuantizationCounter()
    config = _linear("--quant-backward-override", "dequantized")
    x, w = x.requires_grad_(), w.requires_grad_()
    state = SiteState("layer", config)
    state.runtime.add_observer(counter)
    from megatron.quantization.observers import GemmSite, observer_for
    site = GemmSite("layer", "linear", 1, config, state)
    quantized_linear(x, w, None, config, observer=observer_for(site), state=state).backward(dy)
    assert {gemm for _, gemm, _, _ in counter.quantized} == {"fprop"}
    assert counter.high_precision[("linear", "dgrad", "weight")] == 1
    assert counter.high_precision[("linear", "wgrad", "input")] == 1


def test_a_recipe_file_sets_it_per_site_and_the_start_up_table_shows_it(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("configs:\n"
                      "  fp4: {format: mxfp4, backward_override: high_precision}\n"
                      "matchers:\n"
                      "  fc1: {config: fp4, type: glob, pattern: '*linear_fc1', enabled: true}\n")
    quant = quant_config(["--quant-recipe-file", str(recipe)], num_layers=2)
    cfg = quant.rules.configs["fp4"]
    assert cfg.gemm.backward_override == "high_precision"
    assert "--quant-backward-override high_precision" in describe_config(quant, 2)
    flagged = quant_config(["--quant-scheme", "linear_mxfp8", "--quant-backward-override",
                            "dequantized"], num_layers=2)
    assert flagged.linear.gemm.backward_override == "dequantized"
    assert "--quant-backward-override dequantized" in describe_config(flagged, 2)
    bad = tmp_path / "bad.yaml"
    bad.write_text(recipe.read_text().replace("high_precision", "fp32"))
    with pytest.raises(SettingError, match=r"configs.fp4.backward_override 'fp32': not one of "
                                           r"high_precision, dequantized"):
        quant_config(["--quant-recipe-file", str(bad)], num_layers=2)


def test_bad_values_and_combinations_are_one_line():
    with pytest.raises(SettingError, match="--quant-backward-override.*'fp32'.*high_precision"):
        settings_from_flags(["--quant-backward-override", "fp32"])
    config = quant_config(["--quant-scheme", "linear_nvfp4", "--quant-rht", "16",
                           "--quant-rht-gemms", "fprop", "--quant-backward-override",
                           "dequantized"], num_layers=2).linear
    with pytest.raises(ValueError, match="dequantized.*with a Hadamard transform on fprop"):
        SiteState("decoder.layers.0.mlp.linear_fc1", config)


def test_a_named_recipe_takes_it_and_trains(tmp_path):
    """TransformerEngine's recipes take backward_override beside their own settings: so does
    --quant-recipe here, and a run trains with it."""
    import pretrain_gpt
    from conftest import TINY_MOCK_ARGS
    from megatron.training.training import pretrain

    quant = quant_config(["--quant-recipe", "nvfp4", "--quant-backward-override",
                          "dequantized"], num_layers=2)
    assert quant.linear.gemm.backward_override == "dequantized"
    result = pretrain(pretrain_gpt.forward_step, TINY_MOCK_ARGS + [
        "--train-iters", "2", "--quant-recipe", "nvfp4", "--quant-backward-override",
        "dequantized"])
    assert result.exit_reason == "train-iters" and len(result.losses) == 2
    assert all(torch.isfinite(torch.tensor(list(result.losses.values()))))


def test_an_explicit_backward_format_with_the_override_is_refused():
    with pytest.raises(SettingError, match="--quant-backward-override high_precision with "
                                           "--quant-wgrad nvfp4"):
        quant_config(["--quant-scheme", "linear_nvfp4", "--quant-backward-override",
                      "high_precision", "--quant-wgrad", "nvfp4"])
    # --quant-wgrad none agrees with the override: nothing to refuse.
    config = quant_config(["--quant-scheme", "linear_nvfp4", "--quant-backward-override",
                           "high_precision", "--quant-wgrad", "none"])
    assert config.linear.gemm.backward_override == "high_precision"


def test_the_override_on_a_run_without_quantized_linear_layers_is_noted():
    config = quant_config(["--quant-scheme", "FA_mxfp8", "--quant-backward-override",
                           "dequantized"])
    assert any("--quant-backward-override dequantized changes nothing" in n
               for n in config.notes)
