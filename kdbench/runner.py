"""Walk a plan: hand each cell to the worker, stamp and store its rows at once, show progress.

The runner never measures.  It owns the run id, the thread count, the result file
and the progress lines.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

from kdbench.backends import Backend
from kdbench.environment import capture
from kdbench.plan import Cell, config_columns
from kdbench.store import SCHEMA_VERSION, ResultWriter
from kdbench.suite import Suite
from kdbench.worker import ModelCache, measure_cell


@dataclass
class RunOutcome:
    run_id: str
    path: Path
    cells: int = 0
    rows: int = 0
    failed: list[str] = field(default_factory=list)  # labels of cells with a failed/oom row
    interrupted: bool = False


def new_run_id(suite_name: str, now: datetime | None = None) -> str:
    """`<suite>-<UTC time>-<random>`: sortable, and unique even for two runs started together."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", suite_name).strip("-.")[:60] or "suite"
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    return f"{slug}-{stamp}-{uuid.uuid4().hex[:8]}"


def _fmt_s(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def summary_line(rows: list[dict[str, Any]]) -> str:
    """The main figures of a finished cell, for its progress line."""
    parts = []
    for row in rows:
        m = row["measurement"]
        if row["status"] != "ok":
            parts.append(f"{m}@{row['batch_size']} {row['status'].upper()}: {row.get('error', '')[:120]}")
        elif m == "distill_step":
            noisy = " NOISY" if row["noisy"] else ""
            parts.append(f"step {row['median_ms']:.3g} ms ±{row['rel_iqr']:.0%}{noisy} ({row['throughput']:.0f} samples/s)")
        elif m == "student_inference" and row.get("speedup_vs_teacher"):
            parts.append(f"student@{row['batch_size']} {row['median_ms']:.3g} ms ({row['speedup_vs_teacher']:.1f}x teacher)")
    return "; ".join(parts)


def run_plan(
    suite: Suite,
    cells: list[Cell],
    backend: Backend,
    out_dir: Path,
    threads: int,
    log: Callable[[str], None] = print,
) -> RunOutcome:
    """Measure every cell and append its rows to `out_dir/<run_id>.parquet` as soon as it finishes."""
    torch.set_num_threads(threads)
    run_id = new_run_id(suite.name)
    outcome = RunOutcome(run_id=run_id, path=Path(out_dir) / f"{run_id}.parquet")
    writer = ResultWriter(outcome.path)
    env = capture(backend)
    cache = ModelCache(allow_imports=suite.allow_imports)
    log(f"run {run_id}: {len(cells)} cells of suite '{suite.name}' on {backend.name} "
        f"({env['device_name']}), {threads} CPU threads -> {outcome.path}")
    started = time.monotonic()
    try:
        for i, cell in enumerate(cells, 1):
            rows = measure_cell(cell, backend, cache)
            identity = {
                "schema_version": SCHEMA_VERSION,
                "run_id": run_id,
                "suite": suite.name,
                "suite_file": str(suite.path),
                "cell_id": cell.cell_id,
                "cell_label": cell.label,
                "backend": backend.name,
                "device": str(backend.device),
                **config_columns(cell.config),
                **env,
            }
            now = datetime.now(timezone.utc)
            writer.append([{**identity, "timestamp": now, **row} for row in rows])
            outcome.cells += 1
            outcome.rows += len(rows)
            if any(r["status"] in ("failed", "oom") for r in rows):
                outcome.failed.append(cell.label)
            elapsed = time.monotonic() - started
            left = elapsed / i * (len(cells) - i)
            log(f"[{i}/{len(cells)}] {cell.label}: {summary_line(rows)}  | {_fmt_s(elapsed)} elapsed, ~{_fmt_s(left)} left")
    except KeyboardInterrupt:
        outcome.interrupted = True
    return outcome
