"""`kdbench compare`: verdicts with confidence intervals, on stored run folders of synthetic rows."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from io import StringIO
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from kdbench.cli import main
from kdbench.core.errors import EXIT_NOT_JUDGED
from kdbench.core.stats.repeats import bootstrap_ratio, median_draws, median_log_variance, simultaneous_t, t_ratio
from kdbench.report.compare.compare import compare_frames
from kdbench.report.compare.verdicts import Policy, Verdict, verdict_of
from kdbench.store import read_results
from kdbench.store.results import job_id, open_run
from tests.support.helpers import write_suite
from tests.support.rows import result_row
from tests.support.suites import tiny_suite

CELLS = {"cell-a": "resnet56->resnet20 kd fp32 bs32", "cell-b": "resnet32x4->resnet8x4 kd bf16 bs32"}
MEASUREMENTS = (("distill_step", 32, 40.0), ("student_inference", 1, 2.0), ("teacher_inference", 1, 6.0))


def _rows(run_id: str, scale: dict | None = None, repeats: int = 1, spread: float = 0.0, seed: int = 0, **status):
    """Rows of two cells x three measurements; ``scale[(cell, measurement)]`` multiplies the samples; each
    repeat is offset by up to ``spread`` (run-to-run noise); ``status[cell]`` marks a cell failed."""
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(repeats):
        level = 1 + spread * rng.uniform(-1, 1)
        for cell, label in CELLS.items():
            for measurement, bs, median in MEASUREMENTS:
                factor = (scale or {}).get((cell, measurement), 1.0) * level
                samples = (median * factor * rng.lognormal(0, 0.02, 60)).tolist()
                row = result_row(
                    run_id=run_id,
                    suite="s",
                    cell_id=cell,
                    cell_label=label,
                    repeat=r + 1 if repeats > 1 else None,
                    measurement=measurement,
                    batch_size=bs,
                    samples_ms=samples,
                    median_ms=float(np.median(samples)),
                    device_name="cpu-x",
                    timestamp=datetime(2026, 1, 1, tzinfo=UTC),
                )
                if status.get(cell):
                    row.update(status=status[cell], error="CUDA out of memory", samples_ms=None, median_ms=None)
                rows.append(row)
    return rows


def _run(tmp: Path, run_id: str, rows: list[dict]) -> Path:
    folder = open_run(tmp, "s", "s.yaml", run_id)
    for cell in {r["cell_id"] for r in rows}:
        for rep in sorted({r["repeat"] or 1 for r in rows}):
            part = [r for r in rows if r["cell_id"] == cell and (r["repeat"] or 1) == rep]
            if part:
                folder.write_part(job_id(cell, rep), part)
    return folder.path


def _cli(capsys, *args) -> tuple[int, str, str]:
    code = main(["compare", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_run_compared_with_itself_exits_0(tmp_path, capsys):
    base = _run(tmp_path, "base", _rows("base", repeats=3, spread=0.02))
    code, out, _ = _cli(capsys, base, base)
    assert code == 0
    assert "6 measurement(s) unchanged" in out and "no significant regression in 6 judged" in out
    assert f"note: BASE and NEW are the same folder ({base}, run base): a run compared with itself" in out
    cmp = compare_frames(read_results([base]), read_results([base]))
    assert {c.verdict for c in cmp.changes} == {Verdict.UNCHANGED}
    assert all(c.ratio == pytest.approx(1.0) and c.ci_low <= 1 <= c.ci_high for c in cmp.changes)
    assert all(c.method.startswith("t on log repeat medians, df ") and c.gated for c in cmp.changes)


def test_a_single_repeat_is_not_judged_unless_asked(tmp_path, capsys):
    """One repeat per side: the samples of one process cannot show the noise between runs.  A 1.5x slower
    step is shown, not judged (nothing judged: exit EXIT_NOT_JUDGED, saying why; --allow-unjudged exits 0);
    --gate-single-repeat judges it on that process's noise."""
    base = _run(tmp_path, "base", _rows("base"))
    new = _run(tmp_path, "new", _rows("new", {(cell, "distill_step"): 1.5 for cell in CELLS}))
    assert _cli(capsys, base, new, "--allow-unjudged")[0] == 0
    code, out, err = _cli(capsys, base, new)
    assert code == EXIT_NOT_JUDGED and not err
    assert "6 measurement(s) not judged" in out and "single repeat on each side" in out
    assert "verdict: nothing was judged" in out
    cmp = compare_frames(read_results([base]), read_results([new]))
    steps = [c for c in cmp.changes if c.measurement == "distill_step"]
    assert all(c.verdict == Verdict.UNJUDGED and c.ratio == pytest.approx(1.5, rel=0.03) for c in steps)
    assert cmp.rated == 0 and cmp.exit_code == EXIT_NOT_JUDGED
    code, out, err = _cli(capsys, base, new, "--gate-single-repeat")
    assert code == 1 and "REGRESSED (2) (fail the gate), worst first" in out
    assert err.count("regressed:") == 2 and "judged on the within-process interval" in out


def test_slower_step_samples_exit_1_and_name_the_cells(tmp_path, capsys):
    base = _run(tmp_path, "base", _rows("base", repeats=3, spread=0.02, seed=1))
    slow = {(cell, "distill_step"): 1.5 for cell in CELLS}
    new = _run(tmp_path, "new", _rows("new", slow, repeats=3, spread=0.02, seed=2))
    code, out, err = _cli(capsys, base, new)
    assert code == 1
    regressed = out.split("REGRESSED (2) (fail the gate), worst first:")[1].split("\n\n")[0]
    assert all(f"{label} · distill_step bs32" in regressed for label in CELLS.values())
    assert "inference" not in regressed
    assert err.count("regressed:") == 2
    cmp = compare_frames(read_results([base]), read_results([new]))
    for c in cmp.bad:
        assert c.ratio == pytest.approx(1.5, rel=0.05)
        assert 1.1 < c.ci_low < c.ratio < c.ci_high < 2.1


def test_a_change_within_the_threshold_is_not_a_regression(tmp_path, capsys):
    base = _run(tmp_path, "base", _rows("base", repeats=5, spread=0.002, seed=1))
    shifted = {(c, m): 1.03 for c in CELLS for m, _, _ in MEASUREMENTS}
    new = _run(tmp_path, "new", _rows("new", shifted, repeats=5, spread=0.002, seed=2))
    assert _cli(capsys, base, new, "--threshold", "5")[0] == 0
    cmp = compare_frames(read_results([base]), read_results([new]), threshold=0.05)
    assert all(c.ci_low > 1 for c in cmp.changes)  # significant, but smaller than the threshold
    code, out, _ = _cli(capsys, base, new, "--threshold", "1")
    assert code == 1 and "REGRESSED (6)" in out


def test_improvements_failures_skips_and_one_sided_cells_are_listed(tmp_path, capsys):
    base_rows = _rows("base", repeats=3) + [
        r | {"cell_id": "gone", "cell_label": "gone cell"} for r in _rows("base", repeats=3)[:1]
    ]
    base = _run(tmp_path, "base", base_rows)
    new_rows = _rows("new", {("cell-a", "student_inference"): 0.5}, repeats=3, seed=1, **{"cell-b": "oom"})
    new = _run(tmp_path, "new", new_rows)
    code, out, _ = _cli(capsys, base, new)
    assert code == 1  # cell-b failed in NEW only
    assert "FAILED (3) (fail the gate)" in out and "oom: CUDA out of memory" in out
    assert "IMPROVED (1)" in out and "student_inference bs1" in out.split("IMPROVED (1)")[1]
    assert "ONLY IN BASE (1)" in out and "gone cell" in out
    improved = compare_frames(read_results([new]), read_results([base]))
    assert {c.verdict for c in improved.changes if c.cell_id == "cell-b"} == {Verdict.FIXED}
    # A skip (a runtime missing on the NEW machine) is its own outcome: not a failure, unless asked.
    skipped = _run(tmp_path, "skipped", _rows("skipped", repeats=3, seed=2, **{"cell-b": "skipped"}))
    code, out, _ = _cli(capsys, base, skipped)
    assert code == 0 and "SKIPPED (3):" in out
    code, out, _ = _cli(capsys, base, skipped, "--fail-on-skipped")
    assert code == 1 and "SKIPPED (3) (fail the gate)" in out


def test_a_failed_new_repeat_fails_the_gate_unless_partial_runs_are_allowed(tmp_path, capsys):
    base = _run(tmp_path, "base", _rows("base", repeats=3, spread=0.01))
    rows = _rows("new", repeats=3, spread=0.01, seed=4)
    for r in rows:
        if r["cell_id"] == "cell-a" and r["repeat"] == 2:
            r.update(status="failed", error="worker died", samples_ms=None, median_ms=None)
    new = _run(tmp_path, "new", rows)
    code, out, _ = _cli(capsys, base, new)
    assert code == 1 and "FAILED (3)" in out and "NEW repeats: 2 ok, 1 failed (failed: worker died)" in out
    assert _cli(capsys, base, new, "--allow-partial")[0] == 0
    cmp = compare_frames(read_results([base]), read_results([new]), policy=Policy(allow_partial=True))
    partial = [c for c in cmp.changes if c.cell_id == "cell-a"]
    assert {c.new_repeats for c in partial} == {2} and {c.verdict for c in partial} == {Verdict.UNCHANGED}
    assert all("judged on the ok ones (--allow-partial)" in c.note for c in partial)


def test_thin_rows_are_shown_and_never_judged(tmp_path, capsys):
    base = _run(tmp_path, "base", _rows("base", repeats=3, spread=0.01))
    rows = _rows("new", {("cell-a", "distill_step"): 3.0}, repeats=3, seed=1)
    for r in rows:
        if (r["cell_id"], r["measurement"]) == ("cell-a", "distill_step"):
            r["thin"] = True
    new = _run(tmp_path, "new", rows)
    code, out, _ = _cli(capsys, base, new)
    assert code == 0 and "THIN (1):" in out and "NEW: 3 thin repeat(s) left out" in out
    assert "a time budget shrank them below min_iters" in out


def test_reused_teacher_copies_are_judged_once(tmp_path):
    """Cell b reuses cell a's teacher inference (a copy saying so): a teacher slowdown is one verdict."""

    def rows(run_id, scale):
        out = _rows(run_id, {(c, "teacher_inference"): scale for c in CELLS}, repeats=3, spread=0.01, seed=len(run_id))
        for r in out:
            if r["cell_id"] == "cell-b" and r["measurement"] == "teacher_inference":
                r["measured_in_cell"] = "cell-a"
        return out

    cmp = compare_frames(pd.DataFrame(rows("b", 1.0)), pd.DataFrame(rows("new", 2.0)))
    teacher = [c for c in cmp.changes if c.measurement == "teacher_inference"]
    assert [(c.cell_id, c.verdict) for c in teacher] == [("cell-a", Verdict.REGRESSED)]
    assert cmp.reused == 1 and cmp.rated == 5
    assert any("1 reused teacher inference copies are judged once" in n for n in cmp.notes())


def test_differences_in_threads_torch_and_device_are_named_at_the_top():
    def rows(run_id, **env):
        return [r | env for r in _rows(run_id, repeats=3, seed=len(run_id))]

    base = rows("b", cpu_threads=2, torch_version="2.14.1", backend="cpu")
    new = rows("nn", cpu_threads=1, torch_version="2.13.0", backend="cpu", device_name="cpu-y")
    notes = compare_frames(pd.DataFrame(base), pd.DataFrame(new)).notes()
    assert "different devices: cpu-x vs cpu-y" in notes
    assert "different cpu_threads: 2 vs 1" in notes and "different torch_version: 2.14.1 vs 2.13.0" in notes
    assert not any("backend" in n for n in notes)


def test_a_killed_new_run_is_incomplete_and_fails_the_gate(tmp_path, capsys):
    """A run folder knows what it planned: the cells a killed NEW run never stored fail the gate."""
    from kdbench.store.results import RunFolder

    base = _run(tmp_path, "base", _rows("base", repeats=3, spread=0.01))
    jobs = [job_id(c, r) for r in (1, 2, 3) for c in CELLS]
    RunFolder(base).start_invocation(jobs, jobs).finish(stored=jobs)
    assert RunFolder(base).state().complete
    rows = [r for r in _rows("new", repeats=3, spread=0.01, seed=3) if r["cell_id"] == "cell-a" or r["repeat"] == 1]
    new = _run(tmp_path, "new", rows)  # cell-b: repeat 1 stored, repeats 2 and 3 not
    RunFolder(new).start_invocation(jobs, jobs)  # started, never finished: killed
    code, out, err = _cli(capsys, base, new)
    assert code == 1
    assert "NEW is INCOMPLETE: 4 of 6 planned jobs stored; 1 invocation(s) did not finish" in out
    assert "MISSING (3) (fail the gate)" in out and "2 not stored (repeats 2, 3: NEW is incomplete)" in out
    assert "missing:" in err
    code, out, _ = _cli(capsys, base, new, "--allow-partial")
    assert code == 0
    gone = [r for r in rows if r["cell_id"] == "cell-a"]
    only_a = _run(tmp_path, "only-a", gone)
    RunFolder(only_a).start_invocation(jobs, jobs)
    code, out, _ = _cli(capsys, base, only_a)
    assert code == 1 and "MISSING (3) (fail the gate)" in out and "cell not stored (repeats 1, 2, 3)" in out


# --------------------------------------------------------------------------- the statistics


def test_the_t_interval_is_scipys_student_t_on_log_repeat_medians():
    rng = np.random.default_rng(7)
    for rb, rn in ((3, 3), (2, 5), (1, 2), (10, 10)):
        b, n = rng.lognormal(1.0, 0.05, rb), rng.lognormal(1.1, 0.05, rn)
        ours = t_ratio(b, n, 0.97)
        ref = stats.ttest_ind(np.log(n), np.log(b), equal_var=True).confidence_interval(0.97)
        assert ours.df == rb + rn - 2
        assert (np.log(ours.low), np.log(ours.high)) == pytest.approx((ref.low, ref.high), rel=1e-9)
        assert ours.ratio == pytest.approx(np.exp(np.log(n).mean() - np.log(b).mean()))
    assert t_ratio([1.0], [1.1], 0.95) is None  # df 0: no interval for the run-to-run noise
    wide = t_ratio([1.0, 1.0], [1.0, 1.0], 0.95, floor=0.01)  # identical repeats: the floor sets the width
    assert wide.low < 1 < wide.high


def test_interval_with_one_repeat_agrees_with_scipys_bootstrap():
    rng = np.random.default_rng(5)
    base, new = rng.lognormal(3, 0.1, 80), rng.lognormal(3.1, 0.1, 50)
    ours = bootstrap_ratio(base, new, 0.9, n_boot=20000)
    ref = stats.bootstrap(
        (base, new),
        lambda b, n, axis: np.median(n, axis=axis) / np.median(b, axis=axis),
        vectorized=True,
        method="percentile",
        confidence_level=0.9,
        n_resamples=20000,
        random_state=0,
    ).confidence_interval
    assert ours.ratio == pytest.approx(np.median(new) / np.median(base))
    assert ours.low == pytest.approx(ref.low, rel=0.01) and ours.high == pytest.approx(ref.high, rel=0.01)


@pytest.mark.parametrize("n", [1, 2, 9, 40])
def test_median_draws_match_resampling(n):
    x = np.random.default_rng(n).lognormal(0, 0.3, n)
    fast = median_draws(x, (40000,), np.random.default_rng(1))
    slow = np.median(x[np.random.default_rng(2).integers(0, n, (40000, n))], axis=1)
    assert np.quantile(fast, [0.05, 0.5, 0.95]) == pytest.approx(np.quantile(slow, [0.05, 0.5, 0.95]), rel=0.02)


def test_median_log_variance_is_the_sampling_variance_of_a_median():
    rng = np.random.default_rng(3)
    draws = rng.lognormal(0, 0.05, (4000, 31))
    observed = np.log(np.median(draws, axis=1)).var()
    predicted = np.mean([median_log_variance(d) for d in draws[:300]])
    assert predicted == pytest.approx(observed, rel=0.15)


def _aa_family(rng, r: int, m: int, process: float, within: float = 0.02, n: int = 30, tails: str = "normal"):
    """One synthetic comparison of m measurements, r repeats a side, nothing changed: each repeat's level
    moves by the process-to-process noise (lognormal; heavy-tailed; two process states; or mixed: half the
    measurements at 2 %, half at 12 %), its median by the within-process noise of n samples."""
    shape = (2, m, r)
    if tails == "normal":
        level = rng.normal(0, process, shape)
    elif tails == "t3":
        level = rng.standard_t(3, shape) * process / np.sqrt(3)
    elif tails == "mixed":
        level = rng.normal(0, 1, shape) * np.where(np.arange(m) % 2 == 0, 0.02, 0.12)[None, :, None]
    else:  # two process states, 30 % of processes 40 % slower: the bimodal noise seen on a 2-core VM
        level = np.where(rng.random(shape) < 0.3, np.log(1.4), 0.0)
    sampling = within * np.sqrt(np.pi / 2 / n)
    medians = np.exp(level + rng.normal(0, sampling, shape))
    return [(medians[0, j], medians[1, j], sampling**2) for j in range(m)]


def _false_alarms(
    r: int, process: float, trials: int, tails: str = "normal", m: int = 20, threshold: float = 0.05
) -> tuple[int, int, int]:
    """(comparisons with a false regression: the gate fails; with a false improvement; with either: a false
    verdict in some direction, what the family-wise rate bounds)."""
    rng = np.random.default_rng(1000 * r + int(process * 100) + len(tails) + m)
    regressed = improved = either = 0
    for _ in range(trials):
        family = _aa_family(rng, r, m, process, tails=tails)
        intervals = simultaneous_t(family, 0.95)
        if r == 1:  # not judged: no interval exists
            assert intervals == [None] * m
            continue
        verdicts = [verdict_of(iv, threshold) for iv in intervals]
        regressed += Verdict.REGRESSED in verdicts
        improved += Verdict.IMPROVED in verdicts
        either += Verdict.REGRESSED in verdicts or Verdict.IMPROVED in verdicts
    return regressed, improved, either


@pytest.mark.parametrize("r", [1, 2, 3, 5, 10])
def test_a_a_comparisons_raise_false_alarms_at_most_at_the_stated_rate(r):
    """Two runs of one suite, nothing changed, 20 measurements, r repeats a side: at 3 % and 10 %
    process-to-process noise (and with heavy-tailed, two-state and mixed noise at 3 repeats) the share of
    comparisons with a false verdict in either direction (any measurement called regressed or improved)
    stays within 5 % (binomial margin, 99.9 %)."""
    trials = 400
    limit = stats.binom.ppf(0.999, trials, 0.05)
    cases = [("normal", 0.03), ("normal", 0.10)]
    if r == 3:
        cases += [("t3", 0.05), ("two-state", 0.0), ("mixed", 0.0)]
    for tails, process in cases:
        regressed, improved, either = _false_alarms(r, process, trials, tails)
        assert either <= limit, (r, tails, process, regressed, improved, either)


def test_a_small_family_keeps_the_bound_too():
    """Six measurements (one small suite): the moderation's prior rests on few variances."""
    limit = stats.binom.ppf(0.999, 400, 0.05)
    for tails, process in (("normal", 0.05), ("mixed", 0.0)):
        assert _false_alarms(3, process, 400, tails, m=6)[2] <= limit, tails


def test_the_family_wise_rate_counts_improvements_as_regressions():
    """Issue 45: two runs of the same code read 3 of 10 cells "improved".  One measurement alone, normal noise,
    no threshold: nothing moderates or floors its interval (the prior needs several, the family's median is its
    own variance), so its t-interval is exact and the family-wise rate is reached, not merely bounded.  A false
    verdict either way happens in 5 % of 4,000 A/A comparisons, split evenly between the directions; with each
    direction given the whole 5 % (the bounds before) it was 10 %, beyond this test's margin."""
    trials = 4000
    regressed, improved, either = _false_alarms(3, 0.05, trials, m=1, threshold=0.0)
    low, high = stats.binom.ppf([0.0005, 0.9995], trials, 0.05)
    assert low <= either <= high, (regressed, improved, either)
    assert regressed + improved == either  # one measurement: never both
    assert abs(regressed - improved) <= 4 * (trials * 0.025) ** 0.5, (regressed, improved)


def test_a_true_one_and_a_half_times_slowdown_of_one_cell_is_found_at_three_repeats():
    """At 3 % process-to-process noise nearly always; at 10 % (this 2-core VM's) most of the time."""
    for process, share in ((0.03, 0.95), (0.10, 0.75)):
        rng = np.random.default_rng(11)
        found, trials = 0, 200
        for _ in range(trials):
            family = _aa_family(rng, 3, 20, process)
            base, new, floor = family[0]
            family[0] = (base, new * 1.5, floor)  # one cell's step, 1.5x slower
            verdicts = [verdict_of(iv, 0.05) for iv in simultaneous_t(family, 0.95)]
            found += verdicts[0] == Verdict.REGRESSED and Verdict.REGRESSED not in verdicts[1:]
        assert found >= share * trials, (process, found)


def test_the_moderated_variance_follows_smyths_prior():
    """fit_prior recovers the scaled inverse-chi-squared law the variances were drawn from (d0 counted half)."""
    from kdbench.core.stats.repeats import PRIOR_WEIGHT, fit_prior

    rng = np.random.default_rng(2)
    s0, d0, d = 0.01, 8.0, 4
    true = s0 * d0 / rng.chisquare(d0, 4000)  # per-measurement variances from the prior
    observed = true * rng.chisquare(d, 4000) / d  # each estimated on d degrees of freedom
    fitted_s0, fitted_d0 = fit_prior(observed, [d] * 4000)
    assert fitted_s0 == pytest.approx(s0, rel=0.1) and fitted_d0 == pytest.approx(PRIOR_WEIGHT * d0, rel=0.2)
    equal = 0.01 * rng.chisquare(d, 200) / d  # one variance for all: the prior weighs as much as the data
    assert fit_prior(equal, [d] * 200) == (pytest.approx(0.01, rel=0.2), 200 * d)
    assert fit_prior([0.1, 0.2], [4, 4]) == (0.0, 0.0)


def test_intervals_are_simultaneous_over_the_judged_measurements():
    """Each bound is at 1 - (1 - C)/(2m): with six judged measurements, upper and lower, 95 % for all of them
    together."""
    from kdbench.core.stats.repeats import fit_prior, pooled_log_variance

    base, new = _rows("b", repeats=3, spread=0.03), _rows("n", seed=3, repeats=3, spread=0.03)
    cmp = compare_frames(pd.DataFrame(base), pd.DataFrame(new), confidence=0.95)
    assert cmp.rated == 6 and cmp.each == pytest.approx(1 - 0.05 / 6)  # each bound at 1 - 0.05 / 12
    family = []
    for c in cmp.changes:
        pick = [(r["cell_id"], r["measurement"]) == (c.cell_id, c.measurement) for r in base]
        medians_b = [np.median(r["samples_ms"]) for r, p in zip(base, pick) if p]
        medians_n = [np.median(r["samples_ms"]) for r, p in zip(new, pick) if p]
        floors = [median_log_variance(r["samples_ms"]) for rows in (base, new) for r, p in zip(rows, pick) if p]
        family.append((medians_b, medians_n, max(np.mean(floors[:3]), np.mean(floors[3:]))))
    prior = fit_prior([pooled_log_variance(b, n) for b, n, _ in family], [4] * 6)
    typical = float(np.median([pooled_log_variance(b, n) for b, n, _ in family]))
    for c, (b, n, floor) in zip(cmp.changes, family):
        one = t_ratio(b, n, 0.95, floor=max(floor, typical), prior=prior)  # the same measurement, alone
        assert c.ci_low < one.low and c.ci_high > one.high
    for c, iv in zip(cmp.changes, simultaneous_t(family, 0.95)):
        assert (c.ci_low, c.ci_high) == pytest.approx((iv.low, iv.high), rel=1e-9)


def test_formats_and_out_file(tmp_path, capsys):
    base = _run(tmp_path, "base", _rows("base", repeats=2))
    new = _run(tmp_path, "new", _rows("new", {("cell-a", "distill_step"): 2.0}, repeats=2, seed=1))
    code, out, _ = _cli(capsys, base, new, "--format", "json")
    doc = json.loads(out)
    assert code == doc["exit_code"] == 1 and doc["regressions"] == doc["failing"] == 1
    assert doc["new"]["complete"] is None and doc["judged"] == 6 and doc["changes"][0]["fails_gate"] is True
    assert doc["changes"][0]["verdict"] == "regressed" and doc["changes"][0]["ratio"] == pytest.approx(2, rel=0.03)
    _, out, _ = _cli(capsys, base, new, "--format", "csv")
    table = pd.read_csv(StringIO(out))
    assert len(table) == 6 and table.loc[0, "cell_id"] == "cell-a" and table.loc[0, "verdict"] == "regressed"
    target = tmp_path / "cmp" / "compare.md"
    code, out, _ = _cli(capsys, base, new, "--format", "markdown", "--out", target)
    assert code == 1 and "verdict: FAIL, 1 measurement(s) fail the gate; comparison -> " in out
    text = target.read_text()
    assert (
        "| verdict | cell |" in text and "| regressed | resnet56->resnet20 kd fp32 bs32 | distill_step | 32 |" in text
    )


def test_bad_input_exits_2_with_one_line(tmp_path, capsys):
    base = _run(tmp_path, "base", _rows("base"))
    other = _run(tmp_path, "other", [r | {"cell_id": "x" + r["cell_id"]} for r in _rows("other")])
    code, _, err = _cli(capsys, base, other)
    assert code == 2 and "no cell in common" in err and len(err.strip().splitlines()) == 1
    junk = tmp_path.parent / f"{tmp_path.name}-junk.parquet"
    junk.write_text("not parquet")
    code, _, err = _cli(capsys, base, junk)
    assert code == 2 and "not a readable parquet file" in err
    code, _, err = _cli(capsys, tmp_path, base)  # a folder of two runs
    assert code == 2 and "holds 2 runs" in err
    code, _, err = _cli(capsys, base, base, "--threshold", "-3")
    assert code == 2 and "--threshold" in err
    code, _, err = _cli(capsys, base, base, "--out", tmp_path)
    assert code == 2 and "is a folder; give a file name" in err
    for flag in (
        "--allow-partial=yes",
        "--gate-single-repeat=1",
        "--fail-on-skipped=no",
    ):  # the new flags take no value
        code, _, err = _cli(capsys, base, base, flag)
        assert code == 2 and "ignored explicit argument" in err and len(err.strip().splitlines()) == 1, flag


def test_the_report_compares_with_a_baseline_regressions_first(tmp_path):
    from kdbench import api

    base = _run(tmp_path / "res", "base", _rows("base", repeats=3, spread=0.01))
    new = _run(
        tmp_path / "res",
        "new",
        _rows("new", {("cell-b", "distill_step"): 1.5, ("cell-a", "distill_step"): 0.6}, repeats=3, seed=1),
    )
    page = api.render([new], tmp_path / "rep", baseline=base).read_text()
    section = page.split('<h2 id="compare-1">')[1].split("<h2")[0]
    assert "Comparison: new against base" in section and "1 regression</span>" in section
    verdicts = re.findall(r'<tr class="compare-row[^"]*"><td>(?:<span class="\w+">)?(\w+)', section)
    assert verdicts == ["regressed", "improved"]  # the unchanged are counted, not listed
    assert "4 unchanged" in section and re.search(r">1\.(49\d|50\d)<", section)
    assert (tmp_path / "rep" / "compare_1.png").stat().st_size > 10_000
    assert 'src="compare_1.png"' in section
    # Without a baseline, two runs that share cells (the same suite on two machines) compare the same way.
    other = _run(tmp_path / "res", "other", [r | {"device_name": "gpu-y"} for r in _rows("other", repeats=3, seed=2)])
    page = api.render([tmp_path / "res" / "base", other], tmp_path / "rep2").read_text()
    assert "Comparison: other against base" in page and "different devices: cpu-x vs gpu-y" in page
    assert "compare-2" not in page


def test_one_line_says_when_base_and_new_are_the_same_run(tmp_path, capsys):
    """A single-repeat run against a copy of itself: not only "6 not judged", but why."""
    import shutil

    base = _run(tmp_path, "base", _rows("base"))
    copy = tmp_path / "elsewhere" / "base"
    shutil.copytree(base, copy)
    code, out, _ = _cli(capsys, base, copy)
    assert code == EXIT_NOT_JUDGED and "6 measurement(s) not judged" in out
    same = [line for line in out.splitlines() if "same run" in line]
    assert same == [
        "note: BASE and NEW are the same run (run id base, in two places): a run compared with itself, "
        "every ratio 1; give the run to judge as NEW"
    ]
    other = _run(tmp_path, "new", _rows("new", seed=1))
    assert "same run" not in _cli(capsys, base, other)[1]


def _suite_here(tmp_path, monkeypatch):
    """The folders' suite file `s.yaml`, in the working folder (as `kdbench run s.yaml` left it)."""
    monkeypatch.chdir(tmp_path)
    write_suite(tmp_path / "s.yaml", **tiny_suite(name="s"))


def test_rerun_undecided_measures_the_undecided_cells_again_until_decided(tmp_path, capsys, monkeypatch):
    """A 1.6x slower step under 12 % run-to-run noise: undecided at three repeats (the first look spends almost
    none of alpha); each round stores one more repeat of the undecided cells on both sides (here synthetic, through
    the same call), until the slow step is called regressed; the unchanged measurements that read faster are let go."""
    from kdbench.run import rerun

    _suite_here(tmp_path, monkeypatch)
    slow = {("cell-a", "distill_step"): 1.6}
    base = _run(tmp_path, "base", _rows("base", repeats=3, spread=0.12, seed=4))
    new = _run(tmp_path, "new", _rows("new", slow, repeats=3, spread=0.12, seed=5))
    calls = []

    def measure_again(sides, cells, round_):
        calls.append((sorted(s.name for s in sides), sorted(cells), round_))
        for s in sides:
            done = {job for job in s.folder.stored_job_ids()}
            for cell in cells:
                k = 1 + max(int(j.rsplit("-r", 1)[1]) if "-r" in j else 1 for j in done if j.startswith(cell))
                rows = _rows(s.folder.run_id, slow if s.name == "NEW" else None, repeats=k, spread=0.12, seed=10 + k)
                part = [r | {"repeat": k} for r in rows if r["cell_id"] == cell and r["repeat"] == k]
                s.folder.write_part(job_id(cell, k), part)
        return len(sides) * len(cells)

    monkeypatch.setattr(rerun, "measure_again", measure_again)
    code, out, err = _cli(capsys, base, new, "--rerun-undecided", "2")
    assert code == 1 and "regressed: resnet56->resnet20 kd fp32 bs32 · distill_step bs32" in err
    assert calls[0][0] == ["BASE", "NEW"] and "cell-a" in calls[0][1] and calls[0][2] == 1  # both sides, interleaved
    assert "note: sequential look 1 of 3 (--rerun-undecided 2): judged at α = 0.000687 of 0.05" in out
    looks = [line for line in out.splitlines() if line.startswith("note: sequential look")]
    assert len(looks) == len(calls) + 1 and looks[-1].endswith("5 measurement(s) still undecided at the cap")
    assert re.search(r"distill_step bs32  .* decided at look [123] of 3, [345] / [345] repeats", out)
    assert f"over {len(looks)} look(s), each at its share of it" in out
    stored = {p.name for p in (tmp_path / "new").glob("part-*")}
    assert {f"part-cell-a-r{k}.parquet" for k in range(1, len(calls) + 4)} - {"part-cell-a-r1.parquet"} <= stored
    from kdbench.store.results import RunFolder

    assert RunFolder(new).state().complete is None  # no invocation records in this synthetic run: unknown, as before


def test_rerun_undecided_refuses_what_it_cannot_measure_again(tmp_path, capsys, monkeypatch):
    base = _run(tmp_path, "base", _rows("base", repeats=3, spread=0.1))
    new = _run(tmp_path, "new", _rows("new", {("cell-a", "distill_step"): 1.3}, repeats=3, spread=0.1, seed=1))
    for value in ("0", "-2", "21", "two"):
        code, _, err = _cli(capsys, base, new, "--rerun-undecided", value)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "--rerun-undecided" in err, value
    code, _, err = _cli(capsys, base, new, "--rerun-undecided", "2", "--rerun-sides", "base")
    assert code == 2 and "--rerun-sides" in err and len(err.strip().splitlines()) == 1
    code, _, err = _cli(capsys, base, base, "--rerun-undecided", "2")
    assert code == 2 and "BASE and NEW are the same folder" in err and len(err.strip().splitlines()) == 1
    code, _, err = _cli(capsys, base, new, "--rerun-undecided", "2")  # s.yaml is not in this working folder
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "no side can be measured again here: BASE's suite file 's.yaml' is not here; NEW's suite file" in err
    code, _, err = _cli(capsys, base, new, "--rerun-undecided", "2", "--rerun-sides", "new")
    assert code == 2 and "no side can be measured again here: NEW's suite file 's.yaml' is not here" in err


def test_base_code_measures_base_again_from_its_own_code(tmp_path, capsys, monkeypatch):
    """--base-code DIR: BASE's repeats run with DIR first on their import path (a checkout of BASE's commit), NEW's
    as this process; both sides measured again, interleaved.  Misuse is one line, exit 2."""
    from kdbench.run import rerun

    _suite_here(tmp_path, monkeypatch)
    base = _run(tmp_path, "base", _rows("base", repeats=3, spread=0.12, seed=4))
    new = _run(tmp_path, "new", _rows("new", {("cell-a", "distill_step"): 1.6}, repeats=3, spread=0.12, seed=5))
    checkout = tmp_path / "base-checkout"
    checkout.mkdir()
    seen = []

    def measure_again(sides, cells, round_):
        seen.append({s.name: s.code for s in sides})
        raise KeyboardInterrupt  # one round is enough to see the sides

    monkeypatch.setattr(rerun, "measure_again", measure_again)
    code = main(["compare", str(base), str(new), "--rerun-undecided", "2", "--base-code", str(checkout)])
    assert code == 130 and seen == [{"BASE": checkout.resolve(), "NEW": None}]  # interrupted: 130
    capsys.readouterr()
    for args, says in (
        (["--base-code", str(checkout)], "use it with --rerun-undecided N"),
        (["--rerun-undecided", "2", "--rerun-sides", "new", "--base-code", str(checkout)], "not --rerun-sides new"),
        (["--rerun-undecided", "2", "--base-code", str(tmp_path / "nowhere")], "not a folder; give a checkout"),
    ):
        code, _, err = _cli(capsys, base, new, *args)
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def _import_path(queue) -> None:
    import os
    import sys

    queue.put((sys.path[:2], os.environ.get("PYTHONPATH")))


def test_code_first_is_what_a_spawned_worker_imports_from_and_is_undone_after(tmp_path, monkeypatch):
    import multiprocessing as mp
    import os
    import sys

    from kdbench.run.rerun import code_first

    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    path = list(sys.path)
    ctx = mp.get_context("spawn")  # as ProcessWorker starts its worker
    queue = ctx.Queue()
    with code_first(tmp_path):
        child = ctx.Process(target=_import_path, args=(queue,))
        child.start()
        child_path, child_env = queue.get(timeout=60)
        child.join(timeout=60)
    assert child_path[0] == str(tmp_path) and child_env == os.pathsep.join([str(tmp_path), "/elsewhere"])
    assert sys.path == path and os.environ["PYTHONPATH"] == "/elsewhere"
    with code_first(None):
        assert sys.path == path
