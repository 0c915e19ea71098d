"""Named schemes and recipes resolved into the per-site QuantConfig: `resolve(settings, ...)`.

A scheme names which GEMM sites are simulated in low precision:

    bf16              nothing quantized (the high-precision baseline)
    FA_<fmt>          attention QK^T (the "FA" of the original system); PV stays high precision
                      unless --attn-pv-quant is given
    linear_<fmt>      every parallel linear of every transformer layer (QKV, proj, fc1, fc2,
                      MLA down/up projections, MoE experts and shared experts)
    FA_linear_<fmt>   both

with <fmt> one of mxfp8, mxfp4, hifp8 (the seeds' ten schemes) or nvfp4, mxfp6_e2m3, mxfp6_e3m2,
fp8 (FP8 with TransformerEngine's scaling: --fp8-format e4m3/hybrid, --fp8-recipe
tensorwise/delayed/blockwise). At a quantized site each of the three GEMMs (fprop, dgrad,
wgrad) quantizes both of its operands from the high-precision tensors along its own reduction
axis (see gemm.py). Gradient operands (dY) of MXFP8 sites use --mx-grad-format (E4M3 by
default, as NVIDIA's MXFP8 recipe; E5M2 optional); MXFP4 and HiFP8 sites quantize gradients in
their own format. --no-quant-backward keeps dgrad and wgrad in high precision;
--quant-fprop/--quant-dgrad/--quant-wgrad set one GEMM's format at every quantized site (an
explicit backward format wins over --no-quant-backward). A named recipe (--quant-recipe, see
recipes.py) or a recipe file (--quant-recipe-file) resolves to the same per-site configuration,
and --first-last-layers-bf16 keeps layers at either end in high precision.

The settings come typed and validated from config.py; nothing here checks their choices again.
"""

from __future__ import annotations

from typing import Dict, FrozenSet, Sequence

from megatron.quantization import layer_lists
from megatron.quantization.config import (
    ENV_SCHEME, GEMMS, NONE, SITE_CONCERNS, STOCHASTIC_SLOTS, MatmulQuantConfig, MxSettings,
    Nvfp4Settings, OperandFormats, QuantConfig, QuantSettings, RhtSettings, SettingError,
    effective_scheme, scheme_formats)
from megatron.quantization.presets import defined_settings, named_recipe
from megatron.quantization.recipes import RecipeError, bf16_layer_numbers, load_recipe_file


def grad_variant(fmt: str, settings: QuantSettings) -> str:
    """The format of gradient operands (dY) at a site quantized in `fmt`: MXFP8 per
    --mx-grad-format, FP8 E5M2 under --fp8-format hybrid (the default)."""
    if fmt.startswith("mxfp8"):
        return f"mxfp8_{settings.mx.grad_format}"
    if fmt.startswith("fp8_") and (settings.fp8.format or "hybrid") == "hybrid":
        return "fp8_e5m2"
    return fmt


def site_config(fmt: str, settings: QuantSettings, gemm_formats: Dict[str, str] = None,
                **pieces) -> MatmulQuantConfig:
    """Per-GEMM formats of one site quantized in `fmt` ('none' -> high precision; 'fp8' ->
    fp8_e4m3, gradients per --fp8-format), with the site concerns of `settings`.

    `gemm_formats` ({"fprop"|"dgrad"|"wgrad": format or "none"}) overrides the format of that
    GEMM at a quantized site; an explicit backward GEMM format also wins over
    --no-quant-backward. A site in high precision stays so. `pieces` are further
    MatmulQuantConfig fields (stochastic, rht, weight_2d)."""
    if fmt == "none":
        return NONE
    gemm_formats = gemm_formats or {}
    fmt = "fp8_e4m3" if fmt == "fp8" else fmt
    backward = settings.scheme.backward

    def gemm_format(gemm: str) -> str:
        if gemm in gemm_formats:
            return gemm_formats[gemm]
        return fmt if gemm == "fprop" or backward else "none"

    f, d, w = (OperandFormats(gemm_format(g)).a for g in GEMMS)
    return MatmulQuantConfig(
        fprop=OperandFormats(f, f),                                  # (X or Q or P, W or K^T or V)
        dgrad=OperandFormats(grad_variant(d, settings), d),          # (dY, W ...)
        wgrad=OperandFormats(w, grad_variant(w, settings)),          # (X ..., dY)
        **{concern: getattr(settings, concern) for concern in SITE_CONCERNS}, **pieces)


def effective_settings(settings: QuantSettings) -> QuantSettings:
    """The settings with what Megatron's --fp8-* flags imply applied: the scheme they imply
    (its source noted), and for --fp8-recipe mxfp8 TransformerEngine's MXFP8BlockScaling: the
    rceil scale rule, E5M2 gradients under hybrid."""
    scheme = effective_scheme(settings)
    if scheme != (settings.scheme.scheme or "bf16"):
        settings = settings.replace(scheme=settings.scheme.replace(scheme=scheme,
                                                                   source="--fp8-format"))
    if settings.fp8.format is not None and settings.fp8.recipe == "mxfp8":
        grad = "e5m2" if settings.fp8.format == "hybrid" else "e4m3"
        mx, default = settings.mx, MxSettings()
        # A flag given at another value, or a value set otherwise, contradicts what it implies.
        if mx.scale_mode != "rceil" and ("--mx-scale-mode" in settings.given
                                         or mx.scale_mode != default.scale_mode):
            raise SettingError(f"--fp8-recipe mxfp8 uses TransformerEngine's rceil scale rule; "
                               f"drop --mx-scale-mode {mx.scale_mode} (or use --quant-"
                               "scheme linear_mxfp8 without the --fp8-* flags)")
        if mx.grad_format != grad and "--mx-grad-format" in settings.given:
            raise SettingError(f"--fp8-format {settings.fp8.format} --fp8-recipe mxfp8 puts "
                               f"MXFP8 gradients in {grad.upper()}; drop --mx-grad-format "
                               f"{mx.grad_format} (or use --quant-scheme linear_mxfp8 without "
                               "the --fp8-* flags)")
        settings = settings.replace(mx=mx.replace(scale_mode="rceil", grad_format=grad))
    return settings


def _attention_variant(cfg: MatmulQuantConfig, notes: list) -> MatmulQuantConfig:
    """An attention site's config from a linear one: no Hadamard transform, weight tiles or
    NVFP4 variants (TransformerEngine's are for linear layers; attention has no weights), and
    current instead of delayed FP8 scaling (the chunked attention path quantizes an operand in
    pieces, one amax history cannot follow that)."""
    if cfg.enabled and any(cfg.delayed(f) for f in cfg.formats):
        notes.append("attention's FP8 operands use current (tensorwise) scaling: delayed scaling "
                     "applies to the linear layers")
        cfg = cfg.replace(fp8=cfg.fp8.replace(recipe="tensorwise"))
    return cfg.replace(rht=RhtSettings(), weight_2d=False, nvfp4=Nvfp4Settings())


def fp8_attention(settings: QuantSettings):
    """(QK^T config, PV config) of --fp8-dot-product-attention, as TransformerEngine's FP8
    attention quantizes: Q, K, V and dO in current scaling (MXFP8 under --fp8-recipe mxfp8,
    per-tensor delayed under delayed), the softmax output P (TE's S) and the score gradient dS
    (TE's dP) per tensor from an amax history; E4M3 forward, E5M2 for dO and dS under hybrid.
    --fp8-attention-backward high_precision leaves dgrad and wgrad unquantized,
    --fp8-attention-dp high_precision dS."""
    fp8, scheme = settings.fp8, settings.scheme
    grad = "e5m2" if fp8.format == "hybrid" else "e4m3"
    prefix = "mxfp8_" if fp8.recipe == "mxfp8" else "fp8_"
    op, op_grad = f"{prefix}e4m3", f"{prefix}{grad}"              # Q, K, V / dO
    probs, score_grad = "fp8_e4m3", f"fp8_{grad}"                  # P (S) / dS (dP)
    if scheme.fp8_attention_dp == "high_precision":
        score_grad = "none"
    scaling = fp8.replace(recipe="delayed" if fp8.recipe in (None, "delayed") else "tensorwise")
    common = dict(mx=settings.mx, hifp8=settings.hifp8, fp8=scaling, gemm=settings.gemm)
    qk = MatmulQuantConfig(fprop=OperandFormats(op, op), dgrad=OperandFormats(score_grad, op),
                           wgrad=OperandFormats(op, score_grad),
                           delayed_slots={"dgrad.a", "wgrad.b"}, **common)
    pv = MatmulQuantConfig(fprop=OperandFormats(probs, op), dgrad=OperandFormats(op_grad, op),
                           wgrad=OperandFormats(probs, op_grad),
                           delayed_slots={"fprop.a", "wgrad.a"}, **common)
    if scheme.fp8_attention_backward == "high_precision":
        qk, pv = (c.replace(dgrad=OperandFormats(), wgrad=OperandFormats()) for c in (qk, pv))
    return qk, pv


def _override_notes(settings: QuantSettings, formats: Sequence[str]) -> list:
    s = settings.scheme
    notes = []
    for flag, override, current in (("--linear-quant", s.linear_quant, formats[0]),
                                    ("--attn-qk-quant", s.attn_qk_quant, formats[1]),
                                    ("--attn-pv-quant", s.attn_pv_quant, "none")):
        if override is not None and override != current:
            notes.append(f"{flag} {override} overrides scheme {s.scheme} ({current})")
    for gemm, fmt in s.gemm_formats().items():
        notes.append(f"--quant-{gemm} {fmt}: the {gemm} GEMM of every quantized site in "
                     f"{'high precision' if fmt == 'none' else fmt}")
    return notes


def resolve(settings: QuantSettings, num_layers: int, seed: int = 0) -> QuantConfig:
    """The per-site QuantConfig of a run's settings (overrides win and are noted); `seed`
    keys the Hadamard sign vector."""
    notes = []
    if settings.recipe.recipe and settings.scheme.source == ENV_SCHEME:
        # The variable is --quant-scheme's default; a named recipe decides the sites itself.
        notes.append(f"${ENV_SCHEME}={settings.scheme.scheme} is not used: --quant-recipe "
                     f"{settings.recipe.recipe} decides which sites are quantized")
        settings = settings.replace(scheme=settings.scheme.replace(scheme="bf16",
                                                                   source="default"))
    _check_recipe_fp8_flags(settings)
    settings = effective_settings(settings)
    s, r = settings.scheme, settings.recipe
    linear_fmt, qk_fmt = scheme_formats(s.scheme)
    notes += _override_notes(settings, (linear_fmt, qk_fmt))
    linear_fmt = s.linear_quant if s.linear_quant is not None else linear_fmt
    qk_fmt = s.attn_qk_quant if s.attn_qk_quant is not None else qk_fmt
    pv_fmt = s.attn_pv_quant if s.attn_pv_quant is not None else "none"
    gemm_formats = s.gemm_formats()
    if all(f == "none" for f in (linear_fmt, qk_fmt, pv_fmt)) and gemm_formats:
        notes.append(f"{', '.join('--quant-' + g for g in gemm_formats)} change nothing: no "
                     f"site is quantized by scheme {s.scheme}")
    if settings.hifp8.scaling != "none":
        notes.append(f"--hifp8-scaling {settings.hifp8.scaling}: every HiFP8 operand gets one "
                     "power-of-two scale from its own amax (its largest magnitude in [8, 16))")

    weight_2d = r.weight_2d if r.weight_2d is not None else settings.fp8.scaling == "blockwise"
    pieces = dict(
        stochastic=STOCHASTIC_SLOTS[r.stochastic_rounding or "none"],
        rht=RhtSettings(tuple(r.rht_gemms or ("wgrad",)), r.rht, seed) if r.rht
        else RhtSettings(seed=seed),
        weight_2d=weight_2d)

    def make(fmt: str) -> MatmulQuantConfig:
        return site_config(fmt, settings, gemm_formats, **pieces)

    linear = make(linear_fmt)
    if r.weight_2d and not any(linear.weight_tiles(f) for f in linear.formats):
        notes.append("--quant-weight-2d changes nothing here: only NVFP4 and blockwise FP8 "
                     "weights have 2-D tiles")
    bf16_at = r.bf16_layers
    if r.recipe:
        preset = named_recipe(r.recipe, num_layers, seed, settings)
        linear = preset.linear
        notes.extend(preset.notes if bf16_at is None else ())
        bf16_at = bf16_at if bf16_at is not None else preset.bf16_layers
    rules = None
    if r.recipe_file:
        try:
            rules = load_recipe_file(r.recipe_file, settings, seed,
                                     grad_variant=lambda fmt: grad_variant(fmt, settings))
        except RecipeError as exc:
            raise SettingError(str(exc)) from None
    skip = skip_layer_numbers(s.skip_layers, num_layers)
    if bf16_at is not None:
        try:
            skip |= bf16_layer_numbers(num_layers, *bf16_at)
        except RecipeError as exc:
            raise SettingError(str(exc)) from None
    if settings.nvfp4.enabled and not any(
            "nvfp4" in c.formats for c in [linear] + (list(rules.configs.values()) if rules
                                                      else [])):
        notes.append("the --nvfp4-* variants change nothing here: no linear layer is "
                     "quantized in NVFP4")
    attn_qk, attn_pv = _attention_variant(make(qk_fmt), notes), \
        _attention_variant(make(pv_fmt), notes)
    if settings.gemm.accumulation_bits is not None and not any(
            c.enabled for c in [linear, attn_qk, attn_pv] + (
                list(rules.configs.values()) if rules else [])) and \
            not s.fp8_dot_product_attention:
        notes.append(f"--quant-accumulation-bits {settings.gemm.accumulation_bits} changes "
                     "nothing here: the accumulator model applies to quantized GEMMs, and no "
                     "GEMM is quantized")
    gradients = {fmt for c in [linear, attn_qk, attn_pv] + (
        list(rules.configs.values()) if rules else []) for fmt in (c.dgrad.a, c.wgrad.b)}
    if "--mx-grad-format" in settings.given and not any(f.startswith("mxfp8") for f in
                                                        gradients):
        notes.append(f"--mx-grad-format {settings.mx.grad_format} changes nothing here: no "
                     "gradient operand is in MXFP8 (it sets the element format of MXFP8 "
                     "gradients)")
    if s.fp8_dot_product_attention:
        dpa_settings = settings
        preset_fp8 = bool(r.recipe) and "fp8" in defined_settings(r.recipe)
        if settings.fp8.format is None and not preset_fp8:
            raise SettingError("--fp8-dot-product-attention needs --fp8-format (e4m3 or "
                               "hybrid), as in Megatron-LM, or an FP8 --quant-recipe")
        if preset_fp8:
            # The preset's FP8 scaling is the run's: attention follows it as TE's would.
            if linear.fp8.scaling == "blockwise":
                raise SettingError(f"--fp8-dot-product-attention with --quant-recipe {r.recipe} "
                                   "(blockwise FP8 scaling): FP8 attention takes tensorwise, "
                                   "delayed or mxfp8 scaling")
            dpa_settings = settings.replace(fp8=linear.fp8)
        attn_qk, attn_pv = fp8_attention(dpa_settings)
        notes.append("--fp8-dot-product-attention: attention's P and dS are delayed-scaled; "
                     "it runs the full-scores path (one amax history step per operand and "
                     "call)")
    site_configs = [linear] + (list(rules.configs.values()) if rules else [])
    _check_backward_override(site_configs, settings, notes)
    _check_variant_kernels(site_configs, settings)
    return QuantConfig(
        scheme=s.scheme,
        linear=linear,
        attn_qk=attn_qk,
        attn_pv=attn_pv,
        output_layer=linear if s.output_layer else NONE,
        skip_layers=skip,
        notes=tuple(dict.fromkeys(notes)),
        recipe=r.recipe,
        rules=rules,
        backend=settings.backend,
        settings=settings,
    )


def _check_recipe_fp8_flags(settings: QuantSettings) -> None:
    """--fp8-format / --fp8-recipe with a named recipe that is not an FP8 one: the recipe decides
    the linear layers' formats, so they could only mean FP8 attention."""
    r, fp8 = settings.recipe, settings.fp8
    if not r.recipe or "fp8" in defined_settings(r.recipe) or \
            settings.scheme.fp8_dot_product_attention:
        return
    given = [f"{flag} {value}" for flag, value in (("--fp8-format", fp8.format),
                                                   ("--fp8-recipe", fp8.recipe)) if value]
    if given:
        raise SettingError(f"--quant-recipe {r.recipe} with {' '.join(given)}: the recipe decides "
                           "the linear layers' formats (not FP8 ones) and the FP8 flags would "
                           "change nothing; drop them (or add --fp8-dot-product-attention for "
                           "FP8 attention)")


def _check_backward_override(configs: Sequence[MatmulQuantConfig], settings: QuantSettings,
                             notes: list) -> None:
    """--quant-backward-override (or a recipe's backward_override) replaces the backward GEMMs'
    formats: refuse it where that would discard what the run asked to quantize."""
    s = settings.scheme
    overridden = [c for c in configs if c.gemm.backward_override is not None]
    override = settings.gemm.backward_override or \
        (overridden[0].gemm.backward_override if overridden else None)
    if override is None:
        return
    explicit = [f"--quant-{g} {fmt}" for g, fmt in s.gemm_formats().items()
                if g != "fprop" and fmt != "none"]
    if explicit:
        raise SettingError(f"--quant-backward-override {override} with {', '.join(explicit)}: "
                           "the override leaves the backward GEMMs' operands unquantized (or "
                           "the forward's dequantized); drop one of them")
    for cfg in overridden:
        if cfg.enabled and not cfg.fprop.enabled:
            raise SettingError(f"--quant-backward-override {override} on linear layers whose "
                               "forward GEMM is in high precision: the backward GEMMs are the "
                               "only quantized ones and the override would run the whole site "
                               "in high precision; drop it")
    if not any(c.fprop.enabled for c in overridden):
        notes.append(f"--quant-backward-override {override} changes nothing here: no linear "
                     "layer is quantized")


def _check_variant_kernels(configs: Sequence[MatmulQuantConfig], settings: QuantSettings):
    """The NVFP4 variants (4/6, per-token scales) run in eager PyTorch only, whether the flags,
    a named recipe or a recipe file asked for them."""
    kernels = settings.backend.kernels
    if kernels in ("triton", "compile") and any(
            c.nvfp4.enabled and "nvfp4" in c.formats for c in configs):
        raise SettingError(f"--quant-kernels {kernels} with NVFP4 4/6 or per-token scales (of "
                           "the flags, the recipe or the recipe file): they exist in eager "
                           "PyTorch only; use --quant-kernels auto or eager")


def skip_layer_numbers(items: Sequence[str], num_layers: int) -> FrozenSet[int]:
    """--quant-skip-layers: '1', '-1' (last), '2-4' -> 1-based layer numbers."""
    try:
        return layer_lists.parse_layer_list(items, num_layers, "--quant-skip-layers")
    except ValueError as exc:
        raise SettingError(str(exc)) from None


def quant_config(argv: Sequence[str] = (), num_layers: int = 2, seed: int = 0,
                 environ=None) -> QuantConfig:
    """The QuantConfig that quantization flags resolve to (["--quant-scheme", "FA_mxfp8",
    ...]): what a run with those flags builds (tests, tools)."""
    from megatron.quantization.config import settings_from_flags
    kwargs = {} if environ is None else {"environ": environ}
    return resolve(settings_from_flags(argv, **kwargs), num_layers, seed)
