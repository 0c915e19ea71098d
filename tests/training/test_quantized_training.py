"""Quantized layers in the model and end-to-end training under each of the ten schemes (and
one scheme of each newer format)."""

import math

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

import pretrain_gpt
from megatron.quantization import fake_quantize
from megatron.quantization.attention import QuantDotProductAttention
from megatron.quantization.config import SCHEMES, SEED_SCHEMES
from megatron.quantization.gemm import SiteState
from megatron.quantization.observers import GemmSite, QuantizationCounter
from megatron.quantization.runtime import QuantRuntime, runtimes
from megatron.quantization.schemes import quant_config
from megatron.training.model import core_transformer_config_from_args
from megatron.quantization.local_attention import LocalDotProductAttention, causal_mask
from megatron.training.training import TrainingCallback, pretrain

from conftest import TINY_MOCK_ARGS


class _Count(TrainingCallback):
    """Counts quantized operands during training (observes the model for the whole run)."""

    def __init__(self):
        self.counter = QuantizationCounter()
        self.runtimes = []

    def on_train_start(self, model_chunks, iteration):
        self.runtimes = runtimes(model_chunks)
        for runtime in self.runtimes:
            runtime.add_observer(self.counter)

    def on_train_end(self, exit_reason):
        for runtime in self.runtimes:
            runtime.remove_observer(self.counter)


def train(extra, iters=2):
    count = _Count()
    result = pretrain(pretrain_gpt.forward_step, TINY_MOCK_ARGS + ["--train-iters", str(iters)]
                      + extra, callbacks=[count])
    return result, count.counter


@pytest.fixture(scope="module")
def bf16_losses():
    return train(["--quant-scheme", "bf16"], iters=5)[0].losses


# (format of the forward operands, format of the gradient operands) per scheme suffix; FP8
# schemes default to --fp8-format hybrid (TransformerEngine's default: E5M2 gradients).
SCHEME_FORMATS = {"mxfp8": ("mxfp8_e4m3", "mxfp8_e4m3"), "mxfp4": ("mxfp4", "mxfp4"),
                  "hifp8": ("hifp8", "hifp8"), "nvfp4": ("nvfp4", "nvfp4"),
                  "mxfp6_e2m3": ("mxfp6_e2m3", "mxfp6_e2m3"),
                  "mxfp6_e3m2": ("mxfp6_e3m2", "mxfp6_e3m2"), "fp8": ("fp8_e4m3", "fp8_e5m2")}
NEWER_SCHEMES = ("FA_linear_nvfp4", "linear_mxfp6_e2m3", "FA_mxfp6_e3m2", "FA_linear_fp8")


def test_scheme_names():
    assert set(SEED_SCHEMES + NEWER_SCHEMES) <= set(SCHEMES)
    assert len(SCHEMES) == 1 + 3 * len(SCHEME_FORMATS)


@pytest.mark.parametrize("scheme", SEED_SCHEMES + NEWER_SCHEMES)
def test_scheme_quantizes_exactly_its_gemms(scheme):
    result, counter = train(["--quant-scheme", scheme])
    assert all(math.isfinite(v) for v in result.losses.values()) and len(result.losses) == 2
    expected_kinds = set()
    if scheme.startswith("FA"):
        expected_kinds.add("attn_qk")
    if "linear" in scheme:
        expected_kinds.add("linear")
    assert counter.quantized_kinds() == expected_kinds
    suffix = scheme if scheme == "bf16" else scheme.split("_", 2 if scheme.startswith("FA_linear") else 1)[-1]
    fmt, grad_fmt = SCHEME_FORMATS.get(suffix, (None, None))
    # 2 iterations x 2 micro-batches; 2 layers; 4 linears per layer (qkv, proj, fc1, fc2).
    # The end-of-training validation adds forwards: --eval-iters 1 x 2 micro-batches.
    runs = 2 * 2 * 2
    forwards = runs + 1 * 2 * 2
    assert sorted(result.val_losses) == [2]
    for kind, sites_per_layer in (("attn_qk", 1), ("linear", 4)):
        if kind not in expected_kinds:
            continue
        a, b = ("a", "b") if kind == "attn_qk" else ("input", "weight")
        for gemm, operands in (("fprop", (a, b)), ("dgrad", ("grad_output", b)),
                               ("wgrad", (a, "grad_output"))):
            expected = (forwards if gemm == "fprop" else runs) * sites_per_layer
            for operand in operands:
                want = grad_fmt if operand == "grad_output" else fmt
                assert counter.quantized[(kind, gemm, operand, want)] == expected, \
                    (kind, gemm, operand)
    assert len(counter.sites_run["linear"]) == 2 * 4
    assert counter.sites_run["output_layer"] == {"output_layer"}  # ran, never quantized here


def test_quant_wgrad_none_keeps_weight_gradients_in_high_precision():
    result, counter = train(["--quant-scheme", "FA_linear_mxfp4", "--quant-wgrad", "none"])
    assert result.exit_code == 0
    gemms = {(kind, gemm) for kind, gemm, _, _ in counter.quantized}
    assert gemms == {(k, g) for k in ("linear", "attn_qk") for g in ("fprop", "dgrad")}
    runs = 2 * 2 * 2 * 4          # iterations x micro-batches x layers x linears per layer
    assert counter.high_precision[("linear", "wgrad", "input")] == runs
    assert counter.high_precision[("linear", "wgrad", "grad_output")] == runs


def test_linear_mxfp8_stays_close_to_bf16(bf16_losses):
    mx, _ = train(["--quant-scheme", "linear_mxfp8"], iters=5)
    for it in range(1, 6):
        assert mx.losses[it] == pytest.approx(bf16_losses[it], rel=0.02), it
        assert mx.losses[it] != bf16_losses[it]  # the quantization really ran


def test_skip_layers_pv_and_output_layer():
    _, counter = train(["--quant-scheme", "FA_linear_hifp8", "--quant-skip-layers", "1",
                        "--attn-pv-quant", "mxfp4", "--quant-output-layer",
                        "--no-quant-backward", "--mx-scale-mode", "rceil"], iters=1)
    # Layer 2 only (layer 1 kept in high precision), forward GEMMs only: 2 micro-batches of
    # training and 2 of the end-of-training validation (--eval-iters 1).
    forwards = 2 + 2
    assert counter.quantized[("linear", "fprop", "input", "hifp8")] == forwards * 4
    assert counter.quantized[("attn_pv", "fprop", "a", "mxfp4")] == forwards
    assert counter.quantized[("attn_qk", "fprop", "a", "hifp8")] == forwards
    assert counter.quantized[("output_layer", "fprop", "weight", "hifp8")] == forwards
    assert not any(gemm != "fprop" for _, gemm, _, _ in counter.quantized)


def test_mla_and_experts_are_quantized():
    argv = ["--model-preset", "deepseek-tiny", "--seq-length", "64", "--micro-batch-size", "2",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
            "--train-iters", "1", "--lr", "1e-3", "--num-workers", "0", "--quant-scheme",
            "linear_mxfp8"]
    count = _Count()
    result = pretrain(pretrain_gpt.forward_step, argv, callbacks=[count])
    assert math.isfinite(result.losses[1])
    names = count.counter.sites_run["linear"]
    for part in ("linear_q_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj",
                 "local_experts.0.linear_fc1", "shared_experts.linear_fc2"):
        assert any(part in n for n in names), part
    assert count.counter.quantized[("linear", "fprop", "weight", "mxfp8_e4m3")] > 0


def test_quant_check_prints_and_exits(capsys):
    result = pretrain(pretrain_gpt.forward_step, TINY_MOCK_ARGS + [
        "--train-iters", "1", "--quant-scheme", "FA_mxfp4", "--linear-quant", "mxfp8_e5m2",
        "--quant-check"])
    out = capsys.readouterr().out
    assert result.exit_reason == "quant-check" and result.losses == {}
    assert "quantization: scheme FA_mxfp4" in out and "attention QK^T" in out
    assert "--linear-quant mxfp8_e5m2 overrides scheme FA_mxfp4 (none)" in out


# ---------------------------------------------------------------------------------------------
# The attention module on its own
# ---------------------------------------------------------------------------------------------


def _attention_inputs(seed=0, sq=40, b=2, heads=4, groups=2, dim=32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, heads, dim, generator=g)
    k = torch.randn(sq, b, groups, dim, generator=g) * 2.0
    v = torch.randn(sq, b, groups, dim, generator=g)
    return [t.requires_grad_() for t in (q, k, v)]


def _config(world_size_one):
    cfg = core_transformer_config_from_args(world_size_one)
    cfg.attention_dropout = 0.0
    return cfg


def _module(cls, cfg):
    return cls(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def test_grouped_attention_equals_megatron_core(world_size_one):
    cfg = _config(world_size_one)
    q, k, v = _attention_inputs()
    mask = causal_mask(q.size(0), k.size(0), q.device)
    ours = _module(QuantDotProductAttention, cfg)(q, k, v, mask)
    ref_inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    theirs = _module(LocalDotProductAttention, cfg)(*ref_inputs, mask)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(ours)
    ours.backward(grad)
    theirs.backward(grad)
    # Unquantized attention runs scaled_dot_product_attention: fp32 rounding differs from
    # megatron-core's unfused softmax at the 1e-6 level.
    for mine, ref in zip((q, k, v), ref_inputs):
        torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-4, atol=1e-5)


def test_qk_and_pv_quantization_against_float64_reference(world_size_one):
    cfg = _config(world_size_one)
    module = _module(QuantDotProductAttention, cfg)
    qcfg = quant_config(["--quant-scheme", "FA_mxfp8", "--attn-pv-quant", "hifp8"], 2)
    runtime = QuantRuntime()       # the two sites are observed together
    module.qk_site = GemmSite("qk", "attn_qk", 1, qcfg.attn_qk,
                              SiteState("qk", qcfg.attn_qk, runtime))
    module.pv_site = GemmSite("pv", "attn_pv", 1, qcfg.attn_pv,
                              SiteState("pv", qcfg.attn_pv, runtime))
    seen = {}

    def keep_probs(site, gemm, operand, hp, q, fmt, axis):
        if site.kind == "attn_pv" and gemm == "fprop" and operand == "a":
            seen["probs"] = hp.detach().clone()

    q, k, v = _attention_inputs(seed=1)
    runtime.add_observer(keep_probs)
    try:
        out = module(q, k, v, None)
    finally:
        runtime.remove_observer(keep_probs)
    # Reference: per head, Q and K quantized along the head dim, P along keys, V along keys.
    sq, b, heads, dim = q.shape
    groups = k.size(2)
    rep = heads // groups
    mask = torch.ones(sq, sq, dtype=torch.bool).triu(1)
    probs_seen = seen["probs"].view(b, groups, rep, sq, sq)
    expected = torch.empty(sq, b, heads * dim, dtype=torch.float64)
    for bi in range(b):
        for h in range(heads):
            qh = fake_quantize(q[:, bi, h].detach(), "mxfp8", axis=-1).double()
            kh = fake_quantize(k[:, bi, h // rep].detach(), "mxfp8", axis=-1).double()
            probs = torch.softmax(((qh @ kh.T) * module.softmax_scale).masked_fill(mask, -math.inf),
                                  dim=-1)
            # The module's fp32 probabilities agree with float64 ones to rounding error; the
            # quantized PV GEMM is then checked on exactly the probabilities it used.
            used = probs_seen[bi, h // rep, h % rep]
            torch.testing.assert_close(used.double(), probs, rtol=1e-5, atol=1e-6)
            pq = fake_quantize(used, "hifp8", axis=-1, saturate=True).double()
            vh = fake_quantize(v[:, bi, h // rep].detach(), "hifp8", axis=0, saturate=True).double()
            expected[:, bi, h * dim:(h + 1) * dim] = pq @ vh
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
