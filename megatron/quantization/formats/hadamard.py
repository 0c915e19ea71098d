"""Random Hadamard transform (RHT) of GEMM operands along the reduction axis (design note 6.4).

Every consecutive block of b elements along `axis`, taken as a column vector, becomes

    y_blk = Q x_blk,    Q = (H_b / sqrt(b)) diag(d),

with H_b the Sylvester Hadamard matrix (H_1 = [1], H_2n = [[H, H], [H, -H]]) and d in {+-1}^b a
sign vector that depends only on `seed` and is shared by all blocks. Q is orthonormal
(Q^T Q = I), so transforming both operands of C = A B^T along their reduction axis K with the
same Q leaves the product unchanged: (A Q^T)(B Q^T)^T = A Q^T Q B^T = A B^T. Spreading each
block's outliers over the whole block makes the block scales of NVFP4 / MXFP4 fit the bulk of
the values better (NVFP4 paper section 4.2; TE and torchao build the same matrix).
"""

from __future__ import annotations

import functools
import math

import torch

from megatron.quantization.formats.common import check_tensor, normalize_axis

HADAMARD_BLOCK_SIZES = (16, 32, 64, 128)


def _check_block(block) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or block not in HADAMARD_BLOCK_SIZES:
        raise ValueError(f"Hadamard block size must be one of "
                         f"{', '.join(map(str, HADAMARD_BLOCK_SIZES))}, got {block!r}")
    return block


def hadamard_sign_vector(block: int, seed: int) -> torch.Tensor:
    """The sign vector d in {+-1}^block (float32, CPU) of the transform with this seed.

    One random bit per entry from a CPU torch.Generator seeded with `seed`: the same seed gives
    the same vector on every machine and for every device the transform later runs on.
    """
    block = _check_block(block)
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    bits = torch.randint(0, 2, (block,), generator=gen, dtype=torch.int64)
    return (1 - 2 * bits).to(torch.float32)


def _sylvester(block: int) -> torch.Tensor:
    """The float64 Sylvester Hadamard matrix H_block (entries +-1, H H^T = block I)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.lru_cache(maxsize=64)
def _transposed_matrix(block: int, seed: int, device: torch.device,
                       dtype: torch.dtype) -> torch.Tensor:
    """Q^T = diag(d) H / sqrt(b), built in float64 and rounded once to `dtype`, so that row
    blocks transform as x_blk @ Q^T. Cached per (block, seed, device, dtype): built and copied
    to the device once, not on every call (a bounded cache, in case seeds change per step)."""
    d = hadamard_sign_vector(block, seed).to(torch.float64)
    qt = d[:, None] * _sylvester(block) / math.sqrt(block)
    return qt.to(device=device, dtype=dtype)


def random_hadamard_transform(x: torch.Tensor, axis: int = -1, block: int = 16,
                              seed: int = 0) -> torch.Tensor:
    """y = (H_b / sqrt(b)) diag(d) x_blk for every block of `block` elements along `axis`.

    block: 16 (NVFP4), 32, 64 or 128 (MXFP4); the length along `axis` must be a multiple of it.
    seed: selects the sign vector d (hadamard_sign_vector). Returns x's shape and dtype;
    16-bit inputs are computed in float32 (one rounding at the end), float64 stays float64.
    The transform is linear and differentiable (its gradient is the inverse transform).
    """
    check_tensor(x)
    block = _check_block(block)
    axis = normalize_axis(axis, x.dim())
    n = x.shape[axis]
    if n % block:
        raise ValueError(f"random_hadamard_transform: the length {n} along axis {axis} is not "
                         f"a multiple of the Hadamard block {block}")
    cdtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    qt = _transposed_matrix(block, int(seed), x.device, cdtype)
    rows = x.movedim(axis, -1).to(cdtype)
    y = (rows.unflatten(-1, (n // block, block)) @ qt).flatten(-2)
    return y.movedim(-1, axis).to(x.dtype)
