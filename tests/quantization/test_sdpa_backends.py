"""Which SDPA call the fused attention path makes for grouped K/V heads: passed as they are
(enable_gqa) where flash attention can take them, expanded to one head per query head where
CUDA's flash cannot run, so that no case falls to SDPA's math kernel (full scores). CPU checks;
tests/test_cuda_sdpa.py runs the CUDA kernels."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.quantization import attention as attention_module
from megatron.quantization.attention import sdpa_needs_expanded_kv
from megatron.quantization.local_attention import causal_mask

from test_attention_paths import _compare, _inputs, _module, _run

BF16, FP32 = torch.bfloat16, torch.float32
HEADS, GROUPS, DIM = 8, 2, 32
CASES = ("causal", "mask", "sq<sk")
dtypes = pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])

# (device type, dtype, explicit mask, grouped heads) -> K/V expanded; head dims 64.
DECISIONS = [
    ("cuda", BF16, False, True, False),    # flash takes enable_gqa
    ("cuda", BF16, True, True, True),      # flash takes no mask
    ("cuda", FP32, False, True, True),     # flash takes no fp32
    ("cuda", FP32, True, True, True),
    ("cuda", BF16, False, False, False),   # one K/V head per query head already
    ("cuda", BF16, True, False, False),
    ("cuda", FP32, False, False, False),
    ("cuda", FP32, True, False, False),
    ("cpu", BF16, False, True, False),     # the CPU's flash kernel takes all of these
    ("cpu", BF16, True, True, False),
    ("cpu", FP32, False, True, False),
    ("cpu", FP32, True, True, False),
    ("cpu", BF16, False, False, False),
    ("cpu", BF16, True, False, False),
    ("cpu", FP32, False, False, False),
    ("cpu", FP32, True, False, False),
]


def _row_id(row):
    device, dtype, masked, grouped, _ = row
    return "-".join((device, str(dtype).split(".")[-1], "mask" if masked else "no_mask",
                     "grouped" if grouped else "not_grouped"))


@pytest.mark.parametrize("device,dtype,masked,grouped,expanded", DECISIONS,
                         ids=[_row_id(row) for row in DECISIONS])
def test_decision_table(device, dtype, masked, grouped, expanded):
    assert sdpa_needs_expanded_kv(device, dtype, masked, grouped, 64, 64) == expanded


@pytest.mark.parametrize("head_dim,value_head_dim,expanded", [
    (256, 256, False), (257, 257, True), (192, 128, True)])
def test_decision_by_head_dims(head_dim, value_head_dim, expanded):
    """CUDA's flash kernel takes equal q/k/v head dims up to 256 (bf16, no mask, grouped)."""
    assert sdpa_needs_expanded_kv("cuda", BF16, False, True, head_dim,
                                  value_head_dim) == expanded
    assert not sdpa_needs_expanded_kv("cpu", BF16, False, True, head_dim, value_head_dim)


def _case(name, heads, groups, dtype):
    """Inputs and mask of one case: causal (is_causal, no mask), an explicit per-sample mask
    (causal, and the last 8 keys of sample 1 are padding), or fewer queries than keys (the
    bottom-right causal mask, built by the module)."""
    sq, sk = (40, 72) if name == "sq<sk" else (40, 40)
    query = _inputs(sq, 2, heads, groups, DIM, dtype)[0]
    key, value = _inputs(sk, 2, heads, groups, DIM, dtype, seed=1)[1:]
    mask = None
    if name == "mask":
        mask = causal_mask(sq, sk, torch.device("cpu")).repeat(2, 1, 1, 1)
        mask[1, :, :, sk - 8:] = True     # no row loses all its keys
    return [query, key, value], mask


def _grad(inputs):
    q = inputs[0]
    g = torch.Generator().manual_seed(9)
    return torch.randn(q.size(0), q.size(1), q.size(2) * q.size(3), generator=g).to(q.dtype)


def _sdpa_calls(monkeypatch):
    """Head counts and keyword arguments of every SDPA call the module makes."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        calls.append(dict(kwargs, query_heads=query.size(1), key_heads=key.size(1)))
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", spy)
    return calls


def _decide(monkeypatch, decision):
    monkeypatch.setattr(attention_module, "sdpa_needs_expanded_kv", decision)


def _assert_same_attention(native, expanded, dtype):
    """Forward and dQ bit for bit. dK and dV sum the gradients of the 4 query heads of a group:
    the CPU's GQA kernel sums them in its own order, in fp32, the expanded path in
    repeat_interleave's backward, in the input dtype (bf16: each head's term rounded first).
    They differ by a few roundings of that sum: 4 unit roundoffs of its largest magnitude
    bound them (seen: at most 2, in fp32 and in bf16)."""
    (out, grads), (out_expanded, grads_expanded) = native, expanded
    assert torch.equal(out, out_expanded)
    assert torch.equal(grads[0], grads_expanded[0])
    unit_roundoff = torch.finfo(dtype).eps / 2
    for grad, grad_expanded in zip(grads[1:], grads_expanded[1:]):
        bound = (HEADS // GROUPS) * unit_roundoff * grad.abs().max().item()
        torch.testing.assert_close(grad_expanded, grad, rtol=0, atol=bound)


def _runs(module, monkeypatch, decisions, dtype, case):
    """Output and input gradients of the module on one case under each K/V decision."""
    inputs, mask = _case(case, HEADS, GROUPS, dtype)
    runs = []
    for decision in decisions:
        _decide(monkeypatch, decision)
        runs.append(_run(lambda q, k, v: module(q, k, v, mask), inputs, _grad(inputs)))
    return runs


@dtypes
@pytest.mark.parametrize("case", CASES)
def test_expanded_kv_equals_enable_gqa(world_size_one, monkeypatch, dtype, case):
    """K/V expanded to one head per query head give enable_gqa's results, in every case."""
    calls = _sdpa_calls(monkeypatch)
    native, expanded = _runs(_module(world_size_one), monkeypatch,
                             (lambda *args: False, lambda *args: True), dtype, case)
    assert [(c["enable_gqa"], c["key_heads"]) for c in calls] == [(True, GROUPS), (False, HEADS)]
    _assert_same_attention(native, expanded, dtype)


@dtypes
@pytest.mark.parametrize("heads,groups", [(HEADS, GROUPS), (4, 4)])
@pytest.mark.parametrize("case", CASES)
def test_cpu_takes_the_flash_kernel_in_every_case(world_size_one, monkeypatch, dtype, heads,
                                                  groups, case):
    """With only the flash kernel allowed (a math fallback raises), the fused path runs forward
    and backward on the CPU: its flash kernel takes masks, fp32 and enable_gqa."""
    calls = _sdpa_calls(monkeypatch)
    module = _module(world_size_one)
    inputs, mask = _case(case, heads, groups, dtype)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out, grads = _run(lambda q, k, v: module(q, k, v, mask), inputs, _grad(inputs))
    assert len(calls) == 1 and calls[0]["enable_gqa"] == (heads != groups)
    assert all(torch.isfinite(t).all() for t in (out, *grads))


@dtypes
@pytest.mark.parametrize("case", CASES)
def test_cuda_decision_on_cpu_tensors(world_size_one, monkeypatch, dtype, case):
    """The module's SDPA call as on a GPU, made on the CPU under the flash kernel alone: the
    decision taken for device type "cuda". Expanded K/V come with enable_gqa off and one head
    per query head -- what CUDA's memory-efficient kernel takes -- and give the CPU's own
    (enable_gqa) results; fp32 also matches the unfused reference."""
    calls = _sdpa_calls(monkeypatch)
    module = _module(world_size_one)
    as_on_cuda = lambda device_type, *rest: sdpa_needs_expanded_kv("cuda", *rest)  # noqa: E731
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        native, on_cuda = _runs(module, monkeypatch, (sdpa_needs_expanded_kv, as_on_cuda),
                                dtype, case)
        if dtype == FP32:
            _compare(module, *_case(case, HEADS, GROUPS, dtype), rtol=1e-4, atol=1e-5)
    expanded = dtype == FP32 or case != "causal"
    assert calls[1]["enable_gqa"] == (not expanded)
    assert calls[1]["key_heads"] == (HEADS if expanded else GROUPS)
    _assert_same_attention(native, on_cuda, dtype)
