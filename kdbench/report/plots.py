"""The report's timing and quality charts: the distillation step, inference latency, the student's speed-up, where
the step's time goes (its phases) and accuracy against latency.

Every chart is one PNG with a fixed file name in the output folder.  A chart with no
successful measurement to show is not drawn; its :class:`~kdbench.report.charts.Chart` carries the reason.

Timing charts are faceted by *source*: one row of panels per (run, device, backend), so
measurements from different machines are never drawn on the same axes.  The quality
chart is the exception: it places each trained model at its own measured latency.
The Language models section's charts are :mod:`kdbench.report.lm`'s; a comparison's forest plot and a suite's
history are :mod:`kdbench.report.compare.plots`'.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import LogFormatter, NullLocator

from kdbench.core.names import INFERENCE, LM_SERVING, REMAINDER_COLUMN, Measurement, Status
from kdbench.core.names import PHASES as STEP_PHASES
from kdbench.report.charts import (
    HATCHED,
    NOISY_NOTE,
    POOLED,
    RATE_COLUMNS,
    RING_LABELS,
    RINGED,
    Chart,
    add_variant,
    axis_label,
    centre_spread,
    faceted_figure,
    flag_counts,
    flag_hatches,
    flag_patches,
    flag_rings,
    grouped_bars,
    label_room,
    not_drawn,
    palette,
    rates,
    ring_handles,
    rotate_labels,
    saved_chart,
    variant_order,
    variant_rank,
    with_keys,
)
from kdbench.report.summaries import REMAINDER_LIMIT, phase_gap, pooled, shown_phases


def draw_charts(df: pd.DataFrame, out_dir: Path) -> list[Chart]:
    """Draw the timing charts of the report into ``out_dir`` (quality rows, which time nothing, left out):
    one bar or point per cell, its repeats pooled as ``compare`` centres them."""
    ok = with_keys(pooled(df))
    sized = ok[ok["batch_size"].notna()]  # serving is drawn against the batch size
    speedups = sized[sized["measurement"].eq(Measurement.STUDENT_INFERENCE) & sized["speedup_vs_teacher"].notna()]
    speedups = speedup_flags(speedups, sized[sized["measurement"].isin(INFERENCE)])
    serving = [_inference_latency(sized[sized["measurement"].isin(INFERENCE)], out_dir), _speedup(speedups, out_dir)]
    if ok["measurement"].isin(LM_SERVING).any():  # an LM run's serving is drawn in its own section
        where = " Language models' prefill and decode, with their speed-ups, are in the Language models section."
        serving = [replace(c, caption=c.caption + where) if c.file is None else c for c in serving]
    return [_distill_step(ok[ok["measurement"].eq(Measurement.DISTILL_STEP)], out_dir), *serving]


def _distill_step(rows: pd.DataFrame, out_dir: Path) -> Chart:
    title = "Distillation step"
    if rows.empty:
        return not_drawn(title, "no successful distill_step measurement")
    rows = add_variant(rows, extra=("batch_size",), within=("source", "pair")).sort_values("pair")
    sources = sorted(rows["source"].unique())
    variants = variant_order(rows["variant"])
    color = palette(variants)
    n_bars = rows.groupby("source").size().max()

    def style(bars):
        return {"color": color[bars["variant"].iloc[0]], "hatch": flag_hatches(bars)}

    def with_iqr(bars):  # error bars: the centre's interval over repeats; with one repeat p25 to p75
        low, high = centre_spread(bars)
        return {**style(bars), "yerr": [low, high], "capsize": 3}

    rows = rates(rows)
    units = [c for c in RATE_COLUMNS if rows["rate_column"].eq(c).any()]  # one throughput panel per unit
    width = min(16.0, max(9.0, 0.7 * n_bars + 5 + 3 * (len(units) - 1)))
    pairs = list(rows["pair"].unique())
    room = label_room(pairs, rotate_labels(pairs, 0.7 * width / (1 + len(units))))  # as grouped_bars decides
    fig, facets = faceted_figure(sources, 1 + len(units), width=width, height=3.6 + room)
    for (ax_t, *ax_rates), source in zip(facets, sources):
        here = rows[rows["source"].eq(source)]
        grouped_bars(ax_t, here, "pair", "variant", variants, "median_ms", with_iqr)
        ax_t.set_ylabel(axis_label("step time", "median_ms") + "\ncentre over repeats")  # two short lines
        for ax_q, unit in zip(ax_rates, units):
            in_unit = here[here["rate_column"].eq(unit)]
            if in_unit.empty:
                ax_q.set_visible(False)
                continue
            grouped_bars(ax_q, in_unit.fillna({"rate": 0}), "pair", "variant", variants, "rate", style)
            ax_q.set_ylabel(axis_label("throughput", unit))
    handles = [Patch(facecolor=color[v], edgecolor="0.25", label=v) for v in variants]
    fig.legend(handles=[*handles, *flag_patches(rows, always_noisy=True)], loc="outside right upper", fontsize=8)
    per_unit = (
        " A language model's (or any token workload's) cells are drawn in tokens/s, in a panel of their own; other "
        "cells in samples/s."
        if len(units) > 1
        else " Token workloads' cells (language models) in tokens/s."
        if units == [RATE_COLUMNS[0]]
        else ""
    )
    caption = (
        "Time of one distillation step (teacher forward, student forward, backward and update) per teacher → "
        f"student pair and cell (left), and the resulting throughput (right): one bar per cell, its {POOLED} (the "
        "geometric mean of the repeats' medians). Error bars: the centre's 95 % interval over the repeats; with a "
        f"single repeat, the interquartile range of its timed iterations. {HATCHED} (shrunk by the time budget: "
        "never judged)." + per_unit + flag_counts(rows)
    )
    return saved_chart(title, fig, out_dir, "distill_step.png", caption)


def _inference_latency(rows: pd.DataFrame, out_dir: Path) -> Chart:
    title = "Inference latency"
    if rows.empty:
        return not_drawn(title, "no successful student_inference or teacher_inference measurement with a batch size")
    rows = add_variant(rows, extra=("runtime",))
    rows["role"] = rows["measurement"].str.removesuffix("_inference")
    rows["model"] = rows["student"].where(rows["role"].eq("student"), rows["teacher"]).fillna("?")
    rows["line"] = rows["role"] + ": " + rows["model"] + " · " + rows["variant"]
    # A teacher measured in several cells (one per student) is one line: the median of its medians.
    points = (
        rows.groupby(["source", "role", "model", "variant", "line", "batch_size"], as_index=False)
        .agg(
            median_ms=("median_ms", "median"),
            is_noisy=("is_noisy", "any"),
            is_contended=("is_contended", "any"),
            is_thin=("is_thin", "all"),
        )
        .sort_values("batch_size")
    )
    sources = sorted(points["source"].unique())
    color = palette(sorted(points["model"].unique()))  # colour: model; marker: variant; dash: teacher
    marker = dict(zip(variant_order(points["variant"]), itertools.cycle("osD^v<>pX*")))
    batch_sizes = sorted(points["batch_size"].unique())

    fig, facets = faceted_figure(sources, 1, width=10.0, height=3.6)
    for (ax,), source in zip(facets, sources):
        here = points[points["source"].eq(source)]
        for (role, model, variant, line), pts in here.groupby(["role", "model", "variant", "line"]):
            ax.plot(
                pts["batch_size"],
                pts["median_ms"],
                "-" if role == "student" else "--",
                marker=marker[variant],
                ms=4,
                color=color[model],
                label=line,
            )
        flag_rings(ax, here, "batch_size", "median_ms")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(batch_sizes, [str(int(b)) for b in batch_sizes])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(LogFormatter())
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
        ax.set_xlabel(axis_label("batch size", "batch_size"))
        ax.set_ylabel(axis_label("median latency", "median_ms"))
        ax.grid(which="both", alpha=0.3)
        n_entries = len(ax.get_legend_handles_labels()[1])
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, borderaxespad=0, ncols=1 + n_entries // 17)
    caption = (
        "Latency of one inference forward pass against batch size (both axes logarithmic), each "
        f"measurement's {POOLED}; students solid, teachers dashed. "
        f"A teacher measured in several cells is drawn once, at the median of its centres. {RINGED}."
        + flag_counts(points)
    )
    return saved_chart(title, fig, out_dir, "inference_latency.png", caption)


def _speedup(rows: pd.DataFrame, out_dir: Path) -> Chart:
    title = "Student speed-up over teacher"
    if rows.empty:
        return not_drawn(title, "no student_inference measurement with a matching teacher_inference")
    rows = add_variant(rows, extra=("runtime",), within=("source", "pair", "batch_size"))
    rows["group"] = rows["pair"] + "\n(" + rows["variant"] + ")"
    rows = rows.assign(rank=rows["variant"].map(variant_rank)).sort_values(["pair", "rank"])
    sources = sorted(rows["source"].unique())
    batch_sizes = sorted(rows["batch_size"].unique())
    shades = colormaps["viridis"]
    color = {b: shades(0.1 + 0.75 * i / max(1, len(batch_sizes) - 1)) for i, b in enumerate(batch_sizes)}
    n_bars = rows.groupby("source").size().max()

    n_groups = rows.groupby("source")["group"].nunique().max()
    width = min(14.0, max(8.0, 0.45 * n_bars + 4))
    groups = list(rows["group"].unique())
    room = label_room(groups, n_groups > 4 or rotate_labels(groups, 0.75 * width))  # vertical tick labels
    fig, facets = faceted_figure(sources, 1, width=width, height=3.8 + room)
    for (ax,), source in zip(facets, sources):
        here = rows[rows["source"].eq(source)]
        drawn = grouped_bars(
            ax,
            here,
            "group",
            "batch_size",
            batch_sizes,
            "speedup_vs_teacher",
            lambda bars: {"color": color[bars["batch_size"].iloc[0]], "hatch": flag_hatches(bars)},
        )
        for batch_size, bars in drawn.items():  # a flagged speed-up says so on its bar too, not by its hatch alone
            of = here[here["batch_size"].eq(batch_size)]
            labels = [
                f"{x:.1f}×" + (" contended" if c else "") + (" noisy" if n else "")
                for x, c, n in zip(of["speedup_vs_teacher"], of["is_contended"], of["is_noisy"])
            ]
            ax.bar_label(bars, labels=labels, fontsize=7, padding=2, rotation=90)
        ax.axhline(1.0, color="0.3", linestyle="--", linewidth=1)
        ax.margins(y=0.18)
        ax.set_ylabel(axis_label("speed-up vs teacher", "speedup_vs_teacher"))
    handles = [Patch(facecolor=color[b], edgecolor="0.25", label=str(int(b))) for b in batch_sizes]
    fig.legend(
        handles=[*handles, *flag_patches(rows)],
        loc="outside right upper",
        fontsize=8,
        title=axis_label("batch size", "batch_size"),
        title_fontsize=8,
    )
    inverted = int(rows["is_inverted"].sum())
    caption = (
        "Teacher latency divided by student latency at the same batch size and precision, per cell (the "
        "centres over repeats of each repeat's own speed-up). Above the dashed line (1×) the student is faster. "
        f"A speed-up is hatched as its two latencies are: / noisy ({NOISY_NOTE}), \\ contended (measured on a busy "
        "machine); it is marked noisy too where the teacher or the student ran slower at this batch size than at a "
        "larger one in the same cell, which only noise does: such a bar is no speed-up to read."
        + flag_counts(rows)
        + (f" {inverted} of them slower at a smaller batch than at a larger one." if inverted else "")
    )
    return saved_chart(title, fig, out_dir, "speedup.png", caption)


def speedup_flags(speedups: pd.DataFrame, inference: pd.DataFrame) -> pd.DataFrame:
    """The student_inference rows ``speedups`` with the flags of both latencies their speed-up divides: contended or
    noisy where the student's or the same cell's teacher's row at that batch size is, and ``is_inverted`` (counted
    as noisy) where either model's latency at this batch size is above its latency at a larger batch size of the
    same cell: a batch of 1 slower than a batch of 32 is noise, and the speed-up drawn from it is too."""
    key = ["run_id", "cell_id", "batch_size"]
    teacher = inference[inference["measurement"].eq(Measurement.TEACHER_INFERENCE)].drop_duplicates(key, keep="last")
    teacher = teacher.set_index(key)
    at = pd.MultiIndex.from_frame(speedups[key])
    out = speedups.copy()
    for flag in ("is_noisy", "is_contended", "is_thin"):
        theirs = teacher[flag].reindex(at).eq(True).to_numpy() if flag in teacher else False
        out[flag] = out[flag].eq(True).to_numpy() | theirs
    inverted = pd.Series(False, index=inference.index)
    for _, rows in inference.groupby(["run_id", "cell_id", "measurement"]):
        ms = pd.to_numeric(rows["median_ms"], errors="coerce")
        batch = pd.to_numeric(rows["batch_size"], errors="coerce")
        for i in rows.index:  # slower than at some larger batch of the same model and cell
            inverted[i] = bool((ms[batch > batch[i]] < ms[i]).any())
    by_key = inference.assign(inverted_=inverted).groupby(key)["inverted_"].any()
    out["is_inverted"] = by_key.reindex(at).fillna(False).astype(bool).to_numpy()
    out["is_noisy"] = out["is_noisy"] | out["is_inverted"]
    return out


# --- where the step's time goes ------------------------------------------------------

PHASES = tuple((p.column, p.label) for p in STEP_PHASES)  # (column, legend label) in the order of the step
REMAINDER = (REMAINDER_COLUMN, "remainder (step median − the phases)")
PHASE_COLUMNS = tuple(c for c, _ in PHASES) + (REMAINDER[0],)
_REMAINDER_COLOR = "0.75"
_REMAINDER_HATCH = "xx"


def draw_phases(df: pd.DataFrame, out_dir: Path) -> Chart:
    """``phases.png``: the median step split into its phases, one horizontal bar per distill_step cell."""
    title = "Where the step's time goes"
    df = with_keys(pooled(df))
    rows = df[df["measurement"].eq(Measurement.DISTILL_STEP)]
    rows = rows[rows[list(PHASE_COLUMNS)].notna().any(axis=1)]
    if rows.empty:
        return not_drawn(title, "no successful distill_step measurement has phase timings")
    # the remainder drawn is what the phases drawn leave of the median drawn (the table's "adds up" judges the same)
    rows = rows.assign(bar=rows["cell_label"].fillna(rows["pair"]), **{REMAINDER[0]: phase_gap(rows)})
    rows = rows.sort_values("bar", ascending=False)
    sources = sorted(rows["source"].unique())
    # on-policy LM steps begin with the student's generation: drawn first where any cell has it
    phases = tuple((p.column, p.label) for p in shown_phases(rows))
    color = palette([c for c, _ in phases])
    n_bars = rows.groupby("source").size().max()
    clipped = int((rows[REMAINDER[0]] < 0).sum())

    fig, facets = faceted_figure(sources, 1, width=11.0, height=1.3 + 0.38 * n_bars)
    for (ax,), source in zip(facets, sources):
        here = rows[rows["source"].eq(source)]
        y = range(len(here))
        left = pd.Series(0.0, index=here.index)
        for column, label in (*phases, REMAINDER):
            width = here[column].fillna(0.0).clip(lower=0.0)
            look = (
                {"color": _REMAINDER_COLOR, "hatch": _REMAINDER_HATCH}
                if column == REMAINDER[0]
                else {"color": color[column]}
            )
            ax.barh(y, width, left=left, height=0.7, label=label, edgecolor="0.25", linewidth=0.5, **look)
            left = left + width
        median = here["median_ms"]
        ax.scatter(median, y, marker="|", s=260, color="black", linewidths=2, zorder=3, label="median step time")
        flag_rings(ax, here.assign(y_=list(y)), "median_ms", "y_", s=160)
        ax.set_yticks(list(y), list(here["bar"]), fontsize=8)
        ax.set_ylim(-0.6, len(here) - 0.4)
        ax.set_xlabel(axis_label("median time per step", "phase_backward_ms"))
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
    handles, labels = facets[0][0].get_legend_handles_labels()
    handles = [h for h, label in zip(handles, labels) if label not in RING_LABELS] + ring_handles(rows)
    fig.legend(handles=handles, loc="outside right upper", fontsize=8)
    note = (
        f" {clipped} stack{'s end' if clipped != 1 else ' ends'} past the tick: the phase medians add up to more "
        "than the step median (no remainder drawn)."
        if clipped
        else ""
    )
    caption = (
        "The median of each phase of the distillation step (teacher forward, student forward, loss, "
        "backward, optimizer; pooled over repeats as the step's time is), "
        "stacked; the grey hatched remainder is the median step time minus the sum of the phase medians drawn, "
        "so that the stack ends at the black tick, the median step time. It holds the time between the stamps "
        "(Python overhead) and what medians taken from different iterations do not add up to: where the phases "
        f"vary from one iteration to the next it can be large (the table below flags one above {REMAINDER_LIMIT:.0%} "
        f"of the median and says why). {RINGED}." + note + flag_counts(rows)
    )
    return saved_chart(title, fig, out_dir, "phases.png", caption)


# --- quality against latency ---------------------------------------------------------


def _latency(inference: pd.DataFrame, column: str, model: str, run_ids: set) -> tuple[float, int] | None:
    """Median latency of ``model`` at its smallest measured batch size, preferring rows of ``run_ids``.

    Several rows at that batch size (cells, precisions) give the median of their medians.
    """
    rows = inference[inference[column].eq(model)]
    same_run = rows[rows["run_id"].isin(run_ids)]
    rows = same_run if len(same_run) else rows
    if rows.empty:
        return None
    batch = rows["batch_size"].min()
    return float(rows.loc[rows["batch_size"].eq(batch), "median_ms"].median()), int(batch)


def _accuracy_points(quality: pd.DataFrame) -> pd.DataFrame:
    """Mean and std (ddof=1, 0 for one seed) of accuracy per model: teachers, and students per method or scratch."""
    q = quality[quality["status"].eq(Status.OK) & quality["accuracy"].notna()].copy()
    is_teacher = q["quality_role"].eq("teacher")
    q["model"] = q["teacher"].where(is_teacher, q["student"]).fillna("?")
    q["kind"] = q["method"].where(q["quality_role"].eq("distilled"), q["quality_role"]).fillna("?")
    if q.loc[q["quality_role"].eq("distilled"), "teacher"].nunique() > 1:  # say which teacher distilled
        from_teacher = " ← " + q["teacher"].fillna("?")
        q["kind"] = q["kind"].where(~q["quality_role"].eq("distilled"), q["kind"] + from_teacher)
    points = q.groupby(["quality_role", "model", "kind"], as_index=False).agg(
        accuracy=("accuracy", "mean"),
        std=("accuracy", "std"),
        seeds=("accuracy", "size"),
        run_ids=("run_id", lambda s: tuple(sorted(set(s.dropna())))),
    )
    points["std"] = points["std"].fillna(0.0)
    return points


def draw_quality_front(df: pd.DataFrame, out_dir: Path) -> Chart:
    """``quality_front.png``: trained accuracy (mean ± std over seeds) against inference latency."""
    title = "Accuracy against inference latency"
    df = df.copy()
    df["run_id"] = df["run_id"].fillna("?")
    quality = df[df["measurement"].eq(Measurement.QUALITY)]
    points = _accuracy_points(quality)
    if points.empty:
        return not_drawn(title, "no successful quality row with an accuracy")
    ok = df[df["status"].eq(Status.OK) & df["median_ms"].notna() & df["batch_size"].notna()]
    inference = {
        "teacher": ok[ok["measurement"].eq(Measurement.TEACHER_INFERENCE)],
        "student": ok[ok["measurement"].eq(Measurement.STUDENT_INFERENCE)],
    }
    found = []
    for p in points.itertuples(index=False):
        role = "teacher" if p.quality_role == "teacher" else "student"
        found.append(_latency(inference[role], role, p.model, p.run_ids))
    points["latency_ms"] = [f[0] if f else None for f in found]
    points["latency_batch"] = [f[1] if f else None for f in found]
    missing = sorted(set(points.loc[points["latency_ms"].isna(), "model"]))
    points = points[points["latency_ms"].notna()]
    if points.empty:
        return not_drawn(
            title,
            "no student_inference or teacher_inference latency of the models the quality rows "
            "trained (" + ", ".join(missing) + ")",
        )

    students = points[points["quality_role"].ne("teacher")]
    teachers = points[points["quality_role"].eq("teacher")]
    color = palette(sorted(students["model"].unique()))
    kinds = sorted(students["kind"].unique(), key=lambda k: (k != "scratch", k))
    marker = dict(zip(kinds, itertools.cycle("osD^v<>pX")))
    fig = Figure(figsize=(10.0, 5.0), layout="constrained")
    ax = fig.subplots()
    for p in students.itertuples(index=False):
        ax.errorbar(
            p.latency_ms,
            p.accuracy * 100,
            yerr=p.std * 100,
            fmt=marker[p.kind],
            ms=7,
            capsize=3,
            color=color[p.model],
            mec="0.2",
            label=f"{p.model} · {p.kind} (batch {p.latency_batch})",
        )
    for p in teachers.itertuples(index=False):
        ax.errorbar(
            p.latency_ms,
            p.accuracy * 100,
            yerr=p.std * 100,
            fmt="*",
            ms=14,
            capsize=3,
            color="black",
            label=f"teacher {p.model} (batch {p.latency_batch})",
        )
    if points["latency_ms"].max() > 10 * points["latency_ms"].min():
        ax.set_xscale("log")
    ax.set_xlabel(axis_label("median inference latency at the smallest measured batch size", "median_ms"))
    ax.set_ylabel("top-1 test accuracy (%)")
    datasets = ", ".join(map(str, quality["quality_dataset"].dropna().unique()))
    ax.set_title(
        "Top-1 accuracy (%) against inference latency (ms)" + (f" · {datasets}" if datasets else ""), fontsize=10
    )
    ax.grid(which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, borderaxespad=0)
    note = f" Left out (no latency measured): {', '.join(missing)}." if missing else ""
    caption = (
        "Top-1 test accuracy after training (mean over seeds, error bars ± one standard deviation) against the "
        "median inference latency of the same model, at the smallest batch size measured for it, from the same "
        "run where there is one (the median of the medians when several cells measured it). Students: colour "
        "by model, marker by method (scratch: trained without a teacher); teachers: black stars. Up and to the "
        "left is better." + note
    )
    return saved_chart(title, fig, out_dir, "quality_front.png", caption)
