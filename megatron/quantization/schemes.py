"""Named quantization schemes and the per-GEMM configuration they resolve to.

A scheme names which GEMM sites are simulated in low precision:

    bf16              nothing quantized (the high-precision baseline)
    FA_<fmt>          attention QK^T (the "FA" of the original system); PV stays high precision
                      unless --attn-pv-quant is given
    linear_<fmt>      every parallel linear of every transformer layer (QKV, proj, fc1, fc2,
                      MLA down/up projections, MoE experts and shared experts)
    FA_linear_<fmt>   both

with <fmt> one of mxfp8, mxfp4, hifp8. At a quantized site each of the three GEMMs (fprop,
dgrad, wgrad) quantizes both of its operands from the high-precision tensors along its own
reduction axis (see gemm.py). Gradient operands (dY) of MXFP8 sites use --mx-grad-format
(E4M3 by default, as NVIDIA's MXFP8 recipe; E5M2 optional); MXFP4 and HiFP8 sites quantize
gradients in their own format. --no-quant-backward keeps dgrad and wgrad in high precision;
--quant-fprop/--quant-dgrad/--quant-wgrad set one GEMM's format at every quantized site (e.g.
wgrad in high precision, as several published recipes do; an explicit backward format wins
over --no-quant-backward). --hifp8-scaling tensor gives every HiFP8 operand a per-tensor
power-of-two scale from its own amax.

`QuantConfig` is the single resolved decision; `describe()` prints it at start-up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Optional, Sequence

from megatron.quantization.formats import canonical_format
from megatron.quantization.gemm import HIFP8_SCALINGS, MatmulQuantConfig, OperandFormats
from megatron.quantization import layer_lists

ELEMENT_FORMATS = ("mxfp8", "mxfp4", "hifp8")
SCHEMES = ("bf16",) + tuple(
    f"{prefix}_{fmt}" for prefix in ("FA", "linear", "FA_linear") for fmt in ELEMENT_FORMATS)
SITE_KINDS = ("linear", "attn_qk", "attn_pv", "output_layer")
GRAD_FORMATS = ("e4m3", "e5m2")
OVERRIDE_FORMATS = ("none", "mxfp8", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "hifp8")
ENV_SCHEME = "CUSTOM_QUANT_TYPE"
ATTENTION_IMPLS = ("auto", "unfused")
GEMMS = ("fprop", "dgrad", "wgrad")

NONE = MatmulQuantConfig()


class SchemeError(ValueError):
    """An unknown scheme or format name."""


def scheme_formats(scheme: str):
    """(linear format, attention QK format) of a named scheme; 'none' where not quantized."""
    if scheme not in SCHEMES:
        raise SchemeError(f"unknown quantization scheme {scheme!r}; valid: {', '.join(SCHEMES)}")
    if scheme == "bf16":
        return "none", "none"
    prefix, fmt = scheme.rsplit("_", 1)
    return (fmt if "linear" in prefix else "none"), (fmt if "FA" in prefix else "none")


def scheme_from_env(environ=os.environ) -> str:
    """Default scheme seeded from CUSTOM_QUANT_TYPE (the original system's variable).

    A scheme name is taken as is; a bare element format (mxfp8, mxfp4, hifp8) means what it
    meant there: linear layers and attention both quantized (FA_linear_<fmt>).
    """
    value = environ.get(ENV_SCHEME, "").strip()
    if not value:
        return "bf16"
    if value in SCHEMES:
        return value
    if value in ELEMENT_FORMATS:
        return f"FA_linear_{value}"
    raise SchemeError(f"{ENV_SCHEME}={value!r} is not a quantization scheme; valid: "
                      f"{', '.join(SCHEMES + ELEMENT_FORMATS)}")


def _grad_variant(fmt: str, grad_format: str) -> str:
    """The format of gradient operands (dY) at a site quantized in `fmt`."""
    return canonical_format(f"mxfp8_{grad_format}") if fmt.startswith("mxfp8") else fmt


def site_config(fmt: str, grad_format: str, backward: bool, scale_mode: str,
                hifp8_scaling: str = "none",
                gemm_formats: Optional[Dict[str, str]] = None) -> MatmulQuantConfig:
    """Per-GEMM formats for one site quantized in `fmt` ('none' -> high precision).

    `gemm_formats` ({"fprop"|"dgrad"|"wgrad": format or "none"}) overrides the format of that
    GEMM at a quantized site; an explicit backward GEMM format also wins over
    `backward=False`. A site in high precision stays so."""
    if fmt == "none":
        return NONE
    gemm_formats = gemm_formats or {}
    fmt = canonical_format(fmt)

    def gemm_format(gemm: str) -> str:
        if gemm in gemm_formats:
            return canonical_format(gemm_formats[gemm])
        return fmt if gemm == "fprop" or backward else "none"

    f, d, w = (gemm_format(g) for g in GEMMS)
    return MatmulQuantConfig(
        fprop=OperandFormats(f, f),                              # (X or Q or P, W or K^T or V)
        dgrad=OperandFormats(_grad_variant(d, grad_format), d),  # (dY, W ...)
        wgrad=OperandFormats(w, _grad_variant(w, grad_format)),  # (X ..., dY)
        scale_mode=scale_mode,
        hifp8_scaling=hifp8_scaling,
    )


@dataclass(frozen=True)
class QuantConfig:
    """The resolved quantization decision for every GEMM site of the model."""

    scheme: str = "bf16"
    linear: MatmulQuantConfig = NONE
    attn_qk: MatmulQuantConfig = NONE
    attn_pv: MatmulQuantConfig = NONE
    output_layer: MatmulQuantConfig = NONE
    skip_layers: FrozenSet[int] = field(default_factory=frozenset)
    notes: tuple = ()
    # Core attention: "auto" (fused kernel, or linear-memory chunks when quantized) or
    # "unfused" (full scores, the reference path; for checks and benchmarks).
    attention_impl: str = "auto"

    def for_site(self, kind: str, layer_number: Optional[int]) -> MatmulQuantConfig:
        """The config of a site of `kind` in transformer layer `layer_number` (1-based)."""
        if kind not in SITE_KINDS:
            raise ValueError(f"unknown site kind {kind!r}; valid: {', '.join(SITE_KINDS)}")
        if layer_number is not None and layer_number in self.skip_layers:
            return NONE
        return getattr(self, kind)

    @property
    def enabled(self) -> bool:
        return any(getattr(self, kind).enabled for kind in SITE_KINDS)

    def describe(self, num_layers: Optional[int] = None) -> str:
        """A readable per-GEMM table of what is quantized, for logs and --quant-check."""
        names = {
            "linear": ("linear layers", ("input", "weight"), ("grad_output", "weight"),
                       ("grad_output", "input")),
            "attn_qk": ("attention QK^T", ("query", "key"), ("grad_scores", "key"),
                        ("query", "grad_scores")),
            "attn_pv": ("attention PV", ("probs", "value"), ("grad_context", "value"),
                        ("probs", "grad_context")),
            "output_layer": ("output layer", ("input", "weight"), ("grad_output", "weight"),
                             ("grad_output", "input")),
        }
        lines = [f"quantization scheme: {self.scheme}"]
        for kind in SITE_KINDS:
            cfg = getattr(self, kind)
            title, fprop, dgrad, wgrad = names[kind]
            if not cfg.enabled:
                lines.append(f"  {title:<15} high precision")
                continue
            formats = {getattr(getattr(cfg, g), side) for g in GEMMS for side in ("a", "b")}
            details = [f"MX scale mode {cfg.scale_mode}"] if any(
                f.startswith("mx") for f in formats) else []
            if "hifp8" in formats:
                details.append("HiFP8 " + ("per-tensor scaling" if cfg.hifp8_scaling == "tensor"
                                           else "unscaled"))
            lines.append(f"  {title:<15} {'; '.join(details)}")
            for gemm, (a, b) in (("fprop", fprop), ("dgrad", dgrad), ("wgrad", wgrad)):
                ops = getattr(cfg, gemm)
                lines.append(f"    {gemm:<6} {a}: {ops.a:<11} {b}: {ops.b}")
        if self.attention_impl != "auto":
            lines.append(f"  attention implementation: {self.attention_impl}")
        if self.skip_layers:
            layers = ", ".join(str(n) for n in sorted(self.skip_layers))
            lines.append(f"  layers kept in high precision: {layers}")
        elif num_layers is not None:
            lines.append(f"  applies to all {num_layers} transformer layers")
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


def parse_layer_list(items: Sequence[str], num_layers: int) -> FrozenSet[int]:
    """--quant-skip-layers: '1', '-1' (last), '2-4' -> 1-based layer numbers."""
    try:
        return layer_lists.parse_layer_list(items, num_layers, "--quant-skip-layers")
    except ValueError as exc:
        raise SchemeError(str(exc)) from None


def build_quant_config(scheme: str, num_layers: int, linear_quant: Optional[str] = None,
                       attn_qk_quant: Optional[str] = None, attn_pv_quant: Optional[str] = None,
                       backward: bool = True, scale_mode: str = "floor", grad_format: str = "e4m3",
                       skip_layers: Sequence[str] = (), output_layer: bool = False,
                       attention_impl: str = "auto", hifp8_scaling: str = "none",
                       gemm_formats: Optional[Dict[str, str]] = None) -> QuantConfig:
    """Resolve a scheme plus overrides into a QuantConfig (overrides win and are noted).

    `gemm_formats` ({"fprop"|"dgrad"|"wgrad": format}) sets that GEMM's format at every
    quantized site (--quant-fprop/--quant-dgrad/--quant-wgrad)."""
    gemm_formats = {g: f for g, f in (gemm_formats or {}).items() if f is not None}
    for gemm, fmt in gemm_formats.items():
        if gemm not in GEMMS:
            raise SchemeError(f"unknown GEMM {gemm!r}; valid: {', '.join(GEMMS)}")
        if fmt not in OVERRIDE_FORMATS:
            raise SchemeError(f"--quant-{gemm} {fmt!r} is not a format; valid: "
                              f"{', '.join(OVERRIDE_FORMATS)}")
    if hifp8_scaling not in HIFP8_SCALINGS:
        raise SchemeError(f"unknown HiFP8 scaling {hifp8_scaling!r}; valid: "
                          f"{', '.join(HIFP8_SCALINGS)}")
    if attention_impl not in ATTENTION_IMPLS:
        raise SchemeError(f"unknown attention implementation {attention_impl!r}; valid: "
                          f"{', '.join(ATTENTION_IMPLS)}")
    if grad_format not in GRAD_FORMATS:
        raise SchemeError(f"unknown gradient format {grad_format!r}; valid: {', '.join(GRAD_FORMATS)}")
    linear_fmt, qk_fmt = scheme_formats(scheme)
    pv_fmt = "none"
    notes = []
    for label, override, current in (("--linear-quant", linear_quant, linear_fmt),
                                     ("--attn-qk-quant", attn_qk_quant, qk_fmt),
                                     ("--attn-pv-quant", attn_pv_quant, pv_fmt)):
        if override is not None and override not in OVERRIDE_FORMATS:
            raise SchemeError(f"{label} {override!r} is not a format; valid: "
                              f"{', '.join(OVERRIDE_FORMATS)}")
        if override is not None and override != current:
            notes.append(f"{label} {override} overrides scheme {scheme} ({current})")
    linear_fmt = linear_quant if linear_quant is not None else linear_fmt
    qk_fmt = attn_qk_quant if attn_qk_quant is not None else qk_fmt
    pv_fmt = attn_pv_quant if attn_pv_quant is not None else pv_fmt
    for gemm, fmt in gemm_formats.items():
        notes.append(f"--quant-{gemm} {fmt}: the {gemm} GEMM of every quantized site in "
                     f"{'high precision' if fmt == 'none' else fmt}")
    if all(f == "none" for f in (linear_fmt, qk_fmt, pv_fmt)) and gemm_formats:
        notes.append(f"{', '.join('--quant-' + g for g in gemm_formats)} change nothing: no "
                     f"site is quantized by scheme {scheme}")
    if hifp8_scaling != "none":
        notes.append(f"--hifp8-scaling {hifp8_scaling}: every HiFP8 operand gets one "
                     "power-of-two scale from its own amax (its largest magnitude in [8, 16))")

    def make(fmt: str) -> MatmulQuantConfig:
        return site_config(fmt, grad_format, backward, scale_mode, hifp8_scaling, gemm_formats)

    return QuantConfig(
        scheme=scheme,
        linear=make(linear_fmt),
        attn_qk=make(qk_fmt),
        attn_pv=make(pv_fmt),
        output_layer=make(linear_fmt) if output_layer else NONE,
        skip_layers=parse_layer_list(skip_layers, num_layers),
        notes=tuple(notes),
        attention_impl=attention_impl,
    )
