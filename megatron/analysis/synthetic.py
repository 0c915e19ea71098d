"""Synthetic capture directories that follow docs/capture-format.md exactly (tests, benchmarks).

`write_capture(root, quant_types, ...)` writes, per quant type, a run file, one manifest, a
summary and full-mode record files for a small transformer-shaped set of GEMM operands:
linear layers (input / weight / grad_output and their wgrad/dgrad re-quantized copies, plus
unquantized outputs and gradients) and core attention (query, key, probs, value, grad_scores).
Quantized copies come from the format library's `fake_quantize` with the record's own axis,
scale mode and saturation, so records are what a training run would write. Values are drawn
with heavy tails, per-layer scales, occasional outliers and exact zeros so that saturation,
flushing and HiF8's regions are all exercised.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Role:
    tensor_name: str
    operation: str
    phase: str
    gemm: str
    operand: str
    shape: str          # symbolic: "TK", "NK", "TN", "MK", "MN", "attn_q", ...
    axis: Optional[int]  # block axis when quantized (None: result, never quantized)
    kind: str           # act | weight | grad


LINEAR_ROLES = (
    Role("input", "forward", "pre", "fprop", "input", "TK", 2, "act"),
    Role("weight", "forward", "pre", "fprop", "weight", "NK", 1, "weight"),
    Role("output", "forward", "post", "fprop", "output", "TN", None, "act"),
    Role("grad_output", "backward", "pre", "dgrad", "grad_output", "TN", 2, "grad"),
    Role("weight_dgrad", "backward", "pre", "dgrad", "weight", "NK", 0, "weight"),
    Role("grad_input", "backward", "post", "dgrad", "grad_input", "TK", None, "grad"),
    Role("grad_output_wgrad", "backward", "pre", "wgrad", "grad_output", "MN", 0, "grad"),
    Role("input_wgrad", "backward", "pre", "wgrad", "input", "MK", 0, "act"),
    Role("grad_weight", "backward", "post", "wgrad", "grad_weight", "NK", None, "grad"),
)
ATTENTION_ROLES = (
    Role("query", "forward", "pre", "fprop", "a", "Q", 2, "act"),
    Role("key", "forward", "pre", "fprop", "b", "KT", 1, "act"),
    Role("scores", "forward", "post", "fprop", "output", "S", None, "act"),
    Role("grad_scores", "backward", "pre", "dgrad", "grad_output", "S", 2, "grad"),
    Role("probs", "forward", "pre", "fprop", "a", "S", 2, "prob"),
    Role("value", "forward", "pre", "fprop", "b", "V", 1, "act"),
)
_PV = {"probs", "value"}
LINEAR_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def scheme_formats(quant_type: str) -> Tuple[str, str]:
    """(linear format, attention format) of a scheme name ('none' where not quantized)."""
    if quant_type == "bf16" or "_" not in quant_type:
        return "none", "none"
    prefix, fmt = quant_type.rsplit("_", 1)
    fmt = {"mxfp8": "mxfp8_e4m3"}.get(fmt, fmt)
    return (fmt if "linear" in prefix else "none"), (fmt if "FA" in prefix else "none")


def _shape(symbol: str, dims: Dict[str, int], module: str) -> Tuple[int, ...]:
    s, b, h = dims["seq"], dims["batch"], dims["hidden"]
    n_out = {"linear_qkv": 2 * h, "linear_proj": h, "linear_fc1": dims["ffn"],
             "linear_fc2": h}.get(module, h)
    k_in = {"linear_fc2": dims["ffn"]}.get(module, h)
    g, r, d = dims["groups"], dims["heads"] // dims["groups"], h // dims["heads"]
    table = {
        "TK": (s, b, k_in), "TN": (s, b, n_out), "NK": (n_out, k_in), "MK": (s * b, k_in),
        "MN": (s * b, n_out), "Q": (b * g, r * s, d), "KT": (b * g, d, s),
        "S": (b * g, r * s, s), "V": (b * g, s, d),
    }
    return table[symbol]


def _values(role: Role, shape, layer: int, gen: torch.Generator) -> torch.Tensor:
    """Heavy-tailed values with role-typical magnitudes, a few outliers and exact zeros."""
    n = 1
    for size in shape:
        n *= size
    if role.kind == "prob":
        logits = torch.randn(shape, generator=gen) * 3.0
        return torch.softmax(logits, dim=-1)
    scale = {"act": 1.0 * (1.5 ** layer), "weight": 0.02, "grad": 1e-4 / (2.0 ** layer)}[role.kind]
    # Student-t-like tails: normal / sqrt(chi2 / nu) with nu = 4.
    normal = torch.randn(shape, generator=gen)
    chi = torch.randn((4,) + tuple(shape), generator=gen).pow(2).mean(0).clamp_min(1e-3)
    x = normal / chi.sqrt() * scale
    flat = x.view(-1)
    k = max(1, n // 4096)
    idx = torch.randint(0, n, (k,), generator=gen)
    flat[idx] = flat[idx] * 200.0                 # outliers: saturate MX blocks, HiF8 mant1
    idx = torch.randint(0, n, (k,), generator=gen)
    flat[idx] = 0.0                               # exact zeros
    idx = torch.randint(0, n, (k,), generator=gen)
    flat[idx] = flat[idx] * 1e-6                  # tiny values: flushed by MX blocks
    return x


def _tensor_stats(x: torch.Tensor, q: Optional[torch.Tensor], fmt: str, axis, scale_mode):
    """tensor_info / quant_error as the capture writer computes them."""
    from megatron.tensor_capture.stats import quant_error, tensor_info

    info = tensor_info(x)
    err = quant_error(x, q, fmt, axis, scale_mode) if q is not None else None
    return info, err


def _json_safe(value):
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def write_capture(root: str, quant_types: Sequence[str] = ("bf16", "FA_linear_mxfp8"),
                  layers: int = 2, iterations: Iterable[int] = (1,), micro_batches: int = 1,
                  seq: int = 16, batch: int = 2, hidden: int = 64, ffn: int = 128,
                  heads: int = 4, groups: int = 2, dtype: torch.dtype = torch.bfloat16,
                  scale_mode: str = "floor", seed: int = 0, run_id: str = "20260101_000000",
                  reuse_tensors: bool = False, modules: Sequence[str] = LINEAR_MODULES,
                  attention: bool = True) -> Dict[str, List[str]]:
    """Write a full-mode capture under `root`; returns {quant_type: [record paths]}.

    `reuse_tensors` draws each (layer, module, role) once and saves it for every iteration
    and micro-batch (fast generation of large captures for benchmarks).
    """
    from megatron.quantization.formats import fake_quantize

    dims = dict(seq=seq, batch=batch, hidden=hidden, ffn=ffn, heads=heads, groups=groups)
    written: Dict[str, List[str]] = {}
    for quant_type in quant_types:
        directory = os.path.join(root, quant_type)
        os.makedirs(directory, exist_ok=True)
        lin_fmt, attn_fmt = scheme_formats(quant_type)
        run = {"format_version": FORMAT_VERSION, "run_id": run_id, "quant_type": quant_type,
               "mode": "full", "control_iter": max(iterations), "collect_micro_batches":
               micro_batches, "world_size": 1, "args": {"num_layers": layers,
                                                        "hidden_size": hidden},
               "quant_config": f"synthetic capture, linear={lin_fmt}, attention={attn_fmt}",
               "start_time": datetime(2026, 1, 1).isoformat()}
        with open(os.path.join(directory, f"run-{run_id}.json"), "w") as f:
            json.dump(run, f)
        gen = torch.Generator().manual_seed(seed)
        cache: Dict[tuple, tuple] = {}
        counter = 0
        paths = []
        total = 0
        manifest_path = os.path.join(directory, f"manifest-{run_id}-rank00000.jsonl")
        with open(manifest_path, "w") as manifest:
            for iteration in iterations:
                for mb in range(micro_batches):
                    for layer in range(1, layers + 1):
                        sites = [(m, "linear", LINEAR_ROLES, lin_fmt) for m in modules]
                        if attention:
                            sites.append(("core_attention", "attention", ATTENTION_ROLES,
                                          attn_fmt))
                        for module, component, roles, fmt in sites:
                            for role in roles:
                                key = (layer, module, role.tensor_name)
                                if reuse_tensors and key in cache:
                                    x, q, meta_fmt, info, err = cache[key]
                                else:
                                    shape = _shape(role.shape, dims, module)
                                    x = _values(role, shape, layer, gen).to(dtype)
                                    # PV stays high precision in FA_ schemes (QK^T only).
                                    quantized = (fmt != "none" and role.axis is not None
                                                 and role.tensor_name not in _PV)
                                    meta_fmt = fmt if quantized else "none"
                                    saturate = True if meta_fmt == "hifp8" else None
                                    q = (fake_quantize(x, meta_fmt, axis=role.axis,
                                                       scale_mode=scale_mode, saturate=saturate)
                                         if quantized else None)
                                    info, err = _tensor_stats(x, q, meta_fmt, role.axis,
                                                              scale_mode)
                                    cache[key] = (x, q, meta_fmt, info, err)
                                counter += 1
                                path, nbytes = _write_record(
                                    directory, run_id, counter, quant_type, layer, module,
                                    component, role, iteration, mb, x, q, meta_fmt, info, err,
                                    scale_mode)
                                meta = _metadata(run_id, counter, quant_type, layer, module,
                                                 component, role, iteration, mb, meta_fmt,
                                                 scale_mode)
                                line = {"format_version": FORMAT_VERSION,
                                        "file": os.path.basename(path), "bytes": nbytes,
                                        "metadata": meta, "tensor_info": info,
                                        "quant_error": err}
                                manifest.write(json.dumps(_json_safe(line)) + "\n")
                                paths.append(path)
                                total += nbytes
        summary = {"records": counter, "files": counter, "bytes": total, "write_seconds": 0.0,
                   "stall_seconds": 0.0, "dropped": 0, "error": None,
                   "end_time": datetime(2026, 1, 1, 0, 1).isoformat()}
        with open(os.path.join(directory, f"summary-{run_id}-rank00000.json"), "w") as f:
            json.dump(summary, f)
        written[quant_type] = paths
    return written


def _metadata(run_id, counter, quant_type, layer, module, component, role, iteration, mb,
              fmt, scale_mode):
    path = (f"decoder.layers.{layer - 1}.self_attention.core_attention" if component ==
            "attention" else f"decoder.layers.{layer - 1}.mlp.{module}")
    meta = {
        "layer_type": component, "layer_idx": layer, "module": path,
        "operation": role.operation, "phase": role.phase,
        "component": "FA" if component == "attention" else "linear",
        "quant_type": quant_type, "tensor_name": role.tensor_name, "gemm": role.gemm,
        "operand": role.operand, "iteration": iteration, "micro_batch": mb, "rank": 0,
        "tp_rank": 0, "pp_rank": 0, "dp_rank": 0, "world_size": 1,
        "save_time": datetime(2026, 1, 1).isoformat(), "run_id": run_id, "counter": counter,
        "format": fmt, "axis": role.axis,
    }
    if fmt != "none":
        meta["scale_mode"] = scale_mode
        if fmt == "hifp8":
            meta["saturate"] = True
    return meta


def _write_record(directory, run_id, counter, quant_type, layer, module, component, role,
                  iteration, mb, x, q, fmt, info, err, scale_mode):
    layer_type = "attention" if component == "attention" else "linear"
    tag = "FA" if component == "attention" else "linear"
    name = (f"{run_id}_{counter:06d}_{layer_type}_L{layer}_{role.operation}_{role.phase}_{tag}_"
            f"{quant_type}_{role.tensor_name}_{module}_it{iteration}_mb{mb}.pt")
    record = {"format_version": FORMAT_VERSION, "tensor": x, "tensor_info": info,
              "metadata": _metadata(run_id, counter, quant_type, layer, module, component, role,
                                    iteration, mb, fmt, scale_mode)}
    if q is not None:
        record["quantized"] = q
        record["quant_error"] = err
    path = os.path.join(directory, name)
    tmp = path + ".tmp"
    torch.save(record, tmp)
    os.replace(tmp, path)
    return path, os.path.getsize(path)
