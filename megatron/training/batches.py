"""Moving one micro-batch to the model's device (light: imports only torch, so the entry
script can import it without pulling in megatron-core)."""

from __future__ import annotations

from typing import Dict, Tuple

import torch


def batch_to_device(batch: Dict[str, torch.Tensor], device: torch.device) -> Tuple:
    """(tokens, labels, loss_mask, attention_mask or None, position_ids) on `device`."""
    moved = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    return (moved["tokens"], moved["labels"], moved["loss_mask"].float(),
            moved.get("attention_mask"), moved["position_ids"])
