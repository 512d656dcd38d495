"""Walk a plan: hand each cell to the worker, stamp and store its rows at once, show progress.

The runner never measures (workers do: kdbench.run.workers).  It owns the run id, the
thread count, the result file, resuming, and the progress lines.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from kdbench.config.plan import Cell, config_columns
from kdbench.config.schema import Suite
from kdbench.hw.backends import Backend, detect
from kdbench.hw.environment import capture
from kdbench.measure.cell import MeasureOptions
from kdbench.measure.flops import latest_ceiling, utilization_columns
from kdbench.run.workers import InlineWorker, ProcessWorker, TorchrunWorker
from kdbench.store.schema import PROBES_DIR, SCHEMA_VERSION, ResultWriter, read_table

FAILURES = ("failed", "oom", "timeout")  # statuses that make `run` exit with 1


@dataclass
class RunOutcome:
    run_id: str
    path: Path
    cells: int = 0
    rows: int = 0
    failed: list[str] = field(default_factory=list)  # labels of cells with a failed/oom/timeout row
    interrupted: bool = False


def new_run_id(suite_name: str, now: datetime | None = None) -> str:
    """`<suite>-<UTC time>-<random>`: sortable, and unique even for two runs started together."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", suite_name).strip("-.")[:60] or "suite"
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")
    return f"{slug}-{stamp}-{uuid.uuid4().hex[:8]}"


def _fmt_s(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def summary_line(rows: list[dict[str, Any]]) -> str:
    """The main figures of a finished cell, for its progress line."""
    parts = []
    bad = [r for r in rows if r["status"] != "ok"]
    if bad and len({(r["status"], r.get("error")) for r in bad}) == 1 and len(bad) == len(rows):
        return f"{bad[0]['status'].upper()}: {(bad[0].get('error') or '')[:200]}"
    quality = [r for r in rows if r["measurement"] == "quality"]
    if quality:
        failed = sum(r["status"] != "ok" for r in quality)
        return f"{len(quality)} quality rows" + (f", {failed} FAILED" if failed else "")
    for row in rows:
        m = row["measurement"]
        if row["status"] != "ok":
            parts.append(f"{m}@{row['batch_size']} {row['status'].upper()}: {(row.get('error') or '')[:120]}")
        elif m == "distill_step":
            noisy = " NOISY" if row["noisy"] else ""
            parts.append(
                f"step {row['median_ms']:.3g} ms ±{row['rel_iqr']:.0%}{noisy} ({row['throughput']:.0f} samples/s)"
            )
        elif m == "student_inference" and row.get("speedup_vs_teacher"):
            parts.append(
                f"student@{row['batch_size']} {row['median_ms']:.3g} ms ({row['speedup_vs_teacher']:.1f}x teacher)"
            )
    return "; ".join(parts)


def scaling_efficiency(rows: list[dict[str, Any]]) -> bool:
    """Fill `scaling_efficiency` of world_size > 1 distill_step rows whose world_size 1 twin
    (the same config but for world_size) is in the run; True if any value changed."""

    def key(row: dict[str, Any]) -> str:
        config = json.loads(row["config_json"])
        config.pop("world_size")
        return json.dumps(config, sort_keys=True)

    steps = [r for r in rows if r["measurement"] == "distill_step" and r["status"] == "ok" and r.get("config_json")]
    single = {key(r): r["throughput"] for r in steps if r["world_size"] == 1}
    changed = False
    for r in steps:
        base = single.get(key(r)) if r["world_size"] > 1 else None
        value = r["throughput"] / (r["world_size"] * base) if base else None
        if value != r.get("scaling_efficiency"):
            r["scaling_efficiency"] = value
            changed = True
    return changed


def find_resumable(out_dir: Path, suite_name: str) -> tuple[Path | None, set[str]]:
    """The newest result file of this suite in `out_dir`, and the cell ids stored in any of them."""
    newest: Path | None = None
    done: set[str] = set()
    for path in sorted(Path(out_dir).glob("*.parquet"), key=lambda p: p.stat().st_mtime):
        try:
            table = read_table(path, columns=["suite", "cell_id"])
        except Exception:  # not a kdbench file: not ours to resume
            continue
        ids = {
            cid
            for s, cid in zip(table.column("suite").to_pylist(), table.column("cell_id").to_pylist())
            if s == suite_name
        }
        if ids:
            done |= ids
            newest = path
    return newest, done


def run_plan(
    suite: Suite,
    cells: list[Cell],
    backend: Backend,
    out_dir: Path,
    threads: int,
    *,
    resume: bool = False,
    inline: bool = False,
    cell_timeout_s: float | None = None,
    profile: bool = False,
    log: Callable[[str], None] = print,
) -> RunOutcome:
    """Measure every cell (with `resume`, every cell not yet stored in `out_dir`) and append each
    cell's rows to the run's parquet file as soon as it finishes."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # recorded by capture() below; the worker sets its own
    try:
        return _run(suite, cells, backend, out_dir, threads, resume, inline, cell_timeout_s, profile, log)
    finally:
        torch.set_num_threads(before)


class Recorder:
    """Stamps a cell's rows with identity, config and environment, appends them, prints progress."""

    def __init__(self, suite: Suite, backend: Backend, outcome: RunOutcome, total: int, log: Callable[[str], None]):
        self.suite, self.backend, self.outcome, self.total, self.log = suite, backend, outcome, total, log
        self.env = capture(backend)
        self.ceiling = latest_ceiling(outcome.path.parent / PROBES_DIR, self.env["device_name"], backend.name)
        self.writer: ResultWriter | None = None  # the file appears with the first stored cell
        self.started = time.monotonic()
        self.seen = 0

    def record(self, cell: Cell, rows: list[dict[str, Any]], label: str | None = None) -> None:
        self.seen += 1
        label = label or cell.label
        head = f"[{self.seen}/{self.total}] {label}"
        if not rows:
            self.log(f"{head}: measured with the other nodes; the node that ran global rank 0 stores its rows")
            return
        identity = {
            "schema_version": SCHEMA_VERSION,
            "run_id": self.outcome.run_id,
            "suite": self.suite.name,
            "suite_file": str(self.suite.path),
            "cell_id": cell.cell_id,
            "cell_label": label,
            "backend": self.backend.name,
            "device": str(self.backend.device),
            **config_columns(cell.config, self.backend.name),
            **self.env,
        }
        for row in rows:
            if row.get("status") == "ok":
                row.update(
                    utilization_columns(
                        row.get("flops"),
                        row.get("median_ms"),
                        self.env["device_name"],
                        cell.config.precision,
                        self.ceiling,
                    )
                )
        now = datetime.now(UTC)
        if self.writer is None:
            self.writer = ResultWriter(self.outcome.path)
        self.writer.append([{**identity, "timestamp": now, **row} for row in rows])
        self.writer.update(scaling_efficiency)
        self.outcome.cells += 1
        self.outcome.rows += len(rows)
        if any(r["status"] in FAILURES for r in rows):
            self.outcome.failed.append(label)
        elapsed = time.monotonic() - self.started
        left = elapsed / self.seen * (self.total - self.seen)
        self.log(f"{head}: {summary_line(rows)}  | {_fmt_s(elapsed)} elapsed, ~{_fmt_s(left)} left")


def open_run(
    suite: Suite, cells: list[Cell], out_dir: Path, resume: bool, log: Callable[[str], None]
) -> tuple[RunOutcome, list[Cell]]:
    """The run's id and file (a new one, or with `resume` the newest of this suite) and the cells to do."""
    previous, done = find_resumable(out_dir, suite.name) if resume else (None, set())
    if previous is not None:
        outcome = RunOutcome(run_id=previous.stem, path=previous)
    else:
        if resume:
            log(f"nothing of suite '{suite.name}' in {out_dir} to resume; starting a new run")
        run_id = new_run_id(suite.name)
        outcome = RunOutcome(run_id=run_id, path=Path(out_dir) / f"{run_id}.parquet")
    todo = [c for c in cells if c.cell_id not in done]
    if previous is not None:
        log(
            f"resuming run {outcome.run_id}: {len(cells) - len(todo)} of {len(cells)} cells already stored, "
            f"{len(todo)} to go"
        )
    return outcome, todo


def _run(
    suite: Suite,
    cells: list[Cell],
    backend: Backend,
    out_dir: Path,
    threads: int,
    resume: bool,
    inline: bool,
    cell_timeout_s: float | None,
    profile: bool,
    log: Callable[[str], None],
) -> RunOutcome:
    outcome, todo = open_run(suite, cells, out_dir, resume, log)
    recorder = Recorder(suite, backend, outcome, len(todo), log)
    log(
        f"run {outcome.run_id}: {len(todo)} cells of suite '{suite.name}' on {backend.name} "
        f"({recorder.env['device_name']}), {threads} CPU threads -> {outcome.path}"
    )
    if not todo:
        return outcome
    if recorder.ceiling:
        log(f"utilisation against this device's measured ceiling: probe {recorder.ceiling['probe_id']}")
    else:
        log(
            f"no probe of this device in {Path(out_dir) / PROBES_DIR}: run `kdbench probe` for utilisation "
            "against its measured ceiling"
        )
    options = MeasureOptions(trace_dir=str(Path(out_dir) / "traces" / outcome.run_id) if profile else None)
    if options.trace_dir:
        log(f"profiler traces -> {options.trace_dir}")
    worker_cls = InlineWorker if inline else ProcessWorker
    worker = worker_cls(backend, suite.allow_imports, threads, options)
    ddp_worker = TorchrunWorker(
        backend, suite.allow_imports, threads, gpu_count=detect().gpu_count, launcher=suite.launcher
    )
    timeout = cell_timeout_s if cell_timeout_s is not None else suite.cell_timeout_s
    try:
        for cell in todo:
            recorder.record(cell, (ddp_worker if cell.config.world_size > 1 else worker).measure(cell, timeout))
    except KeyboardInterrupt:
        outcome.interrupted = True
    finally:
        worker.close()
    return outcome


def quality_cell(suite: Suite, cells: list[Cell]) -> Cell | None:
    """The suite's quality run as one unit of the plan: stored, resumed and reported like a cell.

    Its config is the first planned cell's; its id hashes the quality settings and the
    (teacher, student, method) jobs, so a rerun of the same suite finds it again.
    """
    if suite.quality is None:
        return None
    from kdbench.quality.protocol import quality_jobs

    jobs = [j.config for j in quality_jobs(c.config for c in cells)]
    key = json.dumps(
        {
            "quality": suite.quality.model_dump(mode="json"),
            "jobs": sorted(c.cell_id for c in cells if c.config in jobs),
        },
        sort_keys=True,
    )
    cid = "quality-" + hashlib.sha256(key.encode()).hexdigest()[:12]
    return Cell(index=len(cells), cell_id=cid, config=jobs[0])


def run_quality_cell(
    suite: Suite,
    cells: list[Cell],
    backend: Backend,
    out_dir: Path,
    threads: int,
    resume: bool,
    log: Callable[[str], None] = print,
) -> RunOutcome | None:
    """Run the suite's quality block (in this process) into the newest run file of the suite;
    None when the suite has none. With `resume`, nothing happens if it is stored already."""
    qcell = quality_cell(suite, cells)
    if qcell is None:
        return None
    from kdbench.quality.protocol import markdown_table, quality_jobs, run_quality, summarize_quality

    outcome, todo = open_run(suite, [qcell], out_dir, True, lambda _m: None)
    if not todo:
        log(f"quality: already stored in {outcome.path}")
        return outcome
    q = suite.quality
    jobs = quality_jobs(c.config for c in cells)
    log(
        f"quality on {q.dataset}: {q.seeds} seed(s) x {len(jobs)} distillation(s), {q.epochs} epochs each, "
        f"target {q.target:g} x the teacher's accuracy"
    )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = run_quality(q, jobs, backend, log=lambda m: log(f"  {m}"), allow_imports=suite.allow_imports)
    except KeyboardInterrupt:
        outcome.interrupted = True
        return outcome
    finally:
        torch.set_num_threads(before)
    recorder = Recorder(suite, backend, outcome, 1, log)
    recorder.record(qcell, rows, label=f"quality ({q.dataset}, {q.seeds} seeds)")
    import pandas as pd

    log(markdown_table(summarize_quality(pd.DataFrame([r for r in rows if r["status"] == "ok"]))))
    return outcome
