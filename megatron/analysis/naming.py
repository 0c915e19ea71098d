"""The names the report gives runs, layers and sites.

One run, one name: a run's label (`--quant-scheme` as resolved, `recipe_<name>` for a named
recipe, ...) is what its capture's run file and record metadata carry (`quant_type`) and what
its training log's argument block prints as `quant_config`; that log also prints the run's
`tensorboard_dir`. Captures are named by their run files (loading.py), loss curves named after
their files by their logs' labels (losses.name_by_label), and TensorBoard run directories by
the label of the training log that wrote them (`telemetry_names`). What still does not match
is reported with the flag that names it (`unmatched`), so that one run never becomes two
half-empty schemes. A user's `NAME=PATH` (`split_named`) always wins.

Layers: the capture format's layer 0 is the output layer, which reports call `output` and list
after the transformer layers, so that it never reads as the first of them.
"""

from __future__ import annotations

import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

UNMATCHED = "unmatched_run_name"       # problem kind
OUTPUT_LAYER = 0                       # the capture format's layer number of the output layer


def split_named(spec: str) -> Tuple[Optional[str], str]:
    """`NAME=PATH` -> (NAME, PATH); a plain path (or one that exists although it holds a
    `=`, or an empty NAME) -> (None, spec)."""
    if "=" in spec and not os.path.exists(spec):
        name, path = spec.split("=", 1)
        if name.strip():
            return name.strip(), path.strip()
    return None, spec


def layer_label(layer: int) -> str:
    """`L1`, `L2`, ... and `output` for the output layer."""
    return "output" if layer == OUTPUT_LAYER else f"L{layer}"


def layer_order(layer: int) -> tuple:
    """Sort key: transformer layers in order, the output layer last."""
    return layer == OUTPUT_LAYER, layer


def display_site(site: str) -> str:
    """A telemetry site as reports name it: `L0.output_layer` -> `output_layer`."""
    prefix = f"L{OUTPUT_LAYER}."
    return site[len(prefix):] if site.startswith(prefix) else site


def telemetry_names(curves) -> Dict[str, str]:
    """{TensorBoard run directory (real path): label} from the training logs' argument
    blocks (a log whose run wrote TensorBoard scalars names that directory's run)."""
    return {os.path.realpath(curve.tensorboard_dir): curve.name for curve in curves
            if curve.tensorboard_dir and curve.name}


def unmatched(kind: str, runs: Sequence[Tuple[str, str]], known: Iterable[str],
              flag: str) -> List[str]:
    """One problem line per run of `runs` ((name, where)) whose name no other source knows
    while some known name has no run of this kind: the two are probably one run under two
    names. `flag` is the option that names a run (`--tensorboard-dir`, `--loss-logs`)."""
    known = set(known)
    candidates = sorted(known - {name for name, _ in runs})
    if not candidates:
        return []
    suggestion = candidates[0] if len(candidates) == 1 else "NAME"
    verb = "has" if len(candidates) == 1 else "have"
    return [f"{kind} run {name!r} ({where}) has no capture or log of that name, and "
            f"{', '.join(candidates)} {verb} no {kind}: if they are one run, name it with "
            f"{flag} {suggestion}={where} (or give its training log, whose argument block "
            "records the run's label and TensorBoard directory)"
            for name, where in runs if name not in known]
