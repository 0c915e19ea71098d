"""How a quantized operand was quantized, in both directions: from a GEMM report (the site's
config and the observer's extra keywords) to the capture metadata that describes it, and from
that metadata back to `megatron.quantization.gemm.quantize_operand`, which reproduces the
recorded q bit for bit (docs/capture-format.md, "Reproducing q").

The metadata fields besides `format`, `axis`, `scale_mode` and `saturate`:

    hifp8_scaling, hifp8_scale_exponent   HiFP8 with a per-tensor power-of-two scale
    stochastic_seed    int: the elements were stochastically rounded with a generator seeded so
    tensor_amax        float: the amax the NVFP4 / FP8 per-tensor scale came from (the imposed
                       one, e.g. delayed scaling's, or the operand's own)
    fp8_scaling        "tensor" (current), "delayed" (from tensor_amax) or "block"
    fp8_block          [1, 128] or [128, 128] (block scaling)
    fp8_margin, fp8_pow2_scale   the FP8 scale rule
    block_2d           bool: a weight quantized in 2-D tiles (NVFP4 16x16, FP8 128x128)
    nvfp4_4over6, nvfp4_4over6_bound   NVFP4 4/6: "mae" / "mse" and the tensor-scale bound
    row_scaled         bool: NVFP4 with one tensor amax per line along the block axis (no
                       tensor_amax is recorded then)
    rht_block, rht_seed   the operand went through the random Hadamard transform first: the
                       recorded tensor is the rotated (zero-padded) operand the GEMM quantized

`gemm.format_options` is the one place that turns a site's config into fake_quantize's format
options (block_2d, amax, scaling, block, margin, pow2_scale), as quantize_operand does; the
statistics use them to recompute an operand's scales.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.quantization.formats import format_info

FP8_SCALINGS = ("tensor", "delayed", "block")
_FP8_RECIPE_OF = {"tensor": "tensorwise", "delayed": "delayed", "block": "blockwise"}


def _as_float(value) -> float:
    """A 0-d tensor or number as a Python float (a float32 value stays exactly itself)."""
    if isinstance(value, torch.Tensor):
        return float(value.detach().to(torch.float32).cpu())
    return float(torch.tensor(float(value), dtype=torch.float32))


def own_amax(hp: torch.Tensor, fmt: str, options: dict) -> Optional[float]:
    """The tensor amax an NVFP4 or tensor-scaled FP8 operand's scale came from when none was
    imposed: max |hp| as the quantizer computes it (float32; NaN / Inf when hp holds them)."""
    kind = format_info(fmt).kind
    if kind == "nvfp4":
        if not hp.numel():
            return 0.0
        # NVFP4 rounds float64 to float32 first, then takes max |x| (NaN propagates).
        work = hp.detach().to(torch.float32) if hp.dtype == torch.float64 else hp.detach()
        low, high = torch.aminmax(work)
        return _as_float(torch.maximum(high, low.neg()).abs())
    if kind == "fp8" and options.get("scaling") == "tensor":
        from megatron.quantization.formats.fp8 import fp8_amax
        return _as_float(fp8_amax(hp))
    return None


def operand_metadata(config, fmt: str, hp: torch.Tensor, options: dict,
                     extra: dict) -> dict:
    """The metadata keys (see the module docstring) of a quantized operand in `fmt` whose
    format options are `options` (gemm.format_options) and whose GEMM report carried `extra`."""
    meta = {}
    kind = format_info(fmt).kind
    seed = extra.get("seed")
    if seed is not None:
        meta["stochastic_seed"] = int(seed)
    if kind == "nvfp4":
        meta["block_2d"] = bool(options.get("block_2d"))
        if options.get("four_over_six"):
            meta["nvfp4_4over6"] = options["four_over_six"]
            meta["nvfp4_4over6_bound"] = int(options.get("four_over_six_bound", 448))
        if options.get("row_scaled"):
            meta["row_scaled"] = True
    if kind == "fp8":
        block = options.get("block")
        if options.get("scaling") == "block":
            meta["fp8_scaling"] = "block"
            meta["fp8_block"] = list(block)
            meta["block_2d"] = tuple(block) == (128, 128)
            meta["fp8_margin"] = 0
        else:
            meta["fp8_scaling"] = "delayed" if extra.get("amax") is not None else "tensor"
            meta["fp8_margin"] = _plain_number(options.get("margin", 0))
            meta["block_2d"] = False
        meta["fp8_pow2_scale"] = bool(options.get("pow2_scale"))
    if (kind == "nvfp4" and not options.get("row_scaled")) or \
            (kind == "fp8" and options.get("scaling") == "tensor"):
        imposed = extra.get("amax")
        meta["tensor_amax"] = _as_float(imposed) if imposed is not None else \
            own_amax(hp, fmt, options)
    return meta


def _plain_number(value):
    value = float(value)
    return int(value) if value.is_integer() else value


def rotation_metadata(config, gemm: str) -> dict:
    """rht_block / rht_seed when `gemm`'s operands went through the Hadamard transform."""
    if gemm in config.rht.gemms:
        return {"rht_block": int(config.rht.block), "rht_seed": int(config.rht.seed)}
    return {}


# --------------------------------------------------------------------------------------------
# Back: metadata -> quantize_operand
# --------------------------------------------------------------------------------------------

def operand_config(metadata: dict):
    """A MatmulQuantConfig with which quantize_operand quantizes like the recorded operand
    (its scale rule, HiFP8 saturation and scaling, 2-D weight tiles, FP8 settings)."""
    from megatron.quantization.config import (
        Fp8Settings, HiFP8Settings, MatmulQuantConfig, MxSettings)

    fp8_scaling = metadata.get("fp8_scaling", "tensor")
    fp8 = Fp8Settings(recipe=_FP8_RECIPE_OF[fp8_scaling],
                      margin=int(metadata.get("fp8_margin", 0) or 0),
                      pow2_scale=bool(metadata.get("fp8_pow2_scale", False)))
    hifp8 = HiFP8Settings(
        scaling=metadata.get("hifp8_scaling", "none") if metadata.get("format") == "hifp8"
        else "none", saturate=bool(metadata.get("saturate", False)))
    return MatmulQuantConfig(mx=MxSettings(scale_mode=metadata.get("scale_mode") or "floor"),
                             hifp8=hifp8, weight_2d=bool(metadata.get("block_2d", False)),
                             fp8=fp8)


def operand_keywords(metadata: dict) -> dict:
    """quantize_operand's keywords for the recorded operand: weight (2-D tiles), amax (NVFP4,
    delayed FP8), seed (stochastic rounding), scale_exponent (scaled HiFP8)."""
    fmt = metadata.get("format", "none")
    kind = format_info(fmt).kind
    keywords = {}
    if metadata.get("block_2d"):
        keywords["weight"] = True
    if metadata.get("tensor_amax") is not None and (
            kind == "nvfp4" or (kind == "fp8" and metadata.get("fp8_scaling") == "delayed")):
        keywords["amax"] = float(metadata["tensor_amax"])
    if metadata.get("stochastic_seed") is not None:
        keywords["seed"] = int(metadata["stochastic_seed"])
    if kind == "nvfp4":
        keywords.update(_nvfp4_variant(metadata))
    if fmt == "hifp8" and metadata.get("hifp8_scaling") == "tensor" and \
            metadata.get("hifp8_scale_exponent") is not None:
        keywords["scale_exponent"] = int(metadata["hifp8_scale_exponent"])
    return keywords


def _nvfp4_variant(metadata: dict) -> dict:
    """fake_quantize's NVFP4 variant options of a recorded operand."""
    variant = {}
    if metadata.get("nvfp4_4over6"):
        variant["four_over_six"] = metadata["nvfp4_4over6"]
        variant["four_over_six_bound"] = int(metadata.get("nvfp4_4over6_bound", 448))
    if metadata.get("row_scaled"):
        variant["row_scaled"] = True
    return variant


def stats_options(metadata: dict) -> dict:
    """The fake_quantize format options of a recorded operand (for its statistics)."""
    fmt = metadata.get("format", "none")
    kind = format_info(fmt).kind
    if kind == "nvfp4":
        amax = metadata.get("tensor_amax")
        return {"block_2d": bool(metadata.get("block_2d", False)),
                "amax": None if amax is None else float(amax), **_nvfp4_variant(metadata)}
    if kind == "fp8":
        scaling = metadata.get("fp8_scaling", "tensor")
        if scaling == "block":
            return {"scaling": "block", "block": tuple(metadata.get("fp8_block") or (1, 128)),
                    "pow2_scale": bool(metadata.get("fp8_pow2_scale", False))}
        amax = metadata.get("tensor_amax") if scaling == "delayed" else None
        return {"scaling": "tensor", "amax": None if amax is None else float(amax),
                "margin": metadata.get("fp8_margin", 0) or 0,
                "pow2_scale": bool(metadata.get("fp8_pow2_scale", False))}
    return {}


def requantize(tensor: torch.Tensor, metadata: dict,
               device: Optional[torch.device] = None) -> torch.Tensor:
    """q of a recorded operand rebuilt from its high-precision tensor and metadata with
    quantize_operand (bit for bit the recorded `quantized`). Stochastically rounded operands
    draw their bits from a generator of the device they run on: pass `device` of the kind the
    capture ran on (its tensor_info.device) to redraw a GPU capture's bits."""
    from megatron.quantization.gemm import quantize_operand

    source = tensor.device
    if device is not None:
        tensor = tensor.to(device)
    q = quantize_operand(tensor, metadata["format"], int(metadata["axis"]),
                         operand_config(metadata), **operand_keywords(metadata))
    return q.to(source)

