"""Kernel mode "compile": the NVFP4 and FP8 scales of the compiled graphs are eager's.

On CUDA a compiled NVFP4 graph gave a bf16 gradient 1.5 where eager gives 2 (a value on the
E2M1 rounding tie 1.75, one ulp off): Inductor's Triton code divides differently from eager in
two ways, and the CPU shows neither (its C++ code divides correctly rounded and keeps every
division a division), so no CPU result can differ:

- torch.reciprocal (torch <= 2.11) becomes Triton's approximate `1 / x`, outside the
  correctly rounded division of eager_numerics.division_rounding; the scales are reciprocals;
- a division by a constant becomes a multiplication by the constant's reciprocal (two
  roundings).

So the first test checks what prevents both, in the graphs Inductor lowers (after the
decompositions, before code generation): no reciprocal, and every divisor computed from the
graph's inputs. Before kernels/compiled.py rewrote reciprocals as divisions, it failed on the
NVFP4, FP8 and MX graphs. The second checks on the CPU what a baked-in scale would break: one
graph serves tensors of different amax, imposed or not, rounded either way, with eager's bits.
"""

import contextlib

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

from megatron.quantization.dispatch import fake_quantize

from test_compiled_quantization import RUN, assert_same_bits, guard_set, operand, quantize

aten, prims = torch.ops.aten, torch.ops.prims
RECIPROCALS = {aten.reciprocal.default, prims.reciprocal.default}
DIVISIONS = {aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode,
             prims.div.default}


class _Record(CustomGraphPass):
    """A post-grad pass that keeps each graph Inductor is about to lower."""

    def __init__(self):
        self.graphs = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs.append(graph)

    def uuid(self):
        return None         # nothing to cache: every graph is compiled and recorded


@contextlib.contextmanager
def lowered_graphs():
    """The graphs Inductor lowers in the block, compiled from an empty Dynamo cache (no
    Inductor or AOTAutograd cache either: a cache hit would skip the passes)."""
    record = _Record()
    torch._dynamo.reset()
    try:
        with inductor_config.patch(post_grad_custom_post_pass=record, fx_graph_cache=False), \
                functorch_config.patch(enable_autograd_cache=False):
            yield record.graphs
    finally:
        torch._dynamo.reset()


def _from_inputs(node: torch.fx.Node) -> bool:
    """Whether the tensor `node` is computed from a tensor input of the graph: else it is a
    constant to Inductor (sizes taken from the inputs do not count)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        if n.op == "placeholder":
            return True
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def division_hazards(graph: torch.fx.Graph) -> list:
    """The nodes Inductor's CUDA code would round differently from eager: reciprocals, and
    divisions by a number or by a tensor that is a constant."""
    hazards = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in RECIPROCALS:
            hazards.append(node.format_node())
        elif node.target in DIVISIONS:
            divisor = node.args[1]
            if not (isinstance(divisor, torch.fx.Node) and _from_inputs(divisor)):
                hazards.append(node.format_node())
    return hazards


def _one_call_per_option_set():
    """A recipe run's calls (test_compiled_quantization.RUN), one per format and option set:
    the sizes only change which sizes are 1, not the arithmetic."""
    calls = {}
    for call in RUN:
        calls.setdefault(guard_set(call)[:5], call)
    return list(calls.values())


def _call_id(call) -> str:
    flags = sorted(call.options) + ["amax"] * (call.amax is not None) + ["sr"] * bool(call.seed)
    return "-".join([call.fmt, str(call.dtype).removeprefix("torch."), *flags])


@pytest.mark.parametrize("call", _one_call_per_option_set(), ids=_call_id)
def test_compiled_graphs_divide_as_eager_does(call):
    x = operand(call)
    with lowered_graphs() as graphs:
        actual = quantize(call, x, "compile")
    assert graphs, "nothing was compiled"
    hazards = [h for g in graphs for h in division_hazards(g)]
    assert not hazards, hazards
    assert_same_bits(quantize(call, x, "eager"), actual, call)


def _gradient(shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    """A bf16 gradient as test_cuda.py draws it: normal numbers over 12 decades along the last
    axis, a zero first row; `scale` moves its amax (and makes it no power of two apart)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-6, 6, shape[-1]) * scale
    x.view(-1, shape[-1])[0] = 0.0
    return x.to(torch.bfloat16)


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_one_nvfp4_graph_serves_every_amax_with_eagers_bits():
    """Operands of different amax through the graph compiled for the first: nothing about
    one call's scales may stay in the graph (a guard on them would recompile, a constant would
    give wrong bits). The (65, 2, 160) gradient is the operand CUDA got wrong; the 4-D input
    of that linear goes along its last axis (the same graph) and a middle one."""
    torch._dynamo.reset()
    counters.clear()
    try:
        # (tensors, axis, options): each group compiles one graph, on its first tensor.
        groups = [
            ([_gradient((65, 2, 160), 2, s) for s in (1.0, 3.7e-4, 0.37)]
             + [_gradient((65, 2, 96, 160), 0)], -1, {}),
            ([_gradient((65, 2, 96, 160), 0, s) for s in (1.0, 0.0123)], 2, {}),
            ([_gradient((130, 160), 2, s).float() for s in (1.0, 0.37)], 0, {}),
        ]
        for amax in (3e6, 1e4, 7.5):
            groups.append(([_gradient((130, 160), 2).float()], 0, {"amax": torch.tensor(amax)}))
        for seed in (1, 2):
            groups.append(([_gradient((65, 2, 160), 2, 0.37 * seed)], -1, {"seed": seed}))
        graphs = []
        for tensors, axis, options in groups:
            for x in tensors:
                results = []
                for kernels in ("eager", "compile"):
                    kwargs = {k: v for k, v in options.items() if k != "seed"}
                    if "seed" in options:
                        kwargs.update(rounding="stochastic",
                                      generator=torch.Generator().manual_seed(options["seed"]))
                    results.append(fake_quantize(x, "nvfp4", axis=axis, kernels=kernels,
                                                 **kwargs))
                assert_same_bits(*results, (tuple(x.shape), axis, options))
            graphs.append(_graphs())
        # One graph per distinct option set and pattern of sizes equal to 1: the sequence
        # and values of amax add none.
        assert graphs == [1, 2, 3, 4, 4, 4, 5, 5], graphs
        assert not counters["graph_break"], dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
