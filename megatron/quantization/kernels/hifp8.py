"""HiFP8 quantize-dequantize in one Triton kernel (integer arithmetic on the float bits).

Element-wise, the rule of formats/hifp8.py: with E = floor(log2|x|) the HiF8 step is 2**S,
S = E - width (width 3 for |E| <= 3, 2 for |E| <= 7, 1 above), S = E for the denormals
(-22 <= E <= -16), S = -22 for E = -23 (2**-23 ties up to 2**-22, P17); |x| < 2**-23 (fp32
subnormals included) becomes 0. x = sig * 2**lsb is rounded to a multiple of 2**(S - lsb) with
ties away from zero (P18). A result above 32768 (that is >= 49152; inputs >= 40960) and +-Inf
become +-Inf, or +-32768 with saturate. NaN stays NaN; zero results are +0 (HiF8 has no -0,
P16). Every result has at most 4 significant bits within 2**-22 .. 2**15, so the bf16 output
is the float32 result's high half, exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron.quantization.kernels.bits import load_bits, store_bits
from megatron.quantization.kernels.tuning import ELEMENTS_PER_PROGRAM, launch


@triton.jit
def hifp8_qdq_kernel(x_ptr, y_ptr, numel, SATURATE: tl.constexpr, IS_BF16: tl.constexpr,
                     BLOCK_: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < numel
    u = load_bits(x_ptr, offs, mask, IS_BF16)
    mag = u & 0x7FFFFFFF
    bexp = mag >> 23
    sig = (mag & 0x7FFFFF) | 0x800000
    e = bexp - 127
    ae = tl.abs(e)
    width = tl.where(ae <= 3, 3, tl.where(ae <= 7, 2, 1))
    s = tl.where(e >= -15, e - width, tl.where(e >= -22, e, -22))
    shift = tl.minimum(tl.maximum(s - (e - 23), 1), 25)
    q = (sig + (1 << (shift - 1))) >> shift            # ties away from zero
    q = tl.where(e >= -23, q, 0)                       # |x| < 2**-23 (and fp32 subnormals)
    qbits = q.to(tl.float32).to(tl.int32, bitcast=True)
    res = tl.where(q == 0, 0, qbits + tl.minimum(tl.maximum(s, -126), 126) * 8388608)
    over = (e > 15) | ((e == 15) & (q > 2))            # also +-Inf (e = 128)
    if SATURATE:
        res = tl.where(over, 0x47000000, res)          # 32768
    else:
        res = tl.where(over, 0x7F800000, res)
    res = tl.where(res != 0, res | ((u >> 31) << 31), 0)   # x's sign; -0 -> +0
    res = tl.where(mag > 0x7F800000, 0x7FC00000, res)      # NaN
    store_bits(y_ptr, offs, mask, res, IS_BF16)            # bf16: exact, the high half


def hifp8_fake_quantize_triton(x: torch.Tensor, saturate: bool) -> torch.Tensor:
    """fake_quantize(x, "hifp8", saturate=saturate) by the Triton kernel (float32 or bf16)."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"the HiFP8 Triton kernel takes float32 or bfloat16, got {x.dtype}")
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    launch(hifp8_qdq_kernel, "BLOCK_", ELEMENTS_PER_PROGRAM,
           lambda block: triton.cdiv(x.numel(), block), (x, y, x.numel()), key=("numel",),
           SATURATE=bool(saturate), IS_BF16=x.dtype == torch.bfloat16, enable_fp_fusion=False)
    return y
