"""--tensor-save-config FILE: capture rules in YAML or JSON (docs/capture-format.md).

In the spirit of TransformerEngine's debug config: a list of rules, each selecting GEMM
records by module-path regex (`layers`), module names (`modules`) and tensor kinds (`kinds`)
and saying what to do with them (`mode`: full / stats / off, `iterations` / `interval`,
`stats`: the statistics a manifest line keeps). The first rule that selects a record decides
for it; a record no rule selects is not captured. Top-level keys give the defaults of every
rule; a file without `rules` is one rule that selects everything.

Every mistake is one ValueError line naming the file, the place, the bad value and what is
valid (megatron.training turns it into a ConfigError: exit code 2 before anything is built).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

from megatron.tensor_capture.format import METRICS
from megatron.tensor_capture.policy import (
    MODULE_NAMES, RULE_MODES, CaptureRule, Schedule, parse_kinds)

RULE_KEYS = ("name", "layers", "modules", "kinds", "mode", "iterations", "interval", "stats")
TOP_KEYS = ("mode", "iterations", "interval", "kinds", "stats", "micro_batches", "rules")
INHERITED = ("mode", "iterations", "interval", "kinds", "stats")


@dataclass(frozen=True)
class CaptureFile:
    """The rules of a capture config file and its other settings (None = not given)."""

    path: str
    rules: Tuple[CaptureRule, ...]
    micro_batches: Optional[int] = None

    @property
    def has_schedule(self) -> bool:
        return any(not rule.schedule.empty for rule in self.rules)

    @property
    def modes(self) -> FrozenSet[str]:
        return frozenset(rule.mode for rule in self.rules)


class _Where:
    """Builds the one-line messages: `--tensor-save-config FILE: rules[1].mode: ...`."""

    def __init__(self, path: str):
        self.path = path

    def error(self, where: str, problem: str) -> ValueError:
        place = f"{where}: " if where else ""
        return ValueError(f"--tensor-save-config {self.path}: {place}{problem}")


def _load(path: str) -> Any:
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"--tensor-save-config {path}: cannot read it ({exc.strerror}); give a "
                         "YAML or JSON file") from None
    try:
        if path.lower().endswith(".json"):
            return json.loads(text)
        import yaml    # PyYAML: only needed when a config file is given

        return yaml.safe_load(text)
    except ValueError as exc:             # json.JSONDecodeError
        raise ValueError(f"--tensor-save-config {path}: not valid JSON ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - yaml.YAMLError and its subclasses
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"--tensor-save-config {path}: not valid YAML ({where}{problem})") \
            from None


def _check_keys(where: _Where, place: str, mapping: Any, valid: Tuple[str, ...]) -> dict:
    if not isinstance(mapping, dict):
        raise where.error(place, f"expected a mapping of keys ({', '.join(valid)}), got "
                                 f"{type(mapping).__name__}")
    for key in mapping:
        if key not in valid:
            raise where.error(place, f"unknown key {key!r}; valid: {', '.join(valid)}")
    return mapping


def _names(where: _Where, place: str, value: Any) -> List[str]:
    """A list of names, given as a list or as a comma/space-separated string."""
    if isinstance(value, str):
        return [n for n in re.split(r"[,\s]+", value) if n]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise where.error(place, f"{value!r} is not a list of names")


def _positive(where: _Where, place: str, value: Any, train_iters: int,
              what: str = "iteration") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise where.error(place, f"{value!r} is not a positive integer {what}; valid: "
                                 f"1..{train_iters} (1-based, as in the training log)")
    if value > train_iters:
        raise where.error(place, f"{what} {value} is beyond --train-iters {train_iters}; "
                                 f"valid: 1..{train_iters}")
    return value


def _schedule(where: _Where, place: str, spec: dict, train_iters: int) -> Schedule:
    iterations = spec.get("iterations", [])
    if not isinstance(iterations, list):
        iterations = [iterations]
    found = frozenset(_positive(where, f"{place}iterations", i, train_iters)
                      for i in iterations)
    interval = spec.get("interval", 0)
    if interval != 0:
        interval = _positive(where, f"{place}interval", interval, train_iters, "interval")
    return Schedule(found, interval)


def _rule(where: _Where, place: str, spec: dict, train_iters: int, index: int) -> CaptureRule:
    mode = spec.get("mode", "full")
    if mode is False:                  # YAML 1.1 reads a bare `off` as false
        mode = "off"
    if mode not in RULE_MODES:
        raise where.error(f"{place}mode", f"{mode!r} is not a mode; valid: "
                                          f"{', '.join(RULE_MODES)}")
    layers = None
    if spec.get("layers") is not None:
        pattern = spec["layers"]
        if not isinstance(pattern, str):
            raise where.error(f"{place}layers", f"{pattern!r} is not a regular expression on "
                                                "the module path (e.g. 'layers\\.[01]\\.'); "
                                                "--tensor-save-layers takes layer numbers")
        try:
            layers = re.compile(pattern)
        except re.error as exc:
            raise where.error(f"{place}layers", f"{pattern!r} is not a valid regular "
                                                f"expression ({exc})") from None
    kinds = parse_kinds(_names(where, f"{place}kinds", spec.get("kinds", "default")),
                        source=f"--tensor-save-config {where.path}: {place}kinds")
    name = str(spec.get("name", f"rule {index}"))
    return CaptureRule(
        name=name, layers=layers, kinds=kinds, mode=mode,
        modules=_choices(where, f"{place}modules", spec.get("modules"), MODULE_NAMES, "module"),
        schedule=_schedule(where, place, spec, train_iters),
        stats=_choices(where, f"{place}stats", spec.get("stats"), METRICS, "statistic"))


def _choices(where: _Where, place: str, value: Any, valid: Tuple[str, ...],
             what: str) -> Optional[FrozenSet[str]]:
    """Names that must each be one of `valid` (None when the key is not given)."""
    if value is None:
        return None
    chosen = frozenset(_names(where, place, value))
    for name in sorted(chosen):
        if name not in valid:
            raise where.error(place, f"unknown {what} {name!r}; valid: {', '.join(valid)}")
    return chosen


def read_capture_file(path: str, train_iters: int) -> CaptureFile:
    """The rules of a capture config file, validated (ValueError: one line)."""
    where = _Where(path)
    doc = _load(path)
    top = _check_keys(where, "", {} if doc is None else doc, TOP_KEYS)
    micro_batches = top.get("micro_batches")
    if micro_batches is not None and (isinstance(micro_batches, bool) or
                                      not isinstance(micro_batches, int) or micro_batches < 1):
        raise where.error("micro_batches", f"{micro_batches!r} is not a positive number of "
                                           "micro-batches")
    defaults: Dict[str, Any] = {key: top[key] for key in INHERITED if key in top}
    _rule(where, "", defaults, train_iters, 0)        # the top level's own mistakes, named so
    specs = top.get("rules")
    if specs is None:
        specs = [{"name": "all"}]
    if not isinstance(specs, list) or not specs:
        raise where.error("rules", "expected a non-empty list of rules")
    rules = []
    for index, spec in enumerate(specs):
        place = f"rules[{index}]"
        spec = _check_keys(where, place, spec, RULE_KEYS)
        inherited = dict(defaults)
        if "iterations" in spec or "interval" in spec:
            # A rule's own schedule replaces the top level's (both keys), not adds to it.
            inherited.pop("iterations", None)
            inherited.pop("interval", None)
        merged = {**inherited, **spec}
        rules.append(_rule(where, f"{place}." if "rules" in top else "", merged, train_iters,
                           index))
    return CaptureFile(path=os.fspath(path), rules=tuple(rules), micro_batches=micro_batches)
