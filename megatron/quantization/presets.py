"""Named recipes (--quant-recipe NAME): the FP4 recipes of the papers, Megatron-Bridge's
mixed-precision recipes and TransformerEngine's quantizer-factory combinations, each as the
per-GEMM, per-operand config of the linear layers plus the BF16 layers it keeps.

A preset fixes the formats, the stochastic rounding, the Hadamard transform, the weight tiles
and the settings of its concerns it defines (an MXFP8 preset's scale rule, an FP8 preset's
scaling); the run's flags give the rest (RECIPE_SOURCES in config.py says what each one
reproduces, and from where). A flag that contradicts a setting the preset defines is an error.
Attention stays in high precision under every preset, as in its source.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Dict, Optional, Tuple

from megatron.quantization.config import (
    RECIPE_SOURCES, SITE_CONCERNS, STOCHASTIC_SLOTS, MatmulQuantConfig, OperandFormats,
    QuantSettings, RhtSettings, SettingError, setting_name)

NVFP4_ALL = OperandFormats("nvfp4", "nvfp4")
MXFP8_ALL = OperandFormats("mxfp8_e4m3", "mxfp8_e4m3")
# Nemotron-3 Super's NVFP4 preset keeps its last 14 layers in BF16 (Megatron-Bridge).
NEMOTRON_3_SUPER_BF16_AT_END = 14


@dataclass(frozen=True)
class Preset:
    """A named recipe resolved for a model: the linear layers' config, the (start, end) layer
    counts kept in BF16, and notes for the start-up table."""

    linear: MatmulQuantConfig
    bf16_layers: Tuple[int, int]
    notes: Tuple[str, ...] = ()


def nvfp4_bf16_layers_at_end(num_layers: int) -> int:
    """The NVFP4 paper's BF16 tail: about 15% of the layers, at least one."""
    return max(1, int(math.floor(0.15 * num_layers + 0.5)))


# name -> {concern: {field: value}}: the settings each preset defines.
_FP8_HYBRID = MappingProxyType({"format": "hybrid"})
_DEFINED = MappingProxyType({
    "nvfp4": {},
    "mxfp4_rht_sr": {},
    "bf16_with_mxfp8_mixed": {"mx": {"scale_mode": "rceil", "grad_format": "e4m3"}},
    "bf16_with_fp8_current_scaling_mixed": {"fp8": dict(_FP8_HYBRID, recipe="tensorwise")},
    "bf16_with_fp8_delayed_scaling_mixed": {"fp8": dict(
        _FP8_HYBRID, recipe="delayed", margin=0, amax_history_len=1024,
        amax_compute_algo="max")},
    "bf16_with_fp8_subchannel_scaling_mixed": {"fp8": dict(_FP8_HYBRID, recipe="blockwise")},
    "bf16_with_nvfp4_mixed": {},
    "nemotron_3_super_bf16_with_nvfp4_mixed": {},
    "mxfp8_fwd_nvfp4_bwd": {"mx": {"scale_mode": "rceil"}},
    "high_precision_fwd_mxfp8_bwd": {"mx": {"scale_mode": "rceil", "grad_format": "e4m3"}},
    "mxfp8_fwd_high_precision_bwd": {"mx": {"scale_mode": "rceil"},
                                     "gemm": {"backward_override": "dequantized"}},
    "nvfp4_1d_weight": {},
    "nvfp4_4over6": {"nvfp4": {"four_over_six": "all", "four_over_six_err_mode": "mae",
                               "four_over_six_e4m3_use_256": "all"}},
    "nvfp4_row_scaled_fwd_high_precision_bwd": {"nvfp4": {"row_scaled_activation": True},
                                                "gemm": {"backward_override": "dequantized"}},
})
assert set(_DEFINED) == set(RECIPE_SOURCES), "every named recipe has a preset and a source"


def _layout(name: str, seed: int) -> Tuple[dict, Tuple[int, int]]:
    """(MatmulQuantConfig pieces, BF16 layer counts before the model size is known: an end
    count of -1 means the NVFP4 paper's 15%)."""
    nvfp4_recipe = dict(fprop=NVFP4_ALL, dgrad=NVFP4_ALL, wgrad=NVFP4_ALL,
                        stochastic=STOCHASTIC_SLOTS["grad"],
                        rht=RhtSettings(("wgrad",), 16, seed), weight_2d=True)
    fp8 = dict(fprop=OperandFormats("fp8_e4m3", "fp8_e4m3"),
               dgrad=OperandFormats("fp8_e5m2", "fp8_e4m3"),
               wgrad=OperandFormats("fp8_e4m3", "fp8_e5m2"))
    if name == "nvfp4":
        return nvfp4_recipe, (0, -1)
    if name == "mxfp4_rht_sr":
        mxfp4 = OperandFormats("mxfp4", "mxfp4")
        return dict(dgrad=mxfp4, wgrad=mxfp4,
                    stochastic=frozenset({"dgrad.a", "dgrad.b", "wgrad.a", "wgrad.b"}),
                    rht=RhtSettings(("dgrad", "wgrad"), 64, seed)), (0, 0)
    if name in ("bf16_with_mxfp8_mixed", "high_precision_fwd_mxfp8_bwd"):
        fprop = OperandFormats() if name.startswith("high_precision") else MXFP8_ALL
        return dict(fprop=fprop, dgrad=MXFP8_ALL, wgrad=MXFP8_ALL), (0, 0)
    if name == "bf16_with_fp8_current_scaling_mixed":
        return fp8, (1, 1)
    if name == "bf16_with_fp8_delayed_scaling_mixed":
        return fp8, (0, 0)
    if name == "bf16_with_fp8_subchannel_scaling_mixed":
        return dict(fp8, weight_2d=True), (0, 0)
    if name == "bf16_with_nvfp4_mixed":
        return nvfp4_recipe, (0, 0)
    if name == "nemotron_3_super_bf16_with_nvfp4_mixed":
        return nvfp4_recipe, (0, NEMOTRON_3_SUPER_BF16_AT_END)
    if name == "mxfp8_fwd_nvfp4_bwd":
        # dgrad: dY in NVFP4 with SR; W as 1-D NVFP4 requantized from the MXFP8-dequantized
        # weight. wgrad: X and dY in NVFP4 with RHT 16, dY with SR (TE's nvfp4_factory).
        return dict(fprop=MXFP8_ALL, dgrad=NVFP4_ALL, wgrad=NVFP4_ALL,
                    stochastic=STOCHASTIC_SLOTS["grad"], rht=RhtSettings(("wgrad",), 16, seed),
                    dequantized_sources=frozenset({"weight"})), (0, 0)
    if name == "mxfp8_fwd_high_precision_bwd":
        return dict(fprop=MXFP8_ALL, dgrad=OperandFormats(), wgrad=OperandFormats()), (0, 0)
    if name == "nvfp4_1d_weight":
        return dict(nvfp4_recipe, weight_2d=False,
                    dequantized_sources=frozenset({"weight"})), (0, 0)
    if name == "nvfp4_4over6":
        return dict(fprop=NVFP4_ALL, dgrad=NVFP4_ALL, wgrad=NVFP4_ALL, weight_2d=True), (0, 0)
    if name == "nvfp4_row_scaled_fwd_high_precision_bwd":
        return dict(fprop=NVFP4_ALL, dgrad=OperandFormats(), wgrad=OperandFormats()), (0, 0)
    raise SettingError(f"unknown recipe {name!r}; valid: {', '.join(RECIPE_SOURCES)}")


def defined_settings(name: str) -> Dict[str, Dict[str, object]]:
    """{concern: {field: value}} of the settings named recipe `name` defines."""
    return {concern: dict(fields) for concern, fields in _DEFINED[name].items()}


def named_recipe(name: str, num_layers: int, seed: int,
                 base: Optional[QuantSettings] = None) -> Preset:
    """The linear layers' config and BF16 layers of named recipe `name` for a model of
    `num_layers`; its site concerns are the run's settings `base` with what the recipe defines
    applied (a flag given at another value than the recipe's, or another value the flags
    imply, is a SettingError)."""
    base = base or QuantSettings()
    pieces, (start, end) = _layout(name, seed)
    concerns = {c: getattr(base, c) for c in SITE_CONCERNS}
    for concern, fields in _DEFINED[name].items():
        run, default = concerns[concern], type(concerns[concern])()
        for field_name, value in fields.items():
            current = getattr(run, field_name)
            flag = setting_name(type(run), field_name)
            if current == value or (flag not in base.given
                                    and current == getattr(default, field_name)):
                continue
            sets = f"--quant-recipe {name} sets {flag} {_text(value)}"
            implied = _implied_by(base, concern)
            if flag in base.given or implied is None:
                raise SettingError(f"{sets}; drop {flag} {_text(current)}")
            raise SettingError(f"{sets}, but {implied} imply {flag} {_text(current)}; change "
                               f"or drop {implied.split(' --')[0]}")
        concerns[concern] = dataclasses.replace(run, **fields)
    notes = []
    if end == -1:
        end = nvfp4_bf16_layers_at_end(num_layers)
    elif end > num_layers:
        notes.append(f"--quant-recipe {name} keeps its last {end} layers in BF16: with "
                     f"{num_layers} layers every layer is in BF16")
        end = num_layers
    return Preset(MatmulQuantConfig(**pieces, **concerns), (start, end), tuple(notes))


def _implied_by(settings: QuantSettings, concern: str) -> Optional[str]:
    """The flags that imply the settings of `concern` (--fp8-format F --fp8-recipe mxfp8: the
    MX scale rule and gradient format), or None."""
    fp8 = settings.fp8
    if concern == "mx" and fp8.recipe == "mxfp8" and fp8.format is not None:
        return f"--fp8-format {fp8.format} --fp8-recipe mxfp8"
    return None


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
