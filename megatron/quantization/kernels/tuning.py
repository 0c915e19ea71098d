"""Launch configurations of the QDQ kernels: tuned on the GPU they run on, fixed under the
interpreter.

On a GPU a kernel runs under triton.autotune over how much work one program takes (its
GROUP_ or BLOCK_ meta-parameter) and its warps: the fastest pair is measured once per key (the
size arguments, the layout and variant constexprs, the argument dtypes) and cached for the
process, so a training run tunes each GEMM operand's shape during its first step. Every
configuration computes the same bits (a program's work is whole blocks); only the speed
differs. Under Triton's interpreter (the CPU tests) the first size and no tuning run.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import triton
import triton.testing

from megatron.quantization.kernels.environment import interpreter_enabled

WARPS = (4, 8)


def launch(kernel, meta: str, sizes: Sequence[int], programs: Callable[[int], int], args,
           key: Sequence[str], **constants) -> None:
    """kernel(*args, **constants) on programs(size) programs with `meta` = size: sizes[0]
    under the interpreter, the tuned one (of `sizes` x WARPS) on a GPU. `key` names the
    arguments whose values select a tuned configuration."""
    if interpreter_enabled():
        kernel[(programs(sizes[0]),)](*args, **{meta: sizes[0]}, **constants)
        return
    tuned = _autotuned(kernel, meta, tuple(sizes), tuple(key))
    tuned[lambda config: (programs(config[meta]),)](*args, **constants)


@functools.lru_cache(maxsize=None)
def _autotuned(kernel, meta: str, sizes, key):
    configs = [triton.Config({meta: size}, num_warps=warps) for size in sizes
               for warps in WARPS]
    return triton.autotune(configs, key=list(key), do_bench=_quick_bench)(kernel)


def _quick_bench(kernel_call, quantiles):
    """A QDQ launch is tens to hundreds of microseconds: 5 ms of warm-up and 20 of timing per
    configuration tell them apart, where triton's default 25 + 100 ms would spend seconds of a
    run's first step on tuning its operands' shapes."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)
