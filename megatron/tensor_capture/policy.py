"""What to capture: which iterations, micro-batches, layers and tensors.

All decisions are made from the parsed flags; nothing here touches tensors. Parse errors are
ValueErrors whose message names the bad value and what is valid (arguments.py turns them into
ConfigErrors).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import FrozenSet, Iterable, Optional, Pattern, Tuple

from megatron.quantization.layer_lists import parse_layer_list
from megatron.tensor_capture.roles import REQUANT, RESULT, Role, tensor_names

COMPONENTS = ("attention", "linear")

# Captured unless --tensor-save-kinds says otherwise (plus every quantized operand).
DEFAULT_TENSORS = {
    "attention": ("query", "key", "value", "output",
                  "grad_output", "grad_query", "grad_key", "grad_value"),
    "linear": ("input", "weight", "output", "grad_output", "grad_input"),
}
GROUPS = ("default", "all", "forward", "backward", "quantized")
ALIASES = {"attn": "attention", "fa": "attention", "gradients": "backward", "grads": "backward"}


@dataclass(frozen=True)
class KindSelection:
    """Tensor names to capture per component, and components whose quantized operands
    (including re-quantized copies) are captured whatever their name."""

    names: FrozenSet[Tuple[str, str]]
    quantized: FrozenSet[str]

    def wants(self, component: str, role: Role, quantized: bool) -> bool:
        # A re-quantized copy of an unquantized operand would duplicate the first record.
        if role.kind == REQUANT and not quantized:
            return False
        if (component, role.tensor_name) in self.names:
            return True
        return quantized and role.kind != RESULT and component in self.quantized

    def describe(self) -> str:
        parts = []
        for component in COMPONENTS:
            names = sorted(n for c, n in self.names if c == component)
            extra = " + quantized operands" if component in self.quantized else ""
            parts.append(f"{component}: {', '.join(names) or '-'}{extra}")
        return "; ".join(parts)


def _valid_kinds_text() -> str:
    names = sorted(set(tensor_names("attention")) | set(tensor_names("linear")))
    return (f"[attention.|linear.]<name or group>, groups: {', '.join(GROUPS)}; "
            f"names: {', '.join(names)}")


def _select(component: str, selector: str):
    roles = tensor_names(component)
    if selector == "default":
        return {(component, n) for n in DEFAULT_TENSORS[component]}, {component}
    if selector == "all":
        return {(component, n) for n in roles}, {component}
    if selector in ("forward", "backward"):
        return {(component, n) for n in DEFAULT_TENSORS[component]
                if roles[n].operation == selector}, set()
    if selector == "quantized":
        return set(), {component}
    if selector in roles:
        return {(component, selector)}, set()
    return None


def parse_kinds(items: Optional[Iterable[str]]) -> KindSelection:
    """--tensor-save-kinds: tokens `[component.]selector`, comma- or space-separated.

    `attention` alone means `attention.default`; a selector without component applies to
    every component that has it (`output`, `grad_output`, `forward`, ...).
    """
    tokens = [t.strip() for item in (items or ["default"]) for t in str(item).split(",")]
    tokens = [t for t in tokens if t]
    if not tokens:
        tokens = ["default"]
    names, quantized = set(), set()
    for token in tokens:
        raw = token
        token = token.lower()
        component, _, selector = token.partition(".") if "." in token else ("", "", token)
        component = ALIASES.get(component, component)
        selector = ALIASES.get(selector, selector)
        if not component and selector in COMPONENTS:
            component, selector = selector, "default"
        components = [component] if component else list(COMPONENTS)
        if component and component not in COMPONENTS:
            raise ValueError(f"--tensor-save-kinds {raw!r}: unknown component {component!r}; "
                             f"valid: {_valid_kinds_text()}")
        matched = False
        for c in components:
            selected = _select(c, selector)
            if selected is not None:
                matched = True
                names |= selected[0]
                quantized |= selected[1]
        if not matched:
            raise ValueError(f"--tensor-save-kinds {raw!r}: unknown kind; valid: "
                             f"{_valid_kinds_text()}")
    return KindSelection(frozenset(names), frozenset(quantized))


def parse_layers(items: Optional[Iterable[str]], num_layers: int) -> Optional[FrozenSet[int]]:
    """--tensor-save-layers: '3', '2-4', '-1' (last layer), '0' (the output layer), comma- or
    space-separated; None (no flag) means every layer."""
    if items is None:
        return None
    layers = parse_layer_list(items, num_layers, "--tensor-save-layers", allow_output_layer=True)
    if not layers:
        raise ValueError("--tensor-save-layers needs at least one layer (0 = output layer, "
                         f"1..{num_layers})")
    return layers


def parse_filter(pattern: Optional[str]) -> Optional[Pattern]:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"--tensor-save-filter {pattern!r} is not a valid regular expression "
                         f"({exc})") from None


@dataclass
class CapturePolicy:
    """Which iterations, micro-batches, layers and records are captured.

    `control_iter` counts iterations of this run: with a run resumed at iteration S, iterations
    S+1..S+N are captured (the first N of the run); 0 captures every iteration.
    """

    control_iter: int = 1
    micro_batches: int = 1
    layers: Optional[FrozenSet[int]] = None
    kinds: KindSelection = parse_kinds(None)
    name_filter: Optional[Pattern] = None
    start_iteration: int = 0

    def captures_iteration(self, iteration: int) -> bool:
        if self.control_iter == 0:
            return iteration > self.start_iteration
        return self.start_iteration < iteration <= self.start_iteration + self.control_iter

    @property
    def last_iteration(self) -> Optional[int]:
        return None if self.control_iter == 0 else self.start_iteration + self.control_iter

    def iteration_count(self, start: int, end: int) -> int:
        """How many of the iterations start+1..end are captured."""
        stop = end if self.control_iter == 0 else min(end, self.last_iteration)
        return max(0, stop - start)

    def captures_micro_batch(self, micro_batch: int) -> bool:
        return micro_batch < self.micro_batches

    def captures_layer(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def captures_name(self, name: str) -> bool:
        return self.name_filter is None or self.name_filter.search(name) is not None

    def captures_role(self, component: str, role: Role, quantized: bool) -> bool:
        return self.kinds.wants(component, role, quantized)

    def selects(self, info, role: Role, quantized: bool) -> bool:
        """Whether a record of site `info` (a records.SiteInfo) in `role` is captured."""
        return (self.captures_layer(info.layer) and
                self.captures_role(info.component, role, quantized) and
                self.captures_name(info.record_name(role)))
