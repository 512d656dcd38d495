"""What every chart of the report is drawn with (matplotlib's object API: no pyplot, no global state).

:class:`Chart` (drawn into a PNG of a fixed name, or not drawn and why), the keys charts group rows by
(:func:`with_keys`: pair, source, noisy and thin flags; :func:`add_variant`: the label of a bar, from the config
columns that vary), colours, faceting by source, grouped bars, error bars and the shared legend entries and caption
sentences.  :mod:`kdbench.report.plots`, :mod:`kdbench.report.lm` and :mod:`kdbench.report.compare.plots` draw
with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from kdbench.core.schema import COLUMNS

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
RATE_COLUMNS = ("tokens_per_s", "throughput")  # a token workload's rate (tokens/s), any other row's (samples/s)
NOISY_HATCH = "///"
THIN_HATCH = ".."
THIN_NOTE = "thin: shrunk by the time budget, not judged"
# Sentences the captions share.
POOLED = "repeats pooled as kdbench compare centres them"
HATCHED = f"Hatched bars are noisy ({NOISY_NOTE}); dotted ones thin"


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


def rate_columns(rows: pd.DataFrame) -> pd.Series:
    """The column each row's throughput is read from: ``tokens_per_s`` for a token workload's row (an LM's or an
    encoder's: it has ``tokens``), else ``throughput`` (samples/s).  The one place that decides a row's rate unit:
    every chart and table that shows a rate reads it through here (:func:`rates`)."""
    tokens = pd.Series(False, index=rows.index)
    for column in ("tokens", "tokens_per_s"):
        if column in rows:
            tokens |= rows[column].notna()
    return pd.Series(RATE_COLUMNS[0], index=rows.index).where(tokens, RATE_COLUMNS[1])


def rates(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` with each row's rate and its column (:func:`rate_columns`) added: ``rate`` and ``rate_column``."""
    which = rate_columns(rows)
    value = pd.Series(float("nan"), index=rows.index)
    for column in RATE_COLUMNS:
        if column in rows:
            value = value.where(which.ne(column), pd.to_numeric(rows[column], errors="coerce"))
    return rows.assign(rate=value.to_numpy(), rate_column=which.to_numpy())


def with_keys(df: pd.DataFrame) -> pd.DataFrame:
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


def add_variant(df: pd.DataFrame, extra: tuple[str, ...] = (), within: tuple[str, ...] = ()) -> pd.DataFrame:
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


def variant_rank(variant: str) -> tuple[int, str]:
    """Sort key of a variant: precisions in a fixed order (fp32, tf32, bf16, fp16, others)."""
    return _PRECISION_ORDER.get(variant.split(",")[0], 99), variant


def variant_order(variants) -> list[str]:
    return sorted(set(variants), key=variant_rank)


def palette(keys: list[str]) -> dict[str, tuple]:
    """A stable tab10/tab20 colour per key."""
    cmap = colormaps["tab10" if len(keys) <= 10 else "tab20"]
    return {k: cmap(i % cmap.N) for i, k in enumerate(keys)}


def centre_spread(rows: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """(below, above) the centre for error bars: the centre's interval over repeats where there is one, else
    the single repeat's p25 to p75 (rows stored before the quartiles: ± IQR/2)."""
    half = (rows["iqr_ms"] / 2).fillna(0)
    below = (rows["median_ms"] - rows["p25_ms"]).fillna(half)
    above = (rows["p75_ms"] - rows["median_ms"]).fillna(half)
    if "centre_low_ms" in rows:
        below = (rows["median_ms"] - rows["centre_low_ms"]).fillna(below)
        above = (rows["centre_high_ms"] - rows["median_ms"]).fillna(above)
    return below.clip(lower=0, upper=rows["median_ms"]), above.clip(lower=0)


def not_drawn(title: str, why: str) -> Chart:
    return Chart(title=title, caption=f"Not drawn: {why}.")


def faceted_figure(sources: list[str], ncols: int, width: float, height: float) -> tuple[Figure, list]:
    """A figure with one titled row of ``ncols`` axes per source."""
    fig = Figure(figsize=(width, height * len(sources)), layout="constrained")
    rows = []
    for sub, source in zip(fig.subfigures(len(sources), 1, squeeze=False)[:, 0], sources):
        sub.suptitle(source, fontsize=10, fontweight="bold", x=0.01, ha="left")
        rows.append(sub.subplots(1, ncols, squeeze=False)[0])
    return fig, rows


def grouped_bars(ax, here: pd.DataFrame, group: str, series: str, order: list, value: str, style) -> dict:
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


def flag_hatches(bars: pd.DataFrame) -> list[str]:
    """Each bar's hatch: dotted when thin, hatched when noisy, none otherwise."""
    return [THIN_HATCH if t else NOISY_HATCH if n else "" for n, t in zip(bars["is_noisy"], bars["is_thin"])]


def flag_patches(rows: pd.DataFrame, always_noisy: bool = False) -> list[Patch]:
    """The legend entries of :func:`flag_hatches`: noisy (when a row is, or ``always_noisy``) and thin (when a row
    is)."""
    patches = []
    if always_noisy or rows["is_noisy"].eq(True).any():
        patches.append(Patch(facecolor="white", edgecolor="0.25", hatch=NOISY_HATCH, label=f"noisy\n({NOISY_NOTE})"))
    if rows["is_thin"].eq(True).any():
        patches.append(Patch(facecolor="white", edgecolor="0.25", hatch=THIN_HATCH, label=THIN_NOTE))
    return patches


def saved_chart(title: str, fig: Figure, out_dir: Path, name: str, caption: str) -> Chart:
    """The chart ``fig``, written as ``out_dir/name`` (a bare Figure has no pyplot state to close)."""
    fig.savefig(out_dir / name, dpi=DPI)
    return Chart(title=title, caption=caption, file=name)
