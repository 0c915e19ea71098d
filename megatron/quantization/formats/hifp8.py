"""HiFloat8: ties-away rounding on the HiF8 value grid, and the per-tensor scaled variant."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron.quantization.formats.common import (
    HIFP8_MAX, HIFP8_OVERFLOW, MAX_SHARED_EXPONENT, MIN_SHARED_EXPONENT,
    HIFP8_DEFAULT_TARGET_EXPONENT, bit_layout, check_saturate, check_tensor, compute_dtype,
    device_table, pow2, to_compute)

def _hifp8_spacing_exponent(e: int) -> int:
    """log2 of the HiF8 rounding step for a value with floor(log2|x|) = e.

    In range, r = |x| / step lies in [2**m, 2**(m + 1)) with m mantissa bits and
    floor(r + 0.5) is the ties-away rounding: 0.5 is a multiple of r's ulp, so r + 0.5 is
    exact unless it carries into the next binade, and then it can only round to a value at or
    above that (integer) binade boundary, which floors to the right integer. The same holds
    for r in [1/2, 1), but not for r in [1/4, 1/2), whose sum can round up to 1. Below the
    HiF8 range, e = -23 uses the step 2**-22 (r in [1/2, 1) -> 1: 2**-23 ties away to 2**-22,
    P17) and e <= -24 a step that makes r < 1/4, so the result is 0.
    """
    if e >= -15:
        width = 3 if abs(e) <= 3 else 2 if abs(e) <= 7 else 1   # above 15: overflow anyway
        return e - width
    if e >= -22:
        return e              # denormals 2**-22 .. 2**-16: powers of two only
    if e == -23:
        return -22
    return e + 3


def _hifp8_spacing_table(dtype: torch.dtype) -> torch.Tensor:
    """MINUS the step 2**s, indexed by the biased exponent field of the compute dtype.

    Negative so that floor(r + 0.5) * table[field] comes out as -q: the overflow test then
    fits one in-place threshold_ (see _hifp8_round). Field 0 (zeros and subnormals of the
    compute dtype) behaves like the lowest binade and rounds to 0; the all-ones field
    (Inf / NaN) maps to -1, which keeps Inf and NaN as they are.
    """
    _, _, bias, field_max = bit_layout(dtype)
    steps = [-1.0 if f == field_max else -math.ldexp(1.0, _hifp8_spacing_exponent(max(f, 1) - bias))
             for f in range(field_max + 1)]
    return torch.tensor(steps, dtype=dtype)


# Caches of constant tables, keyed by (dtype, device) and ((dtype, saturate), device).
_SPACING_TABLE_CACHE = {(dtype, torch.device("cpu")): _hifp8_spacing_table(dtype)
                        for dtype in (torch.float32, torch.float64)}




# -q is below this exactly when q overflowed: q > 32768 means q >= 49152 on the HiF8 grid.
_HIFP8_NEG_OVERFLOW = -(HIFP8_MAX + HIFP8_OVERFLOW) / 2


def _hifp8_round(work: torch.Tensor, sign_source: torch.Tensor, owned: bool,
                 saturate: bool) -> torch.Tensor:
    """HiF8 TA rounding of `work` (float32/64); returns a new tensor, or `work` if owned."""
    int_dtype, mbits_fp, _, field_max = bit_layout(work.dtype)
    table = device_table(_SPACING_TABLE_CACHE, work.dtype, work.device)
    field = (work.view(int_dtype) >> mbits_fp).bitwise_and_(field_max)
    # One gather from a 256-entry (float64: 2048) table beats a chain of piecewise ops.
    neg_step = table.index_select(0, field.reshape(-1)).view(field.shape)
    # r = |x| / step (exact: power of two); written over `field` to save an allocation.
    r = work.div_(neg_step) if owned else torch.div(work, neg_step, out=field.view(work.dtype))
    del field
    # Ties away from zero on |x| (P18): floor(r + 0.5) with r >= 0 and r + 0.5 exact.
    neg_q = r.abs_().add_(0.5).floor_().mul_(neg_step)
    del neg_step
    if saturate:
        neg_q.clamp_(min=-HIFP8_MAX)                   # finite overflow and Inf -> 32768
    else:
        # Results above 32768 are >= 49152, i.e. inputs >= 40960: the Inf code (P17).
        # threshold_ keeps NaN (the comparison is false for it).
        F.threshold_(neg_q, _HIFP8_NEG_OVERFLOW, -math.inf)
    # Set the sign from x, then + 0.0 turns -0 into +0 (HiF8 has no -0, P16).
    return neg_q.copysign_(sign_source).add_(0.0)


def _hifp8_half_table(dtype: torch.dtype, saturate: bool, device: torch.device) -> torch.Tensor:
    """HiF8 result for each of the 65536 bf16 / fp16 bit patterns, in that dtype.

    Computed by the float32 path from the exactly upcast values, so a lookup is by construction
    the float32 result cast back (one rounding, P6).
    """
    key = (dtype, saturate)
    if (key, torch.device("cpu")) not in _HALF_TABLE_CACHE:
        values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
        _HALF_TABLE_CACHE[(key, torch.device("cpu"))] = _hifp8_round(
            values.float(), values, True, saturate).to(dtype)
    return device_table(_HALF_TABLE_CACHE, key, device)


_HALF_TABLE_CACHE = {}


def prepare_hifp8_tables(dtype: torch.dtype, saturate: bool, device: torch.device) -> None:
    """Build the lookup table that HiFP8 of `dtype` inputs reads on `device`, ahead of a
    torch.compile trace: built inside it, the table would be part of the graph and the graph
    compiled again once the table exists."""
    if dtype in (torch.bfloat16, torch.float16):
        _hifp8_half_table(dtype, saturate, device)
    else:
        device_table(_SPACING_TABLE_CACHE, compute_dtype(dtype), device)


def hifp8_fake_quantize(x: torch.Tensor, saturate: bool) -> torch.Tensor:
    if x.dtype in (torch.bfloat16, torch.float16):
        # 16-bit inputs: one gather from the table of all 65536 bit patterns.
        table = _hifp8_half_table(x.dtype, saturate, x.device)
        index = x.view(torch.int16).to(torch.int32).add_(32768)
        return table.index_select(0, index.reshape(-1)).view(x.shape)
    work, owned = to_compute(x)
    return _hifp8_round(work, x, owned, saturate).to(x.dtype)


def hifp8_scale_exponent(x: torch.Tensor,
                         target_exponent: int = HIFP8_DEFAULT_TARGET_EXPONENT) -> torch.Tensor:
    """The per-tensor scale exponent k of `hifp8_scaled_fake_quantize`, as a 0-dim int tensor
    on x's device (no host sync): k = target_exponent - floor(log2 amax), clamped to
    [-127, 127]; 0 for an all-zero tensor or one holding NaN/Inf."""
    check_tensor(x)
    _check_target_exponent(target_exponent)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.int32, device=x.device)
    amax = x.detach().abs().amax().float()
    return _scale_exponent_of_amax(amax, target_exponent)


def _scale_exponent_of_amax(amax: torch.Tensor, target_exponent: int) -> torch.Tensor:
    _, e = torch.frexp(amax)                  # amax = m * 2**e, m in [0.5, 1)
    k = (target_exponent + 1 - e).clamp(MIN_SHARED_EXPONENT, MAX_SHARED_EXPONENT)
    return torch.where(torch.isfinite(amax) & (amax > 0), k, torch.zeros_like(k))


def _check_target_exponent(target_exponent) -> None:
    if not isinstance(target_exponent, int) or not -15 <= target_exponent <= 15:
        raise ValueError(f"target_exponent must be an int in [-15, 15], got {target_exponent!r}")


def hifp8_scaled_fake_quantize(x: torch.Tensor,
                               target_exponent: int = HIFP8_DEFAULT_TARGET_EXPONENT,
                               saturate: bool = True,
                               scale_exponent=None) -> torch.Tensor:
    """HiFP8 fake quantization with one per-tensor power-of-two scale.

    The scale is 2**k with k = target_exponent - floor(log2 amax) (exact, from frexp), so the
    tensor's largest magnitude lands in [2**target_exponent, 2**(target_exponent + 1)); the
    scaled tensor is rounded to HiF8 and divided by the scale again. Both multiplications are
    exact, so the result is exactly 2**-k * HiF8(2**k * x).

    Default target 3, i.e. amax in [8, 16): the top binade of the 3-bit-mantissa region
    [1/8, 16). The largest values, which dominate a GEMM, then get the finest HiF8 precision,
    the 3-bit region covers 7 binades below amax, 2 and 1 mantissa bits the next 12, and the
    denormals reach 25 binades below amax; nothing can overflow. Mapping amax to the HiF8
    maximum (target 15) instead trades the top precision (1 mantissa bit) for 12 more binades
    of range at the bottom. k is clamped to [-127, 127]; a tensor that is all zeros or holds
    NaN/Inf is quantized unscaled.

    `scale_exponent` (an int or a 0-dim integer tensor) imposes k instead of deriving it from
    x: the operand of a GEMM processed in pieces (chunked attention) is scaled by the k of the
    whole operand (`hifp8_scale_exponent`).
    """
    check_tensor(x)
    _check_target_exponent(target_exponent)
    check_saturate("hifp8", saturate)
    if x.numel() == 0:
        return x.clone()
    with torch.no_grad():
        work, owned = to_compute(x)
        if scale_exponent is None:
            k = _scale_exponent_of_amax(torch.maximum(work.amax(), work.amin().neg()),
                                        target_exponent)
        else:
            k = torch.as_tensor(scale_exponent, device=x.device).to(torch.int32)
        scaled = work.mul_(pow2(k, work.dtype)) if owned else work * pow2(k, work.dtype)
        q = _hifp8_round(scaled, x, True, bool(saturate))
        return q.mul_(pow2(-k, work.dtype)).to(x.dtype)

