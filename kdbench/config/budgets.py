"""Budgets: a suite's absolute limits on its measurements, and their check against result rows.

A suite's ``budgets:`` block is a list of limits, each on one statistic of one
measurement, optionally narrowed to a batch size and to cells whose config columns
have given values::

    budgets:
      - {measurement: student_inference, batch_size: 1, stat: p95_ms, max: 5}   # serving latency
      - {measurement: distill_step, stat: median_ms, max: 200}
      - {measurement: distill_step, stat: peak_memory_bytes, max: 8.0e9}
      - {measurement: student_inference, stat: throughput, min: 2000, where: {precision: bf16}}

Every matching measurement is checked: its value is the median over the cell's ok
repeats.  A matching measurement that failed misses its budget.  ``kdbench run`` prints
every missed budget and exits 1; the report shows each check.  Torch-free: the report
checks the budgets a run stored in its manifest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import pandas as pd
from pydantic import Field, field_validator, model_validator

from kdbench.config.base import Strict
from kdbench.errors import did_you_mean
from kdbench.names import Status
from kdbench.store.schema import COLUMNS, CONFIG, DERIVED, RESULT, STATISTICS

_NUMERIC = ("int", "double", "float", "int32", "int64")
STATS = tuple(c.name for c in COLUMNS if c.group in (STATISTICS, RESULT, DERIVED) and str(c.type) in _NUMERIC)
WHERE = tuple(c.name for c in COLUMNS if c.group == CONFIG and c.name not in ("config_json", "batch_size"))
UNITS = {c.name: c.unit for c in COLUMNS}


class Budget(Strict):
    """One limit: ``stat`` of ``measurement`` (at ``batch_size``, in cells matching ``where``) within
    ``max`` and/or ``min``."""

    measurement: Literal["distill_step", "student_inference", "teacher_inference"]
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


@dataclass(frozen=True)
class BudgetCheck:
    budget: str  # Budget.describe()
    stat: str
    measurement: str
    run_id: str
    cell_id: str
    cell_label: str
    batch_size: int | None
    value: float | None  # median over the ok repeats; None when none is ok
    met: bool
    note: str = ""


def select(df: pd.DataFrame, budget: Budget) -> pd.DataFrame:
    """The rows ``budget`` applies to."""
    mask = df["measurement"].eq(budget.measurement)
    if budget.batch_size is not None:
        mask &= df["batch_size"].eq(budget.batch_size)
    for key, value in budget.where.items():
        mask &= df[key].eq(value) if key in df else False
    return df[mask]


def check(df: pd.DataFrame, budgets: list[Budget]) -> list[BudgetCheck]:
    """Every (budget, measurement) check on ``df``'s rows, in budget order."""
    checks = []
    for budget in budgets:
        rows = select(df, budget)
        for (run_id, cell_id, bs), group in rows.groupby(["run_id", "cell_id", "batch_size"], dropna=False, sort=False):
            ok = group[group["status"].eq(Status.OK)]
            values = pd.to_numeric(ok[budget.stat], errors="coerce").dropna() if budget.stat in ok else pd.Series()
            common = dict(
                budget=budget.describe(),
                stat=budget.stat,
                measurement=budget.measurement,
                run_id=str(run_id),
                cell_id=str(cell_id),
                cell_label=str(group["cell_label"].iloc[-1]),
                batch_size=None if pd.isna(bs) else int(bs),
            )
            if values.empty:
                why = "no ok measurement" if ok.empty else f"{budget.stat} was not measured"
                bad = group[~group["status"].eq(Status.OK)]
                if not bad.empty:
                    why = f"{bad['status'].iloc[-1]}: {' '.join(str(bad['error'].iloc[-1] or '').split())[:120]}"
                checks.append(BudgetCheck(**common, value=None, met=False, note=why))
                continue
            value = float(values.median())
            repeats = f"median of {len(values)} repeats" if len(values) > 1 else ""
            checks.append(BudgetCheck(**common, value=value, met=budget.holds(value), note=repeats))
    return checks


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
