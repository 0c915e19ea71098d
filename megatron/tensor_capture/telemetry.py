"""Quantization telemetry: per-site, per-operand statistics of chosen training iterations.

`QuantTelemetry` is a GEMM observer (megatron.quantization.observers protocol). While an
iteration is being measured it adds, for every operand of every GEMM site, the sufficient
statistics of operand_sums.operand_statistics to device-resident accumulators: no host
synchronisation in the step. `reduce()` then stacks every accumulator, all-reduces them over
all ranks (sums and maxima: two collectives) and copies the result to the host once.

It accepts operands in pieces (`accepts_pieces`): the chunked attention path reports each
chunk of a chunked operand, whose statistics add up exactly, instead of falling back to the
O(s^2) full-scores path the way whole-tensor capture does.

Keys are `L{layer}.{module}` (capture's short module names, `.qk`/`.pv` for attention) and
`{gemm}.{operand}` with attention operands named by role (query, key, grad_scores; probs,
value, grad_context). Metrics, per key:

    saturated_pct flushed_pct sqnr_db rel_error amax       quantized operands
    scale_exp_min scale_exp_max                              MX formats (MXFP8, MXFP6, MXFP4)
    hifp8_{underflow,denormal,mant1,mant2,mant3,overflow}_pct   HiFP8
    block_scale_zero_pct block_scale_subnormal_pct           NVFP4: shares of the blocks whose
                                                             E4M3 scale is 0 / below 2**-6
    tensor_scale_min tensor_scale_max                        NVFP4 (s_enc), FP8 per tensor
    block_scale_min block_scale_max                          NVFP4 (nonzero E4M3 scales), FP8
                                                             blockwise (tiles with data)
    amax                                                     operands kept in high precision
    nonfinite (= 1) and amax only                            an operand that held NaN/Inf

NVFP4 and FP8 `saturated_pct` counts the elements the element format's clamp changed (a
scaled value beyond max_normal plus half a step: |v| > 464 for E4M3, >= 61440 for E5M2,
>= 7 for E2M1): FP8 with delayed scaling when the tensor outgrew the amax of its history,
NVFP4 in blocks with subnormal E4M3 scales. The scale ranges are over the micro-batches,
chunks and ranks measured (one value when the operand was measured once).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch

from megatron.quantization.formats import format_info, hifp8_scale_exponent
from megatron.tensor_capture.records import SameDataCache
from megatron.quantization.gemm import VARIANT_KEYS, format_options
from megatron.tensor_capture.operand_sums import (
    MAX_EMPTY, MAX_FIELDS, SUM_FIELDS, operand_statistics)
from megatron.tensor_capture.stats import HIFP8_REGIONS

# Attention operands by role (quantized_matmul reports a, b, grad_output).
_ATTENTION_ROLES = {
    "attn_qk": {"a": "query", "b": "key", "grad_output": "grad_scores"},
    "attn_pv": {"a": "probs", "b": "value", "grad_output": "grad_context"},
}
_RESULTS = ("output", "grad_input", "grad_weight", "grad_a", "grad_b")
_S = {name: i for i, name in enumerate(SUM_FIELDS)}
_M = {name: i for i, name in enumerate(MAX_FIELDS)}


def site_label(layer: int, module: str, kind: str) -> str:
    suffix = {"attn_qk": ".qk", "attn_pv": ".pv"}.get(kind, "")
    return f"L{layer}.{module}{suffix}"


class QuantTelemetry:
    """The observer and its accumulators. `labels` maps site names to site labels."""

    accepts_pieces = True

    def __init__(self, labels: Dict[str, str]):
        self.labels = dict(labels)
        self.active = False
        # (site label, operand key) -> [sums, maxima, format]
        self._acc: Dict[Tuple[str, str], list] = {}
        self._keys: Optional[List[Tuple[str, str, str]]] = None   # agreed by all ranks
        # x-side statistics of data measured earlier in this iteration (weakly keyed).
        self._same_data = SameDataCache(size=4096)

    # -- observers protocol --------------------------------------------------------------

    def bind(self, site):
        if not self.active:
            return None
        label = self.labels.get(site.name) or site_label(site.layer_number or 0,
                                                         site.name.rsplit(".", 1)[-1], site.kind)
        roles = _ATTENTION_ROLES.get(site.kind, {})
        config = site.config

        def observe(gemm, operand, hp, q, fmt, axis, scale_exponent=None, amax=None,
                    weight=False, **extra):
            if operand in _RESULTS:
                return
            k = options = None
            if q is not None and fmt == "hifp8" and config.tensor_scaled(fmt):
                # a chunk of a tensor-scaled operand comes with the whole operand's scale
                k = scale_exponent if scale_exponent is not None else hifp8_scale_exponent(hp)
            if q is not None:
                # NVFP4 / FP8: the format options (2-D weight tiles, an imposed or delayed
                # amax) their scales are recomputed with; stochastic rounding changes none
                options = format_options(config, fmt, hp.dim(), weight=weight, amax=amax,
                                         **{k: extra[k] for k in VARIANT_KEYS if k in extra})
            known = self._same_data.get(hp) if q is not None else None
            sums, maxima, x_side = operand_statistics(
                hp, q, fmt if q is not None else "none", axis, config.mx.scale_mode, k, known,
                options=options)
            if q is not None and known is None:
                self._same_data.put(hp, x_side)
            self._add((label, f"{gemm}.{roles.get(operand, operand)}"), sums, maxima,
                      fmt if q is not None else "none")

        observe.accepts_pieces = True
        return observe

    def _add(self, key, sums, maxima, fmt):
        entry = self._acc.get(key)
        if entry is None:
            self._acc[key] = [sums, maxima, fmt]
        else:
            entry[0].add_(sums)
            torch.maximum(entry[1], maxima, out=entry[1])

    # -- one measured iteration ------------------------------------------------------------

    def begin(self) -> None:
        self.active = True

    def reduce(self, group=None) -> Dict[Tuple[str, str], Dict[str, float]]:
        """{(site, operand): {metric: value}} over all ranks; ends the measured iteration."""
        self.active = False
        self._same_data = SameDataCache(size=4096)
        keys = self._agree_on_keys(group)
        device = next((e[0].device for e in self._acc.values()), _default_device())
        sums = torch.zeros(len(keys), len(SUM_FIELDS), dtype=torch.float64, device=device)
        maxima = torch.tensor(MAX_EMPTY, dtype=torch.float64,
                              device=device).repeat(len(keys), 1)
        for i, (site, operand, _) in enumerate(keys):
            entry = self._acc.get((site, operand))
            if entry is not None:
                sums[i], maxima[i] = entry[0], entry[1]
        self._acc.clear()
        if _distributed():
            torch.distributed.all_reduce(sums, group=group)
            torch.distributed.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX, group=group)
        host = torch.cat([sums, maxima], dim=1).cpu().tolist()     # the one synchronisation
        split = len(SUM_FIELDS)
        return {(site, operand): metrics(row[:split], row[split:], fmt)
                for (site, operand, fmt), row in zip(keys, host)}

    def _agree_on_keys(self, group) -> List[Tuple[str, str, str]]:
        """The sorted union of every rank's keys (gathered once: the set is fixed by the
        model and its configuration)."""
        local = sorted((site, operand, entry[2]) for (site, operand), entry in self._acc.items())
        if self._keys is None:
            union = set(local)
            if _distributed():
                gathered = [None] * torch.distributed.get_world_size(group)
                torch.distributed.all_gather_object(gathered, local, group=group)
                union = {tuple(k) for keys in gathered for k in keys}
            self._keys = sorted(union)
        return self._keys


def metrics(sums: List[float], maxima: List[float], fmt: str) -> Dict[str, float]:
    """The metrics of one (site, operand) from its reduced sufficient statistics."""
    s = dict(zip(SUM_FIELDS, sums))
    m = dict(zip(MAX_FIELDS, maxima))
    out = {"amax": m["amax"]}
    if s["nonfinite"] > 0:
        # NaN/Inf in the operand (or its quantized copy): the one fact worth reporting.
        out["nonfinite"] = 1.0
        return out
    if fmt == "none":
        return out
    signal, error = s["signal_sq"], s["error_sq"]
    out["saturated_pct"] = 100.0 * s["saturated"] / s["count"] if s["count"] else 0.0
    out["flushed_pct"] = 100.0 * s["flushed"] / s["nonzero"] if s["nonzero"] else 0.0
    if signal > 0:
        out["sqnr_db"] = math.inf if error == 0 else 10.0 * math.log10(signal / error)
        out["rel_error"] = math.sqrt(error / signal)
    kind = format_info(fmt).kind
    if kind == "mx" and m["scale_exp_max"] > -1e8:
        out["scale_exp_min"] = -m["neg_scale_exp_min"]
        out["scale_exp_max"] = m["scale_exp_max"]
    if kind == "nvfp4" and s["blocks"] > 0:
        out["block_scale_zero_pct"] = 100.0 * s["zero_scale_blocks"] / s["blocks"]
        out["block_scale_subnormal_pct"] = 100.0 * s["subnormal_scale_blocks"] / s["blocks"]
    for name in ("tensor_scale", "block_scale"):
        if m[f"{name}_max"] > -math.inf:
            out[f"{name}_min"] = -m[f"neg_{name}_min"]
            out[f"{name}_max"] = m[f"{name}_max"]
    if kind == "hifp8":
        total = sum(s[f"hifp8_{r}"] for r in HIFP8_REGIONS)
        for region in HIFP8_REGIONS:
            out[f"hifp8_{region}_pct"] = 100.0 * s[f"hifp8_{region}"] / total if total else 0.0
    return out


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
