"""Every quantization setting, once: typed, documented, validated, and the source of its flag.

A setting is a field of a frozen dataclass, one dataclass per concern (which sites and formats,
the MX scale rule, HiFP8 and FP8 scaling, the FP4-recipe pieces, how the simulation runs). The
field's type says its choices (`Literal`), `setting(...)` gives its default, its help text and,
for settings a user sets, its command-line flag and its key in recipe files. From these fields

    add_arguments(parser)        generates the flags and their help (pretrain_gpt.py,
                                 tools/evaluate.py),
    QuantSettings.from_args(...) reads them back into the typed settings,
    settings_from_flags(argv)    parses quantization flags alone (evaluate.py arms, tests),
    recipe_key_settings()        names the keys a recipe-file config may set,

and every dataclass validates its own fields when it is made (choices, bounds, types: one
`SettingError` line naming the flag, the bad value and what is valid). Cross-setting rules
(a recipe and a scheme at once, ...) are checked once by `QuantSettings`.

Adding a setting means adding one field here (plus the code where it acts): the flag, its help,
its recipe-file key, its validation, its place in the per-site config (the site configs hold
the concern dataclasses themselves), the start-up table and the provenance all follow.

The per-site result of resolving the settings (schemes.py, recipes.py) is a `MatmulQuantConfig`
(formats of the three GEMMs' operands plus the concern settings) for each GEMM site, collected
in a `QuantConfig` for the whole model together with how the run executes it (`BackendSettings`).
"""

from __future__ import annotations

from types import MappingProxyType
import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterator, List, Literal, Optional, Sequence, Tuple

from megatron.quantization.formats import SCALE_MODES, canonical_format, format_info
from megatron.quantization.schedule import check_entry as check_schedule_entry

# -- choices -----------------------------------------------------------------------------------

GEMMS = ("fprop", "dgrad", "wgrad")
# The operand slots of a GEMM site: "<gemm>.<side>", side a / b of OperandFormats.
OPERAND_SLOTS = tuple(f"{g}.{side}" for g in GEMMS for side in ("a", "b"))
GRADIENT_SLOTS = frozenset({"dgrad.a", "wgrad.b"})     # dY in dgrad and in wgrad
# A linear site's other operands: X (activation) and W (weight).
LINEAR_SLOT_ROLES = MappingProxyType({"fprop.a": "activation", "fprop.b": "weight",
                                      "dgrad.b": "weight", "wgrad.a": "activation"})

SEED_FORMATS = ("mxfp8", "mxfp4", "hifp8")      # the seeds' ten schemes
ELEMENT_FORMATS = SEED_FORMATS + ("nvfp4", "mxfp6_e2m3", "mxfp6_e3m2", "fp8")
SCHEMES = ("bf16",) + tuple(
    f"{prefix}_{fmt}" for prefix in ("FA", "linear", "FA_linear") for fmt in ELEMENT_FORMATS)
SEED_SCHEMES = ("bf16",) + tuple(       # the experiment matrix's ten
    f"{prefix}_{fmt}" for prefix in ("FA", "linear", "FA_linear") for fmt in SEED_FORMATS)
OVERRIDE_FORMATS = ("none", "mxfp8", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "mxfp6_e2m3",
                    "mxfp6_e3m2", "nvfp4", "fp8_e4m3", "fp8_e5m2", "hifp8")
# The named recipes and what each reproduces (--help, README and the docs point here).
RECIPE_SOURCES = MappingProxyType({
    "nvfp4": "NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149; TransformerEngine "
             "NVFP4BlockScaling): fprop/dgrad/wgrad of every linear layer in NVFP4, weights in "
             "16x16 tiles, RHT 16 on wgrad, stochastic rounding of gradients, the last ~15% of "
             "the layers (at least one) and attention in BF16",
    "mxfp4_rht_sr": "Tseng, Yu, Park 2025 (arXiv 2502.20586): forward in BF16, dgrad and wgrad "
                    "of every linear layer in MXFP4 with a random Hadamard transform of block 64 "
                    "and stochastic rounding of their operands",
    # Megatron-Bridge, src/megatron/bridge/training/mixed_precision.py (v0.6.0)
    "bf16_with_mxfp8_mixed": "Megatron-Bridge's bf16_with_mxfp8_mixed (TE MXFP8BlockScaling, "
                             "E4M3): every linear GEMM in MXFP8 E4M3, gradients included, rceil "
                             "scale rule; no BF16 layers",
    "bf16_with_fp8_current_scaling_mixed": "Megatron-Bridge's bf16_with_fp8_current_scaling_mixed "
                                           "(TE Float8CurrentScaling, hybrid): E4M3 forward, E5M2 "
                                           "gradients, one scale per tensor from its own amax; "
                                           "first and last layer in BF16",
    "bf16_with_fp8_delayed_scaling_mixed": "Megatron-Bridge's bf16_with_fp8_delayed_scaling_mixed "
                                           "(TE DelayedScaling, hybrid): scales from an amax "
                                           "history of 1024 steps (max), margin 0; no BF16 layers",
    "bf16_with_fp8_subchannel_scaling_mixed": "Megatron-Bridge's "
                                              "bf16_with_fp8_subchannel_scaling_mixed (TE "
                                              "Float8BlockScaling, hybrid): 1x128 tiles for "
                                              "activations and gradients, 128x128 for weights, "
                                              "power-of-two scales; no BF16 layers",
    "bf16_with_nvfp4_mixed": "Megatron-Bridge's bf16_with_nvfp4_mixed (TE NVFP4BlockScaling "
                             "defaults): the nvfp4 recipe's GEMMs (16x16 weight tiles, RHT 16 on "
                             "wgrad, stochastic rounding of gradients) with no BF16 layers",
    "nemotron_3_super_bf16_with_nvfp4_mixed": "Megatron-Bridge's "
                                              "nemotron_3_super_bf16_with_nvfp4_mixed: as "
                                              "bf16_with_nvfp4_mixed with the last 14 layers in "
                                              "BF16",
    # TransformerEngine, transformer_engine/pytorch/custom_recipes/quantizer_factory_zoo.py
    "mxfp8_fwd_nvfp4_bwd": "TE's mxfp8_fwd_nvfp4_bwd quantizer factory: fprop in MXFP8; dgrad "
                           "and wgrad in NVFP4 (dY stochastically rounded, RHT 16 on wgrad), the "
                           "dgrad weight as 1-D NVFP4 requantized from the dequantized MXFP8 "
                           "weight",
    "high_precision_fwd_mxfp8_bwd": "TE's high_precision_fwd_mxfp8_bwd quantizer factory: fprop "
                                    "in BF16, dgrad and wgrad in MXFP8 E4M3",
    "mxfp8_fwd_high_precision_bwd": "TE's mxfp8_fwd_high_precision_bwd quantizer factory: fprop "
                                    "in MXFP8, dgrad and wgrad on the forward's dequantized X and "
                                    "W with dY unquantized (backward_override dequantized)",
    "nvfp4_1d_weight": "TE's nvfp4_1d_weight quantizer factory: the nvfp4 recipe's GEMMs with "
                       "1-D weight blocks, the dgrad weight requantized from the dequantized "
                       "fprop weight; no BF16 layers",
    "nvfp4_4over6": "TE's NVFP4 4over6 test recipe: every linear GEMM in NVFP4 with 4/6 (MAE, "
                    "tensor bound 256) on weights and activations, 16x16 weight tiles, no RHT, "
                    "no stochastic rounding",
    "nvfp4_row_scaled_fwd_high_precision_bwd": "TE's nvfp4_row_scaled_fwd_high_precision_bwd "
                                               "quantizer factory: fprop in NVFP4 with per-token "
                                               "scales of X, dgrad and wgrad on the dequantized "
                                               "forward operands, dY unquantized",
})
RECIPE_NAMES = tuple(RECIPE_SOURCES)
RHT_BLOCKS = (16, 32, 64, 128)
ENV_SCHEME = "CUSTOM_QUANT_TYPE"

Gemm = Literal[GEMMS]
SchemeName = Literal[SCHEMES]
OverrideFormat = Literal[OVERRIDE_FORMATS]
ScaleMode = Literal[SCALE_MODES]
GradFormat = Literal["e4m3", "e5m2"]
HiFP8Scaling = Literal["none", "tensor"]
Fp8Format = Literal["e4m3", "hybrid"]
Fp8Recipe = Literal["tensorwise", "delayed", "mxfp8", "blockwise"]
AmaxComputeAlgo = Literal["max", "most_recent"]
StochasticRounding = Literal["none", "grad", "all"]
RecipeName = Literal[RECIPE_NAMES]
RhtBlock = Literal[(0,) + RHT_BLOCKS]
KernelMode = Literal["auto", "triton", "compile", "eager"]
AttentionImpl = Literal["auto", "unfused"]
Nvfp4Scope = Literal["none", "weights", "activations", "all"]
FourOverSixMode = Literal["mae", "mse"]

KERNEL_MODES = typing.get_args(KernelMode)
FP8_SCALINGS = ("tensorwise", "delayed", "blockwise")   # what an FP8 operand's scale follows
STOCHASTIC_SLOTS = MappingProxyType({"none": frozenset(), "grad": GRADIENT_SLOTS,
                                     "all": frozenset(OPERAND_SLOTS)})
# The argparse dest where the parser records the quantization flags given on the command line
# (add_arguments' actions; QuantSettings.given).
GIVEN_DEST = "quant_flags_given"
# Bounds of settings that size memory: an amax history is one fp32 per step per operand slot.
MAX_AMAX_HISTORY_LEN = 1 << 16


class SettingError(ValueError):
    """A quantization setting (or combination) that cannot be used; the message is one line."""


# -- the field helper ----------------------------------------------------------------------------

def setting(default: Any = dataclasses.MISSING, help: str = "", *, flag: Optional[str] = None,
            recipe_key: Optional[str] = None, metavar: Optional[str] = None,
            nargs: Optional[str] = None, store_true: bool = False,
            minimum: Optional[float] = None, maximum: Optional[float] = None,
            default_factory: Any = dataclasses.MISSING):
    """A dataclass field that is a setting: `help` becomes its flag's help text; `flag` (e.g.
    "--mx-scale-mode") makes it a command-line flag (its dest is the flag's name with '_');
    `recipe_key` lets recipe-file configs set it; minimum/maximum bound a number; store_true
    makes a bool flag that can only be switched on."""
    metadata = dict(help=help, flag=flag, recipe_key=recipe_key, metavar=metavar, nargs=nargs,
                    store_true=store_true, minimum=minimum, maximum=maximum)
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _name_of(f: dataclasses.Field) -> str:
    """How messages name a setting: its flag, else its field name."""
    return f.metadata.get("flag") or f.name


def setting_name(kind, name: str) -> str:
    """How messages name field `name` of settings dataclass `kind`: its flag, else its
    recipe-file key, else the field name."""
    f = next(f for f in dataclasses.fields(kind) if f.name == name)
    return f.metadata.get("flag") or f.metadata.get("recipe_key") or f.name


def _unwrap_optional(tp) -> Tuple[Any, bool]:
    """(T, True) for Optional[T], (tp, False) otherwise."""
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _choices(tp) -> Optional[tuple]:
    """The choices of a Literal type (of its items, for Tuple[Literal, ...])."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) is tuple:
        return _choices(typing.get_args(tp)[0])
    return None


def check_setting(f: dataclasses.Field, tp, value, name: Optional[str] = None) -> None:
    """One setting's value against its type and bounds: a SettingError naming the setting
    (`name`, else its flag), the value and what is valid."""
    name = name or _name_of(f)
    inner, optional = _unwrap_optional(tp)
    if value is None:
        if not optional:
            raise SettingError(f"{name}: a value is required")
        return
    choices = _choices(inner)
    origin = typing.get_origin(inner)
    if origin is tuple:
        if not isinstance(value, tuple):
            raise SettingError(f"{name}: expected a list, got {value!r}")
        twice = sorted({str(v) for v in value if value.count(v) > 1})
        if twice:      # a list of names is a set: a repeat is a typo, not a weight
            raise SettingError(f"{name} {' '.join(map(str, value))}: "
                               f"{', '.join(twice)} given more than once")
        items = value
    else:
        items = (value,)
    for item in items:
        if choices is not None:
            if item not in choices or type(item) is not type(choices[0]):
                valid = ", ".join(str(c) for c in choices)
                raise SettingError(f"{name} {item!r}: not one of {valid}")
        elif inner is bool:
            if not isinstance(item, bool):
                raise SettingError(f"{name}: expected true or false, got {item!r}")
        elif inner is int:
            if isinstance(item, bool) or not isinstance(item, int):
                raise SettingError(f"{name}: expected an integer, got {item!r}")
        elif inner is float:
            if isinstance(item, bool) or not isinstance(item, (int, float)) or item != item \
                    or item in (float("inf"), float("-inf")):
                raise SettingError(f"{name}: expected a finite number, got {item!r}")
        elif inner is str:
            if not isinstance(item, str):
                raise SettingError(f"{name}: expected a string, got {item!r}")
        lo, hi = f.metadata.get("minimum"), f.metadata.get("maximum")
        if (lo is not None and item < lo) or (hi is not None and item > hi):
            bounds = f"{lo if lo is not None else '-inf'}..{hi if hi is not None else 'inf'}"
            raise SettingError(f"{name} {item!r}: out of range; valid: {bounds}")


class Settings:
    """Base of the concern dataclasses: validates every field when an instance is made."""

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            if not f.metadata or "help" not in f.metadata:
                continue
            value = getattr(self, f.name)
            if isinstance(value, list):           # lists from argparse or YAML: tuples here
                value = tuple(value)
                object.__setattr__(self, f.name, value)
            check_setting(f, hints[f.name], value)
        self.check()

    def check(self) -> None:
        """Rules between fields of one concern (none by default)."""

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


# -- the concerns ------------------------------------------------------------------------------

@dataclass(frozen=True)
class SchemeSettings(Settings):
    """Which GEMM sites are simulated in low precision, and in which formats.

    A scheme names the sites: bf16 (nothing), FA_<fmt> (attention QK^T; PV stays high
    precision unless --attn-pv-quant is given), linear_<fmt> (every parallel linear of every
    transformer layer), FA_linear_<fmt> (both). The other fields override it."""

    scheme: Optional[SchemeName] = setting(
        None, flag="--quant-scheme",
        help="Which GEMMs are simulated in low precision: bf16 (none), FA_<fmt> (attention "
             "QK^T only; PV stays high precision unless --attn-pv-quant is given), "
             "linear_<fmt> (every parallel linear of every transformer layer), FA_linear_<fmt> "
             "(both), with fmt mxfp8/mxfp4/hifp8 (the original ten schemes) or nvfp4, "
             "mxfp6_e2m3, mxfp6_e3m2, fp8 (FP8 scaled per --fp8-format/--fp8-recipe). "
             f"Default: ${ENV_SCHEME} if set, else bf16.")
    linear_quant: Optional[OverrideFormat] = setting(
        None, flag="--linear-quant",
        help="Override the element format of the linear layers ('none' = high precision).")
    attn_qk_quant: Optional[OverrideFormat] = setting(
        None, flag="--attn-qk-quant", help="Override the format of the attention QK^T GEMMs.")
    attn_pv_quant: Optional[OverrideFormat] = setting(
        None, flag="--attn-pv-quant",
        help="Quantize the attention PV (probabilities x values) GEMMs in this format (no "
             "scheme quantizes PV by itself).")
    backward: bool = setting(
        True, flag="--quant-backward",
        help="Also quantize the backward GEMMs (dgrad and wgrad) of quantized sites; "
             "--no-quant-backward keeps them in high precision.")
    fprop: Optional[OverrideFormat] = setting(
        None, flag="--quant-fprop",
        help="Format of the forward GEMM (X·W, Q·K^T, P·V) at every quantized site, "
             "overriding the scheme for that GEMM ('none' = high precision). Sites the scheme "
             "keeps in high precision stay so.")
    dgrad: Optional[OverrideFormat] = setting(
        None, flag="--quant-dgrad",
        help="Format of the input-gradient GEMM (dY·W^T ...) at every quantized site, "
             "overriding the scheme for that GEMM ('none' = high precision). Sites the scheme "
             "keeps in high precision stay so.")
    wgrad: Optional[OverrideFormat] = setting(
        None, flag="--quant-wgrad",
        help="Format of the weight-gradient GEMM (X^T·dY ...) at every quantized site, "
             "overriding the scheme for that GEMM ('none' = high precision, e.g. --quant-wgrad "
             "none keeps weight gradients in bf16). Sites the scheme keeps in high precision "
             "stay so.")
    skip_layers: Tuple[str, ...] = setting(
        (), flag="--quant-skip-layers", nargs="*",
        help="Transformer layers kept in high precision: 1-based numbers, ranges like 2-4, "
             "negative numbers from the end (e.g. 1 -1 keeps the first and last layer in bf16).")
    output_layer: bool = setting(
        False, flag="--quant-output-layer", store_true=True,
        help="Also quantize the output (LM head) layer with the linear format.")
    fp8_dot_product_attention: bool = setting(
        False, flag="--fp8-dot-product-attention", store_true=True,
        help="Simulate FP8 attention as TransformerEngine runs it under Megatron-LM's flag of "
             "the same name: Q, K, V and dO in current scaling (MXFP8 with --fp8-recipe mxfp8, "
             "per-tensor delayed with --fp8-recipe delayed), the softmax output S and the "
             "score gradient dP per tensor from an amax history; E4M3 forward, E5M2 for dO "
             "and dP under --fp8-format hybrid. Needs --fp8-format.")
    fp8_attention_backward: Literal["fp8", "high_precision"] = setting(
        "fp8", flag="--fp8-attention-backward",
        help="With --fp8-dot-product-attention: the attention's backward GEMMs in FP8 (the "
             "default) or in high precision (TransformerEngine's NVTE_FP8_DPA_BWD=0).")
    fp8_attention_dp: Literal["fp8", "high_precision"] = setting(
        "fp8", flag="--fp8-attention-dp",
        help="With --fp8-dot-product-attention: dP (the score gradient the dQ and dK GEMMs "
             "take) in FP8 (the default) or kept in high precision, the GEMM SageBwd found "
             "fragile (arXiv 2603.02170).")

    # Where `scheme` came from: "--quant-scheme", $CUSTOM_QUANT_TYPE or "default".
    source: str = field(default="default", metadata={"value": "quant_scheme_source"})

    def gemm_formats(self) -> Dict[str, str]:
        """{gemm: format} of the per-GEMM overrides that are given."""
        return {g: getattr(self, g) for g in GEMMS if getattr(self, g) is not None}


@dataclass(frozen=True)
class MxSettings(Settings):
    """The MX formats' shared-scale rule and the element format of MXFP8 gradients."""

    scale_mode: ScaleMode = setting(
        "floor", flag="--mx-scale-mode", recipe_key="scale_mode",
        help="MX shared-scale rule: floor (OCP spec: floor(log2 amax) - emax; the block "
             "maximum may clip), rceil (NVIDIA recipe: ceil(log2(amax / max_normal))), ceil "
             "(torchao: ceil(log2 amax) - emax; never clips, wastes range) or even (torchao: "
             "floor after rounding amax's mantissa, half up, to the element's bits).")
    grad_format: GradFormat = setting(
        "e4m3", flag="--mx-grad-format",
        help="Element format of the gradient operands of MXFP8 GEMMs (E4M3 as in NVIDIA's "
             "MXFP8 recipe, or E5M2).")


@dataclass(frozen=True)
class HiFP8Settings(Settings):
    """HiFP8 operands: a per-tensor power-of-two scale or none, and overflow behaviour."""

    scaling: HiFP8Scaling = setting(
        "none", flag="--hifp8-scaling", recipe_key="hifp8_scaling",
        help="Scaling of HiFP8 operands: none (the plain per-element cast) or tensor (one "
             "power-of-two scale per operand from its current amax, putting its largest "
             "magnitude in [8, 16), the 3-bit-mantissa region; forward and backward).")
    saturate: bool = setting(
        True, help="HiFP8 operands saturate at +-32768 instead of overflowing to +-Inf (the "
                   "training behaviour: one outlier must not turn a GEMM into Inf/NaN).")


@dataclass(frozen=True)
class Nvfp4Settings(Settings):
    """NVFP4 variants of TransformerEngine's NVFP4BlockScaling recipe: 4/6 block scales
    (v2.17+) and per-token tensor scales of activations (v2.16+), for linear layers. Operand
    roles: weights (W in fprop and dgrad), activations (X in fprop and wgrad); gradients (dY)
    never take either, as in TE."""

    four_over_six: Nvfp4Scope = setting(
        "none", flag="--nvfp4-4over6", recipe_key="nvfp4_4over6",
        help="NVFP4 '4/6' (TE's nvfp4_4over6, arXiv 2512.02010): each 16-block is quantized "
             "with the scale that maps its amax to 6 and with the one that maps it to 4, and "
             "keeps the smaller error; for the weights, the activations or all (never "
             "gradients) of NVFP4 linear layers. Default none. Not with the Hadamard transform "
             "or stochastic rounding on the same operands (TE refuses both).")
    four_over_six_err_mode: FourOverSixMode = setting(
        "mae", flag="--nvfp4-4over6-err-mode", recipe_key="nvfp4_4over6_err_mode",
        help="How 4/6 measures a block's error: mae (sum of |error|, TE's default) or mse.")
    four_over_six_e4m3_use_256: Nvfp4Scope = setting(
        "all", flag="--nvfp4-4over6-e4m3-use-256", recipe_key="nvfp4_4over6_e4m3_use_256",
        help="Operands (among those with 4/6) whose tensor scale maps their amax to 6 * 256 "
             "instead of 6 * 448, leaving the map-to-4 block scale room below E4M3's 448 "
             "(TE's nvfp4_4over6_e4m3_use_256; default all).")
    row_scaled_activation: bool = setting(
        False, flag="--nvfp4-row-scaled-activation", store_true=True,
        recipe_key="row_scaled_activation",
        help="One NVFP4 tensor scale per token (per row of X along K in fprop, per column "
             "along the tokens in wgrad) instead of one per tensor, for the activations of "
             "NVFP4 linear layers (TE's row_scaled_activation). Not with the Hadamard "
             "transform or stochastic rounding on those operands.")

    def operand_options(self, role: Optional[str]) -> Dict[str, Any]:
        """fake_quantize's NVFP4 variant options for an operand of `role` ("weight",
        "activation"; None for gradients and attention operands: none)."""
        if role not in ("weight", "activation"):
            return {}
        covers = lambda scope: scope in ("all", role + "s")  # noqa: E731
        options = {}
        if covers(self.four_over_six):
            options["four_over_six"] = self.four_over_six_err_mode
            options["four_over_six_bound"] = 256 if covers(self.four_over_six_e4m3_use_256) \
                else 448
        if self.row_scaled_activation and role == "activation":
            options["row_scaled"] = True
        return options

    @property
    def enabled(self) -> bool:
        return self.four_over_six != "none" or self.row_scaled_activation


@dataclass(frozen=True)
class Fp8Settings(Settings):
    """FP8 operands ("fp8_e4m3" / "fp8_e5m2") scaled as TransformerEngine's recipes do:

    tensorwise  one float32 scale per operand from its own amax (Float8CurrentScaling)
    delayed     one scale per operand from the amax history of its earlier quantizations
                (DelayedScaling; megatron's default)
    blockwise   one scale per 1x128 tile along the reduction axis, per 128x128 tile for
                weights of sites with 2-D weight tiles (Float8BlockScaling)
    mxfp8       the MXFP8 path instead (MX formats with the rceil scale rule)

    scale = (fp8_max * 2**-margin) / amax, truncated to a power of two when pow2_scale."""

    format: Optional[Fp8Format] = setting(
        None, flag="--fp8-format",
        help="Simulate FP8 linear layers as megatron-core + TransformerEngine would: e4m3 "
             "(every operand E4M3) or hybrid (E4M3 forward, E5M2 gradients). Implies "
             "--quant-scheme linear_fp8 (linear_mxfp8 with --fp8-recipe mxfp8) unless an "
             "*_fp8 scheme is given.")
    recipe: Optional[Fp8Recipe] = setting(
        None, flag="--fp8-recipe", recipe_key="fp8_recipe",
        help="FP8 scaling: tensorwise (current scaling, per tensor), delayed (per-tensor scale "
             "from an amax history; megatron's default), mxfp8 (the MXFP8 path with the rceil "
             "scale rule), blockwise (1x128 tiles, 128x128 for weights).")
    margin: int = setting(
        0, flag="--fp8-margin", recipe_key="fp8_margin", minimum=0, maximum=64,
        help="Scaling margin: scale = (fp8_max * 2^-margin) / amax (default 0).")
    amax_history_len: int = setting(
        1, flag="--fp8-amax-history-len", recipe_key="fp8_amax_history_len", minimum=1,
        maximum=MAX_AMAX_HISTORY_LEN,
        help="Delayed scaling: number of past amaxes kept per operand (default 1; at most "
             f"{MAX_AMAX_HISTORY_LEN}).")
    amax_compute_algo: AmaxComputeAlgo = setting(
        "most_recent", flag="--fp8-amax-compute-algo", recipe_key="fp8_amax_compute_algo",
        help="Delayed scaling: the amax a scale uses, the latest in the history or its maximum "
             "(default most_recent).")
    pow2_scale: Optional[bool] = setting(
        None, flag="--fp8-power-2-scales", recipe_key="fp8_pow2_scale",
        help="Truncate FP8 scales to powers of two (default: on for blockwise, as "
             "TransformerEngine's Float8BlockScaling, off otherwise).")
    @property
    def scaling(self) -> str:
        """How an FP8 operand is scaled: tensorwise, delayed or blockwise (the recipe; delayed
        when none is given, as megatron-core)."""
        return self.recipe if self.recipe in FP8_SCALINGS else "delayed"

    @property
    def power_of_two(self) -> bool:
        """Whether FP8 scales are truncated to powers of two."""
        return self.scaling == "blockwise" if self.pow2_scale is None else self.pow2_scale


@dataclass(frozen=True)
class GemmSettings(Settings):
    """How a quantized site's GEMMs compute with their operands, beyond the formats (per site:
    recipe-file configs may set these by their recipe keys)."""

    accumulation_bits: Optional[int] = setting(
        None, flag="--quant-accumulation-bits", recipe_key="accumulation_bits", minimum=1,
        maximum=23, metavar="M",
        help="Simulate a limited-precision GEMM accumulator (megatron/quantization/"
             "accumulation.py): the partial sums of quantized sites' GEMMs keep M mantissa "
             "bits, truncated toward zero after every --quant-accumulation-group products (13: "
             "the ~14-bit accumulator DeepSeek-V3 measured on Hopper FP8 tensor cores). "
             "Default: none (FP32 accumulation).")
    accumulation_group: int = setting(
        32, flag="--quant-accumulation-group", recipe_key="accumulation_group", minimum=1,
        maximum=4096, metavar="K",
        help="Products summed exactly before each truncation of the partial sum (one MMA "
             "instruction's reduction; default 32).")
    accumulation_promotion: int = setting(
        0, flag="--quant-accumulation-promotion", recipe_key="accumulation_promotion",
        minimum=0, metavar="N",
        help="Promote the limited-precision partial sum into an FP32 accumulator every N "
             "products, a multiple of the group (128: DeepSeek-V3's fix, TransformerEngine's "
             "split accumulator); 0 (default): never.")
    accumulation_gemms: Tuple[Gemm, ...] = setting(
        GEMMS, flag="--quant-accumulation-gemms", recipe_key="accumulation_gemms", nargs="+",
        metavar="GEMM",
        help="The GEMMs whose accumulation --quant-accumulation-bits limits (default: fprop "
             "dgrad wgrad; TransformerEngine chooses its split accumulator per GEMM).")
    backward_override: Optional[Literal["high_precision", "dequantized"]] = setting(
        None, flag="--quant-backward-override", recipe_key="backward_override",
        help="How the backward GEMMs (dgrad, wgrad) of quantized linear layers take their "
             "operands, as TransformerEngine's recipe option backward_override: high_precision "
             "(dY, W and X unquantized) or dequantized (the forward's dequantized X and W, not "
             "quantized again along the other axis; dY unquantized). Default: every backward "
             "GEMM quantizes its operands itself.")

    def check(self) -> None:
        if self.accumulation_promotion % self.accumulation_group:
            raise SettingError(f"--quant-accumulation-promotion {self.accumulation_promotion}: "
                               "0 or a multiple of --quant-accumulation-group "
                               f"{self.accumulation_group}")

    def limits(self, gemm: str) -> bool:
        """Whether `gemm`'s accumulation is the limited-precision one."""
        return self.accumulation_bits is not None and gemm in self.accumulation_gemms


@dataclass(frozen=True)
class RecipeSettings(Settings):
    """The FP4/FP8-recipe pieces: a named recipe or a recipe file, stochastic rounding, the
    random Hadamard transform, 2-D weight tiles, layers kept in BF16."""

    recipe: Optional[RecipeName] = setting(
        None, flag="--quant-recipe",
        help="A published training recipe in one flag: " + "; ".join(
            f"{name}: {text}" for name, text in RECIPE_SOURCES.items()) +
             ". --first-last-layers-bf16 replaces the recipe's BF16 layers.")
    recipe_file: Optional[str] = setting(
        None, flag="--quant-recipe-file", metavar="FILE",
        help="A YAML/JSON recipe in megatron-core's RecipeConfig shape: named configs (per GEMM "
             "format, stochastic rounding, Hadamard transform, 2-D weight tiles, scale rules) "
             "and ordered glob matchers over module paths with global layer indices "
             "(decoder.layers.3.mlp.linear_fc1); the first match decides a site's config, "
             "unmatched sites keep the scheme's.")
    stochastic_rounding: Optional[StochasticRounding] = setting(
        None, flag="--quant-stochastic-rounding", recipe_key="stochastic_rounding",
        help="Stochastic rounding of the elements of quantized operands (MX, NVFP4, FP8; "
             "scales as with round-to-nearest): none (default), grad (the gradient operands dY "
             "of dgrad and wgrad, as the NVFP4 recipe) or all. Draws are keyed by --seed, "
             "iteration, site and operand: reproducible, also after resuming.")
    rht: Optional[RhtBlock] = setting(
        None, flag="--quant-rht", metavar="BLOCK",
        help="Random Hadamard transform of block 16/32/64/128 (0: off, the default) applied to "
             "both operands of the --quant-rht-gemms GEMMs of quantized linear layers along "
             "their reduction axis before they are quantized (the exact product is unchanged); "
             "one random sign vector per run, from --seed.")
    rht_gemms: Optional[Tuple[Gemm, ...]] = setting(
        None, flag="--quant-rht-gemms", nargs="+", metavar="GEMM",
        help="GEMMs the Hadamard transform applies to (default: wgrad, as in both FP4 papers).")
    weight_2d: Optional[bool] = setting(
        None, flag="--quant-weight-2d", recipe_key="weight_2d",
        help="Quantize linear weights in 2-D tiles (NVFP4 16x16, FP8 blockwise 128x128), so "
             "the fprop and dgrad copies of a weight are the same numbers. Default: on for the "
             "FP8 blockwise recipe, off otherwise (the nvfp4 recipe sets it).")
    first_last_layers_bf16: bool = setting(
        False, flag="--first-last-layers-bf16", store_true=True,
        help="Keep the first --num-layers-at-start-in-bf16 and the last "
             "--num-layers-at-end-in-bf16 transformer layers in high precision (megatron-core's "
             "flag).")
    num_layers_at_start_in_bf16: int = setting(
        1, flag="--num-layers-at-start-in-bf16", minimum=0,
        help="Layers at the start kept in BF16 with --first-last-layers-bf16 (default 1).")
    num_layers_at_end_in_bf16: int = setting(
        1, flag="--num-layers-at-end-in-bf16", minimum=0,
        help="Layers at the end kept in BF16 with --first-last-layers-bf16 (default 1).")
    schedule: Tuple[str, ...] = setting(
        (), flag="--quant-schedule", nargs="+", metavar="PHASE@WHEN",
        help="A precision schedule: from the iteration after WHEN on, every site runs in PHASE: "
             "quantized (as configured; how a run starts), high_precision_forward (the forward "
             "GEMMs -- linear fprop, attention QK^T and PV -- in the run's precision, BF16 "
             "under --bf16; the backward as configured) or high_precision (every GEMM). WHEN is "
             "an iteration count (900) or a fraction of --train-iters with a decimal point "
             "(0.9). E.g. 'high_precision_forward@0.85' (the NVFP4 paper's Appendix D), "
             "'high_precision@0.5 quantized@0.75' for an ablation. Each switch is logged, "
             "checkpoints record the schedule and a resume follows it.")

    def check(self) -> None:
        for entry in self.schedule:
            try:
                check_schedule_entry(entry)
            except ValueError as exc:
                raise SettingError(str(exc)) from None
        if self.rht_gemms is not None and not self.rht:
            raise SettingError("--quant-rht-gemms needs --quant-rht BLOCK (the transform is off)")
        if self.recipe and self.recipe_file:
            raise SettingError(f"--quant-recipe {self.recipe} and --quant-recipe-file "
                               f"{self.recipe_file}: give one of them")

    @property
    def bf16_layers(self) -> Optional[Tuple[int, int]]:
        """(first, last) layer counts kept in BF16 by --first-last-layers-bf16, else None."""
        if not self.first_last_layers_bf16:
            return None
        return self.num_layers_at_start_in_bf16, self.num_layers_at_end_in_bf16


@dataclass(frozen=True)
class AttentionSettings(Settings):
    """How core attention runs its quantized (or unquantized) GEMMs; every choice gives the
    same quantized operands."""

    impl: AttentionImpl = setting(
        "auto", flag="--quant-attention-impl",
        help="Core attention: auto (default: the fused kernel when attention is not "
             "quantized, exact linear-memory chunks when it is) or unfused (megatron-core's "
             "full [b, heads, s, s] scores: the reference path, O(s^2) memory; for checks and "
             "benchmarks).")
    chunk_rows: Optional[int] = setting(
        None, minimum=32,
        help="Query rows per chunk of the chunked path (a multiple of 32); None: from the "
             "memory budget (a fixed size on a CPU, a share of the free memory on a GPU).")
    share_operands: bool = setting(
        True, help="K^T and V quantized once per GEMM slot and call, not once per chunk.")
    skip_masked_blocks: bool = setting(
        True, help="Chunks and tiles leave out the key blocks the causal mask hides from all "
                   "their rows.")

    def check(self) -> None:
        if self.chunk_rows is not None and self.chunk_rows % 32:
            raise SettingError(f"chunk_rows {self.chunk_rows}: not a multiple of 32")


@dataclass(frozen=True)
class BackendSettings(Settings):
    """How the simulation runs: kernels, caches, the attention path. Results are bit for bit
    the same whatever these say."""

    kernels: KernelMode = setting(
        "auto", flag="--quant-kernels",
        help="How fake quantization runs (bit for bit the same quantized operands in every "
             "mode): auto (default: fused Triton kernels for CUDA tensors where triton is "
             "installed and covers the call -- MX formats, HiFP8, NVFP4, FP8; fp32/bf16 "
             "operands -- "
             "and the fused quantized-attention kernels where they cover the attention GEMMs' "
             "formats; eager PyTorch and the chunked attention elsewhere), triton (the Triton "
             "kernels, an error for anything they do not cover; on CPU tensors under "
             "TRITON_INTERPRET=1), compile (torch.compile of the PyTorch code) or eager (plain "
             "PyTorch).")
    weight_cache: bool = setting(
        True, flag="--quant-weight-cache",
        help="Keep each quantized linear weight's QDQ copy per GEMM axis until the next "
             "optimizer step (every micro-batch and recomputed forward reuses it; bit for bit "
             "the same numbers). Costs two copies of every quantized weight (counted by the "
             "memory estimate); --no-quant-weight-cache quantizes at every use.")
    attention: AttentionSettings = field(default_factory=AttentionSettings)


CONCERNS = ("scheme", "mx", "hifp8", "fp8", "gemm", "recipe", "backend")
# The concerns every GEMM site carries whole (MatmulQuantConfig); recipe-file configs may set
# their fields that have a recipe key.
SITE_CONCERNS = ("mx", "nvfp4", "hifp8", "fp8", "gemm")


@dataclass(frozen=True)
class QuantSettings(Settings):
    """Every quantization setting of a run, by concern (what the flags say, typed)."""

    scheme: SchemeSettings = field(default_factory=SchemeSettings)
    mx: MxSettings = field(default_factory=MxSettings)
    nvfp4: Nvfp4Settings = field(default_factory=Nvfp4Settings)
    hifp8: HiFP8Settings = field(default_factory=HiFP8Settings)
    fp8: Fp8Settings = field(default_factory=Fp8Settings)
    gemm: GemmSettings = field(default_factory=GemmSettings)
    recipe: RecipeSettings = field(default_factory=RecipeSettings)
    backend: BackendSettings = field(default_factory=BackendSettings)
    # The flags given on the command line, at any value ("--mx-scale-mode", ...; given_flags
    # decides): what a named recipe or --fp8-recipe mxfp8 may not set to something else.
    given: FrozenSet[str] = field(default=frozenset(), compare=False,
                                  metadata={"value": GIVEN_DEST})

    def check(self) -> None:
        """The rules between concerns: a named recipe or a recipe file decides what the
        per-site flags decide, so both at once is a contradiction."""
        r, s = self.recipe, self.scheme
        self._check_fp8_attention()
        if self.nvfp4.enabled and self.backend.kernels in ("triton", "compile"):
            raise SettingError(f"--quant-kernels {self.backend.kernels} with the --nvfp4-* "
                               "variants: they exist in eager PyTorch only; use --quant-kernels "
                               "auto or eager")
        source = (f"--quant-recipe {r.recipe}" if r.recipe else
                  f"--quant-recipe-file {r.recipe_file}" if r.recipe_file else None)
        if r.recipe_file is None:
            self._check_accumulation_flags()
        if source is None:
            if self.fp8.recipe is not None and self.fp8.format is None and \
                    "fp8" not in scheme_formats(s.scheme or "bf16"):
                raise SettingError(f"--fp8-recipe {self.fp8.recipe} needs --fp8-format (or an "
                                   f"*_fp8 scheme); scheme {s.scheme or 'bf16'} has no FP8 site")
            return
        if r.recipe and s.source == "--quant-scheme" and s.scheme != "bf16":
            raise SettingError(f"{source} with --quant-scheme {s.scheme}: the recipe decides "
                               "which sites are quantized; drop --quant-scheme")
        given = [f"--{name.replace('_', '-')}" for name in
                 ("linear_quant", "attn_qk_quant", "attn_pv_quant")
                 if getattr(s, name) is not None]
        given += [f"--quant-{g}" for g in s.gemm_formats()]
        if r.recipe:
            given += [flag for flag, value in (
                ("--quant-stochastic-rounding", r.stochastic_rounding), ("--quant-rht", r.rht),
                ("--quant-rht-gemms", r.rht_gemms), ("--quant-weight-2d", r.weight_2d))
                if value is not None]
            if not s.backward:
                given.append("--no-quant-backward")
        if given:
            raise SettingError(f"{source} with {', '.join(given)}: the recipe sets these; drop "
                               f"{'them' if len(given) > 1 else 'it'} (or write a recipe file)")

    def _check_accumulation_flags(self) -> None:
        """The accumulator model's flags do nothing without --quant-accumulation-bits (a recipe
        file's configs may set the bits per site, with these flags as their defaults)."""
        g, default = self.gemm, GemmSettings()
        given = [f"{setting_name(GemmSettings, name)} {_flag_text(getattr(g, name))}"
                 for name in ("accumulation_group", "accumulation_promotion",
                              "accumulation_gemms")
                 if getattr(g, name) != getattr(default, name)]
        if g.accumulation_bits is None and given:
            raise SettingError(f"{', '.join(given)} without --quant-accumulation-bits M: the "
                               "accumulator model is off, so they would change nothing; give "
                               "--quant-accumulation-bits (e.g. 13) or drop them")

    def _check_fp8_attention(self) -> None:
        fp8, s = self.fp8, self.scheme
        if not s.fp8_dot_product_attention:
            extra = [flag for flag, value, default in (
                ("--fp8-attention-backward", s.fp8_attention_backward, "fp8"),
                ("--fp8-attention-dp", s.fp8_attention_dp, "fp8")) if value != default]
            if extra:
                raise SettingError(f"{', '.join(extra)} apply to --fp8-dot-product-attention, "
                                   "which is off")
            return
        # (Its FP8 format comes from --fp8-format or an FP8 --quant-recipe: schemes.py checks.)
        if fp8.recipe == "blockwise":
            raise SettingError("--fp8-dot-product-attention with --fp8-recipe blockwise: FP8 "
                               "attention takes tensorwise, delayed or mxfp8 scaling")
        given = [flag for flag, value in (("--attn-qk-quant", s.attn_qk_quant),
                                          ("--attn-pv-quant", s.attn_pv_quant)) if value]
        if (s.scheme or "bf16").startswith("FA"):
            given.append(f"--quant-scheme {s.scheme}")
        if given:
            raise SettingError(f"--fp8-dot-product-attention decides attention's formats; "
                               f"drop {', '.join(given)}")

    # -- flags <-> settings ---------------------------------------------------------------

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ=os.environ) -> "QuantSettings":
        """The typed settings of parsed flags (argparse dests as add_arguments names them);
        the scheme defaults to $CUSTOM_QUANT_TYPE, else bf16."""
        values = dict(vars(args))
        values[GIVEN_DEST] = given_flags(values)
        if values.get("quant_scheme") is None:
            values["quant_scheme"] = scheme_from_env(environ)
            values["quant_scheme_source"] = \
                ENV_SCHEME if environ.get(ENV_SCHEME, "").strip() else "default"
        else:
            values["quant_scheme_source"] = "--quant-scheme"
        return _from_flags(cls, values)

    def as_flags(self) -> Dict[str, Any]:
        """{dest: value} of every flag, as from_args would read them back."""
        return {_dest(f.metadata["flag"]): value for f, value in _flag_fields(self)}

    def label(self) -> str:
        """The run's label (capture directories, run files, reports): the recipe's name
        recipe_<name>, <scheme>_recipe_file (recipe_file under bf16) for a recipe file, else
        the scheme the flags resolve to (--fp8-format implies one)."""
        if self.recipe.recipe:
            return f"recipe_{self.recipe.recipe}"
        scheme = effective_scheme(self)
        if self.recipe.recipe_file:
            return "recipe_file" if scheme == "bf16" else f"{scheme}_recipe_file"
        return scheme


def given_flags(values: dict) -> FrozenSet[str]:
    """The quantization flags given on the command line, from parsed flags `values` (argparse
    dests): those add_arguments' parser recorded; for values no such parser made (a namespace
    built by hand), the flags whose value is not their default."""
    if isinstance(values.get(GIVEN_DEST), (tuple, list, set, frozenset)):
        return frozenset(values[GIVEN_DEST])
    given = set()
    for f, _ in _flag_field_types(QuantSettings):
        dest, default = _dest(f.metadata["flag"]), f.default
        value = values.get(dest, default)
        value = tuple(value) if isinstance(value, list) else value
        if value != default and not (value is None and default == ()):
            given.add(f.metadata["flag"])
    return frozenset(given)


def _flag_text(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _flag_fields(obj) -> Iterator[Tuple[dataclasses.Field, Any]]:
    """(field, value) of every flag setting of a settings tree, in definition order."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _flag_fields(value)
        elif f.metadata.get("flag"):
            yield f, value


def _from_flags(kind, values: dict):
    """An instance of the settings dataclass `kind` whose flag fields take values[dest] (their
    defaults where absent; lists as tuples) and whose nested settings are built alike."""
    kwargs = {}
    for f in dataclasses.fields(kind):
        tp = typing.get_type_hints(kind)[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _from_flags(tp, values)
            continue
        key = _dest(f.metadata["flag"]) if f.metadata.get("flag") else f.metadata.get("value")
        if key is None or key not in values:
            continue
        value = values[key]
        if value is None and f.default == ():       # a list flag not given: the empty list
            value = ()
        kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    return kind(**kwargs)


class _Given(argparse.Action):
    """Records its flag (the first option string: --quant-backward for --no-quant-backward)
    among the namespace's given flags (GIVEN_DEST), then acts as its other base."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, GIVEN_DEST, None)     # anything else: a probe's placeholder
        given = set(given) if isinstance(given, (tuple, list, set, frozenset)) else set()
        setattr(namespace, GIVEN_DEST, tuple(sorted(given | {self.option_strings[0]})))
        super().__call__(parser, namespace, values, option_string)


class _GivenStore(_Given, argparse._StoreAction):
    pass


class _GivenStoreTrue(_Given, argparse._StoreTrueAction):
    pass


class _GivenBool(_Given, argparse.BooleanOptionalAction):
    pass


def add_arguments(group, cls=QuantSettings) -> None:
    """Add a flag for every flag setting of `cls`'s tree to an argparse group (or parser);
    the flags given are recorded in the namespace (GIVEN_DEST, see given_flags)."""
    group.set_defaults(**{GIVEN_DEST: ()})
    for f, tp in _flag_field_types(cls):
        meta = f.metadata
        inner, optional = _unwrap_optional(tp)
        kwargs = dict(dest=_dest(meta["flag"]), help=meta["help"].replace("%", "%%"))
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        default = f.default if f.default is not dataclasses.MISSING else None
        if inner is bool:
            kwargs["action"] = _GivenStoreTrue if meta.get("store_true") else _GivenBool
            kwargs["default"] = default
        else:
            kwargs["action"] = _GivenStore
            choices = _choices(inner)
            scalar = typing.get_args(inner)[0] if typing.get_origin(inner) is tuple else inner
            kwargs["type"] = type(choices[0]) if choices else scalar
            if choices:
                kwargs["choices"] = choices
            if meta.get("nargs"):
                kwargs["nargs"] = meta["nargs"]
                default = None if default == () else default
            kwargs["default"] = default
        group.add_argument(meta["flag"], **kwargs)


def _flag_field_types(cls) -> Iterator[Tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _flag_field_types(tp)
        elif f.metadata.get("flag"):
            yield f, tp


def flag_names(cls=QuantSettings) -> List[str]:
    """Every quantization flag ("--mx-scale-mode", ...), in definition order."""
    return [f.metadata["flag"] for f, _ in _flag_field_types(cls)]


def switch_flags(cls=QuantSettings) -> Dict[str, bool]:
    """{flag: whether --no-<flag> switches it off} of the quantization flags that take no
    value (a bool setting's)."""
    return {f.metadata["flag"]: not f.metadata.get("store_true")
            for f, tp in _flag_field_types(cls) if _unwrap_optional(tp)[0] is bool}


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise SettingError(message)


def settings_parser() -> argparse.ArgumentParser:
    """A parser of the quantization flags alone (errors raise SettingError)."""
    parser = _RaisingParser(add_help=False, allow_abbrev=False)
    add_arguments(parser)
    return parser


def settings_from_flags(argv: Sequence[str], base: Optional[QuantSettings] = None,
                        environ=os.environ) -> QuantSettings:
    """QuantSettings from quantization flags (["--quant-scheme", "linear_mxfp8", ...]): on top
    of `base`'s values when given (only the flags in argv change; the flags given are
    `base`'s and argv's). Any other flag is a SettingError naming it."""
    parser = settings_parser()
    namespace = argparse.Namespace(**(base.as_flags() if base is not None else {}))
    setattr(namespace, GIVEN_DEST, tuple(sorted(base.given)) if base is not None else ())
    args, unknown = parser.parse_known_args(list(argv), namespace=namespace)
    if unknown:
        raise SettingError(f"not a quantization flag: {' '.join(unknown)} (valid: "
                           f"{', '.join(flag_names())})")
    if base is not None and base.scheme.source != "--quant-scheme" and \
            "--quant-scheme" not in argv:
        args.quant_scheme = None       # the base's scheme came from the environment: again
    return QuantSettings.from_args(args, environ)


def recipe_key_settings() -> Dict[str, Tuple[str, dataclasses.Field, Any]]:
    """{recipe-file key: (concern, field, type)} of the settings a recipe config may set."""
    keys = {}
    for concern in SITE_CONCERNS + ("recipe",):
        kind = typing.get_type_hints(QuantSettings)[concern]
        hints = typing.get_type_hints(kind)
        for f in dataclasses.fields(kind):
            if f.metadata.get("recipe_key"):
                keys[f.metadata["recipe_key"]] = (concern, f, hints[f.name])
    return keys


# -- schemes -----------------------------------------------------------------------------------

def scheme_formats(scheme: str) -> Tuple[str, str]:
    """(linear format, attention QK format) of a named scheme; 'none' where not quantized."""
    if scheme not in SCHEMES:
        raise SettingError(f"unknown quantization scheme {scheme!r}; valid: {', '.join(SCHEMES)}")
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
    raise SettingError(f"{ENV_SCHEME}={value!r} is not a quantization scheme; valid: "
                       f"{', '.join(SCHEMES + ELEMENT_FORMATS)}")


def effective_scheme(settings: QuantSettings) -> str:
    """The scheme once Megatron's --fp8-* flags are applied: they imply linear_fp8 (or
    linear_mxfp8 for --fp8-recipe mxfp8) unless the scheme already has the format; a scheme
    that puts the linear layers in another format is a SettingError."""
    scheme, fp8 = settings.scheme.scheme or "bf16", settings.fp8
    if fp8.format is None:
        return scheme
    linear = scheme_formats(scheme)[0]
    wanted = "mxfp8" if fp8.recipe == "mxfp8" else "fp8"
    if scheme == "bf16":
        return f"linear_{wanted}"
    if linear != wanted:
        suggestion = ("FA_linear_" if scheme.startswith("FA") else "linear_") + wanted
        raise SettingError(f"--fp8-format {fp8.format} --fp8-recipe {fp8.recipe or 'delayed'} "
                           f"quantizes the linear layers in {wanted}, but --quant-scheme "
                           f"{scheme} puts them in {linear}; use --quant-scheme {suggestion} "
                           "or drop one")
    return scheme


# -- per-site configuration ----------------------------------------------------------------------

_STOCHASTIC_KINDS = ("mx", "nvfp4", "fp8")


@dataclass(frozen=True)
class OperandFormats:
    """Formats of one GEMM's two operands (canonical names; "none" = high precision)."""

    a: str = "none"
    b: str = "none"

    def __post_init__(self):
        for side in ("a", "b"):
            try:
                object.__setattr__(self, side, canonical_format(getattr(self, side)))
            except ValueError as exc:
                raise SettingError(str(exc)) from None

    @property
    def enabled(self) -> bool:
        return self.a != "none" or self.b != "none"


@dataclass(frozen=True)
class RhtSettings:
    """The random Hadamard transform of a site: the GEMMs whose two operands go through it
    along the reduction axis before they are quantized, its block and its sign seed."""

    gemms: Tuple[str, ...] = ()
    block: int = 16
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "gemms", tuple(self.gemms))
        if set(self.gemms) - set(GEMMS):
            raise SettingError(f"unknown GEMMs {list(self.gemms)} for the Hadamard transform; "
                               f"valid: {', '.join(GEMMS)}")
        if self.block not in RHT_BLOCKS:
            raise SettingError(f"Hadamard block {self.block!r} is not one of "
                               f"{', '.join(map(str, RHT_BLOCKS))}")


@dataclass(frozen=True)
class MatmulQuantConfig:
    """How one GEMM site (a linear layer, attention's QK^T or PV) quantizes its three GEMMs:

    fprop:  C  = A @ B    (a=A, b=B)
    dgrad:  dA = dC @ B^T (a=dC, b=B)
    wgrad:  dB = A^T @ dC (a=A, b=dC)

    plus the settings of the concerns its operands' formats use (SITE_CONCERNS: MX scale rule,
    NVFP4 variants, HiFP8 and FP8 scaling, how its GEMMs compute), the operand slots it rounds
    stochastically ("fprop.a", ... see OPERAND_SLOTS; MX, NVFP4 and FP8 operands), its Hadamard transform
    (linear sites only) and whether its weights are quantized in 2-D tiles (NVFP4 16x16, FP8
    blockwise 128x128; linear sites)."""

    fprop: OperandFormats = OperandFormats()
    dgrad: OperandFormats = OperandFormats()
    wgrad: OperandFormats = OperandFormats()
    mx: MxSettings = MxSettings()
    nvfp4: Nvfp4Settings = Nvfp4Settings()
    hifp8: HiFP8Settings = HiFP8Settings()
    fp8: Fp8Settings = Fp8Settings()
    gemm: GemmSettings = GemmSettings()
    stochastic: FrozenSet[str] = frozenset()
    rht: RhtSettings = RhtSettings()
    weight_2d: bool = False
    # Operand slots whose FP8 operands take their scale from an amax history whatever the
    # FP8 scaling of the rest (TransformerEngine's FP8 attention: S and dP delayed).
    delayed_slots: FrozenSet[str] = frozenset()
    # Linear operands ("input", "weight") whose backward copies are quantized from the
    # forward's dequantized tensor (rounded to the input dtype) instead of the original: TE's
    # HybridQuantizer with columnwise_source="rowwise_dequantized".
    dequantized_sources: FrozenSet[str] = frozenset()

    def __post_init__(self):
        for gemm in GEMMS:
            ops = getattr(self, gemm)
            if not isinstance(ops, OperandFormats):
                raise TypeError(f"MatmulQuantConfig.{gemm} must be OperandFormats, "
                                f"got {type(ops).__name__}")
        object.__setattr__(self, "dequantized_sources", frozenset(self.dequantized_sources))
        if not self.dequantized_sources <= {"input", "weight"}:
            raise SettingError(f"dequantized sources {sorted(self.dequantized_sources)}: "
                               "'input' and/or 'weight'")
        for name in ("stochastic", "delayed_slots"):
            object.__setattr__(self, name, frozenset(getattr(self, name)))
            unknown = sorted(set(getattr(self, name)) - set(OPERAND_SLOTS))
            if unknown:
                raise SettingError(f"unknown operand slots {unknown}; valid: "
                                   f"{', '.join(OPERAND_SLOTS)}")
        if self.delayed_slots and self.fp8.scaling == "blockwise":
            raise SettingError("delayed-scaled operand slots take one scale per tensor, not "
                               "the blockwise recipe's tiles")
        self._check_nvfp4_variants()

    def _check_nvfp4_variants(self) -> None:
        """TransformerEngine refuses 4/6 and row scaling on operands it rotates (RHT) or rounds
        stochastically; so does this (a linear site's operand slots, by role)."""
        for slot, role in LINEAR_SLOT_ROLES.items():
            gemm, side = slot.split(".")
            options = self.nvfp4.operand_options(role)
            if not options or getattr(getattr(self, gemm), side) != "nvfp4":
                continue
            what = " and ".join(name for name, key in (("4/6", "four_over_six"),
                                                       ("row scaling", "row_scaled"))
                                if key in options)
            if slot in self.stochastic:
                raise SettingError(f"NVFP4 {what} of the {role}s with stochastic rounding of "
                                   f"them ({slot}): TransformerEngine's {what} rounds to "
                                   "nearest; drop one of them")
            if gemm in self.rht.gemms:
                raise SettingError(f"NVFP4 {what} of the {role}s with the Hadamard transform "
                                   f"on {gemm}: TransformerEngine refuses the combination "
                                   "(its recipes need disable_rht); drop one of them")

    def replace(self, **changes) -> "MatmulQuantConfig":
        return dataclasses.replace(self, **changes)

    @property
    def formats(self) -> FrozenSet[str]:
        """Every operand format of the three GEMMs ("none" included)."""
        return frozenset(getattr(getattr(self, g), side) for g in GEMMS for side in ("a", "b"))

    @property
    def enabled(self) -> bool:
        """True when any operand of any GEMM is quantized."""
        return self.fprop.enabled or self.dgrad.enabled or self.wgrad.enabled

    def saturate_for(self, fmt: str) -> Optional[bool]:
        """The fake_quantize `saturate` argument this config uses for `fmt`."""
        return self.hifp8.saturate if fmt == "hifp8" else None

    def tensor_scaled(self, fmt: str, slot: Optional[str] = None) -> bool:
        """True when operands in `fmt` (in operand slot `slot`) get one scale for the whole
        tensor: HiFP8 with scaling "tensor" (a power-of-two exponent), NVFP4 (its float32
        tensor scale) and FP8 with tensorwise or delayed scaling. An operand quantized in
        pieces (chunked attention) must be given the whole operand's scale
        (gemm.whole_tensor_scale)."""
        if fmt == "hifp8":
            return self.hifp8.scaling == "tensor"
        if fmt == "nvfp4":
            return True
        return fmt.startswith("fp8_") and (self.fp8.scaling in ("tensorwise", "delayed")
                                           or self.delayed(fmt, slot))

    def delayed(self, fmt: str, slot: Optional[str] = None) -> bool:
        """True when an operand in `fmt` (in operand slot `slot`, "fprop.a", ...) takes its
        scale from an amax history; without a slot: whether any slot in `fmt` can."""
        if not fmt.startswith("fp8_"):
            return False
        if self.fp8.scaling == "delayed":
            return True
        return bool(self.delayed_slots) if slot is None else slot in self.delayed_slots

    def weight_tiles(self, fmt: str) -> bool:
        """True when weights in `fmt` are quantized in 2-D tiles (NVFP4 16x16, FP8 blockwise
        128x128); other formats have no 2-D variant."""
        return self.weight_2d and (fmt == "nvfp4" or (fmt.startswith("fp8_")
                                                      and self.fp8.scaling == "blockwise"))

    def stochastic_slot(self, gemm: str, side: str, fmt: str) -> bool:
        """True when the operand in slot gemm.side is stochastically rounded."""
        return (f"{gemm}.{side}" in self.stochastic and fmt != "none"
                and format_info(fmt).kind in _STOCHASTIC_KINDS)

    def reusable(self, gemm: str, side: str, fmt: str) -> bool:
        """True when quantizing the same tensor again in slot gemm.side gives the same bits, so
        one quantization may serve several uses: round to nearest and a scale from the tensor
        itself. A stochastically rounded operand draws anew at every call and a delayed-scaled
        one steps its amax history, so those are quantized at every use."""
        return (not self.stochastic_slot(gemm, side, fmt)
                and not self.delayed(fmt, f"{gemm}.{side}"))


NONE = MatmulQuantConfig()
SITE_KINDS = ("linear", "attn_qk", "attn_pv", "output_layer")


@dataclass(frozen=True)
class QuantConfig:
    """The resolved quantization decision for every GEMM site of a model, and how the run
    executes it.

    A site's config: high precision if its layer is in `skip_layers` (--quant-skip-layers,
    --first-last-layers-bf16); else the config of the first recipe-file matcher its global
    module path matches (`rules`); else the config of its kind. `settings` are the typed
    settings it was resolved from, with what the flags imply applied (provenance)."""

    scheme: str = "bf16"
    linear: MatmulQuantConfig = NONE
    attn_qk: MatmulQuantConfig = NONE
    attn_pv: MatmulQuantConfig = NONE
    output_layer: MatmulQuantConfig = NONE
    skip_layers: FrozenSet[int] = field(default_factory=frozenset)
    notes: tuple = ()
    recipe: Optional[str] = None                       # --quant-recipe NAME
    rules: Any = field(default=None, compare=False)    # --quant-recipe-file (RecipeRules)
    backend: BackendSettings = field(default_factory=BackendSettings)
    settings: QuantSettings = field(default_factory=QuantSettings, compare=False)

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

    def site_configs(self) -> List[MatmulQuantConfig]:
        """Every site config this decision can hand out: per kind, and a recipe file's."""
        configs = [getattr(self, kind) for kind in SITE_KINDS]
        if self.rules is not None:
            configs += list(self.rules.configs.values())
        return configs

    @property
    def label(self) -> str:
        """The run's label (see QuantSettings.label)."""
        return self.settings.label()

    @property
    def source(self) -> str:
        """Where the label comes from, for the start-up line."""
        s = self.settings
        if s.recipe.recipe:
            return "--quant-recipe"
        source = "--fp8-format" if self.scheme != (s.scheme.scheme or "bf16") else s.scheme.source
        return source + (" and --quant-recipe-file" if s.recipe.recipe_file else "")

    def replace(self, **changes) -> "QuantConfig":
        return dataclasses.replace(self, **changes)
