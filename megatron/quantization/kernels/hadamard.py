"""The random Hadamard transform inside the quantization kernels: the operand is rotated in
registers as it is loaded, so no rotated copy is written and read back.

`rotate` computes formats/hadamard.py's arithmetic step for step (signs, butterflies with
strides 1, 2, ..., b/2 in that order, one multiplication by f32(1/sqrt(b)), a bf16 operand's
result rounded to bf16), so the fused kernels give the bits of quantizing eager's rotated
tensor. The butterflies are sums and differences only (nothing a GPU could fuse into an FMA).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from megatron.quantization.formats.hadamard import inverse_sqrt, signs_on
from megatron.quantization.kernels.bits import round_bits_to_bf16


@triton.jit
def _butterfly(z, ROWS: tl.constexpr, RB: tl.constexpr, H: tl.constexpr):
    """One stage: within every group of 2H elements of a row, (z_i, z_i+H) -> (z_i + z_i+H,
    z_i - z_i+H)."""
    pairs = tl.permute(tl.reshape(z, [ROWS, RB // (2 * H), 2, H]), [0, 1, 3, 2])
    a, c = tl.split(pairs)                                  # [ROWS, RB / 2H, H] each
    out = tl.permute(tl.join(a + c, a - c), [0, 1, 3, 2])
    return tl.reshape(out, [ROWS, RB])


@triton.jit
def rotate(u, signs_ptr, ROWS: tl.constexpr, WIDTH: tl.constexpr, RB: tl.constexpr,
           INV_SQRT: tl.constexpr, IS_BF16: tl.constexpr):
    """float32 bits [ROWS, WIDTH] (WIDTH a multiple of RB, the transform's blocks consecutive
    along a row) -> the float32 bits of their transform, rounded to bf16 for a bf16 operand."""
    z = tl.reshape(u.to(tl.float32, bitcast=True), [ROWS * (WIDTH // RB), RB])
    z = z * tl.load(signs_ptr + tl.arange(0, RB))[None, :]
    for stage in tl.static_range(7):
        if (1 << stage) < RB:
            z = _butterfly(z, ROWS * (WIDTH // RB), RB, 1 << stage)
    bits = tl.reshape(z * INV_SQRT, [ROWS, WIDTH]).to(tl.int32, bitcast=True)
    if IS_BF16:
        bits = round_bits_to_bf16(bits)
    return bits


def hadamard_launch(rht, device) -> dict:
    """The launch arguments of a kernel that rotates its operand: {"signs": the sign vector
    (a tensor on `device`, cached), "RHT": the block, "INV_SQRT": f32(1/sqrt(block))}; RHT 0
    (and a placeholder sign vector) for rht None."""
    if rht is None:
        return {"signs": _placeholder(device), "RHT": 0, "INV_SQRT": 1.0}
    block, seed = rht
    return {"signs": signs_on(block, int(seed), device, torch.float32), "RHT": block,
            "INV_SQRT": inverse_sqrt(block, torch.float32)}


@functools.lru_cache(maxsize=8)
def _placeholder(device) -> torch.Tensor:
    return torch.ones(1, dtype=torch.float32, device=device)
