"""Parsing of transformer-layer lists given on the command line (one rule for every flag)."""

from __future__ import annotations

import re
from typing import FrozenSet, Iterable

_LAYER_ITEM = re.compile(r"^(-?\d+)(?:-(-?\d+))?$")


def parse_layer_list(items: Iterable[str], num_layers: int, flag: str,
                     allow_output_layer: bool = False) -> FrozenSet[int]:
    """'3', '2-4', '-1' (the last layer), comma- or space-separated -> 1-based layer numbers.

    With `allow_output_layer`, 0 names the output layer. Raises ValueError naming `flag`,
    the bad item and the valid range.
    """
    lowest = 0 if allow_output_layer else 1
    valid = (f"{'0 (output layer), ' if allow_output_layer else ''}1..{num_layers}, "
             f"-{num_layers}..-1 (from the last layer), ranges like 2-4")
    layers = set()
    for part in (p.strip() for item in items for p in str(item).split(",")):
        if not part:
            continue
        match = _LAYER_ITEM.match(part)
        if match is None:
            raise ValueError(f"{flag} {part!r} is not a layer number or range; valid: {valid}")
        lo = int(match.group(1))
        hi = int(match.group(2)) if match.group(2) is not None else lo
        for n in (lo, hi):
            if not (lowest <= n <= num_layers or -num_layers <= n <= -1):
                raise ValueError(f"{flag} {part!r}: layer {n} is out of range for {num_layers} "
                                 f"layers; valid: {valid}")
        lo, hi = (n + num_layers + 1 if n < 0 else n for n in (lo, hi))
        if hi < lo:
            raise ValueError(f"{flag} {part!r}: empty range; write it as {hi}-{lo}")
        layers.update(range(lo, hi + 1))
    return frozenset(layers)
