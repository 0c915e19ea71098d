"""Simulated low-precision GEMMs: exact MX / HiFP8 fake quantization and quantized linears."""

from megatron.quantization.formats import (
    FORMAT_NAMES,
    HIFP8_MAX,
    HIFP8_OVERFLOW,
    MX_BLOCK_SIZE,
    NAN_EXPONENT,
    SCALE_MODES,
    FormatInfo,
    canonical_format,
    compile_enabled,
    fake_quantize,
    fake_quantize_compiled,
    format_info,
    hifp8_scale_exponent,
    hifp8_scaled_fake_quantize,
    mx_shared_exponents,
    set_compile,
    set_kernels,
)
from megatron.quantization.gemm import (
    MatmulQuantConfig,
    OperandFormats,
    quantized_linear,
    quantized_matmul,
)

__all__ = [
    "FORMAT_NAMES", "HIFP8_MAX", "HIFP8_OVERFLOW", "MX_BLOCK_SIZE", "NAN_EXPONENT", "SCALE_MODES",
    "FormatInfo", "canonical_format", "compile_enabled", "fake_quantize", "fake_quantize_compiled",
    "format_info", "hifp8_scale_exponent", "hifp8_scaled_fake_quantize", "mx_shared_exponents", "set_compile",
    "set_kernels",
    "MatmulQuantConfig", "OperandFormats", "quantized_linear", "quantized_matmul",
]
