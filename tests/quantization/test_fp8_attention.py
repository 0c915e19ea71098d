"""--fp8-dot-product-attention: attention's operands in FP8 with TransformerEngine's roles.

The module's outputs and gradients are checked against a float64 computation of the unfused
attention written here, with the same quantization points: Q, K, V, dO per tensor from their
own amax (current scaling), P (TE's S) and dS (TE's dP) per tensor from their amax histories
(the first call from an empty history: scale 1), E4M3 forward, E5M2 gradients."""

import math

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from megatron.quantization import formats
from megatron.quantization.attention import QuantDotProductAttention
from megatron.quantization.config import SettingError
from megatron.quantization.gemm import SiteState
from megatron.quantization.observers import GemmSite
from megatron.quantization.runtime import QuantRuntime
from megatron.quantization.schemes import quant_config
from megatron.training.model import core_transformer_config_from_args

FP8 = ["--fp8-format", "hybrid", "--fp8-dot-product-attention"]


def _formats(cfg):
    return {g: (getattr(cfg, g).a, getattr(cfg, g).b) for g in ("fprop", "dgrad", "wgrad")}


def test_the_roles_of_each_recipe():
    tw = quant_config(FP8 + ["--fp8-recipe", "tensorwise"], num_layers=2)
    assert _formats(tw.attn_qk) == {"fprop": ("fp8_e4m3", "fp8_e4m3"),
                                    "dgrad": ("fp8_e5m2", "fp8_e4m3"),
                                    "wgrad": ("fp8_e4m3", "fp8_e5m2")}
    assert _formats(tw.attn_pv) == {"fprop": ("fp8_e4m3", "fp8_e4m3"),
                                    "dgrad": ("fp8_e5m2", "fp8_e4m3"),
                                    "wgrad": ("fp8_e4m3", "fp8_e5m2")}
    assert tw.attn_qk.delayed_slots == {"dgrad.a", "wgrad.b"}            # dS
    assert tw.attn_pv.delayed_slots == {"fprop.a", "wgrad.a"}            # P
    assert tw.attn_qk.fp8.scaling == "tensorwise"
    assert not tw.attn_qk.delayed("fp8_e4m3", "fprop.a") and tw.attn_qk.delayed("fp8_e5m2",
                                                                                  "dgrad.a")
    mx = quant_config(["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8",
                       "--fp8-dot-product-attention"], num_layers=2)
    assert _formats(mx.attn_pv) == {"fprop": ("fp8_e4m3", "mxfp8_e4m3"),
                                    "dgrad": ("mxfp8_e4m3", "mxfp8_e4m3"),
                                    "wgrad": ("fp8_e4m3", "mxfp8_e4m3")}
    assert mx.attn_pv.mx.scale_mode == "rceil"
    delayed = quant_config(FP8, num_layers=2)                            # megatron's default
    assert delayed.attn_qk.fp8.scaling == "delayed"
    forward = quant_config(FP8 + ["--fp8-attention-backward", "high_precision"], num_layers=2)
    assert not forward.attn_qk.dgrad.enabled and not forward.attn_pv.wgrad.enabled
    dp = quant_config(FP8 + ["--fp8-attention-dp", "high_precision"], num_layers=2)
    assert dp.attn_qk.dgrad.a == dp.attn_qk.wgrad.b == "none" and dp.attn_pv.dgrad.a == \
        "fp8_e5m2"
    # An FP8 preset gives attention its format and scaling without --fp8-format.
    preset = quant_config(["--quant-recipe", "bf16_with_fp8_current_scaling_mixed",
                           "--fp8-dot-product-attention"], num_layers=4)
    assert _formats(preset.attn_pv) == _formats(tw.attn_pv)
    assert preset.attn_qk.fp8.scaling == "tensorwise"


@pytest.mark.parametrize("flags, words", [
    (["--fp8-dot-product-attention"], "needs --fp8-format"),
    (FP8 + ["--quant-scheme", "FA_linear_fp8"], "drop --quant-scheme FA_linear_fp8"),
    (FP8 + ["--attn-pv-quant", "mxfp8"], "drop --attn-pv-quant"),
    (FP8 + ["--fp8-recipe", "blockwise"], "tensorwise, delayed or mxfp8"),
    (["--fp8-attention-backward", "high_precision"], "which is off"),
])
def test_contradictions_are_one_line(flags, words):
    with pytest.raises(SettingError, match=words):
        quant_config(flags, num_layers=2)


def _module(args, quant):
    cfg = core_transformer_config_from_args(args)
    module = QuantDotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                      attention_type="self")
    runtime = QuantRuntime(quant.backend)
    for name in ("qk", "pv"):
        config = getattr(quant, f"attn_{name}")
        setattr(module, f"{name}_site", GemmSite(f"attn.{name}", f"attn_{name}", 1, config,
                                                 SiteState(f"attn.{name}", config, runtime)))
    module.attention = quant.backend.attention
    module.quant_runtime = runtime
    return module


def _fq(x, fmt, amax=None):
    """Per-tensor FP8 of x (float64 in and out), its own amax or an imposed one."""
    return formats.fake_quantize(x.float(), fmt, scaling="tensor",
                                 amax=amax).double()


def _reference(q, k, v, grad, histories):
    """Output and (dq, dk, dv) of causal attention in float64 with TE's FP8 roles; `histories`
    {"P": amax or 0, "dS": amax or 0} the delayed scales' amaxes (0: scale 1)."""
    sq, b, heads, d = q.shape
    to_bh = lambda t: t.permute(1, 2, 0, 3).double()           # [b, h, s, d]
    Q, K, V, dO = to_bh(q), to_bh(k), to_bh(v), to_bh(grad.view(sq, b, heads, d))
    Qq, Kq, Vq = (_fq(t, "fp8_e4m3") for t in (Q, K, V))
    scores = (Qq @ Kq.transpose(-1, -2)).float().double() / math.sqrt(d)
    hidden = torch.triu(torch.ones(sq, sq, dtype=torch.bool), 1)
    scores = scores.masked_fill(hidden, -10000.0)
    P = torch.softmax(scores, -1)
    Pq = _fq(P, "fp8_e4m3", histories["P"])
    out = Pq @ Vq
    dOq = _fq(dO, "fp8_e5m2")
    dP = dOq @ Vq.transpose(-1, -2)
    dS = P * (dP - (P * dP).sum(-1, keepdim=True)) / math.sqrt(d)
    dS = dS.masked_fill(hidden, 0.0)
    dSq = _fq(dS, "fp8_e5m2", histories["dS"])
    dq, dk, dv = dSq @ Kq, dSq.transpose(-1, -2) @ Qq, Pq.transpose(-1, -2) @ dOq
    back = lambda t: t.permute(2, 0, 1, 3)
    return (back(out).reshape(sq, b, heads * d),
            [back(t) for t in (dq, dk, dv)], {"P": P.abs().max(), "dS": dS.abs().max()})


def test_forward_and_backward_equal_a_float64_reference(world_size_one):
    """Two calls: the first with empty histories (scale 1), the second scaled from the
    first's P and dS amaxes; every GEMM operand at its role's format and scale."""
    quant = quant_config(FP8 + ["--fp8-recipe", "tensorwise"], num_layers=2)
    args = world_size_one
    heads, dim = args.num_attention_heads, args.hidden_size // args.num_attention_heads
    args.num_query_groups = heads
    module = _module(args, quant)
    g = torch.Generator().manual_seed(0)
    histories = {"P": None, "dS": None}
    for call in range(2):
        q, k, v = (torch.randn(48, 2, heads, dim, generator=g) for _ in range(3))
        grad = torch.randn(48, 2, heads * dim, generator=g)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = module(*leaves, None)
        out.backward(grad)
        want, want_grads, seen = _reference(q, k, v, grad, {
            key: (0.0 if value is None else value) for key, value in histories.items()})
        torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-6)
        for got, ref in zip([t.grad for t in leaves], want_grads):
            torch.testing.assert_close(got.double(), ref, rtol=2e-4, atol=2e-5)
        histories = seen


def test_a_resumed_run_repeats_the_delayed_scales_of_attention(tmp_path):
    """The attention sites' amax histories are in the checkpoint: 4 iterations in one run
    equal 2 + 2 resumed, bit for bit."""
    import pretrain_gpt
    from conftest import TINY_MOCK_ARGS
    from megatron.training.training import pretrain

    flags = TINY_MOCK_ARGS + FP8 + ["--fp8-recipe", "tensorwise", "--fp8-amax-history-len",
                                    "4", "--fp8-amax-compute-algo", "max"]
    whole = pretrain(pretrain_gpt.forward_step, flags + ["--train-iters", "4"])
    save = str(tmp_path / "ckpt")
    pretrain(pretrain_gpt.forward_step, flags + ["--train-iters", "4", "--save", save,
                                                 "--exit-interval", "2"])
    resumed = pretrain(pretrain_gpt.forward_step, flags + ["--train-iters", "4", "--load", save])
    assert [resumed.losses[i] for i in (3, 4)] == [whole.losses[i] for i in (3, 4)]
