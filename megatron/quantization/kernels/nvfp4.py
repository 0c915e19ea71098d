"""NVFP4 quantize-dequantize in one Triton kernel (16-element blocks along any axis).

The sequence of formats/nvfp4.py, step for step: the tensor scales (steps 1-3: s_enc, s_dec,
and whether the tensor amax is finite) are the eager float32 ops on 0-d tensors, computed
before the launch (no host sync); the kernel reads them and does, per block, in float32 with
one rounding per operation as eager does:

    S = amax_b * f32(s_enc * f32(1/6));  s = E4M3(S)  (nearest even, subnormals, <= 448)
    enc = min(1 / f32(s * s_dec), FLT_MAX)             (a correctly rounded division)
    v = clamp(x * enc, -6, 6);  q = E2M1(v)            (nearest even, or stochastic)
    y = q * f32(f32(s * amax) * f32(1/2688))

The two grid roundings are the integer ones of bits.round_to_grid; a tensor holding NaN or
Inf (or a non-finite imposed amax) comes out all NaN. The float products are IEEE float32
multiplications (Triton keeps float32 subnormals in them on NVIDIA GPUs; the division is
launched without libdevice's flush-to-zero).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from megatron.quantization.formats.common import NVFP4_BLOCK_SIZE
from megatron.quantization.formats.nvfp4 import (
    ONE_OVER_2688_F32, FLT_MAX, ONE_SIXTH_F32, tensor_scales)
from megatron.quantization.kernels.bits import (
    block_offsets, load_bits, pack, round_to_grid, store_bits)

GROUP = 128         # blocks of 16 per program: 2048 elements
# The float32 constants as the kernel writes them (Python floats that are float32 values).
_FLT_MAX = 3.4028234663852886e38
_RECIP_2688 = 0.00037202381645329297
assert _FLT_MAX == FLT_MAX and _RECIP_2688 == ONE_OVER_2688_F32


@triton.jit
def _nvfp4_qdq_kernel(x_ptr, noise_ptr, y_ptr, scales_ptr, n_blocks, length, inner,
                      blocks_per_row, STOCHASTIC: tl.constexpr, IS_BF16: tl.constexpr,
                      GROUP_: tl.constexpr):
    offs, mask = block_offsets(n_blocks, length, inner, blocks_per_row, GROUP_, 16)
    u = load_bits(x_ptr, offs, mask, IS_BF16)

    per_unit = tl.load(scales_ptr)          # f32(s_enc * f32(1/6))
    s_dec = tl.load(scales_ptr + 1)
    amax_t = tl.load(scales_ptr + 2)
    finite = tl.load(scales_ptr + 3) != 0.0

    amax_b = tl.max(u & 0x7FFFFFFF, axis=1).to(tl.float32, bitcast=True)
    big = (amax_b * per_unit).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    qs, ss = round_to_grid(big, 0, 0, -6, 3, 14, 8, False)          # E4M3, saturating
    s = pack(qs, ss).to(tl.float32, bitcast=True)
    p = s * s_dec
    recip = tl.math.div_rn(tl.full(p.shape, 1.0, tl.float32), tl.where(p == 0.0, 1.0, p))
    enc = tl.where(p == 0.0, 3.4028234663852886e38, tl.minimum(recip, 3.4028234663852886e38))
    dec = (s * amax_t) * 0.00037202381645329297                     # f32(1/2688)

    v = u.to(tl.float32, bitcast=True) * enc[:, None]
    v = tl.minimum(tl.maximum(v, -6.0), 6.0)
    vbits = v.to(tl.int32, bitcast=True)
    if STOCHASTIC:
        noise = tl.load(noise_ptr + offs, mask=mask, other=0x3F800000)
    else:
        noise = 0
    q, qe = round_to_grid(vbits & 0x7FFFFFFF, 0, noise, 0, 1, 3, 2, STOCHASTIC)   # E2M1
    qv = (pack(q, qe) | ((vbits >> 31) << 31)).to(tl.float32, bitcast=True)
    y = (qv * dec[:, None]).to(tl.int32, bitcast=True)
    y = tl.where(finite, y, 0x7FC00000)
    store_bits(y_ptr, offs, mask, y, IS_BF16)


def nvfp4_fake_quantize_triton(x: torch.Tensor, axis: int, noise: Optional[torch.Tensor] = None,
                               amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fake_quantize(x, "nvfp4", axis, amax=amax) (1-D blocks) by the Triton kernel.

    x: float32 or bf16; axis normalised; noise: None or eager's uniform [0, 1) float32 numbers
    of x's shape (stochastic rounding); amax: None or an imposed 0-d float32 tensor amax."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"the NVFP4 Triton kernel takes float32 or bfloat16, got {x.dtype}")
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    # max |x| without a |x| temporary: NaN if any NaN, else Inf if any Inf (abs: max(0, -0)
    # may be -0).
    data_amax = torch.maximum(x.amax(), x.amin().neg()).abs().float()
    amax, s_enc, s_dec, finite = tensor_scales(data_amax, amax)
    scales = torch.stack([s_enc * ONE_SIXTH_F32, s_dec, amax, finite.float()]).float()
    length = x.shape[axis]
    inner = math.prod(x.shape[axis + 1:])
    outer = math.prod(x.shape[:axis])
    blocks_per_row = -(-length // NVFP4_BLOCK_SIZE)
    n_blocks = outer * blocks_per_row * inner
    view = torch.int16 if x.dtype == torch.bfloat16 else torch.int32
    noise_arg = x.view(view) if noise is None else noise.contiguous().view(torch.int32)
    _nvfp4_qdq_kernel[(triton.cdiv(n_blocks, GROUP),)](
        x.view(view), noise_arg, y.view(view), scales, n_blocks, length, inner, blocks_per_row,
        STOCHASTIC=noise is not None, IS_BF16=x.dtype == torch.bfloat16, GROUP_=GROUP,
        enable_reflect_ftz=False)      # div_rn keeps float32 subnormals, as eager does
    return y
