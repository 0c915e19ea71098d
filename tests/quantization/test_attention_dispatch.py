"""Which path quantized attention takes under --quant-kernels, and the fused Triton kernels
inside QuantDotProductAttention and a training run.

The kernels run here under Triton's CPU interpreter, which must be enabled before triton is
first imported: those checks run in one subprocess (this file run as a script) that prints one
JSON line; this process never imports triton. `--quant-kernels triton` runs the kernels on
CPU tensors under the interpreter; "auto" uses them on CUDA only.
"""

from __future__ import annotations

import json

import pytest
import torch

from interpreted import require_interpreter, run_interpreted

SQ, HEADS, GROUPS, DIM = 80, 4, 2, 32


def _ulps(mine, ref) -> float:
    """max |mine - ref| in units in the last place of max |ref| (bf16: 8 significant bits)."""
    import math
    scale = float(ref.double().abs().max())
    ulp = 2.0 ** (math.floor(math.log2(scale)) + 1 - 8)
    return float((mine.double() - ref.double()).abs().max()) / ulp


def _module_results(args, mode, qk, pv, observe=False):
    """(out, grads, fused kernels used) of one forward/backward of a real
    QuantDotProductAttention whose sites run under kernel mode `mode`."""
    from megatron.quantization.kernels import attention as kernels
    from megatron.quantization.runtime import runtime_of
    import test_attention_paths as paths

    module = paths._module(args, qk, pv, kernels=mode)
    inputs = paths._inputs(SQ, 1, HEADS, GROUPS, DIM, torch.bfloat16)
    grad = torch.randn(SQ, 1, HEADS * DIM, generator=torch.Generator().manual_seed(9)).bfloat16()
    calls = []
    apply = kernels.TritonQuantizedAttention.apply

    def spy(*a, **k):
        calls.append(1)
        return apply(*a, **k)

    class Watch:           # an observer that accepts operand pieces (as the telemetry)
        def bind(self, site):
            def observe(*report, **extra):
                return None
            observe.accepts_pieces = True
            return observe
    watch = Watch()
    kernels.TritonQuantizedAttention.apply = spy
    if observe:
        runtime_of(module).add_observer(watch)
    try:
        out, grads = paths._run(lambda q, k, v: module(q, k, v, None), inputs, grad)
    finally:
        kernels.TritonQuantizedAttention.apply = apply
        runtime_of(module).remove_observer(watch)
    return out, grads, bool(calls)


def interpreter_checks():
    import pretrain_gpt
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.initialize import (
        destroy_distributed, initialize_distributed, set_random_seeds)
    from megatron.training.training import pretrain
    from conftest import TINY_MOCK_ARGS

    args = validate_args(parse_args(TINY_MOCK_ARGS + ["--train-iters", "1", "--bf16"]),
                         check_paths=False)
    initialize_distributed(args)
    set_random_seeds(args.seed)
    results = {}
    eager_out, eager_grads, eager_fused = _module_results(args, "eager", "mxfp8", "mxfp8")
    out, grads, fused = _module_results(args, "triton", "mxfp8", "mxfp8")
    results["module"] = {"fused": fused, "eager fused": eager_fused,
                         "ulps": [_ulps(a, b) for a, b in zip([out] + grads,
                                                              [eager_out] + eager_grads)]}
    _, _, observed_fused = _module_results(args, "triton", "mxfp8", "mxfp8", observe=True)
    results["observed fused"] = observed_fused
    # A bf16 input to a module whose softmax does not upcast (an fp32 model's): the softmax
    # runs in bf16, which the kernels do not compute.
    fp32_model = validate_args(parse_args(TINY_MOCK_ARGS + ["--train-iters", "1"]),
                               check_paths=False)
    try:
        _module_results(fp32_model, "triton", "mxfp8", "mxfp8")
        results["bf16 softmax"] = None
    except ValueError as exc:
        results["bf16 softmax"] = str(exc)
    try:
        _module_results(args, "triton", "mxfp8", "nvfp4")
        results["uncovered"] = None
    except ValueError as exc:
        results["uncovered"] = str(exc)
    destroy_distributed()

    def train(mode):
        return pretrain(pretrain_gpt.forward_step, TINY_MOCK_ARGS + [
            "--train-iters", "2", "--bf16", "--quant-scheme", "FA_linear_mxfp8",
            "--attn-pv-quant", "mxfp8", "--quant-kernels", mode]).losses

    results["training"] = {"eager": train("eager"), "triton": train("triton")}
    return results


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def results():
    pytest.importorskip("triton")
    return run_interpreted(__file__, timeout=1200)


def test_triton_mode_runs_the_fused_kernels_in_the_module(results):
    """Under --quant-kernels triton the module takes the fused kernels (eager: the chunked
    path), and out, dQ, dK, dV agree with the chunked path within 2 bf16 units in the last
    place of each output's largest value (the kernels' own tests bound the difference: fp32
    summation order and exp, one bf16 rounding; dK and dV are rounded once instead of per
    chunk)."""
    module = results["module"]
    assert module["fused"] and not module["eager fused"]
    assert max(module["ulps"]) <= 2, module["ulps"]


def test_observed_calls_stay_on_the_chunked_path(results):
    assert results["observed fused"] is False


def test_triton_mode_names_what_the_kernels_do_not_cover(results):
    message = results["uncovered"]
    assert message is not None and "does not cover this quantized attention" in message
    assert "nvfp4" in message


def test_a_softmax_in_bf16_is_not_covered(results):
    assert "softmax in bf16" in results["bf16 softmax"]


def test_training_with_the_fused_kernels(results):
    """Two bf16 iterations of FA_linear_mxfp8 + PV: the first loss (before any update) equals
    the eager run's to the bf16 rounding of the attention outputs, the second stays close."""
    eager, triton = results["training"]["eager"], results["training"]["triton"]
    assert sorted(eager) == sorted(triton) == ["1", "2"]
    assert triton["1"] == pytest.approx(eager["1"], rel=1e-3)
    assert triton["2"] == pytest.approx(eager["2"], rel=1e-2)


@pytest.mark.parametrize("mode", ["auto", "eager", "compile"])
def test_cpu_tensors_take_the_chunked_path_outside_triton_mode(world_size_one, monkeypatch,
                                                                mode):
    """auto uses the kernels on CUDA only; eager and compile never (nothing imports triton)."""
    from megatron.quantization import attention
    import test_attention_paths as paths

    used = []
    monkeypatch.setattr(attention.QuantDotProductAttention, "_fused_quantized",
                        lambda *a, **k: used.append(1))
    module = paths._module(world_size_one, "mxfp8", "mxfp8", kernels=mode)
    assert module.kernels == mode
    inputs = paths._inputs(64, 1, HEADS, GROUPS, DIM, torch.bfloat16)
    out = module(*inputs, None)
    assert not used and out.shape == (64, 1, HEADS * DIM)


if __name__ == "__main__":
    require_interpreter()
    import warnings
    warnings.filterwarnings("ignore")
    print(json.dumps(interpreter_checks()))
