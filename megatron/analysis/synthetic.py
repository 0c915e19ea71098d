"""Synthetic capture directories that follow docs/capture-format.md exactly (tests, benchmarks).

`write_capture(root, quant_schemes, ...)` writes, per scheme, a run file, one manifest, a
summary and full-mode record files for a small transformer-shaped set of GEMM operands:
linear layers (input / weight / grad_output and their wgrad/dgrad re-quantized copies, plus
unquantized outputs and gradients) and core attention (query, key, probs, value, grad_scores).
Quantized copies come from the format library's `fake_quantize` with the record's own axis,
scale mode and saturation, so records are what a training run would write; as in training,
the copies a backward GEMM re-quantizes (`*_dgrad`, `*_wgrad`) exist only where that GEMM
quantizes. Values are drawn with heavy tails, per-layer scales, occasional outliers and exact
zeros so that saturation, flushing and HiF8's regions are all exercised. With
`hifp8_scaling="tensor"`, HiF8 operands are quantized with one per-tensor power-of-two scale
(`hifp8_scaled_fake_quantize`) and carry the metadata keys `hifp8_scaling` and
`hifp8_scale_exponent`, as training writes them.

NVFP4, MXFP6 and FP8 schemes (`linear_nvfp4`, `FA_linear_mxfp6_e2m3`, `linear_fp8`, ...) are
quantized as training quantizes them, through megatron.quantization.gemm.quantize_operand, and
carry the same metadata (megatron.tensor_capture.replay): `fp8_recipe` picks FP8's scaling
(`tensorwise`, `delayed` -- the scale from an amax of 3/4 of the tensor's own, so that the
values above it saturate, as a tensor that outgrew its history does -- or `blockwise`),
`weight_2d` quantizes NVFP4 / FP8-blockwise weights in 2-D tiles, `stochastic` rounds the
gradient operands stochastically (seeded, with `stochastic_seed` in the metadata). FP8 schemes
quantize in E4M3 (fp8_e4m3). Their records also hold the operand's scales (`scales`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron.quantization.formats import (canonical_format, fake_quantize, format_info,
                                          hifp8_scale_exponent, hifp8_scaled_fake_quantize)
from megatron.quantization.config import (
    FP8_SCALINGS, Fp8Settings, MatmulQuantConfig, MxSettings)
from megatron.quantization.gemm import format_options, quantize_operand
from megatron.quantization.config import scheme_formats as scheme_site_formats
from megatron.tensor_capture import format as capture_format
from megatron.tensor_capture.replay import operand_metadata, own_amax
from megatron.tensor_capture.roles import role_for
from megatron.tensor_capture.stats import block_scales, quant_error, tensor_info

FP8_RECIPES = FP8_SCALINGS


@dataclass(frozen=True)
class Role:
    """One synthetic operand: its GEMM report (names come from the capture's role tables) and
    how its values are drawn."""

    site_kind: str       # linear | attn_qk | attn_pv
    gemm: str
    operand: str
    shape: str           # symbolic: "TK", "NK", "TN", "MK", "MN", "Q", "KT", "S", "V"
    axis: Optional[int]  # block axis when quantized (None: result, never quantized)
    kind: str            # act | weight | grad | prob

    @property
    def _capture_role(self):
        return role_for(self.site_kind, self.gemm, self.operand)

    @property
    def tensor_name(self) -> str:
        return self._capture_role.tensor_name

    @property
    def operation(self) -> str:
        return self._capture_role.operation

    @property
    def phase(self) -> str:
        return self._capture_role.phase


LINEAR_ROLES = (
    Role("linear", "fprop", "input", "TK", 2, "act"),
    Role("linear", "fprop", "weight", "NK", 1, "weight"),
    Role("linear", "fprop", "output", "TN", None, "act"),
    Role("linear", "dgrad", "grad_output", "TN", 2, "grad"),
    Role("linear", "dgrad", "weight", "NK", 0, "weight"),
    Role("linear", "dgrad", "grad_input", "TK", None, "grad"),
    Role("linear", "wgrad", "grad_output", "MN", 0, "grad"),
    Role("linear", "wgrad", "input", "MK", 0, "act"),
    Role("linear", "wgrad", "grad_weight", "NK", None, "grad"),
)
ATTENTION_ROLES = (
    Role("attn_qk", "fprop", "a", "Q", 2, "act"),
    Role("attn_qk", "fprop", "b", "KT", 1, "act"),
    Role("attn_qk", "fprop", "output", "S", None, "act"),
    Role("attn_qk", "dgrad", "grad_output", "S", 2, "grad"),
    Role("attn_pv", "fprop", "a", "S", 2, "prob"),
    Role("attn_pv", "fprop", "b", "V", 1, "act"),
)
LINEAR_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def scheme_formats(quant_scheme: str) -> Tuple[str, str]:
    """(linear format, attention QK^T format) of a scheme name, canonical ('none' where not
    quantized)."""
    linear, attention = scheme_site_formats(quant_scheme)
    return tuple(fmt if fmt == "none" else canonical_format("fp8_e4m3" if fmt == "fp8" else fmt)
                 for fmt in (linear, attention))


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


def write_capture(root: str, quant_schemes: Sequence[str] = ("bf16", "FA_linear_mxfp8"),
                  layers: int = 2, iterations: Iterable[int] = (1,), micro_batches: int = 1,
                  seq: int = 16, batch: int = 2, hidden: int = 64, ffn: int = 128,
                  heads: int = 4, groups: int = 2, dtype: torch.dtype = torch.bfloat16,
                  scale_mode: str = "floor", seed: int = 0, run_id: str = "20260101_000000",
                  reuse_tensors: bool = False, modules: Sequence[str] = LINEAR_MODULES,
                  attention: bool = True, hifp8_scaling: str = "none",
                  run_args: Optional[dict] = None, fp8_recipe: str = "tensorwise",
                  weight_2d: bool = False, stochastic: bool = False) -> Dict[str, List[str]]:
    """Write a full-mode capture under `root`; returns {quant_scheme: [record paths]}.

    `reuse_tensors` draws each (layer, module, role) once and saves it for every iteration
    and micro-batch (fast generation of large captures for benchmarks). `hifp8_scaling`:
    "none" or "tensor" (per-tensor scaled HiF8 operands). `run_args` are added to the run
    file's `args` (the training flags a real run records). `fp8_recipe`, `weight_2d` and
    `stochastic`: see the module docstring.
    """
    if hifp8_scaling not in ("none", "tensor"):
        raise ValueError(f"hifp8_scaling must be 'none' or 'tensor', got {hifp8_scaling!r}")
    if fp8_recipe not in FP8_RECIPES:
        raise ValueError(f"fp8_recipe must be one of {', '.join(FP8_RECIPES)}, got "
                         f"{fp8_recipe!r}")
    recipe = _Recipe(MatmulQuantConfig(mx=MxSettings(scale_mode=scale_mode), weight_2d=weight_2d,
                                       fp8=Fp8Settings(recipe=fp8_recipe)), stochastic)
    iterations = tuple(iterations)
    dims = dict(seq=seq, batch=batch, hidden=hidden, ffn=ffn, heads=heads, groups=groups)
    written: Dict[str, List[str]] = {}
    for scheme in quant_schemes:
        directory = os.path.join(root, scheme)
        os.makedirs(directory, exist_ok=True)
        lin_fmt, attn_fmt = scheme_formats(scheme)
        run = {"format_version": capture_format.FORMAT_VERSION, "run_id": run_id,
               capture_format.SCHEME_KEY: scheme, "mode": "full",
               "control_iter": max(iterations), "collect_micro_batches": micro_batches,
               "world_size": 1,
               "args": {"num_layers": layers, "hidden_size": hidden, **(run_args or {})},
               "quant_config": f"synthetic capture, linear={lin_fmt}, attention={attn_fmt}",
               "start_time": datetime(2026, 1, 1).isoformat()}
        with open(capture_format.run_file(directory, run_id), "w") as f:
            f.write(capture_format.json_line(run))
        gen = torch.Generator().manual_seed(seed)
        cache: Dict[tuple, tuple] = {}
        counter = 0
        paths = []
        total = 0
        with open(capture_format.manifest_file(directory, run_id, 0), "w") as manifest:
            for iteration in iterations:
                for mb in range(micro_batches):
                    for layer in range(1, layers + 1):
                        sites = [(m, "linear", LINEAR_ROLES, lin_fmt) for m in modules]
                        if attention:
                            sites.append(("core_attention", "attention", ATTENTION_ROLES,
                                          attn_fmt))
                        for module, component, roles, fmt in sites:
                            for role in roles:
                                if _requantized_copy(role) and not _quantized(role, fmt):
                                    continue     # recorded only when its GEMM quantizes it
                                key = (layer, module, role.tensor_name)
                                if reuse_tensors and key in cache:
                                    x, q, meta_fmt, info, err, k, how = cache[key]
                                else:
                                    x, q, meta_fmt, info, err, k, how = _operand(
                                        role, dims, module, layer, gen, dtype, fmt, scale_mode,
                                        hifp8_scaling, recipe, counter)
                                    cache[key] = (x, q, meta_fmt, info, err, k, how)
                                counter += 1
                                meta = _metadata(run_id, counter, scheme, layer, module,
                                                 component, role, iteration, mb, meta_fmt,
                                                 scale_mode, k, how)
                                path = _write_record(directory, run_id, counter, module, meta,
                                                     x, q, info, err, how)
                                nbytes = os.path.getsize(path)
                                manifest.write(capture_format.json_line(
                                    capture_format.manifest_entry(os.path.basename(path),
                                                                  nbytes, meta, info, err)))
                                paths.append(path)
                                total += nbytes
        summary = {"records": counter, "files": counter, "bytes": total, "write_seconds": 0.0,
                   "stall_seconds": 0.0, "dropped": 0, "error": None,
                   "end_time": datetime(2026, 1, 1, 0, 1).isoformat()}
        with open(capture_format.summary_file(directory, run_id, 0), "w") as f:
            f.write(capture_format.json_text(summary))
        written[scheme] = paths
    return written


def _quantized(role: Role, fmt: str) -> bool:
    # PV stays high precision in FA_ schemes (QK^T only).
    return fmt != "none" and role.axis is not None and role.site_kind != "attn_pv"


def _requantized_copy(role: Role) -> bool:
    """An operand a backward GEMM quantizes again (`input_wgrad`, `weight_dgrad`, ...)."""
    return role.tensor_name.endswith(("_dgrad", "_wgrad"))


@dataclass(frozen=True)
class _Recipe:
    config: MatmulQuantConfig      # weight_2d and the FP8 settings of every site
    stochastic: bool               # SR of the gradient operands


@dataclass
class _How:
    """How an NVFP4 / FP8 / stochastically rounded operand was quantized: its metadata keys
    (replay.operand_metadata) and format options."""

    metadata: dict
    options: dict


def _recipe_quantize(x, role: Role, fmt: str, recipe: _Recipe, counter: int):
    """(q, _How) of an operand quantized as a training run with `recipe` would."""
    config, kind = recipe.config, format_info(fmt).kind
    extra = {}
    if role.kind == "weight" and config.weight_tiles(fmt):
        extra["weight"] = True
    if kind == "fp8" and config.fp8.scaling == "delayed":
        # A history 3/4 of the tensor's own amax: the top quarter saturates.
        amax = own_amax(x, fmt, {"scaling": "tensor"})
        extra["amax"] = torch.tensor(0.75 * amax, dtype=torch.float32)
    if recipe.stochastic and role.kind == "grad" and kind in ("mx", "nvfp4", "fp8"):
        extra["seed"] = 1000 + counter
    options = format_options(config, fmt, x.dim(), weight=bool(extra.get("weight")),
                               amax=None if "amax" not in extra else float(extra["amax"]))
    q = quantize_operand(x, fmt, role.axis, config, **extra)
    metadata = operand_metadata(config, fmt, x, options, extra)
    if "seed" in extra:
        options["stochastic"] = True
    return q, _How(metadata, options)


def _operand(role: Role, dims, module, layer, gen, dtype, fmt, scale_mode, hifp8_scaling,
             recipe: _Recipe, counter: int):
    """(x, quantized x or None, its format, tensor_info, quant_error, HiF8 scale exponent k or
    None, _How or None) of one operand."""
    x = _values(role, _shape(role.shape, dims, module), layer, gen)
    quantized = _quantized(role, fmt)
    meta_fmt = fmt if quantized else "none"
    if meta_fmt == "nvfp4" and role.kind == "grad":
        # Rows of nearly vanished gradient (masked tokens): blocks whose E4M3 scale is
        # subnormal (x 1e-3) or rounds to zero (x 1e-6) next to the tensor's amax.
        flat = x.view(-1)
        n = flat.numel()
        flat[: n // 8] *= 1e-3
        flat[n // 8: n // 8 + n // 16] *= 1e-6
    x = x.to(dtype)
    k = how = None
    if meta_fmt == "hifp8" and hifp8_scaling == "tensor":
        k = int(hifp8_scale_exponent(x))
        q = hifp8_scaled_fake_quantize(x)
    elif quantized and (format_info(meta_fmt).kind in ("nvfp4", "fp8") or recipe.stochastic):
        q, how = _recipe_quantize(x, role, meta_fmt, recipe, counter)
    elif quantized:
        q = fake_quantize(x, meta_fmt, axis=role.axis, scale_mode=scale_mode,
                          saturate=True if meta_fmt == "hifp8" else None)
    else:
        q = None
    info = tensor_info(x)
    err = quant_error(x, q, meta_fmt, role.axis, scale_mode, hifp8_scale_exponent=k,
                      options=how.options if how else None) if q is not None else None
    return x, q, meta_fmt, info, err, k, how


def _metadata(run_id, counter, scheme, layer, module, component, role, iteration, mb,
              fmt, scale_mode, hifp8_k=None, how: Optional[_How] = None):
    path = (f"decoder.layers.{layer - 1}.self_attention.core_attention" if component ==
            "attention" else f"decoder.layers.{layer - 1}.mlp.{module}")
    meta = {
        "layer_type": component, "layer_idx": layer, "module": path,
        "operation": role.operation, "phase": role.phase,
        "component": "FA" if component == "attention" else "linear",
        capture_format.SCHEME_KEY: scheme, "tensor_name": role.tensor_name, "gemm": role.gemm,
        "operand": role.operand, "iteration": iteration, "micro_batch": mb, "rank": 0,
        "tp_rank": 0, "pp_rank": 0, "dp_rank": 0, "world_size": 1,
        "save_time": datetime(2026, 1, 1).isoformat(), "run_id": run_id, "counter": counter,
        "format": fmt, "axis": role.axis,
    }
    if fmt != "none":
        meta["scale_mode"] = scale_mode
        if fmt == "hifp8":
            meta["saturate"] = True
            meta["hifp8_scaling"] = "none" if hifp8_k is None else "tensor"
            if hifp8_k is not None:
                meta["hifp8_scale_exponent"] = hifp8_k
        if how is not None:
            meta.update(how.metadata)
    return meta


def _write_record(directory, run_id, counter, module, meta, x, q, info, err,
                  how: Optional[_How] = None) -> str:
    path = os.path.join(directory, capture_format.record_file_name(run_id, counter, meta, module))
    tmp = path + ".tmp"
    scales = block_scales(x, meta["format"], meta["axis"], how.options) if how else None
    torch.save(capture_format.record_dict(x, info, meta, q, err, scales), tmp)
    os.replace(tmp, path)
    return path
