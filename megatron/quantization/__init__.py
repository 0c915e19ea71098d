"""Simulated low-precision GEMMs: exact fake quantization, quantized GEMMs and layers.

`fake_quantize` here is formats.fake_quantize (the definition) run by the implementation the
kernel mode picks (dispatch.py); the settings live in config.py, their resolution into per-site
configs in schemes.py and recipes.py.
"""

from megatron.quantization.config import (
    MatmulQuantConfig,
    OperandFormats,
    QuantConfig,
    QuantSettings,
)
from megatron.quantization.dispatch import fake_quantize
from megatron.quantization.formats import (
    FORMAT_NAMES,
    HIFP8_MAX,
    HIFP8_OVERFLOW,
    MX_BLOCK_SIZE,
    NAN_EXPONENT,
    SCALE_MODES,
    FormatInfo,
    canonical_format,
    format_info,
    hifp8_scale_exponent,
    hifp8_scaled_fake_quantize,
    mx_shared_exponents,
)
from megatron.quantization.gemm import quantized_linear, quantized_matmul

__all__ = [
    "FORMAT_NAMES", "HIFP8_MAX", "HIFP8_OVERFLOW", "MX_BLOCK_SIZE", "NAN_EXPONENT", "SCALE_MODES",
    "FormatInfo", "canonical_format", "fake_quantize", "format_info", "hifp8_scale_exponent",
    "hifp8_scaled_fake_quantize", "mx_shared_exponents",
    "MatmulQuantConfig", "OperandFormats", "QuantConfig", "QuantSettings",
    "quantized_linear", "quantized_matmul",
]
