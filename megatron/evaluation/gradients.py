"""Gradient fidelity: the gradient of the mean validation loss under an arm versus references.

For fixed weights and batches, every parameter's gradient of the mean per-token loss over the
batches (each micro-batch's gradient accumulated in float64, so no accumulation rounding is
added) is compared with the same gradient of a reference (the baseline arm in the run's
precision, and the unquantized model in fp32): cosine similarity and relative L2 error
||g - g_ref|| / ||g_ref||, per GEMM site (its weight) and over all parameters.

Stochastic rounding: K gradients with independent draws (iterations 1..K of the counter-based
streams) are averaged; the relative error of the mean versus K shows whether the rounding is
unbiased (error falls as 1/sqrt(K) towards the floor set by everything deterministic) or not
(round-to-nearest: every draw is the same, the error stays).
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np
import torch

from megatron.evaluation.losses import device
from megatron.evaluation.model_state import site_label
from megatron.quantization import randomness
from megatron.training.batches import batch_to_device

Gradients = Dict[str, torch.Tensor]


def gradients(module, named_parameters, batches: List[dict], seed: int,
              draw: int = 1) -> Gradients:
    """float64 gradients of the mean per-token loss over `batches`, by parameter name (tied
    parameters once). `draw` keys the stochastic-rounding streams."""
    module.train()     # dropout is off in these models; train() only for modules that care
    params = list(named_parameters)
    acc = {name: torch.zeros(p.shape, dtype=torch.float64) for name, p in params}
    dev = device()
    total_tokens = sum(float(b["loss_mask"].sum()) for b in batches)
    randomness.start_iteration(seed, draw)
    for batch in batches:
        for _, p in params:
            p.grad = None
        tokens, labels, loss_mask, attention_mask, position_ids = batch_to_device(batch, dev)
        losses = module(tokens, position_ids, attention_mask, labels=labels).float()
        (torch.sum(losses.view(-1) * loss_mask.view(-1)) / total_tokens).backward()
        for name, p in params:
            if p.grad is not None:
                acc[name] += p.grad.detach().double().cpu()
    for _, p in params:
        p.grad = None
    module.eval()
    return acc


def unique_parameters(model) -> list:
    """(name, parameter) pairs, a tied parameter once (under its first name)."""
    seen, out = set(), []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def compare(grads: Gradients, reference: Gradients) -> Dict[str, float]:
    """Cosine similarity and relative L2 error over all parameters."""
    g = torch.cat([grads[k].flatten() for k in sorted(reference)])
    r = torch.cat([reference[k].flatten() for k in sorted(reference)])
    return _pair(g, r)


def _pair(g: torch.Tensor, r: torch.Tensor) -> Dict[str, float]:
    r_norm = float(r.norm())
    cosine = float(g @ r) / max(float(g.norm()) * r_norm, 1e-300)
    return {"cosine": cosine, "rel_l2": float((g - r).norm()) / max(r_norm, 1e-300)}


def per_site(grads: Gradients, reference: Gradients, sites) -> Dict[str, Dict[str, float]]:
    """The comparison of each GEMM site's weight gradient, keyed "layer/label" (the output
    layer "output"); sites sharing a label in one layer (MoE experts) are pooled."""
    pooled: Dict[str, list] = {}
    for site in sites:
        if site.kind not in ("linear", "output_layer"):
            continue        # attention GEMMs have no weights: they show in the layer's others
        name = f"{site.name}.weight"
        if name not in reference:
            continue
        key = "output" if site.layer_number is None else f"{site.layer_number}/{site_label(site.name)}"
        pooled.setdefault(key, []).append(name)
    return {key: _pair(torch.cat([grads[n].flatten() for n in names]),
                       torch.cat([reference[n].flatten() for n in names]))
            for key, names in pooled.items()}


def draws_curve(module, named_parameters, batches, seed: int, ks: Sequence[int],
                reference: Gradients) -> Dict[str, list]:
    """Relative L2 error versus `reference` of the mean of the first K gradient draws, for
    each K in `ks` (draw k uses stream iteration k)."""
    ks = sorted(set(int(k) for k in ks))
    keys = sorted(reference)
    ref = torch.cat([reference[k].flatten() for k in keys])
    running = torch.zeros_like(ref)
    errors = []
    for k in range(1, ks[-1] + 1):
        g = gradients(module, named_parameters, batches, seed, draw=k)
        running += torch.cat([g[n].flatten() for n in keys])
        if k in ks:
            errors.append(float((running / k - ref).norm() / ref.norm()))
    slope = float(np.polyfit(np.log(ks), np.log(errors), 1)[0]) if len(ks) > 1 else float("nan")
    return {"K": ks, "rel_l2": errors, "log_log_slope": slope}
