"""Each GEMM operand quantized once: per training step, the quantizations of K and V in chunked
attention do not grow with the sequence length (the number of chunks), those of the weights do
not grow with the number of micro-batches; and this reuse, with the causal key blocks the
chunks leave out, changes no bit of the losses or gradients."""

from collections import Counter, defaultdict

import pytest
import torch

import pretrain_gpt
from megatron.quantization import attention as attention_module
from megatron.quantization import gemm as gemm_module
from megatron.quantization.attention import QuantDotProductAttention
from megatron.quantization.config import MatmulQuantConfig, OperandFormats
from megatron.training.training import TrainingCallback, pretrain

from conftest import TINY_MOCK_ARGS

ATTENTION_MXFP8 = ["--quant-scheme", "FA_linear_mxfp8", "--attn-pv-quant", "mxfp8"]


class _Quantizations(TrainingCallback):
    """Operand quantizations per iteration and (site path, gemm, operand).

    Every GEMM operand is quantized through gemm.quantize_slot (also imported by attention);
    the wrapper attributes the fake-quantize calls made inside it to the site, and every
    fake-quantize call of the run must happen inside it."""

    def __init__(self, monkeypatch):
        self.counts = defaultdict(Counter)
        self.iteration = 0
        self.inside = self.outside = 0
        self._slot = None
        real_slot = gemm_module.quantize_slot

        def quantize_slot(config, gemm, name, side, hp, fmt, axis, scales=None, state=None,
                          weight=False, rotate=False):
            self._slot = (state.path if state is not None else "", gemm, name)
            try:
                return real_slot(config, gemm, name, side, hp, fmt, axis, scales, state, weight,
                                 rotate)
            finally:
                self._slot = None

        for module in (gemm_module, attention_module):
            monkeypatch.setattr(module, "quantize_slot", quantize_slot)
        for name in ("fake_quantize", "hifp8_scaled_fake_quantize"):
            monkeypatch.setattr(gemm_module, name, self._spy(getattr(gemm_module, name)))

    def _spy(self, real):
        def quantize(*args, **kwargs):
            if self._slot is None:
                self.outside += 1
            else:
                self.inside += 1
                self.counts[self.iteration][self._slot] += 1
            return real(*args, **kwargs)
        return quantize

    def on_iteration_start(self, iteration):
        self.iteration = iteration

    def on_iteration_end(self, iteration):
        self.iteration = None         # the final validation's forward passes are not counted
        return None

    def site(self, iteration, suffix):
        """{(gemm, operand): count} of the one site whose path ends with `suffix`."""
        paths = {path for path, _, _ in self.counts[iteration] if path.endswith(suffix)}
        assert len(paths) == 1, (suffix, paths)
        path = paths.pop()
        return {(g, o): n for (p, g, o), n in self.counts[iteration].items() if p == path}


class _Attention(TrainingCallback):
    """Sets the attention settings of every quantized core attention of the run's model
    before its first forward pass (the converter gives them the config's)."""

    def __init__(self, **changes):
        self.changes = changes
        self.modules = 0

    def on_train_start(self, model_chunks, iteration):
        for chunk in model_chunks:
            for module in chunk.modules():
                if isinstance(module, QuantDotProductAttention):
                    module.attention = module.attention.replace(**self.changes)
                    self.modules += 1
        assert self.modules > 0


def _train(extra, iters=2, callbacks=(), chunk_rows=None, previous=False):
    """A run; chunk_rows sets the query rows of attention's chunks; previous runs it as before
    the reuse: K and V quantized in every chunk, no key block skipped, weights at every call
    (--no-quant-weight-cache)."""
    changes = {}
    if chunk_rows is not None:
        changes["chunk_rows"] = chunk_rows
    if previous:
        changes.update(share_operands=False, skip_masked_blocks=False)
        extra = extra + ["--no-quant-weight-cache"]
    callbacks = ([_Attention(**changes)] if changes else []) + list(callbacks)
    return pretrain(pretrain_gpt.forward_step,
                    TINY_MOCK_ARGS + ["--train-iters", str(iters)] + extra, callbacks=callbacks)


def _counted(monkeypatch, extra, iters=2, **options):
    counter = _Quantizations(monkeypatch)
    _train(extra, iters, [counter], **options)
    assert counter.inside > 0 and counter.outside == 0
    return counter


# Per micro-batch, one layer: (gemm, operand) -> quantizations, with n chunks of query rows.
def _attention_counts(n):
    qk = {("fprop", "a"): 2 * n, ("fprop", "b"): 2,     # Q chunks, K^T: forward + recompute
          ("dgrad", "grad_output"): n, ("dgrad", "b"): 1, ("wgrad", "a"): n,
          ("wgrad", "grad_output"): n}
    pv = {("fprop", "a"): n, ("fprop", "b"): 1, ("dgrad", "grad_output"): n, ("dgrad", "b"): 1,
          ("wgrad", "a"): n, ("wgrad", "grad_output"): n}
    return qk, pv


def _linear_counts(micro_batches):
    return {("fprop", "input"): micro_batches, ("fprop", "weight"): 1,
            ("dgrad", "grad_output"): micro_batches, ("dgrad", "weight"): 1,
            ("wgrad", "grad_output"): micro_batches, ("wgrad", "input"): micro_batches}


def test_k_and_v_are_quantized_once_whatever_the_sequence_length(monkeypatch):
    """Chunks of 32 query rows: 4 per (sample, group) at seq 64, 16 at seq 256. K^T and V
    are quantized once per GEMM slot and micro-batch (K^T's fprop slot twice: the forward and
    backward's recomputation); the pieces Q, P, dS, dO once per chunk and pass; the weights
    once per step."""
    heads_per_group, micro_batches = 2, 2
    for seq in (64, 256):
        counter = _counted(monkeypatch, ATTENTION_MXFP8 + ["--seq-length", str(seq)],
                           chunk_rows=32)
        chunks = heads_per_group * seq // 32
        qk, pv = _attention_counts(chunks)
        for iteration in (1, 2):
            for layer in (0, 1):
                prefix = f"decoder.layers.{layer}.self_attention."
                assert counter.site(iteration, prefix + "core_attention.qk") == \
                    {key: micro_batches * n for key, n in qk.items()}
                assert counter.site(iteration, prefix + "core_attention.pv") == \
                    {key: micro_batches * n for key, n in pv.items()}
                for linear in ("self_attention.linear_qkv", "self_attention.linear_proj",
                               "mlp.linear_fc1", "mlp.linear_fc2"):
                    assert counter.site(iteration, f"decoder.layers.{layer}.{linear}") == \
                        _linear_counts(micro_batches)


def test_before_the_reuse_k_v_and_weights_were_quantized_at_every_use(monkeypatch):
    """The counts above can fail: without the reuse K^T and V are quantized in every chunk
    and the weights at every micro-batch."""
    counter = _counted(monkeypatch, ATTENTION_MXFP8, iters=1, chunk_rows=32, previous=True)
    chunks, micro_batches = 4, 2
    qk = counter.site(1, "layers.0.self_attention.core_attention.qk")
    pv = counter.site(1, "layers.0.self_attention.core_attention.pv")
    assert qk[("fprop", "b")] == qk[("fprop", "a")] == 2 * chunks * micro_batches
    assert qk[("dgrad", "b")] == pv[("fprop", "b")] == pv[("dgrad", "b")] == chunks * micro_batches
    fc1 = counter.site(1, "layers.0.mlp.linear_fc1")
    assert fc1[("fprop", "weight")] == fc1[("dgrad", "weight")] == micro_batches


def test_weights_are_quantized_once_per_step_whatever_the_micro_batches(monkeypatch):
    """Global batch 2x and 4x the micro-batch: each weight once per step and GEMM axis
    (refreshed after every optimizer step), the activations once per micro-batch."""
    for global_batch, micro_batches in ((4, 2), (8, 4)):
        counter = _counted(monkeypatch, ["--quant-scheme", "linear_mxfp8",
                                         "--global-batch-size", str(global_batch)], iters=3)
        for iteration in (1, 2, 3):
            for layer in (0, 1):
                for linear in ("self_attention.linear_qkv", "self_attention.linear_proj",
                               "mlp.linear_fc1", "mlp.linear_fc2"):
                    assert counter.site(iteration, f"decoder.layers.{layer}.{linear}") == \
                        _linear_counts(micro_batches)


def test_no_quant_weight_cache_quantizes_weights_at_every_use(monkeypatch):
    """--no-quant-weight-cache: each weight once per micro-batch (and the flag's default,
    the cache, is back for the next run)."""
    counter = _counted(monkeypatch, ["--quant-scheme", "linear_mxfp8",
                                     "--global-batch-size", "8", "--no-quant-weight-cache"],
                       iters=1)
    got = counter.site(1, "decoder.layers.0.mlp.linear_fc1")
    assert got[("fprop", "weight")] == got[("dgrad", "weight")] == 4
    counter = _counted(monkeypatch, ["--quant-scheme", "linear_mxfp8",
                                     "--global-batch-size", "8"], iters=1)
    assert counter.site(1, "decoder.layers.0.mlp.linear_fc1")[("fprop", "weight")] == 1


class _Gradients(TrainingCallback):
    """Every parameter's gradient (the main grad the optimizer used) after each iteration."""

    def __init__(self):
        self.grads = []

    def on_train_start(self, model_chunks, iteration):
        self.params = [p for chunk in model_chunks for p in chunk.parameters()]

    def on_iteration_end(self, iteration):
        self.grads.append([getattr(p, "main_grad", p.grad).detach().clone()
                           for p in self.params])


def _bits(t):
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


SCHEMES = {
    "mxfp8": ATTENTION_MXFP8,
    "mxfp4": ["--quant-scheme", "FA_linear_mxfp4", "--attn-pv-quant", "mxfp4"],
    "nvfp4": ["--quant-scheme", "FA_linear_nvfp4", "--attn-pv-quant", "nvfp4"],
    "hifp8_tensor": ["--quant-scheme", "FA_linear_hifp8", "--attn-pv-quant", "hifp8",
                     "--hifp8-scaling", "tensor"],
    "recipe_nvfp4": ["--quant-recipe", "nvfp4"],
    "mxfp8_sr_all": ATTENTION_MXFP8 + ["--quant-stochastic-rounding", "all"],
    "mxfp8_bf16": ATTENTION_MXFP8 + ["--bf16"],
}


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_reuse_and_skipped_key_blocks_change_no_bit(monkeypatch, scheme):
    """Losses and every gradient of three iterations (two micro-batches each), bit for bit,
    with and without the reuse of quantized operands and the skipped causal key blocks.
    nvfp4 and hifp8_tensor scale P and dS by the whole operand's amax (the chunks' first
    pass); recipe_nvfp4 rounds the gradients stochastically and caches its 16x16-tile
    weights; mxfp8_sr_all rounds every operand stochastically (K, V and the weights are then
    quantized at every use, with the draws as before, and no key block is skipped)."""
    runs = []
    for previous in (True, False):
        grads = _Gradients()
        result = _train(SCHEMES[scheme], iters=3, callbacks=[grads], chunk_rows=32,
                        previous=previous)
        runs.append((result, grads.grads))
    (before, before_grads), (after, after_grads) = runs
    assert after.losses == before.losses and after.grad_norms == before.grad_norms
    assert len(after_grads) == len(before_grads) == 3
    for mine, theirs in zip(after_grads, before_grads):
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(mine, theirs))


def _linear_calls(monkeypatch):
    """The weight quantizations of quantized_linear calls: [(gemm, seed or None)]."""
    calls = []
    real = gemm_module.quantize_slot

    def quantize_slot(config, gemm, name, side, hp, fmt, axis, scales=None, state=None,
                      weight=False, rotate=False):
        q, extra = real(config, gemm, name, side, hp, fmt, axis, scales, state, weight, rotate)
        if name == "weight":
            calls.append((gemm, extra.get("seed")))
        return q, extra

    monkeypatch.setattr(gemm_module, "quantize_slot", quantize_slot)
    return calls


def _step(x, weight, config, state):
    x = x.detach().requires_grad_()                   # dgrad runs too
    y = gemm_module.quantized_linear(x, weight, None, config, state=state)
    y.backward(torch.ones_like(y))
    return y.detach()


def test_weight_copies_are_dropped_by_an_update(monkeypatch):
    """Reused while the weight is unchanged; an in-place write (autograd's version counter),
    a step of the optimizer the site's runtime watches (megatron-core's optimizers follow it
    with writes through `param.data`, invisible to that counter) or
    runtime.invalidate_weights() refreshes them."""
    calls = _linear_calls(monkeypatch)
    config = MatmulQuantConfig(*[OperandFormats("mxfp8", "mxfp8")] * 3)
    state = gemm_module.SiteState("layer", config)
    g = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64, 32, generator=g))
    x = torch.randn(8, 32, generator=g)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    state.runtime.watch_optimizer(optimizer)          # as pretrain does for its optimizer

    def fresh():
        """quantized_linear's result without the cache (a new site state), not counted."""
        n = len(calls)
        y = gemm_module.quantized_linear(x, weight.detach(), None, config)
        del calls[n:]
        return y

    first = _step(x, weight, config, state)
    assert _step(x, weight, config, state).equal(first) and len(calls) == 2   # fprop, dgrad
    optimizer.step()                                  # a torch.optim step: refreshed
    assert _step(x, weight, config, state).equal(fresh()) and len(calls) == 4
    with torch.no_grad():
        weight.data.copy_(torch.randn(64, 32, generator=g))   # unseen by the version counter
    optimizer.step()
    assert _step(x, weight, config, state).equal(fresh()) and len(calls) == 6
    with torch.no_grad():
        weight.mul_(0.5)                              # in place: the version counter moves
    assert _step(x, weight, config, state).equal(fresh()) and len(calls) == 8
    weight.data.mul_(2.0)
    state.runtime.invalidate_weights()
    assert _step(x, weight, config, state).equal(fresh()) and len(calls) == 10


def test_stochastically_rounded_weights_draw_at_every_call(monkeypatch):
    """A weight slot with stochastic rounding is quantized at every call, each call with the
    next draw of the counter-based stream, as before; the other slot is reused."""
    calls = _linear_calls(monkeypatch)
    formats = OperandFormats("mxfp4", "mxfp4")
    config = MatmulQuantConfig(formats, formats, formats, stochastic=frozenset({"dgrad.b"}))
    state = gemm_module.SiteState("layer", config)
    weight = torch.nn.Parameter(torch.randn(64, 32, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(8, 32)
    state.runtime.start_iteration(0, 1)
    for _ in range(3):
        _step(x, weight, config, state)
    assert [gemm for gemm, _ in calls] == ["fprop", "dgrad", "dgrad", "dgrad"]
    seeds = [seed for gemm, seed in calls if gemm == "dgrad"]
    assert len(set(seeds)) == 3 and calls[0][1] is None
