"""Result rows as files other tools read: ``kdbench export``.

* ``csv``: every row and column (schema order first), for spreadsheets and any CSV reader;
  lists (``samples_ms``) as JSON arrays, timestamps ISO 8601, floats written exactly.
* ``json``: the same rows as a JSON array of objects (null for missing values), for scripts
  and tools that want typed values and real arrays.
* ``pytest-benchmark``: the JSON file pytest-benchmark saves, one benchmark per ok timing row
  (times in seconds, statistics recomputed from the samples as pytest-benchmark computes
  them), so ``pytest-benchmark compare`` and the dashboards built on its files show kdbench
  runs beside pytest-benchmark ones.  One machine's rows per file, as pytest-benchmark keeps them.

Torch-free, like the rest of the report side.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import statistics
from bisect import bisect_left, bisect_right
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from kdbench.core.errors import KdbenchError
from kdbench.core.names import SERVING, TIMED, Status
from kdbench.core.schema import COLUMN_NAMES, COLUMNS
from kdbench.store.files import write_text

FORMATS = ("csv", "json", "pytest-benchmark")
PYTEST_BENCHMARK_VERSION = "5.3.1"  # the file layout written (unchanged since 3.1 but for extra keys)
TIMINGS = TIMED
_INT_COLUMNS = frozenset(c.name for c in COLUMNS if pa.types.is_integer(c.type))
_MACHINE = re.compile(r"^([^-]+)-(.+?)-(x86_64|aarch64|arm64|AMD64|ppc64le|s390x|riscv64|i[3-6]86)(?:-|$)")
_ENV_KEYS = ("device_name", "device_arch", "device_arch_full", "device_count", "device_memory_bytes", "backend")
_ENV_KEYS += ("driver_version", "torch_version", "cuda_version", "hip_version", "cudnn_version", "kdbench_version")


def _py(value: Any, column: str = "") -> Any:
    """A value as plain JSON data: None for NaN/NA/NaT, ISO 8601 for timestamps, lists for arrays."""
    if isinstance(value, (np.ndarray, list, tuple)):
        return [_py(v) for v in value]
    if value is None or value is pd.NA or value is pd.NaT:
        return None
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        if column in _INT_COLUMNS and value.is_integer():
            return int(value)  # an integer column that pandas made float for its nulls
    return value


def _columns(df: pd.DataFrame) -> list[str]:
    return [c for c in COLUMN_NAMES if c in df.columns] + [c for c in df.columns if c not in COLUMN_NAMES]


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    columns = _columns(df)
    return [{c: _py(v, c) for c, v in zip(columns, row, strict=True)} for row in df[columns].itertuples(index=False)]


def _csv(df: pd.DataFrame) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(_columns(df))
    for record in _records(df):  # str(float) is the shortest exact repr; None is an empty field
        writer.writerow(json.dumps(v) if isinstance(v, list) else v for v in record.values())
    return buf.getvalue()


def _stats(data: list[float]) -> dict[str, Any]:
    """pytest-benchmark's statistics of ``data`` (seconds), computed as pytest_benchmark.stats.Stats does.

    ``ld15iqr`` / ``hd15iqr`` are the lowest / highest datum within the Tukey fences (Q1 - 1.5 IQR,
    Q3 + 1.5 IQR; a datum on a fence is within), as pytest-benchmark computes them since 5.3.1 (the
    version these files declare).  Releases before 5.3.1 returned the first datum *above* the upper
    fence as ``hd15iqr`` when there was one (their ``ld15iqr`` was already this one)."""
    n, s = len(data), sorted(data)
    if n == 1:
        q1 = q3 = s[0]
    elif n % 2:  # its "method 3" quartiles for odd counts
        k = n // 4
        if n % 4 == 1:
            q1, q3 = 0.25 * s[k - 1] + 0.75 * s[k], 0.75 * s[3 * k] + 0.25 * s[3 * k + 1]
        else:
            q1, q3 = 0.75 * s[k] + 0.25 * s[k + 1], 0.25 * s[3 * k + 1] + 0.75 * s[3 * k + 2]
    else:  # "method 2": medians of the halves
        q1, q3 = statistics.median(s[: n // 2]), statistics.median(s[n // 2 :])
    mean, iqr, total = statistics.mean(data), q3 - q1, sum(data)
    stddev = statistics.stdev(data) if n > 1 else 0
    lo, hi = q1 - 1.5 * iqr, q3 + 1.5 * iqr
    std_out = sum(1 for v in data if v < mean - stddev or v > mean + stddev)
    iqr_out = sum(1 for v in data if v < lo or v > hi)
    return {
        "min": s[0],
        "max": s[-1],
        "mean": mean,
        "stddev": stddev,
        "rounds": n,
        "median": statistics.median(data),
        "iqr": iqr,
        "q1": q1,
        "q3": q3,
        "iqr_outliers": iqr_out,
        "stddev_outliers": std_out,
        "outliers": f"{std_out};{iqr_out}",
        "ld15iqr": s[0] if n == 1 else s[bisect_left(s, lo)],
        "hd15iqr": s[0] if n == 1 else s[bisect_right(s, hi) - 1],
        "ops": n / total if total else 0,
        "total": total,
        "data": data,
        "iterations": 1,  # each sample is one call
    }


def _timing_rows(df: pd.DataFrame) -> pd.DataFrame:
    key = df.reindex(columns=["status", "measurement", "samples_ms"])
    has_samples = key["samples_ms"].map(lambda v: isinstance(v, (list, tuple, np.ndarray)) and len(v) > 0)
    rows = df[key["status"].eq(Status.OK) & key["measurement"].isin(TIMINGS) & has_samples]
    if rows.empty:
        raise KdbenchError(
            "no ok timing rows with samples (distill_step, student_inference, teacher_inference) to export as "
            "pytest-benchmark; pick a run that measured something"
        )
    pairs = rows.reindex(columns=["hostname", "device_name"]).drop_duplicates().itertuples(index=False)
    machines = sorted(f"{_py(host) or 'unknown host'} ({_py(device) or 'unknown device'})" for host, device in pairs)
    if len(machines) > 1:
        raise KdbenchError(
            f"the rows come from {len(machines)} machines ({', '.join(machines)}); pytest-benchmark files hold one "
            "machine's run: export one machine's run at a time"
        )
    return rows


def _benchmarks(rows: pd.DataFrame) -> list[dict[str, Any]]:
    records = _records(rows)
    for r in records:
        label = r.get("cell_label") or r.get("cell_id")
        bs = f" bs{r.get('batch_size')}" if r["measurement"] in SERVING else ""
        repeat = f" #{r['repeat']}" if (r.get("repeat") or 0) > 1 else ""
        r["param_"] = f"{label}{bs}{repeat}"
    names: dict[str, set] = {}
    for r in records:  # two cells with one label: tell them apart by cell id
        names.setdefault(f"{r['measurement']}[{r['param_']}]", set()).add(r.get("cell_id"))
    out, seen = [], set()
    for r in records:
        param = r["param_"]
        if len(names[f"{r['measurement']}[{param}]"]) > 1:
            param = f"{param} {str(r.get('cell_id'))[:8]}"
        name = f"{r['measurement']}[{param}]"
        if name in seen:
            raise KdbenchError(f"{name} is in more than one run of these results; export one run at a time")
        seen.add(name)
        keys = ("cell_id", "run_id", "batch_size", "precision", "device_name", "backend")
        params = {k: r.get(k) for k in keys}
        more = ("cell_label", "teacher", "student", "method", "world_size", "timer", "median_ms", "throughput")
        out.append(
            {
                "group": r["measurement"],
                "name": name,
                "fullname": f"kdbench::{r.get('suite')}::{name}",
                "params": params,
                "param": param,
                "extra_info": {**params, **{k: r.get(k) for k in (*more, "noisy")}},
                "options": {
                    "disable_gc": None,
                    "timer": r.get("timer"),
                    "min_rounds": r.get("min_iters"),
                    "max_time": None,
                    "min_time": r.get("min_time_s"),
                    "precision": None,
                    "warmup": r.get("warmup"),
                },
                "stats": _stats([ms / 1000 for ms in r["samples_ms"] if ms is not None]),
            }
        )
    return out


def _machine_info(row: dict[str, Any]) -> dict[str, Any]:
    match = _MACHINE.match(row.get("os") or "")
    machine = row.get("device_arch") if row.get("backend") == "cpu" else (match and match.group(3))
    return {
        "node": row.get("hostname"),
        "processor": row.get("cpu_model"),
        "machine": machine,
        "python_compiler": None,
        "python_implementation": None,
        "python_implementation_version": None,
        "python_version": row.get("python_version"),
        "python_build": None,
        "release": match and match.group(2),
        "system": match.group(1) if match else (row.get("os") or "").split("-")[0] or None,
        "cpu": {"brand_raw": row.get("cpu_model"), "count": row.get("cpu_count"), "arch_string_raw": machine},
        "os": row.get("os"),
        **{k: row.get(k) for k in _ENV_KEYS},
    }


def _pytest_benchmark(df: pd.DataFrame) -> str:
    rows = _timing_rows(df)
    ordered = rows.sort_values("timestamp", na_position="first", kind="stable") if "timestamp" in rows else rows
    last = _records(ordered.tail(1))[0]  # the newest row: its environment and time stand for the file's
    commits = sorted({c for c in rows.get("git_commit", pd.Series(dtype=object)).dropna()})
    doc = {
        "machine_info": _machine_info(last),
        "commit_info": {
            "id": ",".join(commits) or "unversioned",
            "time": None,
            "author_time": None,
            "dirty": False,
            "project": "kdbench",
            "branch": "(unknown)",
        },
        "benchmarks": _benchmarks(rows),
        "datetime": last.get("timestamp") or datetime.now(UTC).isoformat(),
        "version": PYTEST_BENCHMARK_VERSION,
    }
    return json.dumps(doc, indent=4, allow_nan=False) + "\n"


def export(df: pd.DataFrame, fmt: str) -> str:
    """The rows of ``df`` (as :func:`kdbench.store.read_results` returns them) as the text of a ``fmt`` file."""
    if fmt == "csv":
        return _csv(df)
    if fmt == "json":
        return json.dumps(_records(df), indent=1, allow_nan=False) + "\n"
    if fmt == "pytest-benchmark":
        return _pytest_benchmark(df)
    raise KdbenchError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")


def write_export(df: pd.DataFrame, fmt: str, out: Path | None = None) -> str:
    """:func:`export`'s text, also written to ``out`` (atomically) when given."""
    text = export(df, fmt)
    if out is not None:
        write_text(text, Path(out))
    return text
