"""What every format family shares: names and descriptions of the formats, argument checks,
exact bit-level helpers (powers of two, compute dtypes, padding)."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from types import MappingProxyType
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

FORMAT_NAMES = ("mxfp8", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "mxfp6_e2m3", "mxfp6_e3m2",
                "nvfp4", "fp8_e4m3", "fp8_e5m2", "hifp8", "bf16", "fp16", "none")
_ALIASES = MappingProxyType({"mxfp8": "mxfp8_e4m3"})
SCALE_MODES = ("floor", "rceil", "ceil", "even")

MX_BLOCK_SIZE = 32
NVFP4_BLOCK_SIZE = 16
MIN_SHARED_EXPONENT = -127          # E8M0 code 0x00 = 2**-127
MAX_SHARED_EXPONENT = 127           # E8M0 code 0xFE = 2**127
NAN_EXPONENT = 128                  # reported for a block holding NaN or Inf (E8M0 code 0xFF)

HIFP8_MAX = 32768.0                 # largest finite HiF8 value, 2**15
HIFP8_OVERFLOW = 40960.0            # 1.25 * 2**15: |x| >= this rounds to the Inf code
HIFP8_MIN_NORMAL = 2.0 ** -15
HIFP8_MIN_SUBNORMAL = 2.0 ** -22
HIFP8_DEFAULT_TARGET_EXPONENT = 3   # see hifp8_scaled_fake_quantize

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# --------------------------------------------------------------------------------------------
# Format descriptions
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FormatInfo:
    """What a format can represent (values in float, exponents unbiased).

    kind is "mx" (32-blocks with E8M0 scales), "nvfp4" (16-blocks with E4M3 scales and a
    float32 tensor scale), "fp8" (float32 scales per tensor or per tile), "hifp8", "float"
    (bf16 / fp16 pass-through) or "none". For MX the numbers describe the element format;
    block values are these times the block scale 2**e, e in [-127, 127]; emax_elem / emin_elem are the exponents of the largest
    and smallest normal element. mantissa_bits is the largest mantissa width (HiF8 has 3 near 1
    and fewer further out). overflow_threshold is the smallest magnitude that the plain cast
    sends to Inf (HiF8 only; MX elements saturate).
    """

    name: str
    kind: str
    block_size: Optional[int] = None
    emax_elem: Optional[int] = None
    emin_elem: Optional[int] = None
    max_normal: Optional[float] = None
    min_normal: Optional[float] = None
    min_subnormal: Optional[float] = None
    mantissa_bits: Optional[int] = None
    overflow_threshold: Optional[float] = None


def _mx_info(name, emax, emin, mbits, max_normal):
    return FormatInfo(name=name, kind="mx", block_size=MX_BLOCK_SIZE, emax_elem=emax,
                      emin_elem=emin, max_normal=max_normal, min_normal=2.0 ** emin,
                      min_subnormal=2.0 ** (emin - mbits), mantissa_bits=mbits)


FORMAT_INFO = MappingProxyType({
    # E4M3 "fn": S.1111.111 is NaN, so the largest normal is 1.75 * 2**8.
    "mxfp8_e4m3": _mx_info("mxfp8_e4m3", emax=8, emin=-6, mbits=3, max_normal=448.0),
    "mxfp8_e5m2": _mx_info("mxfp8_e5m2", emax=15, emin=-14, mbits=2, max_normal=57344.0),
    "mxfp4": _mx_info("mxfp4", emax=2, emin=0, mbits=1, max_normal=6.0),
    "mxfp6_e2m3": _mx_info("mxfp6_e2m3", emax=2, emin=0, mbits=3, max_normal=7.5),
    "mxfp6_e3m2": _mx_info("mxfp6_e3m2", emax=4, emin=-2, mbits=2, max_normal=28.0),
    # NVFP4: E2M1 elements in blocks of 16 with an E4M3 block scale and a float32 tensor scale.
    "nvfp4": FormatInfo(name="nvfp4", kind="nvfp4", block_size=NVFP4_BLOCK_SIZE, emax_elem=2,
                        emin_elem=0, max_normal=6.0, min_normal=1.0, min_subnormal=0.5,
                        mantissa_bits=1),
    # FP8 with a float32 scale per tensor (current or delayed scaling) or per 1x128 / 128x128
    # tile (blockwise); the numbers describe the element format.
    "fp8_e4m3": FormatInfo(name="fp8_e4m3", kind="fp8", emax_elem=8, emin_elem=-6,
                           max_normal=448.0, min_normal=2.0 ** -6, min_subnormal=2.0 ** -9,
                           mantissa_bits=3),
    "fp8_e5m2": FormatInfo(name="fp8_e5m2", kind="fp8", emax_elem=15, emin_elem=-14,
                           max_normal=57344.0, min_normal=2.0 ** -14, min_subnormal=2.0 ** -16,
                           mantissa_bits=2),
    "hifp8": FormatInfo(name="hifp8", kind="hifp8", max_normal=HIFP8_MAX,
                        min_normal=HIFP8_MIN_NORMAL, min_subnormal=HIFP8_MIN_SUBNORMAL,
                        mantissa_bits=3, overflow_threshold=HIFP8_OVERFLOW),
    "bf16": FormatInfo(name="bf16", kind="float", emin_elem=-126,
                       max_normal=torch.finfo(torch.bfloat16).max, min_normal=2.0 ** -126,
                       min_subnormal=2.0 ** -133, mantissa_bits=7),
    "fp16": FormatInfo(name="fp16", kind="float", emin_elem=-14, max_normal=65504.0,
                       min_normal=2.0 ** -14, min_subnormal=2.0 ** -24, mantissa_bits=10),
    "none": FormatInfo(name="none", kind="none"),
})

# torch dtypes whose float32/bf16 casts round to the MX element formats exactly (RNE,
# subnormals kept); see round_elements_ for the saturation they may lack (P7, P8).
NATIVE_ELEMENT_DTYPES = MappingProxyType({
    "mxfp8_e4m3": torch.float8_e4m3fn,
    "mxfp8_e5m2": torch.float8_e5m2,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
})
PASS_THROUGH_DTYPES = MappingProxyType({"bf16": torch.bfloat16, "fp16": torch.float16})


def canonical_format(name: str) -> str:
    """The canonical name of a format ("mxfp8" -> "mxfp8_e4m3"); ValueError if unknown."""
    if not isinstance(name, str) or name not in FORMAT_NAMES:
        raise ValueError(f"unknown quantization format {name!r}; valid formats: "
                         f"{', '.join(FORMAT_NAMES)}")
    return _ALIASES.get(name, name)


def format_info(fmt: str) -> FormatInfo:
    """The FormatInfo of a format name (aliases accepted)."""
    return FORMAT_INFO[canonical_format(fmt)]


def check_scale_mode(scale_mode: str) -> None:
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"unknown MX scale_mode {scale_mode!r}; valid modes: "
                         f"{', '.join(SCALE_MODES)}")


def check_tensor(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"fake_quantize expects a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"fake_quantize needs a floating-point tensor, got dtype {x.dtype}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"fake_quantize does not support dtype {x.dtype}; supported: "
                        f"{', '.join(str(d) for d in _SUPPORTED_DTYPES)}")


def normalize_axis(axis: int, ndim: int) -> int:
    if isinstance(axis, bool):
        raise TypeError("axis must be an int, got bool")
    axis = operator.index(axis)
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for a tensor with ndim {ndim} "
                         f"(valid: {-ndim}..{ndim - 1})" if ndim else
                         f"axis {axis} is out of range for a tensor with ndim 0 "
                         "(block quantization needs at least one dimension)")
    return axis % ndim


def check_saturate(fmt: str, saturate) -> bool:
    if fmt == "hifp8":
        if saturate not in (None, False, True):
            raise ValueError(f"saturate must be None, False or True, got {saturate!r}")
        return bool(saturate)
    if saturate is not None:
        raise ValueError(f"saturate applies to hifp8 only (MX always saturates finite values, "
                         f"bf16/fp16 casts never do); got saturate={saturate!r} for {fmt!r}")
    return False


# --------------------------------------------------------------------------------------------
# Exact powers of two and compute dtypes
# --------------------------------------------------------------------------------------------

def compute_dtype(dtype: torch.dtype, native_bf16: bool = False) -> torch.dtype:
    """float64 stays float64; bf16 stays bf16 where the caller computes exactly in it;
    everything else computes in float32."""
    if dtype == torch.float64 or (native_bf16 and dtype == torch.bfloat16):
        return dtype
    return torch.float32


def bit_layout(dtype: torch.dtype):
    """(integer view dtype, mantissa bits, exponent bias, exponent-field maximum)."""
    if dtype == torch.float64:
        return torch.int64, 52, 1023, 0x7FF
    if dtype == torch.bfloat16:
        return torch.int16, 7, 127, 0xFF
    return torch.int32, 23, 127, 0xFF


def pow2(exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exactly 2**exponent (float32 or float64) for integer exponents in [-127, 127], built
    from the bit pattern.

    2**-127 is a float32 subnormal (bits 0x00400000): `(e + 127) << 23` would give 0 for it,
    and clamping it to 2**-126 halves tiny blocks (P5).
    """
    if dtype == torch.float64:
        return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)
    e = exponent.to(torch.int32)
    return torch.where(e > -127, (e + 127) << 23, 0x00400000).view(torch.float32)


def to_compute(x: torch.Tensor, native_bf16: bool = False) -> Tuple[torch.Tensor, bool]:
    """x in its compute dtype, and whether the result is a private copy we may overwrite."""
    cdtype = compute_dtype(x.dtype, native_bf16)
    if x.dtype == cdtype:
        return x, False
    return x.to(cdtype), True   # exact: every bf16/fp16 value is a float32 value


def _pad_axis(x: torch.Tensor, axis: int, pad: int) -> torch.Tensor:
    """Zero-pad `x` at the end of `axis` (zeros never change a block's amax, P14)."""
    spec = [0, 0] * (x.dim() - 1 - axis) + [0, pad]
    return F.pad(x, spec)


def block_view(t: torch.Tensor, axis: int, size: int):
    """(t zero-padded along `axis` to a multiple of `size`, viewed as [..., nblocks, size, ...];
    the padded length). The short tail becomes a block of its own (P14)."""
    pad = -t.shape[axis] % size
    if pad:
        t = _pad_axis(t, axis, pad)
    # view, not unflatten: Tensor.unflatten is Python code that torch.compile cannot trace
    # under a TorchFunctionMode (a graph break)
    shape = t.shape
    return t.view(*shape[:axis], shape[axis] // size, size, *shape[axis + 1:]), pad


def device_table(tables: dict, key, device: torch.device) -> torch.Tensor:
    """tables[(key, device)], copied from the CPU table once per device (not once per call:
    on an accelerator a host-to-device copy each call would stall the step)."""
    if (key, device) not in tables:
        tables[(key, device)] = tables[(key, torch.device("cpu"))].to(device)
    return tables[(key, device)]
