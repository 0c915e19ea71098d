"""Kernel mode "compile" (--quant-kernels compile): the calls of a recipe training run, compiled on
the CPU, give eager's bits, compile no more graphs than they have distinct guard sets, and never
fall back to eager PyTorch in silence: past the module's graph limit they raise.

Dynamo alone keeps at most torch._dynamo.config.recompile_limit (8) graphs per function and runs
the rest eagerly; the compile mode (kernels/compiled.py) feeds its graphs canonical, detached,
whole-block inputs (one graph per option set, whatever the rank, axis, tail or requires_grad)
and raises its own limit for the compiled calls only, with fail_on_recompile_limit_hit.
"""

import contextlib
import math
from dataclasses import dataclass, field
from typing import Optional, Tuple

import pytest
import torch
from torch._dynamo.utils import counters

from megatron.quantization import formats
from megatron.quantization.dispatch import fake_quantize
from megatron.quantization.kernels import compiled

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
BLOCK_SIZES = {"mx": 32, "nvfp4": 16, "fp8": 128}


@dataclass(frozen=True)
class Call:
    """One fake_quantize call of a run: the operand (shape, dtype, requires_grad, transposed
    storage) and the quantization options."""
    fmt: str
    shape: Tuple[int, ...]
    dtype: torch.dtype = torch.bfloat16
    axis: int = -1
    options: dict = field(default_factory=dict)
    requires_grad: bool = False
    transposed: bool = False      # a non-contiguous operand: its last two axes swapped
    amax: Optional[float] = None  # an imposed per-tensor amax
    seed: Optional[int] = None    # stochastic rounding with a generator seeded so
    special: bool = True          # NaN, Inf and an all-zero row in the data

    @property
    def kind(self) -> str:
        return formats.format_info(self.fmt).kind


def operand(call: Call) -> torch.Tensor:
    """Normal numbers spread over 16 decades along the last axis (blocks get scales of their
    own, small elements fall on subnormals), a zero first row, and NaN / Inf in one block."""
    shape = call.shape[:-2] + call.shape[:-3:-1] if call.transposed else call.shape
    g = torch.Generator().manual_seed(sum(shape) + len(call.fmt))
    x = torch.randn(shape, generator=g) * torch.logspace(-8, 8, shape[-1])
    rows = x.view(-1, shape[-1])
    rows[0] = 0.0
    if call.special:
        rows[1, 0], rows[1, 1] = math.nan, -math.inf
    x = x.to(call.dtype)
    if call.transposed:
        x = x.transpose(-1, -2)
    return x.requires_grad_(call.requires_grad)


def quantize(call: Call, x: torch.Tensor, kernels: str) -> torch.Tensor:
    options = dict(call.options)
    if call.amax is not None:
        options["amax"] = torch.tensor(call.amax)
    if call.seed is not None:
        options.update(rounding="stochastic", generator=torch.Generator().manual_seed(call.seed))
    return fake_quantize(x, call.fmt, axis=call.axis, kernels=kernels, **options)


def guard_set(call: Call) -> tuple:
    """What a compiled graph is specialised on: the call's kind, format, dtype and options,
    (not a Hadamard transform, applied before the graph), and which sizes of the graph input
    are 1 (Dynamo's 0/1 specialisation): for blocks along
    an axis [outer, blocks, block, inner], for 2-D tiles [row tiles, ., column tiles, .], for
    element-wise and per-tensor formats the one flat size. Nothing else: not the rank, the
    axis, a tail, requires_grad or the memory layout."""
    options = tuple(sorted((k, str(v)) for k, v in call.options.items() if k != "rht"))
    scaled = (call.fmt, call.dtype, options, call.amax is not None, call.seed is not None)
    n = math.prod(call.shape)
    size = BLOCK_SIZES.get(call.kind)
    if call.options.get("block_2d") or call.options.get("block") == (128, 128):
        rows, cols = call.shape
        return scaled + (-(-rows // size) == 1, -(-cols // size) == 1)
    if size is None or call.options.get("scaling", "block") != "block":
        return scaled + (n == 1,)
    axis = call.axis % len(call.shape)
    outer, inner = math.prod(call.shape[:axis]), math.prod(call.shape[axis + 1:])
    return scaled + (outer == 1, -(-call.shape[axis] // size) == 1, inner == 1)


# The calls of a recipe run (GEMM operands of linears and attention, forward and backward:
# blocked along their reduction axis, tails, bf16 and fp32, operands that require grad), and
# the graphs they need: 14 guard sets.
RUN = [
    # MXFP8, floor, bf16: inputs [s, b, K] and weights along K (outer > 1, inner 1), weights
    # and gradients along the tokens (outer 1), attention [b, K, N] along K (both > 1): 3.
    Call("mxfp8_e4m3", (40, 70), requires_grad=True),
    Call("mxfp8_e4m3", (3, 5, 64)),
    Call("mxfp8_e4m3", (70, 40), transposed=True),
    Call("mxfp8_e4m3", (70, 48), axis=0, requires_grad=True),
    Call("mxfp8_e4m3", (33, 2, 5), axis=0),
    Call("mxfp8_e4m3", (4, 70, 6), axis=1),
    Call("mxfp8_e4m3", (2, 40, 64), axis=1, transposed=True),
    Call("mxfp8_e4m3", (2, 40, 3), axis=-2),
    # MXFP6 rceil in fp32; MXFP4 with stochastic rounding: 1 each.
    Call("mxfp6_e2m3", (40, 70), torch.float32, options=dict(scale_mode="rceil")),
    Call("mxfp6_e2m3", (6, 5, 96), torch.float32, options=dict(scale_mode="rceil")),
    Call("mxfp4", (40, 70), axis=1, seed=1),
    Call("mxfp4", (3, 7, 40), axis=2, seed=2, requires_grad=True),
    # HiFP8: the plain cast in bf16 (a table lookup), saturating in fp32: 1 each.
    Call("hifp8", (40, 70), requires_grad=True),
    Call("hifp8", (3, 5, 7)),
    Call("hifp8", (40, 70), torch.float32, options=dict(saturate=True)),
    # NVFP4 16-blocks in bf16; with an imposed amax (a chunk of an operand) and stochastic
    # rounding in fp32; 16x16 weight tiles with an imposed amax: 1 each.
    Call("nvfp4", (40, 70), special=False),
    Call("nvfp4", (3, 5, 40), special=False, requires_grad=True),
    Call("nvfp4", (40, 70), torch.float32, amax=3e7, seed=3, special=False),
    Call("nvfp4", (40, 70), options=dict(block_2d=True), amax=1e8, special=False,
         requires_grad=True),
    Call("nvfp4", (70, 48), options=dict(block_2d=True), amax=1e8, transposed=True,
         special=False),
    # A Hadamard transform runs eagerly before the graph of the plain call: no graph of its own.
    Call("nvfp4", (40, 64), options=dict(rht=(16, 3)), special=False),
    # FP8: current and delayed tensor scaling, 1x128 blocks along the tokens: 1 each.
    Call("fp8_e4m3", (40, 70), requires_grad=True),
    Call("fp8_e4m3", (3, 5, 7)),
    Call("fp8_e5m2", (40, 70), torch.float32, amax=1e6, options=dict(margin=1, pow2_scale=True)),
    Call("fp8_e4m3", (200, 48), axis=0, options=dict(scaling="block", block=(1, 128))),
    Call("fp8_e4m3", (200, 3, 16), axis=0, options=dict(scaling="block", block=(1, 128))),
    # bf16 pass-through of an fp32 tensor: 1.
    Call("bf16", (40, 70), torch.float32),
]


def assert_same_bits(expected: torch.Tensor, actual: torch.Tensor, what) -> None:
    """Equal bit for bit, NaNs (whose payloads may differ) at the same positions."""
    assert expected.shape == actual.shape and expected.dtype == actual.dtype, what
    assert not actual.requires_grad, what
    nan = expected.isnan()
    assert torch.equal(nan, actual.isnan()), what
    bits = BITS[expected.dtype]
    differ = (expected.view(bits) != actual.view(bits)) & ~nan
    assert not differ.any(), (what, expected[differ][:8], actual[differ][:8])


@contextlib.contextmanager
def fresh_dynamo():
    """An empty Dynamo cache and counters, and afterwards a check that everything traced was
    compiled whole: no graph break, no recompile limit reached."""
    torch._dynamo.reset()
    counters.clear()
    yield counters
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert not [m for m in counters["unimplemented"] if "recompile limit" in m.lower()]
    torch._dynamo.reset()


def dynamo_settings():
    config = torch._dynamo.config
    return config.recompile_limit, config.fail_on_recompile_limit_hit, config.suppress_errors


def test_a_runs_calls_compile_to_eagers_bits_in_one_graph_per_guard_set():
    expected_graphs = len({guard_set(call) for call in RUN})
    assert expected_graphs == 14        # the count written down with RUN
    before = dynamo_settings()
    with fresh_dynamo():
        for call in RUN:
            x = operand(call)
            expected = quantize(call, x, "eager")
            actual = quantize(call, x, "compile")
            assert_same_bits(expected, actual, call)
        graphs = counters["stats"]["unique_graphs"]
    assert 0 < graphs <= expected_graphs, graphs
    assert dynamo_settings() == before      # the limit was raised for the calls only


def test_more_graphs_than_dynamos_own_limit_still_compile():
    """A user's recompile_limit of 2 does not send the third graph of a kind to eager PyTorch:
    the compiled calls run under the module's limit (their patch is honoured at compile
    time), and every graph is counted."""
    x = torch.linspace(-3, 3, 40)
    with fresh_dynamo(), torch._dynamo.config.patch(recompile_limit=2):
        for dtype in (torch.float32, torch.float16, torch.float64):
            xd = x.to(dtype)
            assert torch.equal(fake_quantize(xd, "bf16", kernels="compile"),
                               fake_quantize(xd, "bf16", kernels="eager"))
        assert counters["stats"]["unique_graphs"] == 3


def test_exceeding_the_graph_limit_raises_instead_of_running_eager(monkeypatch):
    monkeypatch.setattr(compiled, "COMPILED_GRAPH_LIMIT", 2)
    x = torch.linspace(-3, 3, 40)
    before = dynamo_settings()
    torch._dynamo.reset()
    try:
        fake_quantize(x, "fp16", kernels="compile")
        fake_quantize(x.double(), "fp16", kernels="compile")
        with pytest.raises(RuntimeError, match="COMPILED_GRAPH_LIMIT = 2") as raised:
            fake_quantize(x.half(), "fp16", kernels="compile")
        assert isinstance(raised.value.__cause__, torch._dynamo.exc.FailOnRecompileLimitHit)
        # Graphs already compiled still serve their calls.
        assert torch.equal(fake_quantize(x, "fp16", kernels="compile"),
                           fake_quantize(x, "fp16", kernels="eager"))
    finally:
        torch._dynamo.reset()
    assert dynamo_settings() == before
