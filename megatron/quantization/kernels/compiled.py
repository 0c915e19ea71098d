"""Kernel mode "compile": fake_quantize's eager definition (formats.apply_format) compiled by
torch.compile, with the same bits.

"compile" compiles one function per format kind (MX, NVFP4, FP8, HiFP8, bf16/fp16), whole
(fullgraph, dynamic shapes, Inductor set to keep eager's roundings). Each call hands it x
detached, contiguous and viewed with the blocks on dimensions of their own, the block axis
in the middle ([outer, nblocks, block, inner], the Triton kernels' view; 2-D tiles as
[rows / b, b, cols / b, b]; element-wise and per-tensor formats flat), a tail zero-padded
beforehand and cropped afterwards. So one graph serves every rank, block axis, length and
requires_grad: a graph per distinct (format, dtype, rounding, scale mode, saturate, block_2d,
imposed amax or not, FP8 scaling options), times Dynamo's specialisation of sizes equal to 1
(outer, the number of blocks, inner). Dynamo would run eager PyTorch, in silence, past
torch._dynamo.config.recompile_limit (8) graphs of a function; the compiled calls instead run
under a patch of their own (not the user's other code) that allows COMPILED_GRAPH_LIMIT
graphs per kind and raises past it, as it raises on a compilation error or graph break.

The graphs go through Inductor set to divide as eager does (_EAGER_NUMERICS), with
torch.reciprocal rewritten as a division (_inductor): Inductor up to torch 2.11 lowers
reciprocal to `1 / x` outside the correctly rounded division, and in Triton that is an
approximation, off by an ulp at times. The NVFP4 and FP8 scales are reciprocals; one ulp
moves a value sitting on an E2M1 rounding tie (dgrad's bf16 gradients hold such values), so a
CUDA graph gave 1.5 where eager gives 2.
"""

from __future__ import annotations

from types import MappingProxyType
import functools
import math
import types
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.quantization.formats import (
    FP8_TILE, MX_BLOCK_SIZE, NVFP4_BLOCK_SIZE, QuantizeCall, apply_format,
    prepare_hifp8_tables)

# The graphs each format kind may compile before one more raises an error. Past Dynamo's own
# limit (torch._dynamo.config.recompile_limit, 8 by default) torch.compile would instead run
# eager PyTorch from then on, in silence. Each distinct guard set is one graph: the format,
# dtype, rounding, scale mode, saturate, block_2d, imposed amax or not and FP8 scaling options
# of a call, times the pattern of its graph input's sizes equal to 1 (Dynamo specialises on
# them: outer, the number of blocks, inner; a run's GEMMs show three patterns). A recipe uses
# per kind a few formats, both roundings and one or two dtypes, e.g. MX 3 formats x 2
# roundings x 2 dtypes x 3 patterns = 36; the limit leaves room for recipe files mixing
# configs, and still stops a runaway recompilation within minutes.
COMPILED_GRAPH_LIMIT = 64

# Inductor options that keep eager's roundings, which the formats are defined by: a cast to a
# narrower dtype and back is kept (fused, bf16(x) would else stay x: the bf16 and fp16
# formats), no FMA contraction, and float32 division correctly rounded in Triton kernels (its
# default is an approximation; the NVFP4 and FP8 scales are quotients).
_EAGER_NUMERICS = MappingProxyType({"emulate_precision_casts": True,
                                    "eager_numerics.division_rounding": True})


def _reciprocal_as_division(x: torch.Tensor):
    """aten.reciprocal as 1 / x, a true division: under division_rounding Inductor's Triton
    code divides correctly rounded (div_rn) as eager does, while its own lowering of
    reciprocal (torch <= 2.11) is Triton's approximate `1 / x`."""
    if not x.is_floating_point():
        return NotImplemented
    return torch.div(torch.ones_like(x), x)


def _inductor(graph, example_inputs):
    """The torch.compile backend: Inductor with _EAGER_NUMERICS and reciprocals as divisions.

    Division by a constant stays a hazard on the GPU: Inductor's lowering turns it into a
    multiplication by the reciprocal there (not on the CPU). No format the graphs cover divides
    by a constant (test_compiled_tensor_scales.py checks the graphs for both)."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    table = dict(select_decomp_table())
    table[torch.ops.aten.reciprocal.default] = _reciprocal_as_division
    return compile_fx(graph, example_inputs, config_patches=dict(_EAGER_NUMERICS),
                      decompositions=table)


# How the compiled graphs take their input (see _graph_input).
_BLOCKS, _TILES, _FLAT = "blocks", "tiles", "flat"


def _layout(kind: str, block_2d: bool, scaling, block) -> Tuple[str, int]:
    """(layout, block size): _BLOCKS for 1-D blocks along an axis, _TILES for square 2-D
    tiles (NVFP4 block_2d, FP8 (128, 128)), _FLAT for element-wise and per-tensor scaling."""
    if kind == "mx":
        return _BLOCKS, MX_BLOCK_SIZE
    if kind == "nvfp4":
        return (_TILES if block_2d else _BLOCKS), NVFP4_BLOCK_SIZE
    if kind == "fp8" and scaling == "block":
        return (_TILES if block == (FP8_TILE, FP8_TILE) else _BLOCKS), FP8_TILE
    return _FLAT, 1


def _pad_to_multiple(t: torch.Tensor, dims, size: int) -> torch.Tensor:
    """t zero-padded at the end of `dims` to multiples of `size` (itself when they are)."""
    pads = [-t.shape[d] % size for d in dims]
    if not any(pads):
        return t
    spec = [0, 0] * t.dim()
    for d, pad in zip(dims, pads):
        spec[2 * (t.dim() - 1 - d) + 1] = pad
    return F.pad(t, spec)      # zeros never change an amax (P14); the caller crops


def _graph_input(t: torch.Tensor, axis: int, layout: str, size: int) -> torch.Tensor:
    """t as the compiled graphs take it: contiguous, whole blocks only, each on a dimension of
    its own of static length; a view of t when t is contiguous and nothing needs padding.

    _BLOCKS: [outer, nblocks, size, inner] (the Triton kernels' [outer, length, inner] view,
    the blocked axis in the middle); _TILES: [rows / size, size, cols / size, size]; _FLAT:
    1-D. Only the sizes then differ between operands, and dynamic shapes cover sizes: one
    graph serves every rank, block axis, memory layout and length, tails included (a graph
    that padded and cropped a tail itself would guard on whether the length was a multiple of
    the block). Detached, so that it is no view either: Dynamo guards on the base of a view."""
    t = t.contiguous()      # a permuted operand would be a graph (and guards) of its own
    if layout == _FLAT:
        return t.view(-1).detach()
    if layout == _BLOCKS:
        shape = t.shape
        t = t.view(math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:]))
        t = _pad_to_multiple(t, (1,), size)
        return t.view(t.shape[0], t.shape[1] // size, size, t.shape[2]).detach()
    t = _pad_to_multiple(t, (0, 1), size)
    return t.view(t.shape[0] // size, size, t.shape[1] // size, size).detach()


def _from_graph_input(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The tensor the shared dispatch quantizes: [outer, length, inner] blocked along 1,
    the padded 2-D tensor, or the 1-D one."""
    if layout == _BLOCKS:
        return t.flatten(1, 2)
    if layout == _TILES:
        return t.flatten(2, 3).flatten(0, 1)
    return t


def _graph_output_to(out: torch.Tensor, x: torch.Tensor, axis: int,
                     layout: str) -> torch.Tensor:
    """A compiled graph's result in x's shape, the padding cropped (a copy only then)."""
    if layout == _BLOCKS:
        out = out.flatten(1, 2).narrow(1, 0, x.shape[axis])
    elif layout == _TILES:
        out = out.flatten(2, 3).flatten(0, 1)[:x.shape[0], :x.shape[1]]
    return out.reshape(x.shape)


def _compiled_body(x, layout, fmt, scale_mode, saturate, options, noise, amax):
    """What torch.compile traces: the shared dispatch on a _graph_input, its result in the
    same layout."""
    work = _from_graph_input(x, layout)
    if noise is not None:
        noise = _from_graph_input(noise, layout)
    out = apply_format(work, fmt, 1 if layout == _BLOCKS else 0, scale_mode, saturate,
                              options, noise, amax)
    return out.reshape(x.shape)


@functools.lru_cache(maxsize=None)
def _compiled_impl(kind: str):
    """torch.compile of _compiled_body for one format kind ("mx", "nvfp4", "fp8", "hifp8",
    "float"). Dynamo keeps graphs, and counts them against its recompile limit, per code
    object: each kind compiles a copy of the body's code of its own, so that the graphs of one
    kind never use up another's limit. fullgraph: a graph break raises too, rather than
    leaving part of the call to eager PyTorch."""
    name = f"fake_quantize_{kind}"
    code = _compiled_body.__code__.replace(co_name=name, co_qualname=name)
    body = types.FunctionType(code, _compiled_body.__globals__, name)
    return torch.compile(body, backend=_inductor, dynamic=True, fullgraph=True)


@functools.lru_cache(maxsize=None)
def _raising_past(limit: int):
    """Dynamo settings for the compiled calls only (a thread-local patch, undone on exit,
    reusable): up to `limit` graphs per kind, then an error instead of eager PyTorch;
    compilation errors raised instead of suppressed (the two settings exclude each other); and
    float options (the FP8 margin) constants of the graph, as the code reads them with
    Python's math functions."""
    import torch._dynamo    # not imported with torch; only the compile mode needs it

    return torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True,
                                      suppress_errors=False, specialize_float=True)


def compiled_fake_quantize(x: torch.Tensor, call: QuantizeCall,
                           noise: Optional[torch.Tensor]) -> torch.Tensor:
    """apply_format's bits through the compiled graphs of the call's kind."""
    if call.fmt == "none":
        return x
    if x.numel() == 0:
        return x.clone()
    fmt, kind, axis, scale_mode, saturate = (call.fmt, call.kind, call.axis, call.scale_mode,
                                             call.saturate)
    options, amax = call.options, call.amax
    block_2d, scaling, _, _, block, _ = options
    layout, size = _layout(kind, block_2d, scaling, block)
    # x detached: the result carries no autograd history anyway, and requires_grad is a guard.
    graph_x = _graph_input(x, axis, layout, size)
    if noise is not None:
        noise = _graph_input(noise, axis, layout, size)
    if kind == "hifp8":
        prepare_hifp8_tables(x.dtype, saturate, x.device)
    limit = COMPILED_GRAPH_LIMIT
    try:
        with _raising_past(limit):
            out = _compiled_impl(kind)(graph_x, layout, fmt, scale_mode, saturate, options,
                                       noise, amax)
    except torch._dynamo.exc.FailOnRecompileLimitHit as error:
        raise RuntimeError(
            f"kernel mode 'compile': fake_quantize's {kind} graphs would exceed "
            f"COMPILED_GRAPH_LIMIT = {limit} with this call ({fmt}, {x.dtype}, shape "
            f"{tuple(x.shape)}, axis {axis}); past the limit torch.compile would run eager "
            "PyTorch. Each distinct format, dtype, rounding, scale mode and option set takes a "
            "graph, times the 0/1 specialisations of the sizes: raise megatron.quantization."
            "kernels.compiled.COMPILED_GRAPH_LIMIT if the run needs that many, else look for "
            "the guard that recompiles (TORCH_LOGS=recompiles)") from error
    return _graph_output_to(out, x, axis, layout)
