"""MX (OCP Microscaling v1.0) block quantization: 32-element blocks sharing an E8M0 scale."""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron.quantization.formats.common import (
    FORMAT_INFO, MAX_SHARED_EXPONENT, MIN_SHARED_EXPONENT, MX_BLOCK_SIZE, NAN_EXPONENT, FormatInfo,
    bit_layout, check_scale_mode, check_tensor, normalize_axis, block_view, to_compute,
    canonical_format)
from megatron.quantization.formats.elements import round_elements_
from megatron.quantization.formats.rounding import stochastic_round_to_grid

def _blocks(work: torch.Tensor, axis: int):
    """(view of work as [..., nblocks, 32, ...], padded length) with blocks along `axis`."""
    return block_view(work, axis, MX_BLOCK_SIZE)


def _block_scales(amax: torch.Tensor, info: FormatInfo, scale_mode: str):
    """(2**-e, 2**e) per block, exactly, from the block maxima (in amax's dtype).

    Everything is read from the float bits and stays a power of two (P2: no log2). With
    P = 2**floor(log2 amax) (amax with its mantissa bits cleared), floor's 2**e is
    P * 2**-emax_elem; the other rules double it where amax is past a threshold of the form
    P * c (exact: c has few bits):
    rceil:  amax > 1.n * P, with max_normal = 1.n * 2**emax_elem: the smallest power of two
            with max_normal * 2**e >= amax, i.e. e = ceil(log2(amax / max_normal));
    ceil:   amax > P: e = ceil(log2 amax) - emax_elem (torchao's CEIL);
    even:   amax >= (2 - 2**-(mbits + 1)) * P, where amax's mantissa rounded half up to the
            element's mbits bits carries into the exponent (torchao's EVEN; 1.75 for E2M1).
    2**e is clamped to [2**-127, 2**127]: a zero or subnormal amax has P = 0 and gets 2**-127
    (P1), which is a float32 (and bf16) subnormal and is kept (P5). 2**-e = 1 / 2**e is exact.
    2**e is NaN for blocks holding NaN or Inf (amax * 0 is NaN there), so that dequantization
    turns all their elements into NaN (P3, P4).
    """
    int_dtype, mbits, _, field_max = bit_layout(amax.dtype)
    pow2 = (amax.view(int_dtype) & (field_max << mbits)).view(amax.dtype)
    bumped = None
    if scale_mode == "rceil":
        mant_n, _ = math.frexp(info.max_normal)       # max_normal = (2 * mant_n) * 2**emax_elem
        bumped = amax > pow2 * (2 * mant_n)
    elif scale_mode == "ceil":
        bumped = amax > pow2
    elif scale_mode == "even":
        bumped = amax >= pow2 * (2.0 - 2.0 ** -(info.mantissa_bits + 1))
    up = pow2.mul_(2.0 ** -info.emax_elem)
    if bumped is not None:
        up.mul_(torch.where(bumped, 2.0, 1.0).to(amax.dtype))
    up.clamp_(2.0 ** MIN_SHARED_EXPONENT, 2.0 ** MAX_SHARED_EXPONENT)
    down = torch.reciprocal(up)
    return down, up.add_(amax * 0.0)


def _exponents_from_scales(up: torch.Tensor) -> torch.Tensor:
    """int32 e from the exact 2**e (exponent field; 2**-127 is the float32/bf16 subnormal with
    field 0, which reads as -127 too); NAN_EXPONENT where 2**e is NaN."""
    int_dtype, mbits, bias, _ = bit_layout(up.dtype)
    e = ((up.view(int_dtype) >> mbits) - bias).to(torch.int32)
    return e.masked_fill_(torch.isnan(up), NAN_EXPONENT)


def _block_amax(blocks: torch.Tensor, dim: int, scratch: Optional[torch.Tensor] = None):
    """max |x| over `dim`: NaN if the block holds a NaN, Inf if it holds +-Inf.

    `scratch`, a tensor like `blocks` that may be overwritten, saves the allocation of the
    full-size |x|.
    """
    if blocks.dtype == torch.bfloat16:
        # bf16 float reductions are slow on CPU; for |x| the 15 low bits order like the values
        # (NaN above Inf above finite), so an int16 max of (bits & 0x7FFF) is the exact amax.
        out = None if scratch is None else scratch.view(torch.int16)
        magnitude = torch.bitwise_and(blocks.view(torch.int16), 0x7FFF, out=out)
        return magnitude.amax(dim, keepdim=True).view(torch.bfloat16)
    # One pass for |x| and one reduction (abs and amax propagate NaN): on a CPU about half the
    # time of max(max x, -min x) when the blocks lie along the innermost axis.
    return torch.abs(blocks, out=scratch).amax(dim, keepdim=True)


def mx_fake_quantize(x: torch.Tensor, fmt: str, axis: int, scale_mode: str,
                      noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """MX quantize-dequantize (round to nearest even, or stochastic rounding with `noise`).

    Round to nearest: bf16 inputs are computed in bf16 without upcasting: scaling by a power of
    two, the element rounding (exact value -> element grid, once) and the final product (exact
    value -> bf16, RNE, once) give bit for bit the float32 result cast to bf16.

    Stochastic rounding (noise: uniform [0, 1) float32 numbers of x's shape): the shared
    exponents are those of round to nearest; each scaled element x * 2**-e, saturated to
    +-max_normal, becomes one of its two grid neighbours with probabilities that make it
    unbiased (design note section 6.3). Computed in float32 (float64 stays float64).
    """
    if noise is not None:
        return _mx_stochastic(x, fmt, axis, scale_mode, noise)
    info = FORMAT_INFO[fmt]
    work, owned = to_compute(x, native_bf16=True)
    blocks, pad = _blocks(work, axis)
    owned = owned or pad > 0
    # The result buffer; the bf16 amax borrows it as scratch before it is filled.
    scaled = blocks if owned else torch.empty_like(blocks)
    amax = _block_amax(blocks, axis + 1, None if owned else scaled)
    down, up = _block_scales(amax, info, scale_mode)
    # Exact: |x| * 2**-e < 2**(emax_elem + 1) cannot overflow, and values small enough to
    # lose bits to underflow round to zero in any element format.
    torch.mul(blocks, down, out=scaled)
    factor = round_elements_(scaled, fmt, info)
    # Dequantize: (factor * q) * 2**e, in this order (q * 2**e alone could underflow). Exact
    # (element values times 2**e fit float32, even at e = -127, P5), except that rceil can
    # round a block near float32 max up to 2**128 = inf (P12); bf16 rounds the exact value once.
    if factor != 1.0:
        scaled.mul_(factor)
    scaled.mul_(up)
    return _unblock(scaled, x, axis, pad)


def _mx_stochastic(x: torch.Tensor, fmt: str, axis: int, scale_mode: str,
                   noise: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of the MX elements; scales exactly as for round to nearest.

    float32 (or float64) throughout: the native fp8-cast and bf16 shortcuts of round to
    nearest have no stochastic counterpart. A block holding NaN/Inf still becomes all NaN: its
    2**e is NaN (the scaled Inf saturates first, so the grid rounding only sees finite values).
    """
    info = FORMAT_INFO[fmt]
    work, _ = to_compute(x)
    blocks, pad = _blocks(work, axis)
    noise_blocks, _ = _blocks(noise, axis)
    down, up = _block_scales(_block_amax(blocks, axis + 1), info, scale_mode)
    scaled = torch.mul(blocks, down).clamp_(-info.max_normal, info.max_normal)
    q = stochastic_round_to_grid(scaled, noise_blocks, info.emin_elem, info.mantissa_bits)
    return _unblock(q.mul_(up), x, axis, pad)


def _unblock(blocks: torch.Tensor, x: torch.Tensor, axis: int, pad: int) -> torch.Tensor:
    """[..., nblocks, 32, ...] back to x's shape (padding cropped) and dtype."""
    out = blocks.flatten(axis, axis + 1)
    if pad:
        out = out.narrow(axis, 0, x.shape[axis])
    return out.to(x.dtype)


def mx_shared_exponents(x: torch.Tensor, fmt: str, axis: int = -1,
                        scale_mode: str = "floor") -> torch.Tensor:
    """Unbiased int32 shared exponents of the MX blocks of `x` along `axis`.

    The result has x's shape with `axis` replaced by the number of blocks, ceil(n / 32). A
    block's scale is 2**e; the E8M0 code is e + 127. All-zero blocks give -127; blocks holding
    NaN or Inf give NAN_EXPONENT (128). fake_quantize uses this same computation.
    """
    check_tensor(x)
    fmt = canonical_format(fmt)
    check_scale_mode(scale_mode)
    info = FORMAT_INFO[fmt]
    if info.kind != "mx":
        raise ValueError(f"{fmt!r} is not an MX format; MX formats: mxfp8, mxfp8_e4m3, "
                         "mxfp8_e5m2, mxfp6_e2m3, mxfp6_e3m2, mxfp4")
    axis = normalize_axis(axis, x.dim())
    work, _ = to_compute(x, native_bf16=True)
    if work.shape[axis] == 0:
        return torch.empty(work.shape, dtype=torch.int32, device=x.device)
    blocks, _ = _blocks(work, axis)
    exponents, _ = mx_block_scales(_block_amax(blocks, axis + 1), fmt, scale_mode)
    return exponents.squeeze(axis + 1)


def mx_block_scales(amax: torch.Tensor, fmt: str, scale_mode: str = "floor"):
    """(unbiased int32 shared exponents e, 2**e in amax's dtype) from the blocks' max |x|
    (float32 or bf16; NaN for a block holding NaN, Inf for one holding Inf): the rule of
    mx_shared_exponents, for callers that already have the block maxima. 2**e is NaN and e is
    NAN_EXPONENT for blocks holding NaN or Inf."""
    fmt = canonical_format(fmt)
    check_scale_mode(scale_mode)
    _, up = _block_scales(amax, FORMAT_INFO[fmt], scale_mode)
    return _exponents_from_scales(up), up

