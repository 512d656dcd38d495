"""The report's charts, drawn with matplotlib's object API (no pyplot, no global state).

Every chart is one PNG with a fixed file name in the output folder.  A chart with no
successful measurement to show is not drawn; its :class:`Chart` carries the reason.

Timing charts are faceted by *source*: one row of panels per (run, device, backend), so
measurements from different machines are never drawn on the same axes.  The quality
chart is the exception: it places each trained model at its own measured latency.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import pyarrow as pa
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogFormatter, NullLocator

from kdbench.names import GENERATE, INFERENCE, LM_SERVING, REMAINDER_COLUMN, Measurement, Status
from kdbench.names import PHASES as STEP_PHASES
from kdbench.report.summaries import pooled
from kdbench.schema import COLUMNS

DPI = 110
NOISY_NOTE = "IQR/median > 10 %"
_UNITS = {c.name: c.unit for c in COLUMNS}
_INTEGER = {c.name for c in COLUMNS if pa.types.is_integer(c.type)}
_PRECISION_ORDER = {"fp32": 0, "tf32": 1, "bf16": 2, "fp16": 3}
# Config columns that, when they vary among plotted rows, become part of a bar's label; cells that still share
# a label (a setting no column shows) get their cell id's first digits, so no two cells ever share a bar.
_VARIANT_COLUMNS = (
    "method",
    "loss_impl",
    "seq_len",
    "teacher_precision",
    "teacher_mode",
    "memory_format",
    "world_size",
    "alignment",
    "pad_to",
    "seed",
    "data_shape",
    "num_classes",
    "optimizer",
    "optimizer_impl",
    "lr",
    "kd_temperature",
    "kd_alpha",
    "method_params",
    "compile",
    "compile_teacher",
    "graphs",
    "conv_autotune",
    "tunableop",
    "parallel",
    "teacher_weights",
)
# Columns that hold for one family of pairs or one setting only (an image cell has no seq_len, an LM cell no image
# shape, a single-device cell no parallel): left out of a label where null, instead of shown as "?".
_WHERE_THEY_APPLY = {"loss_impl", "seq_len", "data_shape", "num_classes", "memory_format", "parallel"}
# Compact spellings of varying config values in chart labels; others show as `column=value`.
_SHORT = {
    "teacher_precision": "teacher-{}",
    "teacher_mode": "teacher-{}",
    "memory_format": "{}",
    "world_size": "ws{}",
    "alignment": "align{}",
    "pad_to": "pad{}",
    "seed": "seed{}",
    "method": "{}",
    "loss_impl": "{}",
    "seq_len": "seq{}",
    "parallel": "{}",
    "teacher_weights": "teacher-weights-{}",
    "data_shape": "{}",
    "optimizer": "{}",
    "optimizer_impl": "{}",
    "compile": "compile-{}",
    "runtime": "serve-{}",
}
_NOISY_HATCH = "///"
_THIN_HATCH = ".."
THIN_NOTE = "thin: shrunk by the time budget, not judged"


@dataclass(frozen=True)
class Chart:
    """One chart of the report: drawn (``file`` set) or skipped (``file`` is None)."""

    title: str
    caption: str  # what the chart shows, or why it was skipped
    file: str | None = None


def axis_label(text: str, column: str) -> str:
    """``text`` followed by the unit of ``column`` as the schema documents it."""
    unit = _UNITS[column]
    return f"{text} ({unit})" if unit else text


def draw_charts(df: pd.DataFrame, out_dir: Path) -> list[Chart]:
    """Draw the timing charts of the report into ``out_dir`` (quality rows, which time nothing, left out):
    one bar or point per cell, its repeats pooled as ``compare`` centres them."""
    ok = _with_keys(pooled(df))
    serving = [
        _inference_latency(ok[ok["measurement"].isin(INFERENCE)], out_dir),
        _speedup(ok[ok["measurement"].eq(Measurement.STUDENT_INFERENCE) & ok["speedup_vs_teacher"].notna()], out_dir),
    ]
    if ok["measurement"].isin(LM_SERVING).any():  # an LM run's serving is drawn in its own section
        where = " Language models' prefill and decode, with their speed-ups, are in the Language models section."
        serving = [replace(c, caption=c.caption + where) if c.file is None else c for c in serving]
    return [_distill_step(ok[ok["measurement"].eq(Measurement.DISTILL_STEP)], out_dir), *serving]


# --- shared helpers ----------------------------------------------------------------


def _with_keys(df: pd.DataFrame) -> pd.DataFrame:
    """Add the columns the charts group by: ``pair``, ``source``, ``is_noisy``; null precision as ``?``."""
    df = df.copy()
    df["pair"] = df["teacher"].fillna("?") + " → " + df["student"].fillna("?")
    df["source"] = df["device_name"].fillna("unknown device") + " (" + df["backend"].fillna("?") + ")"
    if df["run_id"].nunique() > 1:
        df["source"] += " · run " + df["run_id"].fillna("?")
    df["precision"] = df["precision"].fillna("?")
    df["is_noisy"] = df["noisy"].eq(True)
    df["is_thin"] = df["thin"].eq(True) if "thin" in df else False
    return df


def _add_variant(df: pd.DataFrame, extra: tuple[str, ...] = (), within: tuple[str, ...] = ()) -> pd.DataFrame:
    """Add ``variant``: the precision, plus ``col=value`` for config columns that vary; cells of one
    ``within`` group (e.g. source and pair) that would still share a variant get their cell id's start."""
    df = df.copy()
    varying = [c for c in (*_VARIANT_COLUMNS, *extra) if c in df and df[c].nunique(dropna=False) > 1]
    df["variant"] = df["precision"]
    for col in varying:
        template = _SHORT.get(col, col + "={}")
        values = df[col].astype("Int64") if col in _INTEGER else df[col]  # 2, not 2.0, when a null made it float
        text = ", " + values.astype("string").fillna("?").map(template.format)
        df["variant"] += text.where(values.notna(), "") if col in _WHERE_THEY_APPLY else text
    if within:
        group = [*within, "variant"]
        shared = df.groupby(group, dropna=False)["cell_id"].transform("nunique").gt(1)
        df.loc[shared, "variant"] += " #" + df.loc[shared, "cell_id"].astype(str).str[:6]
    return df


def _variant_rank(variant: str) -> tuple[int, str]:
    """Sort key of a variant: precisions in a fixed order (fp32, tf32, bf16, fp16, others)."""
    return _PRECISION_ORDER.get(variant.split(",")[0], 99), variant


def _variant_order(variants) -> list[str]:
    return sorted(set(variants), key=_variant_rank)


def _colors(keys: list[str]) -> dict[str, tuple]:
    """A stable tab10/tab20 colour per key."""
    cmap = colormaps["tab10" if len(keys) <= 10 else "tab20"]
    return {k: cmap(i % cmap.N) for i, k in enumerate(keys)}


def _spread(rows: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """(below, above) the centre for error bars: the centre's interval over repeats where there is one, else
    the single repeat's p25 to p75 (rows stored before the quartiles: ± IQR/2)."""
    half = (rows["iqr_ms"] / 2).fillna(0)
    below = (rows["median_ms"] - rows["p25_ms"]).fillna(half)
    above = (rows["p75_ms"] - rows["median_ms"]).fillna(half)
    if "centre_low_ms" in rows:
        below = (rows["median_ms"] - rows["centre_low_ms"]).fillna(below)
        above = (rows["centre_high_ms"] - rows["median_ms"]).fillna(above)
    return below.clip(lower=0, upper=rows["median_ms"]), above.clip(lower=0)


def _skipped(title: str, why: str) -> Chart:
    return Chart(title=title, caption=f"Not drawn: {why}.")


def _facets(sources: list[str], ncols: int, width: float, height: float) -> tuple[Figure, list]:
    """A figure with one titled row of ``ncols`` axes per source."""
    fig = Figure(figsize=(width, height * len(sources)), layout="constrained")
    rows = []
    for sub, source in zip(fig.subfigures(len(sources), 1, squeeze=False)[:, 0], sources):
        sub.suptitle(source, fontsize=10, fontweight="bold", x=0.01, ha="left")
        rows.append(sub.subplots(1, ncols, squeeze=False)[0])
    return fig, rows


def _grouped_bars(ax, here: pd.DataFrame, group: str, series: str, order: list, value: str, style) -> dict:
    """Bars of ``value``: one x group per distinct ``group`` (in row order), one bar per ``series`` in ``order``.

    ``style(bars)`` gives the keyword arguments of ``ax.bar`` for one series' rows.
    Returns the BarContainers drawn, by series value.
    """
    groups = list(here[group].drop_duplicates())
    width = 0.8 / len(order)
    drawn = {}
    for j, key in enumerate(order):
        bars = here[here[series].eq(key)]
        if bars.empty:
            continue
        x = bars[group].map(groups.index) + (j - (len(order) - 1) / 2) * width
        drawn[key] = ax.bar(x, bars[value], width=width, edgecolor="0.25", linewidth=0.5, **style(bars))
    rotate = len(groups) > 4
    labels = [g.replace("\n", " ") if rotate else g.replace(" → ", "\n→ ") for g in groups]  # two lines side by side
    ax.set_xticks(
        range(len(groups)),
        labels,
        rotation=90 if rotate else 0,
        ha="right" if rotate else "center",
        rotation_mode="anchor",
        va="center" if rotate else "top",
        fontsize=8 if rotate else None,
    )
    ax.set_xlim(-0.7, len(groups) - 0.3)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    return drawn


def _save(fig: Figure, out_dir: Path, name: str) -> str:
    """Write ``fig`` as ``out_dir/name``; a bare Figure has no pyplot state to close."""
    fig.savefig(out_dir / name, dpi=DPI)
    return name


# --- charts --------------------------------------------------------------------------


def _distill_step(rows: pd.DataFrame, out_dir: Path) -> Chart:
    title = "Distillation step"
    if rows.empty:
        return _skipped(title, "no successful distill_step measurement")
    rows = _add_variant(rows, extra=("batch_size",), within=("source", "pair")).sort_values("pair")
    sources = sorted(rows["source"].unique())
    variants = _variant_order(rows["variant"])
    color = _colors(variants)
    n_bars = rows.groupby("source").size().max()

    def style(bars):
        hatch = [_THIN_HATCH if t else _NOISY_HATCH if n else "" for n, t in zip(bars["is_noisy"], bars["is_thin"])]
        return {"color": color[bars["variant"].iloc[0]], "hatch": hatch}

    def with_iqr(bars):  # error bars: the centre's interval over repeats; with one repeat p25 to p75
        low, high = _spread(bars)
        return {**style(bars), "yerr": [low, high], "capsize": 3}

    fig, facets = _facets(sources, 2, width=min(16.0, max(9.0, 0.7 * n_bars + 5)), height=3.6)
    for (ax_t, ax_q), source in zip(facets, sources):
        here = rows[rows["source"].eq(source)]
        _grouped_bars(ax_t, here, "pair", "variant", variants, "median_ms", with_iqr)
        _grouped_bars(ax_q, here.fillna({"throughput": 0}), "pair", "variant", variants, "throughput", style)
        ax_t.set_ylabel(axis_label("step time (centre over repeats)", "median_ms"))
        ax_q.set_ylabel(axis_label("throughput", "throughput"))
    handles = [Patch(facecolor=color[v], edgecolor="0.25", label=v) for v in variants]
    handles.append(Patch(facecolor="white", edgecolor="0.25", hatch=_NOISY_HATCH, label=f"noisy\n({NOISY_NOTE})"))
    if rows["is_thin"].any():
        handles.append(Patch(facecolor="white", edgecolor="0.25", hatch=_THIN_HATCH, label=THIN_NOTE))
    fig.legend(handles=handles, loc="outside right upper", fontsize=8)
    return Chart(
        title=title,
        file=_save(fig, out_dir, "distill_step.png"),
        caption=(
            "Time of one distillation step (teacher forward, student forward, backward and update) per "
            "teacher → student pair and cell (left), and the resulting throughput (right): one bar per cell, its "
            "repeats pooled as kdbench compare centres them (the geometric mean of the repeats' medians). "
            "Error bars: the centre's 95 % interval over the repeats; with a single repeat, the interquartile "
            f"range of its timed iterations. Hatched bars are noisy ({NOISY_NOTE}); dotted ones thin "
            "(shrunk by the time budget: never judged)."
        ),
    )


def _inference_latency(rows: pd.DataFrame, out_dir: Path) -> Chart:
    title = "Inference latency"
    rows = rows[rows["batch_size"].notna()]
    if rows.empty:
        return _skipped(title, "no successful student_inference or teacher_inference measurement with a batch size")
    rows = _add_variant(rows, extra=("runtime",))
    rows["role"] = rows["measurement"].str.removesuffix("_inference")
    rows["model"] = rows["student"].where(rows["role"].eq("student"), rows["teacher"]).fillna("?")
    rows["line"] = rows["role"] + ": " + rows["model"] + " · " + rows["variant"]
    # A teacher measured in several cells (one per student) is one line: the median of its medians.
    points = (
        rows.groupby(["source", "role", "model", "variant", "line", "batch_size"], as_index=False)
        .agg(median_ms=("median_ms", "median"), is_noisy=("is_noisy", "any"), is_thin=("is_thin", "all"))
        .sort_values("batch_size")
    )
    sources = sorted(points["source"].unique())
    color = _colors(sorted(points["model"].unique()))  # colour: model; marker: variant; dash: teacher
    marker = dict(zip(_variant_order(points["variant"]), itertools.cycle("osD^v<>pX*")))
    batch_sizes = sorted(points["batch_size"].unique())

    fig, facets = _facets(sources, 1, width=10.0, height=3.6)
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
        for flag, mark, label in (
            ("is_thin", {"marker": "x", "color": "black"}, THIN_NOTE),
            ("is_noisy", {"facecolors": "none", "edgecolors": "black"}, f"noisy ({NOISY_NOTE})"),
        ):
            flagged = here[here[flag]]
            if len(flagged):
                ax.scatter(
                    flagged["batch_size"], flagged["median_ms"], s=90, linewidths=1, zorder=3, label=label, **mark
                )
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
    return Chart(
        title=title,
        file=_save(fig, out_dir, "inference_latency.png"),
        caption=(
            "Latency of one inference forward pass against batch size (both axes logarithmic), each "
            "measurement's repeats pooled as kdbench compare centres them; students solid, teachers dashed. "
            "A teacher measured in several cells is drawn once, at the median of its centres. Circled points "
            f"are noisy ({NOISY_NOTE}); crossed ones thin (shrunk by the time budget)."
        ),
    )


def _speedup(rows: pd.DataFrame, out_dir: Path) -> Chart:
    title = "Student speed-up over teacher"
    rows = rows[rows["batch_size"].notna()]
    if rows.empty:
        return _skipped(title, "no student_inference measurement with a matching teacher_inference")
    rows = _add_variant(rows, extra=("runtime",), within=("source", "pair", "batch_size"))
    rows["group"] = rows["pair"] + "\n(" + rows["variant"] + ")"
    rows = rows.assign(rank=rows["variant"].map(_variant_rank)).sort_values(["pair", "rank"])
    sources = sorted(rows["source"].unique())
    batch_sizes = sorted(rows["batch_size"].unique())
    shades = colormaps["viridis"]
    color = {b: shades(0.1 + 0.75 * i / max(1, len(batch_sizes) - 1)) for i, b in enumerate(batch_sizes)}
    n_bars = rows.groupby("source").size().max()

    n_groups = rows.groupby("source")["group"].nunique().max()
    label_room = 0.065 * rows["group"].str.len().max() if n_groups > 4 else 0.0  # vertical tick labels
    fig, facets = _facets(sources, 1, width=min(14.0, max(8.0, 0.45 * n_bars + 4)), height=3.8 + label_room)
    for (ax,), source in zip(facets, sources):
        drawn = _grouped_bars(
            ax,
            rows[rows["source"].eq(source)],
            "group",
            "batch_size",
            batch_sizes,
            "speedup_vs_teacher",
            lambda bars: {"color": color[bars["batch_size"].iloc[0]]},
        )
        for bars in drawn.values():
            ax.bar_label(bars, fmt="%.1f×", fontsize=7, padding=2, rotation=90)
        ax.axhline(1.0, color="0.3", linestyle="--", linewidth=1)
        ax.margins(y=0.18)
        ax.set_ylabel(axis_label("speed-up vs teacher", "speedup_vs_teacher"))
    handles = [Patch(facecolor=color[b], edgecolor="0.25", label=str(int(b))) for b in batch_sizes]
    fig.legend(
        handles=handles,
        loc="outside right upper",
        fontsize=8,
        title=axis_label("batch size", "batch_size"),
        title_fontsize=8,
    )
    return Chart(
        title=title,
        file=_save(fig, out_dir, "speedup.png"),
        caption=(
            "Teacher latency divided by student latency at the same batch size and precision, per cell (the "
            "centres over repeats of each repeat's own speed-up). Above the dashed line (1×) the student is faster."
        ),
    )


# --- where the step's time goes ------------------------------------------------------

PHASES = tuple((p.column, p.label) for p in STEP_PHASES)  # (column, legend label) in the order of the step
REMAINDER = (REMAINDER_COLUMN, "remainder (between stamps)")
PHASE_COLUMNS = tuple(c for c, _ in PHASES) + (REMAINDER[0],)
_REMAINDER_COLOR = "0.75"
_REMAINDER_HATCH = "xx"


def draw_phases(df: pd.DataFrame, out_dir: Path) -> Chart:
    """``phases.png``: the median step split into its phases, one horizontal bar per distill_step cell."""
    title = "Where the step's time goes"
    df = _with_keys(pooled(df))
    rows = df[df["measurement"].eq(Measurement.DISTILL_STEP)]
    rows = rows[rows[list(PHASE_COLUMNS)].notna().any(axis=1)]
    if rows.empty:
        return _skipped(title, "no successful distill_step measurement has phase timings")
    rows = rows.assign(bar=rows["cell_label"].fillna(rows["pair"])).sort_values("bar", ascending=False)
    sources = sorted(rows["source"].unique())
    # on-policy LM steps begin with the student's generation: drawn first where any cell has it
    generated = GENERATE.column in rows and rows[GENERATE.column].notna().any()
    phases = ((GENERATE.column, GENERATE.label), *PHASES) if generated else PHASES
    color = _colors([c for c, _ in phases])
    n_bars = rows.groupby("source").size().max()
    clipped = int((rows[REMAINDER[0]] < 0).sum())

    fig, facets = _facets(sources, 1, width=11.0, height=1.3 + 0.38 * n_bars)
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
        ax.set_yticks(list(y), list(here["bar"]), fontsize=8)
        ax.set_ylim(-0.6, len(here) - 0.4)
        ax.set_xlabel(axis_label("median time per step", "phase_backward_ms"))
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
    handles, labels = facets[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=8)
    note = (
        f" {clipped} negative remainder{'s were' if clipped != 1 else ' was'} drawn as 0 "
        "(the phase medians add up to more than the step median)."
        if clipped
        else ""
    )
    return Chart(
        title=title,
        file=_save(fig, out_dir, "phases.png"),
        caption=(
            "The median of each phase of the distillation step (teacher forward, student forward, loss, "
            "backward, optimizer; pooled over repeats as the step's time is), "
            "stacked; the grey hatched remainder is the median of step time minus the sum "
            "of its phases (Python overhead between the time stamps). The black tick is the median step time: "
            "medians do not add exactly, so the stack may end short of it or past it." + note
        ),
    )


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
        return _skipped(title, "no successful quality row with an accuracy")
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
        return _skipped(
            title,
            "no student_inference or teacher_inference latency of the models the quality rows "
            "trained (" + ", ".join(missing) + ")",
        )

    students = points[points["quality_role"].ne("teacher")]
    teachers = points[points["quality_role"].eq("teacher")]
    color = _colors(sorted(students["model"].unique()))
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
    return Chart(
        title=title,
        file=_save(fig, out_dir, "quality_front.png"),
        caption=(
            "Top-1 test accuracy after training (mean over seeds, error bars ± one standard deviation) against the "
            "median inference latency of the same model, at the smallest batch size measured for it, from the same "
            "run where there is one (the median of the medians when several cells measured it). Students: colour "
            "by model, marker by method (scratch: trained without a teacher); teachers: black stars. Up and to the "
            "left is better." + note
        ),
    )


# --- comparisons ---------------------------------------------------------------------

FOREST_ROWS = 60  # the most changed measurements a forest plot shows
_RATIO_TICKS = (0.1, 0.2, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
_VERDICT_COLOR = {"regressed": "#b3261e", "improved": "#1b7f3b", "unchanged": "0.45"}


def draw_forest(cmp, out_dir: Path, name: str) -> Chart:
    """A forest plot of a :class:`kdbench.report.compare.Comparison`: per measurement, the ratio NEW/BASE and
    its interval on a log axis, 1 and the threshold band marked; regressions at the top."""
    title = f"{cmp.new.label} against {cmp.base.label}"
    rated = [c for c in cmp.changes if c.ratio is not None]
    if not rated:
        return _skipped(title, "no measurement was ok on both sides")
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
    handles = [Patch(color=v, label=k) for k, v in _VERDICT_COLOR.items()]
    handles.append(Patch(color="0.9", label=f"threshold ±{t:.0%}"))
    ax.legend(handles=handles, fontsize=8, loc="lower right")
    more = f" The {len(rated) - len(shown)} least changed measurements are left out." if len(rated) > len(shown) else ""
    return Chart(
        title=title,
        file=_save(fig, out_dir, name),
        caption=(
            "Each measurement's ratio of the centres (geometric means of the repeats' medians), NEW over BASE, "
            f"with its t-interval between repeats (bounds at {cmp.confidence:.0%} for all {cmp.rated} judged "
            f"measurements together). Red: slower beyond ±{t:.0%} with an interval above 1; green: faster alike; "
            "grey: unchanged; hollow: one repeat a side, its within-process interval shown but not judged. The grey "
            f"band is the threshold.{more}"
        ),
    )


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
    from kdbench.errors import KdbenchError
    from kdbench.report.compare import compare_frames
    from kdbench.report.compare_format import summary

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
        return _skipped(title, "no successful timed measurement")
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
        color = _colors(lines)
        for line in lines:
            pts = here[here["line"].eq(line)].sort_values("x")
            below, above = _spread(pts)
            ax.errorbar(
                pts["x"], pts["median_ms"], yerr=[below, above], marker="o", ms=4, capsize=3, color=color[line],
                label=line, linewidth=1.2,
            )  # fmt: skip
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
    return Chart(
        title=title,
        file=_save(fig, out_dir, name),
        caption=(
            f"The {len(runs)} runs of suite {suite} in time order, labelled by the commit of the suite's own "
            "repository when it lies in one (else by when the run started). Each line is one measurement of one "
            "cell: its centre (the geometric mean of the repeats' medians) with the centre's 95 % interval over "
            "the repeats (one repeat: its interquartile range). Shaded red: the runs where kdbench compare "
            f"against the run before fails the gate ({failing} of {len(runs) - 1} comparisons)."
        ),
    )
