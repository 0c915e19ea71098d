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

# The output layer (layer 0 in layer lists and record names; module `output_layer`) is left
# out unless asked for: its operands are [tokens, vocabulary] (128256 columns with the Llama 3
# tokenizer: most of a capture's bytes, 80% of a llama-tiny one), it stays in high precision
# unless --quant-output-layer, and the question a capture answers is per transformer layer.
# Asked for: --tensor-save-layers naming 0, --tensor-save-filter or a rule's `layers` regex
# matching `output_layer`, or a rule's `modules` listing it.
OUTPUT_LAYER = 0
OUTPUT_LAYER_MODULE = "output_layer"
OUTPUT_LAYER_NOTE = ("output layer: not captured (ask with --tensor-save-layers 0 ..., or a "
                     "capture rule naming output_layer)")

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


def parse_kinds(items: Optional[Iterable[str]],
                source: str = "--tensor-save-kinds") -> KindSelection:
    """--tensor-save-kinds: tokens `[component.]selector`, comma- or space-separated.
    `source` names where the tokens come from in error messages.

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
            raise ValueError(f"{source} {raw!r}: unknown component {component!r}; "
                             f"valid: {_valid_kinds_text()}")
        matched = False
        for c in components:
            selected = _select(c, selector)
            if selected is not None:
                matched = True
                names |= selected[0]
                quantized |= selected[1]
        if not matched:
            raise ValueError(f"{source} {raw!r}: unknown kind; valid: "
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


# The modules whose GEMMs are captured, by the last element of their module path (routed and
# shared experts end in linear_fc1 / linear_fc2 too). `modules:` of a capture rule names these.
MODULE_NAMES = (
    "linear_qkv", "linear_q", "linear_kv", "linear_proj", "linear_fc1", "linear_fc2",
    "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
    "linear_kv_up_proj", "core_attention", "output_layer",
)
RULE_MODES = ("full", "stats", "off")


@dataclass(frozen=True)
class Schedule:
    """Global iterations (1-based, as in the training log): an explicit set and/or every
    `interval`-th iteration."""

    iterations: FrozenSet[int] = frozenset()
    interval: int = 0

    @property
    def empty(self) -> bool:
        return not self.iterations and not self.interval

    def contains(self, iteration: int) -> bool:
        return iteration in self.iterations or \
            (self.interval > 0 and iteration % self.interval == 0)

    def count(self, first: int, last: int) -> int:
        """How many of the iterations first..last it contains."""
        if last < first:
            return 0
        multiples = last // self.interval - (first - 1) // self.interval if self.interval else 0
        return multiples + sum(1 for i in self.iterations
                               if first <= i <= last and not (self.interval and
                                                              i % self.interval == 0))

    def describe(self) -> str:
        parts = [", ".join(map(str, sorted(self.iterations)))] if self.iterations else []
        if self.interval:
            parts.append(f"every {self.interval}")
        return "; ".join(parts) or "none"


@dataclass(frozen=True)
class CaptureRule:
    """Which records a rule selects (module-path regex, module names, tensor kinds) and what
    happens to them: mode full / stats / off, at which iterations, which statistics the
    manifest keeps (None = all). The first rule that selects a record decides for it."""

    name: str = "all"
    layers: Optional[Pattern] = None          # re.search on the module path
    modules: Optional[FrozenSet[str]] = None  # last element of the module path
    kinds: KindSelection = parse_kinds(None)
    mode: str = "full"
    schedule: Schedule = Schedule()
    stats: Optional[FrozenSet[str]] = None

    @property
    def names_output_layer(self) -> bool:
        """Whether this rule asks for the output layer by name (its `modules` or `layers`)."""
        return (self.modules is not None and OUTPUT_LAYER_MODULE in self.modules) or \
            (self.layers is not None and self.layers.search(OUTPUT_LAYER_MODULE) is not None)

    def selects(self, info, role: Role, quantized: bool) -> bool:
        if self.layers is not None and self.layers.search(info.module_path) is None:
            return False
        if self.modules is not None and \
                info.module_path.rsplit(".", 1)[-1] not in self.modules:
            return False
        return self.kinds.wants(info.component, role, quantized)

    def describe(self) -> str:
        parts = [f"{self.name}: mode {self.mode}"]
        if self.layers is not None:
            parts.append(f"layers /{self.layers.pattern}/")
        if self.modules is not None:
            parts.append(f"modules {', '.join(sorted(self.modules))}")
        parts.append(f"tensors ({self.kinds.describe()})")
        if not self.schedule.empty:
            parts.append(f"iterations {self.schedule.describe()}")
        return ", ".join(parts)

    def to_json(self) -> dict:
        return {"name": self.name, "mode": self.mode,
                "layers": self.layers.pattern if self.layers is not None else None,
                "modules": sorted(self.modules) if self.modules is not None else None,
                "kinds": self.kinds.describe(),
                "iterations": sorted(self.schedule.iterations),
                "interval": self.schedule.interval,
                "stats": sorted(self.stats) if self.stats is not None else None}


@dataclass
class CapturePolicy:
    """Which iterations, micro-batches, layers and records are captured, and in which mode.

    A record is captured at iteration i when the first rule that selects it has a mode other
    than off and i is in that rule's schedule or in the --control-iter window: iterations
    S+1..S+N of a run resumed at S (the first N of the run; 0 = every iteration; None = no
    window). `layers` (--tensor-save-layers) and `name_filter` (--tensor-save-filter) narrow
    every rule. Without rules, one rule captures the selected `kinds` in full mode.

    The output layer (layer 0) is captured only when asked for (OUTPUT_LAYER above): by
    `layers` or `name_filter`, and then by any rule, or by the rules that name it.
    """

    control_iter: Optional[int] = 1
    micro_batches: int = 1
    layers: Optional[FrozenSet[int]] = None
    kinds: KindSelection = parse_kinds(None)
    name_filter: Optional[Pattern] = None
    start_iteration: int = 0
    rules: Tuple[CaptureRule, ...] = ()

    def __post_init__(self):
        if not self.rules:
            self.rules = (CaptureRule(kinds=self.kinds),)
        self._active = tuple(r for r in self.rules if r.mode != "off")
        self._rule_of = {}
        # The output layer named by the flags (every rule may take it), else by rules.
        self._output_by_flags = (self.layers is not None and OUTPUT_LAYER in self.layers) or \
            (self.name_filter is not None and
             self.name_filter.search(OUTPUT_LAYER_MODULE) is not None)
        self._output_rules = tuple(r for r in self.rules
                                   if self._output_by_flags or r.names_output_layer)

    # -- iterations ------------------------------------------------------------------------

    def in_window(self, iteration: int) -> bool:
        """Within the --control-iter window of this run."""
        if self.control_iter is None or iteration <= self.start_iteration:
            return False
        return self.control_iter == 0 or iteration <= self.start_iteration + self.control_iter

    def captures_iteration(self, iteration: int) -> bool:
        if iteration <= self.start_iteration or not self._active:
            return False
        return self.in_window(iteration) or \
            any(r.schedule.contains(iteration) for r in self._active)

    @property
    def last_iteration(self) -> Optional[int]:
        """The iteration after which --control-iter ends the run (None: it does not)."""
        return self.start_iteration + self.control_iter if self.control_iter else None

    def iteration_count(self, rule: CaptureRule, end: int) -> int:
        """How many of the iterations S+1..end `rule` captures."""
        start = self.start_iteration
        if self.control_iter == 0:
            return max(0, end - start)
        window = min(end, start + (self.control_iter or 0))
        return max(0, window - start) + rule.schedule.count(max(window, start) + 1, end)

    def unreachable(self) -> FrozenSet[int]:
        """Scheduled iterations at or before the start of a resumed run (never reached)."""
        return frozenset(i for r in self._active for i in r.schedule.iterations
                         if i <= self.start_iteration)

    # -- records ---------------------------------------------------------------------------

    def captures_micro_batch(self, micro_batch: int) -> bool:
        return micro_batch < self.micro_batches

    def captures_layer(self, layer: int) -> bool:
        if layer == OUTPUT_LAYER:
            return self.output_layer_asked and (self.layers is None or layer in self.layers)
        return self.layers is None or layer in self.layers

    @property
    def output_layer_asked(self) -> bool:
        """Whether the output layer is captured by any rule (see OUTPUT_LAYER)."""
        return any(r.mode != "off" for r in self._output_rules)

    def captures_name(self, name: str) -> bool:
        return self.name_filter is None or self.name_filter.search(name) is not None

    def captures_role(self, component: str, role: Role, quantized: bool) -> bool:
        """Whether any rule may want this tensor (the rule decides per record: rule_at)."""
        return any(r.kinds.wants(component, role, quantized) for r in self._active)

    def rule_for(self, info, role: Role, quantized: bool) -> Optional[CaptureRule]:
        """The rule deciding a record of site `info` (a records.SiteInfo) in `role`, or None
        when the record is not captured at any iteration."""
        key = (info.site_name, role.tensor_name, quantized)
        if key not in self._rule_of:
            rule = None
            if self.captures_layer(info.layer) and \
                    self.captures_name(info.record_name(role)):
                rules = self._output_rules if info.layer == OUTPUT_LAYER else self.rules
                rule = next((r for r in rules if r.selects(info, role, quantized)), None)
            self._rule_of[key] = rule if rule is not None and rule.mode != "off" else None
        return self._rule_of[key]

    def rule_at(self, iteration: int, info, role: Role,
                quantized: bool) -> Optional[CaptureRule]:
        """The rule capturing this record at `iteration`, or None when it is not captured."""
        rule = self.rule_for(info, role, quantized)
        if rule is None or not (self.in_window(iteration) or rule.schedule.contains(iteration)):
            return None
        return rule

    def describe(self) -> str:
        text = " | ".join(r.describe() for r in self.rules)
        return text if self.output_layer_asked else f"{text} | {OUTPUT_LAYER_NOTE}"
