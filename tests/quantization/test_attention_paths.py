"""The three attention paths against the unfused reference: chunked (quantized, linear
memory), fused SDPA (nothing quantized) and the unfused path itself when observed."""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType

from megatron.quantization import attention as attention_module
from megatron.quantization.attention import (
    CHUNK_BYTES, GPU_CHUNK_MAX_BYTES, QuantDotProductAttention, chunk_bounds, chunk_bytes_for,
    chunk_key_extent, default_chunk_rows, free_device_bytes, reference_attention)
from megatron.quantization.config import (
    AttentionSettings, BackendSettings, Fp8Settings, HiFP8Settings, QuantSettings)
from megatron.quantization.formats import fake_quantize
from megatron.quantization.gemm import SiteState
from megatron.quantization.local_attention import causal_mask
from megatron.quantization.observers import GemmSite, QuantizationCounter
from megatron.quantization.runtime import QuantRuntime, observing, runtime_of
from megatron.quantization.schemes import site_config
from megatron.training.model import core_transformer_config_from_args


def _inputs(sq, b, heads, groups, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, heads, dim, generator=g)
    k = torch.randn(sq, b, groups, dim, generator=g) * 2.0
    v = torch.randn(sq, b, groups, dim, generator=g)
    return [t.to(dtype) for t in (q, k, v)]


def _module(args, qk="none", pv="none", chunk_rows=None, dropout=0.0, hifp8_scaling="none",
            stochastic=(), kernels="auto"):
    """A QuantDotProductAttention whose QK^T and PV sites are quantized in `qk` and `pv` (MXFP8
    gradients in E4M3, floor scales, FP8 with current (tensorwise) scaling and hybrid
    gradients, HiFP8 per `hifp8_scaling`), sharing one runtime of kernel mode `kernels` (its
    observers and stochastic-rounding draws: runtime_of(module)), as a converted model's."""
    cfg = core_transformer_config_from_args(args)
    cfg.attention_dropout = dropout
    module = QuantDotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                      attention_type="self")
    settings = QuantSettings(hifp8=HiFP8Settings(scaling=hifp8_scaling))
    runtime = QuantRuntime(BackendSettings(kernels=kernels))
    for name, fmt in (("qk", qk), ("pv", pv)):
        config = site_config(fmt, settings, stochastic=frozenset(stochastic))
        if fmt != "none":
            config = config.replace(fp8=Fp8Settings(recipe="tensorwise"))
        setattr(module, f"{name}_site", GemmSite(f"attn.{name}", f"attn_{name}", 1, config,
                                                 SiteState(f"attn.{name}", config, runtime)))
    module.attention = AttentionSettings(chunk_rows=chunk_rows)
    module.quant_runtime = runtime      # as the converter gives a model its runtime
    return module


def _run(fn, inputs, grad):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


def _compare(module, inputs, mask, rtol, atol):
    grad = torch.randn(inputs[0].size(0), inputs[0].size(1), inputs[0].size(2) * inputs[0].size(3),
                       generator=torch.Generator().manual_seed(9)).to(inputs[0].dtype)
    out, grads = _run(lambda q, k, v: module(q, k, v, mask), inputs, grad)
    ref, ref_grads = _run(lambda q, k, v: reference_attention(module, q, k, v, mask), inputs, grad)
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    for mine, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(mine, theirs, rtol=rtol, atol=atol)


# sq=72 with 4 heads per group: 288 rows, chunks of 64 end in a partial MX block (288 = 4*64+32)
# and a chunk boundary falls inside a head's rows.
@pytest.mark.parametrize("qk,pv", [("mxfp8", "none"), ("none", "mxfp8"), ("mxfp4", "mxfp4"),
                                   ("hifp8", "hifp8"), ("mxfp8", "mxfp4")])
@pytest.mark.parametrize("heads,groups", [(8, 2), (4, 4)])
def test_chunked_equals_unfused_fp32(world_size_one, qk, pv, heads, groups):
    module = _module(world_size_one, qk, pv, chunk_rows=64)
    inputs = _inputs(72, 2, heads, groups, 32, torch.float32)
    mask = causal_mask(72, 72, torch.device("cpu"))
    _compare(module, inputs, mask, rtol=1e-4, atol=1e-5)
    _compare(module, inputs, None, rtol=1e-4, atol=1e-5)   # causal mask made per chunk


def _spread_inputs(dtype):
    """q rows and the output gradient grow by 2**5 from the first chunk to the last, so the
    chunks' own amaxes fall in different binades than the whole tensors' (and P's first row
    is exactly 1 under the causal mask, while later chunks peak below 1)."""
    q, k, v = _inputs(72, 2, 4, 2, 32, torch.float32)
    ramp = 2.0 ** torch.linspace(-3, 2, 72)
    return [t.to(dtype) for t in (q * ramp[:, None, None, None], k, v)]


@pytest.mark.parametrize("qk,pv", [("hifp8", "hifp8"), ("hifp8", "none"), ("none", "hifp8")])
def test_chunked_equals_unfused_with_hifp8_tensor_scaling(world_size_one, qk, pv):
    """Tensor-scaled operands cut into chunks (Q, P, dS, dO) use the whole operand's scale."""
    module = _module(world_size_one, qk, pv, chunk_rows=64, hifp8_scaling="tensor")
    inputs = _spread_inputs(torch.float32)
    _compare(module, inputs, None, rtol=1e-4, atol=1e-5)


def test_hifp8_tensor_scaling_per_chunk_would_differ(world_size_one, monkeypatch):
    """The check above can fail: scaling each chunk by its own amax changes the result."""
    module = _module(world_size_one, "hifp8", "hifp8", chunk_rows=64, hifp8_scaling="tensor")
    monkeypatch.setattr(attention_module, "_needs_whole_scale", lambda config, keys: False)
    with pytest.raises(AssertionError):
        _compare(module, _spread_inputs(torch.float32), None, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("qk,pv", [("nvfp4", "nvfp4"), ("fp8", "fp8"), ("nvfp4", "none"),
                                   ("none", "fp8")])
def test_chunked_equals_unfused_with_tensor_scaled_formats(world_size_one, qk, pv):
    """NVFP4's float32 tensor scale and FP8's per-tensor (current) scale of an operand cut into
    chunks come from the whole operand's amax, as in the unfused path."""
    module = _module(world_size_one, qk, pv, chunk_rows=64)
    _compare(module, _spread_inputs(torch.float32), None, rtol=1e-4, atol=1e-5)


def test_nvfp4_tensor_scale_per_chunk_would_differ(world_size_one, monkeypatch):
    module = _module(world_size_one, "nvfp4", "nvfp4", chunk_rows=64)
    monkeypatch.setattr(attention_module, "_needs_whole_scale", lambda config, keys: False)
    with pytest.raises(AssertionError):
        _compare(module, _spread_inputs(torch.float32), None, rtol=1e-4, atol=1e-5)


def test_chunked_equals_unfused_bf16(world_size_one):
    module = _module(world_size_one, "mxfp8", "mxfp8", chunk_rows=32)
    inputs = _inputs(40, 2, 4, 2, 32, torch.bfloat16)
    # bf16: the GEMM results are rounded to bf16 per chunk (dK, dV: per chunk, then summed).
    _compare(module, inputs, None, rtol=2e-2, atol=2e-2)


def test_chunked_with_a_per_sample_padding_mask(world_size_one):
    module = _module(world_size_one, "mxfp8", "mxfp8", chunk_rows=32)
    module.attn_mask_type = AttnMaskType.padding
    inputs = _inputs(48, 2, 4, 2, 32, torch.float32)
    mask = causal_mask(48, 48, torch.device("cpu")).repeat(2, 1, 1, 1)
    mask[1, :, :, 40:] = True          # sample 1: the last 8 keys are padding
    mask[1, :, :, 0] = False
    _compare(module, inputs, mask, rtol=1e-4, atol=1e-5)


def test_chunks_never_cut_an_mx_block():
    """The wgrad operands are blocked along the row axis: quantizing a chunk alone gives the
    rows of quantizing the whole tensor, for every chunk including a partial last one."""
    x = torch.randn(3, 288 + 17, 8, generator=torch.Generator().manual_seed(1)) * 10
    whole = fake_quantize(x, "mxfp4", axis=1)
    bounds = chunk_bounds(x.size(1), 64)
    assert bounds[-1] == (256, 305) and all(r0 % 32 == 0 for r0, _ in bounds)
    for r0, r1 in bounds:
        assert torch.equal(fake_quantize(x[:, r0:r1], "mxfp4", axis=1), whole[:, r0:r1])
    with pytest.raises(ValueError, match="not a positive multiple of 32"):
        chunk_bounds(100, 48)
    assert default_chunk_rows(16, 8192) == 64       # 32 MiB / (16 * 8192 * 4 B) rows
    assert default_chunk_rows(1024, 8192) == 32     # never below one MX block


def test_chunk_size_from_free_device_memory(monkeypatch):
    """32 MiB of fp32 scores per chunk on a CPU; on a GPU 1/32 of the free memory (the
    driver's free memory plus what the caching allocator holds unused), at least 32 MiB and
    at most 512 MiB."""
    mib, gib = 2 ** 20, 2 ** 30
    assert free_device_bytes(torch.device("cpu")) is None
    assert chunk_bytes_for(None) == CHUNK_BYTES == 32 * mib
    assert chunk_bytes_for(8 * gib) == 256 * mib
    assert chunk_bytes_for(70 * gib) == GPU_CHUNK_MAX_BYTES == 512 * mib
    assert chunk_bytes_for(512 * mib) == 32 * mib
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 4 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * gib)
    free = free_device_bytes(torch.device("cuda", 0))
    assert free == 8 * gib
    # Llama 3.1 8B under TP2 at seq 8192, micro-batch 1: 4 query groups of 4 heads.
    assert default_chunk_rows(4, 8192, chunk_bytes_for(free)) == 2048


def test_causal_key_extents():
    """Rows r = head * sq + position see the keys j <= position + sk - sq; extents are
    rounded up to 32 keys, and a chunk that wraps into the next head sees them all."""
    assert [chunk_key_extent(r0, r1, 128, 128) for r0, r1 in chunk_bounds(256, 32)] == \
        [32, 64, 96, 128, 32, 64, 96, 128]
    assert chunk_key_extent(0, 40, 72, 72) == 64          # positions 0..39 -> keys 0..39
    assert chunk_key_extent(64, 96, 72, 72) == 72         # 64..71 of head 0, 0..23 of head 1
    assert chunk_key_extent(0, 32, 40, 72) == 64          # sk > sq: position 31 sees 63 keys
    assert chunk_key_extent(0, 32, 72, 40) == 40          # sk < sq: rows that see no key


def _bits(t):
    return t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _chunk_extents(monkeypatch):
    """The key extents every chunked call uses (a spy on _ChunkedAttention.apply)."""
    seen = []
    real = attention_module._ChunkedAttention.apply

    def spy(*args):
        seen.append(list(args[-1]))
        return real(*args)

    monkeypatch.setattr(attention_module._ChunkedAttention, "apply", spy)
    return seen


@pytest.mark.parametrize("qk,pv,scaling,stochastic,dtype,sq,sk", [
    ("mxfp8", "mxfp8", "none", (), torch.float32, 72, 72),
    ("mxfp4", "mxfp8", "none", (), torch.bfloat16, 72, 72),
    ("nvfp4", "nvfp4", "none", (), torch.float32, 72, 72),
    ("fp8", "fp8", "none", (), torch.float32, 40, 72),
    ("hifp8", "hifp8", "tensor", (), torch.float32, 72, 40),
    ("none", "mxfp8", "none", (), torch.float32, 96, 96),
    ("mxfp8", "none", "none", (), torch.bfloat16, 96, 96),
    ("nvfp4", "nvfp4", "none", ("fprop.b", "dgrad.b"), torch.float32, 72, 72),
    ("mxfp8", "mxfp8", "none", ("dgrad.a", "wgrad.b"), torch.float32, 72, 72),
])
def test_shared_operands_and_skipped_key_blocks_change_no_bit(world_size_one, monkeypatch, qk,
                                                              pv, scaling, stochastic, dtype,
                                                              sq, sk):
    """K^T and V quantized once per GEMM slot and the causal key blocks a chunk cannot see left
    out: output and gradients bit for bit those of quantizing in every chunk over all keys
    (the previous path), draws of stochastic rounding included. A stochastically rounded
    K^T or V is still quantized at every use; stochastically rounded dS (or P) skips no key
    block (its draws follow the operand's shape)."""
    extents = _chunk_extents(monkeypatch)
    module = _module(world_size_one, qk, pv, chunk_rows=32, hifp8_scaling=scaling,
                     stochastic=stochastic)
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(n, 2, heads, 32, generator=g).to(dtype)
              for n, heads in ((sq, 4), (sk, 2), (sk, 2))]
    grad = torch.randn(sq, 2, 4 * 32, generator=g).to(dtype)
    runs = []
    runtime = runtime_of(module)
    for reuse in (False, True):
        module.attention = module.attention.replace(share_operands=reuse,
                                                    skip_masked_blocks=reuse)
        runtime.start_iteration(7, 1)
        runs.append(_run(lambda q, k, v: module(q, k, v, None), inputs, grad))
        runs[-1] += (dict(runtime.draws.calls),)
    (out0, grads0, draws0), (out1, grads1, draws1) = runs
    assert torch.equal(_bits(out0), _bits(out1)) and draws0 == draws1
    for before, after in zip(grads0, grads1):
        assert torch.equal(_bits(before), _bits(after))
    assert all(e == sk for e in extents[0])
    skipping = "dgrad.a" not in stochastic
    assert any(e < sk for e in extents[1]) == skipping, extents[1]


def test_observed_chunks_skip_no_key_block(world_size_one, monkeypatch):
    """An observer shown the chunks (quantization telemetry) sees them whole, as before."""
    extents = _chunk_extents(monkeypatch)
    module = _module(world_size_one, "mxfp8", "mxfp8", chunk_rows=32)

    class Pieces:
        def bind(self, site):
            def observe(*report, **extra):
                pass
            observe.accepts_pieces = True
            return observe

    with observing(module, Pieces()):
        module(*_inputs(72, 2, 4, 2, 32, torch.float32), None)
    module(*_inputs(72, 2, 4, 2, 32, torch.float32), None)
    assert all(e == 72 for e in extents[0]) and any(e < 72 for e in extents[1])


def _saved_bytes(fn, inputs):
    """Bytes of distinct tensors autograd keeps for backward while `fn` runs."""
    seen = {}

    def pack(t):
        seen[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
        return t

    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*leaves)
    return sum(seen.values())


def test_chunked_memory_is_linear_in_the_sequence(world_size_one):
    module = _module(world_size_one, "mxfp8", "mxfp8", chunk_rows=64)
    saved = {}
    for sq in (128, 512):
        inputs = _inputs(sq, 1, 4, 2, 32, torch.float32)
        saved[sq] = (_saved_bytes(lambda q, k, v: module(q, k, v, None), inputs),
                     _saved_bytes(lambda q, k, v: reference_attention(module, q, k, v, None),
                                  inputs))
    qkv = lambda sq: (4 + 2 + 2) * sq * 32 * 4  # noqa: E731  q, k, v in fp32
    for sq, (chunked, reference) in saved.items():
        assert chunked <= qkv(sq) * 1.01, (sq, chunked)          # only Q, K, V
        assert reference >= 4 * sq * sq * 4, (sq, reference)     # at least the fp32 scores
    assert saved[512][0] / saved[128][0] == pytest.approx(4.0, rel=0.01)


def test_fused_path_for_unquantized_attention(world_size_one, monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", spy)
    module = _module(world_size_one)
    inputs = _inputs(40, 2, 4, 2, 32, torch.float32)
    _compare(module, inputs, None, rtol=1e-4, atol=1e-5)
    assert calls and calls[0]["is_causal"] and calls[0]["attn_mask"] is None
    # A given mask is passed (inverted: SDPA's True means "attend").
    calls.clear()
    _compare(module, inputs, causal_mask(40, 40, torch.device("cpu")), rtol=1e-4, atol=1e-5)
    assert calls and not calls[0]["is_causal"] and calls[0]["attn_mask"] is not None


def test_observers_and_dropout_take_the_unfused_path(world_size_one, monkeypatch):
    calls = []
    real = attention_module._ChunkedAttention.apply

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(attention_module._ChunkedAttention, "apply", spy)
    module = _module(world_size_one, "mxfp8", "mxfp8")
    with observing(module, QuantizationCounter()) as counter:
        q, k, v = _inputs(40, 2, 4, 2, 32, torch.float32)
        out = module(q, k, v, None)
    assert not calls and out.shape == (40, 2, 128)
    # The observer saw whole GEMM operands: the query of all 2*2 groups and 2*40 rows.
    assert counter.quantized[("attn_qk", "fprop", "a", "mxfp8_e4m3")] == 1
    module = _module(world_size_one, "mxfp8", "mxfp8", dropout=0.1)
    module(q, k, v, None)
    assert not calls
    module.eval()                    # no dropout in evaluation: chunked again
    module(q, k, v, None)
    assert calls
