"""The report's *Will it fit* section: each distill_step row's predicted peak (the fit planner's) against the live
tensor peak measured during one more step, with the stated tolerance (:data:`kdbench.core.limits.FIT_TOLERANCE`).

Data (pandas only, never torch): :func:`fit_points`, one row per distill_step row that has a predicted or a measured
peak or a fit note (every repeat: a peak is not a timing to pool), with its ratio, whether the ratio is outside the
tolerance, and its fit notes; :func:`fit_rows`, the table's formatted rows.  Chart: :func:`draw_fit`, predicted
against measured on log-log axes with the y = x line and the tolerance's band.  The page's part: :func:`fit_section`
(None when no row has any fit figure, so earlier runs' reports do not change), with, where the rows carry it, the
*predicted on other devices* table (:mod:`kdbench.report.fit_devices`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

import kdbench.report.charts as charts
from kdbench.core.limits import FIT_TOLERANCE
from kdbench.core.names import FIT_NOTE, Measurement, Status
from kdbench.core.schema import COLUMN_NAMES
from kdbench.report.charts import Chart
from kdbench.report.fit_devices import DevicesTable, devices_table
from kdbench.report.format import MISSING, format_mib, text, truncate

MIB = 2**20
FIT_FIGURES = ("predicted_peak_bytes", "live_peak_bytes")


@dataclass(frozen=True)
class FitSection:
    """What the page's Will it fit section shows."""

    chart: Chart
    rows: list[dict]  # one formatted row per distill_step row with a fit figure or note
    tolerance: str  # "0.90–1.10"
    flagged: int  # rows whose ratio is outside the tolerance
    devices: DevicesTable | None = None  # each step cell predicted on other devices of the table (report.fit_devices)


def tolerance_text() -> str:
    low, high = FIT_TOLERANCE
    return f"{low:.2f}–{high:.2f}"


def fit_section(df: pd.DataFrame, out_dir: Path) -> FitSection | None:
    """The section (its chart drawn into ``out_dir``); None when no distill_step row has a fit figure or note."""
    points = fit_points(df)
    if points.empty:
        return None
    return FitSection(
        chart=draw_fit(points, out_dir),
        rows=fit_rows(points),
        tolerance=tolerance_text(),
        flagged=int(points["flagged"].sum()),
        devices=devices_table(df),
    )


def fit_notes(notes) -> str:
    """The fit notes of a row's ``notes`` (those that begin with :data:`~kdbench.core.names.FIT_NOTE`), without it."""
    if notes is None or pd.isna(notes):
        return ""
    return "; ".join(n.removeprefix(FIT_NOTE) for n in str(notes).split("; ") if n.startswith(FIT_NOTE))


def fit_points(df: pd.DataFrame) -> pd.DataFrame:
    """One row per distill_step row with a predicted or measured peak or a fit note, ordered by source, cell and
    repeat.  Added, besides the chart keys (:func:`kdbench.report.charts.with_keys`): ``ratio`` (the stored
    predicted_peak_ratio, else measured / predicted), ``flagged`` (the ratio outside the tolerance) and
    ``fit_note``."""
    df = df.reindex(columns=list(dict.fromkeys([*COLUMN_NAMES, *df.columns])))
    steps = df[df["measurement"].eq(Measurement.DISTILL_STEP)]
    notes = steps["notes"].map(fit_notes)
    keep = steps[list(FIT_FIGURES)].notna().any(axis=1) | notes.ne("")
    points = charts.with_keys(steps[keep].assign(fit_note=notes[keep]))
    if points.empty:
        return points.assign(ratio=pd.Series(dtype=float), flagged=pd.Series(dtype=bool))
    predicted = pd.to_numeric(points["predicted_peak_bytes"], errors="coerce")
    measured = pd.to_numeric(points["live_peak_bytes"], errors="coerce")
    stored = pd.to_numeric(points["predicted_peak_ratio"], errors="coerce")
    points["ratio"] = stored.fillna(measured / predicted.where(predicted > 0)).astype(float)
    low, high = FIT_TOLERANCE
    points["flagged"] = points["ratio"].notna() & ~points["ratio"].between(low, high)
    points["repeat_"] = pd.to_numeric(points["repeat"], errors="coerce").fillna(1).astype(int)
    order = ["source", "cell_label", "repeat_"]
    return points.sort_values(order, na_position="last").reset_index(drop=True)


def breakdown_text(breakdown) -> str:
    """``predicted_breakdown`` (JSON of bytes by kind) as ``parameters 24.5 MiB, gradients 5.4 MiB, ...``."""
    if breakdown is None or pd.isna(breakdown):
        return ""
    try:
        parts = json.loads(breakdown)
    except (TypeError, ValueError):
        return str(breakdown)
    return ", ".join(f"{kind} {format_mib(n)}" for kind, n in parts.items() if n)


def fit_rows(points: pd.DataFrame) -> list[dict]:
    """The section's table: per step row its predicted and measured peaks, their ratio, the phase of the predicted
    peak and its breakdown, flagged outside the tolerance."""
    several = points.groupby(["run_id", "cell_id"])["repeat_"].transform("nunique").gt(1)
    out = []
    for r, repeats in zip(points.to_dict("records"), several):
        out.append(
            {
                "source": r["source"],
                "cell_label": text(r["cell_label"]) + (f" (repeat {r['repeat_']})" if repeats else ""),
                "ok": r["status"] == Status.OK,
                "status": text(r["status"]),
                "predicted": format_mib(r["predicted_peak_bytes"]),
                "measured": format_mib(r["live_peak_bytes"]),
                "ratio": MISSING if pd.isna(r["ratio"]) else f"{r['ratio']:.3f}",
                "flagged": bool(r["flagged"]),
                "phase": text(r["predicted_peak_phase"]),
                "breakdown": breakdown_text(r["predicted_breakdown"]),
                "host_peak": format_mib(r["host_peak_bytes"]),
                "note": truncate(r["fit_note"]),
            }
        )
    return out


def draw_fit(points: pd.DataFrame, out_dir: Path) -> Chart:
    """Predicted against measured peak, one point per step row that has both, log-log, with y = x and the band."""
    title = "Will it fit: predicted against measured peak"
    both = points[points["predicted_peak_bytes"].notna() & points["live_peak_bytes"].notna()]
    if both.empty:
        return charts.not_drawn(title, "no distill_step row has both a predicted and a measured peak")
    x = pd.to_numeric(both["predicted_peak_bytes"]).astype(float) / MIB
    y = pd.to_numeric(both["live_peak_bytes"]).astype(float) / MIB
    low, high = FIT_TOLERANCE
    lo = min(x.min(), y.min()) / 1.5
    hi = max(x.max(), y.max()) * 1.5
    line = np.geomspace(lo, hi, 50)
    fig = Figure(figsize=(7.5, 6.0), layout="constrained")
    ax = fig.subplots()
    ax.fill_between(line, line * low, line * high, color="0.85")
    ax.plot(line, line, color="0.3", linewidth=1)
    sources = sorted(both["source"].unique())
    color = charts.palette(sources)
    for source in sources:
        here = both["source"].eq(source)
        flagged = both["flagged"]
        for mask, marker in ((here & ~flagged, "o"), (here & flagged, "X")):
            if mask.any():
                ax.scatter(x[mask], y[mask], color=color[source], marker=marker, s=36 if marker == "o" else 70,
                           edgecolors="black", linewidths=0.5, zorder=3)  # fmt: skip
    for _, r in both[both["flagged"]].iterrows():
        ax.annotate(str(r["cell_label"]), (float(r["predicted_peak_bytes"]) / MIB, float(r["live_peak_bytes"]) / MIB),
                    xytext=(5, 3), textcoords="offset points", fontsize=7, color="#b3261e")  # fmt: skip
    ticks = FuncFormatter(lambda v, _pos: f"{v:,.0f}" if v >= 10 else f"{v:.2g}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(ticks)
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal")
    ax.set_xlabel("predicted peak (MiB): the fit planner's fake run of the step")
    ax.set_ylabel("measured peak (MiB): live tensor bytes during one more step")
    ax.grid(alpha=0.3, which="both")
    handles = [
        Patch(facecolor="0.85", label=f"within {tolerance_text()} × predicted"),
        Line2D([], [], color="0.3", linewidth=1, label="measured = predicted"),
        *(Line2D([], [], color=color[s], marker="o", linestyle="", label=s) for s in sources),
    ]
    if both["flagged"].any():
        handles.append(Line2D([], [], color="0.4", marker="X", linestyle="", ms=8, label="outside the tolerance"))
    ax.legend(handles=handles, loc="upper left", fontsize=8)
    caption = (
        "Each distillation step row's peak memory of one device as the fit planner predicted it (the cell's own "
        "step run on fake tensors, nothing allocated) against the peak measured during one more step after the "
        "timed loop: on GPUs the caching allocator's peak of allocated bytes, on the CPU the live tensor bytes "
        "(those alive before the step plus the peak of torch's allocations during it; not the process's resident "
        f"memory). The grey band is the stated tolerance, {tolerance_text()} × the prediction; a cross marks a row "
        "outside it, labelled with its cell."
    )
    return charts.saved_chart(title, fig, out_dir, "fit_peak.png", caption)
