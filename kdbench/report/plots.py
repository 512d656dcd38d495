"""The report's charts, drawn with matplotlib's object API (no pyplot, no global state).

Every chart is one PNG with a fixed file name in the output folder.  A chart with no
successful measurement to show is not drawn; its :class:`Chart` carries the reason.

Charts are faceted by *source*: one row of panels per (run, device, backend), so
measurements from different machines are never drawn on the same axes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import LogFormatter, NullLocator

from kdbench.store import COLUMNS

DPI = 110
NOISY_NOTE = "IQR/median > 10 %"
_UNITS = {c.name: c.unit for c in COLUMNS}
_PRECISION_ORDER = {"fp32": 0, "tf32": 1, "bf16": 2, "fp16": 3}
# Config columns that, when they vary among plotted rows, become part of a bar's label.
_VARIANT_COLUMNS = ("method", "teacher_precision", "memory_format", "world_size", "alignment", "pad_to", "seed")
# Compact spellings of varying config values in chart labels; others show as `column=value`.
_SHORT = {
    "teacher_precision": "teacher-{}",
    "memory_format": "{}",
    "world_size": "ws{}",
    "alignment": "align{}",
    "pad_to": "pad{}",
    "seed": "seed{}",
    "method": "{}",
}
_NOISY_HATCH = "///"


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
    """Draw every chart of the report into ``out_dir``."""
    df = _with_keys(df)
    ok = df[df["status"].eq("ok") & df["median_ms"].notna()]
    return [
        _distill_step(ok[ok["measurement"].eq("distill_step")], out_dir),
        _inference_latency(ok[ok["measurement"].isin(["student_inference", "teacher_inference"])], out_dir),
        _speedup(ok[ok["measurement"].eq("student_inference") & ok["speedup_vs_teacher"].notna()], out_dir),
    ]


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
    return df


def _add_variant(df: pd.DataFrame, extra: tuple[str, ...] = ()) -> pd.DataFrame:
    """Add ``variant``: the precision, plus ``col=value`` for config columns that vary."""
    df = df.copy()
    varying = [c for c in (*_VARIANT_COLUMNS, *extra) if df[c].nunique(dropna=False) > 1]
    df["variant"] = df["precision"]
    for col in varying:
        template = _SHORT.get(col, col + "={}")
        df["variant"] += ", " + df[col].astype("string").fillna("?").map(template.format)
    return df


def _variant_rank(variant: str) -> tuple[int, str]:
    """Sort key of a variant: precisions in a fixed order (fp32, tf32, bf16, fp16, others)."""
    return _PRECISION_ORDER.get(variant.split(",")[0], 99), variant


def _variant_order(variants) -> list[str]:
    return sorted(set(variants), key=_variant_rank)


def _latest(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """One row per ``keys``: the most recent measurement (reruns supersede older rows)."""
    return df.sort_values("timestamp", na_position="first").drop_duplicates(keys, keep="last")


def _colors(keys: list[str]) -> dict[str, tuple]:
    """A stable tab10/tab20 colour per key."""
    cmap = colormaps["tab10" if len(keys) <= 10 else "tab20"]
    return {k: cmap(i % cmap.N) for i, k in enumerate(keys)}


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
    ax.set_xticks(range(len(groups)), labels, rotation=90 if rotate else 0, ha="right" if rotate else "center",
                  rotation_mode="anchor", va="center" if rotate else "top", fontsize=8 if rotate else None)
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
    rows = _latest(_add_variant(rows, extra=("batch_size",)), ["source", "pair", "variant"]).sort_values("pair")
    sources = sorted(rows["source"].unique())
    variants = _variant_order(rows["variant"])
    color = _colors(variants)
    n_bars = rows.groupby("source").size().max()

    def style(bars):
        return {"color": color[bars["variant"].iloc[0]], "hatch": [_NOISY_HATCH if n else "" for n in bars["is_noisy"]]}

    def with_iqr(bars):  # error bars ± IQR/2, the lower arm clipped so that it stays above 0
        half = (bars["iqr_ms"] / 2).fillna(0)
        return {**style(bars), "yerr": [half.clip(upper=bars["median_ms"]), half], "capsize": 3}

    fig, facets = _facets(sources, 2, width=min(16.0, max(9.0, 0.7 * n_bars + 5)), height=3.6)
    for (ax_t, ax_q), source in zip(facets, sources):
        here = rows[rows["source"].eq(source)]
        _grouped_bars(ax_t, here, "pair", "variant", variants, "median_ms", with_iqr)
        _grouped_bars(ax_q, here.fillna({"throughput": 0}), "pair", "variant", variants, "throughput", style)
        ax_t.set_ylabel(axis_label("median step time", "median_ms"))
        ax_q.set_ylabel(axis_label("throughput", "throughput"))
    handles = [Patch(facecolor=color[v], edgecolor="0.25", label=v) for v in variants]
    handles.append(Patch(facecolor="white", edgecolor="0.25", hatch=_NOISY_HATCH, label=f"noisy\n({NOISY_NOTE})"))
    fig.legend(handles=handles, loc="outside right upper", fontsize=8)
    return Chart(
        title=title,
        file=_save(fig, out_dir, "distill_step.png"),
        caption=(
            "Median time of one distillation step (teacher forward, student forward, backward and update) "
            "per teacher → student pair and precision (left), and the resulting throughput (right). "
            "Error bars span ± IQR/2 around the median: p25/p75 are not stored, so the true, "
            f"possibly asymmetric, interquartile range is approximated. Hatched bars are noisy ({NOISY_NOTE})."
        ),
    )


def _inference_latency(rows: pd.DataFrame, out_dir: Path) -> Chart:
    title = "Inference latency"
    rows = rows[rows["batch_size"].notna()]
    if rows.empty:
        return _skipped(title, "no successful student_inference or teacher_inference measurement with a batch size")
    rows = _add_variant(rows)
    rows["role"] = rows["measurement"].str.removesuffix("_inference")
    rows["model"] = rows["student"].where(rows["role"].eq("student"), rows["teacher"]).fillna("?")
    rows["line"] = rows["role"] + ": " + rows["model"] + " · " + rows["variant"]
    # A teacher measured in several cells (one per student) is one line: the median of its medians.
    points = (
        rows.groupby(["source", "role", "model", "variant", "line", "batch_size"], as_index=False)
        .agg(median_ms=("median_ms", "median"), is_noisy=("is_noisy", "any"))
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
            ax.plot(pts["batch_size"], pts["median_ms"], "-" if role == "student" else "--", marker=marker[variant],
                    ms=4, color=color[model], label=line)
        noisy = here[here["is_noisy"]]
        if len(noisy):
            ax.scatter(noisy["batch_size"], noisy["median_ms"], s=90, facecolors="none", edgecolors="black",
                       linewidths=1, zorder=3, label=f"noisy ({NOISY_NOTE})")
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
            "Median latency of one inference forward pass against batch size (both axes logarithmic); "
            "students solid, teachers dashed. A teacher measured in several cells is drawn once, "
            f"at the median of its medians. Circled points are noisy ({NOISY_NOTE})."
        ),
    )


def _speedup(rows: pd.DataFrame, out_dir: Path) -> Chart:
    title = "Student speed-up over teacher"
    rows = rows[rows["batch_size"].notna()]
    if rows.empty:
        return _skipped(title, "no student_inference measurement with a matching teacher_inference")
    rows = _add_variant(rows)
    rows["group"] = rows["pair"] + "\n(" + rows["variant"] + ")"
    rows = _latest(rows, ["source", "group", "batch_size"])
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
        drawn = _grouped_bars(ax, rows[rows["source"].eq(source)], "group", "batch_size", batch_sizes,
                              "speedup_vs_teacher", lambda bars: {"color": color[bars["batch_size"].iloc[0]]})
        for bars in drawn.values():
            ax.bar_label(bars, fmt="%.1f×", fontsize=7, padding=2, rotation=90)
        ax.axhline(1.0, color="0.3", linestyle="--", linewidth=1)
        ax.margins(y=0.18)
        ax.set_ylabel(axis_label("speed-up vs teacher", "speedup_vs_teacher"))
    handles = [Patch(facecolor=color[b], edgecolor="0.25", label=str(int(b))) for b in batch_sizes]
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, title=axis_label("batch size", "batch_size"),
               title_fontsize=8)
    return Chart(
        title=title,
        file=_save(fig, out_dir, "speedup.png"),
        caption=(
            "Teacher median latency divided by student median latency at the same batch size and precision, "
            "per teacher → student pair. Above the dashed line (1×) the student is faster."
        ),
    )
