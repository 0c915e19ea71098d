"""Random Hadamard transform (RHT) of GEMM operands along the reduction axis (design note 6.4).

Every consecutive block of b elements along `axis`, taken as a column vector, becomes

    y_blk = Q x_blk,    Q = (H_b / sqrt(b)) diag(d),

with H_b the Sylvester Hadamard matrix (H_1 = [1], H_2n = [[H, H], [H, -H]]) and d in {+-1}^b a
sign vector that depends only on `seed` and is shared by all blocks. Q is orthonormal
(Q^T Q = I), so transforming both operands of C = A B^T along their reduction axis K with the
same Q leaves the product unchanged: (A Q^T)(B Q^T)^T = A Q^T Q B^T = A B^T. Spreading each
block's outliers over the whole block makes the block scales of NVFP4 / MXFP4 fit the bulk of
the values better (NVFP4 paper section 4.2; TE and torchao build the same matrix).

The arithmetic is defined to the bit, so that a fused kernel (kernels/hadamard.py, inside the
quantization kernels) gives the same numbers on every device: in float32 (float64 for float64
inputs), z = d * x (exact), then the fast Walsh-Hadamard butterflies with strides h = 1, 2, 4,
..., b/2 in that order, each pair (z_i, z_i+h) becoming (z_i + z_i+h, z_i - z_i+h) with one
rounding per sum, then one multiplication by f32(1/sqrt(b)) (exact for b = 16 and 64), and a
16-bit input's result rounded once to its dtype. A matrix product would leave the order of
the sums to the BLAS library, and so the bits to the device.
"""

from __future__ import annotations

import functools
import math
import struct

import torch

from megatron.quantization.formats.common import check_tensor, normalize_axis

HADAMARD_BLOCK_SIZES = (16, 32, 64, 128)


def check_hadamard_block(block) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or block not in HADAMARD_BLOCK_SIZES:
        raise ValueError(f"Hadamard block size must be one of "
                         f"{', '.join(map(str, HADAMARD_BLOCK_SIZES))}, got {block!r}")
    return block


def hadamard_sign_vector(block: int, seed: int) -> torch.Tensor:
    """The sign vector d in {+-1}^block (float32, CPU) of the transform with this seed.

    One random bit per entry from a CPU torch.Generator seeded with `seed`: the same seed gives
    the same vector on every machine and for every device the transform later runs on.
    """
    block = check_hadamard_block(block)
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    bits = torch.randint(0, 2, (block,), generator=gen, dtype=torch.int64)
    return (1 - 2 * bits).to(torch.float32)


def check_hadamard_length(x: torch.Tensor, axis: int, block: int, who: str) -> None:
    """The length of x along `axis` must be a multiple of the transform's block."""
    if x.shape[axis] % block:
        raise ValueError(f"{who}: the length {x.shape[axis]} along axis {axis} is not a "
                         f"multiple of the Hadamard block {block}")


def inverse_sqrt(block: int, dtype: torch.dtype) -> float:
    """1/sqrt(block) rounded to `dtype` (float32 or float64), as a Python float (pure Python:
    no tensor is made for it on the way to a kernel launch)."""
    value = 1.0 / math.sqrt(block)
    if dtype == torch.float64:
        return value
    return struct.unpack("f", struct.pack("f", value))[0]       # round to nearest float32


@functools.lru_cache(maxsize=64)
def signs_on(block: int, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The sign vector d on `device` in `dtype`, built and copied there once per (block, seed,
    device, dtype) (a bounded cache, in case seeds change per step)."""
    return hadamard_sign_vector(block, seed).to(device=device, dtype=dtype)


def butterflies(z: torch.Tensor, block: int) -> torch.Tensor:
    """H_block z over the last axis of z (its length `block`), by the butterflies with strides
    1, 2, ..., block/2 in that order (one rounding per sum). Differentiable."""
    lead = z.shape[:-1]
    h = 1
    while h < block:
        pairs = z.reshape(*lead, block // (2 * h), 2, h)
        a, c = pairs.unbind(-2)
        z = torch.stack((a + c, a - c), -2).reshape(*lead, block)
        h *= 2
    return z


def _butterflies_in_place(z: torch.Tensor, block: int) -> torch.Tensor:
    """butterflies() on a contiguous z without autograd, its sums and differences written
    into two buffers in turn (the same operations, so the same bits; no temporaries)."""
    src, dst = z, torch.empty_like(z)
    lead = z.shape[:-1]
    h = 1
    while h < block:
        pairs = src.view(*lead, block // (2 * h), 2, h)
        out = dst.view(*lead, block // (2 * h), 2, h)
        torch.add(pairs[..., 0, :], pairs[..., 1, :], out=out[..., 0, :])
        torch.sub(pairs[..., 0, :], pairs[..., 1, :], out=out[..., 1, :])
        src, dst = dst, src
        h *= 2
    return src


def random_hadamard_transform(x: torch.Tensor, axis: int = -1, block: int = 16,
                              seed: int = 0) -> torch.Tensor:
    """y = (H_b / sqrt(b)) diag(d) x_blk for every block of `block` elements along `axis`.

    block: 16 (NVFP4), 32, 64 or 128 (MXFP4); the length along `axis` must be a multiple of it.
    seed: selects the sign vector d (hadamard_sign_vector). Returns x's shape and dtype;
    16-bit inputs are computed in float32 (one rounding at the end), float64 stays float64;
    the order of the operations is fixed (see the module docstring). The transform is linear
    and differentiable (its gradient is the inverse transform).
    """
    check_tensor(x)
    block = check_hadamard_block(block)
    axis = normalize_axis(axis, x.dim())
    check_hadamard_length(x, axis, block, "random_hadamard_transform")
    n = x.shape[axis]
    cdtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = x.movedim(axis, -1).unflatten(-1, (n // block, block))
    signs = signs_on(block, int(seed), x.device, cdtype)
    scale = inverse_sqrt(block, cdtype)
    if torch.is_grad_enabled() and x.requires_grad:
        z = butterflies(rows.to(cdtype) * signs, block)
        return (z * scale).flatten(-2).movedim(-1, axis).to(x.dtype)
    # Without autograd: one contiguous float buffer for the signed rows, the butterflies in
    # place, and the scaled result written straight into x's layout and dtype.
    z = torch.empty(rows.shape, dtype=cdtype, device=x.device)
    torch.mul(rows, signs, out=z)
    z = _butterflies_in_place(z, block)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    torch.mul(z, scale, out=out.movedim(axis, -1).unflatten(-1, (n // block, block)))
    return out
