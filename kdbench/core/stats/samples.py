"""Summary statistics of raw timing samples (milliseconds)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np

from kdbench.core.stats.repeats import NOISY_REL_IQR


@dataclass(frozen=True)
class Summary:
    n: int
    median_ms: float
    mean_ms: float
    std_ms: float
    iqr_ms: float
    p05_ms: float
    p25_ms: float
    p75_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    min_ms: float
    max_ms: float
    rel_iqr: float
    noisy: bool
    median_ci_low_ms: float | None
    median_ci_high_ms: float | None

    def as_row(self) -> dict:
        return asdict(self)


def median_ci(samples_ms: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval of the median: the j-th and k-th smallest samples with
    j = ⌊(n − z√n)/2⌋ and k = ⌈1 + (n + z√n)/2⌉ (the binomial's normal approximation, as in Conover's
    *Practical Nonparametric Statistics*); (-inf, inf) with fewer than 6 samples."""
    a = np.sort(np.asarray(samples_ms, dtype=np.float64))
    n = a.size
    if n < 6:
        return -math.inf, math.inf
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    j = max(1, math.floor((n - z * math.sqrt(n)) / 2))
    k = min(n, math.ceil(1 + (n + z * math.sqrt(n)) / 2))
    return float(a[j - 1]), float(a[k - 1])


def summarize(samples_ms: Sequence[float]) -> Summary:
    """Median, IQR (p75 - p25), p5/p25/p75/p90/p95/p99, mean, std (ddof=1), min, max; percentiles
    by numpy's default linear interpolation."""
    a = np.asarray(samples_ms, dtype=np.float64)
    if a.size == 0:
        raise ValueError("no samples to summarize")
    p05, p25, p50, p75, p90, p95, p99 = np.percentile(a, [5, 25, 50, 75, 90, 95, 99])
    iqr = float(p75 - p25)
    rel = iqr / float(p50) if p50 > 0 else float("inf")
    low, high = median_ci(a)
    return Summary(
        n=int(a.size),
        median_ms=float(p50),
        mean_ms=float(a.mean()),
        std_ms=float(a.std(ddof=1)) if a.size > 1 else 0.0,
        iqr_ms=iqr,
        p05_ms=float(p05),
        p25_ms=float(p25),
        p75_ms=float(p75),
        p90_ms=float(p90),
        p95_ms=float(p95),
        p99_ms=float(p99),
        min_ms=float(a.min()),
        max_ms=float(a.max()),
        rel_iqr=rel,
        noisy=rel > NOISY_REL_IQR,
        median_ci_low_ms=low if math.isfinite(low) else None,
        median_ci_high_ms=high if math.isfinite(high) else None,
    )
