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

from megatron.quantization.kernels.bits import ROWS, axis_layout, square_tiles
from megatron.quantization.kernels.environment import interpreter_enabled

WARPS = (4, 8)
# Elements per program the launches tune over (the first: the interpreter's, untuned).
ELEMENTS_PER_PROGRAM = (2048, 1024, 4096, 8192)


def axis_launch(shape, axis: int, width: int):
    """(block_offsets' arguments, LAYOUT, the groups to tune over, programs(group)) for runs
    of `width` elements along `axis` of a contiguous tensor of `shape`."""
    groups = [size // width for size in ELEMENTS_PER_PROGRAM]
    args, layout, _ = axis_layout(shape, axis, width, groups[0])
    return args, layout, groups, lambda group: axis_layout(shape, axis, width, group)[2]


def tile_launch(shape, tile: int):
    """The same for tile x tile tiles of a 2-D tensor (square_tiles' arguments; at least one
    tile per program; LAYOUT unused by the tile kernels)."""
    args = square_tiles(shape, tile)
    groups = list(dict.fromkeys(max(1, size // (tile * tile)) for size in ELEMENTS_PER_PROGRAM))
    return args, ROWS, groups, lambda group: -(-args[0] // group)


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
