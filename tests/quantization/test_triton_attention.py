"""The fused quantized-attention kernels (megatron/quantization/kernels/attention.py) against
eager fake_quantize and the chunked path (_ChunkedAttention).

The kernels run under Triton's CPU interpreter. TRITON_INTERPRET must be set before triton is
first imported, so every kernel run happens in one subprocess (this file run as a script),
which prints one JSON line of measurements; the tests below read it. This process never
imports triton.

Inputs. "exact" inputs hold small integers (|x| <= 15): their MX quantizations are integers or
multiples of 2**-2, so S = Q K^T and dP = dO V^T are exact in fp32 whatever the summation order,
and the kernels and the chunked path see the same scores; what remains different is exp, the
softmax sum's order and the fp32 accumulation order of the GEMMs whose operands are P or dS.
Their S have more significant bits than bf16 keeps, so a missing rounding of S (or of
S * scale) shows. "wide" inputs are exact ones with scores over hundreds of units (P down to
fp32 subnormals and zeros). "random" inputs are Gaussian (every GEMM inexact).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from interpreted import require_interpreter, run_interpreted
from conftest import REPO_ROOT, child_env

G_GROUPS = 2
SHAPES = {                     # sq, sk, d, dv, query heads per group (KV head)
    "sq64": (64, 64, 32, 32, 2),
    "sq80": (80, 80, 32, 32, 2),      # key tail block of 16; row blocks 64..95 span two heads
    "sk>sq": (64, 80, 32, 40, 2),     # dv not a power of two
    "tails": (72, 100, 32, 32, 2),    # R = 144: a row tail block of 16; a key tail block of 4
    "blind": (80, 48, 32, 32, 2),     # queries 0..31 see no key: spread evenly over all keys
    "gqa4": (24, 40, 64, 64, 4),      # sq < 32: every row block and tile spans heads
    "d80": (56, 56, 80, 80, 2),       # head dim padded to 128; R = 112: a tail tile of 48 rows
    "d128": (48, 80, 128, 96, 2),     # dv padded to 128
}
# (query rows, keys) of each kernel under the interpreter (INTERPRETER_TILES) per case.
TILES = {
    "tile": None,               # the default: one tile shape for the three kernels
    # small tiles: at these lengths only they give causal query tiles whose every row sees
    # a whole key tile (the forward's and the dQ kernel's unmasked loops)
    "32x32": dict.fromkeys(("forward", "query", "key"), (32, 32)),
    # as on an H100: the forward's and the dQ kernel's tile, and another one for the dK/dV
    # kernel, which must still recompute the forward's P and the dQ kernel's dS bit for bit
    # (for exact inputs only: numpy's matmul sums inexact products in an order that depends
    # on the tile shape, a GPU's tensor cores do not)
    "gpu": {"forward": (128, 64), "query": (128, 64), "key": (32, 128)},
}
# (P along keys, P along rows, dS along keys, dS along rows, operands outside, grads outside,
#  qk scale mode, pv scale mode)
FORMATS = {
    "mxfp8": ("mxfp8_e4m3", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp8_e5m2", "mxfp8_e4m3",
              "mxfp8_e5m2", "floor", "floor"),
    "mxfp4": ("mxfp4", "mxfp4", "mxfp4", "mxfp4", "mxfp4", "mxfp4", "rceil", "rceil"),
    "none": ("none",) * 6 + ("floor", "floor"),
    "mixed": ("mxfp6_e2m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp4", "mxfp8_e4m3", "mxfp6_e3m2",
              "rceil", "floor"),
}
# (shape, formats, causal, inputs, tiles): every case runs in float32 and bf16.
CASES = [
    ("sq64", "mxfp8", True, "exact", "tile"),
    ("sq64", "none", False, "exact", "tile"),
    ("sq80", "mxfp4", True, "exact", "tile"),
    ("sq80", "mxfp8", False, "exact", "tile"),
    ("sk>sq", "mixed", True, "exact", "tile"),
    ("sk>sq", "none", True, "exact", "tile"),
    ("tails", "mxfp8", True, "exact", "tile"),
    ("tails", "mxfp4", False, "exact", "tile"),
    ("blind", "mxfp8", True, "exact", "tile"),
    ("sq80", "mxfp8", True, "random", "tile"),
    ("sq80", "none", True, "random", "tile"),
    ("tails", "mixed", True, "random", "tile"),
    ("sq64", "mxfp8", True, "wide", "tile"),
    ("tails", "mxfp8", True, "pow2", "tile"),
    ("gqa4", "mxfp8", True, "random", "tile"),
    ("d80", "mixed", False, "random", "tile"),
    ("d128", "mxfp4", True, "random", "tile"),
    ("sq64", "mixed", True, "exact", "32x32"),
    ("tails", "mxfp8", True, "exact", "gpu"),
    ("d80", "mxfp4", True, "exact", "gpu"),
]
# Causal cases that also run visiting every tile (skip_masked_tiles=False), which must give
# the same bits: the first of each shape and tile choice, in bf16 (skipping is the same
# integer logic in both dtypes and for any inputs that meet its assumption).
SKIP_CHECKED = list({(shape, tiles): (shape, fmts, causal, inputs, tiles)
                     for shape, fmts, causal, inputs, tiles in reversed(CASES) if causal}.values())
DTYPE_NAMES = ("float32", "bfloat16")
OUTPUTS = ("out", "grad_q", "grad_k_t", "grad_v")

# Largest difference from the chunked path, in units in the last place of the largest |value|
# of each reference output (see test_results_match_the_chunked_path for where they come from).
TOLERANCE_ULPS = {"float32": 16, "bfloat16": 2}
TOLERANCE_ULPS_ONE_CHUNK = {"float32": 16, "bfloat16": 1}


def case_name(shape, fmts, causal, inputs, tiles, dtype_name):
    return f"{shape} {fmts} {'causal' if causal else 'nomask'} {inputs} {tiles} {dtype_name}"


# ---------------------------------------------------------------------------------------------
# The subprocess
# ---------------------------------------------------------------------------------------------

def _configs(name):
    from megatron.quantization.config import MatmulQuantConfig, MxSettings, OperandFormats
    p, p_rows, ds, ds_rows, operands, grads, qk_mode, pv_mode = FORMATS[name]
    qk = MatmulQuantConfig(fprop=OperandFormats(operands, operands),
                           dgrad=OperandFormats(ds, operands),
                           wgrad=OperandFormats(operands, ds_rows),
                           mx=MxSettings(scale_mode=qk_mode))
    pv = MatmulQuantConfig(fprop=OperandFormats(p, operands), dgrad=OperandFormats(grads, operands),
                           wgrad=OperandFormats(p_rows, grads), mx=MxSettings(scale_mode=pv_mode))
    return qk, pv


def _inputs(shape, kind, dtype, seed):
    """q [G, R, d], k_t [G, d, sk], v [G, sk, dv], dO [G, R, dv] and the softmax scale."""
    import torch
    sq, sk, d, dv, heads = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    rows = heads * sq
    sizes = ((G_GROUPS, rows, d), (G_GROUPS, d, sk), (G_GROUPS, sk, dv), (G_GROUPS, rows, dv))
    if kind == "random":
        q, k_t, v, grad = (torch.randn(s, generator=g) for s in sizes)
        scale = d ** -0.5
    else:
        q, k_t, v, grad = (torch.randint(-15, 16, s, generator=g).float() for s in sizes)
        # "wide": scores over hundreds of units, so P spans every binade down to fp32
        # subnormals and zeros. "pow2": a power-of-two scale, which bf16 launches round once
        # after (kernels._scaled_once).
        scale = {"exact": 0.0123, "wide": 0.37, "pow2": 2.0 ** -6}[kind]
    q[:, 5] = 0.0            # a row of equal scores: P spread over the keys it sees
    grad[:, 7] = 0.0         # a row of zero dS
    grad[1, 64:96] *= 2.0 ** -100   # tiny dO rows: tiny dS blocks, fp32 subnormals among them
    return [t.to(dtype) for t in (q, k_t, v, grad)], scale


def _quantizer(qk_cfg, pv_cfg):
    """The caller's quantization of the whole operands (gemm.quantize_slot, as the chunked
    path quantizes them)."""
    from megatron.quantization.gemm import SiteState, quantize_slot
    sites = {"qk": (qk_cfg, SiteState("attn.qk", qk_cfg)),
             "pv": (pv_cfg, SiteState("attn.pv", pv_cfg))}

    def quantize(site, gemm, name, side, tensor, axis):
        config, state = sites[site]
        fmt = getattr(getattr(config, gemm), side)
        q, _ = quantize_slot(config, gemm, name, side, tensor, fmt, axis, state=state)
        return tensor if q is None else q
    return quantize


def _chunked(inputs, scale, causal, sq, qk_cfg, pv_cfg, chunk_rows=64):
    """(out, [dq, dk_t, dv], captured) of the chunked path on the grouped layout: megatron's
    softmax (FusedScaleMaskSoftmax's torch path, -10000 fill) around _ChunkedAttention.
    captured holds the chunks' P and dS, the tensors the chunked path quantizes."""
    import torch
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func
    from megatron.quantization import attention as attention_module
    from megatron.quantization.attention import QuantDotProductAttention
    from megatron.quantization.config import AttentionSettings
    from megatron.quantization.gemm import SiteState
    from megatron.quantization.observers import GemmSite

    q, k_t, v, grad = inputs
    module = QuantDotProductAttention.__new__(QuantDotProductAttention)
    torch.nn.Module.__init__(module)
    module.scale_mask_softmax = FusedScaleMaskSoftmax(
        input_in_fp16=False, input_in_bf16=q.dtype == torch.bfloat16,
        attn_mask_type=AttnMaskType.causal, scaled_masked_softmax_fusion=False,
        mask_func=attention_mask_func, softmax_in_fp32=True, scale=None)
    module.softmax_scale = scale
    module.attention = AttentionSettings(chunk_rows=chunk_rows)
    for name, cfg in (("qk", qk_cfg), ("pv", pv_cfg)):
        setattr(module, f"{name}_site", GemmSite(f"attn.{name}", f"attn_{name}", 1, cfg,
                                                 SiteState(f"attn.{name}", cfg)))
    captured = {"probs": [], "score_grad": []}
    gemms = attention_module._Gemms
    context, query_grad = gemms.context, gemms.query_grad

    def spy_context(self, probs, *args, **kwargs):
        captured["probs"].append(probs.detach().clone())
        return context(self, probs, *args, **kwargs)

    def spy_query_grad(self, grad_scores, *args, **kwargs):
        captured["score_grad"].append(grad_scores.detach().clone())
        return query_grad(self, grad_scores, *args, **kwargs)

    gemms.context, gemms.query_grad = spy_context, spy_query_grad
    try:
        leaves = [t.detach().clone().requires_grad_() for t in (q, k_t, v)]
        mask_type = AttnMaskType.causal if causal else AttnMaskType.no_mask
        sk = k_t.size(2)
        out = module._chunked(*leaves, None, mask_type, torch.empty(sq, 0), torch.empty(sk, 0, 1))
        out.backward(grad)
    finally:
        gemms.context, gemms.query_grad = context, query_grad
    sk = k_t.size(2)
    whole = {name: torch.cat([torch.nn.functional.pad(t, (0, sk - t.size(-1))) for t in parts],
                             dim=1)
             for name, parts in captured.items() if parts}
    return out.detach(), [t.grad for t in leaves], whole


def _bit_mismatch(kernel, eager):
    """None when two tensors hold the same bits (NaN with NaN), else a description."""
    import torch
    if kernel.shape != eager.shape or kernel.dtype != eager.dtype:
        return f"shape/dtype {tuple(kernel.shape)} {kernel.dtype} vs {tuple(eager.shape)} " \
               f"{eager.dtype}"
    view = torch.int16 if kernel.dtype == torch.bfloat16 else torch.int32
    differ = (kernel.view(view) != eager.view(view)) & ~(kernel.isnan() & eager.isnan())
    if differ.any():
        return (f"{int(differ.sum())} elements differ, e.g. kernel {kernel[differ][:3].tolist()}"
                f" eager {eager[differ][:3].tolist()}")
    return None


def _difference(mine, ref):
    """max |mine - ref| relative to max |ref|, and the largest elementwise relative difference
    where |ref| is at least 1/16 of max |ref|."""
    import math
    bits = 8 if mine.dtype == torch_dtype("bfloat16") else 24
    mine, ref = mine.double(), ref.double()
    scale = float(ref.abs().max())
    diff = (mine - ref).abs()
    big = ref.abs() >= scale / 16
    rel = float((diff[big] / ref.abs()[big]).max()) if big.any() else 0.0
    # units in the last place of the largest |value|
    ulp = 2.0 ** (math.floor(math.log2(scale)) + 1 - bits) if scale else 1.0
    return {"max": float(diff.max()) / scale if scale else float(diff.max()), "rel": rel,
            "ulps": float(diff.max()) / ulp, "scale": scale}


def torch_dtype(name):
    import torch
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _tile_checks(dbg_fwd, dbg_bwd, formats):
    """Each tile quantization against eager fake_quantize of the kernel's own tensor."""
    from megatron.quantization.formats import fake_quantize
    p, ds = dbg_fwd["probs"], dbg_bwd["score_grad"]
    return {
        "P keys": _bit_mismatch(dbg_fwd["probs_q"],
                                fake_quantize(p, formats.probs, -1, formats.pv_scale_mode)),
        "P rows": _bit_mismatch(dbg_bwd["probs_rows_q"],
                                fake_quantize(p, formats.probs_rows, 1, formats.pv_scale_mode)),
        "dS keys": _bit_mismatch(dbg_bwd["score_grad_q"],
                                 fake_quantize(ds, formats.score_grad, -1,
                                               formats.qk_scale_mode)),
        "dS rows": _bit_mismatch(dbg_bwd["score_grad_rows_q"],
                                 fake_quantize(ds, formats.score_grad_rows, 1,
                                               formats.qk_scale_mode)),
        # the dK/dV kernel recomputes the same P and dS as the forward and the dQ kernel
        "P recomputed": _bit_mismatch(dbg_bwd["probs"], p),
        "dS recomputed": _bit_mismatch(dbg_bwd["score_grad_2"], ds),
    }


def _kernel_run(quantize, inputs, formats, scale, causal, sq, skip=True, debug=True):
    from megatron.quantization.kernels import attention as kernels
    q, k_t, v, grad = inputs
    q_f = quantize("qk", "fprop", "a", "a", q, 2)
    k_f = quantize("qk", "fprop", "b", "b", k_t, 1)
    fwd = kernels.attention_forward(q_f, k_f, quantize("pv", "fprop", "b", "b", v, 1), formats,
                                    scale, causal, sq, skip, debug)
    bwd = kernels.attention_backward(
        quantize("pv", "dgrad", "grad_output", "a", grad, 2),
        quantize("pv", "wgrad", "grad_output", "b", grad, 1), q_f,
        quantize("qk", "wgrad", "a", "a", q, 1), k_f, quantize("qk", "dgrad", "b", "b", k_t, 2),
        quantize("pv", "dgrad", "b", "b", v, 2), fwd.row_max, fwd.inv_row_sum, formats, scale,
        causal, sq, skip, debug)
    return fwd, bwd


def run_case(shape, fmts, causal, kind, tiles, dtype_name, seed=0):
    import torch
    from megatron.quantization.kernels import attention as kernels
    dtype = torch_dtype(dtype_name)
    sq, _, _, _, heads = SHAPES[shape]
    qk_cfg, pv_cfg = _configs(fmts)
    formats = kernels.TileFormats.of(qk_cfg, pv_cfg)
    inputs, scale = _inputs(shape, kind, dtype, seed)
    quantize = _quantizer(qk_cfg, pv_cfg)
    default_tiles = dict(kernels.INTERPRETER_TILES)
    kernels.INTERPRETER_TILES.update(TILES[tiles] or {})
    try:
        fwd, bwd = _kernel_run(quantize, inputs, formats, scale, causal, sq)
        if (shape, fmts, causal, kind, tiles) in SKIP_CHECKED and dtype_name == "bfloat16":
            fwd2, bwd2 = _kernel_run(quantize, inputs, formats, scale, causal, sq, skip=False,
                                     debug=False)
    finally:
        kernels.INTERPRETER_TILES.update(default_tiles)
    mine = [fwd.out, bwd.grad_q, bwd.grad_k_t, bwd.grad_v]
    ref_out, ref_grads, captured = _chunked(inputs, scale, causal, sq, qk_cfg, pv_cfg)
    rows = heads * sq
    one_out, one_grads, _ = _chunked(inputs, scale, causal, sq, qk_cfg, pv_cfg,
                                     chunk_rows=-(-rows // 32) * 32)
    result = {"tiles": _tile_checks(fwd.debug, bwd.debug, formats),
              "vs chunked": {name: _difference(m, r) for name, m, r
                             in zip(OUTPUTS, mine, [ref_out] + ref_grads)},
              "vs one chunk": {name: _difference(m, r) for name, m, r
                               in zip(OUTPUTS, mine, [one_out] + one_grads)},
              # the unquantized P and dS the two paths quantize
              "P vs chunked": _difference(fwd.debug["probs"], captured["probs"]),
              "dS vs chunked": _difference(bwd.debug["score_grad"], captured["score_grad"]),
              "P bits differ": int((fwd.debug["probs"] != captured["probs"]).sum()),
              "finite": all(bool(torch.isfinite(t).all()) for t in mine)}
    if (shape, fmts, causal, kind, tiles) in SKIP_CHECKED and dtype_name == "bfloat16":
        every = [fwd2.out, bwd2.grad_q, bwd2.grad_k_t, bwd2.grad_v]
        result["skip"] = {name: bool(torch.equal(a, b)) for name, a, b in
                          zip(OUTPUTS, mine, every)}
    return result


def autograd_case(dtype_name):
    """TritonQuantizedAttention.apply gives the entry points' results bit for bit."""
    from megatron.quantization.kernels import attention as kernels
    dtype = torch_dtype(dtype_name)
    qk_cfg, pv_cfg = _configs("mixed")
    formats = kernels.TileFormats.of(qk_cfg, pv_cfg)
    inputs, scale = _inputs("sq80", "random", dtype, 3)
    quantize = _quantizer(qk_cfg, pv_cfg)
    fwd, bwd = _kernel_run(quantize, inputs, formats, scale, True, 80, debug=False)
    leaves = [t.detach().clone().requires_grad_() for t in inputs[:3]]
    out = kernels.TritonQuantizedAttention.apply(*leaves, quantize, formats, scale, True, 80)
    out.backward(inputs[3])
    return {name: _bit_mismatch(a, b) for name, a, b in
            zip(OUTPUTS, [out.detach()] + [t.grad for t in leaves],
                [fwd.out, bwd.grad_q, bwd.grad_k_t, bwd.grad_v])}


def supported_cases():
    """unsupported_reason for calls the kernels must reject or accept."""
    import torch
    from megatron.quantization.config import (
        Fp8Settings, HiFP8Settings, MatmulQuantConfig, MxSettings, OperandFormats)
    from megatron.quantization.kernels.attention import supported, unsupported_reason
    mx, _ = _configs("mxfp8")
    none = MatmulQuantConfig()

    def cfg(fprop=("mxfp8", "mxfp8"), dgrad=("mxfp8", "mxfp8"), wgrad=("mxfp8", "mxfp8"),
            **kw):
        return MatmulQuantConfig(fprop=OperandFormats(*fprop), dgrad=OperandFormats(*dgrad),
                                 wgrad=OperandFormats(*wgrad), **kw)

    bf16, f32 = torch.bfloat16, torch.float32
    calls = {
        "mxfp8": (mx, mx, bf16, 128, 128, {}),
        "none": (none, none, f32, 64, 64, {}),
        "mxfp4 rceil": (cfg(("mxfp4",) * 2, ("mxfp4",) * 2, ("mxfp4",) * 2,
                            mx=MxSettings(scale_mode="rceil")), mx, bf16, 128, 128, {}),
        "hifp8 outside only": (cfg(fprop=("hifp8", "hifp8")), mx, bf16, 64, 64, {}),
        "stochastic dO outside": (mx, cfg(stochastic={"dgrad.a"}, dgrad=("none", "mxfp8")),
                                  bf16, 64, 64, {}),
        # rejected:
        "nvfp4 P": (mx, cfg(fprop=("nvfp4", "mxfp8")), bf16, 64, 64, {}),
        "fp8 tensorwise dS": (cfg(dgrad=("fp8_e5m2", "mxfp8"),
                                  fp8=Fp8Settings(recipe="tensorwise")), mx, bf16, 64, 64, {}),
        "fp8 delayed P rows": (mx, cfg(wgrad=("fp8_e4m3", "mxfp8"),
                                       fp8=Fp8Settings(recipe="delayed")), bf16, 64, 64, {}),
        "hifp8 dS rows": (cfg(wgrad=("mxfp8", "hifp8"), hifp8=HiFP8Settings(scaling="tensor")),
                          mx, bf16, 64, 64, {}),
        "hifp8 P unscaled": (mx, cfg(fprop=("hifp8", "mxfp8")), bf16, 64, 64, {}),
        "stochastic P": (mx, cfg(stochastic={"fprop.a"}), bf16, 64, 64, {}),
        "stochastic dS": (cfg(stochastic={"wgrad.b"}), mx, bf16, 64, 64, {}),
        "stochastic Q": (cfg(stochastic={"fprop.a"}, dgrad=("none", "none")), mx, bf16, 64, 64,
                         {}),
        "delayed K": (cfg(fprop=("mxfp8", "fp8_e4m3"), fp8=Fp8Settings(recipe="delayed")), mx,
                      bf16, 64, 64, {}),
        "observed": (mx, mx, bf16, 64, 64, {"observed": True}),
        "mask tensor": (mx, mx, bf16, 64, 64, {"mask_tensor": True}),
        "fp16": (mx, mx, torch.float16, 64, 64, {}),
        "bf16 softmax": (mx, mx, bf16, 64, 64, {"softmax_in_fp32": False}),
        "head dim 256": (mx, mx, bf16, 256, 128, {}),
        "value dim 0": (mx, mx, bf16, 64, 0, {}),
    }
    return {name: [supported(*call[:5], **call[5]), unsupported_reason(*call[:5], **call[5])]
            for name, call in calls.items()}


def broken_case():
    """The comparison with the chunked path fails when S is not rounded to bf16 (the kernels'
    _scaled_scores swapped for one without that rounding)."""
    import triton
    import triton.language as tl
    from megatron.quantization.kernels import attention as kernels
    # A jit function must see triton.language among its globals (this module's).
    globals().update(tl=tl, kernels=kernels)

    @triton.jit
    def scores_unrounded(s, scale, IS_BF16: tl.constexpr, POW2_SCALE: tl.constexpr):
        return kernels._round_to_dtype(s * scale, IS_BF16)

    original = kernels._scaled_scores
    kernels._scaled_scores = scores_unrounded
    try:
        return run_case("sq64", "mxfp8", True, "exact", "tile", "bfloat16")["vs chunked"]
    finally:
        kernels._scaled_scores = original


H100_SHARED_BYTES = 232448      # the most shared memory one block may use on an H100


def compile_for_h100():
    """Compile the three kernels for sm_90 in every configuration autotuning may pick there
    for bf16 (d = dv = 64 and 128, causal, MXFP8, rceil; integer arguments and pointers
    divisible by 16, as at training shapes): no GPU is needed, and the compiler checks what
    the interpreter does not (globals must be constexpr, layouts, shared memory). Returns
    each configuration's shared memory, how many of its GEMM instructions are wgmma and
    mma.sync, its instructions other than exp's ex2 that flush subnormals to zero, how many
    loops its SASS has and how many bytes per thread ptxas spills."""
    import torch
    from megatron.quantization.kernels import attention as kernels
    from megatron.quantization.kernels import offline
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend
        make_backend(GPUTarget(*offline.SM90))
    except Exception as e:      # a Triton without its CUDA backend
        return {"skipped": repr(e)}
    compiled = {}
    for name in ("forward", "query", "key"):
        for head_dim in (64, 128):
            configs = kernels.tile_configs(name, (9, 0), torch.bfloat16, head_dim)
            # the stages only size the load buffers: the most of them; d = 64 only where its
            # tiles differ from those at d = 128 (it needs less of everything)
            configs = [c for c in configs if c.stages == max(c.stages for c in configs)]
            if head_dim == 64:
                configs = [c for c in configs if c not in kernels.tile_configs(
                    name, (9, 0), torch.bfloat16, 128)]
            for config in configs:
                done = offline.compile_attention(name, config, head_dim)
                ptx = done.asm["ptx"]
                flushing = [line for line in ptx.splitlines() if ".ftz" in line]
                compiled[f"{name} d{head_dim} {tuple(config)}"] = {
                    "shared": done.metadata.shared, "wgmma": ptx.count("wgmma.mma_async"),
                    "mma.sync": ptx.count("mma.sync"),
                    "ftz": [line for line in flushing if "ex2.approx.ftz.f32" not in line],
                    "loops": len(offline.loop_instructions(done.asm["cubin"])),
                    "spilled": offline.register_use(done)[1]}
    return {"compiled": compiled}


def run_all(selected=None):
    results = {}
    for case in CASES:
        for dtype_name in DTYPE_NAMES:
            name = case_name(*case, dtype_name)
            if selected is None or any(s in name for s in selected):
                results[name] = run_case(*case, dtype_name)
    if selected is None:
        results["autograd"] = {d: autograd_case(d) for d in DTYPE_NAMES}
        results["supported"] = supported_cases()
        results["broken"] = broken_case()
    return results


# ---------------------------------------------------------------------------------------------
# The tests (this process never imports triton)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiled():
    """The --compile-sm90 subprocess, started as the module's tests start so that it runs
    beside the interpreter's (both single-threaded): a function that waits for it and returns
    (exit status, stdout, stderr)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in child_env().items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--compile-sm90"],
                                 env=env, cwd=REPO_ROOT, stdout=out, stderr=err, text=True)

        def report():
            child.wait(timeout=600)
            out.seek(0)
            err.seek(0)
            return child.returncode, out.read(), err.read()

        yield report
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.fixture(scope="module")
def results(compiled):
    return run_interpreted(__file__, timeout=900)


def _cases(results):
    names = [case_name(*case, d) for case in CASES for d in DTYPE_NAMES]
    assert all(name in results for name in names)
    return {name: results[name] for name in names}


def test_tile_quantizations_are_bit_exact(results):
    """P along keys and rows, dS along keys and rows: eager fake_quantize of the kernel's own
    P and dS, bit for bit (tail blocks along keys and rows, blocks across heads, zero rows,
    tiny and fp32-subnormal values included); the dK/dV kernel recomputes the same P and dS."""
    failures = {(name, check): v for name, r in _cases(results).items()
                for check, v in r["tiles"].items() if v is not None}
    assert not failures, failures


def test_results_match_the_chunked_path(results):
    """out, dQ, dK, dV agree with _ChunkedAttention within a few units in the last place (ulp)
    of the largest |value| of each output, u = 2**-24 (float32) or 2**-8 (bf16) relative.

    The two sides see the same quantized operands and differ in summation order and exp only.
    float32: each result is a sum of up to ~100 products, plus the softmax sum and delta; the
    order changes it by a few u of the largest terms (measured: up to 7 ulps with nothing
    quantized, less with MX operands, whose products are often exact). 16 ulps, about 1e-6
    relative. A last-bit difference in P or dS that crosses an MX rounding midpoint would move
    one element by a whole MX step; it did not happen in these cases, whose checks would then
    fail (the inputs are fixed, so this is not flaky).
    bf16: every result is rounded to bf16 once, so the same fp32 differences give at most one
    half-ulp flip; against the chunked path in one chunk: 1 ulp (measured: 0.5). In chunks of
    64 rows the chunked path rounds each chunk's part of dK and dV to bf16 before summing the
    parts (3 chunks here): 2 ulps (measured: 1)."""
    failures = {}
    for name, r in _cases(results).items():
        dtype = name.split()[-1]
        assert r["finite"], name
        for reference, tolerance in (("vs chunked", TOLERANCE_ULPS),
                                     ("vs one chunk", TOLERANCE_ULPS_ONE_CHUNK)):
            for output, d in r[reference].items():
                if d["ulps"] > tolerance[dtype]:
                    failures[(name, reference, output)] = d
    assert not failures, failures


def test_the_probabilities_are_the_chunked_paths(results):
    """The unquantized P and dS the two paths quantize agree to the last bits: float32 P within
    4 ulps of its largest value (exp and the softmax sum's order), dS within 2**-18 of its
    largest (delta's order too); bf16 within one ulp, and P with exact scores in all but a
    few elements (also where the kernels round S * scale once, a power-of-two scale)."""
    for name, r in _cases(results).items():
        dtype = name.split()[-1]
        assert r["P vs chunked"]["max"] <= (2.0 ** -21 if dtype == "float32" else 2.0 ** -8), \
            (name, r["P vs chunked"])
        assert r["dS vs chunked"]["max"] <= (2.0 ** -18 if dtype == "float32" else 2.0 ** -7), \
            (name, r["dS vs chunked"])
        if (" exact " in name or " pow2 " in name) and dtype == "bfloat16":
            assert r["P bits differ"] <= 4, (name, r["P bits differ"])


def test_skipped_causal_tiles_change_nothing(results):
    checked = [case_name(*case, "bfloat16") for case in SKIP_CHECKED]
    for name in checked:
        assert all(results[name]["skip"].values()), (name, results[name]["skip"])


def test_autograd_wrapper_runs_the_kernels(results):
    for dtype, mismatches in results["autograd"].items():
        assert all(v is None for v in mismatches.values()), (dtype, mismatches)


def test_the_comparison_detects_a_missing_rounding(results):
    """Without the rounding of S to bf16 the kernels leave the chunked path's tolerance."""
    assert max(d["ulps"] for d in results["broken"].values()) > 4 * TOLERANCE_ULPS["bfloat16"]


def test_the_kernels_compile_for_an_h100(compiled):
    """The GPU compiler accepts the kernels in every configuration autotuning may pick on an
    H100, they fit its shared memory, and every tl.dot is a wgmma (one instruction family,
    so that S, and P, are the same whatever tiles each kernel takes; the interpreter runs
    Python and checks none of this). No instruction but exp's ex2 flushes subnormals to zero:
    the MX roundings in the tiles are float arithmetic that must keep them. No configuration
    spills registers, and the loops are those benchmarks/kernel_code.py labels."""
    returncode, stdout, stderr = compiled()
    assert returncode == 0, stderr[-4000:]
    report = json.loads(stdout.strip().splitlines()[-1])
    if "skipped" in report:
        pytest.skip(report["skipped"])
    for name, c in report["compiled"].items():
        assert 0 < c["shared"] <= H100_SHARED_BYTES and c["wgmma"] > 0 and not c["mma.sync"], \
            (name, c)
        assert not c["ftz"], (name, c["ftz"][:3])
        # as benchmarks/kernel_code.py reads them: the forward's and the dQ kernel's two
        # passes over unmasked and masked key tiles, the dK/dV kernel's one loop over the
        # query tiles
        assert c["loops"] == (1 if name.startswith("key") else 4), (name, c["loops"])
        assert c["spilled"] == 0, (name, c["spilled"])     # spills would cost every tile


ACCEPTED = ("mxfp8", "none", "mxfp4 rceil", "hifp8 outside only", "stochastic dO outside")
REJECTED = {"nvfp4 P": "nvfp4", "fp8 tensorwise dS": "fp8_e5m2",
            "fp8 delayed P rows": "fp8_e4m3", "hifp8 dS rows": "hifp8",
            "hifp8 P unscaled": "MX formats only", "stochastic P": "stochastic",
            "stochastic dS": "stochastic", "stochastic Q": "not reproducible",
            "delayed K": "not reproducible", "observed": "observer", "mask tensor": "mask",
            "fp16": "dtype", "bf16 softmax": "softmax", "head dim 256": "head dims",
            "value dim 0": "head dims"}


def test_supported_rejects_what_it_must(results):
    verdicts = results["supported"]
    assert set(verdicts) == set(ACCEPTED) | set(REJECTED)
    for name in ACCEPTED:
        assert verdicts[name] == [True, None], (name, verdicts[name])
    for name, words in REJECTED.items():
        ok, reason = verdicts[name]
        assert not ok and words in reason, (name, reason)


if __name__ == "__main__":
    if sys.argv[1:] == ["--compile-sm90"]:
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            sys.exit("compile without TRITON_INTERPRET")
        print(json.dumps(compile_for_h100()))
        sys.exit(0)
    require_interpreter()
    import numpy as np
    np.seterr(all="ignore")     # the interpreter's numpy: exp(-inf) and 0 * inf are intended
    import torch
    torch.set_num_threads(1)
    print(json.dumps(run_all(sys.argv[1:] or None)))
