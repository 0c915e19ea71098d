"""The one rule that picks how a quantization and a core-attention call run.

Every implementation gives the same bits (NaN payloads aside); they differ in speed and in what
they cover. The kernel mode is a setting of the model's quantization config
(BackendSettings.kernels, --quant-kernels), handed to these functions by the GEMM sites; it is
never a process global.

Quantization (`quantize_backend`, used by `fake_quantize`):

    "auto"     the fused Triton kernels (megatron.quantization.kernels) for CUDA tensors when
               triton is importable and the kernels cover the call (MX formats, HiFP8, NVFP4
               in 1-D blocks or 16x16 tiles, FP8 per tensor or per block; float32/bf16),
               else eager PyTorch;
    "triton"   the Triton kernels, or a ValueError naming the format, option, dtype or device
               they do not cover (CPU tensors need Triton's interpreter, TRITON_INTERPRET=1);
    "compile"  eager PyTorch through torch.compile (kernels/compiled.py; a RuntimeError rather
               than a silent eager fallback past its graph limit);
    "eager"    formats.fake_quantize's own code, the definition.

Core attention (`attention_path`, used by attention.QuantDotProductAttention and by the memory
estimate, which asks it as a GPU would be asked):

    "sdpa"       nothing in attention is quantized or observed: PyTorch's fused kernels;
    "reference"  the unfused full-score path: an observer needs whole operands, the softmax
                 has dropout, sinks or layer scaling, the mask has another shape, an operand
                 is delayed-scaled (FP8 attention's P and dS), or --quant-attention-impl
                 unfused;
    "triton"     the fused quantized-attention kernels (kernels/attention.py), under the same
                 modes as above: "auto" on CUDA where they cover the call, "triton" wherever
                 they run (a ValueError for what they do not cover); never for observed calls;
    "chunked"    the exact linear-memory chunks in PyTorch (everything else).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from megatron.quantization import formats
from megatron.quantization import kernels as triton_kernels
from megatron.quantization.config import KERNEL_MODES, MatmulQuantConfig, SettingError

BACKENDS = ("triton", "compile", "eager")
ATTENTION_PATHS = ("sdpa", "reference", "triton", "chunked")


def check_kernel_mode(mode: str) -> str:
    if mode not in KERNEL_MODES:
        raise SettingError(f"unknown kernel mode {mode!r}; valid: {', '.join(KERNEL_MODES)}")
    return mode


# -- quantization --------------------------------------------------------------------------------

def quantize_backend(x: torch.Tensor, call: formats.QuantizeCall, mode: str) -> str:
    """Which implementation runs a prepared call under kernel mode `mode`: one of BACKENDS."""
    check_kernel_mode(mode)
    if mode == "eager":
        return mode
    if call.nvfp4_form != formats.PLAIN:
        # 4/6's two candidates and row scaling exist in the eager implementation only.
        if mode in ("triton", "compile"):
            raise ValueError(f"kernel mode {mode!r} does not cover NVFP4 4/6 or row scaling; "
                             "use kernel mode 'auto' or 'eager' for them")
        return "eager"
    if mode == "compile":
        return mode
    if not _asks_for_kernels(x, mode):
        return "eager"
    reason = (triton_kernels.unsupported_reason(call.kind, call.fmt, x.dtype, call.rounding,
                                         call.block_2d)
              or triton_kernels.device_reason(x.device))
    if reason is None:
        return "triton"
    if mode == "triton":
        raise ValueError(f"kernel mode 'triton' does not cover {reason}; use kernel mode "
                         "'auto' to fall back to eager PyTorch for it")
    return "eager"


def _asks_for_kernels(x: torch.Tensor, mode: str) -> bool:
    """Whether kernel mode `mode` asks for the Triton kernels for x: "triton" anywhere, "auto"
    on CUDA tensors."""
    return mode == "triton" or (mode == "auto" and x.device.type == "cuda")


def fake_quantize(x: torch.Tensor, fmt: str, axis: int = -1, scale_mode: str = "floor",
                  saturate: Optional[bool] = None, *, kernels: str = "auto",
                  **options) -> torch.Tensor:
    """formats.fake_quantize (same arguments, same bits) run by the implementation that kernel
    mode `kernels` picks (quantize_backend)."""
    check_kernel_mode(kernels)
    call = formats.prepare_call(x, fmt, axis, scale_mode, saturate, **options)
    if call.fmt == "none":
        return x
    if x.numel() == 0:
        return x.clone()
    backend = quantize_backend(x, call, kernels)
    with torch.no_grad():
        noise = formats.draw_noise(x, call)
        if backend == "triton":
            return triton_kernels.triton_fake_quantize(x, call, noise)
        if backend == "compile":     # the graphs quantize; a transform runs before them
            from megatron.quantization.kernels.compiled import compiled_fake_quantize
            return compiled_fake_quantize(formats.rotated(x, call),
                                          dataclasses.replace(call, rht=None), noise)
        return formats.quantize(x, call, noise)


def amax_writer(x: torch.Tensor, mode: str):
    """How a delayed-scaling history records max |x| under kernel mode `mode`: the amax
    kernel, reducing straight into the history's entry, where the quantization kernels would
    run x (None: the eager reduction, delayed_scaling.AmaxHistories.step's default). The
    same value either way."""
    check_kernel_mode(mode)
    if not _asks_for_kernels(x, mode):
        return None
    if x.dtype not in triton_kernels.KERNEL_DTYPES or triton_kernels.device_reason(x.device):
        return None
    from megatron.quantization.kernels.amax import tensor_amax
    return lambda t, out: tensor_amax(t.contiguous(), out=out)


# -- core attention ----------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionCall:
    """What decides the path of one core-attention call."""

    impl: str                       # AttentionSettings.impl: "auto" or "unfused"
    plain_softmax: bool             # no dropout RNG, attention sinks or query-key scaling
    row_mask: bool                  # no mask tensor, or one of shape [b or 1, 1, sq, sk]
    quantized: bool                 # QK^T or PV quantizes an operand
    observed: bool                  # an observer watches QK^T or PV
    whole: bool                     # ... and needs whole operands (tensor capture)
    device: torch.device
    dtype: torch.dtype
    head_dim: int
    value_dim: int
    mask_tensor: bool               # an explicit mask tensor (not the implicit causal one)
    softmax_in_fp32: bool           # the softmax computes in fp32
    qk_config: MatmulQuantConfig
    pv_config: MatmulQuantConfig


@dataclass(frozen=True)
class AttentionPath:
    """The path an attention call takes (one of ATTENTION_PATHS) and why."""

    name: str
    reason: str


def attention_path(call: AttentionCall, mode: str) -> AttentionPath:
    """The path of `call` under kernel mode `mode` (see the module docstring)."""
    check_kernel_mode(mode)
    linear = call.impl == "auto" and call.plain_softmax
    if linear and not call.quantized and not call.observed:
        return AttentionPath("sdpa", "nothing in attention is quantized or observed")
    if call.whole:
        return AttentionPath("reference", "an observer needs whole operands")
    if call.impl != "auto":
        return AttentionPath("reference", f"--quant-attention-impl {call.impl}")
    if not call.plain_softmax:
        return AttentionPath("reference", "dropout, attention sinks or query-key layer scaling")
    if not call.row_mask:
        return AttentionPath("reference", "a mask of another shape than [b or 1, 1, sq, sk]")
    if any(cfg.delayed(fmt) for cfg in (call.qk_config, call.pv_config) for fmt in cfg.formats):
        return AttentionPath("reference", "delayed-scaled operands (the chunked path would "
                                          "step their amax histories once per chunk)")
    reason = _triton_attention_reason(call, mode)
    if reason is None:
        return AttentionPath("triton", "the fused Triton kernels cover the call")
    return AttentionPath("chunked", reason)


def _triton_attention_reason(call: AttentionCall, mode: str) -> Optional[str]:
    """Why the fused quantized-attention kernels do not run `call` (None when they do)."""
    if mode not in ("auto", "triton"):
        return f"--quant-kernels {mode}"
    if call.observed:        # the observers see the operands; the kernels keep P, dS in tiles
        return "an observer watches the attention GEMMs"
    if mode == "auto" and call.device.type != "cuda":
        return f"a tensor on {call.device} (--quant-kernels auto runs the kernels on CUDA)"
    reason = _attention_kernel_reason(call)
    if reason is not None and mode == "triton":
        raise ValueError(f"kernel mode 'triton' does not cover this quantized attention: "
                         f"{reason}; use --quant-kernels auto to run it on the chunked path")
    return reason


def _attention_kernel_reason(call: AttentionCall) -> Optional[str]:
    if not triton_kernels.triton_available():
        return "this installation: triton is not importable (pip install triton)"
    from megatron.quantization.kernels.attention import unsupported_reason
    return (unsupported_reason(call.qk_config, call.pv_config, call.dtype, call.head_dim,
                               call.value_dim, mask_tensor=call.mask_tensor,
                               softmax_in_fp32=call.softmax_in_fp32)
            or triton_kernels.device_reason(call.device))
