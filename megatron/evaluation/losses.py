"""Per-sequence validation losses of one arm on fixed batches, and the logits dump.

The batches are drawn once (the validation split, in the order pretrain_gpt.py's validation
reads it: --eval-iters x micro-batches per data-parallel rank) and reused by every arm. The
mean loss is accumulated as pretrain_gpt.py's validation does (each micro-batch's masked sum in
float32, totals in float64), so the bf16 arm's loss is the training log's validation loss.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from megatron.quantization.runtime import runtime_of
from megatron.training.batches import batch_to_device
from megatron.training.data import build_data_iterator, build_datasets
from megatron.training.errors import ConfigError

PROGRESS_SECONDS = 10.0


@dataclass
class ArmLosses:
    """One arm's losses on this run's sequences (all data-parallel ranks gathered)."""

    loss: float                 # mean per-token loss, nats
    tokens: int                 # scored tokens
    sequence_sums: np.ndarray   # [m] summed loss per sequence
    sequence_tokens: np.ndarray  # [m] scored tokens per sequence
    token_losses: np.ndarray    # [scored tokens] per-token losses, in sequence order
    seconds: float


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def validation_batches(args, tokenizer) -> List[dict]:
    """This rank's --eval-iters x num_micro_batches validation micro-batches."""
    _, valid, _ = build_datasets(args, tokenizer)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    iterator = build_data_iterator(valid, 0, args, dp_rank, dp_size, cyclic=True)
    if iterator is None:
        raise ConfigError("the data has no validation split: give --split with a validation "
                          "share (e.g. --split 98,2,0) or --mock-data")
    return [next(iterator) for _ in range(args.eval_iters * args.num_micro_batches)]


def repeated_sequences(batches: List[dict]) -> int:
    """How many of this rank's sequences repeat an earlier one (a validation split smaller
    than --eval-iters x global batch wraps around)."""
    seen, repeats = set(), 0
    for batch in batches:
        for row in batch["tokens"]:
            key = row.numpy().tobytes()
            repeats += key in seen
            seen.add(key)
    return repeats


def _gather(array: np.ndarray) -> np.ndarray:
    """Concatenate a per-rank array over the data-parallel group (rank order)."""
    group = parallel_state.get_data_parallel_group()
    if torch.distributed.get_world_size(group) == 1:
        return array
    parts = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(parts, array, group=group)
    return np.concatenate(parts)


def arm_losses(module, batches: List[dict], seed: int, log: Callable[[str], None],
               label: str) -> ArmLosses:
    """Evaluate `module` (in eval mode, no gradients) on `batches`."""
    module.eval()
    dev = device()
    total = torch.zeros(2, dtype=torch.float64, device=dev)
    sums, counts, token_losses = [], [], []
    start = last = time.time()
    # Forward stochastic rounding: the same draws every time (iteration 0 of the streams).
    runtime_of(module).start_iteration(seed, 0, parallel_state.get_data_parallel_rank())
    with torch.no_grad():
        for done, batch in enumerate(batches, 1):
            tokens, labels, loss_mask, attention_mask, position_ids = batch_to_device(batch, dev)
            losses = module(tokens, position_ids, attention_mask, labels=labels).float()
            total += torch.stack([torch.sum(losses.view(-1) * loss_mask.view(-1)).double(),
                                  loss_mask.sum().double()])
            per_token = losses.double() * loss_mask.double()
            sums.append(per_token.sum(dim=1).cpu().numpy())
            counts.append(loss_mask.sum(dim=1).cpu().numpy().astype(np.int64))
            mask = loss_mask.bool().cpu().numpy()
            token_losses.append(losses.double().cpu().numpy()[mask])
            now = time.time()
            if now - last >= PROGRESS_SECONDS and done < len(batches):
                last = now
                eta = (now - start) / done * (len(batches) - done)
                log(f"  {label}: {done}/{len(batches)} micro-batches, about {eta:.0f} s left")
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    seq_sums = _gather(np.concatenate(sums))
    seq_tokens = _gather(np.concatenate(counts))
    return ArmLosses(loss=float(total[0] / total[1].clamp(min=1)), tokens=int(total[1].item()),
                     sequence_sums=seq_sums, sequence_tokens=seq_tokens,
                     token_losses=_gather(np.concatenate(token_losses)),
                     seconds=time.time() - start)


def warm_up_scaling(model, batch: dict, backward: bool) -> bool:
    """Fill the amax histories of an arm's delayed-scaled operands (FP8 delayed scaling, FP8
    attention's P and dS) from `batch`, the first micro-batch, before the arm is measured. An
    evaluation starts without histories, and TransformerEngine's initial scale 1.0 would
    quantize the first micro-batch as no run with histories does (in FP8 attention it flushes
    most of dS). One pass, a forward and for gradients (`backward`) a backward too, in which
    every delayed-scaled operand is scaled from its own amax (current scaling) and records it:
    the measured pass over the first micro-batch is then exactly that current-scaled pass, and
    each later micro-batch is scaled from its predecessor's amaxes. Nothing else is kept: no
    gradients, and the stochastic-rounding streams restart when the measurement starts.
    Returns whether the arm has delayed-scaled operands (False: nothing was run)."""
    histories = [site.state.amax for site in model.sites if site.state.amax is not None]
    if not histories:
        return False
    module = model.module
    module.eval()
    tokens, labels, loss_mask, attention_mask, position_ids = batch_to_device(batch, device())
    for h in histories:
        h.current = True
    try:
        with torch.enable_grad() if backward else torch.no_grad():
            losses = module(tokens, position_ids, attention_mask, labels=labels).float()
            if backward:
                (torch.sum(losses.view(-1) * loss_mask.view(-1)) / loss_mask.sum()).backward()
    finally:
        for h in histories:
            h.current = False
        for p in module.parameters():
            p.grad = None
    return True


def first_batch_logits(module, batch: dict, vocab_size: int):
    """(tokens [b, s] int64, logits [b, s, vocab] float32) of one micro-batch; the vocabulary
    padding is cut off and tensor-parallel shards gathered."""
    module.eval()
    tokens, _, _, attention_mask, position_ids = batch_to_device(batch, device())
    with torch.no_grad():
        logits = module(tokens, position_ids, attention_mask)
        logits = gather_from_tensor_model_parallel_region(logits)
    return (tokens.cpu().numpy().astype(np.int64),
            logits[..., :vocab_size].float().cpu().numpy())
