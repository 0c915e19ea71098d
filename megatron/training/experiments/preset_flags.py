"""The explicit Megatron-LM flags that mean the same as `--model-preset NAME`.

The launchers spell the architecture out flag by flag, as Megatron-LM's example scripts do.
Reading pretrain_gpt's parser imports megatron.core, so only launcher rendering pays for it.
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Sequence

from megatron.training.experiments.commands import format_number
from megatron.training.experiments.matrix import ExperimentError
from megatron.training.presets import MODEL_PRESETS


def _flag_actions() -> Dict[str, argparse.Action]:
    from megatron.training.arguments import build_parser   # imports megatron.core

    return {a.dest: a for a in build_parser()._actions if a.option_strings}


def list_expression(values: Sequence[int]) -> str:
    """[0, 1, 1, 1] -> '([0]+[1]*3)' (the --moe-layer-freq form Megatron-LM scripts use)."""
    runs: List[List[int]] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return "(" + "+".join(f"[{v}]" if n == 1 else f"[{v}]*{n}" for v, n in runs) + ")"


def preset_flags(preset: str, skip: Sequence[str] = ("seq_length",)) -> List[str]:
    """The flags equivalent to `--model-preset preset`, in the parser's order."""
    actions = _flag_actions()
    order = {dest: i for i, dest in enumerate(actions)}
    flags: List[str] = []
    for dest, value in sorted(MODEL_PRESETS[preset].items(), key=lambda kv: order[kv[0]]):
        if dest in skip:
            continue
        action = actions[dest]
        option = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                flags.append(option)
        elif isinstance(action, argparse._StoreFalseAction):
            if not value:
                flags.append(option)
        elif value is None:
            if action.default is not None:
                raise ExperimentError(f"preset {preset}: {dest}=None has no flag form")
        elif isinstance(value, list):
            flags += [option, list_expression(value)]
        else:
            flags += [option, format_number(value)]
    return flags
