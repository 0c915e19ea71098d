"""The token budget against the data: training-split tokens from the .idx, epochs, warning."""

import numpy as np
import pytest

from megatron.training.budget import (
    describe_budget_of_command, split_fractions, training_split_tokens)


@pytest.fixture
def ten_documents(tmp_path):
    """Documents of 1, 2, ..., 10 tokens (55 in all), written by megatron.core's builder."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "docs")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for n in range(1, 11):
        builder.add_document(np.arange(n, dtype=np.uint16), [n])
    builder.finalize(prefix + ".idx")
    return prefix


def test_training_split_tokens(ten_documents):
    # megatron.core's document split: the first round(f_train * 10) documents.
    assert training_split_tokens(ten_documents, "100,0,0") == 55
    assert training_split_tokens(ten_documents, "80,20,0") == sum(range(1, 9))     # 8 docs
    assert training_split_tokens(ten_documents, "969, 30, 1") == 55     # round(9.69) = 10
    assert training_split_tokens(ten_documents, "5,5") == sum(range(1, 6))
    assert split_fractions("98,2") == pytest.approx([0.98, 0.02, 0.0])
    with pytest.raises(ValueError, match="expected up to three"):
        split_fractions("0,0,0")


def test_budget_lines_and_the_epoch_warning(ten_documents, tmp_path):
    flags = ["--data-path", ten_documents, "--split", "80,20,0", "--global-batch-size", "2",
             "--seq-length", "9"]
    lines = describe_budget_of_command(flags + ["--train-iters", "2"])     # 36 of 36 tokens
    assert lines[0].startswith("data budget: 36 tokens planned (--train-iters 2 x "
                               "--global-batch-size 2 x --seq-length 9)")
    assert lines[1].endswith("36 training tokens, weight 1.000 -> 1.00 epochs")
    assert not any(l.startswith("warning") for l in lines)
    lines = describe_budget_of_command(flags + ["--train-iters", "3"])     # 54 tokens: 1.5
    assert lines[1].endswith("-> 1.50 epochs")
    assert lines[-1].startswith(f"warning: the plan reads {ten_documents} 1.5 times (> 1 epoch)")
    # A blend: each dataset's share of the plan against its own training tokens.
    blend = ["--data-path", "0.25", ten_documents, "0.75", ten_documents, "--split", "100",
             "--global-batch-size", "1", "--seq-length", "110", "--train-iters", "1"]
    lines = describe_budget_of_command(blend)
    assert [l.split("-> ")[1] for l in lines[1:3]] == ["0.50 epochs", "1.50 epochs"]
    assert describe_budget_of_command(["--mock-data", "--train-iters", "5"]) == []
    missing = describe_budget_of_command(["--data-path", str(tmp_path / "nothing"),
                                          "--train-iters", "1"])
    assert missing[0].startswith("data budget: not computed (") and "nothing.idx" in missing[0]
