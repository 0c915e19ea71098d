"""NVFP4 quantize-dequantize in one Triton kernel: 16-element blocks along any axis, or the
16x16 tiles of a 2-D weight (block_2d).

The sequence of formats/nvfp4.py, step for step. The tensor amax comes from the amax kernel
(kernels/amax.py), or is the caller's imposed 0-d tensor; the tensor scales
(steps 2-3) are computed in the kernel from it, so no 0-d tensor arithmetic runs on the host.
Per program (the scalar steps) and per block, in float32 with one rounding per operation as
eager does:

    s_enc = min(2688 / amax, FLT_MAX), 1 where amax == 0 or s_enc == 0;  s_dec = 1 / s_enc
                                                       (correctly rounded divisions)
    S = amax_b * f32(s_enc * f32(1/6));  s = E4M3(S)  (nearest even, subnormals, <= 448)
    enc = min(1 / f32(s * s_dec), FLT_MAX)
    v = clamp(x * enc, -6, 6);  q = E2M1(v)            (nearest even, or stochastic)
    y = q * f32(f32(s * amax) * f32(1/2688))

The two grid roundings are bits.nearest_on_grid's (stochastic: the integer ones of
bits.stochastic_round_to_grid); a tensor holding NaN or Inf (or a non-finite imposed amax)
comes out all NaN. The float products are IEEE float32
multiplications (Triton keeps float32 subnormals in them on NVIDIA GPUs; the divisions are
launched without libdevice's flush-to-zero).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from megatron.quantization.formats.common import NVFP4_BLOCK_SIZE
from megatron.quantization.formats.nvfp4 import ONE_OVER_2688_F32, FLT_MAX, ONE_SIXTH_F32
from megatron.quantization.kernels.amax import tensor_amax
from megatron.quantization.kernels.bits import (
    as_blocks, block_offsets, load_bits, load_noise, nearest_on_grid, pack,
    stochastic_round_to_grid, store_bits, tile_offsets)
from megatron.quantization.kernels.hadamard import hadamard_launch, rotate
from megatron.quantization.kernels.tuning import axis_launch, launch, tile_launch

# The float32 constants as the kernel writes them (Python floats that are float32 values).
_FLT_MAX = 3.4028234663852886e38
_RECIP_2688 = 0.00037202381645329297
_ONE_SIXTH = 0.1666666716337204
assert _FLT_MAX == FLT_MAX and _RECIP_2688 == ONE_OVER_2688_F32 and _ONE_SIXTH == ONE_SIXTH_F32


@triton.jit
def nvfp4_qdq_kernel(x_ptr, noise_ptr, y_ptr, amax_ptr, imposed_ptr, signs_ptr, n_blocks,
                     length, inner, blocks_per_row, IMPOSED: tl.constexpr,
                     TILE_2D: tl.constexpr, STOCHASTIC: tl.constexpr, IS_BF16: tl.constexpr,
                     RHT: tl.constexpr, INV_SQRT: tl.constexpr, WIDTH: tl.constexpr,
                     LAYOUT: tl.constexpr, GROUP_: tl.constexpr):
    # GROUP_ rows of WIDTH elements: 16x16 tiles (TILE_2D, WIDTH 256), or runs along the axis
    # of one block of 16 or (RHT) of one transform block holding whole blocks of 16.
    if TILE_2D:     # n_blocks tiles of [length rows, inner columns]; blocks_per_row per row
        offs, mask = tile_offsets(n_blocks, length, inner, blocks_per_row, GROUP_, 16)
        u = load_bits(x_ptr, offs, mask, IS_BF16)
    else:
        offs, mask = block_offsets(n_blocks, length, inner, blocks_per_row, GROUP_, WIDTH,
                                   LAYOUT)
        u = as_blocks(load_bits(x_ptr, offs, mask, IS_BF16), LAYOUT)
    if RHT > 0:
        u = rotate(u, signs_ptr, GROUP_, WIDTH, RHT, INV_SQRT, IS_BF16)
    BLOCKS: tl.constexpr = GROUP_ * WIDTH // (256 if TILE_2D else 16)
    u = tl.reshape(u, [BLOCKS, 256 if TILE_2D else 16])

    # Steps 1-3 (formats.nvfp4.tensor_scales): the same scalars in every program.
    data_bits = tl.load(amax_ptr).to(tl.int32, bitcast=True)
    finite = data_bits < 0x7F800000
    if IMPOSED:
        amax_t = tl.load(imposed_ptr)
        finite = finite & ((amax_t.to(tl.int32, bitcast=True) & 0x7FFFFFFF) < 0x7F800000)
    else:
        amax_t = data_bits.to(tl.float32, bitcast=True)
    s_enc = tl.math.div_rn(tl.full([], 2688.0, tl.float32), amax_t)
    s_enc = tl.minimum(s_enc, 3.4028234663852886e38)
    s_enc = tl.where((amax_t == 0.0) | (s_enc == 0.0), 1.0, s_enc)
    s_dec = tl.math.div_rn(tl.full([], 1.0, tl.float32), s_enc)
    per_unit = s_enc * 0.1666666716337204                              # f32(1/6)

    amax_b = tl.max(u & 0x7FFFFFFF, axis=1).to(tl.float32, bitcast=True)
    s = nearest_on_grid(amax_b * per_unit, -6, 3, 14, 8)           # E4M3, saturating
    p = s * s_dec
    recip = tl.math.div_rn(tl.full(p.shape, 1.0, tl.float32), tl.where(p == 0.0, 1.0, p))
    enc = tl.where(p == 0.0, 3.4028234663852886e38, tl.minimum(recip, 3.4028234663852886e38))
    dec = (s * amax_t) * 0.00037202381645329297                     # f32(1/2688)

    v = u.to(tl.float32, bitcast=True) * enc[:, None]
    v = tl.minimum(tl.maximum(v, -6.0), 6.0)
    vbits = v.to(tl.int32, bitcast=True)
    noise = load_noise(noise_ptr, offs, mask, STOCHASTIC)
    if STOCHASTIC:                                                      # E2M1
        noise = tl.reshape(as_blocks(noise, LAYOUT), [BLOCKS, 256 if TILE_2D else 16])
        q, qe = stochastic_round_to_grid(vbits & 0x7FFFFFFF, 0, noise, 0, 1, 3, 2)
        mag = pack(q, qe)
    else:
        mag = nearest_on_grid(tl.abs(v), 0, 1, 3, 2).to(tl.int32, bitcast=True)
    qv = (mag | (vbits & -2147483648)).to(tl.float32, bitcast=True)
    y = (qv * dec[:, None]).to(tl.int32, bitcast=True)
    y = tl.where(finite, y, 0x7FC00000)
    store_bits(y_ptr, offs, mask, as_blocks(tl.reshape(y, [GROUP_, WIDTH]), LAYOUT), IS_BF16)


def nvfp4_fake_quantize_triton(x: torch.Tensor, axis: int, noise: Optional[torch.Tensor] = None,
                               amax: Optional[torch.Tensor] = None, block_2d: bool = False,
                               rht: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """fake_quantize(x, "nvfp4", axis, block_2d=block_2d, amax=amax, rht=rht) by the Triton
    kernel.

    x: float32 or bf16 (2-D for block_2d); axis normalised (ignored for block_2d); noise: None
    or eager's uniform [0, 1) float32 numbers of x's shape (stochastic rounding); amax: None
    or an imposed 0-d float32 tensor amax on x's device; rht: None or (block, seed), the random
    Hadamard transform along the axis computed in the kernels (1-D blocks only)."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"the NVFP4 Triton kernel takes float32 or bfloat16, got {x.dtype}")
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    rotation = hadamard_launch(rht, x.device)
    signs = rotation.pop("signs")
    width = 256 if block_2d else max(NVFP4_BLOCK_SIZE, rotation["RHT"])
    args, layout, groups, programs = (tile_launch(x.shape, NVFP4_BLOCK_SIZE) if block_2d else
                                      axis_launch(x.shape, axis, width))
    data_amax = tensor_amax(x, axis if rht else None, signs, **rotation)
    launch(nvfp4_qdq_kernel, "GROUP_", groups, programs,
           (x, x if noise is None else noise.contiguous(), y, data_amax,
            data_amax if amax is None else amax, signs, *args),
           key=("n_blocks", "inner", "LAYOUT", "WIDTH", "STOCHASTIC", "TILE_2D"),
           IMPOSED=amax is not None, TILE_2D=bool(block_2d), STOCHASTIC=noise is not None,
           IS_BF16=x.dtype == torch.bfloat16, WIDTH=width, LAYOUT=layout,
           enable_fp_fusion=False, **rotation,
           enable_reflect_ftz=False)      # div_rn keeps float32 subnormals, as eager does
    return y
