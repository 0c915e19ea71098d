"""The GEMM observer that feeds capture (megatron.quantization.observers protocol).

It watches the model's GEMMs only while a captured iteration runs. `bind(site)` is called when a site
runs forward: it decides whether this site and micro-batch are captured at all (declining
costs the layer nothing) and snapshots the iteration and micro-batch, because under pipeline
schedules the backward of a micro-batch runs after later forwards have started.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Optional, Tuple

from megatron.tensor_capture.roles import role_for
from megatron.tensor_capture.policy import CapturePolicy
from megatron.tensor_capture.records import Recorder, SiteInfo, site_info


class CaptureObserver:
    """Observer with bind(): turns selected GEMM reports into records via a Recorder."""

    def __init__(self, policy: CapturePolicy, recorder: Recorder,
                 sites: Optional[Dict[str, SiteInfo]] = None,
                 on_error: Optional[Callable[[BaseException], None]] = None):
        self.policy = policy
        self.recorder = recorder
        self.sites: Dict[str, SiteInfo] = dict(sites or {})
        self.on_error = on_error
        self.iteration: Optional[int] = None
        self.micro_batch = 0
        self.seconds = 0.0        # time spent capturing in the training step
        self.failed = False
        self._names: Dict[Tuple[str, str], bool] = {}

    # -- state set by the training callback ----------------------------------------------

    def begin_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self.micro_batch = 0

    def end_iteration(self) -> None:
        self.iteration = None

    # -- observers protocol --------------------------------------------------------------

    def bind(self, site):
        if self.iteration is None or self.failed:
            return None
        if not self.policy.captures_micro_batch(self.micro_batch):
            return None
        info = self.sites.get(site.name)
        if info is None:
            info = self.sites[site.name] = site_info(site)
        if not self.policy.captures_layer(info.layer):
            return None
        iteration, micro_batch = self.iteration, self.micro_batch

        def observe(gemm, operand, hp, q, fmt, axis, **extra):
            self._observe(info, site, iteration, micro_batch, gemm, operand, hp, q, fmt, axis,
                          extra)

        return observe

    def __call__(self, site, gemm, operand, hp, q, fmt, axis, **extra):
        """Unbound use (no pipeline snapshot): observe with the current state."""
        bound = self.bind(site)
        if bound is not None:
            bound(gemm, operand, hp, q, fmt, axis, **extra)

    def _observe(self, info: SiteInfo, site, iteration, micro_batch, gemm, operand, hp, q,
                 fmt, axis, extra: Optional[dict] = None) -> None:
        """`extra`: the GEMM report's keywords besides (fmt, axis, config) that determined q
        (gemm.py's _operand: scale_exponent, amax, seed, weight); they go into the record's
        metadata, so that quantize_operand reproduces q (replay.py)."""
        if self.failed:
            return
        role = role_for(site.kind, gemm, operand)
        if role is None or not self.policy.captures_role(info.component, role, q is not None):
            return
        key = (site.name, role.tensor_name)
        selected = self._names.get(key)
        if selected is None:
            selected = self._names[key] = self.policy.captures_name(info.record_name(role))
        if not selected:
            return
        start = time.perf_counter()
        try:
            # (recorders written for reports without keywords keep working)
            keywords = {"extra": extra} if extra else {}
            self.recorder.capture(info, site.config, role, iteration, micro_batch, gemm,
                                  operand, hp, q, fmt, axis, **keywords)
        except Exception as exc:  # noqa: BLE001 - a capture bug must not break training
            self.failed = True
            if self.on_error is not None:
                self.on_error(exc)
        finally:
            self.seconds += time.perf_counter() - start
