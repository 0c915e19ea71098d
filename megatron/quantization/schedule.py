"""Precision schedules (--quant-schedule): which GEMMs stay quantized in which iterations.

A schedule is a list of switches `PHASE@WHEN`. From the iteration after WHEN on, every GEMM
site runs in PHASE:

    quantized               as configured (the scheme, recipe or recipe file)
    high_precision_forward  the forward GEMMs (linear fprop, attention QK^T and PV) in the
                            run's precision (BF16 in a --bf16 run); the backward as configured
    high_precision          every GEMM in the run's precision

WHEN is an iteration count (`900`: iterations 901... switch) or a fraction of --train-iters
with a decimal point (`0.9`: the last 10%), rounded to the nearest iteration (halves to
even). A run starts quantized; `high_precision_forward@0.85 quantized@0.95` switches the
forward to BF16 and back (the NVFP4 paper's Appendix D moves the end of training to higher
precision).

The phase is a function of the iteration alone, so a resume follows the schedule exactly; a
checkpoint records the resolved switches (`Switch` list), and a resume checks that the
iterations it already trained had the phases this run's schedule gives them.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from fractions import Fraction
from types import MappingProxyType
from typing import List, NamedTuple, Sequence, Tuple

QUANTIZED = "quantized"
HIGH_PRECISION_FORWARD = "high_precision_forward"
HIGH_PRECISION = "high_precision"
PHASES = (QUANTIZED, HIGH_PRECISION_FORWARD, HIGH_PRECISION)
PHASE_TEXT = MappingProxyType({
    QUANTIZED: "every GEMM as configured",
    HIGH_PRECISION_FORWARD: "forward GEMMs in the run's precision, backward as configured",
    HIGH_PRECISION: "every GEMM in the run's precision"})
_WHEN = re.compile(r"^(?:([0-9]+)|([0-9]*\.[0-9]+|[0-9]+\.[0-9]*))$")
FLAG = "--quant-schedule"
# What tools/evaluate.py says to a schedule (its arms evaluate fixed weights).
NOT_IN_EVALUATION = (f"{FLAG} switches a training run's precision by iteration; an evaluation "
                     "has none (give each phase as its own arm, e.g. SPEC@quant-fprop=none)")


class Switch(NamedTuple):
    """From iteration `after` + 1 on, the sites run in `phase`."""
    after: int
    phase: str


def check_entry(entry: str) -> Tuple[str, str]:
    """(phase, when) of one `PHASE@WHEN` entry, or ValueError naming it and what is valid."""
    phase, sep, when = entry.partition("@")
    if not sep or phase not in PHASES or not _WHEN.match(when):
        raise ValueError(f"{FLAG} {entry!r}: expected PHASE@WHEN with PHASE one of "
                         f"{', '.join(PHASES)} and WHEN an iteration count (900) or a fraction "
                         "of --train-iters with a decimal point (0.9)")
    if "." in when and not 0.0 <= float(when) <= 1.0:
        raise ValueError(f"{FLAG} {entry!r}: the fraction {when} is not within 0..1")
    return phase, when


def resolve(entries: Sequence[str], train_iters: int) -> List[Switch]:
    """The switches of `entries` at iteration counts; ValueError (one line) for a switch that
    never takes effect, switches out of order, or one into the phase already running."""
    switches, phase_before = [], QUANTIZED
    for entry in entries:
        phase, when = check_entry(entry)
        # Exact decimal arithmetic: 0.7 of 45 is 31.5, which rounds to 32 (halves to even);
        # in binary floating point it is 31.499... and would round to 31.
        after = round(Fraction(when) * train_iters) if "." in when else int(when)
        if after >= train_iters:
            raise ValueError(f"{FLAG} {entry!r}: switches after iteration {after}, but the run "
                             f"ends at --train-iters {train_iters}; it would never take effect")
        if switches and after <= switches[-1].after:
            raise ValueError(f"{FLAG} {entry!r}: switches after iteration {after}, not after "
                             f"the previous switch (iteration {switches[-1].after}); give the "
                             "switches in order")
        if phase == phase_before:
            raise ValueError(f"{FLAG} {entry!r}: the run is already {phase} then; drop it")
        switches.append(Switch(after, phase))
        phase_before = phase
    return switches


def phase_at(switches: Sequence[Switch], iteration: int) -> str:
    """The phase of iteration `iteration` (1-based, as the training loop counts them)."""
    phase = QUANTIZED
    for switch in switches:
        if iteration > switch.after:
            phase = switch.phase
    return phase


def history(switches: Sequence[Switch], iterations: int) -> List[Switch]:
    """The switches that took effect within the first `iterations` iterations: two schedules
    with the same history trained those iterations alike."""
    return [s for s in switches if s.after < iterations]


def describe(switches: Sequence[Switch], train_iters: int) -> str:
    """One line: the iteration ranges of each phase."""
    starts = [Switch(0, QUANTIZED)] + list(switches)
    spans = []
    for n, switch in enumerate(starts):
        last = starts[n + 1].after if n + 1 < len(starts) else train_iters
        if last > switch.after:         # a switch at 0 leaves no quantized iterations
            spans.append(f"iterations {switch.after + 1}-{last} {switch.phase}")
    return "; ".join(spans)


@functools.lru_cache(maxsize=256)      # keyed by the (frozen) config: one per site and phase
def phase_config(config, phase: str):
    """`config` (a MatmulQuantConfig) as `phase` runs it: unchanged when quantized; else the
    phase's GEMMs lose their formats, Hadamard transform and limited-precision accumulator
    (plain GEMMs in the run's precision)."""
    if phase == QUANTIZED:
        return config
    gemms = ("fprop",) if phase == HIGH_PRECISION_FORWARD else ("fprop", "dgrad", "wgrad")
    keep = lambda names: tuple(g for g in names if g not in gemms)      # noqa: E731
    plain = type(config.fprop)()
    return config.replace(
        rht=dataclasses.replace(config.rht, gemms=keep(config.rht.gemms)),
        gemm=config.gemm.replace(accumulation_gemms=keep(config.gemm.accumulation_gemms)),
        **{gemm: plain for gemm in gemms})
