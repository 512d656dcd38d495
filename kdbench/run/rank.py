"""One rank of a data-parallel cell, started by torchrun: ``python -m kdbench.run.rank JOB ROWS``.

Every rank joins the process group and runs the same cell measurement a single-device
worker runs (:func:`kdbench.run.cell.measure_cell` with a
:class:`~kdbench.measure.parallel.DataParallel`); rank 0 writes the cell's rows to
ROWS.  Any exception ends the rank with a non-zero code; torchrun then stops the other
ranks, and the parent stores the cell as failed with the error lines, or as ``oom`` when a
rank ran out of device memory (it leaves its error in :func:`oom_file` first).
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from kdbench.hw.backends import Backend, device_of, dist_backend_for
from kdbench.store.files import write_atomic


def oom_file(rows_file: Path) -> Path:
    """Where a rank that ran out of device memory leaves its error, beside ROWS: the parent then stores the cell as
    ``oom`` (the pair does not fit at this sharding), not as failed."""
    return rows_file.with_suffix(".oom")


def join_process_group(backend_name: str, local_rank: int, timeout_s: float) -> Backend:
    """This rank's backend on its device (the GPU of its local rank), in the env:// process group."""
    device = device_of(backend_name, local_rank)
    kwargs = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # NCCL/RCCL bind to it at once (torch >= 2.3), not at the first collective
    dist.init_process_group(dist_backend_for(backend_name), timeout=timedelta(seconds=timeout_s), **kwargs)
    return Backend(name=backend_name, device=device)


@record
def main(argv: list[str]) -> int:
    from kdbench.measure.parallel import DataParallel
    from kdbench.run.cell import measure_cell
    from kdbench.run.jobs import WorkerContext
    from kdbench.run.process import die_with_parent

    die_with_parent()  # if torchrun dies, so does this rank
    spec_file, rows_file = map(Path, argv)
    spec = pickle.loads(spec_file.read_bytes())
    job, setup = spec["job"], spec["setup"]
    logging.basicConfig(level=setup.log_level, format="%(message)s")  # into torchrun's output (the parent's log file)
    torch.set_num_threads(setup.threads)
    backend = join_process_group(setup.backend.name, int(os.environ["LOCAL_RANK"]), spec["timeout_s"])
    try:
        ctx = WorkerContext(backend, setup.options, setup.allow_imports)
        rows = measure_cell(job.cell, backend, ctx.cache, setup.options, dp=DataParallel())
    except Exception as exc:
        from kdbench.measure.failures import error_text, is_oom

        if is_oom(exc):  # the device's or the host's allocator (a CPU RuntimeError too)
            text = f"rank {os.environ.get('RANK', '?')}: {error_text(exc)}"
            write_atomic(oom_file(rows_file), lambda tmp: Path(tmp).write_text(text))
        raise
    finally:
        dist.destroy_process_group()
    if rows is not None:
        write_atomic(rows_file, lambda tmp: Path(tmp).write_bytes(pickle.dumps(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
