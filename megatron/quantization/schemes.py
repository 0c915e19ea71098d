"""Named quantization schemes and the per-GEMM configuration they resolve to.

A scheme names which GEMM sites are simulated in low precision:

    bf16              nothing quantized (the high-precision baseline)
    FA_<fmt>          attention QK^T (the "FA" of the original system); PV stays high precision
                      unless --attn-pv-quant is given
    linear_<fmt>      every parallel linear of every transformer layer (QKV, proj, fc1, fc2,
                      MLA down/up projections, MoE experts and shared experts)
    FA_linear_<fmt>   both

with <fmt> one of mxfp8, mxfp4, hifp8 (the seeds' ten schemes) or nvfp4, mxfp6_e2m3, mxfp6_e3m2,
fp8 (FP8 with TransformerEngine's scaling: --fp8-format e4m3/hybrid, --fp8-recipe
tensorwise/delayed/blockwise). At a quantized site each of the three GEMMs (fprop,
dgrad, wgrad) quantizes both of its operands from the high-precision tensors along its own
reduction axis (see gemm.py). Gradient operands (dY) of MXFP8 sites use --mx-grad-format
(E4M3 by default, as NVIDIA's MXFP8 recipe; E5M2 optional); MXFP4 and HiFP8 sites quantize
gradients in their own format. --no-quant-backward keeps dgrad and wgrad in high precision;
--quant-fprop/--quant-dgrad/--quant-wgrad set one GEMM's format at every quantized site (e.g.
wgrad in high precision, as several published recipes do; an explicit backward format wins
over --no-quant-backward). --hifp8-scaling tensor gives every HiFP8 operand a per-tensor
power-of-two scale from its own amax. --quant-stochastic-rounding, --quant-rht and
--quant-weight-2d add the FP4-recipe pieces at every quantized linear site; a named recipe
(--quant-recipe, see recipes.py) or a recipe file (--quant-recipe-file: megatron-core's
RecipeConfig shape, per module path) resolves to the same per-site configuration, and
--first-last-layers-bf16 keeps layers at either end in high precision.

`QuantConfig` is the single resolved decision; `describe()` prints it at start-up.
"""

from __future__ import annotations

import os
import dataclasses
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Optional, Sequence, Tuple

from megatron.quantization.formats import canonical_format
from megatron.quantization.gemm import (
    FP8_RECIPES, HIFP8_SCALINGS, RHT_BLOCKS, Fp8Settings, MatmulQuantConfig, OperandFormats)
from megatron.quantization import layer_lists
from megatron.quantization.recipes import (
    RECIPE_NAMES, STOCHASTIC_ROUNDINGS, STOCHASTIC_SLOTS, RecipeError, RecipeRules,
    bf16_layer_numbers, load_recipe_file, nvfp4_bf16_layers_at_end)

SEED_FORMATS = ("mxfp8", "mxfp4", "hifp8")      # the seeds' ten schemes
ELEMENT_FORMATS = SEED_FORMATS + ("nvfp4", "mxfp6_e2m3", "mxfp6_e3m2", "fp8")
SCHEMES = ("bf16",) + tuple(
    f"{prefix}_{fmt}" for prefix in ("FA", "linear", "FA_linear") for fmt in ELEMENT_FORMATS)
SEED_SCHEMES = ("bf16",) + tuple(       # the experiment matrix's ten
    f"{prefix}_{fmt}" for prefix in ("FA", "linear", "FA_linear") for fmt in SEED_FORMATS)
SITE_KINDS = ("linear", "attn_qk", "attn_pv", "output_layer")
GRAD_FORMATS = ("e4m3", "e5m2")
FP8_FORMATS = ("e4m3", "hybrid")
OVERRIDE_FORMATS = ("none", "mxfp8", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "mxfp6_e2m3",
                    "mxfp6_e3m2", "nvfp4", "fp8_e4m3", "fp8_e5m2", "hifp8")
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
    prefix = next(p for p in ("FA_linear_", "linear_", "FA_") if scheme.startswith(p))
    fmt = scheme[len(prefix):]
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


def _grad_variant(fmt: str, grad_format: str, fp8_format: str = "hybrid") -> str:
    """The format of gradient operands (dY) at a site quantized in `fmt`: MXFP8 per
    --mx-grad-format, FP8 E5M2 under --fp8-format hybrid."""
    if fmt.startswith("mxfp8"):
        return canonical_format(f"mxfp8_{grad_format}")
    if fmt.startswith("fp8_") and fp8_format == "hybrid":
        return "fp8_e5m2"
    return fmt


def site_config(fmt: str, grad_format: str, backward: bool, scale_mode: str,
                hifp8_scaling: str = "none",
                gemm_formats: Optional[Dict[str, str]] = None, *, fp8_format: str = "hybrid",
                **settings) -> MatmulQuantConfig:
    """Per-GEMM formats for one site quantized in `fmt` ('none' -> high precision; 'fp8' ->
    fp8_e4m3, gradients per `fp8_format`).

    `gemm_formats` ({"fprop"|"dgrad"|"wgrad": format or "none"}) overrides the format of that
    GEMM at a quantized site; an explicit backward GEMM format also wins over
    `backward=False`. A site in high precision stays so. `settings` are further
    MatmulQuantConfig fields (stochastic, rht_gemms, rht_block, rht_seed, weight_2d, fp8)."""
    if fmt == "none":
        return NONE
    gemm_formats = gemm_formats or {}
    fmt = "fp8_e4m3" if fmt == "fp8" else canonical_format(fmt)

    def gemm_format(gemm: str) -> str:
        if gemm in gemm_formats:
            return canonical_format(gemm_formats[gemm])
        return fmt if gemm == "fprop" or backward else "none"

    f, d, w = (gemm_format(g) for g in GEMMS)
    return MatmulQuantConfig(
        fprop=OperandFormats(f, f),                              # (X or Q or P, W or K^T or V)
        dgrad=OperandFormats(_grad_variant(d, grad_format, fp8_format), d),  # (dY, W ...)
        wgrad=OperandFormats(w, _grad_variant(w, grad_format, fp8_format)),  # (X ..., dY)
        scale_mode=scale_mode,
        hifp8_scaling=hifp8_scaling,
        **settings,
    )


@dataclass(frozen=True)
class QuantConfig:
    """The resolved quantization decision for every GEMM site of the model.

    A site's config: high precision if its layer is in `skip_layers` (--quant-skip-layers,
    --first-last-layers-bf16); else the config of the first recipe-file matcher its global
    module path matches (`rules`); else the config of its kind."""

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
    recipe: Optional[str] = None                       # --quant-recipe NAME
    rules: Optional[RecipeRules] = field(default=None, compare=False)   # --quant-recipe-file

    def for_site(self, kind: str, layer_number: Optional[int],
                 path: Optional[str] = None) -> MatmulQuantConfig:
        """The config of a site of `kind` in transformer layer `layer_number` (1-based) whose
        global module path is `path` (what recipe-file matchers see)."""
        if kind not in SITE_KINDS:
            raise ValueError(f"unknown site kind {kind!r}; valid: {', '.join(SITE_KINDS)}")
        if layer_number is not None and layer_number in self.skip_layers:
            return NONE
        if self.rules is not None and path is not None:
            matched = self.rules.match(path, layer_number)
            if matched is not None:
                return matched[1]
        return getattr(self, kind)

    @property
    def enabled(self) -> bool:
        return self.rules is not None or any(getattr(self, kind).enabled for kind in SITE_KINDS)

    def describe(self, num_layers: Optional[int] = None) -> str:
        """A readable per-GEMM table of what is quantized, for logs and --quant-check."""
        lines = [f"quantization scheme: {self.scheme}"]
        if self.recipe:
            lines.append(f"  recipe: {self.recipe}")
        for kind in SITE_KINDS:
            lines.extend(describe_site(kind, getattr(self, kind), SITE_TITLES[kind]))
        if self.rules is not None:
            lines.append(f"  recipe file {self.rules.path}: its matchers choose the config of "
                         "each site they match (table per site after the model is built):")
            for key, cfg in self.rules.configs.items():
                lines.extend(describe_site("linear", cfg, f"config {key}", indent="    "))
        if self.attention_impl != "auto":
            lines.append(f"  attention implementation: {self.attention_impl}")
        if self.skip_layers:
            layers = ", ".join(str(n) for n in sorted(self.skip_layers))
            lines.append(f"  layers kept in high precision: {layers}")
        elif num_layers is not None:
            lines.append(f"  applies to all {num_layers} transformer layers")
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


SITE_TITLES = {"linear": "linear layers", "attn_qk": "attention QK^T",
               "attn_pv": "attention PV", "output_layer": "output layer"}
OPERAND_NAMES = {
    "linear": (("input", "weight"), ("grad_output", "weight"), ("input", "grad_output")),
    "output_layer": (("input", "weight"), ("grad_output", "weight"), ("input", "grad_output")),
    "attn_qk": (("query", "key"), ("grad_scores", "key"), ("query", "grad_scores")),
    "attn_pv": (("probs", "value"), ("grad_context", "value"), ("probs", "grad_context")),
}


def config_details(cfg: MatmulQuantConfig) -> str:
    """The settings of a quantized site besides its formats, in a few words."""
    formats = cfg.formats
    details = []
    if any(f.startswith("mx") for f in formats):
        details.append(f"MX scale mode {cfg.scale_mode}")
    if "hifp8" in formats:
        details.append("HiFP8 " + ("per-tensor scaling" if cfg.hifp8_scaling == "tensor"
                                   else "unscaled"))
    if any(f.startswith("fp8_") for f in formats):
        fp8 = cfg.fp8
        text = f"FP8 {fp8.recipe}"
        if fp8.recipe == "delayed":
            text += f" (amax history {fp8.amax_history_len}, {fp8.amax_compute_algo})"
        if fp8.margin:
            text += f", margin {fp8.margin:g}"
        if fp8.pow2_scale:
            text += ", power-of-two scales"
        details.append(text)
    if any(cfg.weight_tiles(f) for f in formats):
        details.append("weights in 2-D tiles")
    if cfg.rht_gemms:
        details.append(f"RHT {cfg.rht_block} on {'/'.join(cfg.rht_gemms)} (seed {cfg.rht_seed})")
    if cfg.stochastic:
        details.append("stochastic rounding of " + ", ".join(sorted(cfg.stochastic)))
    return "; ".join(details)


def describe_site(kind: str, cfg: MatmulQuantConfig, title: str, indent: str = "  "):
    """Lines describing one site's (or one recipe config's) GEMMs and settings."""
    if not cfg.enabled:
        return [f"{indent}{title:<15} high precision"]
    lines = [f"{indent}{title:<15} {config_details(cfg)}"]
    for gemm, (a, b) in zip(GEMMS, OPERAND_NAMES[kind]):
        ops = getattr(cfg, gemm)
        sr = {side for side in ("a", "b") if f"{gemm}.{side}" in cfg.stochastic}
        mark = lambda side, fmt: fmt + (" (SR)" if side in sr and fmt != "none" else "")
        lines.append(f"{indent}  {gemm:<6} {a}: {mark('a', ops.a):<16} {b}: {mark('b', ops.b)}")
    return lines


def parse_layer_list(items: Sequence[str], num_layers: int) -> FrozenSet[int]:
    """--quant-skip-layers: '1', '-1' (last), '2-4' -> 1-based layer numbers."""
    try:
        return layer_lists.parse_layer_list(items, num_layers, "--quant-skip-layers")
    except ValueError as exc:
        raise SchemeError(str(exc)) from None


@dataclass(frozen=True)
class RecipeSettings:
    """The FP4/FP8-recipe settings of build_quant_config (the flags of the same names)."""

    stochastic_rounding: Optional[str] = None          # none | grad | all
    rht_block: Optional[int] = None                    # 0 = off
    rht_gemms: Optional[Tuple[str, ...]] = None        # default ("wgrad",)
    weight_2d: Optional[bool] = None                   # None: on for recipes and FP8 blockwise
    fp8_format: Optional[str] = None                   # e4m3 | hybrid (default hybrid)
    fp8: Fp8Settings = field(default_factory=Fp8Settings)
    recipe: Optional[str] = None                       # a RECIPE_NAMES entry
    recipe_file: Optional[str] = None
    bf16_layers: Optional[Tuple[int, int]] = None      # --first-last-layers-bf16 (start, end)
    seed: int = 0                                      # RHT sign vector


def _named_recipe(name: str, num_layers: int, seed: int):
    """(linear config, default BF16 layers at (start, end)) of a named recipe."""
    if name == "nvfp4":
        cfg = MatmulQuantConfig(
            fprop=OperandFormats("nvfp4", "nvfp4"), dgrad=OperandFormats("nvfp4", "nvfp4"),
            wgrad=OperandFormats("nvfp4", "nvfp4"), stochastic=STOCHASTIC_SLOTS["grad"],
            rht_gemms=("wgrad",), rht_block=16, rht_seed=seed, weight_2d=True)
        return cfg, (0, nvfp4_bf16_layers_at_end(num_layers))
    cfg = MatmulQuantConfig(
        dgrad=OperandFormats("mxfp4", "mxfp4"), wgrad=OperandFormats("mxfp4", "mxfp4"),
        stochastic=frozenset({"dgrad.a", "dgrad.b", "wgrad.a", "wgrad.b"}),
        rht_gemms=("dgrad", "wgrad"), rht_block=64, rht_seed=seed)
    return cfg, (0, 0)


def _attention_variant(cfg: MatmulQuantConfig, notes: list) -> MatmulQuantConfig:
    """An attention site's config from a linear one: no Hadamard transform or weight tiles
    (attention has no weights), and current instead of delayed FP8 scaling (the chunked
    attention path quantizes an operand in pieces, one amax history cannot follow that)."""
    if cfg.fp8.recipe == "delayed" and cfg.enabled:
        notes.append("attention's FP8 operands use current (tensorwise) scaling: delayed scaling "
                     "applies to the linear layers")
        cfg = dataclasses.replace(cfg, fp8=dataclasses.replace(cfg.fp8, recipe="tensorwise"))
    return dataclasses.replace(cfg, rht_gemms=(), weight_2d=False)


def _check_recipe_conflicts(scheme: str, r: RecipeSettings, overrides: Dict[str, object]):
    """A named recipe or a recipe file decides what the per-site flags decide: both at once
    is a contradiction (one line)."""
    source = (f"--quant-recipe {r.recipe}" if r.recipe else
              f"--quant-recipe-file {r.recipe_file}" if r.recipe_file else None)
    if source is None:
        return
    if r.recipe and r.recipe_file:
        raise SchemeError(f"{source} and --quant-recipe-file {r.recipe_file}: give one of them")
    if r.recipe and scheme != "bf16":
        raise SchemeError(f"{source} with --quant-scheme {scheme}: the recipe decides which "
                          "sites are quantized; drop --quant-scheme")
    flags = dict(overrides)
    if r.recipe:
        flags.update({"--quant-stochastic-rounding": r.stochastic_rounding,
                      "--quant-rht": r.rht_block, "--quant-rht-gemms": r.rht_gemms,
                      "--quant-weight-2d": r.weight_2d})
    given = [flag for flag, value in flags.items() if value is not None]
    if given:
        raise SchemeError(f"{source} with {', '.join(given)}: the recipe sets these; drop "
                          f"{'them' if len(given) > 1 else 'it'} (or write a recipe file)")


def build_quant_config(scheme: str, num_layers: int, linear_quant: Optional[str] = None,
                       attn_qk_quant: Optional[str] = None, attn_pv_quant: Optional[str] = None,
                       backward: bool = True, scale_mode: str = "floor", grad_format: str = "e4m3",
                       skip_layers: Sequence[str] = (), output_layer: bool = False,
                       attention_impl: str = "auto", hifp8_scaling: str = "none",
                       gemm_formats: Optional[Dict[str, str]] = None,
                       recipe_settings: Optional[RecipeSettings] = None) -> QuantConfig:
    """Resolve a scheme plus overrides into a QuantConfig (overrides win and are noted).

    `gemm_formats` ({"fprop"|"dgrad"|"wgrad": format}) sets that GEMM's format at every
    quantized site (--quant-fprop/--quant-dgrad/--quant-wgrad); `recipe_settings` the
    FP4/FP8-recipe flags (stochastic rounding, RHT, 2-D weights, FP8 scaling, a named recipe
    or a recipe file, BF16 layers)."""
    r = recipe_settings or RecipeSettings()
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
    _check_recipe_settings(r)
    _check_recipe_conflicts(scheme, r, {
        "--linear-quant": linear_quant, "--attn-qk-quant": attn_qk_quant,
        "--attn-pv-quant": attn_pv_quant,
        **{f"--quant-{g}": f for g, f in gemm_formats.items()}})
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

    fp8 = r.fp8
    fp8_format = r.fp8_format or "hybrid"
    weight_2d = r.weight_2d if r.weight_2d is not None else fp8.recipe == "blockwise"
    settings = dict(
        stochastic=STOCHASTIC_SLOTS[r.stochastic_rounding or "none"],
        rht_gemms=tuple(r.rht_gemms or ("wgrad",)) if r.rht_block else (),
        rht_block=r.rht_block or 16, rht_seed=r.seed, weight_2d=weight_2d, fp8=fp8)

    def make(fmt: str) -> MatmulQuantConfig:
        return site_config(fmt, grad_format, backward, scale_mode, hifp8_scaling, gemm_formats,
                           fp8_format=fp8_format, **settings)

    linear = make(linear_fmt)
    if r.weight_2d and not any(linear.weight_tiles(f) for f in linear.formats):
        notes.append("--quant-weight-2d changes nothing here: only NVFP4 and blockwise FP8 "
                     "weights have 2-D tiles")
    bf16_at = r.bf16_layers
    if r.recipe:
        linear, recipe_bf16 = _named_recipe(r.recipe, num_layers, r.seed)
        bf16_at = bf16_at if bf16_at is not None else recipe_bf16
    rules = None
    if r.recipe_file:
        try:
            rules = load_recipe_file(
                r.recipe_file, r.seed,
                grad_variant=lambda fmt: _grad_variant(fmt, grad_format, fp8_format),
                base_fp8=fp8)
        except RecipeError as exc:
            raise SchemeError(str(exc)) from None
    skip = parse_layer_list(skip_layers, num_layers)
    if bf16_at is not None:
        try:
            skip |= bf16_layer_numbers(num_layers, *bf16_at)
        except RecipeError as exc:
            raise SchemeError(str(exc)) from None
    return QuantConfig(
        scheme=scheme,
        linear=linear,
        attn_qk=_attention_variant(make(qk_fmt), notes),
        attn_pv=_attention_variant(make(pv_fmt), notes),
        output_layer=linear if output_layer else NONE,
        skip_layers=skip,
        notes=tuple(dict.fromkeys(notes)),
        attention_impl=attention_impl,
        recipe=r.recipe,
        rules=rules,
    )


def _check_recipe_settings(r: RecipeSettings) -> None:
    if r.stochastic_rounding is not None and r.stochastic_rounding not in STOCHASTIC_ROUNDINGS:
        raise SchemeError(f"--quant-stochastic-rounding {r.stochastic_rounding!r}; valid: "
                          f"{', '.join(STOCHASTIC_ROUNDINGS)}")
    if r.rht_block is not None and r.rht_block != 0 and r.rht_block not in RHT_BLOCKS:
        raise SchemeError(f"--quant-rht {r.rht_block}: valid blocks are 0 (off), "
                          f"{', '.join(map(str, RHT_BLOCKS))}")
    if r.rht_gemms is not None:
        bad = [g for g in r.rht_gemms if g not in GEMMS]
        if bad:
            raise SchemeError(f"--quant-rht-gemms {' '.join(bad)}: valid GEMMs are "
                              f"{', '.join(GEMMS)}")
        if not r.rht_block:
            raise SchemeError("--quant-rht-gemms needs --quant-rht BLOCK (the transform is off)")
    if r.fp8_format is not None and r.fp8_format not in FP8_FORMATS:
        raise SchemeError(f"--fp8-format {r.fp8_format!r}; valid: {', '.join(FP8_FORMATS)}")
    if r.recipe is not None and r.recipe not in RECIPE_NAMES:
        raise SchemeError(f"--quant-recipe {r.recipe!r}; valid: {', '.join(RECIPE_NAMES)}")
