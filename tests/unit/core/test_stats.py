"""Summary statistics against numpy and against hand-computed values."""

import numpy as np
import pytest

from kdbench.core.stats.repeats import NOISY_REL_IQR
from kdbench.core.stats.samples import summarize


def test_hand_computed_small_sample():
    s = summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s.n == 5
    assert s.median_ms == 3.0
    assert s.mean_ms == 22.0
    assert s.min_ms == 1.0 and s.max_ms == 100.0
    assert s.iqr_ms == 2.0  # p75 = 4, p25 = 2 (linear interpolation)
    assert s.p05_ms == pytest.approx(1.2)  # 1 + 0.05 * 4 * (2 - 1)
    assert s.p95_ms == pytest.approx(80.8)  # 4 + 0.8 * (100 - 4)
    assert (s.p25_ms, s.p75_ms) == (2.0, 4.0)
    assert s.p90_ms == pytest.approx(61.6)  # 4 + 0.6 * (100 - 4)
    assert s.p99_ms == pytest.approx(96.16)  # 4 + 0.96 * (100 - 4)
    assert s.std_ms == pytest.approx(np.sqrt(((np.array([1, 2, 3, 4, 100]) - 22.0) ** 2).sum() / 4))
    assert s.rel_iqr == pytest.approx(2 / 3)
    assert s.noisy


def test_equals_numpy_on_random_samples():
    rng = np.random.default_rng(7)
    raw = rng.lognormal(mean=3.0, sigma=0.2, size=257)
    s = summarize(raw.tolist())
    assert s.median_ms == pytest.approx(np.median(raw))
    assert s.mean_ms == pytest.approx(raw.mean())
    assert s.std_ms == pytest.approx(raw.std(ddof=1))
    assert s.iqr_ms == pytest.approx(np.percentile(raw, 75) - np.percentile(raw, 25))
    assert s.p05_ms == pytest.approx(np.percentile(raw, 5))
    assert s.p95_ms == pytest.approx(np.percentile(raw, 95))
    for q in (25, 75, 90, 99):
        assert getattr(s, f"p{q}_ms") == pytest.approx(np.percentile(raw, q))
    assert s.iqr_ms == pytest.approx(s.p75_ms - s.p25_ms)
    assert (s.min_ms, s.max_ms) == (raw.min(), raw.max())


def test_noisy_flag_threshold():
    quiet = summarize([10.0, 10.1, 10.2, 10.3, 10.4])
    assert quiet.rel_iqr == pytest.approx(0.2 / 10.2)
    assert not quiet.noisy
    assert NOISY_REL_IQR == 0.10


def test_single_sample_and_empty():
    s = summarize([5.0])
    assert (s.n, s.median_ms, s.std_ms, s.iqr_ms) == (1, 5.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        summarize([])
