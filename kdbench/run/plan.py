"""A run's plan: the suite's cells as jobs (one share with ``--shard``; the quality block as one more job), checked
before anything runs (budgets that match nothing), and the precisions this machine runs far slower than fp32,
said before the first job (and skipped with ``slow_precisions: skip``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from kdbench.config.plan import Cell
from kdbench.config.plan import shard as shard_cells
from kdbench.config.schema import Suite
from kdbench.errors import KdbenchError
from kdbench.hw.backends import Backend, detect
from kdbench.measure.rows import CELL_BUDGET_S
from kdbench.run.jobs import CellJob, Job, QualityJob
from kdbench.workloads import expand_checked, planned_measurements

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
    for precision, slowdown in slow.items():
        mine = [c for c in cells if precision in (c.config.precision, c.config.teacher_precision)]
        if skip:
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
    c = job.cell.config
    precision = next((p for p in (c.precision, c.teacher_precision) if p in slow), None)
    return skip_reason_for_slow(precision, slow[precision]) if precision else None
