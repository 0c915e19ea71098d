"""megatron/evaluation/claims.py: the verdicts follow the intervals of the numbers given.

The inputs are built by hand (per-sequence sums with a known shift and spread, gradient errors
per micro-batch), so the expected verdicts follow from the construction.
"""

import numpy as np
import pytest

from megatron.evaluation import claims

M = 40          # sequences
N_TOK = 100     # tokens per sequence


def _inputs(tmp_path, nvfp4_shift, last_minus_first, wgrad_rht_shift, sr_slope,
            four_over_six_shift=-0.01):
    rng = np.random.default_rng(0)
    base = rng.normal(600.0, 20.0, M)
    noise = lambda: rng.normal(0.0, 0.5, M)       # noqa: E731  (sum over 100 tokens)
    arms = {"bf16": base, "linear_mxfp4": base + 3.0 + noise(),
            "linear_nvfp4": base + 3.0 + nvfp4_shift * N_TOK + noise(),
            claims.RHT_FPROP: base + 3.0 + nvfp4_shift * N_TOK + 0.5 + noise(),
            claims.FOUR_OVER_SIX: base + 3.0 + (nvfp4_shift + four_over_six_shift) * N_TOK +
            noise(),
            "linear_mxfp8": base + 0.2 + noise(), claims.MXFP8_RCEIL: base + 0.1 + noise()}
    sites = []
    for layer in (1, 2):
        for site in ("qkv", "fc1"):
            key = f"{layer}/{site}"
            shift = 0.5 + (last_minus_first * N_TOK / 2 if layer == 2 else 0.0)
            arms[f"sweep:{key}"] = base + shift + noise()
            sites.append({"layer": layer, "site": site, "key": key})
    labels = list(arms)
    np.savez(tmp_path / "sequences.npz", labels=np.array(labels),
             tokens=np.full(M, N_TOK), sums=np.stack([arms[k] for k in labels]))
    direct = {"sweep": {"scheme": "FA_linear_mxfp4", "sites": sites},
              "schemes": {"linear_mxfp8": {"forward_operands": {"saturated_pct": {
                              "worst": 0.02, "median": 0.001}}},
                          claims.MXFP8_RCEIL: {"forward_operands": {"saturated_pct": {
                              "worst": 0.0, "median": 0.0}}}}}

    def grad(errors):
        return {"vs_fp32": {"rel_l2": float(np.mean(errors)),
                            "per_micro_batch": {"rel_l2": list(errors)}}}

    wgrad = rng.normal(0.20, 0.01, 8)
    dgrad = rng.normal(0.10, 0.01, 8)
    ks = [1, 2, 4, 8, 16]
    sr = [0.3 * k ** sr_slope for k in ks]
    g = {claims.WGRAD: grad(wgrad),
         claims.WGRAD + ",quant-rht=16": grad(wgrad + wgrad_rht_shift + rng.normal(0, 1e-3, 8)),
         claims.DGRAD: grad(dgrad),
         claims.DGRAD + ",quant-rht=16,quant-rht-gemms=dgrad": grad(dgrad + 0.01),
         claims.RN_BACKWARD: grad([0.25] * 8),
         claims.RN_BACKWARD + ",quant-stochastic-rounding=all": dict(
             grad([0.3] * 8), draws={"K": ks, "rel_l2": sr,
                                     "log_log_slope": float(np.polyfit(np.log(ks),
                                                                       np.log(sr), 1)[0])})}
    return direct, str(tmp_path / "sequences.npz"), {"schemes": g}


def _verdicts(rows):
    return {r["claim"]: r["verdict"] for r in rows}


def test_verdicts_when_every_claim_holds(tmp_path):
    rows = claims.check(*_inputs(tmp_path, nvfp4_shift=-0.01, last_minus_first=0.02,
                                 wgrad_rht_shift=-0.05, sr_slope=-0.5))
    v = _verdicts(rows)
    assert all(verdict == "agrees" for verdict in v.values()), v
    assert len(rows) == 8
    nvfp4 = next(r for r in rows if r["claim"].startswith("NVFP4"))
    assert "-0.01" in nvfp4["measured"]


def test_verdicts_when_claims_fail_or_are_not_resolved(tmp_path):
    rows = claims.check(*_inputs(tmp_path, nvfp4_shift=0.0, last_minus_first=-0.02,
                                 wgrad_rht_shift=0.05, sr_slope=0.0,
                                 four_over_six_shift=0.02))
    v = _verdicts(rows)
    assert v["4/6 brings NVFP4 closer to BF16"] == "disagrees"
    assert v["NVFP4's error is below MXFP4's (16-element blocks, E4M3 scales)"] == \
        "not resolved (interval includes 0)"
    assert v["The last layers are more sensitive to FP4 than the first"] == "disagrees"
    assert v["RHT (16) lowers the wgrad error"] == "disagrees"
    assert v["Stochastic rounding is unbiased, round-to-nearest is not"] == "disagrees"


@pytest.mark.parametrize("arms", [claims.DIRECT_ARMS, claims.GRADIENT_ARMS])
def test_the_probes_arms_resolve(arms):
    """Every arm the probe evaluates is a valid spec for llama-tiny (4 layers): a bad one
    would stop `make probe` after its training."""
    from megatron.evaluation.specs import arm_config
    from megatron.training.arguments import parse_args, validate_args

    base = validate_args(parse_args(["--model-preset", "llama-tiny", "--mock-data", "--lr",
                                     "1e-3", "--train-iters", "1", "--micro-batch-size", "4",
                                     "--global-batch-size", "4"]), check_paths=False)
    for spec in arms:
        quant = arm_config(spec, base.quant_config.settings, base.num_layers, base.seed)
        assert quant.enabled == (spec != "bf16"), spec
