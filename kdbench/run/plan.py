"""A run's plan: the suite's cells as jobs (one share with ``--shard``; the quality block as one more job), checked
before anything runs (budgets that match nothing), the precisions this machine runs far slower than fp32,
said before the first job (and skipped with ``slow_precisions: skip``), the cells this environment cannot run (a
package they need is missing, with its install line: :func:`environment_skips`), and the cells whose models this
machine's host memory cannot hold, skipped with the figure (:func:`host_skips`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from kdbench.config.plan import Cell
from kdbench.config.plan import shard as shard_cells
from kdbench.config.schema import Suite
from kdbench.core.errors import KdbenchError
from kdbench.hw.backends import Backend, detect
from kdbench.measure.rows import CELL_BUDGET_S
from kdbench.run.jobs import CellJob, Job, QualityJob
from kdbench.workloads import expand_checked, planned_measurements, workload_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    cells: list[Cell]  # the whole plan (every rank and shard sees the same)
    jobs: list[Job]  # what this invocation runs: its share of the cells, then the quality job
    job_ids: tuple[str, ...] = ()  # every job of the whole plan (all shards): what a complete run stores
    shard: tuple[int, int] | None = None
    skipped: dict[str, str] = field(default_factory=dict)  # job id -> why it is stored as skipped, not run


def plan_jobs(suite: Suite, shard: tuple[int, int] | None = None, backend_name: str = "cpu") -> Plan:
    """The suite's jobs; KdbenchError for anything that cannot run (checked before anything does).
    ``backend_name`` is where it will run (the budgets' ``where`` may name backend-dependent columns)."""
    cells = expand_checked(suite)
    share = shard_cells(cells, *shard) if shard else cells
    # Repeats are interleaved in rounds, as asv's `rounds`: every cell once, then every cell again, each
    # round in fresh worker processes, so a repeat sees a new process (and the machine at another time).
    n = suite.repeat
    jobs: list[Job] = [CellJob(c, r, n) for r in range(1, n + 1) for c in share]
    every = [CellJob(c, r, n).job_id for r in range(1, n + 1) for c in cells]
    check_budgets(suite, cells, backend_name)
    if suite.quality is not None:
        from kdbench.quality.protocol import check_quality

        try:
            check_quality(suite.quality, [c.config for c in cells])
        except KdbenchError as exc:
            raise suite.error(("quality",), str(exc)) from None
        quality = QualityJob.of(suite.quality, cells, suite.allow_imports)
        every.append(quality.job_id)
        if shard is None or shard[0] == 1:
            jobs.append(quality)
    return Plan(cells, jobs, tuple(every), shard)


def planned_backend(suite: Suite, device: str | None) -> str:
    """The backend name a run will use (``--device``, else the suite's), without touching the device."""
    requested = device or suite.backend
    return detect().best if requested == "auto" else requested


def check_budgets(suite: Suite, cells: list[Cell], backend_name: str = "cpu") -> None:
    """A budget that no planned measurement matches is a mistake in the suite (a typo in ``where``, a batch
    size the cells do not measure): say so before anything runs."""
    if not suite.budgets:
        return
    import pandas as pd

    from kdbench.config.budgets import select
    from kdbench.run.jobs import config_columns

    planned = pd.DataFrame(
        [
            {**config_columns(c.config, backend_name), "backend": backend_name, "measurement": str(m), "batch_size": bs}
            for c in cells
            for m, bs in planned_measurements(c.config)
        ]
    )
    for i, budget in enumerate(suite.budgets):
        known = {k: v for k, v in budget.where.items() if k in planned}  # backend, autocast...: known after the run
        if select(planned, budget.model_copy(update={"where": known})).empty:
            raise suite.error(
                ("budgets", i),
                f"'{budget.describe()}' matches no measurement of the plan; check its measurement, batch_size "
                "(a step's is the cell's batch_size, inference's are inference.batch_sizes) and where",
            )


def warn_slow_cells(plan: Plan, backend: Backend, probes_dir: Path, threads: int | None, skip: bool = False) -> dict:
    """One line per precision of the plan measured to run far slower than fp32 here (:mod:`kdbench.hw.speed`:
    the newest probe, a cached or a quick measurement), before anything runs; {precision: Slowdown}."""
    from kdbench.hw.speed import slow_precisions, warning_line

    cells = [j.cell for j in plan.jobs if isinstance(j, CellJob) and j.repeat == 1]
    used = [p for c in cells for p in (c.config.precision, c.config.teacher_precision)]
    slow = slow_precisions(used, backend, probes_dir, threads=threads)
    from kdbench.hw.speed import MEASURED_BUSY

    for precision, slowdown in slow.items():
        mine = [c for c in cells if precision in (c.config.precision, c.config.teacher_precision)]
        if skip and slowdown.source == MEASURED_BUSY:
            then = f"measured on a busy machine, so its {len(mine)} cell(s) are measured, not skipped on that figure"
        elif skip:
            then = f"its {len(mine)} cell(s) are skipped (slow_precisions: skip)"
        else:
            budget = mine[0].config.timing.cell_budget_s or CELL_BUDGET_S.get(backend.name)
            bound = f"each within its {budget:g} s time budget" if budget else "no time budget bounds them"
            then = f"{len(mine)} cell(s) use it, {bound} (timing.cell_budget_s; `slow_precisions: skip` skips them)"
        logger.warning("%s; %s", warning_line(slowdown), then)
    return slow


def slow_skip(job: Job, slow: dict) -> str | None:
    """Why ``job`` is skipped under ``slow_precisions: skip`` (None: it runs)."""
    from kdbench.hw.speed import skip_reason_for_slow

    if not isinstance(job, CellJob):
        return None
    from kdbench.hw.speed import MEASURED_BUSY

    c = job.cell.config
    trusted = {p: s for p, s in slow.items() if s.source != MEASURED_BUSY}  # a busy moment's figure skips nothing
    precision = next((p for p in (c.precision, c.teacher_precision) if p in trusted), None)
    return skip_reason_for_slow(precision, trusted[precision]) if precision else None


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of this machine's memory, as psutil reads them (swap not counted)."""
    import psutil

    memory = psutil.virtual_memory()
    return int(memory.available), int(memory.total)


def ranks_on_node(world_size: int, nnodes: int, alloc=None) -> int:
    """How many of a cell's ranks run on this node: kdbench's own launcher starts ``world_size / nnodes`` per node;
    in an outer allocation, the ranks 0..world_size-1 it has on this node (``LOCAL_WORLD_SIZE``, or srun's
    ``SLURM_NTASKS_PER_NODE``; unknown: all of them)."""
    import os

    if world_size == 1:
        return 1
    if alloc is None:
        return max(world_size // nnodes, 1)
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    return min(world_size, int(local)) if local.isdigit() else world_size


def host_refusal(config, device_type: str, ranks: int, available: int, total: int) -> str | None:
    """Why a cell is not run here: its models need more host memory on this node (its ``ranks`` ranks here, rank 0
    among them) than ``available`` (None: it fits, or cannot be counted before the run)."""
    from kdbench.workloads.placement import gib

    footprint = workload_of(config).host_footprint(config, device_type)
    need = footprint.node_bytes(ranks)
    if need is None or need <= available:
        return None
    here = f"{ranks} ranks on this node: " if ranks > 1 else ""
    return (
        f"the cell's models need {gib(need)} of host memory ({here}{footprint.summary(config.world_size)}) and this "
        f"machine has {gib(available)} available of {gib(total)}: it would swap or be killed; {footprint.fix} "
        f"(counted: {footprint.details()})"
    )


def host_skips(plan: Plan, device_type: str, nnodes: int = 1, alloc=None) -> dict[str, str]:
    """job id -> why, for each cell whose models the host cannot hold (:func:`host_refusal`), before anything
    runs: stored as skipped rather than swapping or being killed part-way."""
    available, total = host_memory()
    skipped = {}
    for job in plan.jobs:
        if isinstance(job, CellJob):
            c = job.cell.config
            why = host_refusal(c, device_type, ranks_on_node(c.world_size, nnodes, alloc), available, total)
            if why:
                skipped[job.job_id] = why
    return skipped


def environment_skips(plan: Plan, backend: Backend) -> dict[str, str]:
    """job id -> why, for each cell this environment cannot run (:func:`kdbench.run.cell.cell_skip`: a package it
    needs is missing, with the line that installs it; a lever or precision this device lacks), before anything
    runs: said at the start and by ``--dry-run``, and stored as skipped without a worker."""
    from kdbench.run.cell import cell_skip

    reasons: dict[str, str] = {}  # cell id -> why (a repeat round's cells are the same cells)
    skipped = {}
    for job in plan.jobs:
        if isinstance(job, CellJob):
            cell = job.cell
            if cell.cell_id not in reasons:
                reasons[cell.cell_id] = cell_skip(cell.config, backend) or ""
            if reasons[cell.cell_id]:
                skipped[job.job_id] = reasons[cell.cell_id]
    return skipped


def warn_cell_notes(plan: Plan) -> dict[str, list[int]]:
    """What the cells' workloads say of a choice the user may not have meant (a uld cell on a shared tokenizer),
    each note said once before anything runs with the numbers of its cells; returned by note."""
    by_note: dict[str, list[int]] = {}
    for job in plan.jobs:
        if isinstance(job, CellJob) and job.repeat == 1:
            for note in workload_of(job.cell.config).plan_notes(job.cell.config):
                by_note.setdefault(note, []).append(job.cell.index + 1)
    for note, numbers in by_note.items():
        cells = f"cell {numbers[0]}" if len(numbers) == 1 else f"{len(numbers)} cells ({', '.join(map(str, numbers))})"
        logger.warning("note: %s: %s", cells, note)
    return by_note


def warn_environment_skips(plan: Plan, backend: Backend) -> dict[str, str]:
    """:func:`environment_skips`, each reason said once before anything runs with the cells it skips (their numbers,
    as ``--dry-run`` prints them)."""
    skipped = environment_skips(plan, backend)
    by_reason: dict[str, list[int]] = {}
    for job in plan.jobs:
        if isinstance(job, CellJob) and job.repeat == 1 and job.job_id in skipped:
            by_reason.setdefault(skipped[job.job_id], []).append(job.cell.index + 1)
    rows = _served_rows_skipped(plan, skipped)
    for why, numbers in [*by_reason.items(), *rows.items()]:
        cells = f"cell {numbers[0]}" if len(numbers) == 1 else f"{len(numbers)} cells ({', '.join(map(str, numbers))})"
        what = "" if why in by_reason else "'s student_inference rows (inference.runtime onnxruntime)"
        logger.warning("skipped here: %s%s: %s", cells, what, why)
    return skipped


def _served_rows_skipped(plan: Plan, skipped: dict[str, str]) -> dict[str, list[int]]:
    """why -> the numbers of the cells (not skipped whole) whose serving rows a missing package skips here: ONNX
    Runtime for ``inference.runtime: onnxruntime`` (the cell's other rows run)."""
    from kdbench.measure.onnx import onnxruntime_missing

    served = [
        j.cell.index + 1
        for j in plan.jobs
        if isinstance(j, CellJob)
        and j.repeat == 1
        and j.job_id not in skipped
        and j.cell.config.inference.runtime == "onnxruntime"
    ]
    why = onnxruntime_missing() if served else None
    return {why: served} if why else {}
