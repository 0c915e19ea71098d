"""What the weight-gradient GEMM's quantization does to dW, from an independent quantizer.

For each arm (a tools/evaluate.py spec; by default with its fprop and dgrad in high precision,
so that every arm quantizes the same wgrad operands; --whole-arm runs it as given) the gradient
of the mean per-token loss of each of --micro-batches validation micro-batches is taken through
a checkpoint in the run's precision, and an observer sees every GEMM operand of every linear
site: the high-precision tensor and the quantized copy the GEMM used. Then:

* a quantizer written here in numpy from the element bit layouts (every code of E4M3, E5M2,
  E2M1 decoded; round to nearest by table search, ties to the even code, saturation at the
  largest finite value; MX: shared scale 2**(floor(log2 amax) - emax_elem), or the rceil rule,
  blocks of 32 along the GEMM's reduction axis; FP8 tensorwise: float32 scale as
  TransformerEngine's current scaling) quantizes every operand again along the reduction
  axis its GEMM must use (wgrad: the tokens), and the copies are compared bit for bit;
* wgrad's operands X [M, K] (the layer input) and dY [M, N] (the output gradient), tokens
  flattened to M: dW = dY^T X in float64 with X quantized alone, dY alone and both, against the
  exact product of the high-precision operands, relative L2 error over all linear weights (and
  per site kind);
* each operand's relative error ||Q(A) - A|| / ||A|| and its shares of elements saturated
  (clamped to the largest element value) and flushed to zero; the error the product would have
  if the operand's errors were independent from token to token, sqrt(sum_t ||dx_t||^2
  ||dy_t||^2) / ||dY^T X|| (X alone; likewise dY), and "coherence", the measured error over
  that (1: independent errors; above 1: errors that add up over the tokens instead of
  cancelling);
* the cancellation of the reduction itself: kappa = sqrt(sum_t ||x_t||^2 ||dy_t||^2) /
  ||dY^T X|| (1 when one token carries the product or the per-token terms are independent and
  random, 1/sqrt(M) for M equal terms, above 1 when they cancel), and the median over the
  weight entries of sum_t |x_tk dy_tn| / |sum_t x_tk dy_tn|. With errors of relative size e
  on every token, the product's relative error is about e * kappa * coherence.

Numbers are per micro-batch, printed as the mean with a 95% t interval over the micro-batches.

    python benchmarks/gradient_operands.py --load CKPT --data-path PREFIX --split 98,2,0 \\
        --seq-length 128 --micro-batch-size 2 --global-batch-size 2 --bf16 \\
        [--micro-batches 4] [--arms SPEC ...] [--whole-arm] [--json FILE]

Every other flag is pretrain_gpt.py's (data, batch, tokenizer), as for tools/evaluate.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

DEFAULT_ARMS = ("linear_mxfp8", "linear_mxfp8@mx-scale-mode=rceil",
                "linear_mxfp8@mx-grad-format=e5m2", "linear_fp8@fp8-recipe=tensorwise")
WGRAD_ONLY = "quant-fprop=none,quant-dgrad=none"
MX_BLOCK = 32
MIN_SHARED_EXPONENT, MAX_SHARED_EXPONENT = -127, 127


# -- an independent quantizer, from the bit layouts --------------------------------------------

def element_table(exponent_bits: int, mantissa_bits: int, bias: int, nan_codes):
    """The non-negative finite values of an 8-bit float format, indexed by code (0..127),
    decoded from the bit fields; codes in `nan_codes` (NaN, Inf) are cut off the top."""
    values = []
    for code in range(1 << (exponent_bits + mantissa_bits)):
        if code in nan_codes:
            break
        exponent, mantissa = code >> mantissa_bits, code & ((1 << mantissa_bits) - 1)
        if exponent == 0:           # subnormal: 0.m * 2**(1 - bias)
            values.append(mantissa * 2.0 ** (1 - bias - mantissa_bits))
        else:
            values.append((1 + mantissa / 2 ** mantissa_bits) * 2.0 ** (exponent - bias))
    return np.array(values)


# E4M3 ("fn"): S.1111.111 is NaN, so the largest code is S.1111.110 = 448. E5M2: exponent
# 11111 is Inf/NaN, the largest code S.11110.11 = 57344. E2M1: no special codes, largest 6.
ELEMENTS = {"e4m3": element_table(4, 3, 7, nan_codes={0x7F}),
            "e5m2": element_table(5, 2, 15, nan_codes=set(range(0x7C, 0x80))),
            "e2m1": element_table(2, 1, 1, nan_codes=set())}


def round_to_element(v: np.ndarray, table: np.ndarray) -> np.ndarray:
    """v (float64) rounded to the nearest value of `table`, ties to the even code, magnitudes
    at or above the largest value saturated to it."""
    magnitude = np.minimum(np.abs(v), table[-1])
    upper = np.clip(np.searchsorted(table, magnitude, side="left"), 1, len(table) - 1)
    lower = upper - 1
    below, above = magnitude - table[lower], table[upper] - magnitude
    pick_upper = (above < below) | ((above == below) & (upper % 2 == 0))
    return np.copysign(np.where(pick_upper, table[upper], table[lower]), v)


def mx_quantize(a: np.ndarray, element: str, rule: str):
    """MX quantize-dequantize of a [M, C] float64 array in blocks of 32 along M (zero
    padded): (values, share of the elements saturated to +-max_normal * 2**e)."""
    table = ELEMENTS[element]
    emax_elem = math.frexp(table[-1])[1] - 1          # floor(log2(max_normal))
    m = a.shape[0]
    padded = np.zeros((-(-m // MX_BLOCK) * MX_BLOCK, a.shape[1]))
    padded[:m] = a
    blocks = padded.reshape(-1, MX_BLOCK, a.shape[1])
    amax = np.abs(blocks).max(axis=1)
    exponent = np.frexp(amax)[1] - 1 - emax_elem      # floor(log2 amax) - emax_elem, exact
    if rule == "rceil":       # the smallest e with max_normal * 2**e >= amax
        exponent = exponent + (amax > table[-1] * np.ldexp(1.0, exponent))
    elif rule != "floor":
        raise ValueError(f"unknown MX scale rule {rule!r}")
    exponent = np.where(amax == 0, MIN_SHARED_EXPONENT,
                        np.clip(exponent, MIN_SHARED_EXPONENT, MAX_SHARED_EXPONENT))
    scale = np.ldexp(1.0, exponent)[:, None, :]
    scaled = blocks / scale
    saturated = float((np.abs(scaled) > table[-1]).sum()) / a.size
    out = round_to_element(scaled, table) * scale
    return out.reshape(padded.shape)[:m], saturated


def tensorwise_quantize(a: np.ndarray, element: str, amax=None):
    """Per-tensor FP8 scaling, float32 arithmetic as TransformerEngine's: scale = f32(max /
    amax) (amax the tensor's own, or a given one: delayed scaling), v = f32(a * scale), the
    element rounding, f32(q * f32(1 / scale)): (values, share of the elements saturated)."""
    table = ELEMENTS[element]
    a32 = a.astype(np.float32)
    amax = np.float32(np.abs(a32).max() if amax is None else amax)
    scale = np.float32(1.0) if amax == 0 else np.float32(np.float32(table[-1]) / amax)
    scaled = (a32 * scale).astype(np.float64)
    saturated = float((np.abs(scaled) > table[-1]).sum()) / a.size
    q = round_to_element(scaled, table).astype(np.float32)
    return (q * (np.float32(1.0) / scale)).astype(np.float64), saturated


def to_bfloat16(a: np.ndarray) -> np.ndarray:
    """float64 values (exact in float32) rounded to bfloat16, nearest even, as float64."""
    bits = a.astype(np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32).astype(np.float64)


MX_ELEMENTS = {"mxfp8": "e4m3", "mxfp8_e4m3": "e4m3", "mxfp8_e5m2": "e5m2", "mxfp4": "e2m1"}
REFERENCE_FORMATS = (*MX_ELEMENTS, "fp8_e4m3", "fp8_e5m2")


def reference_quantize(a: np.ndarray, fmt: str, scale_mode: str, bf16: bool, amax=None):
    """The operand `a` [M, C] (blocks along M) in the project's format `fmt` (one of
    REFERENCE_FORMATS) by this file's quantizer, in the operand's dtype (bf16 when `bf16`):
    (values, share of the elements saturated)."""
    if fmt in MX_ELEMENTS:
        out, saturated = mx_quantize(a, MX_ELEMENTS[fmt], scale_mode)
    else:
        out, saturated = tensorwise_quantize(a, fmt[-4:], amax)
    return (to_bfloat16(out) if bf16 else out.astype(np.float32).astype(np.float64)), saturated


# -- what the product's error is made of --------------------------------------------------------

def site_measures(x, dy, qx, qdy, saturated):
    """Every measure of one site's wgrad for one micro-batch (float64 arrays [M, K], [M, N];
    `saturated`: {"x": share, "dy": share} of the elements saturated)."""
    exact = dy.T @ x
    norm = np.linalg.norm(exact)
    dx, ddy = qx - x, qdy - dy
    x_rows, dy_rows = (x * x).sum(1), (dy * dy).sum(1)
    out = {
        "norm2": norm ** 2,
        "err2_x": np.linalg.norm(dy.T @ qx - exact) ** 2,
        "err2_dy": np.linalg.norm(qdy.T @ x - exact) ** 2,
        "err2_both": np.linalg.norm(qdy.T @ qx - exact) ** 2,
        "indep2_x": float(((dx * dx).sum(1) * dy_rows).sum()),
        "indep2_dy": float(((ddy * ddy).sum(1) * x_rows).sum()),
        "kappa2": float((x_rows * dy_rows).sum()),
        "opnorm2_x": float(x_rows.sum()), "operr2_x": float((dx * dx).sum()),
        "opnorm2_dy": float(dy_rows.sum()), "operr2_dy": float((ddy * ddy).sum()),
    }
    l1 = np.abs(dy).T @ np.abs(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = l1 / np.abs(exact)
    out["cancel_median"] = float(np.median(ratio[np.isfinite(ratio)]))
    for name, a, q in (("x", x, qx), ("dy", dy, qdy)):
        nonzero = a != 0
        out[f"flushed_{name}"] = float((nonzero & (q == 0)).sum()) / max(int(nonzero.sum()), 1)
        out[f"saturated_{name}"] = saturated[name]
    return out


def mean_ci(values):
    """(mean, half-width of the 95% t interval) of a list of per-micro-batch values."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) < 2:
        return float(values.mean()), float("nan")
    from scipy import stats

    half = stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values))
    return float(values.mean()), float(half)


# The reduction axis of each linear GEMM operand, where the blocks must run (the observer
# reports wgrad's operands as [tokens, features]); -1 is the last axis.
REDUCTION_AXIS = {("fprop", "input"): -1, ("fprop", "weight"): 1, ("dgrad", "grad_output"): -1,
                  ("dgrad", "weight"): 0, ("wgrad", "input"): 0, ("wgrad", "grad_output"): 0}


def blocked_2d(t, axis: int) -> np.ndarray:
    """A GEMM operand as a float64 [n, rest] array whose axis 0 is the operand's block axis."""
    a = t.detach().double().cpu().numpy()
    return np.moveaxis(a, axis, 0).reshape(a.shape[axis], -1)


class OperandObserver:
    """Observer of every linear site: checks each quantized operand of every GEMM against the
    reference quantizer (bit for bit) and keeps the wgrad measures, keyed (micro-batch, site
    name)."""

    def __init__(self, bf16: bool):
        self.bf16 = bf16
        self.micro_batch = 0
        self.measures = {}
        self.mismatches = defaultdict(int)
        self.checked = defaultdict(int)
        self.product_error = []
        self._pending = {}

    def bind(self, site):
        if site.kind != "linear":
            return None
        scale_mode = site.config.mx.scale_mode

        def observe(gemm, operand, hp, q, fmt, axis, **extra):
            saturated = None
            if q is not None and fmt in REFERENCE_FORMATS and "seed" not in extra:
                saturated = self._check(gemm, operand, hp, q, fmt, scale_mode,
                                        extra.get("amax"))
            if gemm != "wgrad":
                return
            if operand != "grad_weight":
                if hp.dim() != 2:
                    raise AssertionError(f"{site.name} wgrad {operand}: shape {hp.shape}")
                self._pending[operand] = (hp, q, saturated)
                return
            (dy, qdy, sat_dy), (x, qx, sat_x) = (self._pending.pop("grad_output"),
                                                 self._pending.pop("input"))
            if sat_dy is None or sat_x is None:
                return          # an operand in high precision or in a format not checked
            # Both are reported as [tokens, features], blocked along the tokens (axis 0).
            x, qx, dy, qdy = (t.detach().double().cpu().numpy() for t in (x, qx, dy, qdy))
            self.measures[(self.micro_batch, site.name)] = site_measures(
                x, dy, qx, qdy, {"x": sat_x, "dy": sat_dy})
            exact_q = qdy.T @ qx
            product = hp.detach().double().cpu().numpy()
            self.product_error.append(float(np.linalg.norm(product - exact_q)
                                            / np.linalg.norm(exact_q)))
        return observe

    def _check(self, gemm, operand, hp, q, fmt, scale_mode, amax):
        """Counts the elements where the reference quantizer differs from the GEMM's copy;
        returns the share it saturated."""
        axis = REDUCTION_AXIS[(gemm, operand)] % hp.dim()
        a, q_gemm = blocked_2d(hp, axis), blocked_2d(q, axis)
        if amax is not None:
            amax = float(amax)
        mine, saturated = reference_quantize(a, fmt, scale_mode, self.bf16, amax)
        key = f"{gemm}.{operand} {fmt}"
        self.mismatches[key] += int((mine != q_gemm).sum())
        self.checked[key] += mine.size
        return saturated


def run_arm(model, spec: str, batches, args, seed: int, whole_arm: bool):
    """The observer of one arm over `batches`: the arm as given (`whole_arm`) or with its
    fprop and dgrad in high precision (wgrad only)."""
    import torch

    from megatron.evaluation.losses import device
    from megatron.evaluation.specs import arm_config
    from megatron.quantization.runtime import observing
    from megatron.training.batches import batch_to_device

    if not whole_arm:
        name, _, flags = spec.partition("@")
        spec = f"{name}@{flags + ',' if flags else ''}{WGRAD_ONLY}"
    model.quantize(arm_config(spec, args.quant_config.settings, args.num_layers, seed))
    site_config = next(s.config for s in model.sites if s.kind == "linear")
    observer = OperandObserver(bool(args.bf16))
    module = model.module
    module.eval()
    params = [p for p in module.parameters() if p.requires_grad]
    with observing(model.raw, observer):
        for i, batch in enumerate(batches):
            observer.micro_batch = i
            for p in params:
                p.grad = None
            tokens, labels, loss_mask, attention_mask, position_ids = batch_to_device(
                batch, device())
            losses = module(tokens, position_ids, attention_mask, labels=labels).float()
            (torch.sum(losses.view(-1) * loss_mask.view(-1)) / loss_mask.sum()).backward()
    for p in params:
        p.grad = None
    return observer, site_config


def summarise(observer, micro_batches: int):
    """Per micro-batch sums over the sites, then (mean, ci) of each ratio; also per kind."""
    kinds = sorted({name.rsplit(".", 1)[-1] for _, name in observer.measures})
    groups = {"all": None, **{k: k for k in kinds}}
    out = {}
    for label, kind in groups.items():
        rows = defaultdict(list)
        for i in range(micro_batches):
            ms = [m for (b, name), m in observer.measures.items()
                  if b == i and (kind is None or name.endswith("." + kind))]
            total = {k: sum(m[k] for m in ms) for k in ms[0] if k != "cancel_median"}
            norm2 = total["norm2"]
            for which in ("x", "dy", "both"):
                rows[f"rel_{which}"].append(math.sqrt(total[f"err2_{which}"] / norm2))
            for which in ("x", "dy"):
                rows[f"operr_{which}"].append(math.sqrt(total[f"operr2_{which}"]
                                                        / total[f"opnorm2_{which}"]))
                rows[f"indep_{which}"].append(math.sqrt(total[f"indep2_{which}"] / norm2))
                rows[f"coherence_{which}"].append(math.sqrt(total[f"err2_{which}"]
                                                            / total[f"indep2_{which}"]))
                for share in ("flushed", "saturated"):
                    rows[f"{share}_{which}"].append(float(np.mean([m[f"{share}_{which}"]
                                                                   for m in ms])))
            rows["kappa"].append(math.sqrt(total["kappa2"] / norm2))
            rows["cancel_median"].append(float(np.median([m["cancel_median"] for m in ms])))
        out[label] = {k: {"per_micro_batch": v, "mean_ci95": mean_ci(v)}
                      for k, v in rows.items()}
    return out


def fmt_ci(entry, digits=3):
    mean, half = entry["mean_ci95"]
    return f"{mean:.{digits}f}" if math.isnan(half) else f"{mean:.{digits}f}±{half:.{digits}f}"


def gradient_step_args(rest, micro_batches: int):
    """tools/evaluate.py's model and data flags (`rest`) parsed and checked for a gradient step
    over the first `micro_batches` validation micro-batches, with the process group made (the
    caller destroys it)."""
    from megatron.evaluation.cli import check_tokenizer
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.initialize import initialize_distributed

    args = parse_args(rest + ["--eval-iters", str(micro_batches)])
    args.train_iters = args.train_iters or 1
    args.lr = 0.0 if args.lr is None else args.lr
    args = validate_args(args)
    check_tokenizer(args)
    initialize_distributed(args)
    return args


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), metavar="SPEC",
                   help="tools/evaluate.py specs; each runs with its fprop and dgrad in high "
                        "precision unless --whole-arm (default: %(default)s).")
    p.add_argument("--micro-batches", type=int, default=4,
                   help="Validation micro-batches (the first ones, as evaluate.py's "
                        "--gradients takes them; default %(default)s).")
    p.add_argument("--whole-arm", action="store_true",
                   help="Run each arm as given (fprop and dgrad quantized too: every quantized "
                        "operand is checked bit for bit; the wgrad measures then use that "
                        "arm's own operands).")
    p.add_argument("--json", metavar="FILE", help="Also write the summary as JSON.")
    own, rest = p.parse_known_args(argv)

    import warnings

    warnings.filterwarnings("ignore")
    from megatron.evaluation.losses import validation_batches
    from megatron.evaluation.model_state import load_model
    from megatron.evaluation.run import _padded_vocab
    from megatron.training.initialize import destroy_distributed, set_random_seeds
    from megatron.training.tokenizer import build_tokenizer

    args = gradient_step_args(rest, own.micro_batches)
    try:
        set_random_seeds(args.seed)
        tokenizer = build_tokenizer(args)
        args.padded_vocab_size = _padded_vocab(args, tokenizer.vocab_size)
        model = load_model(args, log=lambda *_: None)
        batches = validation_batches(args, tokenizer)[:own.micro_batches]
        results = {}
        for spec in own.arms:
            observer, config = run_arm(model, spec, batches, args, args.seed, own.whole_arm)
            results[spec] = {
                "mode": "as given" if own.whole_arm else "wgrad only",
                "wgrad": f"X {config.wgrad.a}, dY {config.wgrad.b}, MX scale rule "
                         f"{config.mx.scale_mode}",
                "bit_mismatches": {k: [observer.mismatches[k], observer.checked[k]]
                                   for k in observer.checked},
                "gemm_vs_float64": max(observer.product_error),
                "summary": summarise(observer, len(batches))}
            print_arm(spec, results[spec])
    finally:
        destroy_distributed()
    if own.json:
        with open(own.json, "w") as f:
            json.dump(results, f, indent=1)


def print_arm(spec, result):
    print(f"\n{spec} ({result['mode']}; wgrad: {result['wgrad']})")
    for operand, (bad, total) in result["bit_mismatches"].items():
        print(f"  reference quantizer vs the GEMM's {operand}: {bad} of {total} elements differ")
    print(f"  the GEMM's own dW vs the float64 product of its quantized operands: rel L2 <= "
          f"{result['gemm_vs_float64']:.2e}")
    print("  dW = dY^T X in float64, relative L2 error against the unquantized operands' "
          "product (mean and 95% interval over micro-batches):")
    columns = (("X only", "rel_x", 3), ("dY only", "rel_dy", 3), ("both", "rel_both", 3),
               ("err(X)", "operr_x", 4), ("err(dY)", "operr_dy", 4), ("kappa", "kappa", 2),
               ("coh. X", "coherence_x", 2), ("coh. dY", "coherence_dy", 2))
    print(f"  {'sites':<12}" + "".join(f"{name:>15}" for name, _, _ in columns))
    for label, row in result["summary"].items():
        print(f"  {label:<12}" + "".join(f"{fmt_ci(row[key], digits):>15}"
                                         for _, key, digits in columns))
    print("  shares of the elements (%), mean over micro-batches: saturated X, dY; flushed "
          "to zero X, dY; median per-entry sum|x dy| / |sum x dy|")
    for label, row in result["summary"].items():
        values = [100 * row[k]["mean_ci95"][0] for k in
                  ("saturated_x", "saturated_dy", "flushed_x", "flushed_dy")]
        print(f"  {label:<12}" + "".join(f"{v:>12.4f}" for v in values)
              + f"{row['cancel_median']['mean_ci95'][0]:>12.2f}")


if __name__ == "__main__":
    main()
