"""Scheme specs of tools/evaluate.py: what one evaluated arm quantizes.

    SPEC   = NAME [ "@" FLAG [ "=" VALUE ] { "," FLAG [ "=" VALUE ] } ]
    NAME   = a --quant-scheme (bf16, linear_mxfp4, FA_linear_nvfp4, ...)
           | recipe_<name>            a named recipe (--quant-recipe <name>: recipe_nvfp4, ...)
           | PATH.yaml | PATH.yml | PATH.json   a recipe file (--quant-recipe-file PATH)
    FLAG   = a pretrain_gpt.py quantization flag without its dashes; a list value joins its
             items with "+" (quant-rht-gemms=fprop+wgrad); a switch takes no value, =true or
             =false (nvfp4-row-scaled-activation=true, quant-weight-cache=false)

e.g. `linear_mxfp8@mx-scale-mode=rceil`,
`linear_nvfp4@quant-stochastic-rounding=grad,quant-fprop=none`.
The spec is the arm's label. Quantization flags given on the command line apply to every arm;
a spec's own flags apply on top of them. A spec can set quantization flags only (config.py):
anything else (a sequence length, a seed) is the run's, shared by every arm, and an error here.
"""

from __future__ import annotations

from typing import List, Tuple

from megatron.quantization import schedule
from megatron.quantization.config import (
    RECIPE_NAMES, SCHEMES, QuantConfig, QuantSettings, SettingError, settings_from_flags,
    switch_flags)
from megatron.quantization.schemes import resolve
from megatron.training.errors import ConfigError

RECIPE_FILE_SUFFIXES = (".yaml", ".yml", ".json")
# The flags a spec's name stands for: after '@' they would evaluate another arm than the
# label says.
NAMED_BY_SPEC = ("quant-scheme", "quant-recipe", "quant-recipe-file")


def split_spec(spec: str) -> Tuple[str, List[str]]:
    """(name, extra argv) of a spec."""
    name, _, flags = spec.partition("@")
    if name.startswith("recipe_") and name[len("recipe_"):] in RECIPE_NAMES:
        argv = ["--quant-recipe", name[len("recipe_"):]]
    elif name.endswith(RECIPE_FILE_SUFFIXES):
        argv = ["--quant-recipe-file", name]
    elif name in SCHEMES:
        argv = ["--quant-scheme", name]
    else:
        recipes = ", ".join(f"recipe_{r}" for r in RECIPE_NAMES)
        raise ConfigError(f"--schemes {spec!r}: {name!r} is not a scheme ({', '.join(SCHEMES)}), "
                          f"a recipe ({recipes}) or a recipe file (*.yaml, *.yml, *.json)")
    for item in filter(None, flags.split(",")):
        flag, has_value, value = item.partition("=")
        if flag.lstrip("-") in NAMED_BY_SPEC:
            raise ConfigError(f"--schemes {spec!r}: {flag} is what the spec's name says (the "
                              "arm's label); give it as the name (a scheme, recipe_<name> or "
                              "a recipe file), not after '@'")
        flag = "--" + flag.lstrip("-")
        if has_value and flag in switch_flags():
            argv.append(_switch(spec, flag, value))
            continue
        argv.append(flag)
        if has_value:
            argv.extend(value.split("+"))
    return name, argv


def _switch(spec: str, flag: str, value: str) -> str:
    """The flag a switch's `flag=value` stands for: flag for true, --no-... for false."""
    can_switch_off = switch_flags()[flag]
    if value.lower() == "true":
        return flag
    if value.lower() == "false" and can_switch_off:
        return "--no-" + flag[2:]
    if value.lower() == "false":
        raise ConfigError(f"--schemes {spec!r}: {flag} is a switch that is off unless given; "
                          f"leave it out rather than give it =false")
    valid = "no value, true or false" if can_switch_off else "no value (or true)"
    raise ConfigError(f"--schemes {spec!r}: {flag} is a switch: it takes {valid}, not "
                      f"{value!r}")


def arm_config(spec: str, base: QuantSettings, num_layers: int, seed: int) -> QuantConfig:
    """The QuantConfig of one arm: the run's quantization settings `base` with the spec's
    scheme and flags applied, or ConfigError naming the spec."""
    _, argv = split_spec(spec)
    base = base.replace(scheme=base.scheme.replace(scheme="bf16", source="default"),
                        recipe=base.recipe.replace(recipe=None, recipe_file=None))
    try:
        settings = settings_from_flags(argv, base=base)
        if settings.recipe.schedule:
            raise SettingError(schedule.NOT_IN_EVALUATION)
        return resolve(settings, num_layers, seed)
    except SettingError as exc:
        raise ConfigError(f"--schemes {spec!r}: {exc}") from None
