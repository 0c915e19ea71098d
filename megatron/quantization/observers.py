"""Observers of quantized GEMMs: what tensor capture, telemetry and counters plug into.

Every quantized layer is a GEMM *site* (a `GemmSite`: module name, kind, layer number, config).
Observers watch a model through its runtime (runtime.QuantRuntime.add_observer, or the
`runtime.observing(model, observer)` block). When at least one watches, each GEMM a site runs
reports its operands and result as `observer(site, gemm, operand, hp, q, fmt, axis, **extra)`
(see gemm.py for the operand names and the extra keywords); when none does, the layers take
their fast path and pay nothing.

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
from typing import Callable, Optional

from megatron.quantization.config import MatmulQuantConfig
from megatron.quantization.gemm import SiteState
from megatron.quantization.schedule import QUANTIZED, phase_config

Observer = Callable[..., None]


@dataclass(frozen=True)
class GemmSite:
    """Where a GEMM runs: `name` is the module path, `kind` one of config.SITE_KINDS;
    `state` what the site keeps between calls (its global path, amax histories)."""

    name: str
    kind: str
    layer_number: Optional[int]
    config: MatmulQuantConfig
    state: Optional[SiteState] = field(default=None, compare=False, hash=False, repr=False)

    @property
    def active_config(self) -> MatmulQuantConfig:
        """The config the site runs now: `config` as the precision schedule's current phase
        runs it (schedule.py; `config` itself while quantized)."""
        if self.state is None or self.state.runtime.phase == QUANTIZED:
            return self.config
        return phase_config(self.config, self.state.runtime.phase)


def observer_for(site: GemmSite):
    """A gemm.py observer bound to `site`, or None when no observer of its model wants it."""
    if site.state is None:
        return None
    return site.state.runtime.observer_for(site)


def accepts_pieces(observer) -> bool:
    """Whether `observer` (a bound observer) may be shown an operand piece by piece (chunked
    attention, each piece once) instead of whole. Every observer receives, as keywords, what
    besides (fmt, axis, config) determined a quantized operand (gemm.py's gemm_operand:
    scale_exponent, amax, seed, weight); with a piece of a tensor-scaled operand that is the
    scale of the whole operand."""
    return bool(getattr(observer, "accepts_pieces", False))


class QuantizationCounter:
    """Counts quantized operands per (site kind, gemm, operand, format) and sites seen.

    Add it to a model's runtime (`runtime.observing(model, counter)`);
    `quantized[(kind, gemm, operand, fmt)]` is the number
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
