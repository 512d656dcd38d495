"""The report's *Language models* section: the LM cells' (``data_kind == "tokens"``) step, serving, speculative
decoding and accuracy figures, as tables (:mod:`.tables`, pandas only, never torch) and charts (:mod:`.charts`).

:func:`lm_section` is the page's part: None when the frame has no LM rows, so other reports do not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from kdbench.core.names import Status
from kdbench.report.charts import Chart
from kdbench.report.ledger import ledger_rows, ledger_table
from kdbench.report.lm.charts import draw_lm, floor_chart, speculative_chart
from kdbench.report.lm.tables import (
    floor_points,
    has_lm,
    serving_rows,
    serving_table,
    speculative_rows,
    speculative_table,
    step_points,
    step_rows,
)

__all__ = ["LmSection", "lm_section"]


@dataclass(frozen=True)
class LmSection:
    """What the page's Language models section shows."""

    charts: list[Chart]
    steps: list[dict]  # one formatted row per LM distill_step cell of a run
    serving: list[dict]  # one formatted row per pair, setting, prompt length and batch size
    speculative: list[dict] = field(default_factory=list)  # one formatted row per pair, setting, γ and T
    ledger: list[dict] = field(default_factory=list)  # the accuracy ledger: per loss_impl, precision and objective


def lm_section(df: pd.DataFrame, out_dir: Path) -> LmSection | None:
    """The LM section of the report (its charts drawn into ``out_dir``); None when ``df`` has no LM rows."""
    if not has_lm(df):
        return None
    points = step_points(df)
    speculative = speculative_table(df)
    drawn = draw_lm(points, out_dir)
    if speculative["status"].eq(Status.OK).any():  # only runs with speculative rows get their chart
        drawn.append(speculative_chart(speculative, out_dir))
    floor = floor_points(df)
    if not floor.empty:  # decode rows against a probe's bandwidth: their share of the floor
        drawn.append(floor_chart(floor, out_dir))
    return LmSection(
        charts=drawn,
        steps=step_rows(points),
        serving=serving_rows(serving_table(df)),
        speculative=speculative_rows(speculative),
        ledger=ledger_rows(ledger_table(df)),
    )
