"""Scheme specs of tools/evaluate.py: what one evaluated arm quantizes.

    SPEC   = NAME [ "@" FLAG [ "=" VALUE ] { "," FLAG [ "=" VALUE ] } ]
    NAME   = a --quant-scheme (bf16, linear_mxfp4, FA_linear_nvfp4, ...)
           | recipe_<name>            a named recipe (--quant-recipe <name>: recipe_nvfp4, ...)
           | PATH.yaml | PATH.yml | PATH.json   a recipe file (--quant-recipe-file PATH)
    FLAG   = any pretrain_gpt.py quantization flag without its dashes; a list value joins its
             items with "+" (quant-rht-gemms=fprop+wgrad)

e.g. `linear_mxfp8@mx-scale-mode=rceil`, `linear_nvfp4@quant-stochastic-rounding=grad,quant-fprop=none`.
The spec is the arm's label. Flags given on the command line apply to every arm; a spec's own
flags apply on top of them.
"""

from __future__ import annotations

import argparse
import copy
from typing import List, Tuple

from megatron.quantization.recipes import RECIPE_NAMES
from megatron.quantization.schemes import SCHEMES
from megatron.training.errors import ConfigError
from megatron.training.quant_arguments import validate_quantization_args

RECIPE_FILE_SUFFIXES = (".yaml", ".yml", ".json")
# Quantization flags a spec may set (everything else is the run's, shared by every arm).
_RESET = dict(quant_scheme=None, quant_recipe=None, quant_recipe_file=None)


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
        argv.append("--" + flag.lstrip("-"))
        if has_value:
            argv.extend(value.split("+"))
    return name, argv


def quant_args_for(spec: str, base_args: argparse.Namespace,
                   parser: argparse.ArgumentParser) -> argparse.Namespace:
    """A copy of the run's validated args with the spec's scheme and flags applied and its
    QuantConfig resolved (args.quant_config), or ConfigError naming the spec."""
    _, argv = split_spec(spec)
    args = copy.copy(base_args)
    for key, value in _RESET.items():
        setattr(args, key, value)
    # argparse fills in defaults only for attributes the namespace lacks: parsing into a copy
    # of the run's args changes exactly the flags the spec names.
    try:
        args, unknown = parser.parse_known_args(argv, namespace=args)
    except ConfigError as exc:
        raise ConfigError(f"--schemes {spec!r}: {exc}") from None
    if unknown:
        raise ConfigError(f"--schemes {spec!r}: unknown flag(s) {' '.join(unknown)}")
    try:
        validate_quantization_args(args)
    except ConfigError as exc:
        raise ConfigError(f"--schemes {spec!r}: {exc}") from None
    return args


def spec_parser(build_parser) -> argparse.ArgumentParser:
    """pretrain_gpt.py's parser, raising ConfigError instead of exiting."""
    parser = build_parser()

    def error(message):
        raise ConfigError(message)

    parser.error = error
    return parser
