"""The data of the report's *Language models* section (pandas only, never torch): the LM cells' (``data_kind ==
"tokens"``) step and serving figures, and their formatted table rows.

* :func:`step_points`: one row per LM distill_step cell of a run, its repeats pooled as ``compare`` centres them,
  or its latest row when none was ok (an ``oom`` at a long sequence is a result); with the loss phase's share
  of the step and the computed logits memory's share of the measured peak.
* :func:`loss_shares`, :func:`memory_table`: what the loss-share and memory charts draw.
* :func:`serving_table`: per pair, setting, prompt length and batch size, the student's and the teacher's
  prefill and decode, the student's speed-ups, and each decode's share of the memory-bandwidth floor (its
  ``bandwidth_share``: the bytes a generated token must read at the decode's tokens/s over the probe's copy
  bandwidth; cells that differ only in their loss serve the same models: they are shown once, at the median
  over those cells; cells with another generation backend are their own setting).
* :func:`speculative_table`: per pair, setting, prompt length, new tokens, draft length γ and temperature T, the
  teacher decoding with the student as its draft (speculative_decode rows): α, tokens per verify (measured and
  predicted), tokens/s, the measured and predicted speed-ups over the teacher alone, and the cost ratio c.
* :func:`floor_points`: the decode rows against the memory-bandwidth floor.
* :func:`step_rows`, :func:`serving_rows`, :func:`speculative_rows`: those tables as the page writes them (bytes
  through :func:`kdbench.report.format.format_mib`, as every table of the report).

The accuracy ledger's table is :mod:`kdbench.report.ledger`'s; the charts are :mod:`kdbench.report.lm.charts`'.
"""

from __future__ import annotations

import pandas as pd

import kdbench.report.charts as charts
from kdbench.core.names import LM_SERVING, Measurement, Status
from kdbench.core.schema import COLUMN_NAMES
from kdbench.report.format import (
    MISSING,
    format_int,
    format_mib,
    format_ms,
    format_percent,
    format_speedup,
    truncate,
)
from kdbench.report.summaries import latest, pooled

LM_DATA_KIND = "tokens"
LOSS_IMPLS = ("dense", "natural", "chunked", "fused_linear", "liger", "torch_linear")  # report order (and colours)
GIB = 2**30
STEP_KEY = ["source", "pair", "setting", "impl", "seq_len"]
SERVING_KEY = ["source", "pair", "setting", "seq_len", "decode_tokens", "batch_size"]
SERVING_STATS = ("median_ms", "tokens_per_s", "speedup", "bandwidth_share")
# The LM charts' axes and series: never part of a cell's setting (chunk_size goes with its loss_impl).
_NOT_SETTING = ("loss_impl", "seq_len", "chunk_size", "decode_tokens")
_STATUS_TEXT = {Status.OOM: "OOM"}
FLAGS = ("is_noisy", "is_contended", "is_thin")  # kdbench.report.charts.with_keys'; every chart marks them


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
    left = pd.Series([key not in done for key in zip(rows["run_id"], rows["cell_id"])], index=rows.index, dtype=bool)
    rest = latest(rows[left], ["run_id", "cell_id"])  # a mask, also when no row is left (not a column list)
    parts = [p.dropna(axis=1, how="all") for p in (ok, rest) if len(p)]
    if not parts:
        added = ["loss_share", "logits_share", "peak_bytes", "footprint_bytes", "memory_note", *FLAGS]
        return pd.DataFrame(columns=list(dict.fromkeys([*rows.columns, *STEP_KEY, *added])))
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
    columns += [flag for flag in FLAGS if flag in table]  # the step's: its chart rings them
    return table.loc[keep, columns].reset_index(drop=True)


def serving_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per :data:`SERVING_KEY`: for each serving measurement ``m`` (student/teacher prefill and decode)
    ``m_status`` (ok when one cell's was), ``m_median_ms``, ``m_tokens_per_s`` and, for the student's,
    ``m_speedup`` (the teacher's median over the student's, of the figures of this table: prefill's times, decode's
    tokens/s) and, for decode, ``m_bandwidth_share``, each the median over the cells with that key (``cells``: how
    many) of their centres over repeats; ``m_contended`` and ``m_noisy``: whether a repeat of one of those cells
    was.  The setting is
    the precision, with the teacher's where it differs, and the generation backend where it is not the default
    (the serving measurements depend on nothing else of a cell but its models and shapes)."""
    rows = lm_rows(df)
    rows = rows[rows["measurement"].isin(list(LM_SERVING))]
    stats_of = ("status", *SERVING_STATS, "contended", "noisy")
    columns = [*SERVING_KEY, "cells", *(f"{m}_{s}" for m in LM_SERVING for s in stats_of)]
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
    flags = [
        ok.assign(flag_=ok[column].eq(True)).groupby(by)["flag_"].any().unstack("measurement").add_suffix(f"_{word}")
        for column, word in (("contended", "contended"), ("noisy", "noisy"))
        if column in ok and len(ok)
    ]
    table = pd.concat([cells, status, stats, *flags], axis=1).reset_index()
    table = table.reindex(columns=columns)
    for kind, rate in (("prefill", False), ("decode", True)):
        # the speed-up shown is the quotient of the two figures shown beside it, so that it agrees with them: the
        # median over cells of each cell's speed-up does not (cells' noise moves the three medians apart)
        student, teacher = f"student_{kind}", f"teacher_{kind}"
        if rate:
            quotient = _ratio(table[f"{student}_tokens_per_s"], table[f"{teacher}_tokens_per_s"])
        else:
            quotient = _ratio(table[f"{teacher}_median_ms"], table[f"{student}_median_ms"])
        table[f"{student}_speedup"] = quotient
    for m in LM_SERVING:
        for word in ("contended", "noisy"):
            table[f"{m}_{word}"] = table[f"{m}_{word}"].eq(True)
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
    ok = _with_decode_flags(charts.with_flags(pooled(rows)), df)
    stats = ok.groupby(SPECULATIVE_KEY)[list(SPECULATIVE_STATS)].median() if len(ok) else None
    flags = ok.groupby(SPECULATIVE_KEY)[list(FLAGS)].any() if len(ok) else None
    ordered = rows.sort_values("timestamp", na_position="first")
    status = ordered.groupby(SPECULATIVE_KEY)["status"].agg(_any_ok)
    error = ordered.groupby(SPECULATIVE_KEY)["error"].last()
    cells = rows.groupby(SPECULATIVE_KEY)["cell_id"].nunique().rename("cells")
    parts = [cells, status.rename("status"), error.rename("error")] + ([stats, flags] if stats is not None else [])
    table = pd.concat(parts, axis=1).reset_index().reindex(columns=[*columns, *FLAGS])
    table[list(FLAGS)] = table[list(FLAGS)].eq(True)
    table = table.assign(cells=table["cells"].astype(int))
    return table.sort_values(SPECULATIVE_KEY).reset_index(drop=True)


def _with_decode_flags(spec: pd.DataFrame, df: pd.DataFrame) -> pd.DataFrame:
    """Speculative rows (pooled, with the chart flags) flagged also where a batch-1 teacher_decode or student_decode
    row of their run and cell, the two their speed-up and cost ratio divide, was contended or noisy."""
    if spec.empty:
        return spec
    decode = df[df["measurement"].isin([Measurement.TEACHER_DECODE, Measurement.STUDENT_DECODE])]
    decode = charts.with_flags(pooled(decode[pd.to_numeric(decode["batch_size"], errors="coerce").eq(1)]))
    if decode.empty:
        return spec
    by = decode.groupby(["run_id", "cell_id"])[["is_noisy", "is_contended"]].any()
    at = pd.MultiIndex.from_frame(spec[["run_id", "cell_id"]])
    for flag in ("is_noisy", "is_contended"):
        spec[flag] = spec[flag].eq(True).to_numpy() | by[flag].reindex(at).eq(True).to_numpy()
    return spec


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
        return pd.DataFrame(columns=[*columns, *FLAGS])
    rows = _serving_keys(charts.with_keys(rows))
    spec = rows["measurement"].eq(Measurement.SPECULATIVE_DECODE)
    gamma = pd.to_numeric(rows["draft_tokens"], errors="coerce")
    temperature = pd.to_numeric(rows["spec_temperature"], errors="coerce")
    label = rows["measurement"].astype(str).str.replace("_decode", " decode", regex=False)
    variant = "speculative γ" + gamma.fillna(0).astype(int).astype(str)
    variant += temperature.map(lambda t: " greedy" if t == 0 else f" T {t:g}")
    rows = rows.assign(what=label.where(~spec, variant))
    ok = charts.with_flags(pooled(rows))
    stats = ok.groupby(FLOOR_KEY)[["bandwidth_share", "decode_bytes_per_token"]].median()
    flags = ok.groupby(FLOOR_KEY)[list(FLAGS)].any()
    table = pd.concat([stats, flags], axis=1).reset_index().reindex(columns=[*columns, *FLAGS])
    return table.sort_values(FLOOR_KEY).reset_index(drop=True)


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


# --- table rows ---------------------------------------------------------------------


def step_rows(points: pd.DataFrame) -> list[dict]:
    """The LM step table: per cell its status, tokens/s, step time, loss share and memory, formatted."""

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
                "peak": format_mib(r["peak_bytes"]) if ok else MISSING,
                "footprint": format_mib(r["footprint_bytes"]) if ok else MISSING,
                "memory_note": r["memory_note"],
                "logits": format_mib(r["logits_memory_bytes"]),
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
        row["flags"] = serving_flags(r)
        out.append(row)
    return out


def serving_flags(r: dict) -> str:
    """What of a serving table row was measured on a busy machine or noisy ("contended: student prefill, teacher
    decode"), its speed-ups with it; empty when nothing was."""
    parts = []
    for word in ("contended", "noisy"):
        which = [str(m).replace("_", " ") for m in LM_SERVING if bool(r.get(f"{m}_{word}", False))]
        if which:
            parts.append(f"{word}: " + ", ".join(which))
    return "; ".join(parts)
