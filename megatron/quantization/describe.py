"""The start-up table of what is quantized: per site kind and GEMM, its formats and settings
(printed at start-up, by --quant-check, and into capture run files)."""

from __future__ import annotations

from types import MappingProxyType
import dataclasses
from typing import List, Optional

from megatron.quantization.config import (
    GEMMS, RECIPE_SOURCES, SITE_CONCERNS, SITE_KINDS, MatmulQuantConfig, QuantConfig)
from megatron.quantization.gemm import nvfp4_variant

SITE_TITLES = MappingProxyType({"linear": "linear layers", "attn_qk": "attention QK^T",
                                "attn_pv": "attention PV", "output_layer": "output layer"})
OPERAND_NAMES = MappingProxyType({
    "linear": (("input", "weight"), ("grad_output", "weight"), ("input", "grad_output")),
    "output_layer": (("input", "weight"), ("grad_output", "weight"), ("input", "grad_output")),
    "attn_qk": (("query", "key"), ("grad_scores", "key"), ("query", "grad_scores")),
    "attn_pv": (("probs", "value"), ("grad_context", "value"), ("probs", "grad_context")),
})
# Settings the phrases of config_details already say; any other setting of a site concern
# that differs from its default is listed as "<flag> <value>".
_SAID = frozenset({("mx", "scale_mode"), ("mx", "grad_format"), ("hifp8", "scaling"),
         ("hifp8", "saturate"), ("fp8", "format"), ("fp8", "recipe"), ("fp8", "margin"),
         ("fp8", "amax_history_len"), ("fp8", "amax_compute_algo"), ("fp8", "pow2_scale"),
         ("nvfp4", "four_over_six"), ("nvfp4", "four_over_six_err_mode"),
         ("nvfp4", "four_over_six_e4m3_use_256"), ("nvfp4", "row_scaled_activation"),
         ("gemm", "backward_override")})


def config_details(cfg: MatmulQuantConfig) -> str:
    """The settings of a quantized site besides its formats, in a few words."""
    formats = cfg.formats
    details = []
    if any(f.startswith("mx") for f in formats):
        details.append(f"MX scale mode {cfg.mx.scale_mode}")
    if "nvfp4" in formats and cfg.nvfp4.enabled:
        details.append(_nvfp4_phrase(cfg))
    if "hifp8" in formats:
        details.append("HiFP8 " + ("per-tensor scaling" if cfg.hifp8.scaling == "tensor"
                                   else "unscaled"))
    if any(f.startswith("fp8_") for f in formats):
        fp8 = cfg.fp8
        text = f"FP8 {fp8.scaling}"
        if fp8.scaling == "delayed":
            text += f" (amax history {fp8.amax_history_len}, {fp8.amax_compute_algo})"
        if fp8.margin:
            text += f", margin {fp8.margin:g}"
        if fp8.power_of_two:
            text += ", power-of-two scales"
        details.append(text)
    if any(cfg.weight_tiles(f) for f in formats):
        details.append("weights in 2-D tiles")
    if cfg.rht.gemms:
        details.append(f"RHT {cfg.rht.block} on {'/'.join(cfg.rht.gemms)} (seed {cfg.rht.seed})")
    if cfg.stochastic:
        details.append("stochastic rounding of " + ", ".join(sorted(cfg.stochastic)))
    if cfg.dequantized_sources:
        details.append("backward " + " and ".join(sorted(cfg.dequantized_sources)) +
                       " requantized from the forward's dequantized copy")
    if cfg.gemm.backward_override:
        details.append(f"--quant-backward-override {cfg.gemm.backward_override} (the backward "
                       "GEMMs' operands unquantized or the forward's dequantized, dY unquantized)")
    details.extend(_other_settings(cfg))
    return "; ".join(details)


def _nvfp4_phrase(cfg: MatmulQuantConfig) -> str:
    """The NVFP4 variants of a site, e.g. 'NVFP4 4/6 (mae; tensor bound 256) of weights and
    activations, per-token scales of activations'."""
    v, parts = cfg.nvfp4, []
    if v.four_over_six != "none":
        scope = "weights and activations" if v.four_over_six == "all" else v.four_over_six
        bound = {"none": "448", "all": "256"}.get(v.four_over_six_e4m3_use_256,
                                                   f"256 for {v.four_over_six_e4m3_use_256}")
        parts.append(f"4/6 ({v.four_over_six_err_mode}; tensor bound {bound}) of {scope}")
    if v.row_scaled_activation:
        parts.append("per-token scales of activations")
    return "NVFP4 " + ", ".join(parts)


def _operand_marks(kind: str, cfg: MatmulQuantConfig, gemm: str, side: str, name: str) -> str:
    """What besides its format an operand carries in the table: (SR) stochastic rounding,
    (4/6), (rows) per-token scales, (delayed) an amax-history scale."""
    marks = []
    if f"{gemm}.{side}" in cfg.stochastic:
        marks.append("SR")
    if kind in ("linear", "output_layer"):
        variant = nvfp4_variant(cfg, getattr(getattr(cfg, gemm), side), name)
        if "four_over_six" in variant:
            marks.append("4/6")
        if variant.get("row_scaled"):
            marks.append("rows")
    if f"{gemm}.{side}" in cfg.delayed_slots:
        marks.append("delayed")
    return f" ({', '.join(marks)})" if marks else ""


def _other_settings(cfg: MatmulQuantConfig) -> List[str]:
    """'<flag> <value>' for every site-concern setting the phrases above do not cover and
    whose value differs from its default (a setting added to config.py shows up here)."""
    out = []
    for concern in SITE_CONCERNS:
        value = getattr(cfg, concern)
        default = type(value)()
        for f in dataclasses.fields(value):
            if (concern, f.name) in _SAID or getattr(value, f.name) == getattr(default, f.name):
                continue
            name = f.metadata.get("flag") or f.metadata.get("recipe_key") or f.name
            out.append(f"{name} {getattr(value, f.name)}")
    return out


def describe_site(kind: str, cfg: MatmulQuantConfig, title: str, indent: str = "  "):
    """Lines describing one site's (or one recipe config's) GEMMs and settings."""
    if not cfg.enabled:
        return [f"{indent}{title:<15} high precision"]
    lines = [f"{indent}{title:<15} {config_details(cfg)}"]
    for gemm, (a, b) in zip(GEMMS, OPERAND_NAMES[kind]):
        ops = getattr(cfg, gemm)

        def mark(side, fmt, name):
            return fmt if fmt == "none" else fmt + _operand_marks(kind, cfg, gemm, side, name)
        lines.append(f"{indent}  {gemm:<6} {a}: {mark('a', ops.a, a):<16} "
                     f"{b}: {mark('b', ops.b, b)}")
    return lines


def describe_config(quant: QuantConfig, num_layers: Optional[int] = None,
                    precision: Optional[str] = None) -> str:
    """A readable per-GEMM table of what is quantized, for logs and --quant-check; its first
    line says what the run is (`precision`: the run's own, fp32/bf16/fp16, when known)."""
    lines = [headline(quant, precision)]
    if quant.recipe:
        lines.append(f"  recipe: {quant.recipe}: {RECIPE_SOURCES[quant.recipe]}"
                     if quant.recipe in RECIPE_SOURCES else f"  recipe: {quant.recipe}")
    for kind in SITE_KINDS:
        lines.extend(describe_site(kind, getattr(quant, kind), SITE_TITLES[kind]))
    if quant.rules is not None:
        lines.append(f"  recipe file {quant.rules.path}: its matchers choose the config of "
                     "each site they match (table per site after the model is built):")
        for key, cfg in quant.rules.configs.items():
            lines.extend(describe_site("linear", cfg, f"config {key}", indent="    "))
    if quant.backend.attention.impl != "auto":
        lines.append(f"  attention implementation: {quant.backend.attention.impl}")
    if quant.skip_layers:
        layers = ", ".join(str(n) for n in sorted(quant.skip_layers))
        lines.append(f"  layers kept in high precision: {layers}")
    elif num_layers is not None:
        lines.append(f"  applies to all {num_layers} transformer layers")
    if quant.settings.recipe.schedule:
        lines.append("  precision schedule: " + " ".join(quant.settings.recipe.schedule) +
                     " (--quant-schedule; the iteration ranges follow at start-up)")
    lines.extend(f"  note: {note}" for note in quant.notes)
    return "\n".join(lines)


def headline(quant: QuantConfig, precision: Optional[str] = None) -> str:
    """What the run is, in one line: a recipe, a recipe file, a scheme, or nothing quantized
    (then every GEMM runs in the run's precision: scheme bf16 names the unquantized
    reference, whatever the precision)."""
    if quant.recipe:
        return f"quantization: recipe {quant.recipe}"
    if quant.rules is not None:
        elsewhere = f" (scheme {quant.scheme} at the sites it does not match)" \
            if quant.scheme != "bf16" else ""
        return f"quantization: recipe file {quant.rules.path}{elsewhere}"
    if not quant.enabled:
        where = f"{precision}, the run's precision" if precision else "the run's precision"
        return f"quantization: nothing quantized (every GEMM in {where})"
    return f"quantization: scheme {quant.scheme}"


def describe_sites(sites) -> str:
    """One line per quantized GEMM site: its global path, its formats and settings (the
    start-up table of recipe runs)."""
    lines = ["quantized GEMM sites (fprop a/b, dgrad a/b, wgrad a/b):"]
    for s in sites:
        cfg = s.config
        if not cfg.enabled:
            lines.append(f"  {s.state.path:<48} high precision")
            continue
        formats = " | ".join(f"{getattr(cfg, g).a}/{getattr(cfg, g).b}" for g in GEMMS)
        details = config_details(cfg)
        lines.append(f"  {s.state.path:<48} {formats}" + (f"; {details}" if details else ""))
    return "\n".join(lines)
