"""The report's *Language models* section: the LM cells' (``data_kind == "tokens"``) step and serving figures.

Data (pandas only, never torch):

* :func:`step_points`: one row per LM distill_step cell of a run, its repeats pooled as ``compare`` centres them,
  or its latest row when none was ok (an ``oom`` at a long sequence is a result); with the loss phase's share
  of the step and the computed logits memory's share of the measured peak.
* :func:`loss_shares`, :func:`memory_table`: what the loss-share and memory charts draw.
* :func:`serving_table`: per pair, setting, prompt length and batch size, the student's and the teacher's
  prefill and decode, the student's speed-ups, and each decode's share of the memory-bandwidth floor (its
  ``bandwidth_share``: the bytes a generated token must read at the decode's tokens/s over the probe's copy
  bandwidth; cells that differ only in their loss serve the same models: they are shown once, at the median
  over those cells; cells with another generation backend are their own setting).
* :func:`kdbench.report.ledger.ledger_table`: the accuracy ledger, per loss_impl × precision and objective.
* :func:`speculative_table`: per pair, setting, prompt length, new tokens, draft length γ and temperature T, the
  teacher decoding with the student as its draft (speculative_decode rows): α, tokens per verify (measured and
  predicted), tokens/s, the measured and predicted speed-ups over the teacher alone, and the cost ratio c.

Charts (:func:`draw_lm`, drawn with :mod:`kdbench.report.charts` as the report's other charts are) and the page's part
(:func:`lm_section`, None when the frame has no LM rows, so other reports do not change).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, NullLocator

import kdbench.report.charts as charts
from kdbench.core.names import LM_SERVING, Measurement, Status
from kdbench.core.schema import COLUMN_NAMES
from kdbench.report.charts import Chart
from kdbench.report.format import (
    MISSING,
    format_int,
    format_ms,
    format_percent,
    format_sig,
    format_speedup,
    truncate,
)
from kdbench.report.ledger import ledger_rows, ledger_table
from kdbench.report.summaries import latest, pooled

LM_DATA_KIND = "tokens"
LOSS_IMPLS = ("dense", "chunked", "fused_linear", "liger", "torch_linear")  # report order (and colours)
GIB = 2**30
STEP_KEY = ["source", "pair", "setting", "impl", "seq_len"]
SERVING_KEY = ["source", "pair", "setting", "seq_len", "decode_tokens", "batch_size"]
SERVING_STATS = ("median_ms", "tokens_per_s", "speedup", "bandwidth_share")
# The LM charts' axes and series: never part of a cell's setting (chunk_size goes with its loss_impl).
_NOT_SETTING = ("loss_impl", "seq_len", "chunk_size", "decode_tokens")
_STATUS_TEXT = {Status.OOM: "OOM"}


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
        drawn.append(_speculative_chart(speculative, out_dir))
    floor = floor_points(df)
    if not floor.empty:  # decode rows against a probe's bandwidth: their share of the floor
        drawn.append(_floor_chart(floor, out_dir))
    return LmSection(
        charts=drawn,
        steps=step_rows(points),
        serving=serving_rows(serving_table(df)),
        speculative=speculative_rows(speculative),
        ledger=ledger_rows(ledger_table(df)),
    )


# --- data ----------------------------------------------------------------------------


def _is_lm(df: pd.DataFrame) -> pd.Series:
    """Causal-LM cells: token data and a loss implementation (an encoder pair's token rows have none)."""
    return df["data_kind"].eq(LM_DATA_KIND) & df["loss_impl"].notna()


def lm_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of causal-LM cells, every schema column present."""
    df = df.reindex(columns=list(dict.fromkeys([*COLUMN_NAMES, *df.columns])))
    return df[_is_lm(df)]


def has_lm(df: pd.DataFrame) -> bool:
    return "data_kind" in df and "loss_impl" in df and bool(_is_lm(df).any())


def status_text(status) -> str:
    """How a table cell or a bar shows a measurement that did not run: ``OOM``, ``failed``, ``skipped``..."""
    return _STATUS_TEXT.get(status, str(status))


def impl_order(impls) -> list[str]:
    """Loss implementations in :data:`LOSS_IMPLS` order (others after them, alphabetically)."""

    def rank(label: str) -> tuple[int, str]:
        base = label.split(" ")[0]
        return (LOSS_IMPLS.index(base) if base in LOSS_IMPLS else len(LOSS_IMPLS)), label

    return sorted(set(impls), key=rank)


def step_points(df: pd.DataFrame) -> pd.DataFrame:
    """One row per LM distill_step cell of a run, ordered by source, pair, setting, sequence length and impl.

    Ok cells: their repeats pooled (:func:`kdbench.report.summaries.pooled`); cells with no ok repeat: their
    latest row (status oom, failed, skipped... and its error).  Added, besides the chart keys of
    :mod:`kdbench.report.charts` (``pair``, ``source``): ``impl`` (the loss_impl, with its chunk size where one
    loss_impl ran with several), ``setting`` (the precision and the other config columns that vary, as the
    step chart labels cells), ``loss_share`` (phase_loss_ms / median_ms), ``peak_bytes`` and ``footprint_bytes``
    (the measured peak and footprint of an ok cell), ``logits_share`` (logits_memory_bytes / the peak, which holds
    every buffer alive at once) and ``memory_note`` (why the logits exceed the footprint, where they do:
    :func:`memory_note`)."""
    rows = lm_rows(df)
    rows = rows[rows["measurement"].eq(Measurement.DISTILL_STEP)]
    ok = pooled(rows)
    done = set(zip(ok["run_id"], ok["cell_id"]))
    rest = latest(rows[[key not in done for key in zip(rows["run_id"], rows["cell_id"])]], ["run_id", "cell_id"])
    parts = [p.dropna(axis=1, how="all") for p in (ok, rest) if len(p)]
    if not parts:
        return pd.DataFrame(columns=[*rows.columns, *STEP_KEY, "loss_share", "logits_share"])
    points = pd.concat(parts, ignore_index=True).reindex(columns=list(dict.fromkeys([*rows.columns, *ok.columns])))
    points = charts.with_keys(points)
    points["seq_len"] = pd.to_numeric(points["seq_len"]).fillna(0).astype(int)
    points["impl"] = _impl_labels(points)
    points["setting"] = _settings(points)
    ok_rows = points["status"].eq(Status.OK)
    points["loss_share"] = _ratio(points["phase_loss_ms"], points["median_ms"]).where(ok_rows)
    # The logits are compared with the measured peak, which holds every buffer alive at once (on the CPU the
    # process's whole resident memory); the footprint (the peak minus what was in use as the step began) is shown
    # beside it, and can be below the logits: memory_note says why.
    peak = pd.to_numeric(points["peak_memory_bytes"], errors="coerce").where(ok_rows)
    footprint = pd.to_numeric(points["memory_footprint_bytes"], errors="coerce").where(ok_rows)
    points["peak_bytes"], points["footprint_bytes"] = peak, footprint
    points["logits_share"] = _ratio(points["logits_memory_bytes"], peak).where(ok_rows)
    live = pd.to_numeric(points["live_peak_bytes"], errors="coerce")
    memory = zip(points["logits_memory_bytes"], peak, footprint, points["memory_kind"], live)
    points["memory_note"] = [memory_note(*figures) for figures in memory]
    rank = points["impl"].map({impl: i for i, impl in enumerate(impl_order(points["impl"]))})
    order = ["source", "pair", "setting", "seq_len", "rank_"]
    return points.assign(rank_=rank).sort_values(order).drop(columns="rank_").reset_index(drop=True)


_OVERCOUNT = "the estimate from the shapes counts more buffers than were alive at once"


def memory_note(logits, peak, footprint, kind, live=None) -> str:
    """Why a step's computed logits memory exceeds its measured footprint (or its peak); "" where it does not.
    ``live``: the step's live tensor peak (``live_peak_bytes``), which tells the two causes apart on the CPU."""
    if pd.isna(logits):
        return ""
    if pd.notna(peak) and logits > peak:
        return f"the computed logits exceed the measured peak: {_OVERCOUNT}"
    if pd.isna(footprint) or logits <= footprint:
        return ""
    if kind == "device":
        return (
            "the computed logits exceed the footprint (the allocator's peak minus what was allocated as the step "
            f"began): buffers allocated before the step (a cached teacher's outputs) are not in it, or {_OVERCOUNT}"
        )
    if pd.notna(live) and logits > live:  # the live tensors' peak counts those alive before the step too
        return f"the computed logits exceed the footprint and the live tensors' peak: {_OVERCOUNT}"
    held = ""
    if pd.notna(live):
        held = f" (its live tensors peaked at {float(live) / GIB:.3g} GiB, the logits within them)"
    return (
        "logits above the footprint: on the CPU the footprint is the rise of the process's resident memory, and the "
        "step reused memory the process already held as it began (freed by earlier work, kept by the allocator), "
        f"which that rise does not count{held}; the peak holds it all"
    )


def _ratio(num: pd.Series, den: pd.Series) -> pd.Series:
    num, den = pd.to_numeric(num, errors="coerce"), pd.to_numeric(den, errors="coerce")
    return (num / den.where(den > 0)).astype(float)


def _impl_labels(points: pd.DataFrame) -> pd.Series:
    """The loss_impl, with `` (chunk N)`` where that loss_impl ran with several chunk sizes."""
    impl = points["loss_impl"].astype("string").fillna("?")
    chunk = pd.to_numeric(points["chunk_size"], errors="coerce")
    several = chunk.groupby(impl).transform("nunique").gt(1)
    text = " (chunk " + chunk.astype("Int64").astype("string").fillna("?") + ")"
    return impl.where(~several, impl + text).astype(str)


def _settings(points: pd.DataFrame) -> pd.Series:
    """Each cell's setting: the step chart's variant (precision, batch size and other varying config columns) left
    of the LM axes, its cell id's start added where two cells of one chart position would still share it."""
    hidden = points.drop(columns=[c for c in _NOT_SETTING if c in points]).assign(seq_=points["seq_len"])
    within = ("source", "pair", "impl", "seq_")
    return charts.add_variant(hidden, extra=("batch_size",), within=within)["variant"].astype(str)


def loss_shares(points: pd.DataFrame) -> pd.DataFrame:
    """The ok cells with a loss phase timing: :data:`STEP_KEY`, the loss phase, the step and the share."""
    rows = points[points["loss_share"].notna()]
    return rows[[*STEP_KEY, "phase_loss_ms", "median_ms", "loss_share"]].reset_index(drop=True)


def memory_table(points: pd.DataFrame) -> pd.DataFrame:
    """Per cell against its sequence length: the status, the measured peak and footprint and the computed logits
    memory (GiB), the logits' share of the peak and the :func:`memory_note`; cells with neither a peak, a logits
    size nor an out-of-memory status are left out."""
    peak, footprint = points["peak_bytes"], points["footprint_bytes"]
    logits = pd.to_numeric(points["logits_memory_bytes"], errors="coerce")
    table = points.assign(peak_gib=peak / GIB, footprint_gib=footprint / GIB, logits_gib=logits / GIB)
    keep = peak.notna() | logits.notna() | points["status"].eq(Status.OOM)
    columns = [*STEP_KEY, "status", "peak_gib", "footprint_gib", "logits_gib", "logits_share", "memory_note"]
    return table.loc[keep, columns].reset_index(drop=True)


def serving_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per :data:`SERVING_KEY`: for each serving measurement ``m`` (student/teacher prefill and decode)
    ``m_status`` (ok when one cell's was), ``m_median_ms``, ``m_tokens_per_s`` and, for the student's,
    ``m_speedup`` (the derived speed-up over the same cell's teacher) and, for decode, ``m_bandwidth_share``, each
    the median over the cells with that key (``cells``: how many) of their centres over repeats.  The setting is
    the precision, with the teacher's where it differs, and the generation backend where it is not the default
    (the serving measurements depend on nothing else of a cell but its models and shapes)."""
    rows = lm_rows(df)
    rows = rows[rows["measurement"].isin(list(LM_SERVING))]
    columns = [*SERVING_KEY, "cells", *(f"{m}_{s}" for m in LM_SERVING for s in ("status", *SERVING_STATS))]
    if rows.empty:
        return pd.DataFrame(columns=columns)
    rows = _serving_keys(charts.with_keys(rows))
    ok = pooled(rows).rename(columns={"speedup_vs_teacher": "speedup"})
    by = [*SERVING_KEY, "measurement"]
    stats = ok.groupby(by)[list(SERVING_STATS)].median().unstack("measurement")
    stats.columns = [f"{m}_{s}" for s, m in stats.columns]
    ordered = rows.sort_values("timestamp", na_position="first")
    status = ordered.groupby(by)["status"].agg(lambda s: Status.OK if s.eq(Status.OK).any() else s.iloc[-1])
    status = status.unstack("measurement").add_suffix("_status")
    cells = rows.groupby(SERVING_KEY)["cell_id"].nunique().rename("cells")
    table = pd.concat([cells, status, stats], axis=1).reset_index()
    table = table.reindex(columns=columns)
    table = table.assign(cells=table["cells"].astype(int))
    return table.sort_values(SERVING_KEY).reset_index(drop=True)


def _serving_keys(rows: pd.DataFrame) -> pd.DataFrame:
    """Add the serving key's columns: ``setting`` and the cell's ``decode_tokens`` on its prefill rows too."""
    teacher = rows["teacher_precision"].astype("string").fillna(rows["precision"])
    setting = rows["precision"].where(teacher.eq(rows["precision"]), rows["precision"] + ", teacher " + teacher)
    if "generation" in rows:  # another generation backend than the default: a setting of its own
        backend = rows["generation"].astype("string").fillna("dynamic")
        setting = setting.where(backend.eq("dynamic"), setting + ", " + backend)
    decode = pd.to_numeric(rows["decode_tokens"], errors="coerce").groupby([rows["run_id"], rows["cell_id"]])
    rows = rows.assign(setting=setting.astype(str), decode_tokens=decode.transform("max"))
    for column in ("seq_len", "decode_tokens", "batch_size"):  # 0: unknown (groupby drops null keys)
        rows[column] = pd.to_numeric(rows[column], errors="coerce").fillna(0).astype(int)
    return rows


SPECULATIVE_KEY = ["source", "pair", "setting", "seq_len", "decode_tokens", "draft_tokens", "spec_temperature"]
SPECULATIVE_STATS = (
    "spec_alpha",
    "spec_tokens_per_verify",
    "spec_predicted_tokens_per_verify",
    "tokens_per_s",
    "spec_speedup",
    "spec_predicted_speedup",
    "spec_cost_ratio",
)


def speculative_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per :data:`SPECULATIVE_KEY`: the speculative_decode rows' ``status`` (ok when one cell's was) and
    :data:`SPECULATIVE_STATS` (α, tokens per verify measured and predicted, tokens/s, the speed-ups measured and
    predicted, the cost ratio), each the median over the cells with that key (``cells``: how many) of their centres
    over repeats (the derived columns of :mod:`kdbench.store.derived`)."""
    rows = lm_rows(df)
    rows = rows[rows["measurement"].eq(Measurement.SPECULATIVE_DECODE)]
    columns = [*SPECULATIVE_KEY, "cells", "status", "error", *SPECULATIVE_STATS]
    if rows.empty:
        return pd.DataFrame(columns=columns)
    rows = _serving_keys(charts.with_keys(rows))
    rows["draft_tokens"] = pd.to_numeric(rows["draft_tokens"], errors="coerce").fillna(0).astype(int)
    rows["spec_temperature"] = pd.to_numeric(rows["spec_temperature"], errors="coerce").fillna(0.0)
    ok = pooled(rows)
    stats = ok.groupby(SPECULATIVE_KEY)[list(SPECULATIVE_STATS)].median() if len(ok) else None
    ordered = rows.sort_values("timestamp", na_position="first")
    status = ordered.groupby(SPECULATIVE_KEY)["status"].agg(_any_ok)
    error = ordered.groupby(SPECULATIVE_KEY)["error"].last()
    cells = rows.groupby(SPECULATIVE_KEY)["cell_id"].nunique().rename("cells")
    parts = [cells, status.rename("status"), error.rename("error")] + ([stats] if stats is not None else [])
    table = pd.concat(parts, axis=1).reset_index().reindex(columns=columns)
    table = table.assign(cells=table["cells"].astype(int))
    return table.sort_values(SPECULATIVE_KEY).reset_index(drop=True)


FLOOR_KEY = ["source", "pair", "setting", "seq_len", "decode_tokens", "batch_size", "what"]


def floor_points(df: pd.DataFrame) -> pd.DataFrame:
    """One point per :data:`FLOOR_KEY` (``what``: student decode, teacher decode, or speculative γ T): the median
    over the cells with that key of their centres over repeats of ``bandwidth_share`` (the share of the probe's
    copy bandwidth the row's floor bytes reach, :mod:`kdbench.store.derived`) and ``decode_bytes_per_token``;
    empty when no decode row has a share (no probe of the device)."""
    rows = lm_rows(df)
    decodes = (Measurement.STUDENT_DECODE, Measurement.TEACHER_DECODE, Measurement.SPECULATIVE_DECODE)
    rows = rows[rows["measurement"].isin(decodes) & rows["status"].eq(Status.OK)]
    rows = rows[pd.to_numeric(rows["bandwidth_share"], errors="coerce").notna()]
    columns = [*FLOOR_KEY, "bandwidth_share", "decode_bytes_per_token"]
    if rows.empty:
        return pd.DataFrame(columns=columns)
    rows = _serving_keys(charts.with_keys(rows))
    spec = rows["measurement"].eq(Measurement.SPECULATIVE_DECODE)
    gamma = pd.to_numeric(rows["draft_tokens"], errors="coerce")
    temperature = pd.to_numeric(rows["spec_temperature"], errors="coerce")
    label = rows["measurement"].astype(str).str.replace("_decode", " decode", regex=False)
    variant = "speculative γ" + gamma.fillna(0).astype(int).astype(str)
    variant += temperature.map(lambda t: " greedy" if t == 0 else f" T {t:g}")
    rows = rows.assign(what=label.where(~spec, variant))
    ok = pooled(rows)
    stats = ok.groupby(FLOOR_KEY)[["bandwidth_share", "decode_bytes_per_token"]].median()
    return stats.reset_index().reindex(columns=columns).sort_values(FLOOR_KEY).reset_index(drop=True)


def _any_ok(statuses: pd.Series):
    """ok when one cell's was, else the latest status."""
    return Status.OK if statuses.eq(Status.OK).any() else statuses.iloc[-1]


def speculative_rows(table: pd.DataFrame) -> list[dict]:
    """The speculative table, formatted: a row that did not run shows its status and error instead."""

    def fixed(x, digits: int = 3) -> str:
        return MISSING if pd.isna(x) else f"{float(x):.{digits}f}"

    out = []
    for r in table.to_dict("records"):
        ok = r["status"] == Status.OK
        row = {key: r[key] for key in ("source", "pair", "setting", "cells")}
        row.update(
            ok=ok,
            status=status_text(r["status"]),
            error="" if ok or pd.isna(r["error"]) else truncate(str(r["error"])),
            seq_len=format_int(r["seq_len"] or None),
            decode_tokens=format_int(r["decode_tokens"] or None),
            draft_tokens=str(int(r["draft_tokens"])),
            temperature="greedy" if float(r["spec_temperature"]) == 0 else f"{float(r['spec_temperature']):g}",
            alpha=fixed(r["spec_alpha"]) if ok else MISSING,
            tokens_per_verify=fixed(r["spec_tokens_per_verify"], 2) if ok else MISSING,
            predicted_tokens_per_verify=fixed(r["spec_predicted_tokens_per_verify"], 2) if ok else MISSING,
            tokens_per_s=format_int(r["tokens_per_s"]) if ok else MISSING,
            speedup=format_speedup(r["spec_speedup"]) if ok else MISSING,
            predicted_speedup=format_speedup(r["spec_predicted_speedup"]) if ok else MISSING,
            cost_ratio=fixed(r["spec_cost_ratio"]) if ok else MISSING,
        )
        out.append(row)
    return out


# --- table rows ----------------------------------------------------------------------


def step_rows(points: pd.DataFrame) -> list[dict]:
    """The LM step table: per cell its status, tokens/s, step time, loss share and memory, formatted."""

    def gib(n_bytes) -> str:
        return format_sig(None if pd.isna(n_bytes) else float(n_bytes) / GIB, "GiB")

    out = []
    for r in points.to_dict("records"):
        ok = r["status"] == Status.OK
        error = "" if ok or pd.isna(r["error"]) else str(r["error"])
        out.append(
            {
                "source": r["source"],
                "pair": r["pair"],
                "setting": r["setting"],
                "impl": r["impl"],
                "seq_len": format_int(r["seq_len"] or None),
                "batch_size": format_int(r["batch_size"]),
                "ok": ok,
                "status": status_text(r["status"]),
                "tokens_per_s": format_int(r["tokens_per_s"]) if ok else MISSING,
                "median": format_ms(r["median_ms"]) if ok else MISSING,
                "loss_share": format_percent(r["loss_share"]),
                "peak": gib(r["peak_bytes"]) if ok else MISSING,
                "footprint": gib(r["footprint_bytes"]) if ok else MISSING,
                "memory_note": r["memory_note"],
                "logits": gib(r["logits_memory_bytes"]),
                "buffers": "" if pd.isna(r["logits_buffers"]) else str(r["logits_buffers"]),
                "logits_share": format_percent(r["logits_share"]),
                "error": truncate(error),
            }
        )
    return out


def serving_rows(table: pd.DataFrame) -> list[dict]:
    """The serving table, formatted: a measurement that did not run shows its status (``OOM``...) instead."""

    def figure(r: dict, measurement: str, stat: str, fmt) -> str:
        status = r[f"{measurement}_status"]
        if pd.isna(status):
            return MISSING  # not measured
        return fmt(r[f"{measurement}_{stat}"]) if status == Status.OK else status_text(status)

    out = []
    for r in table.to_dict("records"):
        row = {key: r[key] for key in ("source", "pair", "setting", "cells")}
        row.update(
            seq_len=format_int(r["seq_len"] or None),
            decode_tokens=format_int(r["decode_tokens"] or None),
            batch_size=format_int(r["batch_size"] or None),
        )
        for kind in ("prefill", "decode"):
            student, teacher = f"student_{kind}", f"teacher_{kind}"
            stat, fmt = ("median_ms", format_ms) if kind == "prefill" else ("tokens_per_s", format_int)
            row[f"student_{kind}"] = figure(r, student, stat, fmt)
            row[f"teacher_{kind}"] = figure(r, teacher, stat, fmt)
            row[f"{kind}_speedup"] = figure(r, student, "speedup", format_speedup)
            if kind == "decode":  # the share of the bandwidth floor each decode reaches (none without a probe)
                row["student_decode_floor"] = figure(r, student, "bandwidth_share", format_percent)
                row["teacher_decode_floor"] = figure(r, teacher, "bandwidth_share", format_percent)
            row[f"{kind}_bad"] = any(
                pd.notna(r[f"{m}_status"]) and r[f"{m}_status"] != Status.OK for m in (student, teacher)
            )
        out.append(row)
    return out


# --- charts --------------------------------------------------------------------------


def draw_lm(points: pd.DataFrame, out_dir: Path) -> list[Chart]:
    """The LM section's charts, from :func:`step_points`: tokens/s, memory against sequence length, loss share."""
    return [_tokens_chart(points, out_dir), _memory_chart(points, out_dir), _loss_share_chart(points, out_dir)]


def _impl_colors(impls: list[str]) -> dict[str, tuple]:
    """One colour per loss implementation, the same in every chart and report (by :data:`LOSS_IMPLS`)."""
    known = charts.palette([*LOSS_IMPLS, *(i for i in impl_order(impls) if i not in LOSS_IMPLS)])
    return {i: known.get(i, known.get(i.split(" ")[0])) for i in impls}


def _compact(value: float) -> str:
    return f"{value / 1e3:.3g}k" if value >= 1e3 else f"{value:.3g}"


def _status_bars(ax, here: pd.DataFrame, group: str, impls: list[str], value: str, color: dict, fmt) -> None:
    """Grouped bars of ``value``, one per loss impl in each ``group``, labelled ``fmt(value)``; a cell that did not
    run is a zero bar labelled with its status (``OOM``...). Noisy bars hatched, thin ones dotted."""
    ok = here["status"].eq(Status.OK)
    here = here.assign(bar_=here[value].where(ok).fillna(0.0))

    def style(bars):
        return {"color": color[bars["impl"].iloc[0]], "hatch": charts.flag_hatches(bars)}

    drawn = charts.grouped_bars(ax, here, group, "impl", impls, "bar_", style)
    for impl, bars in drawn.items():
        rows = here[here["impl"].eq(impl)]
        labels = [fmt(v) if s == Status.OK else status_text(s) for v, s in zip(rows[value], rows["status"])]
        texts = ax.bar_label(bars, labels=labels, fontsize=7, padding=2, rotation=90)
        for text, status in zip(texts, rows["status"]):
            if status != Status.OK:
                text.set(color="#b3261e", fontweight="bold")
    ax.margins(y=0.22)
    if not here["bar_"].gt(0).any():  # nothing ran here: no value axis to show
        ax.set_ylim(0, 1)
        ax.set_yticks([])


def _legend(fig, impls: list[str], color: dict, rows: pd.DataFrame, extra=()) -> None:
    handles = [Patch(facecolor=color[i], edgecolor="0.25", label=i) for i in impls]
    handles += charts.flag_patches(rows)
    fig.legend(handles=[*handles, *extra], loc="outside right upper", fontsize=8, title="loss_impl", title_fontsize=8)


def _tokens_chart(points: pd.DataFrame, out_dir: Path) -> Chart:
    title = "LM distillation step: tokens per second"
    if not points["status"].eq(Status.OK).any():
        return charts.not_drawn(title, "no successful LM distill_step measurement")
    rows = charts.rates(points.assign(group=points["pair"] + "\n(" + points["setting"] + ")"))  # tokens/s
    sources = sorted(rows["source"].unique())
    seq_lens = sorted(rows["seq_len"].unique())
    impls = impl_order(rows["impl"])
    color = _impl_colors(impls)
    n_groups = rows.groupby(["source", "seq_len"])["group"].nunique().max()
    width = min(18.0, max(8.0, 2.0 + len(seq_lens) * (1.0 + 0.3 * n_groups * len(impls))))
    fig, facets = charts.faceted_figure(sources, len(seq_lens), width=width, height=4.0)
    for axes, source in zip(facets, sources):
        for ax, seq_len in zip(axes, seq_lens):
            ax.set_title(f"sequence length {seq_len}", fontsize=9)
            here = rows[rows["source"].eq(source) & rows["seq_len"].eq(seq_len)]
            if here.empty:
                ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes, color="0.4")
                ax.set_xticks([])
                continue
            _status_bars(ax, here, "group", impls, "rate", color, _compact)
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}"))
        axes[0].set_ylabel(charts.axis_label("step throughput", charts.RATE_COLUMNS[0]))
    _legend(fig, impls, color, rows)
    caption = (
        "Tokens processed per second by the distillation step of each teacher → student pair, one bar per "
        f"loss implementation, one panel per sequence length (each cell's {charts.POOLED}). A cell that did not run is "
        f"an empty bar labelled with its status (OOM: the device ran out of memory). {charts.HATCHED}."
    )
    return charts.saved_chart(title, fig, out_dir, "lm_tokens_per_s.png", caption)


def _memory_chart(points: pd.DataFrame, out_dir: Path) -> Chart:
    title = "LM distillation step: memory against sequence length"
    table = memory_table(points)
    if table.empty:
        return charts.not_drawn(title, "no LM distill_step row has a measured peak, a computed logits size or an OOM")
    table["panel"] = table["pair"] + " · " + table["setting"]
    sources = sorted(table["source"].unique())
    panels = {s: sorted(table.loc[table["source"].eq(s), "panel"].unique()) for s in sources}
    ncols = max(len(p) for p in panels.values())
    impls = impl_order(table["impl"])
    color = _impl_colors(impls)
    fig, facets = charts.faceted_figure(sources, ncols, width=min(18.0, 3.0 + 4.5 * ncols), height=3.8)
    for axes, source in zip(facets, sources):
        for ax, panel in itertools.zip_longest(axes, panels[source]):
            if panel is None:
                ax.set_visible(False)
                continue
            _memory_panel(ax, table[table["source"].eq(source) & table["panel"].eq(panel)], impls, color)
            ax.set_title(panel, fontsize=9)
        axes[0].set_ylabel("memory (GiB)")
    looks = [
        Line2D([], [], color="0.2", marker="o", ms=4, label="measured peak"),
        Line2D([], [], color="0.2", linestyle=":", marker="s", ms=3, label="measured footprint"),
        Line2D([], [], color="0.2", linestyle="--", label="computed logits buffers"),
        Line2D([], [], color="0.2", marker="X", linestyle="", ms=8, label="out of memory"),
    ]
    handles = [Line2D([], [], color=color[i], linewidth=3, label=i) for i in impls]
    fig.legend(handles=[*handles, *looks], loc="outside right upper", fontsize=8, title="loss_impl", title_fontsize=8)
    below = int(table["memory_note"].astype(bool).sum())
    note = (
        f" In {below} cell{'s' if below != 1 else ''} the logits exceed the footprint (the table below says why)."
        if below
        else ""
    )
    caption = (
        "Memory of the distillation step against the sequence length, measured (on GPUs the allocator's "
        "counters, on the CPU the worker's resident memory): solid, its peak, which holds every buffer alive at "
        "once (on the CPU the whole process: interpreter, libraries, models); dotted, its footprint, the peak minus "
        "what was in use as the step began (models, batch, optimizer state). Beside them in the same colour "
        "(dashed) the memory of the B×S×V-sized buffers the loss implementation holds at its peak, computed from "
        "the shapes: part of the peak, the gap to it is what activations, gradients and the rest take. The "
        "footprint can be below the logits: on the CPU the step reuses memory the process already held as it "
        "began (freed by earlier work, kept by the allocator), which the rise of its resident memory does not "
        "count. A cross at the top marks the sequence length at which a loss implementation ran out of memory." + note
    )
    return charts.saved_chart(title, fig, out_dir, "lm_memory.png", caption)


def _memory_panel(ax, here: pd.DataFrame, impls: list[str], color: dict) -> None:
    """One pair and setting: per loss impl its peak (solid), its logits (dashed) and its OOMs (crosses on top)."""
    ooms = 0
    for impl in impls:
        pts = here[here["impl"].eq(impl)].sort_values("seq_len")
        peak, logits = pts[pts["peak_gib"].notna()], pts[pts["logits_gib"].notna()]
        footprint = pts[pts["footprint_gib"].notna()]
        ax.plot(peak["seq_len"], peak["peak_gib"], "-o", ms=4, color=color[impl])
        ax.plot(footprint["seq_len"], footprint["footprint_gib"], ":", marker="s", ms=3, color=color[impl])
        ax.plot(logits["seq_len"], logits["logits_gib"], "--", marker=".", ms=5, color=color[impl])
        for seq_len in pts.loc[pts["status"].eq(Status.OOM), "seq_len"]:
            y = 0.93 - 0.1 * ooms
            ax.scatter([seq_len], [y], transform=ax.get_xaxis_transform(), marker="X", s=80, color=color[impl],
                       edgecolors="black", linewidths=0.6, zorder=4, clip_on=False)  # fmt: skip
            ax.annotate("OOM", (seq_len, y), xycoords=("data", "axes fraction"), xytext=(6, -3),
                        textcoords="offset points", fontsize=7, color="#b3261e", fontweight="bold")  # fmt: skip
            ooms += 1
    seq_lens = sorted(here["seq_len"].unique())
    if len(seq_lens) > 1:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(seq_lens, [str(s) for s in seq_lens])
    if len(seq_lens) > 1:
        ax.set_xlim(seq_lens[0] / 1.3, seq_lens[-1] * 1.3)
    top = pd.concat([here["peak_gib"], here["footprint_gib"], here["logits_gib"]]).max()
    ax.set_ylim(0, 1.0 if pd.isna(top) or top <= 0 else top * (1.25 + 0.1 * ooms))
    ax.set_xlabel(charts.axis_label("sequence length", "seq_len"))
    ax.grid(alpha=0.3)


def _loss_share_chart(points: pd.DataFrame, out_dir: Path) -> Chart:
    title = "LM distillation step: share of the step in the loss"
    if not points["loss_share"].notna().any():
        return charts.not_drawn(title, "no successful LM distill_step measurement has a loss phase timing")
    rows = points[points["loss_share"].notna() | points["status"].ne(Status.OK)]
    rows = rows.assign(
        group=rows["pair"] + "\n(seq " + rows["seq_len"].astype(str) + ", " + rows["setting"] + ")",
        share_pct=rows["loss_share"] * 100,
    )
    sources = sorted(rows["source"].unique())
    impls = impl_order(rows["impl"])
    color = _impl_colors(impls)
    n_groups = rows.groupby("source")["group"].nunique().max()
    label_room = 0.065 * rows["group"].str.len().max() if n_groups > 4 else 0.0  # vertical tick labels
    width = min(16.0, max(8.0, 3.0 + 0.3 * n_groups * len(impls)))
    fig, facets = charts.faceted_figure(sources, 1, width=width, height=3.8 + label_room)
    for (ax,), source in zip(facets, sources):
        _status_bars(ax, rows[rows["source"].eq(source)], "group", impls, "share_pct", color, lambda v: f"{v:.0f} %")
        ax.set_ylabel("loss phase (% of the step time)")
    _legend(fig, impls, color, rows)
    caption = (
        "The loss phase's median (for LM cells both LM heads and the token loss) as a share of the median "
        "step time, per pair, sequence length and loss implementation: what a cheaper loss implementation "
        "can save at most. A cell that did not run is an empty bar labelled with its status."
    )
    return charts.saved_chart(title, fig, out_dir, "lm_loss_share.png", caption)


def _speculative_chart(table: pd.DataFrame, out_dir: Path) -> Chart:
    """Per source, one panel per pair and setting: the measured speed-up of speculative decoding over the teacher
    alone against the draft length γ (solid, one line per temperature) and the speed-up predicted from α, γ and
    the cost ratio (dashed, same colour)."""
    title = "Speculative decoding: measured and predicted speed-up over the teacher alone"
    rows = table[table["status"].eq(Status.OK)].assign(panel=lambda t: t["pair"] + " · " + t["setting"])
    sources = sorted(rows["source"].unique())
    panels = {src: sorted(rows.loc[rows["source"].eq(src), "panel"].unique()) for src in sources}
    ncols = max(len(p) for p in panels.values())
    temperatures = sorted(rows["spec_temperature"].unique())
    color = charts.palette([f"{t:g}" for t in temperatures])
    fig, facets = charts.faceted_figure(sources, ncols, width=min(16.0, 3.0 + 4.0 * ncols), height=3.4)
    for axes, source in zip(facets, sources):
        for ax, panel in itertools.zip_longest(axes, panels[source]):
            if panel is None:
                ax.set_visible(False)
                continue
            here = rows[rows["source"].eq(source) & rows["panel"].eq(panel)]
            for t in temperatures:
                line = here[here["spec_temperature"].eq(t)].sort_values("draft_tokens")
                c = color[f"{t:g}"]
                ax.plot(line["draft_tokens"], line["spec_speedup"], "-o", ms=4, color=c)
                ax.plot(line["draft_tokens"], line["spec_predicted_speedup"], "--", marker=".", color=c)
            ax.axhline(1.0, color="0.5", linewidth=0.8, linestyle=":")
            gammas = sorted(here["draft_tokens"].unique())
            ax.set_xticks(gammas, [str(g) for g in gammas])
            ax.set_xlabel("draft tokens per round (γ)")
            ax.set_title(panel, fontsize=9)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("speed-up over the teacher alone (×)")
    handles = [
        Line2D([], [], color=color[f"{t:g}"], linewidth=3, label="greedy" if t == 0 else f"T {t:g}")
        for t in temperatures
    ]
    handles += [
        Line2D([], [], color="0.2", marker="o", ms=4, label="measured"),
        Line2D([], [], color="0.2", linestyle="--", label="predicted from α, γ, c"),
    ]
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, title="verification", title_fontsize=8)
    caption = (
        "The teacher generating with the student as its draft (speculative_decode rows, batch size 1): its speed-up "
        "over the same cell's teacher decoding alone (solid), and the speed-up predicted from the measured "
        "acceptance rate α, the draft length γ and the cost ratio c of the two models' decode rows, "
        "(1 − α^(γ+1)) / ((1 − α)(γc + 1)) (dashed; Leviathan et al. 2023). Below the dotted line the draft slows "
        "the teacher down. The predicted speed-up costs a verify step as one decode step and takes α independent "
        "from token to token: the gap between the lines is what that leaves out (and the loop's own overhead)."
    )
    return charts.saved_chart(title, fig, out_dir, "lm_speculative.png", caption)


def _floor_chart(points: pd.DataFrame, out_dir: Path) -> Chart:
    """Per source, one horizontal bar per decode row kind of each pair, setting and batch size: its share of the
    memory-bandwidth floor, labelled with the share and the MB each generated token must read."""
    title = "Decode against its floor: share of the measured memory bandwidth"
    sources = sorted(points["source"].unique())
    most = max(len(points[points["source"].eq(s)]) for s in sources)
    fig, facets = charts.faceted_figure(sources, 1, width=9.0, height=1.2 + 0.32 * most)
    whats = sorted(points["what"].unique())
    color = charts.palette(whats)
    for axes, source in zip(facets, sources):
        ax = axes[0]
        here = points[points["source"].eq(source)].iloc[::-1]
        labels = [
            f"{r.pair} · {r.setting} · seq {r.seq_len} · bs{r.batch_size} · {r.what}"
            for r in here.itertuples(index=False)
        ]
        share = here["bandwidth_share"].astype(float) * 100
        bars = ax.barh(range(len(here)), share, color=[color[w] for w in here["what"]])
        ax.set_yticks(range(len(here)), labels, fontsize=7)
        texts = [
            f"{v:.1f} %  ({_megabytes(float(b))} MB/token)" if pd.notna(b) else f"{v:.1f} %"
            for v, b in zip(share, here["decode_bytes_per_token"])
        ]
        ax.bar_label(bars, labels=texts, fontsize=7, padding=2)
        ax.set_xlabel("share of the probe's copy bandwidth reached by the floor bytes (%)")
        ax.set_xlim(0, max(100.0, float(share.max()) * 1.35))
        ax.axvline(100.0, color="0.5", linewidth=0.8, linestyle=":")
        ax.grid(axis="x", alpha=0.3)
    caption = (
        "Decoding is memory-bound: each generated token must read the weights (per batch) and the KV cache. Each bar "
        "is a decode row's decode_bytes_per_token × tokens/s over the probe's copy bandwidth (bandwidth_share; the "
        "copy counts bytes read + written); the dotted line is the floor itself. Speculative rows count each verify "
        "step's teacher read and each draft forward's student read per generated token. Weights that stay in a "
        "CPU's caches can put a bar past the line: the floor, not the measurement, is then off."
    )
    return charts.saved_chart(title, fig, out_dir, "lm_decode_floor.png", caption)


def _megabytes(nbytes: float) -> str:
    mb = nbytes / 1e6
    return f"{mb:,.0f}" if mb >= 100 else f"{mb:.3g}"
