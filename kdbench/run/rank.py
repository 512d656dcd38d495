"""One rank of a data-parallel cell; started by torchrun (``python -m kdbench.run.rank CELL ROWS``).

Every rank builds the same teacher and student (same seed), wraps the student in
DistributedDataParallel (the teacher stays a plain frozen module), and steps on
its own batch (seed + rank).  The ranks agree on one iteration count before timing
(DDP needs every rank to make the same collective calls), time each iteration
locally, then gather the samples: each iteration counts at its slowest rank.
Rank 0 also measures inference, on its own device, and writes the cell's rows.

Any exception ends the rank with a non-zero code; torchrun then stops the other
ranks, and the parent records the cell as failed with the error lines.
"""

from __future__ import annotations

import math
import os
import pickle
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

from kdbench.config.plan import Cell, dist_backend_for
from kdbench.config.schema import CellConfig
from kdbench.distill.step import DistillStep
from kdbench.hw.backends import Backend
from kdbench.hw.data import synthetic_batch
from kdbench.measure.cell import ModelCache, distill_row, measure_inference, model_pair, step_flops
from kdbench.measure.flops import MemoryMeter, memory_columns, optimizer_state_bytes
from kdbench.measure.timing import timed_loop
from kdbench.models import count_params
from kdbench.run.workers import die_with_parent


def _agreed_iterations(step: DistillStep, config: CellConfig, backend: Backend, group: Any) -> tuple[int, float]:
    """Cold call + warm-up + one probe call; every rank takes the largest count any rank needs."""
    t = config.timing
    probe = timed_loop(step, backend.clock(), warmup=t.warmup, min_iters=1, min_time_s=0.0, max_iters=1)
    wanted = max(t.min_iters, math.ceil(t.min_time_s * 1e3 / max(probe.samples_ms[0], 1e-6)))
    agreed = torch.tensor([min(wanted, t.max_iters), probe.first_ms], dtype=torch.float64, device=backend.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return int(agreed[0].item()), float(agreed[1].item())


def measure_rank(cell: Cell, backend: Backend, allow_imports: bool, group: Any = None) -> list[dict[str, Any]] | None:
    """This rank's part of a data-parallel cell over `group` (default: all ranks); rows on its rank 0."""
    config = cell.config
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    teacher, student = model_pair(config, backend, ModelCache(allow_imports=allow_imports))
    params = {"student_params": count_params(student), "teacher_params": count_params(teacher)}

    def wrap(trainee: torch.nn.Module) -> torch.nn.Module:  # the student and its adapters
        return DistributedDataParallel(
            trainee,
            device_ids=[backend.device] if backend.device_type == "cuda" else None,
            bucket_cap_mb=config.ddp.bucket_cap_mb,
            gradient_as_bucket_view=config.ddp.gradient_as_bucket_view,
            static_graph=config.ddp.static_graph,
            process_group=group,
        )

    x, y = synthetic_batch(config, config.batch_size, backend.device, config.seed + rank)
    step = DistillStep(teacher, student, x, y, config, backend, wrap=wrap)
    iters, first_ms = _agreed_iterations(step, config, backend, group)
    with MemoryMeter(backend) as memory:
        raw = timed_loop(step, backend.clock(), warmup=0, min_iters=iters, min_time_s=0.0, max_iters=iters)
    flops = step_flops(step)  # every rank: the counted step runs DDP's collectives
    mine = torch.tensor(raw.samples_ms, dtype=torch.float64, device=backend.device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    slowest = torch.stack(everyone).max(dim=0).values.tolist()
    loss = torch.tensor([float(step.last_loss)], dtype=torch.float64, device=backend.device)
    dist.all_reduce(loss, group=group)  # mean loss over ranks
    rows = None
    if rank == 0:
        raw = type(raw)(first_ms=first_ms, samples_ms=slowest, clock=raw.clock)
        row = distill_row(step, raw, config, x, float(loss.item()) / world)
        row.update(
            memory_columns(memory.result()), **flops, optimizer_state_bytes=optimizer_state_bytes(step.optimizer)
        )
        rows = [row]
        for bs in config.inference.batch_sizes:  # rank 0 alone, on its own device; the others wait
            srow = measure_inference(student, "student", bs, config, backend)
            rows.append(srow)
            if config.inference.teacher:
                trow = measure_inference(teacher, "teacher", bs, config, backend)
                rows.append(trow)
                srow["speedup_vs_teacher"] = trow["median_ms"] / srow["median_ms"]
        for row in rows:
            row.update(params)
    dist.barrier(group=group)
    return rows


@record
def main(argv: list[str]) -> int:
    die_with_parent()  # if torchrun dies, so does this rank
    cell_file, rows_file = map(Path, argv)
    job = pickle.loads(cell_file.read_bytes())
    cell: Cell = job["cell"]
    local_rank = int(os.environ["LOCAL_RANK"])
    if job["backend"] == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = Backend(name=job["backend"], device=device)
    torch.set_num_threads(job["threads"])
    dist.init_process_group(dist_backend_for(backend.name), timeout=timedelta(seconds=job["timeout_s"]))
    try:
        rows = measure_rank(cell, backend, job["allow_imports"])
    finally:
        dist.destroy_process_group()
    if rows is not None:
        tmp = rows_file.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(rows))
        os.replace(tmp, rows_file)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
