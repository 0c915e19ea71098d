"""Fused Triton quantize-dequantize kernels, bit for bit equal to the eager formats package.

One kernel per format family; each reads every element once and writes it once (per-tensor
scales add one reading pass: the amax kernel). The kernels compute with integer operations on
the float bits (the few float operations are single IEEE roundings: products and correctly
rounded divisions, no sums a GPU could fuse), so the same code gives the same bits on a GPU
and under Triton's interpreter (TRITON_INTERPRET=1, on the CPU), where the tests run it. The
launch does nothing else on the host: no copies, casts, views or 0-d scale arithmetic (the
per-tensor scales are computed in the kernels).

Covered, for float32 and bf16 inputs, with round to nearest or stochastic rounding (the
kernel reads the uniform numbers eager draws from the caller's generator, so the bits are the
same):
- the MX formats (MXFP8 E4M3/E5M2, MXFP6 E2M3/E3M2, MXFP4 E2M1), every scale rule
  (floor, rceil, ceil, even), any block axis;
- HiFP8 (plain cast and saturating);
- NVFP4 with 16-element blocks along any axis or 16x16 tiles (block_2d), its own or an
  imposed tensor amax;
- for MX and 1-D NVFP4, the random Hadamard transform of the operand along its axis
  (QuantizeCall.rht), computed in the kernel as it loads the operand (kernels/hadamard.py);
- FP8 E4M3/E5M2 with per-tensor current or delayed scaling, or 1x128 / 128x128 blocks, any
  margin, power-of-two scales or not.
NVFP4's 4/6 and row scaling, bf16/fp16 pass-through and float16/float64 inputs are reported
as not covered by `unsupported_reason`, and the caller falls back to the eager implementation
(megatron.quantization.dispatch decides).

Triton is optional: importing this package does not import it; `triton_available()` says
whether it can be imported.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.quantization.kernels.environment import (  # noqa: F401 (public names)
    interpreter_enabled, triton_available)

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
KERNEL_KINDS = ("mx", "hifp8", "nvfp4", "fp8")


def unsupported_reason(kind: str, fmt: str, dtype: torch.dtype, rounding: str,
                       block_2d: bool = False) -> Optional[str]:
    """Why the kernels do not cover this call (None when they do). block_2d (NVFP4's 16x16
    tiles) is covered; the argument stays for callers that pass it."""
    if kind not in KERNEL_KINDS:
        return (f"format {fmt!r} (the Triton kernels cover the MX formats, hifp8, nvfp4 and "
                "fp8)")
    if rounding not in ("nearest", "stochastic"):
        return f"rounding={rounding!r}"
    if dtype not in KERNEL_DTYPES:
        return f"dtype {dtype} (the Triton kernels take float32 and bfloat16)"
    return None


def device_reason(device: torch.device) -> Optional[str]:
    """Why tensors on `device` cannot run the kernels (None when they can)."""
    if not (device.type == "cuda" or (device.type == "cpu" and interpreter_enabled())):
        return (f"a tensor on {device} (the Triton kernels run on CUDA tensors, or on CPU "
                f"tensors under Triton's interpreter, TRITON_INTERPRET=1)")
    if not triton_available():
        return "this installation: triton is not importable (pip install triton)"
    return None


def triton_fake_quantize(x: torch.Tensor, call, noise: Optional[torch.Tensor]) -> torch.Tensor:
    """Quantize-dequantize by the Triton kernel of the format's family: a prepared call
    (formats.QuantizeCall) that unsupported_reason and device_reason accept."""
    if call.kind == "nvfp4":
        from megatron.quantization.kernels.nvfp4 import nvfp4_fake_quantize_triton
        return nvfp4_fake_quantize_triton(x, call.axis, noise, call.amax, call.block_2d,
                                          call.rht)
    if call.kind == "fp8":
        from megatron.quantization.kernels.fp8 import fp8_fake_quantize_triton
        _, scaling, margin, pow2_scale, block, _ = call.options
        return fp8_fake_quantize_triton(x, call.fmt, call.axis, scaling, call.amax, margin,
                                        pow2_scale, block, noise)
    if call.kind == "hifp8":
        from megatron.quantization.kernels.hifp8 import hifp8_fake_quantize_triton
        return hifp8_fake_quantize_triton(x, call.saturate)
    from megatron.quantization.kernels.mx import mx_fake_quantize_triton
    return mx_fake_quantize_triton(x, call.fmt, call.axis, call.scale_mode, noise, call.rht)
