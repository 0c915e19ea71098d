"""FP8 (E4M3 / E5M2) quantize-dequantize in one Triton kernel: per-tensor current or delayed
scaling, and 1x128 / 128x128 blockwise scaling (formats/fp8.py defines every step).

Per tensor, the amax comes from the amax kernel (kernels/amax.py, current scaling) or is the
caller's 0-d tensor (delayed scaling); per block the kernel takes it from the block's |x| bit
patterns. The scales are computed in the kernel, in float32 as eager computes them:

    scale     = f32(scaled_max / amax)                 correctly rounded division
                value_for_inf where the quotient is +Inf; 1 where amax is 0, Inf or NaN;
                pow2: only the exponent bits
    scale_inv = f32(1 / scale)
    v         = f32(x * scale), saturated to +-fp8_max, rounded to the element grid
                (nearest even, or stochastically from eager's uniform numbers)
    y         = f32(q * scale_inv)

NaN and Inf as eager: current scaling makes the whole tensor NaN, a tile holding one makes
that tile NaN, delayed scaling makes only those elements NaN. scaled_max = f32(fp8_max *
2**-margin) is a host constant (formats.fp8's pure-Python float32 rounding).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from megatron.quantization.formats.common import FORMAT_INFO
from megatron.quantization.formats.fp8 import (
    FP8_TILE, FLT_MAX, block_value_for_inf, scaled_max)
from megatron.quantization.kernels.amax import tensor_amax
from megatron.quantization.kernels.bits import (
    as_blocks, block_offsets, element_constants, load_bits, load_noise, nearest_on_grid, pack,
    stochastic_round_to_grid, store_bits, tile_offsets)
from megatron.quantization.kernels.tuning import (
    ELEMENTS_PER_PROGRAM, axis_launch, launch, tile_launch)

_EXPONENT_MASK = 0x7F800000


@triton.jit
def _scales(amax, scaled_max, VALUE_FOR_INF: tl.constexpr, POW2: tl.constexpr):
    """(scale, scale_inv) from float32 amax values (formats.fp8._scales_from_amax)."""
    scale = tl.math.div_rn(tl.zeros_like(amax) + scaled_max, amax)
    scale = tl.where(scale == float("inf"), VALUE_FOR_INF, scale)
    scale = tl.where((amax > 0.0) & (amax < float("inf")), scale, 1.0)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)


@triton.jit
def _round_scaled(u, scale, scale_inv, noise, EMAX: tl.constexpr, EMIN: tl.constexpr,
                  MBITS: tl.constexpr, TOP_SIG: tl.constexpr, STOCHASTIC: tl.constexpr):
    """float32 bits of f32(q * scale_inv), q = the element rounding of f32(x * scale)."""
    v = u.to(tl.float32, bitcast=True) * scale
    vbits = v.to(tl.int32, bitcast=True)
    if STOCHASTIC:
        q, s = stochastic_round_to_grid(vbits & 0x7FFFFFFF, 0, noise, EMIN, MBITS, TOP_SIG, EMAX)
        mag = pack(q, s)
    else:
        mag = nearest_on_grid(tl.abs(v), EMIN, MBITS, TOP_SIG, EMAX).to(tl.int32, bitcast=True)
    qv = (mag | (vbits & -2147483648)).to(tl.float32, bitcast=True)
    y = (qv * scale_inv).to(tl.int32, bitcast=True)
    return tl.where((vbits & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, y)    # NaN stays NaN


@triton.jit
def fp8_tensor_kernel(x_ptr, noise_ptr, y_ptr, amax_ptr, numel, scaled_max,
                      DELAYED: tl.constexpr, POW2: tl.constexpr, EMAX: tl.constexpr,
                      EMIN: tl.constexpr, MBITS: tl.constexpr, TOP_SIG: tl.constexpr,
                      STOCHASTIC: tl.constexpr, IS_BF16: tl.constexpr, BLOCK_: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < numel
    u = load_bits(x_ptr, offs, mask, IS_BF16)
    amax = tl.load(amax_ptr)              # the caller's (delayed) or the amax kernel's
    scale, scale_inv = _scales(amax, scaled_max, 3.4028234663852886e38, POW2)
    noise = load_noise(noise_ptr, offs, mask, STOCHASTIC)
    y = _round_scaled(u, scale, scale_inv, noise, EMAX, EMIN, MBITS, TOP_SIG, STOCHASTIC)
    if DELAYED:     # only the non-finite elements themselves are NaN
        y = tl.where((u & 0x7FFFFFFF) >= 0x7F800000, 0x7FC00000, y)
    else:           # an undefined tensor scale: all NaN
        y = tl.where(amax.to(tl.int32, bitcast=True) >= 0x7F800000, 0x7FC00000, y)
    store_bits(y_ptr, offs, mask, y, IS_BF16)


@triton.jit
def fp8_block_kernel(x_ptr, noise_ptr, y_ptr, n_blocks, length, inner, blocks_per_row,
                     scaled_max, VALUE_FOR_INF: tl.constexpr, TILE_2D: tl.constexpr,
                     POW2: tl.constexpr, EMAX: tl.constexpr, EMIN: tl.constexpr,
                     MBITS: tl.constexpr, TOP_SIG: tl.constexpr, STOCHASTIC: tl.constexpr,
                     IS_BF16: tl.constexpr, LAYOUT: tl.constexpr, GROUP_: tl.constexpr):
    if TILE_2D:     # n_blocks tiles of [length rows, inner columns]; LAYOUT unused
        offs, mask = tile_offsets(n_blocks, length, inner, blocks_per_row, GROUP_, 128)
        u = load_bits(x_ptr, offs, mask, IS_BF16)
    else:
        offs, mask = block_offsets(n_blocks, length, inner, blocks_per_row, GROUP_, 128,
                                   LAYOUT)
        u = as_blocks(load_bits(x_ptr, offs, mask, IS_BF16), LAYOUT)
    amax_bits = tl.max(u & 0x7FFFFFFF, axis=1)
    scale, scale_inv = _scales(amax_bits.to(tl.float32, bitcast=True), scaled_max,
                               VALUE_FOR_INF, POW2)
    noise = load_noise(noise_ptr, offs, mask, STOCHASTIC)
    if STOCHASTIC and not TILE_2D:
        noise = as_blocks(noise, LAYOUT)
    y = _round_scaled(u, scale[:, None], scale_inv[:, None], noise, EMAX, EMIN, MBITS, TOP_SIG,
                      STOCHASTIC)
    y = tl.where((amax_bits >= 0x7F800000)[:, None], 0x7FC00000, y)   # the tile is NaN
    if not TILE_2D:
        y = as_blocks(y, LAYOUT)
    store_bits(y_ptr, offs, mask, y, IS_BF16)


def fp8_fake_quantize_triton(x: torch.Tensor, fmt: str, axis: int, scaling: str,
                             amax: Optional[torch.Tensor], margin: float, pow2_scale: bool,
                             block: Optional[Tuple[int, int]],
                             noise: Optional[torch.Tensor] = None) -> torch.Tensor:
    """formats.fp8.fp8_fake_quantize (validated options) by the Triton kernels; x float32 or
    bf16, amax None or a 0-d float32 tensor on x's device (delayed scaling)."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"the FP8 Triton kernel takes float32 or bfloat16, got {x.dtype}")
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    info = FORMAT_INFO[fmt]
    common = dict(POW2=bool(pow2_scale), STOCHASTIC=noise is not None,
                  IS_BF16=x.dtype == torch.bfloat16, enable_reflect_ftz=False,
                  enable_fp_fusion=False, **element_constants(fmt))
    noise_arg = x if noise is None else noise.contiguous()
    top = scaled_max(info.max_normal, margin)
    if scaling == "tensor":
        amax_arg = tensor_amax(x) if amax is None else amax
        launch(fp8_tensor_kernel, "BLOCK_", ELEMENTS_PER_PROGRAM,
               lambda block: triton.cdiv(x.numel(), block),
               (x, noise_arg, y, amax_arg, x.numel(), top), key=("numel", "STOCHASTIC"),
               DELAYED=amax is not None, **common)
        return y
    tiles = tuple(block) == (FP8_TILE, FP8_TILE)
    args, layout, groups, programs = (tile_launch(x.shape, FP8_TILE) if tiles else
                                      axis_launch(x.shape, axis, FP8_TILE))
    launch(fp8_block_kernel, "GROUP_", groups, programs, (x, noise_arg, y, *args, top),
           key=("n_blocks", "inner", "LAYOUT", "STOCHASTIC", "TILE_2D"),
           VALUE_FOR_INF=block_value_for_inf(x.dtype), TILE_2D=tiles, LAYOUT=layout,
           **common)
    return y

assert FLT_MAX == 3.4028234663852886e38
