"""The HTML report: one self-contained page plus the PNG charts beside it.

The page is rendered by jinja2 with autoescaping on, so every string that comes from a
suite or a result (labels, errors, host names...) is HTML-escaped.  File names in the
output folder are fixed (``index.html``, ``distill_step.png``, ...), never built from
result strings.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from jinja2 import Environment, FileSystemLoader

from kdbench.errors import KdbenchError
from kdbench.report.plots import NOISY_NOTE, draw_charts
from kdbench.store import COLUMN_NAMES

MISSING = "—"
ERROR_CHARS = 200
_STATUS_ORDER = ("ok", "failed", "oom", "skipped")
_MEASUREMENT_ORDER = {"distill_step": 0, "student_inference": 1, "teacher_inference": 2}
ENV_COLUMNS = (
    "device_name", "device_arch", "device_count", "backend", "driver_version", "torch_version",
    "torchvision_version", "cuda_version", "hip_version", "cudnn_version", "cpu_model", "cpu_threads",
    "cpu_count", "hostname", "os", "python_version", "kdbench_version", "git_commit", "cudnn_benchmark",
    "blas_library", "env_knobs",
)

_TEMPLATES = Environment(
    loader=FileSystemLoader(Path(__file__).parent / "templates"),
    autoescape=True,
    trim_blocks=True,
    lstrip_blocks=True,
)


def render_report(df: pd.DataFrame, out_dir: str | Path, title: str | None = None) -> Path:
    """Write ``index.html`` and its charts into ``out_dir`` (created if needed); return the page's path.

    ``df`` holds result rows as :func:`kdbench.store.read_results` returns them; columns
    it lacks are treated as null.  ``title`` defaults to the suites' names.
    """
    if df.empty:
        raise KdbenchError("no measurements to report: the results are empty; run `kdbench run SUITE` first")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise KdbenchError(f"{out_dir} is a file; give a folder for the report")
    out_dir.mkdir(parents=True, exist_ok=True)
    df = df.reindex(columns=list(dict.fromkeys([*COLUMN_NAMES, *df.columns]))).reset_index(drop=True)
    df["run_id"] = df["run_id"].fillna("?")
    suites = sorted(df["suite"].dropna().unique())
    page = _TEMPLATES.get_template("index.html.j2").render(
        title=title or ("kdbench — " + ", ".join(suites) if suites else "kdbench report"),
        runs=_runs(df),
        n_cells=df["cell_id"].nunique(),
        n_rows=len(df),
        status_counts=_status_counts(df),
        charts=draw_charts(df, out_dir),
        measurements=_measurements(df),
        environments=_environments(df),
        noisy_note=NOISY_NOTE,
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


def _runs(df: pd.DataFrame) -> list[dict]:
    return [
        {
            "run_id": run_id,
            "suite": _values(rows["suite"]),
            "first": _timestamp(rows["timestamp"].min()),
            "last": _timestamp(rows["timestamp"].max()),
            "hostname": _values(rows["hostname"]),
            "device_name": _values(rows["device_name"]),
            "backend": _values(rows["backend"]),
            "n_rows": len(rows),
        }
        for run_id, rows in df.groupby("run_id", sort=True)
    ]


def _status_counts(df: pd.DataFrame) -> dict[str, int]:
    counts = df["status"].fillna("unknown").value_counts()
    order = [s for s in _STATUS_ORDER if s in counts] + sorted(set(counts.index) - set(_STATUS_ORDER))
    return {s: int(counts[s]) for s in order}


def _measurements(df: pd.DataFrame) -> list[dict]:
    """Every row, formatted for the table, ordered by run, cell, measurement and batch size."""
    df = df.assign(order_=df["measurement"].map(_MEASUREMENT_ORDER), noisy_=df["noisy"].eq(True))
    df = df.sort_values(["run_id", "cell_label", "order_", "batch_size"], na_position="last")
    return [
        {
            "run_id": r.run_id,
            "cell_label": _text(r.cell_label),
            "measurement": _text(r.measurement),
            "status": _text(r.status),
            "ok": r.status == "ok",
            "batch_size": format_int(r.batch_size),
            "precision": _text(r.precision),
            "median": format_ms(r.median_ms),
            "iqr": format_ms(r.iqr_ms),
            "p05_p95": MISSING if pd.isna(r.p05_ms) or pd.isna(r.p95_ms)
            else f"{format_ms(r.p05_ms)} – {format_ms(r.p95_ms)}",
            "n": format_int(r.n),
            "throughput": format_int(r.throughput),
            "speedup": format_speedup(r.speedup_vs_teacher),
            "noisy": bool(r.noisy_),
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
