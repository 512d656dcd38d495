"""The sequential design of `compare --rerun-undecided` in pure numbers: alpha spent over the looks, the power to
find a one-cell slowdown within the cap, the false-alarm rate over the whole sequence, and the figures
docs/verdicts.md states (simulated by benchmarks/verdict_calibration.py, whose `sequential` runs compare's own
intervals, verdicts and undecided rule).  The noise is the 15 % process-to-process spread of the 2-core VM's
missed copies (benchmarks/README.md: a step's three repeats over 119-163 ms), at which three repeats find a 1.5x
step about as often as they did there (5 of 8)."""

from __future__ import annotations

import importlib.util
import re

import pytest
from scipy import stats

from kdbench.core.stats.repeats import spending
from kdbench.report.compare.verdicts import Verdict, undecided
from tests.support.paths import ROOT

_spec = importlib.util.spec_from_file_location("verdict_calibration", ROOT / "benchmarks" / "verdict_calibration.py")
CAL = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(CAL)


def test_alpha_is_spent_obrien_fleming_like_over_the_looks():
    assert spending(0.05, 1) == [0.05]
    two = spending(0.05, 2)
    assert two[0] == pytest.approx(2 - 2 * stats.norm.cdf(stats.norm.ppf(0.975) * 2**0.5))  # α(1/2) ≈ 0.0056
    assert two[0] == pytest.approx(0.00557, abs=1e-5) and sum(two) == pytest.approx(0.05, abs=1e-15)
    seven = spending(0.05, 7)
    assert sum(seven) == pytest.approx(0.05, abs=1e-15) and seven == sorted(seven) and seven[0] < 1e-6
    with pytest.raises(ValueError):
        spending(0.05, 0)


def test_what_is_undecided():
    t = 0.05
    assert undecided(Verdict.UNJUDGED, None, None, t)  # one repeat a side: more repeats can judge it
    assert undecided(Verdict.UNCHANGED, 1.2, 1.6, t)  # straddles 1 + threshold
    assert undecided(Verdict.UNCHANGED, 1.03, 1.08, t)  # above 1, ratio under the threshold, interval beyond it
    assert not undecided(Verdict.UNCHANGED, 1.01, 1.04, t)  # no regression beyond the threshold is left
    assert not undecided(Verdict.UNCHANGED, 0.97, 1.2, t)  # reads faster: let go (futility)
    assert not undecided(Verdict.REGRESSED, 1.6, 2.0, t) and not undecided(Verdict.IMPROVED, 0.5, 0.8, t)


def test_a_one_cell_one_and_a_half_times_slowdown_is_caught_in_19_of_20_within_the_cap():
    """20 simulated comparisons of 20 measurements at 3 repeats a side, up to 6 rounds more: the slow step is
    called regressed in at least 19 (without the reruns, about half: the table in docs/verdicts.md)."""
    assert CAL.sequential(1.5, 20, seed=7)["found"] >= 19 / 20


def test_a_a_sequences_keep_the_family_wise_false_alarm_rate():
    """Over 300 simulated A/A sequences (up to 7 looks each) the gate fails in at most 5 % plus the binomial
    margin (99.9 %), and the unchanged measurements that read faster stop early (futility)."""
    trials = 300
    result = CAL.sequential(1.0, trials, seed=3)
    assert result["false_alarm"] * trials <= stats.binom.ppf(0.999, trials, 0.05)
    assert result["extra_repeats"] < 0.6 * CAL.M * CAL.SEQ_ROUNDS  # fewer than all measurements at every round


def _docs_table() -> dict[str, list[float]]:
    text = (ROOT / "docs" / "verdicts.md").read_text()
    table = text.split("<!-- sequential-power -->")[1].split("<!-- /sequential-power -->")[0]
    rows = [line for line in table.strip().splitlines() if line.startswith("| `")]
    return {row.split("|")[1].strip(): [float(x) for x in re.findall(r"([0-9.]+)%", row)] for row in rows}


def test_the_docs_state_the_simulated_power():
    """docs/verdicts.md's table (1,000 simulated comparisons a figure) against 100 fresh ones (50 at 2x, which
    is found at once): within four binomial standard errors plus a point."""
    table = _docs_table()
    rerun = table[f"`--repeat {CAL.SEQ_REPEATS}`, `--rerun-undecided {CAL.SEQ_ROUNDS}`"]
    assert len(rerun) == 1 + len(CAL.SEQ_RATIOS) and rerun[0] <= 5.0
    for slow, stated in zip(CAL.SEQ_RATIOS, rerun[1:]):
        trials = 50 if slow >= 2 else 100
        found = CAL.sequential(slow, trials, seed=int(slow * 100))["found"]
        p = stated / 100
        assert abs(found - p) <= 4 * (max(p * (1 - p), 0.01) / trials) ** 0.5 + 0.01, (slow, found, stated)
    assert rerun[2] >= 95.0  # the 1.5x power the sequence is for
