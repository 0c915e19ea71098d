"""Representable ranges of the simulated element formats, for range markers and saturation.

`format_ranges(name)` returns the format library's `format_info` for the formats it knows, and
otherwise an identical description from the table below (values from the format design notes:
OCP E4M3 / E5M2 / E2M1 elements of MX blocks, and HiFloat8's tapered layout). Analysis code
only reads the fields listed in `FormatRanges`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from megatron.quantization.formats import canonical_format, format_info


@dataclass(frozen=True)
class FormatRanges:
    """The parts of a format description that analysis and plots use."""

    name: str
    kind: str                     # 'mx' | 'hifp8' | 'float' | 'none'
    block_size: Optional[int]     # MX block length (None: per-element format)
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
