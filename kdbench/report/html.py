"""The HTML report: one self-contained page plus the PNG charts beside it.

The page is rendered by jinja2 with autoescaping on, so every string that comes from a
suite or a result (labels, errors, host names...) is HTML-escaped.  File names in the
output folder are fixed (``index.html``, ``distill_step.png``, ...), never built from
result strings.  The one exception is the link to a cell's profiler trace: its ``href`` is
the stored ``trace_file`` relative to the report folder, percent-encoded (so no path can
become a ``javascript:`` URL or break out of the attribute: :func:`kdbench.report.step_tables.trace_link`)
and then HTML-escaped.

This module renders the page and builds its run, comparison, budget, measurement, environment and quality
tables; the step's tables are :mod:`kdbench.report.step_tables`', the Language models section
:mod:`kdbench.report.lm`'s, the Will it fit section :mod:`kdbench.report.fit`'s, the charts
:mod:`kdbench.report.plots`' and :mod:`kdbench.report.compare.plots`'.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from jinja2 import Environment, FileSystemLoader

from kdbench.config.budgets import OUTCOMES, format_value, where_text
from kdbench.core.errors import KdbenchError
from kdbench.core.limits import MAX_LOSS_ERR
from kdbench.core.names import ALIGN, GENERATE, Measurement, Status
from kdbench.core.schema import COLUMN_NAMES, ENVIRONMENT_COLUMNS
from kdbench.report.charts import NOISY_NOTE, RATE_COLUMNS, THIN_NOTE, distinct_cell_labels, rates
from kdbench.report.compare.format import verdict_line
from kdbench.report.compare.plots import draw_forest, draw_history
from kdbench.report.compare.verdicts import Verdict
from kdbench.report.fit import fit_section
from kdbench.report.format import (
    ERROR_CHARS,
    MISSING,
    format_int,
    format_ms,
    format_speedup,
    mean_std,
    text,
    timestamp,
    truncate,
    values,
)
from kdbench.report.lm import lm_section
from kdbench.report.plots import draw_charts, draw_phases, draw_quality_front
from kdbench.report.step_tables import (
    OFFLINE_CORPUS,
    REMAINDER_LIMIT,
    caching_rows,
    lever_rows,
    offline_rows,
    profile_rows,
    top_op_rows,
)
from kdbench.report.summaries import MEASUREMENT_ORDER, shown_phases, summarize_drafts, summarize_quality
from kdbench.store.files import make_folder
from kdbench.store.results import UNREADABLE

_STATUS_ORDER = tuple(Status)
CONTENDED_TITLE = (
    "contended: measured on a busy machine (other processes used the cores or the GPU it needed), so it reads "
    "slow; compare and budgets leave it out unless --judge-contended"
)
ENV_COLUMNS = ("backend", *ENVIRONMENT_COLUMNS)

_TEMPLATES = Environment(
    loader=FileSystemLoader(Path(__file__).parent / "templates"),
    autoescape=True,
    trim_blocks=True,
    lstrip_blocks=True,
)


def render_report(
    df: pd.DataFrame,
    out_dir: str | Path,
    title: str | None = None,
    comparisons: list | None = None,
    budgets: list | None = None,
    states: dict | None = None,
    threshold: float = 0.05,
) -> Path:
    """Write ``index.html`` and its charts into ``out_dir`` (created if needed); return the page's path.

    ``df`` holds result rows as :func:`kdbench.store.read_results` returns them; columns
    it lacks are treated as null.  ``title`` defaults to the suites' names.  ``comparisons``
    (:class:`kdbench.report.compare.verdicts.Comparison`) each get a table and a forest plot;
    ``budgets`` (:class:`kdbench.config.budgets.BudgetCheck`) a table of their outcomes;
    ``states`` (run id -> :class:`kdbench.store.results.RunState`) say which runs are complete.
    A suite with several runs gets its history (each compared with the one before at ``threshold``).
    """
    if df.empty:
        raise KdbenchError("no measurements to report: the results are empty; run `kdbench run SUITE` first")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise KdbenchError(f"{out_dir} is a file; give a folder for the report")
    make_folder(out_dir, "the report folder")
    df = df.reindex(columns=list(dict.fromkeys([*COLUMN_NAMES, *df.columns]))).reset_index(drop=True)
    df["run_id"] = df["run_id"].fillna("?")
    df["cell_label"] = distinct_cell_labels(df)  # cells of other configs that share a label told apart
    states = states or {}
    suites = sorted(df["suite"].dropna().unique())
    has_quality = bool(df["measurement"].eq(Measurement.QUALITY).any())
    page = _TEMPLATES.get_template("index.html.j2").render(
        title=title or ("kdbench — " + ", ".join(suites) if suites else "kdbench report"),
        runs=_runs(df, states),
        histories=_histories(df, out_dir, threshold, states),
        comparisons=_comparisons(comparisons or [], out_dir),
        budgets=_budget_rows(budgets or []),
        n_cells=df["cell_id"].nunique(),
        n_rows=len(df),
        status_counts=_status_counts(df),
        charts=draw_charts(df, out_dir),
        lm=lm_section(df, out_dir),
        ledger_bound=f"{MAX_LOSS_ERR:g}",
        fit=fit_section(df, out_dir),
        phase_chart=draw_phases(df, out_dir),
        profile=profile_rows(df),
        profile_generated=GENERATE in shown_phases(df),
        profile_aligned=ALIGN in shown_phases(df),
        remainder_limit=f"{REMAINDER_LIMIT * 100:.0f} %",
        caching=caching_rows(df),
        offline=offline_rows(df),
        offline_cells=_offline_cells(df),
        offline_corpus=f"{OFFLINE_CORPUS:,}",
        levers=lever_rows(df),
        top_ops=top_op_rows(df, out_dir),
        has_quality=has_quality,
        quality=_quality(df) if has_quality else [],
        drafts=_drafts(df) if has_quality else [],
        quality_chart=draw_quality_front(df, out_dir) if has_quality else None,
        measurements=_measurements(df),
        environments=_environments(df),
        noisy_note=NOISY_NOTE,
        thin_note=THIN_NOTE,
        contended_note=CONTENDED_TITLE,
        error_chars=ERROR_CHARS,
        unreadable=df.attrs.get(UNREADABLE, []),
    )
    index = out_dir / "index.html"
    index.write_text(page, encoding="utf-8")
    return index


# --- page sections -----------------------------------------------------------------


def _offline_cells(df: pd.DataFrame) -> bool:
    """Whether any ok distill_step row ran with an offline teacher (``teacher.mode offline``)."""
    if "teacher_mode" not in df or "measurement" not in df:
        return False
    step = df["measurement"].eq(Measurement.DISTILL_STEP) & df["status"].eq(Status.OK)
    return bool((step & df["teacher_mode"].eq("offline")).any())


def _runs(df: pd.DataFrame, states: dict) -> list[dict]:
    out = []
    for run_id, rows in df.groupby("run_id", sort=True):
        state = states.get(run_id)
        repeats = pd.to_numeric(rows["repeat"], errors="coerce").max()
        out.append(
            {
                "run_id": run_id,
                "suite": values(rows["suite"]),
                "commit": values(rows["suite_commit"]) or MISSING,
                "first": timestamp(rows["timestamp"].min()),
                "last": timestamp(rows["timestamp"].max()),
                "hostname": values(rows["hostname"]),
                "device_name": values(rows["device_name"]),
                "backend": values(rows["backend"]),
                "repeats": 1 if pd.isna(repeats) else int(repeats),
                "n_rows": len(rows),
                "state": MISSING if state is None else state.describe(),
                "incomplete": state is not None and state.complete is False,
            }
        )
    return out


def _histories(df: pd.DataFrame, out_dir: Path, threshold: float, states: dict) -> list[dict]:
    return [
        {
            "chart": chart,
            "runs": [{"run_id": r.run_id, "label": r.label, "failing": r.failing, "verdict": r.verdict} for r in runs],
        }
        for chart, runs in draw_history(df, out_dir, threshold, states)
    ]


def _comparisons(comparisons: list, out_dir: Path) -> list[dict]:
    quiet = (Verdict.UNCHANGED, Verdict.UNJUDGED)
    out = []
    for i, cmp in enumerate(comparisons):
        bad = cmp.policy.bad()
        listed = [c for c in cmp.changes if c.verdict not in quiet]
        out.append(
            {
                "base": cmp.base,
                "new": cmp.new,
                "threshold": f"{cmp.threshold:.0%}",
                "confidence": f"{cmp.confidence:.0%}",
                "each": f"{cmp.each:.4g}",
                "rated": cmp.rated,
                "chart": draw_forest(cmp, out_dir, f"compare_{i + 1}.png"),
                "regressions": cmp.count(Verdict.REGRESSED),
                "failing": len(cmp.bad),
                "verdict": verdict_line(cmp),
                "unchanged": cmp.count(Verdict.UNCHANGED),
                "unjudged": cmp.count(Verdict.UNJUDGED),
                "counts": _verdict_counts(cmp, bad),
                "notes": cmp.notes(),
                "rows": [
                    {
                        "verdict": str(c.verdict),
                        "bad": c.verdict in bad,
                        "good": c.verdict in (Verdict.IMPROVED, Verdict.FIXED),
                        "cell_label": c.cell_label,
                        "measurement": c.measurement,
                        "batch_size": MISSING if c.batch_size is None else c.batch_size,
                        "base": format_ms(c.base_median_ms),
                        "new": format_ms(c.new_median_ms),
                        "ratio": MISSING if c.ratio is None else f"{c.ratio:.3f}",
                        "interval": MISSING if c.ci_low is None else f"{c.ci_low:.3f} – {c.ci_high:.3f}",
                        "repeats": f"{c.base_repeats} / {c.new_repeats}",
                        "note": truncate(c.note),
                    }
                    for c in listed
                ],
            }
        )
    return out


def _verdict_counts(cmp, bad) -> list[dict]:
    """Every verdict the comparison gave, with its count, in verdict order (regressions first, improvements beside
    them): the summary leaves none out. ``kind``: "bad" (fails the gate), "good" (improved, fixed) or ""."""
    good = (Verdict.IMPROVED, Verdict.FIXED)
    return [
        {"verdict": str(v), "count": n, "kind": "bad" if v in bad else "good" if v in good else ""}
        for v in Verdict
        if (n := cmp.count(v))
    ]


def _budget_rows(checks: list) -> list[dict]:
    rows = [
        {
            "budget": c.budget,
            "run_id": c.run_id,
            "where": where_text(c),
            "value": format_value(c.value, c.stat),
            "met": c.met,
            "missed": c.missed,
            "outcome": c.outcome,
            "note": truncate(c.note),
        }
        for c in checks
    ]
    return sorted(rows, key=lambda r: OUTCOMES.index(r["outcome"]))  # misses first, then thin, skipped, met


def _status_counts(df: pd.DataFrame) -> list[dict]:
    """The headline's count of rows per status, each with how many of them were measured on a busy machine
    (contended) or noisy: "ok: 20 (20 contended)" is not the green "ok: 20" of an idle machine, and is written in
    the warning colour (``warn``)."""
    status = df["status"].fillna("unknown")
    counts = status.value_counts()
    order = [s for s in _STATUS_ORDER if s in counts] + sorted(set(counts.index) - set(_STATUS_ORDER))
    flags = {
        word: df[column].eq(True) if column in df else pd.Series(False, index=df.index)
        for word, column in (("contended", "contended"), ("noisy", "noisy"))
    }
    out = []
    for s in order:
        here = status.eq(s)
        flagged = [f"{int((flag & here).sum())} {word}" for word, flag in flags.items() if (flag & here).any()]
        out.append(
            {
                "status": s,
                "count": int(counts[s]),
                "flags": ", ".join(flagged),
                "warn": bool(flagged),
                "title": CONTENDED_TITLE if flags["contended"][here].any() else NOISY_NOTE if flagged else "",
            }
        )
    return out


TOKENS = RATE_COLUMNS[0]  # a token workload's rate: its cell in the table says tokens/s


def _measurements(df: pd.DataFrame) -> list[dict]:
    """Every timing row, formatted for the table, ordered by run, cell, measurement and batch size.

    Quality rows time nothing; they have their own section.
    """
    df = df[df["measurement"].ne(Measurement.QUALITY)]
    repeats = pd.to_numeric(df["repeat"], errors="coerce")
    shown = repeats.where(repeats.groupby(df["run_id"]).transform("max").gt(1))  # only in runs with repeats
    df = df.assign(
        order_=df["measurement"].map(MEASUREMENT_ORDER),
        noisy_=df["noisy"].eq(True),
        thin_=df["thin"].eq(True),
        contended_=df["contended"].eq(True) if "contended" in df else False,
        busy_=pd.to_numeric(df["host_busy_share"], errors="coerce") if "host_busy_share" in df else None,
        rep_=shown,
    )
    df = rates(df)
    df = df.sort_values(["run_id", "cell_label", "order_", "batch_size", "repeat"], na_position="last")
    return [
        {
            "run_id": r.run_id,
            "cell_label": text(r.cell_label) + (f" (repeat {int(r.repeat)})" if pd.notna(r.rep_) else ""),
            "measurement": text(r.measurement),
            "status": text(r.status),
            "ok": r.status == Status.OK,
            "batch_size": format_int(r.batch_size),
            "precision": text(r.precision),
            "median": format_ms(r.median_ms),
            "iqr": format_ms(r.iqr_ms),
            "p05_p95": MISSING
            if pd.isna(r.p05_ms) or pd.isna(r.p95_ms)
            else f"{format_ms(r.p05_ms)} – {format_ms(r.p95_ms)}",
            "n": format_int(r.n),
            "throughput": format_int(r.rate) + (" tokens/s" if r.rate_column == TOKENS and pd.notna(r.rate) else ""),
            "speedup": format_speedup(r.speedup_vs_teacher),
            "noisy": bool(r.noisy_),
            "thin": bool(r.thin_),
            "contended": bool(r.contended_),
            "busy": f"{r.busy_:.2f}" if r.busy_ is not None and pd.notna(r.busy_) else MISSING,
            "launch_bound": r.launch_bound is True,
            "error": truncate(r.error),
        }
        for r in df.itertuples(index=False)
    ]


def _drafts(df: pd.DataFrame) -> list[dict]:
    """The students as drafts (:func:`kdbench.report.summaries.summarize_drafts`), mean ± std over seeds."""

    def figure(r: dict, name: str, digits: int) -> str:
        return mean_std(r[f"{name}_mean"], r[f"{name}_std"], fmt=lambda v: f"{v:.{digits}f}")

    return [
        {
            "teacher": text(r["teacher"]),
            "student": text(r["student"]),
            "role": text(r["quality_role"]),
            "method": text(r["method"]),
            "gamma": r["gamma"],
            "perplexity": figure(r, "perplexity", 3),
            "alpha": figure(r, "alpha", 3),
            "alpha_predicted": figure(r, "alpha_predicted", 3),
            "accepted_per_verify": figure(r, "accepted_per_verify", 2),
            "tokens_per_verify": figure(r, "tokens_per_verify", 2),
            "cost_ratio": figure(r, "cost_ratio", 2),
            "speedup": figure(r, "speedup", 2),
            "speedup_predicted": figure(r, "speedup_predicted", 2),
            "best_alpha": bool(r["best_alpha"]),
            "best_speedup": bool(r["best_speedup"]),
            "seeds": r["n"],
        }
        for r in summarize_drafts(df).to_dict("records")
    ]


def _environments(df: pd.DataFrame) -> list[dict]:
    """Per run, the environment columns that have a value (several values comma-separated)."""
    environments = []
    for run_id, rows in df.groupby("run_id", sort=True):
        items = [(col, values(rows[col])) for col in ENV_COLUMNS]
        environments.append({"run_id": run_id, "entries": [(k, v) for k, v in items if v]})
    return environments


def _quality(df: pd.DataFrame) -> list[dict]:
    return [
        {
            "teacher": text(r["teacher"]),
            "student": text(r["student"]),
            "role": text(r["quality_role"]),
            "method": text(r["method"]),
            "datasets": r["datasets"] or MISSING,
            "accuracy": mean_std(r["accuracy_mean"], r["accuracy_std"], 100),
            "agreement": mean_std(r["agreement_mean"], r["agreement_std"], 100),
            "time_to_target": mean_std(r["time_to_target_mean_s"], r["time_to_target_std_s"], fmt=format_ms),
            "text": bool(pd.notna(r["perplexity_mean"])),  # a language model on text: bits per byte, perplexity
            "tokenizer": text(r["tokenizer"]),
            "perplexity": mean_std(r["perplexity_mean"], r["perplexity_std"], fmt=lambda v: f"{v:.3f}"),
            "bits_per_byte": mean_std(r["bits_per_byte_mean"], r["bits_per_byte_std"], fmt=lambda v: f"{v:.3f}"),
            "train_time": mean_std(r["train_time_mean_s"], None, fmt=format_ms),
            "reached": f"{r['reached']}/{r['n']} reached",
            "seeds": r["n"],
            "failed": r["failed"],
        }
        for r in summarize_quality(df).to_dict("records")
    ]
