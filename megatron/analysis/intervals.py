"""95% intervals, in one place: the t interval of a mean (`mean_interval`, and `mean_std`), and
the paired differences between two evaluations of the same sequences (`paired_delta`).

Each sequence i has a summed loss S_i (scheme) and B_i (baseline) over its n_i scored tokens.
The reported difference is the per-token one, exactly the difference of the two mean losses:

    delta = sum(S_i - B_i) / sum(n_i)

a ratio estimator over sequences. Its standard error (the linearisation of the ratio; for equal
n_i it is the ordinary standard error of the per-sequence means) is

    se = sqrt(sum(e_i^2) / (m (m - 1))) / mean(n),   e_i = (S_i - B_i) - delta n_i

and the interval is delta +- t(0.975, m - 1) se over the m sequences. The percentile bootstrap
over sequences (resampling whole sequences, fixed seed) is reported beside it: where the
per-sequence differences are heavy-tailed or few, it is the one to read.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np
from scipy import stats

BOOTSTRAP_RESAMPLES = 2000
QUANTILES = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)


def paired_delta(scheme_sums: np.ndarray, baseline_sums: np.ndarray,
                 tokens: np.ndarray) -> Dict[str, object]:
    """delta, its t interval, its bootstrap interval and the per-sequence spread."""
    s, b, n = (np.asarray(a, dtype=np.float64) for a in (scheme_sums, baseline_sums, tokens))
    if not (s.shape == b.shape == n.shape) or s.ndim != 1:
        raise ValueError(f"per-sequence arrays must be 1-D and alike: {s.shape}, {b.shape}, "
                         f"{n.shape}")
    m = s.size
    diff = s - b
    delta = float(diff.sum() / n.sum())
    result = {"mean": delta, "sequences": int(m), "ci95": [float("nan"), float("nan")],
              "ci95_bootstrap": [float("nan"), float("nan")], "se": float("nan")}
    if m < 2:
        return result
    residual = diff - delta * n
    se = float(np.sqrt(np.sum(residual ** 2) / (m * (m - 1))) / n.mean())
    half = float(stats.t.ppf(0.975, m - 1)) * se
    result.update(se=se, ci95=[delta - half, delta + half],
                  ci95_bootstrap=bootstrap_interval(diff, n))
    per_sequence = diff / n
    result["sequence_skewness"] = float(stats.skew(per_sequence)) if m > 2 else float("nan")
    return result


def bootstrap_interval(diff: np.ndarray, tokens: np.ndarray,
                       resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> list:
    """Percentile interval of sum(diff)/sum(tokens) over sequences resampled with replacement."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, diff.size, size=(resamples, diff.size))
    ratios = diff[picks].sum(axis=1) / tokens[picks].sum(axis=1)
    lo, hi = np.quantile(ratios, [0.025, 0.975])
    return [float(lo), float(hi)]


def token_quantiles(per_token_diff: np.ndarray,
                    quantiles: Sequence[float] = QUANTILES) -> Dict[str, float]:
    """Quantiles of the per-token loss differences (scored tokens only)."""
    values = np.quantile(np.asarray(per_token_diff, dtype=np.float64), quantiles)
    return {f"q{q:g}": float(v) for q, v in zip(quantiles, values)}


def mean_std(values: Sequence[float]) -> Dict[str, Optional[float]]:
    """Mean and sample standard deviation (n - 1); mean None without values, std None below
    two."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return {"mean": None, "std": None}
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if v.size > 1 else None}


def mean_interval(values: Sequence[float]) -> Dict[str, object]:
    """Mean and t interval (Student's t, n - 1 degrees of freedom) of paired per-unit
    differences (per micro-batch, per seed); the interval is NaN below two values."""
    v = np.asarray(values, dtype=np.float64)
    mean = float(v.mean())
    if v.size < 2:
        return {"mean": mean, "ci95": [float("nan"), float("nan")], "n": int(v.size)}
    half = float(stats.t.ppf(0.975, v.size - 1) * v.std(ddof=1) / np.sqrt(v.size))
    return {"mean": mean, "ci95": [mean - half, mean + half], "n": int(v.size)}
