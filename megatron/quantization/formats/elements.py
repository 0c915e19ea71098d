"""Rounding to the element grids of binary float formats (E4M3, E5M2, E2M1, ...): round to
nearest with ties to even, subnormals kept, finite overflow saturated."""

from __future__ import annotations

from types import MappingProxyType
import torch

from megatron.quantization.formats.common import (
    NATIVE_ELEMENT_DTYPES, FormatInfo, bit_layout)

def round_to_grid_(a: torch.Tensor, emin: int, mbits: int) -> torch.Tensor:
    """Round `a` in place to nearest, ties to even, on the grid of a binary float format with
    `mbits` mantissa bits and smallest normal exponent `emin` (subnormals kept, no overflow
    handling).

    The grid spacing at |a| is 2**(max(floor(log2|a|), emin) - mbits): read floor(log2|a|)
    from the exponent bits, clamp it at emin (below it the spacing is that of the
    subnormals), and divide, round half-to-even (torch.round), multiply: all exact, since the
    spacing is a power of two and a / spacing < 2**(mbits + 2).
    """
    int_dtype, mbits_fp, bias, field_max = bit_layout(a.dtype)
    spacing = a.view(int_dtype) & (field_max << mbits_fp)
    spacing.clamp_(min=(emin + bias) << mbits_fp)
    spacing.sub_(mbits << mbits_fp)
    spacing = spacing.view(a.dtype)
    return a.div_(spacing).round_().mul_(spacing)


def _round_to_element_grid_(a: torch.Tensor, info: FormatInfo) -> torch.Tensor:
    """MX element rounding in place: RNE with subnormals, finite overflow saturated to
    +-max_normal (P7, P8, P9)."""
    round_to_grid_(a, info.emin_elem, info.mantissa_bits)
    return a.clamp_(-info.max_normal, info.max_normal)


# Use torch's fp8 casts for E4M3/E5M2 element rounding (else the generic grid rounding).
NATIVE_FP8_CASTS = MappingProxyType({torch.float32: True, torch.bfloat16: True})
_ELEMENT_EXPONENT_BITS = MappingProxyType({"mxfp8_e4m3": 4, "mxfp8_e5m2": 5, "fp8_e4m3": 4,
                                           "fp8_e5m2": 5})
_ELEMENT_BIAS = MappingProxyType({"mxfp8_e4m3": 7, "mxfp8_e5m2": 15, "fp8_e4m3": 7,
                                  "fp8_e5m2": 15})


def _cast_saturates(dtype: torch.dtype, max_normal: float) -> bool:
    """Whether this torch's CPU float32 -> `dtype` cast clamps overflow (probed, not assumed)."""
    probe = torch.tensor([max_normal * 1.2, -max_normal * 1.2, 1e30, -1e30])
    return probe.to(dtype).float().abs().eq(max_normal).all().item()


_SATURATING_CPU_CASTS = frozenset(dtype for dtype, max_normal in ((torch.float8_e4m3fn, 448.0),
                                                                   (torch.float8_e5m2, 57344.0))
                                  if _cast_saturates(dtype, max_normal))


def _decode_fp8_(out: torch.Tensor, codes: torch.Tensor, fmt: str) -> float:
    """Write the fp8 `codes` into float32/bf16 `out` as value * 2**-k; returns 2**k.

    torch's fp8 -> float conversion is several times slower on CPU than these integer ops.
    The code byte S.E..E.M..M, sign-extended (int8 view), is shifted so that E..E.M..M sits at
    the bottom of out's exponent field and the sign copies reach out's sign bit; masking keeps
    the sign and those 7 bits. The pattern then reads as value * 2**(elem_bias - bias) for
    normals and subnormals alike (element subnormals land on subnormals or normals of `out`,
    exactly). NaN codes decode to finite values; they only occur in NaN blocks, whose NaN
    scale turns them back into NaN.
    """
    int_dtype, _, bias, _ = bit_layout(out.dtype)
    width = int_dtype.itemsize * 8
    shift = width - 8 - (8 - _ELEMENT_EXPONENT_BITS[fmt])
    bits = out.view(int_dtype)
    bits.copy_(codes.view(torch.int8))                    # sign-extending
    bits.bitwise_left_shift_(shift)
    keep = (1 << (width - 1)) | (0x7F << shift)           # sign bit and the 7 E/M bits
    bits.bitwise_and_(keep - (1 << width))
    return 2.0 ** (bias - _ELEMENT_BIAS[fmt])


def round_elements_(a: torch.Tensor, fmt: str, info: FormatInfo) -> float:
    """Round `a` in place to the element format; returns the factor still to apply."""
    native = NATIVE_ELEMENT_DTYPES.get(fmt)
    if native is not None and NATIVE_FP8_CASTS.get(a.dtype, False):
        # torch's float32/bf16 -> fp8 casts are RNE with subnormals (from bf16 through the
        # exact float32 value: one rounding). Clamp first unless the cast is known to
        # saturate (probed on CPU): the e5m2 cast does not, nor does e4m3fn before torch 2.13
        # (P7, P8).
        if not (a.device.type == "cpu" and native in _SATURATING_CPU_CASTS):
            a.clamp_(-info.max_normal, info.max_normal)
        return _decode_fp8_(a, a.to(native), fmt)
    _round_to_element_grid_(a, info)
    return 1.0

