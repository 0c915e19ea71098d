"""Saturation and flush-to-zero of an arm's quantized forward operands on one micro-batch,
measured by the training telemetry's observer (megatron/tensor_capture/telemetry.py)."""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import torch

from megatron.evaluation.losses import device
from megatron.quantization.runtime import observing
from megatron.tensor_capture.callback import collect_sites
from megatron.tensor_capture.telemetry import QuantTelemetry, site_label
from megatron.training.batches import batch_to_device

METRICS = ("saturated_pct", "flushed_pct")


def forward_operand_stats(module, batch: dict) -> Optional[Dict[str, object]]:
    """{metric: {"worst": value, "where": "site operand", "median": value}} over the
    quantized operands of one forward pass, or None when nothing is quantized."""
    labels = {name: site_label(info.layer, info.module, info.kind)
              for name, info in collect_sites([module]).items()}
    with observing(module, QuantTelemetry(labels)) as telemetry:
        telemetry.begin()
        tokens, labels_, _, attention_mask, position_ids = batch_to_device(batch, device())
        module.eval()
        with torch.no_grad():
            module(tokens, position_ids, attention_mask, labels=labels_)
        results = telemetry.reduce()
    out = {}
    for metric in METRICS:
        values = [(f"{site} {operand}", v[metric]) for (site, operand), v in results.items()
                  if metric in v]
        if values:
            where, worst = max(values, key=lambda item: item[1])
            out[metric] = {"worst": worst, "where": where,
                           "median": float(np.median([v for _, v in values])),
                           "operands": len(values)}
    return out or None
