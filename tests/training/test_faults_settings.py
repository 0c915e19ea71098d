"""Numbers out of range and what the start-up log says the run is.

Every numeric setting that sizes memory (sequence length, micro and global batch, the model's
sizes) is bounded, and every learning rate is finite, not negative and small enough for the
optimizer's float32 scalars: one `error:` line naming the value and the valid range, before
anything is built, never a traceback from torch at the first step. The first line of the
quantization table says what the run is: a recipe, a scheme, or nothing quantized in the run's
own precision.
"""

import pytest

import pretrain_gpt
from megatron.training import arguments, initialize, training
from megatron.training.cli import main

from conftest import TINY_MOCK_ARGS
from test_faults import MODEL_BUILT, one_error_line


def run(capsys, *extra):
    argv = list(TINY_MOCK_ARGS) + ["--train-iters", "2"]
    for flag, value in zip(extra[0::2], extra[1::2]):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    code = main(pretrain_gpt.forward_step, argv)
    out, err = capsys.readouterr()
    return code, out, err


ADAM = "a learning rate; Adam's first step size, lr / (1 - --adam-beta1 0.9), must be a float32"


@pytest.mark.parametrize("extra, expected", [
    # Adam's step size lr / (1 - beta1) overflowed float32 inside torch.
    (("--lr", "1e38"), f"--lr 1e+38 is out of range; valid: 0 <= --lr <= 3.403e+37 ({ADAM})"),
    (("--lr", "-1"), f"--lr -1 is out of range; valid: 0 <= --lr <= 3.403e+37 ({ADAM})"),
    (("--lr", "nan"), "--lr nan: not a finite number; give a finite value (see --help for its "
                      "range)"),
    (("--min-lr", "-0.1"), "--min-lr -0.1 is out of range; valid: 0 <= --min-lr (the floor of "
                           "the schedule, at most --lr)"),
    (("--lr", "1e30", "--weight-decay", "1e10"),
     "--lr 1e+30 is out of range; valid: 0 <= --lr <= 3.403e+28 (a learning rate; lr x "
     "--weight-decay 1e+10 must be a float32)"),
    (("--adam-beta1", "1.0"), "--adam-beta1 1 is out of range; valid: 0 <= --adam-beta1 < 1 "
                              "(Adam's beta1)"),
    (("--adam-eps", "-1"), "--adam-eps -1 is out of range; valid: 0 <= --adam-eps (added to "
                           "Adam's denominator)"),
    (("--weight-decay", "inf"), "--weight-decay inf: not a finite number; give a finite value "
                                "(see --help for its range)"),
    (("--attention-dropout", "1.5"), "--attention-dropout 1.5 is out of range; valid: 0 <= "
                                     "--attention-dropout <= 1 (a dropout probability)"),
    (("--seed", "-1"), "--seed -1 is out of range; valid: 0 <= --seed <= 4294967295 (numpy "
                       "seeds are below 2**32 and pipeline stage p uses --seed + 100 p)"),
    (("--seq-length", "100000000"), "--seq-length 100000000 is out of range; valid: 1 <= "
                                    "--seq-length <= 1048576 (tokens per sequence)"),
    (("--micro-batch-size", "100000000"),
     "--micro-batch-size 100000000 x --seq-length 64 = 6,400,000,000 tokens per micro-batch is "
     "out of range; valid: at most 16,777,216 (lower --micro-batch-size: more micro-batches "
     "keep the global batch)"),
    (("--global-batch-size", "2000000"), "--global-batch-size 2000000 is out of range; valid: "
                                         "1 <= --global-batch-size <= 1048576 (sequences per "
                                         "step)"),
    (("--hidden-size", "100000000"),
     "--hidden-size 100000000 is out of range; valid: 1 <= --hidden-size <= 131072 (a model "
     "size; larger ones are typos that would exhaust the memory while the model is built)"),
    (("--num-layers", "1000000"),
     "--num-layers 1000000 is out of range; valid: 1 <= --num-layers <= 1024 (a model size; "
     "larger ones are typos that would exhaust the memory while the model is built)"),
    (("--vocab-size", "10000000000"),
     "--vocab-size 10000000000 is out of range; valid: 1 <= --vocab-size <= 16777216 (a model "
     "size; larger ones are typos that would exhaust the memory while the model is built)"),
    (("--distributed-timeout-minutes", "100000000000000"),
     "--distributed-timeout-minutes 100000000000000 is out of range; valid: 1 <= "
     "--distributed-timeout-minutes <= 10080 (minutes a collective may wait)"),
    (("--num-workers", "100000"), "--num-workers 100000 is out of range; valid: 0 <= "
                                  "--num-workers <= 256 (data-loader processes per rank)"),
], ids=lambda v: " ".join(v) if isinstance(v, tuple) else "")
def test_numbers_out_of_range_are_one_line_before_anything_is_built(capsys, extra, expected):
    code, out, err = run(capsys, *extra)
    assert code == 2 and MODEL_BUILT not in out and "lm loss" not in out
    assert one_error_line(err) == f"error: {expected}"


def test_the_largest_valid_learning_rate_is_accepted():
    args = arguments.validate_args(arguments.parse_args(
        TINY_MOCK_ARGS + ["--train-iters", "2", "--lr", "3.4e37"]), check_paths=False)
    assert args.lr == 3.4e37
    args = arguments.validate_args(arguments.parse_args(      # hf_llama's model namespace
        TINY_MOCK_ARGS + ["--train-iters", "2", "--lr", "0", "--min-lr", "0"]),
        check_paths=False)
    assert args.lr == 0


def test_max_position_embeddings_is_bounded_only_where_it_sizes_a_table():
    big = ["--train-iters", "2", "--max-position-embeddings", str(1 << 21)]
    args = arguments.validate_args(arguments.parse_args(        # llama-tiny: rope
        TINY_MOCK_ARGS + big), check_paths=False)
    assert args.max_position_embeddings == 1 << 21
    with pytest.raises(arguments.ConfigError, match="--max-position-embeddings 2097152 is out "
                       "of range; valid: 1 <= --max-position-embeddings <= 1048576"):
        arguments.validate_args(arguments.parse_args(TINY_MOCK_ARGS + big + [
            "--position-embedding-type", "learned_absolute"]), check_paths=False)


def test_the_seed_bound_knows_the_pipeline_stride():
    assert arguments.PIPELINE_SEED_STRIDE == initialize.PIPELINE_SEED_STRIDE


def test_a_model_that_does_not_fit_is_one_line(capsys, monkeypatch):
    """Within the bounds but too big for the machine: the allocation that fails while the
    model is built (torch: "DefaultCPUAllocator: can't allocate memory") is one line."""
    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 256000000000 bytes. "
                           "Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(training, "build_gpt_model", no_memory)
    code, out, err = run(capsys)
    assert code == 1 and MODEL_BUILT not in out
    assert one_error_line(err) == (
        "error: out of memory building the model (an allocation of 256,000,000,000 bytes "
        "failed): --num-layers 2, --hidden-size 128, --ffn-hidden-size 384, vocabulary 640 do "
        "not fit this machine; shrink them or split the model over more ranks "
        "(--tensor-model-parallel-size, --pipeline-model-parallel-size); "
        "tools/estimate_memory.py tells what fits")


# ---------------------------------------------------------------------------------------------
# What the start-up log says the run is
# ---------------------------------------------------------------------------------------------


def _headline(capsys, *extra):
    code = main(pretrain_gpt.forward_step, TINY_MOCK_ARGS + ["--train-iters", "1",
                                                             "--quant-check", *extra])
    out = capsys.readouterr().out
    assert code == 0
    return out.splitlines()[0]


def test_the_quant_check_of_a_recipe_opens_with_the_recipe(capsys):
    assert _headline(capsys, "--quant-recipe", "nvfp4", "--bf16") == \
        "quantization: recipe nvfp4"


def test_an_unquantized_run_says_so_in_its_own_precision(capsys):
    assert _headline(capsys) == \
        "quantization: nothing quantized (every GEMM in fp32, the run's precision)"
    assert _headline(capsys, "--bf16") == \
        "quantization: nothing quantized (every GEMM in bf16, the run's precision)"


def test_a_scheme_run_names_its_scheme(capsys):
    assert _headline(capsys, "--quant-scheme", "FA_linear_mxfp8", "--bf16") == \
        "quantization: scheme FA_linear_mxfp8"
