"""Charts of runs against runs: the forest plot of one comparison (:func:`draw_forest`) and the history of a
suite's runs on one machine (:func:`draw_history`, each run compared with the one before as kdbench compare
would: :func:`history_runs`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogFormatter, NullLocator

from kdbench.core.errors import KdbenchError
from kdbench.core.names import Measurement, Status
from kdbench.report.charts import (
    RINGED,
    Chart,
    axis_label,
    centre_spread,
    flag_counts,
    flag_rings,
    not_drawn,
    palette,
    saved_chart,
    with_keys,
)
from kdbench.report.compare.compare import compare_frames
from kdbench.report.compare.format import summary
from kdbench.report.compare.verdicts import Comparison
from kdbench.report.summaries import pooled

_LEGEND = {"contended": "contended\n(busy machine: not judged)"}
FOREST_ROWS = 60  # the most changed measurements a forest plot shows
_RATIO_TICKS = (0.1, 0.2, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
_VERDICT_COLOR = {"regressed": "#b3261e", "improved": "#1b7f3b", "unchanged": "0.45", "contended": "#d08c00"}


def draw_forest(cmp: Comparison, out_dir: Path, name: str) -> Chart:
    """A forest plot of a :class:`kdbench.report.compare.verdicts.Comparison`: per measurement, the ratio NEW/BASE and
    its interval on a log axis, 1 and the threshold band marked; regressions at the top."""
    title = f"{cmp.new.label} against {cmp.base.label}"
    rated = [c for c in cmp.changes if c.ratio is not None]
    if not rated:
        return not_drawn(title, "no measurement was ok on both sides")
    changed = [c for c in rated if str(c.verdict) != "unchanged"]
    same = sorted((c for c in rated if str(c.verdict) == "unchanged"), key=lambda c: -abs(math.log(c.ratio)))
    shown = (changed + same)[:FOREST_ROWS]
    fig = Figure(figsize=(9.0, 1.2 + 0.28 * len(shown)), layout="constrained")
    ax = fig.subplots()
    t = cmp.threshold
    ax.axvspan(1 - t, 1 + t, color="0.9", zorder=0, label=f"threshold ±{t:.0%}")
    ax.axvline(1.0, color="0.3", linewidth=0.8)
    for y, c in enumerate(shown):
        color = _VERDICT_COLOR.get(str(c.verdict), "0.45")
        ax.errorbar(
            c.ratio,
            y,
            xerr=[[c.ratio - c.ci_low], [c.ci_high - c.ratio]],
            fmt="o",
            color=color,
            markersize=4,
            capsize=2,
            mfc=color if c.gated else "white",
        )
    ax.set_yticks(range(len(shown)), [c.name for c in shown], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    low, high = ax.get_xlim()
    ax.set_xticks([v for v in _RATIO_TICKS if low <= v <= high] or [1.0])
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(
        f"ratio NEW / BASE of the centres (bounds at {cmp.confidence:.0%} for all {cmp.rated} together; > 1: slower)"
    )
    ax.grid(axis="x", alpha=0.3, which="both")
    drawn = {str(c.verdict) for c in shown}
    handles = [
        Patch(color=v, label=_LEGEND.get(k, k)) for k, v in _VERDICT_COLOR.items() if k not in _LEGEND or k in drawn
    ]  # contended only where one is drawn
    handles.append(Patch(color="0.9", label=f"threshold ±{t:.0%}"))
    fig.legend(handles=handles, fontsize=8, loc="outside right upper")  # beside the axes: it covers no interval
    more = f" The {len(rated) - len(shown)} least changed measurements are left out." if len(rated) > len(shown) else ""
    caption = (
        "Each measurement's ratio of the centres (geometric means of the repeats' medians), NEW over BASE, "
        f"with its t-interval between repeats (bounds at {cmp.confidence:.0%} for all {cmp.rated} judged "
        f"measurements together). Red: slower beyond ±{t:.0%} with an interval above 1; green: faster alike; "
        "grey: unchanged; amber: contended (a side measured on a busy machine: not judged unless "
        "--judge-contended); hollow: not judged (one repeat a side: its within-process interval shown). The grey "
        f"band is the threshold.{more}"
    )
    return saved_chart(title, fig, out_dir, name, caption)


# --- history of one suite's runs -----------------------------------------------------

HISTORY_PANELS = (
    (Measurement.DISTILL_STEP, "distillation step"),
    (Measurement.STUDENT_INFERENCE, "student inference"),
    (Measurement.TEACHER_INFERENCE, "teacher inference"),
)
HISTORY_KINDS = tuple(m for m, _ in HISTORY_PANELS)


@dataclass(frozen=True)
class HistoryRun:
    run_id: str
    label: str  # the suite repository's commit when recorded, else the run's start time
    failing: int | None  # measurements failing the gate against the previous run (None: the first run)
    verdict: str  # the comparison with the previous run, in a few words


def history_runs(df: pd.DataFrame, threshold: float = 0.05, states: dict | None = None) -> list[HistoryRun]:
    """The runs of ``df`` (one suite on one machine) in time order, each compared with the one before it as
    kdbench compare would."""
    rows = df
    order = rows.groupby("run_id")["timestamp"].min().sort_values(kind="stable").index.tolist()
    states = states or {}
    labels = _run_labels(rows, order)
    out: list[HistoryRun] = []
    for i, run_id in enumerate(order):
        here = rows[rows["run_id"].eq(run_id)]
        label = labels[run_id]
        if i == 0:
            out.append(HistoryRun(run_id, label, None, "first run"))
            continue
        try:
            before = rows[rows["run_id"].eq(order[i - 1])]
            cmp = compare_frames(
                before, here, threshold, base_state=states.get(order[i - 1]), new_state=states.get(run_id)
            )
        except KdbenchError as exc:
            out.append(HistoryRun(run_id, label, None, f"not compared: {exc}"))
            continue
        out.append(HistoryRun(run_id, label, len(cmp.bad), summary(cmp)))
    return out


def _run_labels(rows: pd.DataFrame, order: list[str]) -> dict[str, str]:
    """Each run's label: the suite repository's commit where recorded (with the start time when several runs
    share a commit), else the start time."""
    labels = {}
    for run_id in order:
        here = rows[rows["run_id"].eq(run_id)]
        commits = here["suite_commit"].dropna().unique() if "suite_commit" in here else []
        stamp = here["timestamp"].min()
        when = stamp.strftime("%m-%d %H:%M") if pd.notna(stamp) else "?"
        labels[run_id] = str(commits[0]) if len(commits) else when
    counts = pd.Series(list(labels.values())).value_counts()
    for run_id, label in labels.items():
        if counts[label] > 1:
            stamp = rows.loc[rows["run_id"].eq(run_id), "timestamp"].min()
            labels[run_id] = f"{label[:8]} {stamp.strftime('%H:%M:%S') if pd.notna(stamp) else run_id[-8:]}"
    return labels


def draw_history(
    df: pd.DataFrame, out_dir: Path, threshold: float = 0.05, states: dict | None = None
) -> list[tuple[Chart, list[HistoryRun]]]:
    """Per suite with two runs or more on one machine (device and backend): each cell's centre (repeats pooled
    as compare does) with its interval over the runs in time order, one panel per measurement kind, the runs
    where kdbench compare against the previous run fails shaded red (asv's main view).  ``history_<k>.png``.
    Runs of one suite on other machines are compared side by side, not drawn as a history."""
    out = []
    timed = df[df["status"].eq(Status.OK) & df["measurement"].isin(list(HISTORY_KINDS)) & df["suite"].notna()]
    machine = timed["device_name"].fillna("?") + " (" + timed["backend"].fillna("?") + ")"
    groups = timed.assign(machine_=machine).groupby(["suite", "machine_"])["run_id"].nunique()
    for k, (suite, where) in enumerate(sorted(groups[groups > 1].index), 1):
        ids = timed.loc[timed["suite"].eq(suite) & machine.eq(where), "run_id"].unique()
        rows = df[df["run_id"].isin(ids)]
        runs = history_runs(rows, threshold, states)
        out.append((_history_chart(rows, f"{suite} on {where}", runs, out_dir, f"history_{k}.png"), runs))
    return out


def _history_chart(df: pd.DataFrame, suite: str, runs: list[HistoryRun], out_dir: Path, name: str) -> Chart:
    title = f"History of suite {suite}"
    points = pooled(df)
    if points.empty:
        return not_drawn(title, "no successful timed measurement")
    x_of = {r.run_id: i for i, r in enumerate(runs)}
    points = points[points["run_id"].isin(x_of)].assign(x=lambda p: p["run_id"].map(x_of))
    panels = [(m, what) for m, what in HISTORY_PANELS if points["measurement"].eq(m).any()]
    fig = Figure(figsize=(11.0, 1.2 + 3.2 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (measurement, what) in zip(axes, panels):
        here = points[points["measurement"].eq(measurement)].copy()
        bs = "" if measurement == Measurement.DISTILL_STEP else " bs" + here["batch_size"].astype("Int64").astype(str)
        here["line"] = here["cell_label"].fillna(here["cell_id"]) + bs
        lines = sorted(here["line"].unique())
        color = palette(lines)
        for line in lines:
            pts = here[here["line"].eq(line)].sort_values("x")
            below, above = centre_spread(pts)
            ax.errorbar(
                pts["x"], pts["median_ms"], yerr=[below, above], marker="o", ms=4, capsize=3, color=color[line],
                label=line, linewidth=1.2,
            )  # fmt: skip
        flag_rings(ax, with_keys(here), "x", "median_ms")
        for r in runs:
            if r.failing:
                ax.axvspan(x_of[r.run_id] - 0.35, x_of[r.run_id] + 0.35, color="#b3261e", alpha=0.12, zorder=0)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(LogFormatter())
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
        ax.set_ylabel(axis_label(f"{what}: centre", "median_ms"))
        ax.set_xticks(range(len(runs)), [r.label for r in runs], rotation=30, ha="right", fontsize=8)
        ax.set_xlim(-0.5, len(runs) - 0.5)
        ax.grid(which="both", alpha=0.3)
        ncols = 1 + len(lines) // 18
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, borderaxespad=0, ncols=ncols)
    for r in runs:
        if r.failing:
            axes[0].annotate(
                f"{r.failing} fail", (x_of[r.run_id], 1.0), xycoords=("data", "axes fraction"), ha="center",
                va="bottom", color="#b3261e", fontsize=8, fontweight="bold",
            )  # fmt: skip
    failing = sum(bool(r.failing) for r in runs)
    caption = (
        f"The {len(runs)} runs of suite {suite} in time order, labelled by the commit of the suite's own "
        "repository when it lies in one (else by when the run started). Each line is one measurement of one "
        "cell: its centre (the geometric mean of the repeats' medians) with the centre's 95 % interval over "
        "the repeats (one repeat: its interquartile range). Shaded red: the runs where kdbench compare "
        f"against the run before fails the gate ({failing} of {len(runs) - 1} comparisons). {RINGED}."
        + flag_counts(with_keys(points))
    )
    return saved_chart(title, fig, out_dir, name, caption)
