"""Recipe files in megatron-core's own `RecipeConfig` shape (named configs + ordered glob
matchers over module paths); the named recipes are presets.py's.

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
and every setting config.py gives a recipe key, e.g.
    scale_mode          MX scale rule (--mx-scale-mode)
    hifp8_scaling       none | tensor (--hifp8-scaling)
    fp8_recipe          tensorwise | delayed | blockwise; fp8_margin, fp8_pow2_scale,
                        fp8_amax_history_len, fp8_amax_compute_algo as the --fp8-* flags
A setting a config does not name keeps the run's flag value.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from megatron.quantization.config import (
    GEMMS, RHT_BLOCKS, SITE_CONCERNS, STOCHASTIC_SLOTS, MatmulQuantConfig,
    OperandFormats, QuantSettings, RhtSettings, SettingError, check_setting, recipe_key_settings)
from megatron.quantization.formats import canonical_format

STOCHASTIC_ROUNDINGS = tuple(STOCHASTIC_SLOTS)


# Keys of a config besides the settings' recipe keys; stochastic_rounding and weight_2d are
# RecipeSettings' keys, which a config turns into its own operand slots and tiles.
_LAYOUT_KEYS = ("format", "grad_format", "fprop", "dgrad", "wgrad")
_GEMM_KEYS = ("format", "a", "b", "rht", "stochastic")


class RecipeError(SettingError):
    """A recipe file or recipe setting that cannot be used; the message is one line."""


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
    if value not in valid or type(value) is not type(valid[0]):
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


def _site_settings(payload: dict, where: str, base: QuantSettings) -> dict:
    """{concern: settings} of the site concerns, the payload's recipe keys applied on top of
    the run's settings (each value checked as its flag's would be)."""
    out = {concern: getattr(base, concern) for concern in SITE_CONCERNS}
    for key, (concern, f, tp) in recipe_key_settings().items():
        if key not in payload or concern not in out:
            continue
        value = payload[key]
        check_setting(f, tp, value, name=f"{where}.{key}")
        if concern == "fp8" and f.name == "recipe" and value == "mxfp8":
            raise RecipeError(f"{where}.{key}: 'mxfp8' is not an FP8 scaling (give the config "
                              "format mxfp8); valid: tensorwise, delayed, blockwise")
        try:
            out[concern] = out[concern].replace(**{f.name: value})
        except SettingError as exc:
            raise RecipeError(f"{where}.{key}: {exc}") from None
    return out


def config_from_payload(payload: dict, where: str, base: QuantSettings, seed: int = 0,
                        grad_variant=lambda fmt: fmt) -> MatmulQuantConfig:
    """The MatmulQuantConfig a recipe-file config describes. `grad_variant(fmt)` gives the
    gradient-operand format of a GEMM in `fmt` unless grad_format says otherwise (MXFP8:
    --mx-grad-format); `base` the run's settings, which the config's keys override."""
    keys = _LAYOUT_KEYS + tuple(recipe_key_settings())
    _check_keys(payload, keys, where)
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
    concerns = _site_settings(payload, where, base)
    try:
        return MatmulQuantConfig(
            fprop=gemm_formats["fprop"], dgrad=gemm_formats["dgrad"],
            wgrad=gemm_formats["wgrad"], stochastic=frozenset(stochastic),
            rht=RhtSettings(tuple(rht_gemms), rht_blocks.pop() if rht_blocks else 16, seed),
            weight_2d=weight_2d, **concerns)
    except SettingError as exc:
        if isinstance(exc, RecipeError):
            raise
        raise RecipeError(f"{where}: {exc}") from None


# --------------------------------------------------------------------------------------------
# Recipe files
# --------------------------------------------------------------------------------------------

# A recipe is a few dozen lines: anything larger is not one (and is never read whole).
MAX_RECIPE_BYTES = 1 << 20


def _unique_keys(pairs, where: str) -> dict:
    """A mapping from (key, value) pairs; a key given twice is an error (YAML and JSON
    parsers would keep the last in silence)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise RecipeError(f"{where}: {key!r} is given twice (a later one would silently "
                              "replace the earlier)")
        out[key] = value
    return out


def _yaml_loader(where: str):
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            self.flatten_mapping(node)
            return _unique_keys(((self.construct_object(k, deep=deep),
                                  self.construct_object(v, deep=deep))
                                 for k, v in node.value), where)

    return UniqueKeyLoader


def _read_file(path: str) -> dict:
    where = f"--quant-recipe-file {path}"
    try:
        info = os.stat(path)
    except OSError as exc:
        raise RecipeError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    if not stat.S_ISREG(info.st_mode):
        raise RecipeError(f"{where}: not a regular file (a directory, FIFO or device); give a "
                          "YAML or JSON file")
    if info.st_size > MAX_RECIPE_BYTES:
        raise RecipeError(f"{where}: {info.st_size:,} bytes, more than a recipe file's "
                          f"{MAX_RECIPE_BYTES:,}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_RECIPE_BYTES + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{where}: cannot read it ({getattr(exc, 'strerror', None) or exc})") \
            from None
    try:
        if path.endswith(".json"):
            data = json.loads(text, object_pairs_hook=lambda pairs: _unique_keys(pairs, where))
        else:
            import yaml
            data = yaml.load(text, Loader=_yaml_loader(where))     # safe: a SafeLoader
    except RecipeError:
        raise
    except Exception as exc:   # yaml.YAMLError, json.JSONDecodeError
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RecipeError(f"{where}: not valid "
                          f"{'JSON' if path.endswith('.json') else 'YAML'} ({detail})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a mapping with 'configs' and "
                          f"'matchers', got {type(data).__name__}")
    return data


@dataclass
class RecipeRules:
    """A parsed recipe file: megatron-core's RecipeConfig, the resolved config per key, and
    which of its enabled matchers (by name, in order) decided which sites."""

    path: str
    recipe: object                                 # megatron.core ... RecipeConfig
    configs: Dict[str, MatmulQuantConfig]
    matcher_names: Tuple[str, ...] = ()            # the enabled matchers, in order
    matched: Dict[str, str] = field(default_factory=dict)   # site path -> config key
    matched_by: Dict[str, str] = field(default_factory=dict)   # site path -> matcher name

    def match(self, path: str, layer_number: Optional[int]) -> Optional[Tuple[str, MatmulQuantConfig]]:
        from megatron.core.quantization.quant_config import MatchContext
        context = MatchContext(path, layer_number)
        key = self.recipe.match_to_config_key(context)
        if key is None:
            return None
        self.matched[path] = key
        # The first enabled matcher that matches decides (megatron-core's rule).
        for name, matcher in zip(self.matcher_names, self.recipe.matchers):
            if matcher.match(context) is not None:
                self.matched_by[path] = name
                break
        return key, self.configs[key]

    def unmatched(self, matched_names) -> List[str]:
        """The enabled matchers that decide no site, given the names that matched anywhere
        (over every pipeline stage)."""
        return [name for name in self.matcher_names if name not in set(matched_names)]


def load_recipe_file(path: str, base: Optional[QuantSettings] = None, seed: int = 0,
                     grad_variant=lambda fmt: fmt) -> RecipeRules:
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
        if not isinstance(matcher.get("enabled", False), bool):
            raise RecipeError(f"{mwhere}.enabled: expected true or false, got "
                              f"{matcher['enabled']!r}")
        for key in ("config", "type", "pattern"):
            if key not in matcher:
                raise RecipeError(f"{mwhere}: missing '{key}'")
        _choice(matcher["type"], ("glob",), f"{mwhere}.type")
        if matcher["config"] not in configs:
            raise RecipeError(f"{mwhere}: config {matcher['config']!r} is not defined under "
                              f"configs (defined: {', '.join(map(str, configs)) or 'none'})")
        if not isinstance(matcher["pattern"], str):
            raise RecipeError(f"{mwhere}.pattern: expected a string, got {matcher['pattern']!r}")
    base = base or QuantSettings()
    resolved = {key: config_from_payload(payload if payload is not None else {},
                                         f"{where}: configs.{key}", base, seed, grad_variant)
                for key, payload in configs.items()}
    if not any(m.get("enabled", False) for m in matchers.values()):
        raise RecipeError(f"{where}: every matcher is disabled (megatron-core's default is "
                          "enabled: false; add enabled: true)")
    names = tuple(name for name, m in matchers.items() if m.get("enabled", False))
    return RecipeRules(path, RecipeConfig.from_config_dict(data), resolved, names)


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
