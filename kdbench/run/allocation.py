"""Running inside an allocation that already started one kdbench per rank.

``torchrun --nproc-per-node 4 -m kdbench run SUITE`` or ``srun --ntasks 8 kdbench run
SUITE`` starts the CLI once per rank.  Then kdbench launches no ranks itself: the
ranks join one process group and rank 0 runs the same engine as any run
(:func:`kdbench.run.engine.run_suite`: resume, progress, profiling, the quality block),
with :class:`AllocationWorkers` as its workers.  Before each job rank 0 tells the
other ranks which one it is (:func:`follow`): a cell with ``world_size: N`` runs
data-parallel on ranks 0..N-1 (a subgroup) while the others wait, any other job runs
on rank 0 in its isolated worker process, and rank 0 stores every row.  A cell asking
for more ranks than the allocation has is stored as ``skipped``.  A rank that dies
ends the whole allocation (that is how torchrun and srun work); ``--resume`` picks up.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from kdbench.config.plan import Cell
from kdbench.core.errors import KdbenchError
from kdbench.core.names import Status
from kdbench.measure.failures import error_text, status_of
from kdbench.run.jobs import CellJob, Job, WorkerContext, failure_rows
from kdbench.run.workers import STARTUP_TIMEOUT_S, JobResult, WorkerSetup, context

logger = logging.getLogger(__name__)

DEFAULT_PORT = "29500"
_STOP = None


@dataclass(frozen=True)
class Allocation:
    rank: int
    world_size: int
    local_rank: int
    source: str  # "torchrun" or "slurm"


def detect_allocation(environ: Mapping[str, str] | None = None) -> Allocation | None:
    """The allocation this process is a rank of, or None for a plain single-process run."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env):
        alloc = Allocation(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")), "torchrun")
    elif "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_STEP_ID" in env:
        if "MASTER_ADDR" not in env:
            raise KdbenchError(
                "running under srun with several tasks needs MASTER_ADDR (the first node's host name): "
                "export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)"
            )
        alloc = Allocation(
            int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", "0")), "slurm"
        )
    else:
        return None
    return alloc if alloc.world_size > 1 else None


def export_env(alloc: Allocation) -> None:
    """The env:// rendezvous variables torch.distributed reads, for srun as for torchrun."""
    os.environ.setdefault("MASTER_PORT", DEFAULT_PORT)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(alloc.rank), str(alloc.world_size)
    os.environ["LOCAL_RANK"] = str(alloc.local_rank)


def subgroups(alloc: Allocation, cells: list[Cell]) -> dict[int, Any]:
    """A process group of ranks 0..N-1 for each world size N of the plan smaller than the allocation.

    ``new_group`` is collective: every rank creates every subgroup, in the same order,
    from the same plan."""
    sizes = sorted({c.config.world_size for c in cells if 1 < c.config.world_size < alloc.world_size})
    return {n: dist.new_group(list(range(n))) for n in sizes}


def group_timeout_s(cell_timeout_s: float) -> float:
    """How long a rank waits in a collective: the other ranks may be running a whole job on rank 0
    (a worker that first has to start, then the job's time-out, then being stopped)."""
    return cell_timeout_s + STARTUP_TIMEOUT_S + 120


def _data_parallel_cell(cell: Cell, ctx: WorkerContext, groups: dict[int, Any]):
    """This rank's part of a data-parallel cell: the cell's rows on rank 0, None elsewhere."""
    from kdbench.measure.parallel import DataParallel
    from kdbench.run.cell import measure_cell

    return measure_cell(cell, ctx.backend, ctx.cache, ctx.options, dp=DataParallel(groups.get(cell.config.world_size)))


class AllocationWorkers:
    """Rank 0's workers: each job announced to every rank, data-parallel cells run on the ranks they need."""

    def __init__(self, alloc: Allocation, setup: WorkerSetup, single: Any, groups: dict[int, Any]):
        self.alloc, self.single, self.groups = alloc, single, groups
        self.ctx = context(setup)  # data-parallel cells run in this process, as on the other ranks
        self.in_step = False  # between announcing a job and the barrier after it

    def run(self, job: Job, timeout_s: float | None) -> JobResult:
        self.in_step = True
        dist.broadcast_object_list([job.cell_id], src=0)
        start = time.perf_counter()
        ws = job.world_size
        if ws > self.alloc.world_size:
            why = f"world_size {ws} exceeds this allocation's {self.alloc.world_size} ranks"
            result = JobResult(failure_rows(job, Status.SKIPPED, why), 0.0)
        elif ws > 1 and isinstance(job, CellJob):
            try:
                rows = _data_parallel_cell(job.cell, self.ctx, self.groups)
                result = JobResult(rows or [], time.perf_counter() - start)
            except Exception as exc:
                # A rank failed inside the cell's collectives (this one, or another that then left the group):
                # the ranks no longer agree on where they are, so the cell is stored as failed and the run
                # stops; `--resume` goes on after it.
                status = Status.TIMEOUT if "timed out" in str(exc).lower() else status_of(exc)
                rows = failure_rows(job, status, error_text(exc))
                result = JobResult(rows, time.perf_counter() - start, fatal=error_text(exc))
                return result  # no barrier: the other ranks are not where this one is
        else:
            result = self.single.run(job, timeout_s)
        dist.barrier()
        self.in_step = False
        return result

    def fresh(self) -> None:  # the ranks' own processes live as long as the allocation
        self.single.fresh()

    @property
    def isolated(self) -> bool:
        return self.single.isolated

    def close(self) -> None:
        try:
            if not self.in_step:  # interrupted inside a job, the other ranks are not listening: torchrun ends them
                dist.broadcast_object_list([_STOP], src=0)
        finally:
            self.single.close()


def follow(alloc: Allocation, setup: WorkerSetup, cells: list[Cell], groups: dict[int, Any]) -> None:
    """A rank other than 0: take part in each data-parallel cell rank 0 announces, until it says stop."""
    by_id = {c.cell_id: c for c in cells}
    ctx = context(setup)
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0)
        if message[0] is _STOP:
            return
        cell = by_id.get(message[0])  # the quality job is not a cell: nothing to do here
        if cell is not None and 1 < cell.config.world_size <= alloc.world_size and alloc.rank < cell.config.world_size:
            try:
                _data_parallel_cell(cell, ctx, groups)
            except Exception as exc:
                # Leave the group: rank 0's collectives then fail too, and it stores the cell as failed.
                logger.error(
                    "rank %d: %s failed: %s; leaving the run to rank 0", alloc.rank, cell.label, error_text(exc)
                )
                return
        dist.barrier()
