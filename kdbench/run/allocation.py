"""Running inside an allocation that already started one kdbench per rank.

``torchrun --nproc-per-node 4 -m kdbench run SUITE`` or ``srun --ntasks 8 kdbench run
SUITE`` starts the CLI once per rank.  Then kdbench launches nothing itself: the
ranks join one process group, rank 0 plans (and resumes) and says which cells
to do, a cell with ``world_size: N`` runs data-parallel on ranks 0..N-1 (a
subgroup) while the others wait, a ``world_size: 1`` cell runs on rank 0 in its
isolated worker process, and rank 0 stores every row.  A cell asking for more
ranks than the allocation has is stored as ``skipped``.  A rank that dies ends
the whole allocation (that is how torchrun and srun work); ``--resume`` picks up.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from kdbench.config.plan import Cell, dist_backend_for
from kdbench.config.schema import Suite
from kdbench.errors import KdbenchError
from kdbench.hw.backends import Backend
from kdbench.run.workers import InlineWorker, ProcessWorker, rows_for

DEFAULT_PORT = "29500"


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


def _init(alloc: Allocation, backend_name: str, timeout_s: float) -> Backend:
    """Join the allocation's process group (env:// rendezvous) on this rank's device."""
    os.environ.setdefault("MASTER_PORT", DEFAULT_PORT)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(alloc.rank), str(alloc.world_size)
    os.environ["LOCAL_RANK"] = str(alloc.local_rank)
    if backend_name == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", alloc.local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(dist_backend_for(backend_name), timeout=timedelta(seconds=timeout_s))
    return Backend(name=backend_name, device=device)


def run_allocated(
    suite: Suite,
    cells: list[Cell],
    backend_name: str,
    out_dir: Path,
    threads: int,
    *,
    alloc: Allocation,
    resume: bool,
    inline: bool,
    cell_timeout_s: float | None,
    log: Callable[[str], None] = print,
):
    """Every rank calls this with the same plan; rank 0 returns the RunOutcome, the others None."""
    from kdbench.run.engine import Recorder, open_run
    from kdbench.run.rank import measure_rank

    timeout = cell_timeout_s if cell_timeout_s is not None else suite.cell_timeout_s
    backend = _init(alloc, backend_name, timeout + 600)
    torch.set_num_threads(threads)
    try:
        shared: list = [None]
        if alloc.rank == 0:
            outcome, todo = open_run(suite, cells, out_dir, resume, log)
            shared = [[c.index for c in todo]]
        dist.broadcast_object_list(shared, src=0)
        by_index = {c.index: c for c in cells}
        todo = [by_index[i] for i in shared[0]]
        # new_group is collective: every rank creates every subgroup, in the same order.
        groups = {
            n: dist.new_group(list(range(n)))
            for n in sorted({c.config.world_size for c in todo})
            if 1 < n < alloc.world_size
        }
        if alloc.rank == 0:
            recorder = Recorder(suite, backend, outcome, len(todo), log)
            log(
                f"run {outcome.run_id}: {len(todo)} cells of suite '{suite.name}' on {backend.name}, "
                f"{alloc.world_size} ranks of a {alloc.source} allocation -> {outcome.path}"
            )
            worker = (InlineWorker if inline else ProcessWorker)(backend, suite.allow_imports, threads)
        for cell in todo:
            ws = cell.config.world_size
            rows = None
            if ws > alloc.world_size:
                if alloc.rank == 0:
                    rows = rows_for(
                        cell, "skipped", f"world_size {ws} exceeds this allocation's {alloc.world_size} ranks"
                    )
            elif ws == 1:
                if alloc.rank == 0:
                    rows = worker.measure(cell, timeout)
            elif alloc.rank < ws:
                rows = measure_rank(cell, backend, suite.allow_imports, group=groups.get(ws))
            if alloc.rank == 0:
                recorder.record(cell, rows or [])
            dist.barrier()
        if alloc.rank == 0:
            worker.close()
            return outcome
        return None
    finally:
        dist.destroy_process_group()
