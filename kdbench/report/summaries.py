"""Summaries of result rows, as DataFrames: what the report, the CLI and a pandas session tabulate.

Data only (pandas; never torch): the quality table over seeds (and its Markdown form), each measurement's
repeats pooled as ``compare`` centres them (:func:`pooled`), the live/cached teacher pairs with
their pay-back and the offline-teacher cells beside their live twins (from the derived columns of
:mod:`kdbench.store.derived`).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa

from kdbench.core.names import LEAD_PHASES, PHASES, QUALITY_ROLES, VARIANT_COLUMNS, Measurement, Status
from kdbench.core.schema import COLUMNS, DERIVED, RESULT, STATISTICS
from kdbench.core.stats.repeats import NOISY_REL_IQR, centre_interval, median_log_variance
from kdbench.report.format import mean_std
from kdbench.store.derived import PARALLEL, TEACHER_MODE, payback_epochs, payback_steps, twin_key

POOL_KEY = ["run_id", "cell_id", "measurement", "batch_size"]
REMAINDER_LIMIT = 0.10  # |phase_gap| above this share of the median: the phases shown do not account for the step
MEASUREMENT_ORDER = {m: i for i, m in enumerate(Measurement)}  # the order tables list a cell's measurements in
# The figures pooled over repeats: every numeric statistic, result and derived column of a timed row.
POOLED = tuple(
    c.name
    for c in COLUMNS
    if c.group in (STATISTICS, RESULT, DERIVED) and (pa.types.is_integer(c.type) or pa.types.is_floating(c.type))
)

SUMMARY_KEYS = ("teacher", "student", "quality_role", "method")
# Language models of one name but other config overrides are other models: grouped apart, named with them
OVERRIDE_KEYS = ("teacher_overrides", "student_overrides")
QUALITY_COLUMNS = (
    *SUMMARY_KEYS,
    "tokenizer",  # text quality rows: bytes, or a student's own (bpe:<N>); grouped apart (None for images)
    "n",
    "failed",
    "accuracy_mean",
    "accuracy_std",
    "best_accuracy_mean",
    "agreement_mean",
    "agreement_std",
    "reached",
    "time_to_target_mean_s",
    "time_to_target_std_s",
    "epochs_to_target_mean",
    "train_time_mean_s",
    "perplexity_mean",  # text quality rows (NaN for images)
    "perplexity_std",
    "bits_per_byte_mean",
    "bits_per_byte_std",
    "datasets",
)


def latest(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """One row per ``keys``: the most recent (a rerun supersedes an older row)."""
    return df.sort_values("timestamp", na_position="first").drop_duplicates(keys, keep="last")


def latest_steps(df: pd.DataFrame) -> pd.DataFrame:
    """The ok distill_step rows, the latest per (run, cell), ordered by run and cell label."""
    steps = df[df["measurement"].eq(Measurement.DISTILL_STEP) & df["status"].eq(Status.OK)]
    return latest(steps, ["run_id", "cell_id", "cell_label"]).sort_values(["run_id", "cell_label"], na_position="last")


def pooled(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run, cell, measurement and batch size (and speculative variant) of the ok timed rows: its
    repeats pooled as
    ``compare`` centres them.

    Every numeric figure (median, percentiles, phases, throughput, memory, FLOP rates ...) is the
    geometric mean over the repeats (the arithmetic mean where a value is not positive); the other
    columns are the latest repeat's (``contended``: any repeat's).  Thin repeats (shrunk by a time budget) are left
    out when the measurement has others; a measurement with thin repeats only keeps them and stays ``thin``.
    Added: ``repeats`` (how many were pooled) and ``centre_low_ms`` / ``centre_high_ms``, the
    centre's 95 % t-interval over the repeats (null with one: then p25–p75 of its iterations is
    the spread to show)."""
    timed = df[df["status"].eq(Status.OK) & df["measurement"].ne(Measurement.QUALITY) & df["median_ms"].notna()]
    if timed.empty:
        return timed.assign(repeats=pd.Series(dtype=int), centre_low_ms=np.nan, centre_high_ms=np.nan)
    thin = timed["thin"].eq(True) if "thin" in timed else pd.Series(False, index=timed.index)
    # a cell's speculative_decode rows: one measurement per draft length and temperature
    keys = timed[POOL_KEY].astype(str).agg("\0".join, axis=1)
    for column in (c for c in VARIANT_COLUMNS if c in timed):  # null on all other rows
        keys = keys + "\0" + timed[column].astype("string").fillna("").astype(str)
    has_judged = (~thin).groupby(keys).transform("any")
    rows = timed[~thin | ~has_judged].sort_values("timestamp", na_position="first")
    keys = keys[rows.index]
    last = rows.groupby(keys, sort=False).tail(1)
    out = last.set_index(keys[last.index])
    figures: dict[str, pd.Series] = {}
    for column in (c for c in POOLED if c in rows):
        values = pd.to_numeric(rows[column], errors="coerce")
        positive = values.gt(0) | values.isna()
        logs = np.log(values.where(values.gt(0)))
        geometric = np.exp(logs.groupby(keys).mean())
        arithmetic = values.groupby(keys).mean()
        figures[column] = geometric.where(positive.groupby(keys).all(), arithmetic).reindex(out.index)
    figures["repeats"] = rows.groupby(keys).size().reindex(out.index).astype(int)
    figures["n"] = pd.to_numeric(rows["n"], errors="coerce").groupby(keys).sum().reindex(out.index)  # every sample
    low, high = {}, {}
    for key, group in rows.groupby(keys, sort=False):
        if len(group) < 2:
            continue
        floor = np.mean([median_log_variance(s) for s in group["samples_ms"] if s is not None] or [0.0])
        _, low[key], high[key] = centre_interval(group["median_ms"].tolist(), 0.95, floor)
    figures["centre_low_ms"] = pd.Series(low, dtype=float).reindex(out.index)
    figures["centre_high_ms"] = pd.Series(high, dtype=float).reindex(out.index)
    out = pd.concat([out.drop(columns=[c for c in figures if c in out]), pd.DataFrame(figures)], axis=1)
    if "contended" in rows:  # one repeat measured on a busy machine is enough to say so of the centre
        out["contended"] = rows["contended"].eq(True).groupby(keys).any().reindex(out.index).to_numpy()
    if "rel_iqr" in out:  # noisy as the pooled figures say, not as the latest repeat did
        out["noisy"] = out["rel_iqr"].gt(NOISY_REL_IQR).where(out["rel_iqr"].notna(), out["noisy"])
    return out.reset_index(drop=True)


def shown_phases(rows: pd.DataFrame) -> tuple:
    """The step phases the report shows for ``rows`` (:data:`kdbench.core.names.PHASES`), the phases a step may begin
    with first (:data:`kdbench.core.names.LEAD_PHASES`: on-policy generation, cross-tokenizer alignment) where a row has
    one."""
    leads = tuple(p for p in LEAD_PHASES if p.column in rows and rows[p.column].notna().any())
    return (*leads, *PHASES)


def phase_gap(rows: pd.DataFrame) -> pd.Series:
    """Per row, its step median minus the sum of the phase medians shown for it (:func:`shown_phases`, as pooled
    with the step's median): what the phases the report shows leave unaccounted, the figure "adds up" judges.

    Not the stored ``phase_remainder_ms``, the median over iterations of each iteration's step minus its own phases:
    that is near 0 whenever the stamps cover the step, even where the phase medians, taken from different
    iterations, add up to far less (or more) than the step median, as they do when the phases vary from one
    iteration to the next.  Null where no phase was timed."""
    columns = [p.column for p in shown_phases(rows) if p.column in rows]
    phases = rows[columns].apply(pd.to_numeric, errors="coerce")
    total = phases.sum(axis=1, min_count=1)
    return (pd.to_numeric(rows["median_ms"], errors="coerce") - total).astype(float)


def summarize_quality(df: pd.DataFrame) -> pd.DataFrame:
    """Mean and std over seeds of each (teacher, student, quality_role, method), teachers first.

    Statistics use the ``ok`` rows: ``n`` of them (``failed``: the others).  Standard
    deviations are the sample ones (ddof=1), NaN for a single value.
    ``time_to_target_mean_s``/``_std_s`` are over the seeds that reached the target,
    ``reached`` of the ``n``; ``datasets`` lists the data sets the rows come from.
    """
    if "measurement" in df.columns:
        df = df[df["measurement"].eq(Measurement.QUALITY)]
    if df.empty:
        return pd.DataFrame(columns=list(QUALITY_COLUMNS))
    ok = df["status"].eq(Status.OK)
    figures = ("accuracy", "best_accuracy", "agreement", "time_to_target_s", "epochs_to_target", "train_time_s")
    values = {
        c: (pd.to_numeric(df[c], errors="coerce") if c in df.columns else pd.Series(np.nan, index=df.index)).where(ok)
        for c in (*figures, "perplexity", "bits_per_byte")
    }
    dataset = df["quality_dataset"] if "quality_dataset" in df.columns else None
    overrides = {k: df[k] if k in df.columns else None for k in OVERRIDE_KEYS}
    # the tokenizer's name without its digest ("bpe:512 1a2b..." -> "bpe:512"): a failed row, planned, has no digest
    tokenizer = (
        df["tokenizer"].map(lambda v: v.split(" ")[0] if isinstance(v, str) else None) if "tokenizer" in df else None
    )
    work = (
        df[list(SUMMARY_KEYS)].astype(object).assign(ok=ok, dataset=dataset, tokenizer=tokenizer, **overrides, **values)
    )
    if "uld_alignment" in df:  # ULD's two alignments are two methods here: "uld (bytes)" beside "uld (position)"
        aligned = df["uld_alignment"].notna() & df["method"].notna()
        named = df["method"].astype(str) + " (" + df["uld_alignment"].astype(str) + ")"
        work["method"] = work["method"].where(~aligned, named)
    if "teacher_store_encoding" in df:  # offline-teacher students: one per encoding, "forward_kl (offline k32 ...)"
        stored = df["teacher_store_encoding"].notna() & work["method"].notna()
        named = work["method"].astype(str) + " (offline " + df["teacher_store_encoding"].astype(str) + ")"
        work["method"] = work["method"].where(~stored, named)
    summary = (
        work.groupby([*SUMMARY_KEYS, "tokenizer", *OVERRIDE_KEYS], dropna=False, sort=False)
        .agg(
            n=("ok", "sum"),
            failed=("ok", lambda s: int((~s).sum())),
            accuracy_mean=("accuracy", "mean"),
            accuracy_std=("accuracy", "std"),
            best_accuracy_mean=("best_accuracy", "mean"),
            agreement_mean=("agreement", "mean"),
            agreement_std=("agreement", "std"),
            reached=("time_to_target_s", "count"),
            time_to_target_mean_s=("time_to_target_s", "mean"),
            time_to_target_std_s=("time_to_target_s", "std"),
            epochs_to_target_mean=("epochs_to_target", "mean"),
            train_time_mean_s=("train_time_s", "mean"),
            perplexity_mean=("perplexity", "mean"),
            perplexity_std=("perplexity", "std"),
            bits_per_byte_mean=("bits_per_byte", "mean"),
            bits_per_byte_std=("bits_per_byte", "std"),
            datasets=("dataset", lambda s: ", ".join(dict.fromkeys(map(str, s.dropna())))),
        )
        .reset_index()
    )
    _name_models(summary)
    summary["n"] = summary["n"].astype(int)
    order = summary["quality_role"].map({r: i for i, r in enumerate(QUALITY_ROLES)}).fillna(len(QUALITY_ROLES))
    by = [order, *(summary[k].fillna("").astype(str) for k in ("teacher", "student", "method"))]
    ranked = summary.assign(**{f"_{i}": v for i, v in enumerate(by)})
    ranked = ranked.sort_values([f"_{i}" for i in range(len(by))], kind="stable")
    return ranked[list(QUALITY_COLUMNS)].reset_index(drop=True)


def _name_models(summary: pd.DataFrame) -> None:
    """The summary's key columns with None for missing, and a model name that comes with more than one set of
    overrides named with them."""
    names = [k for k in (*SUMMARY_KEYS, "tokenizer") if k in summary]
    keys = summary[names].astype(object)
    summary[names] = keys.where(keys.notna(), None)
    for role in ("teacher", "student"):
        over = summary[f"{role}_overrides"].astype(object).where(summary[f"{role}_overrides"].notna(), None)
        shapes = over.groupby(summary[role].fillna(""), sort=False).transform(lambda s: len(set(s)))
        summary[role] = [
            f"{name} {o or '(as registered)'}" if name is not None and n > 1 else name
            for name, o, n in zip(summary[role], over, shapes)
        ]


def _name(v) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)


def _figure(mean: str, std: str | None, scale: float = 1.0, digits: int = 1):
    """A column of "mean ± std" from the columns ``mean`` and ``std`` (None: the mean alone), scaled, to ``digits``
    decimals."""
    return lambda r: mean_std(r[mean], r[std] if std else None, scale, fmt=lambda v: f"{v:.{digits}f}", missing="–")


def _reached(r: dict) -> str:
    return f"{r['reached']}/{r['n']}" + (f" ({r['failed']} failed)" if r.get("failed") else "")


# The quality tables' columns: (header, the cell of one summary row).
_WHO = (
    ("teacher", lambda r: _name(r["teacher"])),
    ("student", lambda r: _name(r["student"])),
    ("model", lambda r: str(r["quality_role"])),
    ("method", lambda r: _name(r["method"])),
)
_AGREEMENT = ("agreement (%)", _figure("agreement_mean", "agreement_std", 100))
_TO_TARGET = ("time to target (s)", _figure("time_to_target_mean_s", "time_to_target_std_s", digits=2))
IMAGE_TABLE = (
    *_WHO,
    ("top-1 (%)", _figure("accuracy_mean", "accuracy_std", 100)),
    _AGREEMENT,
    _TO_TARGET,
    ("reached", _reached),
)
TEXT_TABLE = (  # language models on text: held-out bits per byte first (comparable across tokenizers), then
    # the perplexity per token of each row's own tokenizer (not comparable across them), and the training time
    *_WHO,
    ("tokenizer", lambda r: _name(r["tokenizer"])),
    ("bits/byte", _figure("bits_per_byte_mean", "bits_per_byte_std", digits=3)),
    ("perplexity (per token)", _figure("perplexity_mean", "perplexity_std", digits=3)),
    ("next-token top-1 (%)", _figure("accuracy_mean", "accuracy_std", 100)),
    _AGREEMENT,
    ("training (s)", _figure("train_time_mean_s", None, digits=1)),
    _TO_TARGET,
    ("reached", _reached),
)


def markdown_table(summary: pd.DataFrame) -> str:
    """A compact Markdown table of :func:`summarize_quality` (accuracies in %, times in s): :data:`IMAGE_TABLE`'s
    columns, or with text rows :data:`TEXT_TABLE`'s."""
    text = "perplexity_mean" in summary.columns and summary["perplexity_mean"].notna().any()
    columns = TEXT_TABLE if text else IMAGE_TABLE
    lines = ["| " + " | ".join(header for header, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r) for _, cell in columns) + " |" for r in summary.to_dict("records")]
    return "\n".join(lines) + "\n"


# The students as drafts of their seed's teacher (text quality rows with quality.speculative): per draft length γ
DRAFT_FIGURES = (  # (summary name, the row's column, a list per γ)
    ("perplexity", "perplexity", False),
    ("alpha", "draft_alpha", True),
    ("alpha_predicted", "draft_alpha_predicted", False),
    ("accepted_per_verify", "draft_accepted_per_verify", True),
    ("tokens_per_verify", "draft_tokens_per_verify", True),
    ("cost_ratio", "draft_cost_ratio", False),
    ("speedup", "draft_speedup", True),
    ("speedup_predicted", "draft_speedup_predicted", True),
)
DRAFT_COLUMNS = (
    *SUMMARY_KEYS,
    "gamma",
    "n",
    *(f"{name}_{s}" for name, _, _ in DRAFT_FIGURES for s in ("mean", "std")),
    "best_alpha",  # the highest mean alpha of the students of one teacher and student shape at this γ
    "best_speedup",  # the highest mean measured speed-up, likewise
)


def summarize_drafts(df: pd.DataFrame) -> pd.DataFrame:
    """The students as drafts of their seed's teacher (the ``draft_*`` columns of text quality rows): per
    (teacher, student, quality_role, method) and draft length γ, the mean and std over the seeds of the perplexity,
    the measured and predicted (1 − TV) acceptance rate, the accepted and generated tokens per verify step, the
    cost ratio and the measured and predicted speed-up; ``best_alpha`` / ``best_speedup`` mark the students with
    the highest mean among those of one teacher and student shape at that γ: which loss makes the best draft.
    Ordered by teacher, student, γ, then scratch before distilled, by method."""
    if df.empty or "draft_gammas" not in df.columns:
        return pd.DataFrame(columns=list(DRAFT_COLUMNS))
    rows = df[df["measurement"].eq(Measurement.QUALITY) & df["status"].eq(Status.OK) & df["draft_gammas"].notna()]
    records = []
    for r in rows.to_dict("records"):
        keys = {k: r.get(k) for k in (*SUMMARY_KEYS, *OVERRIDE_KEYS)}
        for i, gamma in enumerate(r["draft_gammas"]):
            figures = {name: _float(r.get(col), i if per_gamma else None) for name, col, per_gamma in DRAFT_FIGURES}
            records.append({**keys, "gamma": int(gamma), **figures})
    if not records:
        return pd.DataFrame(columns=list(DRAFT_COLUMNS))
    work = pd.DataFrame(records)
    group = [*SUMMARY_KEYS, *OVERRIDE_KEYS, "gamma"]
    aggregations = {"n": ("alpha", "count")}
    for name, _, _ in DRAFT_FIGURES:
        aggregations |= {f"{name}_mean": (name, "mean"), f"{name}_std": (name, "std")}
    summary = work.astype({k: object for k in group if k != "gamma"}).groupby(group, dropna=False, sort=False)
    summary = summary.agg(**aggregations).reset_index()
    shape = summary[["teacher", "student", *OVERRIDE_KEYS, "gamma"]].astype(str).agg("\0".join, axis=1)
    for figure in ("alpha", "speedup"):
        best = summary[f"{figure}_mean"].groupby(shape).transform("max")
        summary[f"best_{figure}"] = summary[f"{figure}_mean"].eq(best) & summary[f"{figure}_mean"].notna()
    _name_models(summary)
    order = summary["quality_role"].map({r: i for i, r in enumerate(QUALITY_ROLES)}).fillna(len(QUALITY_ROLES))
    by = [summary["teacher"].fillna("").astype(str), summary["student"].fillna("").astype(str), summary["gamma"]]
    by += [order, summary["method"].fillna("").astype(str)]
    ranked = summary.assign(**{f"_{i}": v for i, v in enumerate(by)})
    ranked = ranked.sort_values([f"_{i}" for i in range(len(by))], kind="stable")
    return ranked[list(DRAFT_COLUMNS)].reset_index(drop=True)


def _float(value, index: int | None) -> float:
    """A row's figure (the ``index``-th of a list), NaN where missing."""
    if index is not None:
        value = None if value is None or not hasattr(value, "__len__") or len(value) <= index else value[index]
    try:
        return float(value) if value is not None else math.nan
    except (TypeError, ValueError):
        return math.nan


def _bold(best: str, figure) -> object:
    """A column cell, in bold where ``best`` marks the row."""
    return lambda r: f"**{figure(r)}**" if r[best] and figure(r) != "–" else figure(r)


DRAFT_TABLE = (
    *_WHO,
    ("γ", lambda r: str(r["gamma"])),
    ("perplexity", _figure("perplexity_mean", "perplexity_std", digits=3)),
    ("α", _bold("best_alpha", _figure("alpha_mean", "alpha_std", digits=3))),
    ("α predicted (1 − TV)", _figure("alpha_predicted_mean", "alpha_predicted_std", digits=3)),
    ("accepted / verify", _figure("accepted_per_verify_mean", "accepted_per_verify_std", digits=2)),
    ("tokens / verify", _figure("tokens_per_verify_mean", "tokens_per_verify_std", digits=2)),
    ("c", _figure("cost_ratio_mean", "cost_ratio_std", digits=2)),
    ("speed-up (x)", _bold("best_speedup", _figure("speedup_mean", "speedup_std", digits=2))),
    ("predicted speed-up (x)", _figure("speedup_predicted_mean", "speedup_predicted_std", digits=2)),
    ("seeds", lambda r: str(r["n"])),
)


def markdown_drafts(summary: pd.DataFrame) -> str:
    """A Markdown table of :func:`summarize_drafts` (mean ± std over seeds), the highest mean α and measured
    speed-up of each γ in bold; empty without draft figures."""
    if summary.empty:
        return ""
    lines = ["| " + " | ".join(header for header, _ in DRAFT_TABLE) + " |", "|" + "---|" * len(DRAFT_TABLE)]
    lines += ["| " + " | ".join(cell(r) for _, cell in DRAFT_TABLE) + " |" for r in summary.to_dict("records")]
    return "\n".join(lines) + "\n"


def caching_pairs(df: pd.DataFrame) -> pd.DataFrame:
    """Per cached-teacher distill_step cell of a run whose live twin is in the same run: both cells'
    labels and centres (repeats pooled as compare centres them), the saving per step (live centre minus
    cached centre), the one-off cost and the steps after which the saving repays it."""
    steps = pooled(df)
    steps = steps[steps["measurement"].eq(Measurement.DISTILL_STEP)]
    if steps.empty:
        return pd.DataFrame()
    key = steps["run_id"].astype(str) + "\0" + steps["config_json"].map(lambda j: str(twin_key(j, TEACHER_MODE)))
    steps = steps.assign(_key=key)
    live = steps[steps["teacher_mode"].fillna("live").eq("live")].drop_duplicates("_key", keep="last")
    cached = steps[steps["teacher_mode"].eq("cached") & steps["teacher_cache_saving_ms"].notna()]
    pairs = cached.merge(live[["_key", "cell_label", "median_ms"]], on="_key", suffixes=("_cached", "_live"))
    saving = pairs["median_ms_live"] - pairs["median_ms_cached"]
    payback = [payback_steps(one_off, s) for one_off, s in zip(pairs["teacher_cache_ms"], saving)]
    pairs = pairs.assign(
        teacher_cache_saving_ms=saving,
        teacher_cache_payback_steps=[np.nan if p is None else float(p) for p in payback],
    )
    return pairs.rename(columns={"cell_label_cached": "cached_label", "cell_label_live": "cell_label"})


def offline_pairs(df: pd.DataFrame) -> pd.DataFrame:
    """Per offline-teacher distill_step cell of a run (``teacher.mode offline``) whose live twin is in the same run
    (the twin :mod:`kdbench.store.derived` matched: ``offline_twin``), both cells pooled as :func:`caching_pairs` pools
    them: the offline row's columns, the twin's label, median and peaks (``twin_label``, ``median_ms_live``,
    ``predicted_peak_bytes_live``, ``live_peak_bytes_live``), and from the pooled medians the saving per step
    (``saving_ms``: live minus offline), per token (``saving_ms_per_token``: over the step's tokens on all its
    ranks) and the epochs after which it repays the store's build (``payback_epochs``: build ms per token over the
    saving per token, :func:`kdbench.store.derived.payback_epochs`; NaN where not faster or not built)."""
    steps = pooled(df)
    steps = steps[steps["measurement"].eq(Measurement.DISTILL_STEP)]
    if steps.empty or "offline_twin" not in steps:
        return pd.DataFrame()
    offline = steps[steps["teacher_mode"].eq("offline") & steps["offline_twin"].notna()]
    if offline.empty:
        return pd.DataFrame()
    live = steps[steps["teacher_mode"].fillna("live").eq("live")]
    run = steps["run_id"].astype(str) + "\0"
    # a data-parallel offline cell's twin shards its teacher (FSDP2): then its parallelism is not compared either
    sharded = offline["offline_twin"].eq("live fsdp")
    key = (run + steps["config_json"].map(lambda j: str(twin_key(j, TEACHER_MODE)))).rename("_key")
    key_parallel = (run + steps["config_json"].map(lambda j: str(twin_key(j, TEACHER_MODE + PARALLEL)))).rename("_key")
    offline = offline.assign(_key=key_parallel[offline.index].where(sharded, key[offline.index]))
    fsdp = live["parallel"].eq("fsdp") if "parallel" in live else pd.Series(False, index=live.index)
    twins = pd.concat([live.assign(_key=key[live.index]), live[fsdp].assign(_key=key_parallel[live[fsdp].index])])
    twins = twins.drop_duplicates("_key", keep="last")
    twins = twins[["_key", "cell_label", "median_ms", "predicted_peak_bytes", "live_peak_bytes"]].rename(
        columns={
            "cell_label": "twin_label",
            "median_ms": "median_ms_live",
            "predicted_peak_bytes": "predicted_peak_bytes_live",
            "live_peak_bytes": "live_peak_bytes_live",
        }
    )
    pairs = offline.merge(twins, on="_key")
    ranks = pd.to_numeric(pairs["world_size"], errors="coerce").fillna(1) if "world_size" in pairs else 1
    saving = pairs["median_ms_live"] - pairs["median_ms"]
    per_token = saving / (pd.to_numeric(pairs["tokens"], errors="coerce") * ranks)
    payback = payback_epochs(pairs["teacher_store_build_s"], pairs["teacher_store_tokens"], per_token)
    pairs = pairs.assign(saving_ms=saving, saving_ms_per_token=per_token, payback_epochs=payback)
    return pairs.sort_values(["run_id", "cell_label"]).reset_index(drop=True)
