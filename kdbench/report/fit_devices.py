"""The report's *predicted on other devices* table: each step row's step as the step-time model predicts it on the
GPUs of the device table (``predicted_step_devices``, written at run time by :func:`kdbench.fit.cost.other_devices`
from the same fake run's census), beside the step measured here and its prediction for this machine.

Read, not re-predicted: pricing a census is arithmetic the run already did in microseconds, while the census itself
comes from a fake run of the cell (seconds to minutes) that the report, on a floor below the planner and without
torch, cannot and should not repeat.  Pandas only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pandas as pd

import kdbench.report.charts as charts
from kdbench.core.names import Measurement, Status
from kdbench.core.schema import COLUMN_NAMES
from kdbench.report.format import MISSING, text

COLUMN = "predicted_step_devices"


@dataclass(frozen=True)
class DevicesTable:
    """The table: its devices (columns, in the order first met) and one formatted row per step cell."""

    devices: list[str]
    rows: list[dict]


def _parse(value) -> dict:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return {}
    try:
        parsed = json.loads(value)
    except (TypeError, ValueError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _ms(ms) -> str:
    if ms is None or pd.isna(ms):
        return MISSING
    return f"{ms:,.1f} ms" if ms >= 10 else f"{ms:,.2f} ms"


def _rate(per_s, unit: str) -> str:
    if per_s is None:
        return ""
    return f"{per_s / 1e3:,.1f}k {unit}/s" if per_s >= 1e4 else f"{per_s:,.0f} {unit}/s"


def devices_table(df: pd.DataFrame) -> DevicesTable | None:
    """One row per ok distill_step cell (its first repeat: a prediction does not change between repeats) that has
    ``predicted_step_devices``: the measured median and this machine's prediction, then each device's predicted
    step and rate; None when no row has the column (earlier runs' reports do not change)."""
    if COLUMN not in df.columns:
        return None
    df = df.reindex(columns=list(dict.fromkeys([*COLUMN_NAMES, *df.columns])))
    steps = df[df["measurement"].eq(Measurement.DISTILL_STEP) & df["status"].eq(Status.OK) & df[COLUMN].notna()]
    if steps.empty:
        return None
    steps = charts.with_keys(steps)
    steps = steps.assign(repeat_=pd.to_numeric(steps["repeat"], errors="coerce").fillna(1))
    steps = steps.sort_values(["source", "cell_label", "repeat_"], na_position="last")
    steps = steps.drop_duplicates(["run_id", "cell_id"])
    devices: list[str] = []
    rows = []
    for r in steps.to_dict("records"):
        on = _parse(r[COLUMN])
        devices += [d for d in on if d not in devices]
        rows.append(
            {
                "source": text(r.get("source")),
                "cell_label": text(r.get("cell_label")),
                "measured": _ms(r.get("median_ms")),
                "predicted": _ms(r.get("predicted_step_ms")),
                "on": {d: (_ms(v.get("ms")), _rate(v.get("per_s"), v.get("unit", ""))) for d, v in on.items()},
            }
        )
    for row in rows:
        row["cells"] = [row["on"].get(d, (MISSING, "")) for d in devices]
    return DevicesTable(devices, rows)
