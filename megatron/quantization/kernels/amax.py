"""max |x| over a whole tensor in one Triton kernel, for the per-tensor scales (NVFP4's second
level, FP8 current scaling) that the quantization kernels then compute on the device.

Each program reduces its slice of |x| bit patterns and folds the result into one float32 with
an integer atomic max on its bits. Non-negative float32 bit patterns order like the
magnitudes, and every NaN pattern is above +Inf's, so the result is the amax with the eager
reductions' rule: NaN if x holds a NaN, else +Inf if it holds an Inf. No 0-d tensor
arithmetic runs on the host: the consumer kernels read the result, and a delayed-scaling
history gets it written straight into its new entry.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from megatron.quantization.kernels.bits import as_blocks, axis_layout, block_offsets, load_bits
from megatron.quantization.kernels.hadamard import rotate

BLOCK = 4096


@triton.jit
def amax_kernel(x_ptr, out_ptr, numel, IS_BF16: tl.constexpr, BLOCK_: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < numel
    mag = load_bits(x_ptr, offs, mask, IS_BF16) & 0x7FFFFFFF
    tl.atomic_max(out_ptr.to(tl.pointer_type(tl.int32)), tl.max(mag, axis=0))


@triton.jit
def _rotated_amax_kernel(x_ptr, out_ptr, signs_ptr, n_blocks, length, inner, blocks_per_row,
                         IS_BF16: tl.constexpr, RHT: tl.constexpr, INV_SQRT: tl.constexpr,
                         LAYOUT: tl.constexpr, GROUP_: tl.constexpr):
    """max |RHT(x)| along the axis of the layout, the transform computed as the QDQ kernels
    compute it (kernels/hadamard.py)."""
    offs, mask = block_offsets(n_blocks, length, inner, blocks_per_row, GROUP_, RHT, LAYOUT)
    u = as_blocks(load_bits(x_ptr, offs, mask, IS_BF16), LAYOUT)
    u = rotate(u, signs_ptr, GROUP_, RHT, RHT, INV_SQRT, IS_BF16)
    tl.atomic_max(out_ptr.to(tl.pointer_type(tl.int32)),
                  tl.max(tl.max(u & 0x7FFFFFFF, axis=1), axis=0))


def tensor_amax(x: torch.Tensor, axis: Optional[int] = None, signs=None, RHT: int = 0,
                INV_SQRT: float = 1.0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """max |x| as a one-element float32 tensor on x's device (x contiguous, float32 or bf16; 0
    for an empty x), written into `out` when given (a one-element float32 tensor, e.g. a
    delayed-scaling history entry). With RHT > 0: max |x's random Hadamard transform| along
    `axis` with the sign vector `signs` (hadamard.hadamard_launch gives these arguments)."""
    if out is None:
        out = torch.zeros(1, dtype=torch.float32, device=x.device)
    else:
        out.zero_()
    if not x.numel():
        return out
    is_bf16 = x.dtype == torch.bfloat16
    if RHT:
        group = max(1, BLOCK // RHT)
        args, layout, programs = axis_layout(x.shape, axis, RHT, group)
        _rotated_amax_kernel[(programs,)](
            x, out, signs, *args, IS_BF16=is_bf16, RHT=RHT, INV_SQRT=INV_SQRT, LAYOUT=layout,
            GROUP_=group, enable_fp_fusion=False)
    else:
        amax_kernel[(triton.cdiv(x.numel(), BLOCK),)](
            x, out, x.numel(), IS_BF16=is_bf16, BLOCK_=BLOCK)
    return out
