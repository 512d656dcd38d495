"""Verdicts: a NEW run against a BASE run, measurement by measurement.

Cells are matched by ``cell_id`` (a hash of the resolved cell config, not of the machine),
so the same suite run on two machines, two drivers or two commits compares cell by cell.
Each timed measurement (key: cell, measurement, batch size) gets one :class:`Change` with a
:class:`Verdict`.  The statistics are :mod:`kdbench.core.stats.repeats`' (a repeat, measured in a fresh
worker process, is the unit; the centre of a side is the geometric mean of its repeats'
medians); this module matches the two sides and decides; :mod:`kdbench.report.compare.verdicts` holds what it
decides (the verdicts, the policy, the comparison) and :mod:`kdbench.report.compare.format` writes it out.

**The guarantee.** A measurement is *regressed* when its interval of NEW/BASE lies wholly
above 1 **and** the ratio exceeds 1 + threshold (*improved*: below 1 and under 1 − threshold).
The intervals are t-intervals between repeats, *simultaneous* over the m measurements judged
and over both directions: each one-sided bound at 1 − (1 − C)/(2m) (Bonferroni; shown as a two-sided
interval at 1 − (1 − C)/m), so that when nothing changed, the chance that any measurement of the
comparison is called regressed *or improved* is at most 1 − C (the gate fails on a regression only,
so it fails in fewer).  Until issue 45 each direction had the whole 1 − C, and two runs of the same
code read "improved" (or "regressed") in up to twice that share.  Each
measurement's variance is taken as at least the comparison's median one (a measurement that
happens to look quiet in three repeats is not trusted to be quieter than the others), which
only widens intervals.  ``tests/unit/report/test_compare.py`` shows the family-wise rate, false verdicts
of both directions counted, by simulation at 2, 3, 5 and 10 repeats per side.

**More repeats where undecided** (:class:`Sequential`, ``compare --rerun-undecided N``): up to N rounds measure
the cells with an undecided measurement once more a side, and the comparison looks again; look k judges at its
share α_k of α = 1 − C (O'Brien–Fleming-type spending, :func:`kdbench.core.stats.repeats.spending`),
a measurement decided at a look keeps that verdict, so over the whole sequence the chance of a false
verdict, regressed or improved, stays at most 1 − C (union bound).
``tests/system/test_sequential.py`` simulates its power and false-alarm rate.

**What is not judged.** With one repeat on each side no interval can hold the run-to-run noise
(the between-process variance is unknown): those measurements are *not judged* and do not fail
the gate, unless :attr:`Policy.gate_single_repeat` judges them on the iterations of one
process (a within-process bootstrap that calls two identical runs different most of the
time).  Rows thinned by a time budget (``thin``), rows measured on a busy machine (``contended``, unless
:attr:`Policy.judge_contended`), skipped rows and rows of cells that an
incomplete NEW run has not stored yet are their own outcomes.

**What fails the gate** (exit 1): a regression; a measurement ok in BASE that failed (or ran
out of memory, or timed out) in NEW; a NEW repeat that failed or is missing from an incomplete
NEW run, and a cell that an incomplete NEW run never stored (:attr:`Policy.allow_partial`
judges what is there instead); a measurement ok in BASE and skipped in NEW only with
:attr:`Policy.fail_on_skipped`; a faster (improved) LM cell whose accuracy ledger is beyond
:attr:`Policy.max_loss_err` only with :attr:`Policy.gate_loss_err` (otherwise a note names it:
:mod:`kdbench.report.ledger`).  Torch-free: it reads DataFrames only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from kdbench.core.errors import KdbenchError
from kdbench.core.names import FAILURES, TIMED, VARIANT_COLUMNS, Measurement, Status
from kdbench.core.stats.repeats import (
    RatioInterval,
    bootstrap_ratio,
    centre,
    each_level,
    median_log_variance,
    simultaneous_t,
)
from kdbench.report.compare.verdicts import (
    ENVIRONMENT,
    Change,
    Comparison,
    Policy,
    Side,
    Verdict,
    undecided,
    verdict_of,
)
from kdbench.report.ledger import beyond_bound

KEY = ("cell_id", "measurement", "batch_size")
DISTILL_STEP = str(Measurement.DISTILL_STEP)
_ORDER = {v: i for i, v in enumerate(Verdict)}


# --------------------------------------------------------------------------- matching


def _seed(key: tuple) -> int:
    """A seed per measurement: the same inputs give the same interval, in any order."""
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little")


def _timed(df: pd.DataFrame, label: str) -> pd.DataFrame:
    if df.empty or "measurement" not in df:
        raise KdbenchError(f"{label}: holds no result rows; give a run folder or result file of `kdbench run`")
    rows = df[df["measurement"].isin(list(TIMED))].copy()
    if rows.empty:
        raise KdbenchError(f"{label}: holds no timed measurements (distill_step or inference rows) to compare")
    runs = sorted(rows["run_id"].dropna().unique())
    if len(runs) > 1:
        shown = ", ".join(runs[:4]) + (" ..." if len(runs) > 4 else "")
        raise KdbenchError(f"{label}: holds {len(runs)} runs ({shown}); give one run folder on each side")
    rows["batch_size"] = rows["batch_size"].astype("Int64")
    rows["measurement"] = variant_labels(rows)  # a cell's speculative rows: one measurement per variant
    rows["repeat"] = rows["repeat"].fillna(1).astype(int) if "repeat" in rows else 1
    rows["thin_"] = rows["thin"].eq(True) if "thin" in rows else False
    rows["contended_"] = rows["contended"].eq(True) & ~rows["thin_"] if "contended" in rows else False
    copies = rows["measured_in_cell"] if "measured_in_cell" in rows else pd.Series(None, index=rows.index)
    rows["source_"] = copies.where(copies.notna() & copies.ne(rows["cell_id"]), None)
    return rows


def variant_labels(rows: pd.DataFrame) -> pd.Series:
    """The measurement of each row, with its speculative variant where it has one (``speculative_decode γ4 T0``):
    a cell's speculative_decode rows are one measurement per draft length and temperature."""
    labels = rows["measurement"].astype(str)
    if not all(c in rows for c in VARIANT_COLUMNS):
        return labels
    gamma = pd.to_numeric(rows["draft_tokens"], errors="coerce")
    temperature = pd.to_numeric(rows["spec_temperature"], errors="coerce")
    has = gamma.notna()
    text = [f"{m} γ{int(g)} T{t:g}" for m, g, t in zip(labels[has], gamma[has], temperature[has].fillna(0))]
    return labels.where(~has, pd.Series(text, index=labels.index[has], dtype=object))


def _side(rows: pd.DataFrame, label: str, state) -> Side:
    devices = tuple(dict.fromkeys(rows["device_name"].dropna().astype(str))) if "device_name" in rows else ()
    ok = rows[rows["status"].eq(Status.OK)]
    repeats = int(ok.groupby(list(KEY), dropna=False).size().max()) if not ok.empty else 0
    env = {c: tuple(dict.fromkeys(map(str, rows[c].dropna()))) for c in ENVIRONMENT if c in rows}
    return Side(label, tuple(sorted(rows["run_id"].dropna().unique())), devices, repeats, env, state)


@dataclass
class _Measured:
    """One side of one measurement, sorted by what its rows say."""

    rows: pd.DataFrame
    medians: list[float]  # the judged repeats' medians (ok, not thin)
    floor: float  # the mean sampling variance of their log medians
    samples: list[np.ndarray]  # the judged repeats' raw samples
    ok: int  # ok rows (thin included)
    thin: int
    contended: int  # ok rows left out as contended (not thin)
    failed: int
    skipped: int

    @property
    def copies_only(self) -> bool:
        return bool(self.rows["source_"].notna().all())


def _measured(rows: pd.DataFrame | None, judge_contended: bool = False) -> _Measured | None:
    if rows is None:
        return None
    ok = rows[rows["status"].eq(Status.OK)]
    contended = ok["contended_"] & (not judge_contended)
    judged = ok[~ok["thin_"] & ~contended].sort_values("repeat")
    medians, samples, floors = [], [], []
    for raw, median in zip(judged["samples_ms"], judged["median_ms"]):
        a = np.asarray(raw if raw is not None else [], dtype=float)
        a = a[np.isfinite(a)]
        if a.size == 0 and pd.notna(median):
            a = np.array([float(median)])
        if a.size and np.median(a) > 0:
            medians.append(float(np.median(a)))
            samples.append(a)
            floors.append(median_log_variance(a))
    return _Measured(
        rows,
        medians,
        float(np.mean(floors)) if floors else 0.0,
        samples,
        ok=len(ok),
        thin=int(ok["thin_"].sum()),
        contended=int(contended.sum()),
        failed=int(rows["status"].isin(list(FAILURES)).sum()),
        skipped=int(rows["status"].eq(Status.SKIPPED).sum()),
    )


def _reason(rows: pd.DataFrame, statuses) -> str:
    bad = rows[rows["status"].isin(list(statuses))]
    if bad.empty:
        return ""
    r = bad.iloc[-1]
    return f"{r['status']}: {' '.join(str(r.get('error') or '').split())[:160]}"


def compare_frames(
    base: pd.DataFrame,
    new: pd.DataFrame,
    threshold: float = 0.05,
    confidence: float = 0.95,
    base_label: str = "BASE",
    new_label: str = "NEW",
    policy: Policy | None = None,
    base_state=None,
    new_state=None,
) -> Comparison:
    """NEW against BASE, every timed measurement of either side (see the module docstring).  The states
    (:class:`kdbench.store.results.RunState`) say which jobs each run planned and stored."""
    policy = policy or Policy()
    if not 0 <= threshold < 1:
        raise KdbenchError(f"--threshold: must be a percentage from 0 to 100 (exclusive), got {threshold * 100:g}")
    if not 0.5 <= confidence < 1:
        raise KdbenchError(f"--confidence: must be from 0.5 to 1 (exclusive), e.g. 0.95; got {confidence:g}")
    b, n = _timed(base, base_label), _timed(new, new_label)
    if not set(b["cell_id"]) & set(n["cell_id"]):
        raise KdbenchError(
            f"{base_label} and {new_label} have no cell in common (cells match by cell_id, the hash of the "
            "resolved cell config): compare runs of the same suite"
        )
    result = Comparison(_side(b, base_label, base_state), _side(n, new_label, new_state), threshold, confidence, policy)
    judge = policy.judge_contended
    groups_b = {k: _measured(g, judge) for k, g in b.groupby(list(KEY), dropna=False, sort=False)}
    groups_n = {k: _measured(g, judge) for k, g in n.groupby(list(KEY), dropna=False, sort=False)}
    keys = list(dict.fromkeys([*groups_b, *groups_n]))
    keys = [k for k in keys if not _judged_elsewhere(k, groups_b, groups_n, result)]
    plans = {k: _plan(k, groups_b.get(k), groups_n.get(k), result) for k in keys}
    # The intervals: between repeats where there are any (simultaneous over every judged measurement, the
    # within-process ones of --gate-single-repeat included); within one process per side otherwise.
    judged = [k for k, p in plans.items() if p.gated or p.shown]
    family = [(plans[k].b.medians, plans[k].n.medians, max(plans[k].b.floor, plans[k].n.floor)) for k in judged]
    size = sum(plans[k].gated for k in judged)
    between = dict(zip(judged, simultaneous_t(family, confidence, size)))
    each = each_level(confidence, size)
    for key in keys:
        plan = plans[key]
        interval = between.get(key) or (
            bootstrap_ratio(plan.b.samples[0], plan.n.samples[0], each, seed=_seed(key)) if key in between else None
        )
        result.changes.append(_finish(key, plan, interval, threshold))
    result.changes.sort(key=_rank)
    steps = {c.cell_id: (c.cell_label, str(c.verdict)) for c in result.changes if c.measurement == DISTILL_STEP}
    result.ledger = beyond_bound(n, steps, policy.max_loss_err)
    return result


def _judged_elsewhere(key: tuple, groups_b: dict, groups_n: dict, result: Comparison) -> bool:
    """A reused teacher inference copy on both sides, whose measuring cell both sides hold: judged there, once."""
    gb, gn = groups_b.get(key), groups_n.get(key)
    if gb is None or gn is None or not (gb.copies_only and gn.copies_only):
        return False
    _, measurement, bs = key
    sources = {(s, measurement, bs) for g in (gb, gn) for s in g.rows["source_"].dropna()}
    if all(s in groups_b and s in groups_n for s in sources):
        result.reused += 1
        return True
    return False


@dataclass
class _Plan:
    """What one measurement's comparison will be: its verdict when it is decided without statistics, else
    how its interval is to be made."""

    b: _Measured | None
    n: _Measured | None
    verdict: Verdict | None = None  # decided already
    note: str = ""
    gated: bool = False  # an interval decides: t between repeats, or (asked) the within-process bootstrap
    shown: bool = False  # an interval is shown, not judged (one repeat per side)


def _plan(key: tuple, b: _Measured | None, n: _Measured | None, result: Comparison) -> _Plan:
    policy, state = result.policy, result.new.state
    cell_id = key[0]
    if n is None:
        missing = getattr(state, "missing_repeats", lambda _c: [])(cell_id)
        if result.new.incomplete and missing:
            return _Plan(b, n, Verdict.MISSING, f"NEW is incomplete: cell not stored (repeats {_list(missing)})")
        return _Plan(b, n, Verdict.ONLY_BASE)
    if b is None:
        return _Plan(b, n, Verdict.ONLY_NEW)
    base_ok, new_ok = b.ok > 0, n.ok > 0
    if not new_ok:
        if n.failed:
            if not base_ok and b.failed:
                return _Plan(b, n, Verdict.BOTH_FAILED, _reason(n.rows, FAILURES))
            return _Plan(b, n, Verdict.FAILED, _reason(n.rows, FAILURES))
        why = _reason(n.rows, (Status.SKIPPED,))
        return _Plan(b, n, Verdict.SKIPPED, why if base_ok else f"skipped on both sides; {why}")
    if not base_ok:
        if b.failed:
            return _Plan(b, n, Verdict.FIXED, "BASE " + _reason(b.rows, FAILURES))
        return _Plan(b, n, Verdict.ONLY_NEW, "BASE " + _reason(b.rows, (Status.SKIPPED,)))
    notes = []
    missing = getattr(state, "missing_repeats", lambda _c: [])(cell_id) if result.new.incomplete else []
    lost = n.failed + len(missing)
    if lost:
        what = [f"{n.failed} failed ({_reason(n.rows, FAILURES)})"] if n.failed else []
        what += [f"{len(missing)} not stored (repeats {_list(missing)}: NEW is incomplete)"] if missing else []
        text = f"NEW repeats: {n.ok} ok, " + ", ".join(what)
        if not policy.allow_partial:
            verdict = Verdict.FAILED if n.failed else Verdict.MISSING
            return _Plan(b, n, verdict, text + "; --allow-partial judges the ok ones")
        notes.append(text + "; judged on the ok ones (--allow-partial)")
    if b.failed:
        notes.append(f"BASE repeats: {b.failed} failed")
    for side, m in (("BASE", b), ("NEW", n)):
        if m.thin:
            notes.append(f"{side}: {m.thin} thin repeat(s) left out")
        if m.contended:
            notes.append(f"{side}: {m.contended} contended repeat(s) left out (--judge-contended judges them)")
    if not b.medians or not n.medians:
        busy = any(m.contended and not m.medians for m in (b, n))
        return _Plan(b, n, Verdict.CONTENDED if busy else Verdict.THIN, "; ".join(notes))
    plan = _Plan(b, n, note="; ".join(notes))
    if len(b.medians) + len(n.medians) >= 3 or policy.gate_single_repeat:
        plan.gated = True
    else:
        plan.shown = True
    return plan


def _finish(key: tuple, plan: _Plan, interval: RatioInterval | None, threshold: float) -> Change:
    cell_id, measurement, bs = key
    rows = (plan.n if plan.n is not None else plan.b).rows
    common = dict(
        cell_id=cell_id,
        cell_label=str(rows["cell_label"].iloc[-1]),
        measurement=str(measurement),
        batch_size=None if bs is None or pd.isna(bs) else int(bs),
    )
    b, n = plan.b, plan.n
    counts = dict(
        base_repeats=len(b.medians) if b is not None else 0, new_repeats=len(n.medians) if n is not None else 0
    )
    medians = dict(
        base_median_ms=_centre(b),
        new_median_ms=_centre(n),
    )
    if plan.verdict is not None or interval is None:
        return Change(**common, verdict=plan.verdict or Verdict.UNJUDGED, **medians, **counts, note=plan.note)
    verdict = verdict_of(interval, threshold) if plan.gated else Verdict.UNJUDGED
    note = plan.note
    if interval.method == "bootstrap" and plan.gated:
        note = "; ".join(x for x in (note, "judged on the within-process interval (--gate-single-repeat)") if x)
    return Change(
        **common,
        verdict=verdict,
        **medians,
        ratio=interval.ratio,
        ci_low=interval.low,
        ci_high=interval.high,
        **counts,
        method=interval.describe(),
        gated=plan.gated,
        note=note,
    )


def _centre(m: _Measured | None) -> float | None:
    return centre(m.medians) if m is not None and m.medians else None


def _list(values: list[int]) -> str:
    return ", ".join(map(str, values))


def _rank(c: Change) -> tuple:
    worst = -(c.ratio or 0) if c.verdict in (Verdict.REGRESSED, Verdict.UNCHANGED) else (c.ratio or 0)
    return (_ORDER[c.verdict], worst, c.cell_label, c.measurement, c.batch_size or 0)


# --------------------------------------------------------------------------- a sequence of looks


@dataclass
class Sequential:
    """A sequential comparison (``compare --rerun-undecided N``): up to N + 1 looks, the undecided measurements'
    cells measured once more on each side between two looks.  Look k judges at its share α_k of the family-wise
    α = 1 − confidence (:func:`kdbench.core.stats.repeats.spending`); a measurement decided at a look keeps that
    verdict (its later repeats, measured with its cell, change nothing), so a false regression is called at look k with
    chance at most α_k, and over the sequence at most α.  Stopping a measurement that can no longer regress
    (futility) only lowers that chance."""

    confidence: float
    rounds: int  # the cap: extra rounds of repeats at most
    decided: dict[tuple, Change] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    @property
    def looks(self) -> int:
        return self.rounds + 1

    def level(self, look: int) -> float:
        """The confidence look ``look`` (1-based) judges at: 1 − α_k."""
        from kdbench.core.stats.repeats import spending

        return 1 - spending(1 - self.confidence, self.looks)[look - 1]

    def fold(self, cmp: Comparison, look: int) -> list[str]:
        """Fold look ``look``'s comparison into the sequence: its measurements decided earlier take their earlier
        change; those it decides keep its change; the cell ids whose measurements are still undecided (none after
        the last look) are returned, to be measured again."""
        open_cells: list[str] = []
        changes, capped = [], 0
        for c in cmp.changes:
            key = (c.cell_id, c.measurement, c.batch_size)
            if key in self.decided:
                changes.append(self.decided[key])
                continue
            if undecided(c.verdict, c.ratio, c.ci_high, cmp.threshold) and look < self.looks:
                open_cells.append(c.cell_id)
                changes.append(c)
                continue
            at = f"look {look} of {self.looks}, {c.base_repeats} / {c.new_repeats} repeats"
            if undecided(c.verdict, c.ratio, c.ci_high, cmp.threshold):
                capped += 1
                at = f"still undecided at the cap ({at}): --rerun-undecided with a larger N may decide it"
            else:
                at = f"decided at {at}"
            self.decided[key] = c = replace(c, note="; ".join(x for x in (c.note, at) if x))
            changes.append(c)
        cmp.changes = sorted(changes, key=_rank)
        steps = {c.cell_id: str(c.verdict) for c in cmp.changes if c.measurement == DISTILL_STEP}
        cmp.ledger = [replace(f, verdict=steps.get(f.cell_id, f.verdict)) for f in cmp.ledger]  # the kept verdicts
        open_cells = list(dict.fromkeys(open_cells))
        alpha = 1 - self.level(look)
        self.lines.append(
            f"sequential look {look} of {self.looks} (--rerun-undecided {self.rounds}): judged at α = {alpha:.3g} of "
            f"{1 - self.confidence:.3g} (O'Brien–Fleming-type spending); "
            + (
                f"{len(open_cells)} cell(s) undecided, measured again"
                if open_cells
                else f"{capped} measurement(s) still undecided at the cap"
                if capped
                else "nothing left undecided"
            )
        )
        cmp.looks = list(self.lines)
        cmp.confidence = self.confidence
        return open_cells


def side_by_side(
    df: pd.DataFrame,
    base: pd.DataFrame | None = None,
    threshold: float = 0.05,
    confidence: float = 0.95,
    states: dict | None = None,
    policy: Policy | None = None,
) -> list[Comparison]:
    """The report's comparisons: every run of ``df`` against ``base`` (one run), or, without a base, every
    run after the first (by its first measurement) against the first, e.g. the same suite on two machines.
    Runs with no timed cell in common with the base are left out (a given base must share cells with one).
    ``states`` (run id -> RunState) say which runs are complete."""
    if df.empty or "run_id" not in df:
        return []
    states = states or {}
    order = df.groupby("run_id")["timestamp"].min().sort_values(kind="stable").index.tolist()
    given = base is not None
    if base is None:
        if len(order) < 2:
            return []
        base = df[df["run_id"].eq(order[0])]
    else:
        _timed(base, "--baseline")  # one run, with timed rows: else the user's mistake
    base_ids = set(base["run_id"].dropna())
    base_label = ", ".join(sorted(base_ids))
    base_state = states.get(base_label)
    out = []
    for run_id in order:
        if run_id in base_ids:
            continue
        try:
            new = df[df["run_id"].eq(run_id)]
            out.append(
                compare_frames(
                    base, new, threshold, confidence, base_label, str(run_id), policy, base_state, states.get(run_id)
                )
            )
        except KdbenchError:  # a run of other cells, or of quality rows only: nothing to compare
            continue
    if given and not out:
        raise KdbenchError(f"--baseline {base_label}: no other run of the results has a timed cell in common with it")
    return out
