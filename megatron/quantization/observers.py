"""Observers of quantized GEMMs: a small registry that tensor capture and counters plug into.

Every quantized layer is a GEMM *site* (a `GemmSite`: module name, kind, layer number, config).
When at least one observer is registered, each GEMM a site runs reports its operands and result
as `observer(site, gemm, operand, hp, q, fmt, axis, **extra)` (see gemm.py for the operand
names and the extra keywords); when
none is registered the layers take their fast path and pay nothing.

Observers see whole GEMM operands, except those that declare `accepts_pieces` (see
`accepts_pieces`): the chunked attention path shows them each chunk of a chunked operand.

Binding happens in the forward pass (`observer_for` is called when a site runs forward) and
the bound callable is kept for that micro-batch's backward. An observer with a
`bind(site) -> callable or None` method can therefore snapshot forward-time context (such as
the micro-batch index, which differs at backward time under pipeline schedules) or decline to
observe a site.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from megatron.quantization.gemm import MatmulQuantConfig, SiteState

Observer = Callable[..., None]


@dataclass(frozen=True)
class GemmSite:
    """Where a GEMM runs: `name` is the module path, `kind` one of schemes.SITE_KINDS;
    `state` what the site keeps between calls (its global path, amax histories)."""

    name: str
    kind: str
    layer_number: Optional[int]
    config: MatmulQuantConfig
    state: Optional[SiteState] = field(default=None, compare=False, hash=False, repr=False)


_OBSERVERS: List[Observer] = []


def register_observer(observer: Observer) -> Observer:
    _OBSERVERS.append(observer)
    return observer


def unregister_observer(observer: Observer) -> None:
    if observer in _OBSERVERS:
        _OBSERVERS.remove(observer)


def _bind(observer: Observer, site: GemmSite):
    if hasattr(observer, "bind"):
        return observer.bind(site)
    return lambda *report, **extra: observer(site, *report, **extra)


def observer_for(site: GemmSite):
    """A gemm.py observer bound to `site`, or None when no registered observer wants it."""
    if not _OBSERVERS:
        return None
    bound = [b for b in (_bind(o, site) for o in _OBSERVERS) if b is not None]
    if not bound:
        return None
    if len(bound) == 1:
        return bound[0]

    def observe(gemm, operand, hp, q, fmt, axis, **extra):
        for observer in bound:
            observer(gemm, operand, hp, q, fmt, axis, **extra)

    observe.accepts_pieces = all(accepts_pieces(b) for b in bound)
    return observe


def accepts_pieces(observer) -> bool:
    """Whether `observer` (a bound observer) may be shown an operand piece by piece (chunked
    attention, each piece once) instead of whole. Every observer receives, as keywords, what
    besides (fmt, axis, config) determined a quantized operand (gemm.py's gemm_operand:
    scale_exponent, amax, seed, weight); with a piece of a tensor-scaled operand that is the
    scale of the whole operand."""
    return bool(getattr(observer, "accepts_pieces", False))


class QuantizationCounter:
    """Counts quantized operands per (site kind, gemm, operand, format) and sites seen.

    Register it with `register_observer`; `quantized[(kind, gemm, operand, fmt)]` is the number
    of times that operand was quantized, `sites_run[kind]` the set of site names that ran.
    """

    def __init__(self):
        self.quantized = Counter()
        self.high_precision = Counter()
        self.sites_run = {}

    def __call__(self, site: GemmSite, gemm, operand, hp, q, fmt, axis, **extra):
        self.sites_run.setdefault(site.kind, set()).add(site.name)
        if q is not None:
            self.quantized[(site.kind, gemm, operand, fmt)] += 1
        elif operand not in ("output", "grad_input", "grad_weight", "grad_a", "grad_b"):
            self.high_precision[(site.kind, gemm, operand)] += 1

    def quantized_kinds(self):
        return {kind for kind, *_ in self.quantized}
