"""Quantized GEMMs: each of fprop, dgrad and wgrad quantizes its own two operands.

For C = A @ B (A [..., M, K], B [..., K, N]) training runs three GEMMs, each reducing over a
different axis:

    fprop  C  = A @ B      A blocked along K (its last axis),  B along K (its second-to-last)
    dgrad  dA = dC @ B^T   dC blocked along N (its last axis), B along N (its last axis)
    wgrad  dB = A^T @ dC   A blocked along M (second-to-last), dC along M (second-to-last)

MX quantization does not commute with transposition (pitfall P15), so every GEMM quantizes
its operands afresh from the HIGH-PRECISION tensors along its own reduction axis, as
TransformerEngine, torchao and microxcaling do. Only the high-precision operands are saved for
backward. The GEMMs themselves run in the input dtype (bf16 stays bf16, which on hardware
accumulates in fp32).

A linear layer y = x @ W^T + b is the matmul with A = x (all leading token dims flattened to
M) and B = W^T, so its weight [N, K] is blocked along its last axis in fprop and along axis 0
in dgrad, and wgrad blocks dY and x along the flattened token axis. The two quantized copies
of a weight are kept in the site's state and reused by every micro-batch (and recomputed
forward) until the weight changes: every step of the run's optimizer drops them (see
_weight_operand and runtime.QuantRuntime.watch_optimizer).
Stochastically rounded and delayed-scaled weights are quantized at every call, as the other
operands are.

Observers. When `observer` is given it is called as
`observer(gemm, operand, hp, q, fmt, axis)` for every operand of every GEMM that runs (q=None
for operands kept in high precision) and then for the GEMM's result (q=None, fmt="none",
axis=None). Operand names, in call order:

    quantized_linear   fprop: input, weight, output        dgrad: grad_output, weight, grad_input
                       wgrad: grad_output, input, grad_weight
    quantized_matmul   fprop: a, b, output                 dgrad: grad_output, b, grad_a
                       wgrad: a, grad_output, grad_b

`hp` is the high-precision operand in the caller-visible shape (linear: x [..., K],
weight [N, K], dY [..., N]; matmul: a, b, dC) and `q` has the same shape; `axis` is the
non-negative block axis (the GEMM's reduction axis) in that shape, also reported for
operands kept in high precision. Exception: the wgrad operands of quantized_linear are
reported as the 2-D token-flattened tensors ([M, K] and [M, N], axis 0) they are quantized as.
In every case

    q == quantize_operand(hp, fmt, axis, config)

bit for bit, which is `fake_quantize(hp, fmt, axis=axis, scale_mode=config.mx.scale_mode,
saturate=config.saturate_for(fmt))` except for tensor-scaled HiFP8 operands
(`config.hifp8.scaling == "tensor"`), where it is `hifp8_scaled_fake_quantize(hp,
saturate=...)`. saturate_for is None for every format but HiFP8, so for MX this is the plain
`fake_quantize(hp, fmt, axis=axis, scale_mode=config.mx.scale_mode)`; HiFP8 operands saturate
at +-32768 by default (config.hifp8.saturate), which differs from the plain cast only for
|hp| >= 40960.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.quantization import randomness
from megatron.quantization.accumulation import limited_precision_matmul
from megatron.quantization.config import MatmulQuantConfig, OperandFormats
from megatron.quantization.delayed_scaling import AmaxHistories
from megatron.quantization.dispatch import amax_writer, fake_quantize
from megatron.quantization.formats import (
    format_info, hifp8_scale_exponent, hifp8_scaled_fake_quantize, random_hadamard_transform)
from megatron.quantization.main_grad import (
    accumulates_into_main_grad, add_to_main_grad, fp32_product)
from megatron.quantization.runtime import QuantRuntime
from megatron.quantization.tp_comm import TensorParallelComm

__all__ = ["SiteState", "quantized_matmul", "quantized_linear", "matmul_grads", "rotation_fused",
           "format_options", "nvfp4_variant", "quantize_operand", "quantize_slot", "gemm_product",
           "gemm_operand", "gemm_result", "whole_tensor_scale"]

Observer = Callable[..., None]


def gemm_product(config: MatmulQuantConfig, gemm: str, a: torch.Tensor, b: torch.Tensor,
                 fp32: bool = False) -> torch.Tensor:
    """a @ b as the `gemm` of a site computes it: on a limited-precision accumulator where the
    config asks (accumulation.py; the float32 result then rounded to the operands' dtype, as
    a GEMM's epilogue rounds it), else torch's GEMM. `fp32`: the float32 sum itself (the
    fused weight-gradient accumulation's)."""
    if not config.gemm.limits(gemm):
        return fp32_product(a, b) if fp32 else torch.matmul(a, b)
    g = config.gemm
    out = limited_precision_matmul(a, b, g.accumulation_bits, g.accumulation_group,
                                   g.accumulation_promotion)
    return out if fp32 else out.to(torch.promote_types(a.dtype, b.dtype))


def _linear(config: MatmulQuantConfig, x: torch.Tensor, weight: torch.Tensor, bias):
    """F.linear(x, weight, bias) as the site's fprop computes it (the bias added to the
    float32 sum before the rounding, as in a GEMM epilogue, on the limited accumulator)."""
    if not config.gemm.limits("fprop"):
        return F.linear(x, weight, bias)
    g = config.gemm
    out = limited_precision_matmul(x, weight.t(), g.accumulation_bits, g.accumulation_group,
                                   g.accumulation_promotion)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def whole_tensor_scale(fmt: str, amax: torch.Tensor):
    """The imposed scale of a tensor-scaled operand quantized in pieces, from the amax of the
    whole operand (a 0-d float32 tensor; no host sync): the HiFP8 scale exponent, or the amax
    itself (NVFP4, FP8)."""
    return hifp8_scale_exponent(amax.reshape(1)) if fmt == "hifp8" else amax


def format_options(config: MatmulQuantConfig, fmt: str, ndim: int, *, weight: bool = False,
                   amax=None, **variant) -> dict:
    """The fake_quantize format options `config` gives an operand in `fmt` of `ndim`
    dimensions: NVFP4 {block_2d, amax} plus its variant options (`variant`: four_over_six,
    four_over_six_bound, row_scaled, as nvfp4_variant gives them), FP8 {scaling, amax, margin,
    pow2_scale} or {scaling: "block", block, pow2_scale}; {} for other formats. (Stochastic
    rounding and HiFP8's scale are not format options.) What quantize_operand passes, and what
    a capture's statistics recompute scales with (tensor_capture/replay.py)."""
    kind = format_info(fmt).kind
    tiled = bool(weight) and ndim == 2 and config.weight_tiles(fmt)
    if kind == "nvfp4":
        return {"block_2d": tiled, "amax": amax, **variant}
    if kind == "fp8":
        fp8 = config.fp8
        if fp8.scaling == "blockwise":
            return {"scaling": "block", "block": (128, 128) if tiled else (1, 128),
                    "pow2_scale": fp8.power_of_two}
        return {"scaling": "tensor", "amax": amax, "margin": fp8.margin,
                "pow2_scale": fp8.power_of_two}
    return {}


def nvfp4_variant(config: MatmulQuantConfig, fmt: str, name: str) -> dict:
    """The NVFP4 variant options (4/6, row scaling) of operand `name` of a GEMM site: a linear
    layer's "input" is an activation, its "weight" a weight; gradients and attention's
    operands take none."""
    if fmt != "nvfp4":
        return {}
    return config.nvfp4.operand_options(_OPERAND_ROLES.get(name))


_OPERAND_ROLES = MappingProxyType({"input": "activation", "weight": "weight"})
VARIANT_KEYS = ("four_over_six", "four_over_six_bound", "row_scaled")


def quantize_operand(hp: torch.Tensor, fmt: str, axis: int, config: MatmulQuantConfig,
                     scale_exponent=None, *, weight: bool = False, amax=None,
                     seed: Optional[int] = None, kernels: str = "auto",
                     rht: Optional[Tuple[int, int]] = None, **variant) -> torch.Tensor:
    """How `config` quantizes one GEMM operand in `fmt` blocked along `axis`: the single
    definition the GEMMs use and captures are reproduced with.

    scale_exponent imposes the per-tensor scale of a tensor-scaled HiFP8 operand (see
    formats.hifp8_scaled_fake_quantize); amax the per-tensor amax of an NVFP4 or FP8 operand
    (delayed scaling, or one piece of a larger operand); seed, when given, rounds the
    elements stochastically with a generator seeded by it; weight marks a linear layer's
    weight (2-D tiles when config.weight_2d); kernels is the kernel mode that runs it
    (dispatch.py; the same bits in every mode); `variant` the NVFP4 variant options
    (nvfp4_variant)."""
    if config.tensor_scaled(fmt) and fmt == "hifp8":
        return hifp8_scaled_fake_quantize(hp, saturate=config.saturate_for(fmt),
                                          scale_exponent=scale_exponent)
    options = format_options(config, fmt, hp.dim(), weight=weight, amax=amax, **variant)
    if seed is not None:
        options.update(rounding="stochastic", generator=randomness.generator(seed, hp.device))
    if rht is not None:
        options["rht"] = rht
    return fake_quantize(hp, fmt, axis=axis, scale_mode=config.mx.scale_mode,
                         saturate=config.saturate_for(fmt), kernels=kernels, **options)


class SiteState:
    """What a GEMM site keeps between calls: its global module path (the key of its
    stochastic-rounding draws), for delayed FP8 scaling its amax histories, the quantized
    copies of its weight (see _weight_operand), and the runtime its model's sites share
    (kernel mode, observers, draws, weight-cache generation; a private one when omitted)."""

    def __init__(self, path: str, config: MatmulQuantConfig,
                 runtime: Optional[QuantRuntime] = None):
        if any(dequantized_backward_sources(config)) and "fprop" in config.rht.gemms:
            raise ValueError(f"{path or 'a GEMM site'}: backward GEMMs on the dequantized "
                             "forward operands (--quant-backward-override dequantized, or a "
                             "recipe's dequantized sources) with a Hadamard transform on fprop: "
                             "they would take the rotated operands; drop one of them")
        self.path = path
        self.runtime = runtime if runtime is not None else QuantRuntime()
        fp8 = config.fp8
        uses_delayed = any(config.delayed(f) for f in config.formats)
        self.amax = AmaxHistories(fp8.amax_history_len, fp8.amax_compute_algo) \
            if uses_delayed else None
        # gemm -> (key, transformed weight, its quantization, report keywords)
        self.weights = {}


def quantize_slot(config, gemm, name, side, hp, fmt, axis, scales=None, state=None,
                  weight=False, rotate=False):
    """(q, extra): one GEMM operand quantized (q None for fmt "none") and the keywords that
    besides (fmt, axis, config) determined q (what the observer is given). `rotate`: q is the
    quantization of the site's random Hadamard transform of hp (_rotation_fused)."""
    if fmt == "none":
        return None, {}
    extra = {}
    imposed = scales.get((gemm, name)) if scales else None
    if imposed is not None and config.tensor_scaled(fmt, f"{gemm}.{side}"):
        # One piece of a larger operand: the whole operand's scale (a delayed-scaled one's
        # history was stepped once for the whole operand).
        extra["scale_exponent" if fmt == "hifp8" else "amax"] = imposed
    elif state is not None and state.amax is not None and config.delayed(fmt, f"{gemm}.{side}"):
        extra["amax"] = state.amax.step((gemm, name), hp,
                                        amax_writer(hp, state.runtime.kernels))
    if config.stochastic_slot(gemm, side, fmt):
        if state is None:
            raise ValueError(f"{gemm}.{side} is stochastically rounded: its draws need the "
                             "site's state (SiteState)")
        extra["seed"] = state.runtime.draws.draw_seed(state.path, gemm, name)
    if weight and config.weight_tiles(fmt):
        extra["weight"] = True
    extra.update(nvfp4_variant(config, fmt, name))
    kernels = state.runtime.kernels if state is not None else "auto"
    rht = (config.rht.block, config.rht.seed) if rotate else None
    return quantize_operand(hp, fmt, axis, config, **extra, kernels=kernels, rht=rht), extra


def gemm_operand(observer, config, gemm, name, side, hp, fmt, axis, scales=None, state=None,
                 weight=False):
    """Quantize one GEMM operand (or pass it through) and report it. `scales` maps
    (gemm, name) to imposed per-tensor scales (operands cut into chunks, see
    whole_tensor_scale); `state` is the site's SiteState (stochastic draws, amax histories).

    The observer receives, as keywords, whatever besides (fmt, axis, config) determined q:
    scale_exponent (imposed HiFP8 scale), amax (imposed or delayed NVFP4/FP8 amax, a 0-d
    tensor), seed (stochastic rounding), weight=True (a weight in 2-D tiles), and the NVFP4
    variant options (four_over_six, four_over_six_bound, row_scaled) where they apply."""
    q, extra = quantize_slot(config, gemm, name, side, hp, fmt, axis, scales, state, weight)
    if observer is not None:
        observer(gemm, name, hp, q, fmt, axis, **extra)
    return hp if q is None else q


def rotation_fused(config: MatmulQuantConfig, fmt: str, length: int,
                   weight: bool = False) -> bool:
    """Whether an unobserved operand in `fmt` of a GEMM with a Hadamard transform is
    quantized in one call that applies the transform too (no rotated copy: the fused kernels
    compute it as they load the operand): for MX and 1-D NVFP4 operands whose `length` along
    the reduction axis the block divides. Otherwise the operand is rotated (zero-padded) into
    a copy first; the bits are the same either way. (Also what the memory estimate counts.)"""
    return (fmt != "none" and format_info(fmt).kind in ("mx", "nvfp4")
            and not (weight and config.weight_tiles(fmt))
            and length % config.rht.block == 0)


def _rotation_fused(observer, config, hp, fmt, axis, weight=False) -> bool:
    """rotation_fused for an operand hp; an observer is shown the rotated operand itself, so
    an observed GEMM rotates first."""
    return observer is None and rotation_fused(config, fmt, hp.shape[axis], weight)


def rotated_operand(observer, config, gemm, name, side, hp, fmt, axis, state=None):
    """gemm_operand of the random Hadamard transform of hp along `axis`: fused into the
    quantization where _rotation_fused allows it, else rotated (zero-padded) first."""
    if _rotation_fused(observer, config, hp, fmt, axis):
        return quantize_slot(config, gemm, name, side, hp, fmt, axis, state=state,
                             rotate=True)[0]
    return gemm_operand(observer, config, gemm, name, side, _rotated(hp, axis, config), fmt,
                        axis, state=state)


# -- weights: quantized once per optimizer step -------------------------------------------------

def _weight_operand(observer, config, gemm, weight, axis, state):
    """The weight operand of a linear GEMM (fprop or dgrad), quantized along `axis` (the
    GEMM's reduction axis, after the random Hadamard transform along it when the GEMM has
    one), and reported.

    The weight changes only at the optimizer step, so its quantization is kept in the site's
    state and reused by every micro-batch (and by recomputed forwards) until then: the key is
    the optimizer-step generation, the weight's storage, autograd's version counter (an
    in-place write) and the config. Stochastically rounded and delayed-scaled weights are
    quantized at every call (each call draws anew / steps its history), as before. The cost
    is memory: a quantized linear site holds two more copies of its weight (fprop, dgrad)."""
    fmt = getattr(config, gemm).b
    cached = (state is not None and state.runtime.weight_cache and fmt != "none"
              and config.reusable(gemm, "b", fmt))
    key = None
    if cached:
        key = (state.runtime.weights_generation, weight.data_ptr(), weight._version,
               tuple(weight.shape), weight.dtype, weight.device, config)
        entry = state.weights.get(gemm)
        if entry is not None and entry[0] == key and (entry[1] is not None or observer is None):
            _, w_in, q, extra = entry
            if observer is not None:
                observer(gemm, "weight", w_in, q, fmt, axis, **extra)
            return q
    rotate = gemm in config.rht.gemms
    # Quantized with the transform in one call, no rotated copy is kept (w_in None).
    fused = rotate and _rotation_fused(observer, config, weight, fmt, axis, weight=True)
    w_in = None if fused else _rotated(weight, axis, config) if rotate else weight
    q, extra = quantize_slot(config, gemm, "weight", "b", weight if fused else w_in, fmt, axis,
                             state=state, weight=True, rotate=fused)
    if observer is not None:
        observer(gemm, "weight", w_in, q, fmt, axis, **extra)
    if cached:
        state.weights[gemm] = (key, w_in, q, extra)
    return w_in if q is None else q


def _rotated(t: torch.Tensor, axis: int, config: MatmulQuantConfig) -> torch.Tensor:
    """t through the random Hadamard transform along `axis`, zero-padded to a multiple of the
    block first (zero rows of both operands add nothing to the product)."""
    rht = config.rht
    pad = -t.shape[axis] % rht.block
    if pad:
        spec = [0, 0] * (t.dim() - 1 - axis) + [0, pad]
        t = F.pad(t, spec)
    return random_hadamard_transform(t, axis=axis, block=rht.block, seed=rht.seed)


def gemm_result(observer, gemm, name, value):
    """Report a GEMM's result (q=None, fmt "none", axis None) and return it."""
    if observer is not None:
        observer(gemm, name, value, None, "none", None)
    return value


class _QuantizedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, config, observer, scales, state):
        ctx.save_for_backward(a, b)
        ctx.config, ctx.observer, ctx.scales, ctx.state = config, observer, scales, state
        qa = gemm_operand(observer, config, "fprop", "a", "a", a, config.fprop.a, a.dim() - 1,
                          scales, state)
        qb = gemm_operand(observer, config, "fprop", "b", "b", b, config.fprop.b, b.dim() - 2,
                          scales, state)
        return gemm_result(observer, "fprop", "output", gemm_product(config, "fprop", qa, qb))

    @staticmethod
    def backward(ctx, grad_c):
        a, b = ctx.saved_tensors
        grad_a, grad_b = matmul_grads(a, b, grad_c, ctx.config, ctx.observer,
                                      *ctx.needs_input_grad[:2], scales=ctx.scales,
                                      state=ctx.state)
        return grad_a, grad_b, None, None, None, None


def matmul_grads(a, b, grad_c, config: MatmulQuantConfig, observer=None, need_a: bool = True,
                 need_b: bool = True, scales=None, state: Optional[SiteState] = None):
    """(dA, dB) of C = A @ B: the dgrad and wgrad GEMMs quantized_matmul's backward runs."""
    grad_a = grad_b = None
    if need_a:
        qg = gemm_operand(observer, config, "dgrad", "grad_output", "a", grad_c, config.dgrad.a,
                          grad_c.dim() - 1, scales, state)
        qb = gemm_operand(observer, config, "dgrad", "b", "b", b, config.dgrad.b, b.dim() - 1,
                          scales, state)
        grad_a = gemm_result(observer, "dgrad", "grad_a",
                             gemm_product(config, "dgrad", qg, qb.transpose(-1, -2)))
    if need_b:
        qa = gemm_operand(observer, config, "wgrad", "a", "a", a, config.wgrad.a, a.dim() - 2,
                          scales, state)
        qg = gemm_operand(observer, config, "wgrad", "grad_output", "b", grad_c, config.wgrad.b,
                          grad_c.dim() - 2, scales, state)
        grad_b = gemm_result(observer, "wgrad", "grad_b",
                             gemm_product(config, "wgrad", qa.transpose(-1, -2), qg))
    return grad_a, grad_b


class _QuantizedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, config, observer, state, comm, fuse_wgrad):
        ctx.config, ctx.observer, ctx.state = config, observer, state
        ctx.comm, ctx.fuse_wgrad = comm, fuse_wgrad
        shard = x
        x, _ = comm.gather_input(x) if comm is not None else (x, None)
        # The reduction is over K: x's last axis, W's axis 1.
        operand = rotated_operand if "fprop" in config.rht.gemms else gemm_operand
        qx = operand(observer, config, "fprop", "input", "a", x, config.fprop.a, x.dim() - 1,
                     state=state)
        qw = _weight_operand(observer, config, "fprop", weight, 1, state)
        # Only the local shard of a sequence-parallel input is kept (backward gathers it
        # again), or the whole dequantized input the backward GEMMs take instead of it.
        ctx.x_dequantized, ctx.w_dequantized = dequantized_backward_sources(config)
        ctx.save_for_backward(qx if ctx.x_dequantized else shard, weight)
        return gemm_result(observer, "fprop", "output", _linear(config, qx, qw, bias))

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        config, observer, state, comm = ctx.config, ctx.observer, ctx.state, ctx.comm
        need_x, need_w, need_bias = ctx.needs_input_grad[:3]
        n, k = weight.shape
        grad_x = grad_w = grad_bias = None
        wait_x = wait_grad_x = None
        w_operand = weight
        if ctx.w_dequantized:             # the weight as fprop quantized it (cached)
            w_operand = _weight_operand(None, config, "fprop", weight, 1, state)
        if config.gemm.backward_override is not None:
            config = _unquantized_backward(config)
        if need_w and comm is not None and not ctx.x_dequantized:
            # The sequence-parallel input is gathered again while the dgrad GEMM runs.
            x, wait_x = comm.gather_input(x, async_op=True)
        if need_x:
            # dX = dY @ W: reduction over N, the last axis of dY and axis 0 of W.
            operand = rotated_operand if "dgrad" in config.rht.gemms else gemm_operand
            qg = operand(observer, config, "dgrad", "grad_output", "a", grad_y, config.dgrad.a,
                         grad_y.dim() - 1, state=state)
            qw = _weight_operand(observer, config, "dgrad", w_operand, 0, state)
            grad_x = gemm_result(observer, "dgrad", "grad_input",
                                 gemm_product(config, "dgrad", qg, qw))
            if comm is not None:
                # Reduce-scattered (sequence parallel) or all-reduced while wgrad runs.
                grad_x, wait_grad_x = comm.reduce_input_grad(grad_x, async_op=need_w)
        if need_w:
            if wait_x is not None:
                wait_x()
            grad_w = _weight_grad(grad_y.reshape(-1, n), x.reshape(-1, k), weight, config,
                                  observer, state, ctx.fuse_wgrad)
        if need_bias:
            grad_bias = grad_y.reshape(-1, n).sum(0)
        if wait_grad_x is not None:
            wait_grad_x()
        return grad_x, grad_w, grad_bias, None, None, None, None, None


def dequantized_backward_sources(config: MatmulQuantConfig):
    """(input, weight): whether the backward GEMMs of a linear site take X and W from the
    forward's dequantized copies (quantized again in their own formats, or not at all under
    --quant-backward-override dequantized) instead of the originals."""
    override = config.gemm.backward_override == "dequantized"
    return (override or "input" in config.dequantized_sources,
            override or "weight" in config.dequantized_sources)


def _unquantized_backward(config: MatmulQuantConfig) -> MatmulQuantConfig:
    """`config` with dgrad and wgrad in high precision (no quantization, no Hadamard
    transform): what --quant-backward-override leaves the backward GEMMs to do."""
    return config.replace(dgrad=OperandFormats(), wgrad=OperandFormats(), rht=dataclasses.replace(
        config.rht, gemms=tuple(g for g in config.rht.gemms if g == "fprop")))


def _weight_grad(g2, x2, weight, config, observer, state, fuse: bool):
    """dW = dY^T @ X, the reduction over all tokens flattened to one M axis. With `fuse` and a
    weight of a DistributedDataParallel model, dW is summed into weight.main_grad in fp32 and
    the placeholder autograd receives is returned (main_grad.py); the observer sees the fp32
    product either way."""
    operand = rotated_operand if "wgrad" in config.rht.gemms else gemm_operand
    qg = operand(observer, config, "wgrad", "grad_output", "b", g2, config.wgrad.b, 0,
                 state=state)
    qx = operand(observer, config, "wgrad", "input", "a", x2, config.wgrad.a, 0, state=state)
    if not (fuse and accumulates_into_main_grad(weight)):
        return gemm_result(observer, "wgrad", "grad_weight",
                           gemm_product(config, "wgrad", qg.t(), qx))
    product = gemm_result(observer, "wgrad", "grad_weight",
                          gemm_product(config, "wgrad", qg.t(), qx, fp32=True))
    return add_to_main_grad(weight, product)


def quantized_matmul(a: torch.Tensor, b: torch.Tensor, config: MatmulQuantConfig,
                     observer: Optional[Observer] = None, scales=None,
                     state: Optional[SiteState] = None) -> torch.Tensor:
    """a @ b with every GEMM's operands quantized as `config` says.

    a [..., M, K] and b [..., K, N] must have the same leading batch dims (no broadcasting:
    a broadcast operand's wgrad would quantize per batch entry, not per GEMM). `scales` maps
    (gemm, operand) -- ("fprop", "a"), ("dgrad", "grad_output"), ... -- to the per-tensor
    scale a tensor-scaled operand must use (whole_tensor_scale), for a GEMM that is one piece
    of a larger one (chunked attention); other operands derive their scales themselves.
    `state` is the site's SiteState (stochastic draws, amax histories; a fresh one is made
    when omitted).
    """
    if not config.enabled and observer is None:
        return torch.matmul(a, b)
    if a.dim() < 2 or b.dim() < 2 or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"quantized_matmul needs a [..., M, K] and b [..., K, N] with the same "
                         f"batch dims, got {tuple(a.shape)} and {tuple(b.shape)}")
    if config.rht.gemms:
        raise ValueError("the random Hadamard transform applies to linear layers only, not to "
                         "attention's GEMMs")
    if state is None:
        state = SiteState("", config)
    return _QuantizedMatmul.apply(a, b, config, observer, scales, state)


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     config: MatmulQuantConfig, observer: Optional[Observer] = None,
                     state: Optional[SiteState] = None, comm: Optional[TensorParallelComm] = None,
                     fuse_wgrad: bool = False) -> torch.Tensor:
    """y = x @ weight^T + bias with every GEMM's operands quantized as `config` says.

    x [..., K] (any number of leading token dims), weight [N, K], bias [N] or None. `state`
    is the site's SiteState (stochastic draws keyed by its path, delayed-scaling histories;
    a fresh one is made when omitted). `comm` is the layer's tensor-parallel communication
    (tp_comm.py): with sequence parallelism x is the local shard of the sequence and y covers
    the whole sequence. `fuse_wgrad` sums the weight gradient into the fp32 main gradient of a
    DistributedDataParallel weight (main_grad.py). Disabled, unobserved, without
    communication or fusion, this is exactly torch.nn.functional.linear.
    """
    plain = comm is None or comm.size == 1
    if not config.enabled and observer is None and plain and not (
            fuse_wgrad and accumulates_into_main_grad(weight)):
        return F.linear(x, weight, bias)
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"quantized_linear needs x [..., K] and weight [N, K], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if state is None:
        state = SiteState("", config)
    return _QuantizedLinear.apply(x, weight, bias, config, observer, state, comm, fuse_wgrad)
