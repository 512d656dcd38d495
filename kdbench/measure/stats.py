"""Summary statistics of raw timing samples (milliseconds)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

NOISY_REL_IQR = 0.10  # IQR / median above this marks a measurement noisy


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

    def as_row(self) -> dict:
        return asdict(self)


def summarize(samples_ms: Sequence[float]) -> Summary:
    """Median, IQR (p75 - p25), p5/p25/p75/p90/p95/p99, mean, std (ddof=1), min, max; percentiles
    by numpy's default linear interpolation."""
    a = np.asarray(samples_ms, dtype=np.float64)
    if a.size == 0:
        raise ValueError("no samples to summarize")
    p05, p25, p50, p75, p90, p95, p99 = np.percentile(a, [5, 25, 50, 75, 90, 95, 99])
    iqr = float(p75 - p25)
    rel = iqr / float(p50) if p50 > 0 else float("inf")
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
    )
