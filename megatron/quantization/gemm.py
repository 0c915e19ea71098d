"""Quantized GEMMs: each of fprop, dgrad and wgrad quantizes its own two operands.

For C = A @ B (A [..., M, K], B [..., K, N]) training runs three GEMMs, each reducing over a
different axis:

    fprop  C  = A @ B      A blocked along K (its last axis),  B along K (its second-to-last)
    dgrad  dA = dC @ B^T   dC blocked along N (its last axis), B along N (its last axis)
    wgrad  dB = A^T @ dC   A blocked along M (second-to-last), dC along M (second-to-last)

MX quantization does not commute with transposition (pitfall P15), so every GEMM quantizes
its operands afresh from the HIGH-PRECISION tensors along its own reduction axis, as
TransformerEngine, torchao and microxcaling do. Only the high-precision operands are saved for
backward. The GEMMs themselves run in the input dtype (bf16 stays bf16, which on hardware
accumulates in fp32).

A linear layer y = x @ W^T + b is the matmul with A = x (all leading token dims flattened to
M) and B = W^T, so its weight [N, K] is blocked along its last axis in fprop and along axis 0
in dgrad, and wgrad blocks dY and x along the flattened token axis.

Observers. When `observer` is given it is called as
`observer(gemm, operand, hp, q, fmt, axis)` for every operand of every GEMM that runs (q=None
for operands kept in high precision) and then for the GEMM's result (q=None, fmt="none",
axis=None). Operand names, in call order:

    quantized_linear   fprop: input, weight, output        dgrad: grad_output, weight, grad_input
                       wgrad: grad_output, input, grad_weight
    quantized_matmul   fprop: a, b, output                 dgrad: grad_output, b, grad_a
                       wgrad: a, grad_output, grad_b

`hp` is the high-precision operand in the caller-visible shape (linear: x [..., K],
weight [N, K], dY [..., N]; matmul: a, b, dC) and `q` has the same shape; `axis` is the
non-negative block axis (the GEMM's reduction axis) in that shape, also reported for
operands kept in high precision. Exception: the wgrad operands of quantized_linear are
reported as the 2-D token-flattened tensors ([M, K] and [M, N], axis 0) they are quantized as.
In every case

    q == quantize_operand(hp, fmt, axis, config)

bit for bit, which is `fake_quantize(hp, fmt, axis=axis, scale_mode=config.scale_mode,
saturate=config.saturate_for(fmt))` except for tensor-scaled HiFP8 operands
(`config.hifp8_scaling == "tensor"`), where it is `hifp8_scaled_fake_quantize(hp,
saturate=...)`. saturate_for is None for every format but HiFP8, so for MX this is the plain
`fake_quantize(hp, fmt, axis=axis, scale_mode=config.scale_mode)`; HiFP8 operands saturate at
+-32768 by default (MatmulQuantConfig.hifp8_saturate), which differs from the plain cast only
for |hp| >= 40960.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron.quantization.formats import (
    SCALE_MODES,
    canonical_format,
    fake_quantize,
    hifp8_scaled_fake_quantize,
)

__all__ = ["OperandFormats", "MatmulQuantConfig", "quantized_matmul", "quantized_linear",
           "matmul_grads", "quantize_operand", "HIFP8_SCALINGS"]

HIFP8_SCALINGS = ("none", "tensor")

Observer = Callable[..., None]


@dataclass(frozen=True)
class OperandFormats:
    """Formats of one GEMM's two operands (canonical names; "none" = high precision)."""

    a: str = "none"
    b: str = "none"

    def __post_init__(self):
        object.__setattr__(self, "a", canonical_format(self.a))
        object.__setattr__(self, "b", canonical_format(self.b))

    @property
    def enabled(self) -> bool:
        return self.a != "none" or self.b != "none"


@dataclass(frozen=True)
class MatmulQuantConfig:
    """Per-GEMM operand formats of one matmul site.

    fprop:  C  = A @ B    (a=A, b=B)
    dgrad:  dA = dC @ B^T (a=dC, b=B)
    wgrad:  dB = A^T @ dC (a=A, b=dC)

    scale_mode is the MX scale rule ("floor" or "rceil"). hifp8_saturate makes HiFP8 operands
    saturate at +-32768 instead of overflowing to +-Inf (the training behaviour: one outlier
    must not turn a whole GEMM into Inf/NaN). hifp8_scaling "tensor" gives every HiFP8
    operand one power-of-two scale from its own amax (formats.hifp8_scaled_fake_quantize);
    "none" casts it unscaled.
    """

    fprop: OperandFormats = OperandFormats()
    dgrad: OperandFormats = OperandFormats()
    wgrad: OperandFormats = OperandFormats()
    scale_mode: str = "floor"
    hifp8_saturate: bool = True
    hifp8_scaling: str = "none"

    def __post_init__(self):
        for gemm in ("fprop", "dgrad", "wgrad"):
            ops = getattr(self, gemm)
            if not isinstance(ops, OperandFormats):
                raise TypeError(f"MatmulQuantConfig.{gemm} must be OperandFormats, "
                                f"got {type(ops).__name__}")
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(f"unknown MX scale_mode {self.scale_mode!r}; valid modes: "
                             f"{', '.join(SCALE_MODES)}")
        if self.hifp8_scaling not in HIFP8_SCALINGS:
            raise ValueError(f"unknown HiFP8 scaling {self.hifp8_scaling!r}; valid: "
                             f"{', '.join(HIFP8_SCALINGS)}")

    @property
    def enabled(self) -> bool:
        """True when any operand of any GEMM is quantized."""
        return self.fprop.enabled or self.dgrad.enabled or self.wgrad.enabled

    def saturate_for(self, fmt: str) -> Optional[bool]:
        """The fake_quantize `saturate` argument this config uses for `fmt`."""
        return self.hifp8_saturate if fmt == "hifp8" else None

    def tensor_scaled(self, fmt: str) -> bool:
        """True when operands in `fmt` get a per-tensor scale (HiFP8 with scaling "tensor")."""
        return fmt == "hifp8" and self.hifp8_scaling == "tensor"


def quantize_operand(hp: torch.Tensor, fmt: str, axis: int, config: MatmulQuantConfig,
                     scale_exponent=None) -> torch.Tensor:
    """How `config` quantizes one GEMM operand in `fmt` blocked along `axis`: the single
    definition the GEMMs use and captures are reproduced with. `scale_exponent` imposes the
    per-tensor scale of a tensor-scaled operand (see formats.hifp8_scaled_fake_quantize)."""
    if config.tensor_scaled(fmt):
        return hifp8_scaled_fake_quantize(hp, saturate=config.saturate_for(fmt),
                                          scale_exponent=scale_exponent)
    return fake_quantize(hp, fmt, axis=axis, scale_mode=config.scale_mode,
                         saturate=config.saturate_for(fmt))


def _operand(observer, config, gemm, name, hp, fmt, axis, scales=None):
    """Quantize one GEMM operand (or pass it through) and report it. `scales` maps
    (gemm, name) to imposed per-tensor scale exponents (operands cut into chunks)."""
    q = None
    scale = scales.get((gemm, name)) if scales and fmt != "none" else None
    if fmt != "none":
        q = quantize_operand(hp, fmt, axis, config, scale)
    if observer is not None:
        if scale is not None and config.tensor_scaled(fmt):
            observer(gemm, name, hp, q, fmt, axis, scale_exponent=scale)
        else:
            observer(gemm, name, hp, q, fmt, axis)
    return hp if q is None else q


def _result(observer, gemm, name, value):
    if observer is not None:
        observer(gemm, name, value, None, "none", None)
    return value


class _QuantizedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, config, observer, scales):
        ctx.save_for_backward(a, b)
        ctx.config, ctx.observer, ctx.scales = config, observer, scales
        qa = _operand(observer, config, "fprop", "a", a, config.fprop.a, a.dim() - 1, scales)
        qb = _operand(observer, config, "fprop", "b", b, config.fprop.b, b.dim() - 2, scales)
        return _result(observer, "fprop", "output", torch.matmul(qa, qb))

    @staticmethod
    def backward(ctx, grad_c):
        a, b = ctx.saved_tensors
        grad_a, grad_b = matmul_grads(a, b, grad_c, ctx.config, ctx.observer,
                                      *ctx.needs_input_grad[:2], scales=ctx.scales)
        return grad_a, grad_b, None, None, None


def matmul_grads(a, b, grad_c, config: MatmulQuantConfig, observer=None, need_a: bool = True,
                 need_b: bool = True, scales=None):
    """(dA, dB) of C = A @ B: the dgrad and wgrad GEMMs quantized_matmul's backward runs."""
    grad_a = grad_b = None
    if need_a:
        qg = _operand(observer, config, "dgrad", "grad_output", grad_c, config.dgrad.a,
                      grad_c.dim() - 1, scales)
        qb = _operand(observer, config, "dgrad", "b", b, config.dgrad.b, b.dim() - 1, scales)
        grad_a = _result(observer, "dgrad", "grad_a", torch.matmul(qg, qb.transpose(-1, -2)))
    if need_b:
        qa = _operand(observer, config, "wgrad", "a", a, config.wgrad.a, a.dim() - 2, scales)
        qg = _operand(observer, config, "wgrad", "grad_output", grad_c, config.wgrad.b,
                      grad_c.dim() - 2, scales)
        grad_b = _result(observer, "wgrad", "grad_b", torch.matmul(qa.transpose(-1, -2), qg))
    return grad_a, grad_b


class _QuantizedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, config, observer):
        ctx.save_for_backward(x, weight)
        ctx.config, ctx.observer = config, observer
        qx = _operand(observer, config, "fprop", "input", x, config.fprop.a, x.dim() - 1)
        qw = _operand(observer, config, "fprop", "weight", weight, config.fprop.b, 1)
        return _result(observer, "fprop", "output", F.linear(qx, qw, bias))

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        config, observer = ctx.config, ctx.observer
        n, k = weight.shape
        grad_x = grad_w = grad_bias = None
        if ctx.needs_input_grad[0]:
            # dX = dY @ W: reduction over N, the last axis of dY and axis 0 of W.
            qg = _operand(observer, config, "dgrad", "grad_output", grad_y, config.dgrad.a,
                          grad_y.dim() - 1)
            qw = _operand(observer, config, "dgrad", "weight", weight, config.dgrad.b, 0)
            grad_x = _result(observer, "dgrad", "grad_input", torch.matmul(qg, qw))
        if ctx.needs_input_grad[1]:
            # dW = dY^T @ X: reduction over all tokens, flattened to one M axis.
            g2, x2 = grad_y.reshape(-1, n), x.reshape(-1, k)
            qg = _operand(observer, config, "wgrad", "grad_output", g2, config.wgrad.b, 0)
            qx = _operand(observer, config, "wgrad", "input", x2, config.wgrad.a, 0)
            grad_w = _result(observer, "wgrad", "grad_weight", torch.matmul(qg.t(), qx))
        if ctx.needs_input_grad[2]:
            grad_bias = grad_y.reshape(-1, n).sum(0)
        return grad_x, grad_w, grad_bias, None, None


def quantized_matmul(a: torch.Tensor, b: torch.Tensor, config: MatmulQuantConfig,
                     observer: Optional[Observer] = None, scales=None) -> torch.Tensor:
    """a @ b with every GEMM's operands quantized as `config` says.

    a [..., M, K] and b [..., K, N] must have the same leading batch dims (no broadcasting:
    a broadcast operand's wgrad would quantize per batch entry, not per GEMM). `scales` maps
    (gemm, operand) -- ("fprop", "a"), ("dgrad", "grad_output"), ... -- to the per-tensor
    scale exponent a tensor-scaled operand must use, for a GEMM that is one piece of a
    larger one (chunked attention); other operands derive their scales themselves.
    """
    if not config.enabled and observer is None:
        return torch.matmul(a, b)
    if a.dim() < 2 or b.dim() < 2 or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"quantized_matmul needs a [..., M, K] and b [..., K, N] with the same "
                         f"batch dims, got {tuple(a.shape)} and {tuple(b.shape)}")
    return _QuantizedMatmul.apply(a, b, config, observer, scales)


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     config: MatmulQuantConfig,
                     observer: Optional[Observer] = None) -> torch.Tensor:
    """y = x @ weight^T + bias with every GEMM's operands quantized as `config` says.

    x [..., K] (any number of leading token dims), weight [N, K], bias [N] or None. Disabled
    and unobserved, this is exactly torch.nn.functional.linear.
    """
    if not config.enabled and observer is None:
        return F.linear(x, weight, bias)
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"quantized_linear needs x [..., K] and weight [N, K], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    return _QuantizedLinear.apply(x, weight, bias, config, observer)
