"""What the GEMM sites of one model share while it runs: `QuantRuntime`.

The converter (apply_quantization) makes one runtime per model and hands it to every site
(SiteState.runtime); a model quantized again (an evaluation's next arm) keeps it. It holds

* the kernel mode (--quant-kernels) and the weight-cache switch, from the model's QuantConfig;
* the observers that watch the model's GEMMs (tensor capture, telemetry, counters): the layers
  ask `observer_for(site)` in their forward pass and pay nothing when there are none;
* the key of the stochastic-rounding draws (randomness.RoundingDraws): the run's seed, the
  iteration and the data-parallel stream, set by the training loop;
* the precision schedule's phase (schedule.py), set by the training loop each iteration: the
  sites run `phase_config` of their config (GemmSite.active_config);
* the generation of the cached quantized weights: `invalidate_weights` forgets them, and
  `watch_optimizer` makes this run's optimizer call it after every step.

Nothing here is a process global: two models in one process (a run and its evaluation, two
tests) never see each other's observers, draws or caches, and `close()` undoes what the run
attached (the optimizer hooks, the observers).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, List, Optional

import torch

from megatron.quantization.config import BackendSettings
from megatron.quantization.randomness import RoundingDraws
from megatron.quantization.schedule import QUANTIZED

Observer = Callable[..., None]


class QuantRuntime:
    """Run state of one model's GEMM sites (see the module docstring)."""

    def __init__(self, backend: Optional[BackendSettings] = None):
        self.backend = backend or BackendSettings()
        self.observers: List[Observer] = []
        self.draws = RoundingDraws()
        self.phase = QUANTIZED
        self.weights_generation = 0
        self._hooks = []

    @property
    def kernels(self) -> str:
        return self.backend.kernels

    @property
    def weight_cache(self) -> bool:
        return self.backend.weight_cache

    # -- observers ----------------------------------------------------------------------------

    def add_observer(self, observer: Observer) -> Observer:
        self.observers.append(observer)
        return observer

    def remove_observer(self, observer: Observer) -> None:
        if observer in self.observers:
            self.observers.remove(observer)

    def observer_for(self, site):
        """A gemm.py observer bound to `site`, or None when no observer wants it.

        An observer with a `bind(site) -> callable or None` method can snapshot forward-time
        context or decline a site; others are called as observer(site, gemm, ...)."""
        if not self.observers:
            return None
        bound = [b for b in (_bind(o, site) for o in self.observers) if b is not None]
        if not bound:
            return None
        if len(bound) == 1:
            return bound[0]

        def observe(gemm, operand, hp, q, fmt, axis, **extra):
            for observer in bound:
                observer(gemm, operand, hp, q, fmt, axis, **extra)

        observe.accepts_pieces = all(getattr(b, "accepts_pieces", False) for b in bound)
        return observe

    # -- stochastic rounding -----------------------------------------------------------------

    def start_iteration(self, seed: int, iteration: int, stream: int = 0) -> None:
        """Key the stochastic-rounding draws of the coming iteration (randomness.py)."""
        self.draws.start_iteration(seed, iteration, stream)

    # -- cached quantized weights ------------------------------------------------------------

    def invalidate_weights(self, *_args) -> None:
        """Forget every cached quantized weight copy of this model. Runs after every step of a
        watched optimizer; a weight written without an optimizer step and without autograd's
        version counter seeing it (through `param.data`) needs this call before the next
        forward."""
        self.weights_generation += 1

    def watch_optimizer(self, optimizer) -> None:
        """Invalidate the cached weights after every step of `optimizer`: a torch.optim
        optimizer, or megatron-core's wrappers around them (their `.optimizer` and
        `.chained_optimizers`). megatron-core's mixed-precision and distributed optimizers
        write the updated weights through `param.data`, which autograd's version counter does
        not see; they run a torch.optim step first."""
        for inner in _torch_optimizers(optimizer):
            self._hooks.append(inner.register_step_post_hook(self.invalidate_weights))

    def close(self) -> None:
        """Detach what the run attached: optimizer hooks and observers."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.observers.clear()


def _bind(observer: Observer, site):
    if hasattr(observer, "bind"):
        return observer.bind(site)
    return lambda *report, **extra: observer(site, *report, **extra)


def _torch_optimizers(optimizer) -> List[torch.optim.Optimizer]:
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    found = []
    for inner in getattr(optimizer, "chained_optimizers", None) or []:
        found += _torch_optimizers(inner)
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and inner is not optimizer:
        found += _torch_optimizers(inner)
    if not found:
        raise TypeError(f"{type(optimizer).__name__} holds no torch.optim optimizer to watch")
    return found


def runtimes(modules: Iterable[torch.nn.Module]) -> List[QuantRuntime]:
    """The distinct runtimes of the quantized sites in `modules` (model chunks, wrapped or
    not), in module order."""
    found = []
    for model in modules:
        for module in model.modules():
            runtime = getattr(module, "quant_runtime", None)
            if isinstance(runtime, QuantRuntime) and runtime not in found:
                found.append(runtime)
    return found


def runtime_of(model: torch.nn.Module) -> QuantRuntime:
    """The runtime of a quantized model (apply_quantization gave it one)."""
    found = runtimes([model])
    if len(found) != 1:
        raise ValueError(f"expected one quantized model, found {len(found)} runtimes "
                         "(apply_quantization makes one per model)")
    return found[0]


@contextlib.contextmanager
def observing(modules, observer: Observer):
    """`observer` watches every GEMM site of `modules` (a model or a list of them) for the
    block; removed on exit, also on an exception."""
    modules = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
    found = runtimes(modules)
    if not found:
        raise ValueError("no quantized sites to observe (the model was not converted)")
    for runtime in found:
        runtime.add_observer(observer)
    try:
        yield observer
    finally:
        for runtime in found:
            runtime.remove_observer(observer)
