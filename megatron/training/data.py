"""Training data: megatron.core's BlendedMegatronDatasetBuilder + GPTDataset, and batch iteration.

Every rank reads the batches it needs itself (tensor- and pipeline-parallel peers read the same
samples), so no broadcast of batches is needed and the data order is a pure function of
(seed, consumed samples): resuming from a checkpoint continues exactly where the run stopped.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def dataset_sizes(args) -> List[int]:
    """Samples needed for [train, valid, test] (Megatron-LM's iteration-based formula)."""
    train = args.train_iters * args.global_batch_size
    evaluations = args.train_iters // args.eval_interval + 1
    valid = evaluations * args.eval_iters * args.global_batch_size
    test = args.eval_iters * args.global_batch_size
    return [train, valid, test]


def gpt_dataset_config(args, tokenizer) -> GPTDatasetConfig:
    blend = None if args.mock_data else (args.data_prefixes, args.data_weights)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        split=args.split if not args.mock_data else None,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        # The model builds the causal mask itself; a per-sample [S, S] mask is only needed when
        # documents must not attend to each other.
        create_attention_mask=args.reset_attention_mask,
        mid_level_dataset_surplus=0.005,
    )


def build_datasets(args, tokenizer):
    """(train, valid, test) datasets; valid/test may be None when their split is empty."""
    cls = MockGPTDataset if args.mock_data else GPTDataset
    config = gpt_dataset_config(args, tokenizer)
    return BlendedMegatronDatasetBuilder(cls, dataset_sizes(args), lambda: True, config).build()


def _collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    keys = [k for k in (*BATCH_KEYS, "attention_mask") if k in samples[0]]
    return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in keys}


class MicroBatchSampler(torch.utils.data.Sampler):
    """Yields this data-parallel rank's micro-batch indices, starting at `consumed_samples`.

    Each step of `micro_batch_size x dp_size` consecutive samples is split between the DP ranks
    in rank order (Megatron-LM's MegatronPretrainingSampler order).
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int):
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __len__(self):
        step = self.micro_batch_size * self.dp_size
        return max(0, (self.total_samples - self.consumed_samples) // step)

    def __iter__(self) -> Iterator[List[int]]:
        step = self.micro_batch_size * self.dp_size
        start = self.consumed_samples
        while start + step <= self.total_samples:
            first = start + self.dp_rank * self.micro_batch_size
            yield list(range(first, first + self.micro_batch_size))
            start += step


def build_data_iterator(dataset, consumed_samples: int, args, dp_rank: int, dp_size: int,
                        cyclic: bool = False) -> Optional[Iterator]:
    """An iterator of collated micro-batches for this rank (None if there is no dataset)."""
    if dataset is None or len(dataset) == 0:
        return None

    def make_loader(start: int):
        sampler = MicroBatchSampler(len(dataset), start, args.micro_batch_size, dp_rank, dp_size)
        return torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, num_workers=args.num_workers, collate_fn=_collate,
            persistent_workers=False)

    if not cyclic:
        return iter(make_loader(consumed_samples))

    def cycle():
        start = consumed_samples
        while True:
            yield from make_loader(start)
            start = 0

    return cycle()
