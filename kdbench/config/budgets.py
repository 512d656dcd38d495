"""Budgets: a suite's absolute limits on its measurements, and their check against result rows.

A suite's ``budgets:`` block is a list of limits, each on one statistic of one
measurement, optionally narrowed to a batch size and to cells whose config columns
have given values::

    budgets:
      - {measurement: student_inference, batch_size: 1, stat: p95_ms, max: 5}   # serving latency
      - {measurement: distill_step, stat: median_ms, max: 200}
      - {measurement: distill_step, stat: peak_memory_bytes, max: 8.0e9}
      - {measurement: student_inference, stat: throughput, min: 2000, where: {precision: bf16}}

Every matching measurement is checked: its value is the centre over the cell's ok repeats
(the geometric mean, as :mod:`kdbench.core.stats.repeats` pools them for compare).  Each check has an
outcome: ``met``, ``missed``, ``failed`` (the measurement failed: a miss too), ``skipped``
(it cannot run here: not a miss), ``thin`` (a time budget shrank it below ``min_iters``:
too few calls to judge, not a miss) or ``contended`` (measured on a busy machine: not a miss, unless
``run --judge-contended`` judges such rows like any other).  ``kdbench run`` prints every miss and exits 1; when
no check was judged at all it exits :data:`~kdbench.core.errors.EXIT_NOT_JUDGED` (budgets that judged nothing
must not pass a gate) unless ``--allow-unjudged``; the report shows each check.  Torch-free: the report checks
the budgets a run stored with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from kdbench.config.base import Strict
from kdbench.core.errors import did_you_mean
from kdbench.core.names import FAILURES, TIMED, VARIANT_COLUMNS, Status
from kdbench.core.schema import COLUMNS, CONFIG, DERIVED, RESULT, STATISTICS
from kdbench.core.stats.repeats import centre

if TYPE_CHECKING:  # pandas is imported where rows are checked: a suite's parse (every command, every helper) needs none
    import pandas as pd

_NUMERIC = ("int", "double", "float", "int32", "int64")
STATS = tuple(c.name for c in COLUMNS if c.group in (STATISTICS, RESULT, DERIVED) and str(c.type) in _NUMERIC)
WHERE = tuple(c.name for c in COLUMNS if c.group == CONFIG and c.name not in ("config_json", "batch_size"))
UNITS = {c.name: c.unit for c in COLUMNS}


class Budget(Strict):
    """One limit: ``stat`` of ``measurement`` (at ``batch_size``, in cells matching ``where``) within
    ``max`` and/or ``min``."""

    measurement: Literal[tuple(str(m) for m in TIMED)]  # type: ignore[valid-type]
    stat: str = "median_ms"
    max: float | None = Field(None, strict=False)  # strict=False: YAML reads 8e9 (no dot) as a string
    min: float | None = Field(None, strict=False)
    batch_size: int | None = Field(None, ge=1)
    where: dict[str, str | int | float | bool] = Field(default_factory=dict)
    name: str | None = None

    @field_validator("stat")
    @classmethod
    def _stat(cls, v: str) -> str:
        if v not in STATS:
            raise ValueError(
                f"unknown statistic {v!r}; {did_you_mean(v, STATS)}use a numeric result column, e.g. "
                "median_ms, p95_ms, p99_ms, throughput, peak_memory_bytes"
            )
        return v

    @field_validator("where")
    @classmethod
    def _where(cls, v: dict) -> dict:
        for key in v:
            if key not in WHERE:
                raise ValueError(
                    f"where: unknown column {key!r}; {did_you_mean(key, WHERE)}use a config column "
                    "such as precision, student, teacher, method, world_size"
                )
        return v

    @model_validator(mode="after")
    def _limit(self) -> Budget:
        if self.max is None and self.min is None:
            raise ValueError("give a limit: max (for times and memory) or min (for throughput)")
        if self.max is not None and self.min is not None and self.min > self.max:
            raise ValueError(f"min ({self.min:g}) is above max ({self.max:g})")
        return self

    def describe(self) -> str:
        if self.name:
            return self.name
        at = f"@bs{self.batch_size}" if self.batch_size is not None else ""
        where = "".join(f" {k}={v}" for k, v in self.where.items())
        unit = UNITS.get(self.stat, "")
        limits = [
            f"<= {self.max:g}" if self.max is not None else "",
            f">= {self.min:g}" if self.min is not None else "",
        ]
        return f"{self.measurement}{at}{where} {self.stat} {' and '.join(x for x in limits if x)} {unit}".rstrip()

    def holds(self, value: float) -> bool:
        return (self.max is None or value <= self.max) and (self.min is None or value >= self.min)


OUTCOMES = ("missed", "failed", "thin", "contended", "skipped", "met")  # in the order the report lists them
MISSES = ("missed", "failed")  # outcomes that make `kdbench run` exit 1
JUDGED = ("met", "missed", "failed")  # outcomes that judged the measurement; the others say nothing either way


@dataclass(frozen=True)
class BudgetCheck:
    budget: str  # Budget.describe()
    stat: str
    measurement: str
    run_id: str
    cell_id: str
    cell_label: str
    batch_size: int | None
    value: float | None  # the centre over the ok, not thin repeats; None when there is none
    outcome: str  # one of OUTCOMES
    note: str = ""

    @property
    def met(self) -> bool:
        return self.outcome == "met"

    @property
    def missed(self) -> bool:
        """A miss: over (or under) the limit, or the measurement failed."""
        return self.outcome in MISSES


def select(df: pd.DataFrame, budget: Budget) -> pd.DataFrame:
    """The rows ``budget`` applies to."""
    mask = df["measurement"].eq(budget.measurement)
    if budget.batch_size is not None:
        mask &= df["batch_size"].eq(budget.batch_size)
    for key, value in budget.where.items():
        mask &= df[key].eq(value) if key in df else False
    return df[mask]


def check(df: pd.DataFrame, budgets: list[Budget], judge_contended: bool = False) -> list[BudgetCheck]:
    """Every (budget, measurement) check on ``df``'s rows, in budget order; rows measured on a busy machine
    (``contended``) are left out as thin ones are, unless ``judge_contended``."""
    import pandas as pd

    checks = []
    thin_column = df["thin"] if "thin" in df else pd.Series(False, index=df.index)
    busy = df["contended"].eq(True) if "contended" in df and not judge_contended else pd.Series(False, index=df.index)
    for budget in budgets:
        rows = select(df, budget)
        variants = [c for c in VARIANT_COLUMNS if c in rows]  # a cell's speculative rows: one check per variant
        keys = ["run_id", "cell_id", "batch_size", *variants]
        for key, group in rows.groupby(keys, dropna=False, sort=False):
            run_id, cell_id, bs = key[:3]
            ok = group[group["status"].eq(Status.OK)]
            judged = ok[~thin_column[ok.index].eq(True) & ~busy[ok.index]]
            values = pd.to_numeric(judged[budget.stat], errors="coerce").dropna() if budget.stat in ok else pd.Series()
            common = dict(
                budget=budget.describe(),
                stat=budget.stat,
                measurement=_variant(budget.measurement, dict(zip(variants, key[3:]))),
                run_id=str(run_id),
                cell_id=str(cell_id),
                cell_label=str(group["cell_label"].iloc[-1]),
                batch_size=None if pd.isna(bs) else int(bs),
            )
            if values.empty:
                checks.append(BudgetCheck(**common, value=None, **_unjudged(group, ok, judged, budget.stat)))
                continue
            value = centre(values.tolist())
            repeats = f"centre of {len(values)} repeats" if len(values) > 1 else ""
            outcome = "met" if budget.holds(value) else "missed"
            checks.append(BudgetCheck(**common, value=value, outcome=outcome, note=repeats))
    return checks


def _variant(measurement: str, variant: dict) -> str:
    """The measurement, with its speculative variant where it has one (``speculative_decode γ4 T0``)."""
    import pandas as pd

    gamma, temperature = variant.get("draft_tokens"), variant.get("spec_temperature")
    if gamma is None or pd.isna(gamma):
        return measurement
    return f"{measurement} γ{int(gamma)} T{0.0 if pd.isna(temperature) else float(temperature):g}"


def _unjudged(group: pd.DataFrame, ok: pd.DataFrame, judged: pd.DataFrame, stat: str) -> dict:
    """The outcome and note of a check with no value to judge."""
    failed = group[group["status"].isin(list(FAILURES))]
    if not failed.empty:
        why = f"{failed['status'].iloc[-1]}: {' '.join(str(failed['error'].iloc[-1] or '').split())[:120]}"
        return {"outcome": "failed", "note": why}
    if not ok.empty and judged.empty:
        if "thin" not in ok or not ok["thin"].eq(True).all():
            return {
                "outcome": "contended",
                "note": "measured on a busy machine (contended): not judged; rerun it idle, or --judge-contended",
            }
        return {"outcome": "thin", "note": "shrunk by the time budget below min_iters: too few calls to judge"}
    if ok.empty:
        skipped = group[group["status"].eq(Status.SKIPPED)]
        why = " ".join(str(skipped["error"].iloc[-1] or "").split())[:120] if not skipped.empty else ""
        return {"outcome": "skipped", "note": f"skipped: {why}" if why else "skipped"}
    return {"outcome": "missed", "note": f"{stat} was not measured"}


def judged_none(checks: list[BudgetCheck]) -> bool:
    """There are checks and none of them judged its measurement (each thin, contended or skipped): the budgets
    claim nothing, so `kdbench run` exits EXIT_NOT_JUDGED, not 0, unless ``--allow-unjudged``."""
    return bool(checks) and not any(c.outcome in JUDGED for c in checks)


def where_text(c: BudgetCheck) -> str:
    """The measurement a check is about: the cell, and the batch size of an inference."""
    inference = c.measurement != "distill_step" and c.batch_size is not None
    return f"{c.cell_label}" + (f", {c.measurement} bs{c.batch_size}" if inference else "")


def format_value(value: float | None, stat: str) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    if UNITS.get(stat) == "bytes":
        return f"{value / 2**20:,.1f} MiB"
    return f"{value:.4g} {UNITS.get(stat, '')}".rstrip()


def budgets_of(raw: list[dict[str, Any]]) -> list[Budget]:
    """Budgets stored in a run's manifest (as the suite gave them)."""
    return [Budget.model_validate(b) for b in raw]
