"""max |x| over a whole tensor in one Triton kernel, for the per-tensor scales (NVFP4's second
level, FP8 current scaling) that the quantization kernels then compute on the device.

Each program reduces its slice of |x| bit patterns and folds the result into one int32 with an
atomic max. Non-negative float32 bit patterns order like the magnitudes, and every NaN
pattern is above +Inf's, so the result is the float32 bits of the amax with the eager
reductions' rule: NaN if x holds a NaN, else +Inf if it holds an Inf. No 0-d tensor
arithmetic runs on the host: the consumer kernels read these bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron.quantization.kernels.bits import load_bits

BLOCK = 4096


@triton.jit
def _amax_kernel(x_ptr, out_ptr, numel, IS_BF16: tl.constexpr, BLOCK_: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < numel
    mag = load_bits(x_ptr, offs, mask, IS_BF16) & 0x7FFFFFFF
    tl.atomic_max(out_ptr, tl.max(mag, axis=0))


def amax_bits(x: torch.Tensor) -> torch.Tensor:
    """The float32 bits of max |x| as a one-element int32 tensor on x's device (x contiguous,
    float32 or bf16; 0 for an empty x)."""
    out = torch.zeros(1, dtype=torch.int32, device=x.device)
    if x.numel():
        _amax_kernel[(triton.cdiv(x.numel(), BLOCK),)](
            x, out, x.numel(), IS_BF16=x.dtype == torch.bfloat16, BLOCK_=BLOCK)
    return out
