"""The token budget of a run against the tokens its data holds (epochs), stated at start-up.

A plan of 25 B tokens on a 1.66 M-token corpus is 15,000 epochs: the run would measure
memorisation, not pretraining. Megatron-LM silently cycles the data; this module says so.
Token counts come from the .idx files alone (no .bin is read) and follow megatron.core's
document split: the training split of a dataset with N documents is documents
[0, round(f_train * N)).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from megatron.training.data_files import HEADER_BYTES, index_counts


@dataclass(frozen=True)
class DatasetBudget:
    prefix: str
    weight: float          # normalised blend weight
    train_tokens: int      # tokens in the training split's documents
    planned_tokens: float  # this dataset's share of the planned tokens

    @property
    def epochs(self) -> float:
        return self.planned_tokens / self.train_tokens if self.train_tokens else float("inf")


DEFAULT_SPLIT = "969, 30, 1"                 # Megatron-LM's default --split


def split_fractions(split: str) -> List[float]:
    """'98,2,0' -> [0.98, 0.02, 0.0] (megatron.core's normalisation; 1 to 3 numbers)."""
    values = [float(v) for v in re.findall(r"[.0-9]+", split)]
    values += [0.0] * (3 - len(values))
    if len(values) != 3 or sum(values) <= 0:
        raise ValueError(f"--split {split!r}: expected up to three non-negative numbers")
    return [v / sum(values) for v in values]


def training_split_tokens(prefix: str, split: str) -> int:
    """Tokens in the training split of the dataset at `prefix`, read from `prefix`.idx only
    (the layout is in data_files.py: header, int32 sequence lengths, int64 sequence pointers,
    int64 document indices)."""
    path = prefix + ".idx"
    _, sequences, documents = index_counts(path)      # a damaged index: one line
    lengths = np.fromfile(path, dtype=np.int32, count=sequences, offset=HEADER_BYTES)
    doc_index = np.fromfile(path, dtype=np.int64, count=documents,
                            offset=HEADER_BYTES + 12 * sequences)
    # doc_index[i] is the first sequence of document i; the last entry ends the last document.
    train_documents = int(round(split_fractions(split)[0] * (documents - 1)))
    return int(lengths[:doc_index[train_documents]].sum(dtype=np.int64))


def plan(prefixes: Sequence[str], weights: Optional[Sequence[float]], split: str,
         planned_tokens: int) -> List[DatasetBudget]:
    weights = list(weights) if weights else [1.0] * len(prefixes)
    total = float(sum(weights))
    return [DatasetBudget(prefix, w / total, training_split_tokens(prefix, split),
                          planned_tokens * w / total) for prefix, w in zip(prefixes, weights)]


def planned_tokens(args) -> int:
    return args.train_iters * args.global_batch_size * args.seq_length


def describe_budget(args) -> List[str]:
    """Lines for the log: planned tokens, data tokens, epochs; a `warning:` above one epoch.

    Empty for --mock-data; a line saying why when the index cannot be read."""
    if args.mock_data or not args.data_prefixes:
        return []
    planned = planned_tokens(args)
    try:
        budgets = plan(args.data_prefixes, args.data_weights, args.split or DEFAULT_SPLIT,
                       planned)
    except (OSError, ValueError) as exc:  # a missing or damaged index is reported elsewhere
        return [f"data budget: not computed ({exc})"]
    lines = [f"data budget: {planned:,} tokens planned (--train-iters {args.train_iters} x "
             f"--global-batch-size {args.global_batch_size} x --seq-length {args.seq_length})"]
    for b in budgets:
        lines.append(f"  {b.prefix}: {b.train_tokens:,} training tokens, weight {b.weight:.3f}"
                     f" -> {b.epochs:,.2f} epochs")
    worst = max(budgets, key=lambda b: b.epochs)
    if worst.epochs > 1.0:
        lines.append(f"warning: the plan reads {worst.prefix} {worst.epochs:,.1f} times "
                     "(> 1 epoch): later epochs repeat the same documents, so losses measure "
                     "memorisation as much as learning; use more data or fewer tokens")
    return lines


def describe_budget_of_command(pretrain_args: Sequence[str]) -> List[str]:
    """describe_budget for a pretrain_gpt.py command line (train_config.py --dry-run), without
    importing torch: only the flags the budget needs are read."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--train-iters", type=int, default=0)
    parser.add_argument("--global-batch-size", type=int, default=1)
    parser.add_argument("--seq-length", type=int, default=0)
    parser.add_argument("--data-path", nargs="+", default=None)
    parser.add_argument("--split", default=DEFAULT_SPLIT)
    parser.add_argument("--mock-data", action="store_true")
    args, _ = parser.parse_known_args(list(pretrain_args))
    if args.data_path and len(args.data_path) > 1:
        args.data_weights = [float(w) for w in args.data_path[0::2]]
        args.data_prefixes = args.data_path[1::2]
    else:
        args.data_prefixes, args.data_weights = args.data_path, None
    return describe_budget(args)
