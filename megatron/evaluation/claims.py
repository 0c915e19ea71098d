"""The probe's arms and the published claims it tests (tools/probe.py, `make probe`).

Each claim is checked against the evaluation outputs with its noise: paired intervals over
sequences (direct-cast losses), over micro-batches (gradient errors), or the deterministic
counts it rests on, and gets a verdict: agrees, disagrees, or not resolved.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List

import numpy as np

from megatron.analysis.intervals import mean_interval, paired_delta

# Direct cast: every scheme family and recipe, plus the arms the claims compare.
RHT_FPROP = "linear_nvfp4@quant-rht=16,quant-rht-gemms=fprop"
MXFP8_RCEIL = "linear_mxfp8@mx-scale-mode=rceil"
# NVFP4 "4/6" (TE's nvfp4_4over6, MAE unless named) and per-token activation scales.
FOUR_OVER_SIX = "linear_nvfp4@nvfp4-4over6=all"
FOUR_OVER_SIX_ARMS = ("linear_nvfp4@nvfp4-4over6=weights",
                      "linear_nvfp4@nvfp4-4over6=activations", FOUR_OVER_SIX,
                      FOUR_OVER_SIX + ",nvfp4-4over6-err-mode=mse")
ROW_SCALED = "linear_nvfp4@nvfp4-row-scaled-activation"
DIRECT_ARMS = (
    "bf16", "FA_mxfp8", "FA_hifp8", "FA_mxfp4", "linear_mxfp8", "linear_hifp8", "linear_mxfp4",
    "FA_linear_mxfp8", "FA_linear_hifp8", "FA_linear_mxfp4", MXFP8_RCEIL,
    "FA_linear_hifp8@hifp8-scaling=tensor", "linear_mxfp6_e2m3", "linear_mxfp6_e3m2",
    "linear_fp8@fp8-recipe=tensorwise", "linear_fp8@fp8-recipe=blockwise", "linear_nvfp4",
    "FA_linear_nvfp4", RHT_FPROP, "recipe_nvfp4", "recipe_mxfp4_rht_sr",
    *FOUR_OVER_SIX_ARMS, ROW_SCALED,
)

# Gradient fidelity: forward unquantized where a claim is about one backward GEMM.
WGRAD = "linear_nvfp4@quant-fprop=none,quant-dgrad=none"
DGRAD = "linear_nvfp4@quant-fprop=none,quant-wgrad=none"
RN_BACKWARD = "linear_nvfp4@quant-fprop=none"
GRADIENT_ARMS = (
    "bf16", "linear_mxfp8", "linear_mxfp4", "linear_nvfp4", "recipe_nvfp4",
    WGRAD, WGRAD + ",quant-rht=16", DGRAD, DGRAD + ",quant-rht=16,quant-rht-gemms=dgrad",
    RN_BACKWARD, RN_BACKWARD + ",quant-stochastic-rounding=all", FOUR_OVER_SIX, ROW_SCALED,
)


def _verdict_below(ci, agrees_if_below: bool = True) -> str:
    lo, hi = ci
    if hi < 0:
        return "agrees" if agrees_if_below else "disagrees"
    if lo > 0:
        return "disagrees" if agrees_if_below else "agrees"
    return "not resolved (interval includes 0)"


def _verdict_no_help(ci) -> str:
    """A claim that X does not help (does not lower the error)."""
    return "disagrees (it helps)" if ci[1] < 0 else "agrees"


def _fmt(d: dict, scale: float = 1.0, unit: str = "") -> str:
    return (f"{d['mean'] * scale:+.4g}{unit} [{d['ci95'][0] * scale:+.4g}, "
            f"{d['ci95'][1] * scale:+.4g}]")


class _Sequences:
    def __init__(self, path: str):
        data = np.load(path)
        self.labels = list(data["labels"])
        self.sums = data["sums"]
        self.tokens = data["tokens"]

    def __call__(self, label: str) -> np.ndarray:
        return self.sums[self.labels.index(label)]


def check(direct: dict, sequences_path: str, grads: dict) -> List[Dict[str, str]]:
    seq = _Sequences(sequences_path)
    rows = []

    d = paired_delta(seq("linear_nvfp4"), seq("linear_mxfp4"), seq.tokens)
    rows.append(dict(
        claim="NVFP4's error is below MXFP4's (16-element blocks, E4M3 scales)",
        source="NVFP4 pretraining (arXiv 2509.25149): MXFP4 +2.5% vs NVFP4 +1.5% loss at 8B",
        measured=f"direct cast, loss(linear_nvfp4) - loss(linear_mxfp4) = {_fmt(d)} nats/token",
        verdict=_verdict_below(d["ci95"])))

    d = paired_delta(seq(FOUR_OVER_SIX), seq("linear_nvfp4"), seq.tokens)
    rows.append(dict(
        claim="4/6 brings NVFP4 closer to BF16",
        source="Four Over Six (arXiv 2512.02010): NVFP4 up to 19.9% closer to BF16 perplexity "
               "in direct cast",
        measured=f"direct cast, loss(linear_nvfp4 with 4/6 on weights and activations, MAE) - "
                 f"loss(linear_nvfp4) = {_fmt(d)} nats/token",
        verdict=_verdict_below(d["ci95"])))

    sweep = direct["sweep"]
    layers = sorted({r["layer"] for r in sweep["sites"] if r["layer"] is not None})
    first, last = layers[0], layers[-1]

    def layer_sum(layer):
        return sum(seq(f"sweep:{r['key']}") for r in sweep["sites"] if r["layer"] == layer)

    d = paired_delta(layer_sum(last), layer_sum(first), seq.tokens)
    what = (f"layer {last} quantized (all its sites) minus layer {first}"
            if sweep.get("design") == "layers"
            else f"sum over layer {last}'s sites minus layer {first}'s")
    rows.append(dict(
        claim="The last layers are more sensitive to FP4 than the first",
        source="NVFP4 pretraining (arXiv 2509.25149): last-4 BF16 converges, first-4 does not",
        measured=f"sweep in {sweep['scheme']}: {what} = {_fmt(d)} nats/token",
        verdict=_verdict_below(d["ci95"], agrees_if_below=False)))

    g = grads["schemes"]

    def per_batch_diff(a: str, b: str) -> dict:
        return mean_interval(np.subtract(g[a]["vs_fp32"]["per_micro_batch"]["rel_l2"],
                                         g[b]["vs_fp32"]["per_micro_batch"]["rel_l2"]))

    d = per_batch_diff(WGRAD + ",quant-rht=16", WGRAD)
    rows.append(dict(
        claim="RHT (16) lowers the wgrad error",
        source="NVFP4 pretraining (arXiv 2509.25149); TE NVFP4BlockScaling applies RHT to wgrad",
        measured=f"wgrad-only NVFP4, rel L2 of the gradient vs fp32 with minus without RHT = "
                 f"{_fmt(d)} (over {d['n']} micro-batches)",
        verdict=_verdict_below(d["ci95"])))
    d = per_batch_diff(DGRAD + ",quant-rht=16,quant-rht-gemms=dgrad", DGRAD)
    rows.append(dict(
        claim="RHT does not help dgrad",
        source="NVFP4 pretraining (arXiv 2509.25149): no RHT on fprop/dgrad",
        measured=f"dgrad-only NVFP4, rel L2 with minus without RHT = {_fmt(d)} "
                 f"(over {d['n']} micro-batches)",
        verdict=_verdict_no_help(d["ci95"])))
    d = paired_delta(seq(RHT_FPROP), seq("linear_nvfp4"), seq.tokens)
    rows.append(dict(
        claim="RHT does not help fprop",
        source="NVFP4 pretraining (arXiv 2509.25149): no RHT on fprop/dgrad",
        measured=f"direct cast, loss with minus without RHT on fprop = {_fmt(d)} nats/token",
        verdict=_verdict_no_help(d["ci95"])))

    sr = g[RN_BACKWARD + ",quant-stochastic-rounding=all"]["draws"]
    rn = g[RN_BACKWARD]["vs_fp32"]["rel_l2"]
    ratio = sr["rel_l2"][-1] / sr["rel_l2"][0]
    unbiased = sr["rel_l2"][-1] < rn and sr["log_log_slope"] < -0.25
    rows.append(dict(
        claim="Stochastic rounding is unbiased, round-to-nearest is not",
        source="Tseng et al. (arXiv 2502.20586); NVFP4 pretraining (SR on gradients)",
        measured=f"backward in NVFP4: RN rel L2 {rn:.4g} (every draw the same); mean of K SR "
                 f"draws {sr['rel_l2'][0]:.4g} (K={sr['K'][0]}) -> {sr['rel_l2'][-1]:.4g} "
                 f"(K={sr['K'][-1]}), ratio {ratio:.3f}, log-log slope "
                 f"{sr['log_log_slope']:.2f} (1/sqrt(K): -0.5, then the bf16 floor)",
        verdict="agrees" if unbiased else "disagrees"))

    floor = direct["schemes"]["linear_mxfp8"].get("forward_operands") or {}
    rceil = direct["schemes"][MXFP8_RCEIL].get("forward_operands") or {}
    fs, rs = floor.get("saturated_pct", {}), rceil.get("saturated_pct", {})
    d = paired_delta(seq(MXFP8_RCEIL), seq("linear_mxfp8"), seq.tokens)
    more = fs.get("worst", 0) > rs.get("worst", 0)
    rows.append(dict(
        claim="MXFP8 with the OCP floor scale saturates more than with rceil",
        source="MXFP8 recipe (arXiv 2506.08027): rceil scales; the OCP floor clips",
        measured=f"saturated share of forward operands, worst (median): floor "
                 f"{fs.get('worst', 0):.3g}% ({fs.get('median', 0):.3g}%), rceil "
                 f"{rs.get('worst', 0):.3g}% ({rs.get('median', 0):.3g}%) on one micro-batch; "
                 f"loss rceil minus floor {_fmt(d)} nats/token",
        verdict="agrees" if more else "disagrees"))
    return rows


def markdown(rows: List[Dict[str, str]]) -> str:
    lines = ["| claim | source | measured here (95% interval) | verdict |",
             "|---|---|---|---|"]
    lines += [f"| {r['claim']} | {r['source']} | {r['measured']} | {r['verdict']} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def write(rows: List[Dict[str, str]], outdir: str) -> None:
    with open(os.path.join(outdir, "claims.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(outdir, "claims.md"), "w") as f:
        f.write(markdown(rows))
