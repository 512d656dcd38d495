"""What every chart of the report is drawn with (matplotlib's object API: no pyplot, no global state).

:class:`Chart` (drawn into a PNG of a fixed name, or not drawn and why), the keys charts group rows by
(:func:`with_keys`: pair, source, noisy and thin flags; :func:`add_variant`: the label of a bar, from the config
columns that vary), colours, faceting by source, grouped bars, error bars and the shared legend entries and caption
sentences.  :mod:`kdbench.report.plots`, :mod:`kdbench.report.lm` and :mod:`kdbench.report.compare.plots` draw
with them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
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
CONTENDED_HATCH = "\\\\\\"  # three backslashes: the other diagonal, a cross where a bar is noisy too
THIN_HATCH = ".."
THIN_NOTE = "thin: shrunk by the time budget, not judged"
CONTENDED_NOTE = "contended: measured on a busy machine, reads slow"
# How a point (a line chart's, not a bar) shows the same flags: a hollow ring around it
RINGS = (
    ("is_noisy", {"marker": "o", "facecolors": "none", "edgecolors": "black"}, f"noisy ({NOISY_NOTE})"),
    ("is_contended", {"marker": "s", "facecolors": "none", "edgecolors": "#b3261e"}, CONTENDED_NOTE),
    ("is_thin", {"marker": "x", "color": "black"}, THIN_NOTE),
)
RING_LABELS = tuple(label for _, _, label in RINGS)
# Sentences the captions share.
POOLED = "repeats pooled as kdbench compare centres them"
HATCHED = (
    f"Bars hatched / are noisy ({NOISY_NOTE}), hatched \\ contended (measured on a busy machine: they read slow; "
    "crossed: both), dotted ones thin"
)
RINGED = (
    f"A hollow black circle around a point marks it noisy ({NOISY_NOTE}), a hollow red square contended (measured on "
    "a busy machine: it reads slow), a cross thin (shrunk by the time budget)"
)


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
    """Add the columns the charts group by: ``pair`` (:func:`model_names`), ``source``, ``is_noisy``,
    ``is_thin`` and ``is_contended``; null precision as ``?``."""
    df = df.copy()
    teacher, student = model_names(df)
    df["pair"] = teacher + " → " + student
    df["source"] = df["device_name"].fillna("unknown device") + " (" + df["backend"].fillna("?") + ")"
    if df["run_id"].nunique() > 1:
        df["source"] += " · run " + df["run_id"].fillna("?")
    df["precision"] = df["precision"].fillna("?")
    return with_flags(df)


def with_flags(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with the flags every chart marks: ``is_noisy``, ``is_thin`` and ``is_contended`` (booleans)."""
    false = pd.Series(False, index=df.index)
    return df.assign(
        is_noisy=df["noisy"].eq(True) if "noisy" in df else false,
        is_thin=df["thin"].eq(True) if "thin" in df else false,
        is_contended=df["contended"].eq(True) if "contended" in df else false,
    )


def _overrides(config_json, role: str) -> dict:
    """The config overrides of a cell's ``role`` model (``overrides.teacher`` / ``.student`` of its config)."""
    try:
        config = json.loads(config_json)
    except (TypeError, ValueError):
        return {}
    found = config.get("overrides", {}).get(role) if isinstance(config, dict) else None
    return found if isinstance(found, dict) else {}


def model_names(df: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """The teacher's and the student's names as charts and tables show them: a model name that comes with more than
    one set of config overrides among ``df``'s rows (``gpt2`` at 1 and at 2 layers) is another model each time, so
    it is named with the overrides that tell it apart (``gpt2 (n_layer=2)``): two such cells never share a bar,
    a line or a table row."""
    out = []
    for role in ("teacher", "student"):
        names = df[role].astype(object).where(df[role].notna(), "?").astype(str)
        if "config_json" not in df or df.empty:
            out.append(names)
            continue
        configs = [j if isinstance(j, str) else None for j in df["config_json"]]
        parsed = {j: _overrides(j, role) for j in set(configs)}  # one parse per cell
        over = [parsed[j] for j in configs]
        named = list(names)
        for name in set(names):
            at = [i for i, n in enumerate(names) if n == name]
            keys = sorted({k for i in at for k in over[i]})
            differ = [k for k in keys if len({json.dumps(over[i].get(k), sort_keys=True) for i in at}) > 1]
            for i in at if differ else ():
                named[i] = f"{name} (" + ", ".join(f"{k}={_value(over[i].get(k))}" for k in differ) + ")"
        out.append(pd.Series(named, index=df.index, dtype=object))
    return out[0], out[1]


def distinct_cell_labels(df: pd.DataFrame) -> pd.Series:
    """Each row's ``cell_label``, told apart where cells of other configs share one: a plan labels its own cells
    apart, but cells of two runs (one per model ``overrides``, say) can each be the plain ``gpt2->gpt2 kd fp32
    bs8`` of its plan; in one report they get the settings in which their configs differ appended
    (``overrides.student.n_layer=2``), as the plan's own labels do, so that no table row or chart line merges
    them."""
    labels = df["cell_label"].astype(object).where(df["cell_label"].notna(), df["cell_id"]).astype(str)
    if "config_json" not in df or df.empty:
        return labels
    cells = df.assign(label_=labels)[["label_", "cell_id", "config_json"]].drop_duplicates("cell_id")
    shared = cells[cells.groupby("label_")["cell_id"].transform("nunique").gt(1)]
    extra: dict[str, str] = {}
    for _, group in shared.groupby("label_"):
        flats = {c: _flat(j) for c, j in zip(group["cell_id"], group["config_json"])}
        keys = sorted({k for f in flats.values() for k in f})
        differ = [k for k in keys if len({f.get(k) for f in flats.values()}) > 1]
        for cell, f in flats.items():
            if differ:
                extra[cell] = " " + " ".join(f"{k}={f.get(k, 'null')}" for k in differ)
    return labels + df["cell_id"].map(lambda cell: extra.get(cell, "")).astype(str)


def _flat(config_json, prefix: str = "") -> dict[str, str]:
    """A cell's config (its JSON, or a mapping of it) as dotted keys and their values' JSON; {} when unreadable."""
    if isinstance(config_json, str):
        try:
            config_json = json.loads(config_json)
        except ValueError:
            return {}
    if not isinstance(config_json, dict):
        return {}
    out: dict[str, str] = {}
    for k, v in config_json.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v, sort_keys=True, separators=(",", ":"))
    return out


def _value(v) -> str:
    return "default" if v is None else json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else str(v)


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
    width = ax.get_figure(root=True).get_figwidth() * ax.get_position().width  # inches, before the layout
    rotate = rotate_labels(groups, width)
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


CHAR_INCHES = 0.085  # about the width of one character of a 10-point tick label


def rotate_labels(groups: list[str], width_in: float) -> bool:
    """Whether x tick labels of ``groups`` (each written on its lines, the pair split at its arrow) would overlap
    side by side on axes ``width_in`` inches wide: then they are written vertically (more than 4 groups always)."""
    if len(groups) > 4:
        return True
    longest = max((len(line) for g in groups for line in g.replace(" → ", "\n→ ").split("\n")), default=0)
    return longest * CHAR_INCHES * len(groups) > 0.9 * width_in


def label_room(groups, rotated: bool) -> float:
    """Inches of figure height that vertical tick labels of ``groups`` take (0 when they are not rotated)."""
    return 0.065 * max((len(g) for g in groups), default=0) if rotated else 0.0


def flag_hatches(bars: pd.DataFrame) -> list[str]:
    """Each bar's hatch: / when noisy, \\ when contended (both: crossed), dots when thin, none otherwise."""
    contended = bars["is_contended"] if "is_contended" in bars else pd.Series(False, index=bars.index)
    return [
        (NOISY_HATCH if n is True else "") + (CONTENDED_HATCH if c is True else "") + (THIN_HATCH if t is True else "")
        for n, c, t in zip(bars["is_noisy"].eq(True), contended.eq(True), bars["is_thin"].eq(True))
    ]


def flag_patches(rows: pd.DataFrame, always_noisy: bool = False) -> list[Patch]:
    """The legend entries of :func:`flag_hatches`: noisy (when a row is, or ``always_noisy``), contended and thin
    (when a row is)."""
    patches = []
    if always_noisy or rows["is_noisy"].eq(True).any():
        patches.append(Patch(facecolor="white", edgecolor="0.25", hatch=NOISY_HATCH, label=f"noisy\n({NOISY_NOTE})"))
    if "is_contended" in rows and rows["is_contended"].eq(True).any():
        label = "contended\n(busy machine: reads slow)"
        patches.append(Patch(facecolor="white", edgecolor="0.25", hatch=CONTENDED_HATCH, label=label))
    if rows["is_thin"].eq(True).any():
        patches.append(Patch(facecolor="white", edgecolor="0.25", hatch=THIN_HATCH, label=THIN_NOTE))
    return patches


def flag_rings(ax, points: pd.DataFrame, x: str, y: str, **scatter) -> None:
    """Ring each flagged point of ``points`` (:data:`RINGS`: noisy, contended, thin), each kind labelled once for the
    legend; the points' own markers are drawn by the caller."""
    for flag, look, label in RINGS:
        flagged = points[points[flag].eq(True)] if flag in points else points.iloc[:0]
        if len(flagged):
            kwargs = {"s": 90, "linewidths": 1.2, "zorder": 3, **look, **scatter}
            ax.scatter(flagged[x], flagged[y], label=label, **kwargs)


def ring_handles(points: pd.DataFrame) -> list[Line2D]:
    """Legend entries of the rings :func:`flag_rings` drew for ``points`` (a figure legend's; an axes legend finds
    them itself)."""
    handles = []
    for flag, look, label in RINGS:
        if flag in points and points[flag].eq(True).any():
            color = look.get("edgecolors", look.get("color"))
            face = "none" if "facecolors" in look else color
            handles.append(Line2D([], [], linestyle="", marker=look["marker"], ms=9, mfc=face, mec=color, label=label))
    return handles


def flag_counts(rows: pd.DataFrame) -> str:
    """What a chart's caption says of its flagged rows (" Of the 8 drawn here: 3 contended, 1 noisy."); empty when
    none is."""
    parts = [
        f"{int(rows[flag].eq(True).sum())} {word}"
        for flag, word in (("is_contended", "contended"), ("is_noisy", "noisy"), ("is_thin", "thin"))
        if flag in rows and rows[flag].eq(True).any()
    ]
    return f" Of the {len(rows)} drawn here: " + ", ".join(parts) + "." if parts else ""


def saved_chart(title: str, fig: Figure, out_dir: Path, name: str, caption: str) -> Chart:
    """The chart ``fig``, written as ``out_dir/name`` (a bare Figure has no pyplot state to close), the image grown
    or cropped to every artist drawn (``bbox_inches="tight"``): no axis title or label is cut at its edge."""
    fig.savefig(out_dir / name, dpi=DPI, bbox_inches="tight", pad_inches=0.08)
    return Chart(title=title, caption=caption, file=name)
