"""Element rounding modes: round to nearest (ties to even) and stochastic rounding.

Stochastic rounding replaces only the final rounding of an element to its grid: a scaled value
v between its grid neighbours lo <= |v| <= hi becomes hi with probability (|v| - lo) / (hi - lo)
and lo otherwise, so E[q] = v. The caller computes scales exactly as for round to nearest and
saturates v to the format's range first (a value at +-max is on the grid and stays). The
random numbers are uniform [0, 1) float32 values drawn from a caller's torch.Generator, one per
element of the operand, so the same generator state gives the same bits.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.quantization.formats.common import bit_layout

ROUNDINGS = ("nearest", "stochastic")


def check_rounding(rounding: str, generator: Optional[torch.Generator]) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDINGS)}")
    if rounding == "stochastic" and not isinstance(generator, torch.Generator):
        raise ValueError("rounding='stochastic' needs generator=<torch.Generator> (the source "
                         f"of the random bits), got {type(generator).__name__}")
    if rounding == "nearest" and generator is not None:
        raise ValueError("generator is used by rounding='stochastic' only")


def uniform_noise(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One uniform [0, 1) float32 number per element of x, on x's device, from `generator`."""
    if generator.device != x.device and not (generator.device.type == x.device.type == "cuda"):
        raise ValueError(f"the generator is on {generator.device}, the tensor on {x.device}")
    return torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)


def stochastic_round_to_grid(a: torch.Tensor, noise: torch.Tensor, emin: int,
                              mbits: int) -> torch.Tensor:
    """Stochastically round `a` (float32/float64, finite values within the format's range) on
    the grid of a binary float format with `mbits` mantissa bits and smallest normal exponent
    `emin` (subnormals kept); `noise` holds uniform [0, 1) numbers of a's shape. Returns a new
    tensor; `a` is used as scratch (overwritten).

    The spacing at |a| is 2**(max(floor(log2|a|), emin) - mbits) (read from the exponent bits,
    as for round to nearest); r = |a| / spacing is exact, floor(r) * spacing is the lower
    neighbour lo and r - floor(r) the probability of rounding up to lo + spacing. A value on
    the grid has r - floor(r) = 0 and never moves. NaN stays NaN.
    """
    int_dtype, mbits_fp, bias, field_max = bit_layout(a.dtype)
    spacing = a.view(int_dtype) & (field_max << mbits_fp)
    spacing.clamp_(min=(emin + bias) << mbits_fp)
    spacing.sub_(mbits << mbits_fp)
    spacing = spacing.view(a.dtype)
    r = a.div_(spacing)
    lower = r.abs().floor_()
    up = (noise < (r.abs() - lower)).to(a.dtype)
    return lower.add_(up).mul_(spacing).copysign_(r)
