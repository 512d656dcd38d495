"""What a comparison of a NEW run against a BASE run is: each measurement's :class:`Change` and its
:class:`Verdict`, the :class:`Policy` of what fails the gate, the two :class:`Side` s and the
:class:`Comparison` that holds them with its notes; and :func:`verdict_of`, the rule that calls a ratio's
interval regressed, improved or unchanged.

:mod:`kdbench.report.compare.compare` matches the sides and decides (its docstring states the guarantee);
:mod:`kdbench.report.compare.format` writes a comparison out.  Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from kdbench.core.errors import EXIT_NOT_JUDGED
from kdbench.core.limits import MAX_LOSS_ERR
from kdbench.core.stats.repeats import RatioInterval, each_level
from kdbench.report.ledger import LedgerFlag, ledger_note

# Environment columns whose difference between the sides changes what the figures mean: named at the top.
ENVIRONMENT = (
    "backend",
    "device_name",
    "cpu_threads",
    "torch_version",
    "cuda_version",
    "hip_version",
    "cudnn_version",
    "driver_version",
    "hostname",
)


class Verdict(StrEnum):
    REGRESSED = "regressed"  # significantly slower, beyond the threshold
    FAILED = "failed"  # ok in BASE, failed (or oom, timeout) in NEW; or a NEW repeat failed
    MISSING = "missing"  # in BASE, and planned but not stored (yet) by an incomplete NEW run
    IMPROVED = "improved"  # significantly faster, beyond the threshold
    FIXED = "fixed"  # failed in BASE, ok in NEW
    UNCHANGED = "unchanged"  # within noise or within the threshold
    UNJUDGED = "not judged"  # one repeat per side: the run-to-run noise is unknown
    THIN = "thin"  # a side's rows were shrunk by a time budget: too few calls to judge
    CONTENDED = "contended"  # a side's rows were measured on a busy machine: not judged unless --judge-contended
    SKIPPED = "skipped"  # skipped in NEW (or on both sides): cannot run there
    BOTH_FAILED = "both failed"
    ONLY_BASE = "only in base"
    ONLY_NEW = "only in new"


@dataclass(frozen=True)
class Policy:
    """What may fail the gate beyond regressions and failures (the command line's options)."""

    gate_single_repeat: bool = False  # judge one-repeat sides on their within-process interval
    allow_partial: bool = False  # judge an incomplete NEW run, or one with failed repeats, on what it has
    fail_on_skipped: bool = False  # a measurement ok in BASE and skipped in NEW fails the gate
    judge_contended: bool = False  # judge rows measured on a busy machine (``contended``) like any other
    max_loss_err: float = MAX_LOSS_ERR  # the accuracy ledger's bound on loss_rel_err and grad_rel_err (a note)
    gate_loss_err: bool = False  # a faster (improved) cell beyond max_loss_err fails the gate
    allow_unjudged: bool = False  # nothing judged exits 0, not EXIT_NOT_JUDGED

    def bad(self) -> tuple[Verdict, ...]:
        """The verdicts that make `compare` exit 1 under this policy."""
        bad = [Verdict.REGRESSED, Verdict.FAILED, Verdict.MISSING]
        return tuple(bad + [Verdict.SKIPPED] if self.fail_on_skipped else bad)


@dataclass(frozen=True)
class Change:
    cell_id: str
    cell_label: str
    measurement: str
    batch_size: int | None
    verdict: Verdict
    base_median_ms: float | None = None  # the centre of a side: geometric mean of its repeats' medians
    new_median_ms: float | None = None
    ratio: float | None = None  # NEW / BASE of the centres
    ci_low: float | None = None
    ci_high: float | None = None
    base_repeats: int = 0  # repeats judged on each side (ok, not thin)
    new_repeats: int = 0
    method: str = ""  # how the interval was made (empty: none)
    gated: bool = False  # the interval took part in the verdict (and in the m of the simultaneous intervals)
    note: str = ""

    @property
    def name(self) -> str:
        bs = f" bs{self.batch_size}" if self.batch_size is not None else ""
        return f"{self.cell_label} · {self.measurement}{bs}"


@dataclass(frozen=True)
class Side:
    """One side of a comparison: which run, machine and software it is, and whether it is complete."""

    label: str  # the path as given
    run_ids: tuple[str, ...]
    devices: tuple[str, ...]
    repeats: int  # the most repeats of any measurement
    environment: dict[str, tuple[str, ...]] = field(default_factory=dict)  # ENVIRONMENT column -> values
    state: object | None = None  # kdbench.store.results.RunState, when the side is a run folder

    @property
    def incomplete(self) -> bool:
        return getattr(self.state, "complete", None) is False


@dataclass
class Comparison:
    base: Side
    new: Side
    threshold: float
    confidence: float  # for all the judged measurements together
    policy: Policy = field(default_factory=Policy)
    changes: list[Change] = field(default_factory=list)
    reused: int = 0  # teacher inference copies judged once, at the cell that measured them
    looks: list[str] = field(default_factory=list)  # a sequential comparison's looks, one line each
    ledger: list[LedgerFlag] = field(default_factory=list)  # NEW cells beyond the accuracy ledger's bound

    @property
    def rated(self) -> int:
        """Measurements whose interval was judged: the m of the simultaneous intervals."""
        return sum(c.gated for c in self.changes)

    @property
    def each(self) -> float:
        """The two-sided level of each judged interval: 1 - (1 - confidence) / m, each one-sided bound at
        1 - (1 - confidence) / (2m), so that no false verdict either way, regressed or improved, is called with
        more than 1 - confidence chance in the comparison."""
        return each_level(self.confidence, self.rated)

    @property
    def bad(self) -> list[Change]:
        bad = self.policy.bad()
        return [c for c in self.changes if c.verdict in bad]

    @property
    def inaccurate(self) -> list[LedgerFlag]:
        """The cells that fail the gate for their accuracy: faster (improved) beyond the ledger's bound, with
        ``gate_loss_err``."""
        return [f for f in self.ledger if f.improved] if self.policy.gate_loss_err else []

    @property
    def exit_code(self) -> int:
        """1 when something fails the gate; :data:`~kdbench.core.errors.EXIT_NOT_JUDGED` when nothing was judged
        (every measurement contended, thin or one repeat a side: a gate that judged nothing must not pass)
        unless the policy allows it; else 0."""
        if self.bad or self.inaccurate:
            return 1
        return EXIT_NOT_JUDGED if self.rated == 0 and not self.policy.allow_unjudged else 0

    def count(self, verdict: Verdict) -> int:
        return sum(c.verdict == verdict for c in self.changes)

    @property
    def same_run(self) -> str | None:
        """'the same folder' or 'the same run (run id X)' when BASE and NEW are one run; else None."""
        if not self.base.run_ids or self.base.run_ids != self.new.run_ids:
            return None
        ids = ", ".join(self.base.run_ids)
        if Path(self.base.label).resolve() == Path(self.new.label).resolve():
            return f"the same folder ({self.base.label}, run {ids})"
        return f"the same run (run id {ids}, in two places)"

    def notes(self) -> list[str]:
        notes = []
        if self.same_run:
            notes.append(
                f"BASE and NEW are {self.same_run}: a run compared with itself, every ratio 1; give the run to "
                "judge as NEW"
            )
        notes += self.looks
        ledger = ledger_note(self.ledger, self.policy.max_loss_err, self.policy.gate_loss_err)
        notes += [ledger] if ledger else []
        unjudged = self.count(Verdict.UNJUDGED)
        if unjudged:
            notes.append(
                f"{unjudged} measurement(s) have a single repeat on each side: one process's iterations cannot show "
                "the noise from run to run, so they are not judged and do not fail the gate; run both sides with "
                "--repeat 3 (or `repeat: 3`) for verdicts, or pass --gate-single-repeat to judge them on the "
                "within-process interval (two runs of the same suite then differ most of the time)"
            )
        elif self.policy.gate_single_repeat and (self.base.repeats <= 1 or self.new.repeats <= 1):
            notes.append(
                "--gate-single-repeat: single-repeat measurements are judged on the noise within one process, "
                "which understates the noise from run to run: expect false alarms"
            )
        for side, name in ((self.base, "BASE"), (self.new, "NEW")):
            if side.state is not None and getattr(side.state, "complete", None) is not True:
                notes.append(f"{name} is {side.state.describe()}")
        if self.new.incomplete and self.policy.allow_partial:
            notes.append("--allow-partial: the cells the incomplete NEW run has not stored are listed, not failed")
        for column, label in (("device_name", "devices"), *((c, c) for c in ENVIRONMENT if c != "device_name")):
            b, n = self.base.environment.get(column, ()), self.new.environment.get(column, ())
            if b and n and set(b) != set(n):
                notes.append(f"different {label}: {', '.join(b)} vs {', '.join(n)}")
        if self.reused:
            notes.append(
                f"{self.reused} reused teacher inference copies are judged once, at the cell that measured them"
            )
        thin = self.count(Verdict.THIN)
        if thin:
            notes.append(
                f"{thin} measurement(s) are thin (a time budget shrank them below min_iters): not judged; raise "
                "timing.cell_budget_s or lower their counts"
            )
        contended = self.count(Verdict.CONTENDED)
        if contended:
            notes.append(
                f"{contended} measurement(s) were measured on a busy machine (contended: other processes took the "
                "cores or GPU they needed): not judged; rerun them on an idle machine, or pass --judge-contended"
            )
        return notes


def verdict_of(interval: RatioInterval, threshold: float) -> Verdict:
    """Regressed: the interval of NEW/BASE wholly above 1 and the ratio beyond 1 + threshold; improved: wholly
    below 1 and under 1 - threshold; else unchanged."""
    if interval.low > 1 and interval.ratio > 1 + threshold:
        return Verdict.REGRESSED
    if interval.high < 1 and interval.ratio < 1 - threshold:
        return Verdict.IMPROVED
    return Verdict.UNCHANGED


def undecided(verdict: Verdict, ratio: float | None, high: float | None, threshold: float) -> bool:
    """Whether more repeats could turn a measurement's verdict into a regression: not judged for want of
    repeats (one a side), or unchanged with its interval reaching beyond 1 + threshold (straddling it, or above
    1 with the ratio under it) and its ratio above 1.  Decided: regressed, improved, an interval wholly under
    1 + threshold (no regression beyond the threshold is left to find), or a ratio at or under 1 (NEW reads
    no slower: let go for futility, which can only lower the false-alarm rate, and halves the repeats an
    unchanged suite costs)."""
    if verdict == Verdict.UNJUDGED:
        return True
    if verdict != Verdict.UNCHANGED or ratio is None or high is None:
        return False
    return high > 1 + threshold and ratio > 1
