"""How the repeats of one measurement pool into one figure, and how two pools compare: the statistics
every verdict and every pooled figure of kdbench uses (compare, budgets, break-even, the report).

A measurement (a cell's step, or an inference at one batch size) is measured once per *repeat*, each
repeat in a fresh worker process (``repeat: N``).  Inside a process the iterations are tight; from one
process to the next the level moves (allocator state, memory placement, clocks, the machine's other
load) by more than the iterations of one process can show.  So the repeat is the unit:

* **centre**: the geometric mean of the repeats' medians (with one repeat, its median);
* **interval of a ratio NEW/BASE**: Student's t on the logs of the repeat medians, with the variance
  pooled over both sides (df = r_base + r_new − 2) and floored at the sampling variance of one
  repeat's median (a repeat's median moves at least by its own sampling noise).  With one repeat on
  each side there is no between-process variance to estimate (df = 0): no interval can hold the
  run-to-run noise, and :func:`t_ratio` says so by returning None;
* **a family of measurements** (:func:`simultaneous_t`): each variance moderated towards the family's
  (Smyth's empirical Bayes, the "moderated t" of limma, its prior weighted half: :func:`fit_prior`),
  floored at the family's median, and the bounds Bonferroni-simultaneous in both directions (:func:`each_level`);
* **a sequence of looks** (``compare --rerun-undecided``: the undecided measurements measured again):
  ``alpha`` shared out over the looks by an O'Brien–Fleming-type spending function (:func:`spending`);
* **within-process interval** (one repeat per side, shown but not gated on unless asked): a percentile
  bootstrap of the iterations (:func:`bootstrap_ratio`), whose resampled medians are drawn from their
  order statistics' Beta laws (each draw O(1));
* **paired interval** (two cells measured in the same repeats, e.g. a lever against its twin): the
  per-repeat differences' t-interval (:func:`paired_t`, scipy's ``ttest_1samp``).
* **noisy**: a measurement whose IQR / median is above ``NOISY_REL_IQR`` (one repeat's samples, or
  the pooled figures in the report): its median is read with care.

Torch-free (numpy, scipy): the report and the store use it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

NOISY_REL_IQR = 0.10  # IQR / median above this marks a measurement (a repeat, or the repeats pooled) noisy

# A repeat's median, from n samples of spread s (in logs), varies with variance about (π/2) s² / n: the
# asymptotic variance of a sample median of normal data.  The spread comes from the MAD, robust to the
# stray slow iterations every timed loop has.
_MEDIAN_VARIANCE = math.pi / 2
_MAD_TO_SIGMA = 1.482602218505602  # 1 / Φ⁻¹(3/4)


@dataclass(frozen=True)
class RatioInterval:
    """A ratio NEW/BASE of two centres and its confidence interval."""

    ratio: float
    low: float
    high: float
    confidence: float
    method: str  # "t" (between repeats) or "bootstrap" (the iterations of one process)
    df: float | None = None  # t's degrees of freedom (the prior's included, when moderated)

    def describe(self) -> str:
        if self.method == "t":
            return f"t on log repeat medians, df {self.df:g}"
        return "bootstrap of the iterations of one process per side"


def centre(values: Sequence[float]) -> float:
    """The centre of a measurement's repeats: the geometric mean of their values (medians, or any
    positive statistic); the arithmetic mean when a value is not positive; NaN for none."""
    a = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    if a.size == 0:
        return math.nan
    if a.size == 1:
        return float(a[0])
    if (a > 0).all():
        return float(np.exp(np.log(a).mean()))
    return float(a.mean())


def median_log_variance(samples: Sequence[float]) -> float:
    """The sampling variance of the log of the median of ``samples`` (0 with fewer than 2 positive ones)."""
    a = np.asarray(samples, dtype=float)
    a = a[np.isfinite(a) & (a > 0)]
    if a.size < 2:
        return 0.0
    logs = np.log(a)
    spread = _MAD_TO_SIGMA * float(np.median(np.abs(logs - np.median(logs))))
    return _MEDIAN_VARIANCE * spread**2 / a.size


def t_ratio(
    base: Sequence[float],
    new: Sequence[float],
    confidence: float,
    floor: float = 0.0,
    prior: tuple[float, float] | None = None,
) -> RatioInterval | None:
    """NEW/BASE of the geometric means of ``new`` and ``base`` (repeat medians, all positive) and its
    two-sided t-interval at ``confidence``: the difference of the mean logs, the variance pooled over
    both sides, df = len(base) + len(new) − 2.  With a ``prior`` (s0², d0) the variance is moderated,
    (d0·s0² + df·s²) / (d0 + df), on df + d0 degrees of freedom; then it is at least ``floor`` (a
    variance of one log value).  None with fewer than three values in all (df 0: the between-repeat
    variance is unknown).

    Without a prior and a floor it is scipy's ``ttest_ind(log new, log base).confidence_interval`` (a
    test checks)."""
    return _t_ratios([(base, new, floor)], confidence, prior)[0]


def _summary(base: Sequence[float], new: Sequence[float]) -> tuple[float, float, int, int] | None:
    """(mean log new − mean log base, the sum of squared deviations of the logs within each side, len(base),
    len(new)) of one measurement; None with df 0."""
    b, n = np.log(np.asarray(base, dtype=float)), np.log(np.asarray(new, dtype=float))
    if b.size == 0 or n.size == 0 or b.size + n.size < 3:
        return None
    mb, mn = b.mean(), n.mean()
    return float(mn - mb), float(((b - mb) ** 2).sum() + ((n - mn) ** 2).sum()), b.size, n.size


def _t_ratios(
    family: Sequence[tuple[Sequence[float], Sequence[float], float]],
    confidence: float,
    prior: tuple[float, float] | None = None,
    summaries: Sequence[tuple[float, float, int, int] | None] | None = None,
) -> list[RatioInterval | None]:
    """:func:`t_ratio` of each (base, new, floor) of ``family`` at one ``confidence`` and ``prior``, with one
    call of scipy's t quantile for all of them (a simulation judges thousands of families); ``summaries``
    (:func:`_summary` of each) when the caller has them."""
    from scipy import stats

    if summaries is None:
        summaries = [_summary(b, n) for b, n, _ in family]
    parts = []
    for (_, _, floor), summary in zip(family, summaries):
        if summary is None:
            parts.append(None)
            continue
        diff, squares, nb, nn = summary
        df = nb + nn - 2
        variance, dof = squares / df, float(df)
        if prior is not None and prior[1] > 0:
            s0, d0 = prior
            variance, dof = (d0 * s0 + df * variance) / (d0 + df), df + d0
        parts.append((diff, max(variance, floor) * (1 / nb + 1 / nn), dof))
    known = [p for p in parts if p is not None]
    if not known:
        return [None] * len(parts)
    quantiles = iter(np.atleast_1d(stats.t.ppf(0.5 + confidence / 2, [dof for _, _, dof in known])))
    out: list[RatioInterval | None] = []
    for p in parts:
        if p is None:
            out.append(None)
            continue
        diff, spread, dof = p
        half = float(next(quantiles)) * math.sqrt(spread)
        out.append(
            RatioInterval(math.exp(diff), math.exp(diff - half), math.exp(diff + half), confidence, "t", round(dof, 1))
        )
    return out


def pooled_log_variance(base: Sequence[float], new: Sequence[float]) -> float | None:
    """The between-repeat variance of a measurement's log medians, pooled over both sides (None: df 0)."""
    summary = _summary(base, new)
    return None if summary is None else summary[1] / (summary[2] + summary[3] - 2)


PRIOR_WEIGHT = 0.5  # the prior's degrees of freedom count half: a suite has tens of measurements, not thousands


def _trigamma_inverse(x: float) -> float:
    """y with trigamma(y) = x (Smyth's Newton iteration, as limma's trigammaInverse)."""
    from scipy import special

    y = 0.5 + 1 / x if x < 1e6 else 1 / math.sqrt(x)
    for _ in range(50):
        tri = float(special.polygamma(1, y))
        step = tri * (1 - tri / x) / float(special.polygamma(2, y))
        y += step
        if -step / y < 1e-8:
            break
    return y


def fit_prior(variances: Sequence[float], dfs: Sequence[int]) -> tuple[float, float]:
    """(s0², d0): the scaled inverse-χ² law of a family's variances, fitted by the moments of their logs
    (Smyth 2004, *Linear models and empirical Bayes methods for assessing differential expression*, as
    limma's ``fitFDist``), d0 counted at :data:`PRIOR_WEIGHT` and at most the family's own degrees of
    freedom.  d0 = 0 (no moderation) with fewer than three variances."""
    from scipy import special

    v, d = np.asarray(variances, dtype=float), np.asarray(dfs, dtype=float)
    keep = (v > 0) & np.isfinite(v)
    v, d = v[keep], d[keep]
    if v.size < 3:
        return 0.0, 0.0
    e = np.log(v) - special.digamma(d / 2) + np.log(d / 2)
    excess = float(np.var(e, ddof=1) - np.mean(special.polygamma(1, d / 2)))
    total = float(d.sum())
    if excess <= 0:  # no more spread than sampling alone: one variance for all
        d0 = math.inf
        s0 = math.exp(float(e.mean()))
    else:
        d0 = 2 * _trigamma_inverse(excess)
        s0 = math.exp(float(e.mean()) + float(special.digamma(d0 / 2)) - math.log(d0 / 2))
    return s0, min(PRIOR_WEIGHT * d0, total)


def each_level(confidence: float, m: int) -> float:
    """The two-sided level of each of m intervals whose bounds, upper and lower, hold together at ``confidence``:
    1 − (1 − confidence)/m (Bonferroni over the 2m one-sided bounds, each at 1 − (1 − confidence)/(2m)).  When
    nothing changed, the chance that *any* measurement is called different, regressed or improved, is then at
    most 1 − confidence.  (Bounds at 1 − (1 − confidence)/m each, as kdbench had them until issue 45, held that
    rate for each direction alone: twice it for a false verdict either way, and two runs of the same code read
    "improved" beyond the stated rate.)"""
    return max(0.0, 1 - (1 - confidence) / max(1, m))


def spending(alpha: float, looks: int) -> list[float]:
    """The share of ``alpha`` each of ``looks`` equally spaced looks of a sequential comparison may spend: the
    increments of Lan and DeMets' O'Brien–Fleming-type spending function α(t) = 2 − 2Φ(z₁₋α/₂ / √t) at
    t = 1/L, 2/L, ... 1 (Lan & DeMets 1983, *Discrete sequential boundaries for clinical trials*, Biometrika
    70:659).  They sum to ``alpha``; each look judges at its own share (Bonferroni over the looks, which holds
    whatever the looks' dependence), so the chance of a false regression over the whole sequence is at most
    ``alpha``.  The early looks, on few repeats, spend little; the last keeps most of it.  One look: [alpha]."""
    from scipy import stats

    if looks < 1:
        raise ValueError(f"looks must be at least 1, got {looks}")
    t = np.arange(1, looks + 1) / looks
    spent = 2 - 2 * stats.norm.cdf(stats.norm.ppf(1 - alpha / 2) / np.sqrt(t))
    spent[-1] = alpha  # α(1) = alpha exactly
    return [float(x) for x in np.diff(np.concatenate([[0.0], spent]))]


def simultaneous_t(
    family: Sequence[tuple[Sequence[float], Sequence[float], float]], confidence: float, size: int | None = None
) -> list[RatioInterval | None]:
    """The t-intervals (:func:`t_ratio`) of a family of measurements, each given as (base repeat medians, new
    repeat medians, sampling-variance floor), each at :func:`each_level` (m = ``size``, else the measurements
    that have an interval), so that no false verdict, a regression or an improvement, is called with more than
    1 − ``confidence`` chance in the whole family.

    With a handful of repeats a measurement's own variance is a poor estimate (with 3 + 3 repeats, one in
    ten is under a third of the truth, and a low estimate is what makes a false alarm) on few degrees of
    freedom (which makes the intervals of a real change wide).  So each variance is moderated towards the
    family's (:func:`fit_prior`), which adds the prior's degrees of freedom, and is then at least its floor
    and the family's median pooled variance (flooring only widens).  ``tests/unit/report/test_compare.py`` shows the
    false-alarm rate within its bound under normal, heavy-tailed, two-state and mixed-noise families."""
    summaries = [_summary(b, n) for b, n, _ in family]
    variances = [x[1] / (x[2] + x[3] - 2) for x in summaries if x is not None]
    dfs = [x[2] + x[3] - 2 for x in summaries if x is not None]
    typical = float(np.median(variances)) if variances else 0.0
    prior = fit_prior(variances, dfs)
    m = size if size is not None else len(variances)
    each = each_level(confidence, m)
    return _t_ratios([(b, n, max(floor, typical)) for b, n, floor in family], each, prior, summaries)


def centre_interval(values: Sequence[float], confidence: float = 0.95, floor: float = 0.0):
    """(centre, low, high) of one measurement's repeat values: the geometric mean and its t-interval
    (df = r − 1, the log variance floored at ``floor``); low and high are None with one value."""
    from scipy import stats

    a = np.asarray([v for v in values if v is not None and math.isfinite(v) and v > 0], dtype=float)
    if a.size == 0:
        return math.nan, None, None
    logs = np.log(a)
    mid = float(logs.mean())
    if a.size == 1:
        return math.exp(mid), None, None
    variance = max(float(logs.var(ddof=1)), floor)
    half = float(stats.t.ppf(0.5 + confidence / 2, a.size - 1)) * math.sqrt(variance / a.size)
    return math.exp(mid), math.exp(mid - half), math.exp(mid + half)


def paired_t(differences: Sequence[float], confidence: float = 0.95) -> tuple[float, float | None, float | None]:
    """(mean, low, high) of per-repeat differences with scipy's one-sample t-interval (df = r − 1);
    low and high are None with one difference, and equal the mean when every difference is the same."""
    from scipy import stats

    d = np.asarray([x for x in differences if x is not None and math.isfinite(x)], dtype=float)
    if d.size == 0:
        return math.nan, None, None
    mean = float(d.mean())
    if d.size == 1:
        return mean, None, None
    if np.ptp(d) == 0:
        return mean, mean, mean
    low, high = stats.ttest_1samp(d, 0.0).confidence_interval(confidence)
    return mean, float(low), float(high)


# --------------------------------------------------------------------------- within one process


def median_draws(x: np.ndarray, size: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Draws of the median of a bootstrap resample of ``x`` (n values, with replacement), without
    building the resamples.

    The k-th smallest of n draws from the empirical distribution is ``sorted(x)[ceil(n U) - 1]``
    with U the k-th smallest of n uniforms, which is Beta(k, n + 1 - k); for even n the next
    order statistic is U + (1 - U) Beta(1, n - k).  So each draw costs O(1), not O(n).
    """
    s = np.sort(np.asarray(x, dtype=float))
    n = s.size
    if n == 1:
        return np.full(size, s[0])

    def at(u: np.ndarray) -> np.ndarray:
        return s[np.clip(np.ceil(u * n).astype(np.int64) - 1, 0, n - 1)]

    k = (n + 1) // 2
    u = rng.beta(k, n + 1 - k, size)
    if n % 2:
        return at(u)
    v = u + (1 - u) * rng.beta(1, n - k, size)
    return (at(u) + at(v)) / 2


N_BOOT = 5000  # bootstrap draws at least; more when an interval reaches far into the tails
MAX_BOOT = 100_000


def bootstrap_ratio(
    base: Sequence[float], new: Sequence[float], confidence: float, seed: int = 0, n_boot: int | None = None
) -> RatioInterval:
    """NEW/BASE of the medians of two processes' iterations and its percentile-bootstrap interval: the
    noise within one process per side, which understates the noise from run to run."""
    tail = (1 - confidence) / 2
    n_boot = n_boot or min(MAX_BOOT, max(N_BOOT, math.ceil(20 / tail)))  # some 20 draws beyond each end
    rng = np.random.default_rng(seed)
    b, n = np.asarray(base, dtype=float), np.asarray(new, dtype=float)
    boot = median_draws(n, (n_boot,), rng) / median_draws(b, (n_boot,), rng)
    low, high = np.quantile(boot, [tail, 1 - tail])
    return RatioInterval(float(np.median(n) / np.median(b)), float(low), float(high), confidence, "bootstrap")
