"""Representable ranges of the simulated element formats, for range markers and saturation.

`format_ranges(name)` returns the format library's `format_info` for the formats it knows, and
otherwise an identical description from the table below (values from the format design notes:
OCP E4M3 / E5M2 / E2M1 / E2M3 / E3M2 elements of MX blocks, NVFP4's E2M1 elements with E4M3
block scales, FP8 E4M3 / E5M2 with float32 scales, and HiFloat8's tapered layout). Analysis
code only reads the fields listed in `FormatRanges`; `describe(name)` is the one-line
description the report and statistics.json give each format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from megatron.quantization.formats import canonical_format, format_info


@dataclass(frozen=True)
class FormatRanges:
    """The parts of a format description that analysis and plots use."""

    name: str
    kind: str                     # 'mx' | 'nvfp4' | 'fp8' | 'hifp8' | 'float' | 'none'
    block_size: Optional[int]     # MX / NVFP4 block length (None: per-element format, or FP8
                                  # whose scale is per tensor or per 1x128 / 128x128 tile)
    emax_elem: Optional[int]      # exponent of the largest normal element value
    max_normal: Optional[float]   # largest finite magnitude (of the element, for MX)
    min_normal: Optional[float]
    min_subnormal: Optional[float]
    mantissa_bits: Optional[int]  # HiFP8: the widest (3-bit) mantissa

    @property
    def quantized(self) -> bool:
        return self.kind != "none"


_FALLBACK = {
    "mxfp8_e4m3": FormatRanges("mxfp8_e4m3", "mx", 32, 8, 448.0, 2.0 ** -6, 2.0 ** -9, 3),
    "mxfp8_e5m2": FormatRanges("mxfp8_e5m2", "mx", 32, 15, 57344.0, 2.0 ** -14, 2.0 ** -16, 2),
    "mxfp4": FormatRanges("mxfp4", "mx", 32, 2, 6.0, 1.0, 0.5, 1),
    "mxfp6_e2m3": FormatRanges("mxfp6_e2m3", "mx", 32, 2, 7.5, 1.0, 0.125, 3),
    "mxfp6_e3m2": FormatRanges("mxfp6_e3m2", "mx", 32, 4, 28.0, 0.25, 0.0625, 2),
    "nvfp4": FormatRanges("nvfp4", "nvfp4", 16, 2, 6.0, 1.0, 0.5, 1),
    "fp8_e4m3": FormatRanges("fp8_e4m3", "fp8", None, 8, 448.0, 2.0 ** -6, 2.0 ** -9, 3),
    "fp8_e5m2": FormatRanges("fp8_e5m2", "fp8", None, 15, 57344.0, 2.0 ** -14, 2.0 ** -16, 2),
    "hifp8": FormatRanges("hifp8", "hifp8", None, 15, 32768.0, 2.0 ** -15, 2.0 ** -22, 3),
    "none": FormatRanges("none", "none", None, None, None, None, None, None),
}
_ALIASES = {
    "mxfp8": "mxfp8_e4m3", "e4m3": "mxfp8_e4m3", "mxfp8e4m3": "mxfp8_e4m3",
    "e5m2": "mxfp8_e5m2", "mxfp8e5m2": "mxfp8_e5m2", "mxfp4_e2m1": "mxfp4", "e2m1": "mxfp4",
    "hif8": "hifp8", "hifloat8": "hifp8", "bf16": "none", "": "none", "null": "none",
}


def _from_library(name: str) -> Optional[FormatRanges]:
    """The format library is the authority on every format it knows."""
    try:
        info = format_info(canonical_format(name))
    except Exception:
        return None

    def get(field, default=None):
        return getattr(info, field, default)

    return FormatRanges(
        name=str(get("name", name)), kind=str(get("kind", "none")),
        block_size=get("block_size"), emax_elem=get("emax_elem"),
        max_normal=_float_or_none(get("max_normal")), min_normal=_float_or_none(get("min_normal")),
        min_subnormal=_float_or_none(get("min_subnormal")), mantissa_bits=get("mantissa_bits"))


def _float_or_none(value):
    return None if value is None else float(value)


@lru_cache(maxsize=None)
def format_ranges(name: Optional[str]) -> FormatRanges:
    """Range description of a format name as written in capture metadata ('none' if unknown)."""
    key = "none" if name is None else str(name).strip()
    library = _from_library(key) if key.lower() not in ("none", "", "null") else None
    if library is not None:
        return library
    key = _ALIASES.get(key.lower(), key.lower())
    if key in _FALLBACK:
        return _FALLBACK[key]
    # An unknown format is analysed as "quantized, range unknown" rather than dropped.
    return FormatRanges(key, "float", None, None, None, None, None, None)


def known_formats():
    """Formats with a built-in description, in display order."""
    return [name for name in _FALLBACK if name != "none"]


_ELEMENTS = {"mxfp8_e4m3": "E4M3", "mxfp8_e5m2": "E5M2", "mxfp4": "E2M1",
             "mxfp6_e2m3": "E2M3", "mxfp6_e3m2": "E3M2", "nvfp4": "E2M1", "fp8_e4m3": "E4M3",
             "fp8_e5m2": "E5M2"}
_SCALES = {
    "mx": "one E8M0 power-of-two scale per block of 32 along the GEMM's reduction axis",
    "nvfp4": "one E4M3 scale per block of 16 along the reduction axis (16x16 tiles for "
             "2-D weights) and one float32 scale per tensor (2688 / amax)",
    "fp8": "one float32 scale per tensor (448 or 57344 / amax: current or delayed scaling) or "
           "per 1x128 / 128x128 tile (blockwise)",
}


def _number(value: float) -> str:
    """2^k for powers of two below 1/4, the plain number otherwise."""
    mantissa, exponent = math.frexp(value)
    return f"2^{exponent - 1}" if mantissa == 0.5 and exponent < -1 else f"{value:g}"


def scale_description(name: Optional[str]) -> Optional[str]:
    """How a format's elements are scaled (None for per-element formats)."""
    return _SCALES.get(format_ranges(name).kind)


def describe(name: Optional[str]) -> str:
    """One line: the element format, its range and its scaling."""
    r = format_ranges(name)
    if r.kind == "none":
        return "high precision (not quantized)"
    if r.kind == "hifp8":
        return ("HiFloat8: tapered 8-bit float (3/2/1 mantissa bits by binade), denormals "
                "2^-22..2^-16, largest finite 32768, per element (optionally one "
                "power-of-two scale per tensor)")
    if r.kind == "float":
        return f"{r.name}: IEEE-style float, largest finite {r.max_normal:g}" \
            if r.max_normal else f"{r.name}: format of unknown range"
    element = _ELEMENTS.get(r.name, "")
    text = (f"{element} elements (largest {_number(r.max_normal)}, smallest subnormal "
            f"{_number(r.min_subnormal)})" if r.max_normal and r.min_subnormal
            else f"{element} elements")
    return f"{r.name}: {text}, {_SCALES.get(r.kind, 'scaled')}"
