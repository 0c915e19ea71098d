"""--hifp8-scaling tensor in training: every HiF8 operand of every GEMM gets one power-of-two
scale from its own amax, captures record it, and the record reproduces bit for bit.

The expected scale is derived here from the record's tensor alone (amax * 2^k in [8, 16)),
not from the code under test.
"""

import math

import pytest
import torch

import pretrain_gpt
from megatron.quantization.formats import fake_quantize
from megatron.tensor_capture.load import load_record, read_manifest
from megatron.tensor_capture.stats import hifp8_regions
from megatron.training.training import pretrain

from conftest import TINY_MOCK_ARGS

SCHEME = "FA_linear_hifp8"


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


@pytest.fixture(scope="module")
def scaled_capture(tmp_path_factory):
    out = tmp_path_factory.mktemp("hifp8")
    args = TINY_MOCK_ARGS + ["--train-iters", "2", "--bf16", "--quant-scheme", SCHEME,
                             "--attn-pv-quant", "hifp8", "--hifp8-scaling", "tensor",
                             "--save-tensors", "--tensor-save-dir", str(out),
                             "--control-iter", "1", "--collect-micro-batches", "1",
                             "--tensor-save-layers", "2"]
    result = pretrain(pretrain_gpt.forward_step, args)
    assert result.exit_code == 0
    return read_manifest(str(out / SCHEME))


def test_every_hifp8_operand_is_scaled_and_reproduces(scaled_capture):
    quantized = [e for e in scaled_capture if e["metadata"]["format"] == "hifp8"]
    kinds = {(e["metadata"]["site_kind"], e["metadata"]["gemm"]) for e in quantized}
    assert kinds == {(kind, gemm) for kind in ("linear", "attn_qk", "attn_pv")
                     for gemm in ("fprop", "dgrad", "wgrad")}
    for entry in quantized:
        meta = entry["metadata"]
        record = load_record(entry["path"])
        x, q = record["tensor"], record["quantized"]
        amax = x.abs().max().double().item()
        k = 3 - math.floor(math.log2(amax))          # amax * 2^k lands in [8, 16)
        assert meta["hifp8_scaling"] == "tensor" and meta["hifp8_scale_exponent"] == k
        scaled = (x.double() * 2.0 ** k).float()     # exact: a power of two
        expected = (fake_quantize(scaled, "hifp8", saturate=True).double() * 2.0 ** -k)
        assert torch.equal(_bits(expected.to(x.dtype)), _bits(q)), meta["name"]
        errors = entry["quant_error"]
        assert errors["hifp8_regions"] == pytest.approx(hifp8_regions(scaled))
        assert errors["hifp8_regions_unscaled"] == pytest.approx(hifp8_regions(x))
        assert errors["saturated_fraction"] == 0.0   # the largest value maps into [8, 16)


def test_scaling_moves_gradients_out_of_the_coarse_regions(scaled_capture):
    """The reason for the flag: unscaled, small gradients sit in HiF8's 1-bit mantissa and
    denormal regions; scaled, most of them move up to 2 and 3 bits."""
    grads = [e["quant_error"] for e in scaled_capture
             if e["metadata"]["format"] == "hifp8" and e["metadata"]["gemm"] == "wgrad"
             and e["metadata"]["operand"] == "grad_output"]
    assert grads
    coarse = lambda r: r["mant1"] + r["denormal"] + r["underflow"]  # noqa: E731
    assert sum(coarse(g["hifp8_regions"]) for g in grads) < \
        sum(coarse(g["hifp8_regions_unscaled"]) for g in grads)


def test_training_losses_depend_on_the_scaling():
    base = TINY_MOCK_ARGS + ["--train-iters", "3", "--bf16", "--quant-scheme", SCHEME]
    unscaled = pretrain(pretrain_gpt.forward_step, base).losses
    scaled = pretrain(pretrain_gpt.forward_step, base + ["--hifp8-scaling", "tensor"]).losses
    assert all(math.isfinite(v) for v in [*unscaled.values(), *scaled.values()])
    assert unscaled != scaled
