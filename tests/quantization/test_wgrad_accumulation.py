"""Weight gradients summed into the fp32 main gradient (gradient-accumulation fusion).

A linear layer wrapped by megatron-core's DistributedDataParallel, in bf16, over several
micro-batches: its main_grad against the exact sum of the wgrad GEMM's products computed in
float64 from the operands the GEMM is given (for a quantized layer, the operands quantized
by the formats package along the token axis). fp32 summation leaves at most a few units of
fp32 rounding; rounding each micro-batch's result to bf16 first (the unfused path, kept by
--no-gradient-accumulation-fusion) leaves about 2**-9 relative, far beyond that bound.
"""

import pytest
import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig

import pretrain_gpt
from megatron.quantization.formats import fake_quantize
from megatron.quantization.config import MatmulQuantConfig, OperandFormats
from megatron.quantization.gemm import SiteState
from megatron.quantization.layers import QuantColumnParallelLinear
from megatron.quantization.observers import GemmSite
from megatron.training.training import pretrain

from conftest import TINY_MOCK_ARGS

TOKENS, IN, OUT, MICRO_BATCHES = 96, 64, 48, 4
MXFP8 = MatmulQuantConfig(fprop=OperandFormats("mxfp8_e4m3", "mxfp8_e4m3"),
                          dgrad=OperandFormats("mxfp8_e4m3", "mxfp8_e4m3"),
                          wgrad=OperandFormats("mxfp8_e4m3", "mxfp8_e4m3"))


class _OneLinear(torch.nn.Module):
    def __init__(self, config, quant: MatmulQuantConfig, fuse: bool):
        super().__init__()
        self.linear = QuantColumnParallelLinear(
            IN, OUT, config=config, init_method=torch.nn.init.normal_, bias=False,
            gather_output=False)
        self.linear.quant_site = GemmSite("linear", "linear", 1, quant, SiteState("linear", quant))
        self.linear.fuse_wgrad_accumulation = fuse

    def forward(self, x):
        return self.linear(x)[0]


def _micro_batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(TOKENS, 1, IN, generator=g).bfloat16(),
             torch.randn(TOKENS, 1, OUT, generator=g).bfloat16()) for _ in range(MICRO_BATCHES)]


def _main_grad(quant: MatmulQuantConfig, fuse: bool, batches):
    """main_grad of the DDP-wrapped bf16 layer after backward of every micro-batch, with the
    loss sum(y * r) so that dY = r exactly."""
    config = TransformerConfig(num_layers=1, hidden_size=IN, num_attention_heads=1,
                               params_dtype=torch.bfloat16, bf16=True,
                               use_cpu_initialization=True)
    torch.manual_seed(3)
    model = DistributedDataParallel(config=config, module=_OneLinear(config, quant, fuse),
                                    ddp_config=DistributedDataParallelConfig(
                                        grad_reduce_in_fp32=True))
    model.zero_grad_buffer()
    for x, r in batches:
        (model(x).float() * r.float()).sum().backward()
    weight = model.module.linear.weight
    assert weight.grad is None          # the hook moved (or skipped) every gradient
    return weight.main_grad.clone()


def _exact(quant: MatmulQuantConfig, batches):
    """(sum of dY^T X in float64, sum of |dY|^T |X|) over the micro-batches, from the wgrad
    operands: [tokens, features] blocked along the tokens."""
    total = bound = 0
    for x, r in batches:
        x2, g2 = x.reshape(TOKENS, IN), r.reshape(TOKENS, OUT)
        if quant.enabled:
            x2 = fake_quantize(x2, quant.wgrad.a, axis=0)
            g2 = fake_quantize(g2, quant.wgrad.b, axis=0)
        total = total + g2.double().t() @ x2.double()
        bound = bound + g2.double().abs().t() @ x2.double().abs()
    return total, bound


@pytest.mark.parametrize("quant", [MatmulQuantConfig(), MXFP8], ids=["bf16", "mxfp8"])
def test_main_grad_is_the_fp32_sum_of_the_wgrad_products(world_size_one, quant):
    batches = _micro_batches()
    exact, magnitude = _exact(quant, batches)
    # fp32 summation of TOKENS products per micro-batch, then MICRO_BATCHES additions.
    fp32_bound = (TOKENS + MICRO_BATCHES) * 2.0 ** -24 * magnitude
    fused = _main_grad(quant, True, batches).double()
    assert ((fused - exact).abs() <= fp32_bound).all()
    # The unfused path rounds each micro-batch's dW to bf16 first: many times the bound.
    unfused = _main_grad(quant, False, batches).double()
    assert ((unfused - exact).abs() > fp32_bound).float().mean() > 0.5
    assert (unfused - exact).abs().max() > 100 * (fused - exact).abs().max()


def test_the_ddp_hook_adds_nothing_more(world_size_one):
    """With fusion the layer hands autograd a placeholder the DDP hook must skip: main_grad
    after one micro-batch equals the GEMM's fp32 result alone (not twice it, not garbage)."""
    batches = _micro_batches()[:1]
    exact, magnitude = _exact(MatmulQuantConfig(), batches)
    fused = _main_grad(MatmulQuantConfig(), True, batches).double()
    assert ((fused - exact).abs() <= (TOKENS + 1) * 2.0 ** -24 * magnitude).all()


def _run(extra):
    result = pretrain(pretrain_gpt.forward_step, TINY_MOCK_ARGS + ["--train-iters", "3", *extra])
    return result.losses, result.grad_norms


@pytest.mark.parametrize("model", [[], ["--untie-embeddings-and-output-weights"]],
                         ids=["tied", "untied"])
def test_fp32_training_is_unchanged_by_fusion(monkeypatch, model):
    """In fp32 the fused sum is the unfused one bit for bit (the GEMM's fp32 result added to
    main_grad either way): losses and gradient norms are identical, which also shows that the
    tied embedding's own gradient still reaches the shared main_grad (zero placeholder)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert _run(model) == _run(model + ["--no-gradient-accumulation-fusion"])


def test_bf16_training_changes_by_the_fusion_only(monkeypatch):
    """In bf16 the fusion changes the gradients by the per-micro-batch bf16 rounding it
    removes: the first iteration's loss (before any update) is the same, the gradient norm
    differs by a few 1e-5 relative, no more."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    fused_losses, fused_norms = _run(["--bf16"])
    plain_losses, plain_norms = _run(["--bf16", "--no-gradient-accumulation-fusion"])
    assert fused_losses[1] == plain_losses[1]
    assert fused_norms[1] != plain_norms[1]
    assert fused_norms[1] == pytest.approx(plain_norms[1], rel=1e-3)


def test_the_start_up_log_states_how_weight_gradients_accumulate():
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.precision import describe_precision

    def text(extra):
        args = validate_args(parse_args(TINY_MOCK_ARGS + ["--train-iters", "1", *extra]),
                             check_paths=False)
        return describe_precision(args)

    assert "summed into them from the GEMMs' fp32 results" in text(["--bf16"])
    assert "rounded to bf16 per micro-batch first" in text(
        ["--bf16", "--no-gradient-accumulation-fusion"])
    assert "gradients, weights and Adam state: fp32" in text([])
