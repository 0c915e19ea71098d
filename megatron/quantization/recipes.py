"""Quantization recipes: the named FP4 recipes of the papers, and recipe files in megatron-core's
own `RecipeConfig` shape (named configs + ordered glob matchers over module paths).

A recipe file (YAML or JSON) reads

    configs:
      fp4:                        # how a matched GEMM site is quantized (keys below)
        format: nvfp4
        weight_2d: true
        stochastic_rounding: grad
        wgrad: {format: nvfp4, rht: 16}
      hp: {format: none}
    matchers:                     # first match wins; megatron-core's matcher fields
      last_layer: {config: hp, type: glob, pattern: "decoder.layers.3.*", enabled: true}
      linear:     {config: fp4, type: glob, pattern: "*linear_*", enabled: true}

and is parsed with megatron.core.quantization.quant_config.RecipeConfig. Module paths are the
model's with GLOBAL layer indices (0-based, as megatron names them): decoder.layers.3.mlp.linear_fc1,
decoder.layers.0.self_attention.linear_qkv, decoder.layers.0.self_attention.core_attention.qk
(and .pv), output_layer; under pipeline parallelism a stage's local index is translated, so a
pattern means the same layer whatever the layout. Sites no matcher matches keep what the
scheme and flags give them.

Config keys (every one optional; unknown keys are an error):
    format              format of every operand of fprop, dgrad and wgrad ("none": high precision)
    grad_format         format of the gradient operands (dY of dgrad and wgrad)
    fprop/dgrad/wgrad   that GEMM: a format, or {format, a, b, rht, stochastic: [a, b]} where a
                        and b are its two operands (linear: fprop input/weight, dgrad
                        grad_output/weight, wgrad input/grad_output) and rht a Hadamard block
                        (16, 32, 64, 128; 0 = off; one block size per config)
    stochastic_rounding none | grad (the dY operands) | all
    weight_2d           weights in 2-D tiles (NVFP4 16x16, FP8 blockwise 128x128)
    scale_mode          MX scale rule: floor | rceil
    hifp8_scaling       none | tensor
    fp8_recipe          tensorwise | delayed | blockwise; fp8_margin, fp8_pow2_scale,
                        fp8_amax_history_len, fp8_amax_compute_algo as the --fp8-* flags
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from megatron.quantization.formats import SCALE_MODES, canonical_format
from megatron.quantization.gemm import (
    FP8_RECIPES, GEMMS, GRADIENT_SLOTS, HIFP8_SCALINGS, OPERAND_SLOTS, RHT_BLOCKS, Fp8Settings,
    MatmulQuantConfig, OperandFormats)

STOCHASTIC_ROUNDINGS = ("none", "grad", "all")
STOCHASTIC_SLOTS = {"none": frozenset(), "grad": GRADIENT_SLOTS, "all": frozenset(OPERAND_SLOTS)}
RECIPE_NAMES = ("nvfp4", "mxfp4_rht_sr")

# What each named recipe reproduces (README and --help point here).
RECIPE_SOURCES = {
    "nvfp4": "NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149; TransformerEngine "
             "NVFP4BlockScaling): fprop/dgrad/wgrad of every linear layer in NVFP4, weights in "
             "16x16 tiles, RHT 16 on wgrad, stochastic rounding of gradients, the last ~15% of "
             "the layers (at least one) and attention in BF16",
    "mxfp4_rht_sr": "Tseng, Yu, Park 2025 (arXiv 2502.20586): forward in BF16, dgrad and wgrad "
                    "of every linear layer in MXFP4 with a random Hadamard transform of block 64 "
                    "and stochastic rounding of their operands",
}

_CONFIG_KEYS = ("format", "grad_format", "fprop", "dgrad", "wgrad", "stochastic_rounding",
                "weight_2d", "scale_mode", "hifp8_scaling", "fp8_recipe", "fp8_margin",
                "fp8_pow2_scale", "fp8_amax_history_len", "fp8_amax_compute_algo")
_GEMM_KEYS = ("format", "a", "b", "rht", "stochastic")


class RecipeError(ValueError):
    """A recipe file or recipe setting that cannot be used; the message is one line."""


def nvfp4_bf16_layers_at_end(num_layers: int) -> int:
    """The NVFP4 recipe's BF16 tail: about 15% of the layers, at least one."""
    return max(1, int(math.floor(0.15 * num_layers + 0.5)))


def bf16_layer_numbers(num_layers: int, at_start: int, at_end: int) -> frozenset:
    """1-based layer numbers of the first `at_start` and last `at_end` layers."""
    for label, n in (("--num-layers-at-start-in-bf16", at_start),
                     ("--num-layers-at-end-in-bf16", at_end)):
        if not isinstance(n, int) or n < 0 or n > num_layers:
            raise RecipeError(f"{label} {n}: must be in 0..{num_layers} (--num-layers)")
    return frozenset(range(1, at_start + 1)) | frozenset(
        range(num_layers - at_end + 1, num_layers + 1))


# --------------------------------------------------------------------------------------------
# One config payload -> MatmulQuantConfig
# --------------------------------------------------------------------------------------------

def _format(value, where: str) -> str:
    try:
        return canonical_format(value)
    except ValueError as exc:
        raise RecipeError(f"{where}: {exc}") from None


def _choice(value, valid, where: str):
    if value not in valid:
        raise RecipeError(f"{where}: {value!r} is not one of {', '.join(map(str, valid))}")
    return value


def _check_mapping(mapping, where: str) -> None:
    if not isinstance(mapping, dict):
        raise RecipeError(f"{where}: expected a mapping, got {type(mapping).__name__}")


def _check_keys(mapping, valid, where: str) -> None:
    _check_mapping(mapping, where)
    unknown = sorted(set(mapping) - set(valid))
    if unknown:
        raise RecipeError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}; valid: "
                          f"{', '.join(valid)}")


def config_from_payload(payload: dict, where: str, seed: int = 0,
                        grad_variant=lambda fmt: fmt,
                        base_fp8: Optional[Fp8Settings] = None) -> MatmulQuantConfig:
    """The MatmulQuantConfig a recipe-file config describes. `grad_variant(fmt)` gives the
    gradient-operand format of a GEMM in `fmt` unless grad_format says otherwise (MXFP8:
    --mx-grad-format); `base_fp8` the --fp8-* settings the keys fp8_* override."""
    _check_keys(payload, _CONFIG_KEYS, where)
    default = _format(payload.get("format", "none"), f"{where}.format")
    grad_format = payload.get("grad_format")
    if grad_format is not None:
        grad_format = _format(grad_format, f"{where}.grad_format")
    gemm_formats, stochastic, rht_gemms, rht_blocks = {}, set(), [], set()
    sr = _choice(payload.get("stochastic_rounding", "none"), STOCHASTIC_ROUNDINGS,
                 f"{where}.stochastic_rounding")
    stochastic |= STOCHASTIC_SLOTS[sr]
    for gemm in GEMMS:
        spec = payload.get(gemm, default)
        gwhere = f"{where}.{gemm}"
        if not isinstance(spec, dict):
            spec = {"format": spec}
        _check_keys(spec, _GEMM_KEYS, gwhere)
        fmt = _format(spec.get("format", default), f"{gwhere}.format")
        grad = grad_format if grad_format is not None else grad_variant(fmt)
        # Gradient operands: dgrad's a and wgrad's b.
        a = _format(spec.get("a", grad if gemm == "dgrad" else fmt), f"{gwhere}.a")
        b = _format(spec.get("b", grad if gemm == "wgrad" else fmt), f"{gwhere}.b")
        gemm_formats[gemm] = OperandFormats(a, b)
        rht = spec.get("rht", 0)
        if rht:
            rht_blocks.add(_choice(rht, RHT_BLOCKS, f"{gwhere}.rht"))
            rht_gemms.append(gemm)
        sides = spec.get("stochastic", [])
        if not isinstance(sides, list) or any(side not in ("a", "b") for side in sides):
            raise RecipeError(f"{gwhere}.stochastic: expected a list of operands a, b; got "
                              f"{sides!r}")
        stochastic |= {f"{gemm}.{side}" for side in sides}
    if len(rht_blocks) > 1:
        raise RecipeError(f"{where}: one Hadamard block size per config, got "
                          f"{sorted(rht_blocks)}")
    weight_2d = payload.get("weight_2d", False)
    if not isinstance(weight_2d, bool):
        raise RecipeError(f"{where}.weight_2d: expected true or false, got {weight_2d!r}")
    base = base_fp8 or Fp8Settings()
    try:
        fp8 = Fp8Settings(
            recipe=_choice(payload.get("fp8_recipe", base.recipe), FP8_RECIPES,
                           f"{where}.fp8_recipe"),
            margin=payload.get("fp8_margin", base.margin),
            pow2_scale=payload.get("fp8_pow2_scale", base.pow2_scale),
            amax_history_len=payload.get("fp8_amax_history_len", base.amax_history_len),
            amax_compute_algo=payload.get("fp8_amax_compute_algo", base.amax_compute_algo))
        return MatmulQuantConfig(
            fprop=gemm_formats["fprop"], dgrad=gemm_formats["dgrad"],
            wgrad=gemm_formats["wgrad"],
            scale_mode=_choice(payload.get("scale_mode", "floor"), SCALE_MODES,
                               f"{where}.scale_mode"),
            hifp8_scaling=_choice(payload.get("hifp8_scaling", "none"), HIFP8_SCALINGS,
                                  f"{where}.hifp8_scaling"),
            stochastic=frozenset(stochastic), rht_gemms=tuple(rht_gemms),
            rht_block=rht_blocks.pop() if rht_blocks else 16, rht_seed=seed,
            weight_2d=weight_2d, fp8=fp8)
    except ValueError as exc:
        if isinstance(exc, RecipeError):
            raise
        raise RecipeError(f"{where}: {exc}") from None


# --------------------------------------------------------------------------------------------
# Recipe files
# --------------------------------------------------------------------------------------------

def _read_file(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise RecipeError(f"--quant-recipe-file {path}: cannot read it ({exc.strerror or exc})") \
            from None
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml
            data = yaml.safe_load(text)
    except Exception as exc:   # yaml.YAMLError, json.JSONDecodeError
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RecipeError(f"--quant-recipe-file {path}: not valid "
                          f"{'JSON' if path.endswith('.json') else 'YAML'} ({detail})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"--quant-recipe-file {path}: expected a mapping with 'configs' and "
                          f"'matchers', got {type(data).__name__}")
    return data


@dataclass
class RecipeRules:
    """A parsed recipe file: megatron-core's RecipeConfig and the resolved config per key."""

    path: str
    recipe: object                                 # megatron.core ... RecipeConfig
    configs: Dict[str, MatmulQuantConfig]
    matched: Dict[str, str] = field(default_factory=dict)   # site path -> config key

    def match(self, path: str, layer_number: Optional[int]) -> Optional[Tuple[str, MatmulQuantConfig]]:
        from megatron.core.quantization.quant_config import MatchContext
        key = self.recipe.match_to_config_key(MatchContext(path, layer_number))
        if key is None:
            return None
        self.matched[path] = key
        return key, self.configs[key]


def load_recipe_file(path: str, seed: int = 0, grad_variant=lambda fmt: fmt,
                     base_fp8: Optional[Fp8Settings] = None) -> RecipeRules:
    """Parse a recipe file with megatron-core's RecipeConfig and validate every config and
    matcher (one RecipeError line for the first problem)."""
    from megatron.core.quantization.quant_config import RecipeConfig
    data = _read_file(path)
    where = f"--quant-recipe-file {path}"
    _check_keys(data, ("configs", "matchers"), where)
    configs = data.get("configs") or {}
    matchers = data.get("matchers") or {}
    _check_mapping(configs, f"{where}: configs")
    _check_mapping(matchers, f"{where}: matchers")
    if not matchers:
        raise RecipeError(f"{where}: no matchers (nothing would be matched)")
    for name, matcher in matchers.items():
        mwhere = f"{where}: matcher {name}"
        _check_keys(matcher, ("config", "type", "pattern", "enabled"), mwhere)
        for key in ("config", "type", "pattern"):
            if key not in matcher:
                raise RecipeError(f"{mwhere}: missing '{key}'")
        _choice(matcher["type"], ("glob",), f"{mwhere}.type")
        if matcher["config"] not in configs:
            raise RecipeError(f"{mwhere}: config {matcher['config']!r} is not defined under "
                              f"configs (defined: {', '.join(map(str, configs)) or 'none'})")
        if not isinstance(matcher["pattern"], str):
            raise RecipeError(f"{mwhere}.pattern: expected a string, got {matcher['pattern']!r}")
    resolved = {key: config_from_payload(payload if payload is not None else {},
                                         f"{where}: configs.{key}", seed, grad_variant, base_fp8)
                for key, payload in configs.items()}
    if not any(m.get("enabled", False) for m in matchers.values()):
        raise RecipeError(f"{where}: every matcher is disabled (megatron-core's default is "
                          "enabled: false; add enabled: true)")
    return RecipeRules(path, RecipeConfig.from_config_dict(data), resolved)


_LAYER_PATH = re.compile(r"(^|\.)layers\.(\d+)(?=\.|$)")


def global_module_path(name: str, layer_number: Optional[int]) -> str:
    """The module path with the transformer layer's index made global (layer_number - 1):
    under pipeline parallelism a stage names its layers from 0."""
    if layer_number is None:
        return name
    match = _LAYER_PATH.search(name)
    if match is None:
        return name
    start, end = match.span(2)
    return name[:start] + str(layer_number - 1) + name[end:]
