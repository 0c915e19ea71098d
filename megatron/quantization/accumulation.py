"""Limited-precision GEMM accumulation: what a tensor core's accumulator does to a long sum.

FP8 GEMMs on Hopper tensor cores do not accumulate in full FP32: DeepSeek-V3 (arXiv 2412.19437,
section 3.3) measured about 14 bits of mantissa, about 2% maximum relative error at K = 4096,
and fixed it by promoting the partial sums into FP32 registers every N_C = 128 elements
(TransformerEngine's `use_split_accumulator`). This module models that, for any GEMM:

For every output element c = sum_k a_k b_k, with the K products taken in order in groups of
`group` (one MMA instruction's reduction; a short last group is zero-padded):

1. a group's products are summed exactly (in float64: exact for the 8- and 16-bit operands of
   low-precision GEMMs; for wider ones the group sum is rounded once, at 53 bits, far below
   what the accumulator keeps);
2. the running partial sum P and the group's sum S are aligned to the larger of their two
   exponents E = max(floor(log2|P|), floor(log2|S|)) and each truncated toward zero to a
   multiple of 2**(E - m), m = `mantissa_bits` (the bits that fall off the aligned adder);
   their sum is then truncated toward zero to m mantissa bits of its own exponent: P;
3. every `promotion` products (a multiple of `group`; 0: never) and after the last group, P is
   added to an FP32 accumulator (IEEE float32 addition, round to nearest even) and reset to
   0. Without promotion the result is P itself, rounded to float32.

m = 23 with promotion every group is FP32 accumulation in group-sized steps; m = 13 is the
"fp22" accumulator (1 + 8 + 13 bits) the DeepSeek-V3 measurement points to. The cost is one
float64 GEMM of the group sums plus a pass over the M x N outputs per group: about K / group
elementwise passes, slow next to a hardware GEMM but exact, and only for the GEMMs asked.
"""

from __future__ import annotations

import torch

__all__ = ["limited_precision_matmul", "check_accumulation"]


def check_accumulation(mantissa_bits: int, group: int, promotion: int) -> None:
    """ValueError naming a bad value and what is valid."""
    if isinstance(mantissa_bits, bool) or not isinstance(mantissa_bits, int) \
            or not 1 <= mantissa_bits <= 23:
        raise ValueError(f"mantissa_bits {mantissa_bits!r}: valid 1..23 (FP32 keeps 23)")
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group {group!r}: a positive number of products")
    if isinstance(promotion, bool) or not isinstance(promotion, int) or promotion < 0 \
            or promotion % group:
        raise ValueError(f"promotion {promotion!r}: 0 (never) or a positive multiple of the "
                         f"group ({group})")


def _add(partial: torch.Tensor, group_sum: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """Step 2: the aligned, truncated addition of a group's sum to the partial sum (float64,
    exact). The larger exponent E is the exponent of the larger magnitude; both terms are cut
    to integer multiples of 2**(E - m) (division and multiplication by powers of two are
    exact), and their sum, |n| < 2**(m + 2) such units, keeps its m + 1 leading bits."""
    _, exponent = torch.frexp(torch.maximum(partial.abs(), group_sum.abs()))
    step_exponent = (exponent - (1 + mantissa_bits)).double()      # E - m (frexp: E + 1)
    step = torch.exp2(step_exponent)
    units = torch.trunc(partial / step).add_(torch.trunc(group_sum / step))
    fraction, bits = torch.frexp(units)                 # units = fraction * 2**bits exactly
    kept = torch.trunc(fraction.mul_(2.0 ** (mantissa_bits + 1)))
    return kept.mul_(torch.exp2(step_exponent.add_(bits - (1 + mantissa_bits))))


def limited_precision_matmul(a: torch.Tensor, b: torch.Tensor, mantissa_bits: int = 13,
                             group: int = 32, promotion: int = 128) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] (or b [K, N]) with the accumulation of the module
    docstring: products summed exactly within groups of `group`, the partial sum truncated
    toward zero to `mantissa_bits` after every group, promoted into FP32 every `promotion`
    products (0: never). Returns float32 (the accumulator's type)."""
    check_accumulation(mantissa_bits, group, promotion)
    if a.dim() < 2 or b.dim() < 2 or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"limited_precision_matmul needs a [..., M, K] and b [..., K, N], got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    k = a.shape[-1]
    groups = max(1, -(-k // group))
    pad = groups * group - k
    a64 = torch.nn.functional.pad(a.double(), (0, pad))
    b64 = torch.nn.functional.pad(b.double().transpose(-1, -2), (0, pad)).transpose(-1, -2)
    a64 = a64.unflatten(-1, (groups, group))                  # [..., M, G, group]
    b64 = b64.unflatten(-2, (groups, group))                  # [..., G, group, N]
    sums = torch.einsum("...mgk,...gkn->...gmn", a64, b64)    # the exact group sums
    partial = torch.zeros_like(sums[..., 0, :, :])
    result = torch.zeros(partial.shape, dtype=torch.float32, device=a.device)
    every = promotion // group if promotion else 0
    for g in range(groups):
        partial = _add(partial, sums[..., g, :, :], mantissa_bits)
        if every and ((g + 1) % every == 0 or g == groups - 1):
            result = result + partial.float()         # P fits float32: a float32 addition
            partial = torch.zeros_like(partial)
    return result if every else partial.float() + 0.0    # -0.0 -> 0.0
