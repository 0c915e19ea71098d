"""Gradient fidelity: the gradient of the validation loss under an arm versus references.

For fixed weights, each of N micro-batches gives the gradient of its mean per-token loss for
every parameter. It is compared with the same micro-batch's gradient of a reference (the
unquantized model in fp32, and the baseline arm in the run's precision): cosine similarity
and relative L2 error ||g - g_ref|| / ||g_ref|| over all parameters, per micro-batch (their
mean, and a t interval over micro-batches for paired comparisons of arms) and for the whole
set (the token-weighted mean gradient); per GEMM site (its weight) for the whole set.

Stochastic rounding: K gradients with independent draws (iterations 1..K of the counter-based
streams) are averaged; the relative error of the mean versus K shows whether the rounding is
unbiased (the error falls as 1/sqrt(K) towards the floor set by everything deterministic) or
not (round-to-nearest: every draw is the same, the error stays).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from megatron.evaluation.losses import device
from megatron.evaluation.model_state import site_label
from megatron.quantization.runtime import runtime_of
from megatron.training.batches import batch_to_device


# Gradients are held in float32 (a 135M-parameter model's micro-batch gradient is 0.5 GB); the
# kept micro-batch rows live in an unlinked temporary file (np.memmap), so the kernel can page
# them out under memory pressure instead of killing the run; norms and dot products are taken
# in float64, CHUNK entries at a time.
CHUNK = 1 << 22


def _file_backed(rows: int, columns: int) -> torch.Tensor:
    """A [rows, columns] float32 tensor backed by an unlinked temporary file."""
    import tempfile

    handle = tempfile.TemporaryFile()
    handle.truncate(rows * columns * 4)
    array = np.memmap(handle, dtype=np.float32, mode="r+", shape=(rows, columns))
    return torch.from_numpy(array)


@dataclass
class Gradients:
    """Per-micro-batch gradients, flattened over the parameters in `names` order (float32)."""

    names: List[str]
    sizes: List[int]
    per_batch: Optional[torch.Tensor]   # [micro-batches, parameters] float32; None: streamed
    weights: torch.Tensor        # [micro-batches] tokens / total tokens, float64
    _total: torch.Tensor = None
    # Streamed gradients (`against`): each micro-batch's comparison with each reference's,
    # by the reference's position in `against`; the micro-batch rows are not kept.
    pairs: Optional[List[List[Dict[str, float]]]] = None

    @property
    def total(self) -> torch.Tensor:
        """The token-weighted mean gradient (summed in float64, held in float32)."""
        if self._total is None:
            out = torch.empty(self.per_batch.shape[1], dtype=torch.float32)
            for i in range(0, out.numel(), CHUNK):
                out[i:i + CHUNK] = (self.weights @ self.per_batch[:, i:i + CHUNK].double())
            self._total = out
        return self._total

    def of(self, names: Sequence[str], vector: torch.Tensor) -> torch.Tensor:
        """The entries of `names` in a flat vector."""
        offsets = np.cumsum([0] + self.sizes)
        index = {n: i for i, n in enumerate(self.names)}
        return torch.cat([vector[offsets[index[n]]:offsets[index[n] + 1]] for n in names])


def unique_parameters(model) -> list:
    """(name, parameter) pairs, a tied parameter once (under its first name)."""
    seen, out = set(), []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def gradients(module, named_parameters, batches: List[dict], seed: int,
              draw: int = 1, against: Sequence["Gradients"] = (),
              keep: bool = True) -> Gradients:
    """Each micro-batch's gradient of its mean per-token loss. `draw` keys the
    stochastic-rounding streams. With `keep` False the micro-batch rows are not kept (only
    the total, and each row's comparison with the same micro-batch of each of `against`):
    memory for one row instead of one per micro-batch."""
    params = list(named_parameters)
    dev = device()
    tokens = []
    pairs = [[] for _ in against]
    running = None
    rows = _file_backed(len(batches), sum(p.numel() for _, p in params)) if keep else None
    module.eval()        # no dropout; gradients flow all the same
    runtime_of(module).start_iteration(seed, draw)
    for batch in batches:
        for _, p in params:
            p.grad = None
        tokens_, labels, loss_mask, attention_mask, position_ids = batch_to_device(batch, dev)
        losses = module(tokens_, position_ids, attention_mask, labels=labels).float()
        count = float(loss_mask.sum())
        (torch.sum(losses.view(-1) * loss_mask.view(-1)) / count).backward()
        row = torch.cat([
            (p.grad.detach().float().cpu() if p.grad is not None
             else torch.zeros(p.shape, dtype=torch.float32)).flatten() for _, p in params])
        for out, reference in zip(pairs, against):
            out.append(_pair(row, reference.per_batch[len(tokens)]))
        if keep:
            rows[len(tokens)] = row
        else:
            running = row * count if running is None else running.add_(row, alpha=count)
        tokens.append(count)
    for _, p in params:
        p.grad = None
    weights = torch.tensor(tokens, dtype=torch.float64)
    names, sizes = [n for n, _ in params], [p.numel() for _, p in params]
    if keep:
        return Gradients(names, sizes, rows, weights / weights.sum(),
                         pairs=pairs if against else None)
    return Gradients(names, sizes, None, weights / weights.sum(),
                     _total=running / float(weights.sum()), pairs=pairs)


def _sums(g: torch.Tensor, r: torch.Tensor):
    """(g.g, r.r, g.r, |g-r|^2) in float64, CHUNK entries at a time."""
    gg = rr = gr = dd = 0.0
    for i in range(0, g.numel(), CHUNK):
        a, b = g[i:i + CHUNK].double(), r[i:i + CHUNK].double()
        gg, rr, gr = gg + float(a @ a), rr + float(b @ b), gr + float(a @ b)
        dd += float((a - b) @ (a - b))
    return gg, rr, gr, dd


def _pair(g: torch.Tensor, r: torch.Tensor) -> Dict[str, float]:
    gg, rr, gr, dd = _sums(g, r)
    r_norm = rr ** 0.5
    cosine = gr / max(gg ** 0.5 * r_norm, 1e-300)
    return {"cosine": cosine, "rel_l2": dd ** 0.5 / max(r_norm, 1e-300)}


def compare(grads: Gradients, reference: Gradients, streamed: Optional[int] = None
            ) -> Dict[str, object]:
    """Cosine and relative L2 error of the whole set's gradient, and per micro-batch (taken
    from `grads.pairs[streamed]` when the rows were streamed against `reference`)."""
    out = _pair(grads.total, reference.total)
    if streamed is not None:
        per = grads.pairs[streamed]
    else:
        per = [_pair(g, r) for g, r in zip(grads.per_batch, reference.per_batch)]
    out["per_micro_batch"] = {"cosine": [p["cosine"] for p in per],
                              "rel_l2": [p["rel_l2"] for p in per]}
    return out


def per_site(grads: Gradients, reference: Gradients, sites) -> Dict[str, Dict[str, float]]:
    """The comparison of each GEMM site's weight gradient (whole set), keyed "layer/label"
    (the output layer "output"); sites sharing a label in one layer (MoE experts) pooled."""
    pooled: Dict[str, list] = {}
    for site in sites:
        name = f"{site.name}.weight"
        if site.kind not in ("linear", "output_layer") or name not in reference.names:
            continue        # attention GEMMs have no weights
        key = "output" if site.layer_number is None else \
            f"{site.layer_number}/{site_label(site.name)}"
        pooled.setdefault(key, []).append(name)
    g, r = grads.total, reference.total
    return {key: _pair(grads.of(names, g), reference.of(names, r))
            for key, names in pooled.items()}


def draws_curve(module, named_parameters, batches, seed: int, ks: Sequence[int],
                reference: Gradients, log=None, label: str = "") -> Dict[str, list]:
    """Relative L2 error versus `reference` (whole set) of the mean of the first K gradient
    draws, for each K in `ks` (draw k uses stream iteration k). `log` gets a progress line
    every PROGRESS_SECONDS with the time left."""
    import time

    from megatron.evaluation.losses import PROGRESS_SECONDS

    ks = sorted(set(int(k) for k in ks))
    ref = reference.total
    running = torch.zeros(ref.shape, dtype=torch.float32)
    errors = []
    start = last = time.time()
    for k in range(1, ks[-1] + 1):
        running += gradients(module, named_parameters, batches, seed, draw=k,
                             keep=False).total
        if k in ks:
            errors.append(_pair(running / k, ref)["rel_l2"])
        now = time.time()
        if log is not None and k < ks[-1] and (now - last >= PROGRESS_SECONDS or k == 1):
            last = now
            left = (now - start) / k * (ks[-1] - k)
            log(f"  {label}: stochastic-rounding draw {k}/{ks[-1]}, about {left:.0f} s left")
    slope = float(np.polyfit(np.log(ks), np.log(errors), 1)[0]) if len(ks) > 1 else float("nan")
    return {"K": ks, "rel_l2": errors, "log_log_slope": slope}
