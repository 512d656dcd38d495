"""The HTML report: one self-contained page plus the PNG charts beside it.

The page is rendered by jinja2 with autoescaping on, so every string that comes from a
suite or a result (labels, errors, host names...) is HTML-escaped.  File names in the
output folder are fixed (``index.html``, ``distill_step.png``, ...), never built from
result strings.  The one exception is the link to a cell's profiler trace: its ``href`` is
the stored ``trace_file`` relative to the report folder, percent-encoded (so no path can
become a ``javascript:`` URL or break out of the attribute) and then HTML-escaped.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from urllib.parse import quote

import pandas as pd
from jinja2 import Environment, FileSystemLoader

from kdbench.errors import KdbenchError
from kdbench.names import PHASES, Measurement, Status
from kdbench.report.lm import lm_section
from kdbench.report.plots import (
    NOISY_NOTE,
    THIN_NOTE,
    draw_charts,
    draw_forest,
    draw_history,
    draw_phases,
    draw_quality_front,
)
from kdbench.report.summaries import caching_pairs, latest_steps, mean_std, pooled, summarize_quality
from kdbench.schema import COLUMN_NAMES, ENVIRONMENT_COLUMNS

MISSING = "—"
ERROR_CHARS = 200
_STATUS_ORDER = tuple(Status)
_MEASUREMENT_ORDER = {m: i for i, m in enumerate(Measurement)}
ENV_COLUMNS = ("backend", *ENVIRONMENT_COLUMNS)
REMAINDER_LIMIT = 0.10  # |remainder| above this share of the median: the phases do not account for the step
STALL_GAP = 0.05  # window throughput this far below the median-based one: the window had gaps or stalls
MIB = 2**20

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
    (:class:`kdbench.report.compare.Comparison`) each get a table and a forest plot;
    ``budgets`` (:class:`kdbench.config.budgets.BudgetCheck`) a table of their outcomes;
    ``states`` (run id -> :class:`kdbench.store.results.RunState`) say which runs are complete.
    A suite with several runs gets its history (each compared with the one before at ``threshold``).
    """
    if df.empty:
        raise KdbenchError("no measurements to report: the results are empty; run `kdbench run SUITE` first")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise KdbenchError(f"{out_dir} is a file; give a folder for the report")
    out_dir.mkdir(parents=True, exist_ok=True)
    df = df.reindex(columns=list(dict.fromkeys([*COLUMN_NAMES, *df.columns]))).reset_index(drop=True)
    df["run_id"] = df["run_id"].fillna("?")
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
        phase_chart=draw_phases(df, out_dir),
        profile=_profile(df),
        remainder_limit=f"{REMAINDER_LIMIT * 100:.0f} %",
        caching=_caching(df),
        levers=_levers(df),
        top_ops=_top_ops(df, out_dir),
        has_quality=has_quality,
        quality=_quality(df) if has_quality else [],
        quality_chart=draw_quality_front(df, out_dir) if has_quality else None,
        measurements=_measurements(df),
        environments=_environments(df),
        noisy_note=NOISY_NOTE,
        thin_note=THIN_NOTE,
        error_chars=ERROR_CHARS,
    )
    index = out_dir / "index.html"
    index.write_text(page, encoding="utf-8")
    return index


# --- number formatting -------------------------------------------------------------


def format_ms(x) -> str:
    """A time to 3 significant digits in plain notation: 1234.5 → '1230', 0.012345 → '0.0123'."""
    if pd.isna(x):
        return MISSING
    x = float(f"{float(x):.3g}")
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    decimals = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:.{decimals}f}"


def format_int(x) -> str:
    """A count or throughput as a rounded integer with thousands separators."""
    return MISSING if pd.isna(x) else f"{float(x):,.0f}"


def format_speedup(x) -> str:
    return MISSING if pd.isna(x) else f"{float(x):.2f}×"


def format_sig(x, unit: str = "") -> str:
    """Any quantity to 3 significant digits (as :func:`format_ms`), with ``unit`` appended."""
    if pd.isna(x):
        return MISSING
    return format_ms(x) + (f" {unit}" if unit else "")


def format_percent(ratio) -> str:
    """A ratio as a percentage to 3 significant digits: 0.1234 → '12.3 %'."""
    return format_sig(None if pd.isna(ratio) else float(ratio) * 100, "%")


def format_mib(n_bytes) -> str:
    return MISSING if pd.isna(n_bytes) else f"{float(n_bytes) / MIB:,.1f} MiB"


def _text(x) -> str:
    return MISSING if pd.isna(x) else str(x)


def _truncate(text, limit: int = ERROR_CHARS) -> str:
    if pd.isna(text):
        return ""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _timestamp(ts) -> str:
    return MISSING if pd.isna(ts) else ts.strftime("%Y-%m-%d %H:%M:%S UTC")


def _values(series: pd.Series) -> str:
    """The distinct non-null values of ``series``, comma-separated (empty when none)."""
    return ", ".join(map(str, series.dropna().unique()))


# --- page sections -----------------------------------------------------------------


def _runs(df: pd.DataFrame, states: dict) -> list[dict]:
    out = []
    for run_id, rows in df.groupby("run_id", sort=True):
        state = states.get(run_id)
        repeats = pd.to_numeric(rows["repeat"], errors="coerce").max()
        out.append(
            {
                "run_id": run_id,
                "suite": _values(rows["suite"]),
                "commit": _values(rows["suite_commit"]) or MISSING,
                "first": _timestamp(rows["timestamp"].min()),
                "last": _timestamp(rows["timestamp"].max()),
                "hostname": _values(rows["hostname"]),
                "device_name": _values(rows["device_name"]),
                "backend": _values(rows["backend"]),
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
    from kdbench.report.compare import Verdict
    from kdbench.report.compare_format import verdict_line

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
                        "note": _truncate(c.note),
                    }
                    for c in listed
                ],
            }
        )
    return out


def _levers(df: pd.DataFrame) -> list[dict]:
    """The cells that paid a one-off cost for their levers, with the break-even against the same
    measurement without levers (derived columns, pooled over matched repeats), by run and cell."""
    rows = pooled(df)
    rows = rows[rows["one_off_ms"].notna()]
    rows = rows.assign(order_=rows["measurement"].map(_MEASUREMENT_ORDER))
    out = []
    for r in rows.sort_values(["run_id", "cell_label", "order_", "batch_size"]).itertuples(index=False):
        gain = r.lever_gain_ms
        share = gain / r.lever_baseline_ms if pd.notna(gain) and r.lever_baseline_ms else None
        if r.thin is True:
            verdict = "thin: not judged"
        elif pd.isna(gain):
            verdict = "no twin without levers in this run"
        elif gain <= 0:
            verdict = "never: not faster"
        else:
            verdict = format_int(r.break_even_steps)
        if pd.notna(r.lever_gain_low_ms) and r.thin is not True:
            low = format_int(r.break_even_low_steps) if pd.notna(r.break_even_low_steps) else "never"
            high = format_int(r.break_even_high_steps) if pd.notna(r.break_even_high_steps) else "never"
            span = f"{low} – {high}"
            gain_range = f"{format_ms(r.lever_gain_low_ms)} – {format_ms(r.lever_gain_high_ms)}"
        else:
            span = gain_range = MISSING
        out.append(
            {
                "run_id": r.run_id,
                "cell_label": _text(r.cell_label),
                "measurement": _text(r.measurement)
                + (f" bs{int(r.batch_size)}" if r.measurement != Measurement.DISTILL_STEP else ""),
                "runtime": _text(r.runtime) if pd.notna(r.runtime) else MISSING,
                "kind": _text(r.one_off_kind),
                "one_off_s": format_sig(r.one_off_ms / 1e3),
                "net_s": format_sig(None if pd.isna(r.lever_one_off_net_ms) else r.lever_one_off_net_ms / 1e3),
                "repeats": int(r.repeats),
                "baseline": format_ms(r.lever_baseline_ms),
                "median": format_ms(r.median_ms),
                "gain": format_ms(gain),
                "gain_range": gain_range,
                "gain_pct": format_percent(share) if share is not None else MISSING,
                "break_even": verdict,
                "break_even_range": span,
                "check": _text(r.output_check) if pd.notna(r.output_check) else "",
                "compile": MISSING
                if pd.isna(r.graph_breaks)
                else f"{int(r.graph_breaks)} breaks, {int(r.compiled_graphs)} graphs, {int(r.recompiles)} recompiles"
                if pd.notna(r.recompiles)
                else f"{int(r.graph_breaks)} breaks",
            }
        )
    return out


def _budget_rows(checks: list) -> list[dict]:
    from kdbench.config.budgets import OUTCOMES, format_value, where_text

    rows = [
        {
            "budget": c.budget,
            "run_id": c.run_id,
            "where": where_text(c),
            "value": format_value(c.value, c.stat),
            "met": c.met,
            "missed": c.missed,
            "outcome": c.outcome,
            "note": _truncate(c.note),
        }
        for c in checks
    ]
    return sorted(rows, key=lambda r: OUTCOMES.index(r["outcome"]))  # misses first, then thin, skipped, met


def _status_counts(df: pd.DataFrame) -> dict[str, int]:
    counts = df["status"].fillna("unknown").value_counts()
    order = [s for s in _STATUS_ORDER if s in counts] + sorted(set(counts.index) - set(_STATUS_ORDER))
    return {s: int(counts[s]) for s in order}


def _measurements(df: pd.DataFrame) -> list[dict]:
    """Every timing row, formatted for the table, ordered by run, cell, measurement and batch size.

    Quality rows time nothing; they have their own section.
    """
    df = df[df["measurement"].ne(Measurement.QUALITY)]
    repeats = pd.to_numeric(df["repeat"], errors="coerce")
    shown = repeats.where(repeats.groupby(df["run_id"]).transform("max").gt(1))  # only in runs with repeats
    df = df.assign(
        order_=df["measurement"].map(_MEASUREMENT_ORDER),
        noisy_=df["noisy"].eq(True),
        thin_=df["thin"].eq(True),
        rep_=shown,
    )
    df = df.sort_values(["run_id", "cell_label", "order_", "batch_size", "repeat"], na_position="last")
    return [
        {
            "run_id": r.run_id,
            "cell_label": _text(r.cell_label) + (f" (repeat {int(r.repeat)})" if pd.notna(r.rep_) else ""),
            "measurement": _text(r.measurement),
            "status": _text(r.status),
            "ok": r.status == Status.OK,
            "batch_size": format_int(r.batch_size),
            "precision": _text(r.precision),
            "median": format_ms(r.median_ms),
            "iqr": format_ms(r.iqr_ms),
            "p05_p95": MISSING
            if pd.isna(r.p05_ms) or pd.isna(r.p95_ms)
            else f"{format_ms(r.p05_ms)} – {format_ms(r.p95_ms)}",
            "n": format_int(r.n),
            "throughput": format_int(r.throughput),
            "speedup": format_speedup(r.speedup_vs_teacher),
            "noisy": bool(r.noisy_),
            "thin": bool(r.thin_),
            "launch_bound": r.launch_bound is True,
            "error": _truncate(r.error),
        }
        for r in df.itertuples(index=False)
    ]


def _environments(df: pd.DataFrame) -> list[dict]:
    """Per run, the environment columns that have a value (several values comma-separated)."""
    environments = []
    for run_id, rows in df.groupby("run_id", sort=True):
        items = [(col, _values(rows[col])) for col in ENV_COLUMNS]
        environments.append({"run_id": run_id, "entries": [(k, v) for k, v in items if v]})
    return environments


def _remainder(rem, median) -> tuple[str, bool | None]:
    """'0.130 ms (1.1 %)' and whether |remainder| exceeds REMAINDER_LIMIT of the median (None: unknown)."""
    if pd.isna(rem):
        return MISSING, None
    if pd.isna(median) or float(median) <= 0:
        return format_sig(rem, "ms"), None
    share = float(rem) / float(median)
    return f"{format_sig(rem, 'ms')} ({share * 100:.1f} %)", abs(share) > REMAINDER_LIMIT


def _profile(df: pd.DataFrame) -> list[dict]:
    """Per ok distill_step cell: its phases, cold start, compute rate, memory and energy, formatted (its
    repeats pooled as compare centres them)."""
    out = []
    steps = pooled(df)
    steps = steps[steps["measurement"].eq(Measurement.DISTILL_STEP)].sort_values(["run_id", "cell_label"])
    for r in steps.to_dict("records"):
        remainder, bad = _remainder(r["phase_remainder_ms"], r["median_ms"])
        steady = format_sig(r["time_to_steady_ms"])
        if steady != MISSING and pd.notna(r["steady_after_iters"]):
            steady += f" ({int(r['steady_after_iters'])} calls)"
        mfu = format_percent(r["mfu"])
        if mfu != MISSING and pd.notna(r["datasheet_device"]):
            mfu += f" of {r['datasheet_device']}"
        mfu_title = (
            f"achieved / datasheet peak {format_sig(r['datasheet_peak_tflops'], 'TFLOP/s')}"
            if pd.notna(r["datasheet_peak_tflops"])
            else ""
        )
        ceiling_title = "" if pd.isna(r["ceiling_probe_id"]) else f"probe {r['ceiling_probe_id']}"
        if pd.notna(r["ceiling_tflops"]):
            ceiling = f"measured ceiling {format_sig(r['ceiling_tflops'], 'TFLOP/s')}"
            ceiling_title = f"{ceiling}, {ceiling_title}" if ceiling_title else ceiling
        memory = format_mib(r["peak_memory_bytes"])
        if memory != MISSING and pd.notna(r["memory_kind"]):
            memory += f" ({r['memory_kind']})"
        warnings = []
        for column, what in (("nonfinite_steps", "non-finite step"), ("scaler_skips", "GradScaler skip")):
            if pd.notna(r[column]) and r[column] != 0:
                warnings.append(f"{int(r[column])} {what}{'s' if r[column] != 1 else ''}")
        if pd.notna(r["window_throughput"]) and pd.notna(r["throughput"]) and r["throughput"] > 0:
            gap = 1 - r["window_throughput"] / r["throughput"]
            if gap > STALL_GAP:
                warnings.append(f"window {gap:.0%} below the median's throughput: gaps or stalls")
        if r["launch_bound"] is True:
            warnings.append("launch-bound: measures the host, not the GPU")
        if r["thin"] is True:
            warnings.append(THIN_NOTE)
        if pd.notna(r["energy_window_s"]) and r["energy_window_s"] < 5:
            warnings.append(f"energy over {r['energy_window_s']:.2g} s: rough")
        out.append(
            {
                "run_id": r["run_id"],
                "cell_label": _text(r["cell_label"]),
                "median": format_ms(r["median_ms"]),
                "repeats": int(r["repeats"]),
                "phases": [format_ms(r[p.column]) for p in PHASES],
                "remainder": remainder,
                "remainder_bad": bad,
                "first": format_ms(r["first_ms"]),
                "steady": steady,
                "gflops": format_sig(None if pd.isna(r["flops"]) else r["flops"] / 1e9),
                "tflops": format_sig(r["achieved_tflops"]),
                "mfu": mfu,
                "mfu_title": mfu_title,
                "ceiling": format_percent(r["ceiling_utilization"]),
                "ceiling_title": ceiling_title,
                "memory": memory,
                "optimizer_state": format_mib(r["optimizer_state_bytes"]),
                "energy": format_sig(r["energy_per_step_j"]),
                "samples_per_joule": format_sig(r["samples_per_joule"]),
                "warnings": warnings,
            }
        )
    return out


def _caching(df: pd.DataFrame) -> list[dict]:
    """Live vs cached teacher of the same cell and run: the saving per step and when caching pays back."""
    out = []
    for r in caching_pairs(df).to_dict("records"):
        saving = r["teacher_cache_saving_ms"]
        if pd.notna(r["teacher_cache_payback_steps"]):
            payback = format_int(r["teacher_cache_payback_steps"])
        elif saving <= 0:
            payback = "never (cached is not faster)"
        else:
            payback = MISSING
        out.append(
            {
                "run_id": r["run_id"],
                "cell_label": _text(r["cell_label"]),
                "cached_label": _text(r["cached_label"]),
                "live": format_ms(r["median_ms_live"]),
                "cached": format_ms(r["median_ms_cached"]),
                "saving_ms": format_ms(saving),
                "saving_pct": f"{saving / r['median_ms_live'] * 100:.1f} %" if r["median_ms_live"] > 0 else MISSING,
                "one_off": format_ms(r["teacher_cache_ms"]),
                "payback": payback,
            }
        )
    return out


def trace_link(trace_file: str, out_dir: str | Path) -> tuple[str, str]:
    """(href, text) of the link to a trace from the report folder.

    The text is the path relative to the report folder (forward slashes); the href is
    that path percent-encoded, so that no stored path can become another URL scheme
    (``javascript:``), a fragment or a query.  Both are HTML-escaped by the template.
    """
    try:
        rel = os.path.relpath(trace_file, out_dir)
    except ValueError:  # another drive (Windows): keep the path as it is
        rel = trace_file
    rel = rel.replace(os.sep, "/")
    return quote(rel, safe="/"), rel


def _top_ops(df: pd.DataFrame, out_dir: Path) -> list[dict]:
    """Per traced ok distill_step cell: its top operators by self time, and the link to its trace."""
    out = []
    for r in latest_steps(df).to_dict("records"):
        if pd.isna(r["top_ops"]):
            continue
        try:
            ops = json.loads(r["top_ops"])
            rows = [
                {"op": str(o["op"]), "ms": format_ms(o.get("self_ms_per_call")), "count": format_int(o.get("count"))}
                for o in ops
            ]
            error = ""
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            rows, error = [], f"unreadable top_ops ({type(exc).__name__})"
        href, text = (None, None) if pd.isna(r["trace_file"]) else trace_link(str(r["trace_file"]), out_dir)
        out.append(
            {
                "run_id": r["run_id"],
                "cell_label": _text(r["cell_label"]),
                "ops": rows,
                "error": error,
                "href": href,
                "trace": text,
            }
        )
    return out


def _quality(df: pd.DataFrame) -> list[dict]:
    return [
        {
            "teacher": _text(r["teacher"]),
            "student": _text(r["student"]),
            "role": _text(r["quality_role"]),
            "method": _text(r["method"]),
            "datasets": r["datasets"] or MISSING,
            "accuracy": mean_std(r["accuracy_mean"], r["accuracy_std"], 100),
            "agreement": mean_std(r["agreement_mean"], r["agreement_std"], 100),
            "time_to_target": mean_std(r["time_to_target_mean_s"], r["time_to_target_std_s"], fmt=format_ms),
            "text": bool(pd.notna(r["perplexity_mean"])),  # a language model on text: perplexity, bits per byte
            "perplexity": mean_std(r["perplexity_mean"], r["perplexity_std"], fmt=lambda v: f"{v:.3f}"),
            "bits_per_byte": mean_std(r["bits_per_byte_mean"], r["bits_per_byte_std"], fmt=lambda v: f"{v:.3f}"),
            "train_time": mean_std(r["train_time_mean_s"], None, fmt=format_ms),
            "reached": f"{r['reached']}/{r['n']} reached",
            "seeds": r["n"],
            "failed": r["failed"],
        }
        for r in summarize_quality(df).to_dict("records")
    ]
