"""Megatron-LM's memory flags with the quantized layers: recompute quantizes exactly as the
first forward, the attention paths agree, overlap flags keep DP results, bad combinations
stop with one line."""

import pytest

import pretrain_gpt
from megatron.quantization.observers import QuantizationCounter
from megatron.quantization.runtime import runtimes
from megatron.training.arguments import ConfigError, parse_args, validate_args
from megatron.training.training import TrainingCallback, pretrain

from conftest import TINY_MOCK_ARGS
from test_distributed import ARGS as DIST_ARGS, torchrun

QUANTIZED = TINY_MOCK_ARGS + ["--train-iters", "3", "--quant-scheme", "FA_linear_mxfp8",
                              "--attn-pv-quant", "mxfp8"]


class _CountFprop(TrainingCallback):
    """Counts forward GEMM reports of the linear layers during iteration 1."""

    def __init__(self):
        self.counter = QuantizationCounter()
        self.runtimes = []

    def on_train_start(self, model_chunks, iteration):
        self.runtimes = runtimes(model_chunks)

    def on_iteration_start(self, iteration):
        if iteration == 1:
            for runtime in self.runtimes:
                runtime.add_observer(self.counter)

    def on_iteration_end(self, iteration):
        for runtime in self.runtimes:
            runtime.remove_observer(self.counter)

    def fprop_inputs(self):
        return self.counter.quantized[("linear", "fprop", "input", "mxfp8_e4m3")]


@pytest.fixture(scope="module")
def plain_losses():
    return pretrain(pretrain_gpt.forward_step, QUANTIZED).losses


@pytest.mark.parametrize("extra", [
    ["--quant-attention-impl", "unfused"],
    ["--recompute-activations"],
    ["--recompute-granularity", "full", "--recompute-method", "uniform"],
    ["--recompute-granularity", "full", "--recompute-method", "block",
     "--recompute-num-layers", "1"],
], ids=["unfused-attention", "selective", "full-uniform", "full-block"])
def test_same_losses_bit_for_bit(plain_losses, extra):
    assert pretrain(pretrain_gpt.forward_step, QUANTIZED + extra).losses == plain_losses


def test_full_recompute_really_recomputes():
    plain, recomputed = _CountFprop(), _CountFprop()
    pretrain(pretrain_gpt.forward_step, QUANTIZED + ["--train-iters", "1"], callbacks=[plain])
    pretrain(pretrain_gpt.forward_step, QUANTIZED + ["--train-iters", "1", "--recompute-granularity",
                                                      "full", "--recompute-method", "uniform"],
             callbacks=[recomputed])
    # 2 layers x 4 linears x 2 micro-batches, each forward run twice under full recompute.
    assert plain.fprop_inputs() == 16 and recomputed.fprop_inputs() == 32


@pytest.mark.parametrize("extra,message", [
    (["--context-parallel-size", "2"], "context parallelism is not supported; valid: 1"),
    (["--recompute-granularity", "full"], "needs --recompute-method (valid: uniform, block)"),
    (["--recompute-method", "uniform"], "go with --recompute-granularity full"),
    (["--recompute-activations", "--recompute-granularity", "full", "--recompute-method",
      "uniform"], "cannot be combined with --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "0"], "--recompute-num-layers 0 is invalid"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "3", "--num-layers", "4"], "to divide the 4 layers"),
    (["--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "3"], "exceeds the 2 layers"),
    (["--overlap-param-gather"], "needs --use-distributed-optimizer and --overlap-grad-reduce"),
    (["--recompute-activations", "--save-tensors"], "--save-tensors cannot be combined"),
])
def test_bad_combinations(extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_args(parse_args(QUANTIZED + extra), check_paths=False)


def test_flash_attention_flag_is_accepted():
    args = validate_args(parse_args(QUANTIZED + ["--use-flash-attn"]), check_paths=False)
    assert args.use_flash_attn and args.quant_config.backend.attention.impl == "auto"


def test_overlapped_data_parallel_matches_one_process(tmp_path):
    """DP=2 with both overlaps (and an evaluation and a checkpoint in between, which need the
    overlapped parameter gather finished) gives the single process's losses."""
    reference = pretrain(pretrain_gpt.forward_step, DIST_ARGS).losses
    losses, out = torchrun(2, DIST_ARGS + [
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--eval-interval", "2", "--save", str(tmp_path / "ckpt"), "--save-interval", "2"])
    assert sorted(losses) == [1, 2, 3, 4] and "saved checkpoint" in out
    for it, loss in losses.items():
        assert loss == pytest.approx(reference[it], rel=2e-5), it
