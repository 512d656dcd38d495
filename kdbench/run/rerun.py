"""Measuring the undecided cells of a comparison again (``compare --rerun-undecided N``): one more repeat of each
given cell on each side that can be measured here, as one round of each side's run in a fresh worker process (as a
run's rounds are), BASE and NEW one after the other (the side measured first alternating from round to round),
each job stored as a new part (``part-<cell>-r<k>``) of the side's own run folder, with its own invocation
record (which plans just those jobs, so the run stays complete).  The statistics of the sequence are
:class:`kdbench.report.compare.compare.Sequential`'s.

A side is measured here only when it can be: a run folder (not a bare file) whose suite file is here and still
plans the cell, measured on this host with this torch.  Its repeats then use the suite file as it is now and the
software this process runs: a BASE measured from other code (another commit, an uncommitted edit) must not be
measured again here as it is, which ``--rerun-sides new`` says, or is measured again from that code, which
``--base-code DIR`` gives (a checkout of BASE's commit: DIR comes first on the worker's import path).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kdbench.config.schema import Suite
from kdbench.core.errors import KdbenchError
from kdbench.store.results import MANIFEST, RunFolder, parse_job_id

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RerunSide:
    name: str  # "BASE" or "NEW"
    folder: RunFolder
    suite: Suite
    device: str | None = None  # the backend its rows recorded
    code: Path | None = None  # where its repeats import their code from first (--base-code); None: as this process


def why_not(name: str, path: Path, rows) -> str | None:
    """Why side ``name`` (its path and stored rows) cannot be measured again here; None when it can."""
    import torch

    folder = RunFolder(Path(path))
    if not (folder.path / MANIFEST).is_file():
        return f"{name} {path} is not a run folder (a file, or a folder of several runs): give its run folder"
    suite_file = folder.manifest().get("suite_file")
    if not suite_file or not Path(suite_file).is_file():
        return f"{name}'s suite file {suite_file!r} is not here"
    for column, here in (("hostname", socket.gethostname()), ("torch_version", torch.__version__)):
        if column in rows:
            there = set(rows[column].dropna().astype(str))
            if there and there != {str(here)}:
                return f"{name} was measured with {column} {', '.join(sorted(there))}, this machine has {here}"
    return None


def side(name: str, path: Path, rows, code: str | Path | None = None) -> RerunSide:
    """The side, ready to measure again: its suite as stored, at the thread count its rows recorded, and its code
    from ``code`` first (a folder; KdbenchError when it is not one)."""
    from kdbench.config import load_suite, with_overrides

    folder = RunFolder(Path(path))
    suite = load_suite(folder.manifest()["suite_file"])
    threads = rows["cpu_threads"].dropna() if "cpu_threads" in rows else []
    if len(threads):
        suite = with_overrides(suite, {"threads": ("recorded cpu_threads", int(threads.iloc[-1]))})
    backends = rows["backend"].dropna() if "backend" in rows else []
    if code is not None and not Path(code).is_dir():
        raise KdbenchError(f"--base-code {code}: not a folder; give a checkout of the commit {name} was measured from")
    where = Path(code).resolve() if code is not None else None
    return RerunSide(name, folder, suite, str(backends.iloc[-1]) if len(backends) else None, where)


@contextlib.contextmanager
def code_first(code: Path | None) -> Iterator[None]:
    """``code`` first on the import path of the workers started meanwhile: on ``sys.path`` (a ``spawn`` worker
    starts from its parent's) and in ``PYTHONPATH`` (a rank torchrun starts); both as they were afterwards."""
    if code is None:
        yield
        return
    path, env = list(sys.path), os.environ.get("PYTHONPATH")
    sys.path.insert(0, str(code))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(code), *([env] if env else [])])
    try:
        yield
    finally:
        sys.path[:] = path
        if env is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env


def measure_again(sides: list[RerunSide], cell_ids: list[str], round_: int) -> int:
    """One more repeat of each of ``cell_ids`` on each side: a round of the side's run, in a fresh worker process
    (as a run's rounds are), the sides one after the other, the side measured first alternating by round (BASE
    first in odd rounds), so that neither side has the machine's later state to itself.  The number of jobs
    stored."""
    from kdbench.run.engine import RunOptions, run_suite
    from kdbench.run.jobs import CellJob
    from kdbench.run.plan import Plan, plan_jobs, planned_backend

    order = sides if round_ % 2 else list(reversed(sides))
    stored = 0
    for s in order:
        plan = plan_jobs(s.suite, None, planned_backend(s.suite, s.device))
        cells = {c.cell_id: c for c in plan.cells}
        repeats = {}
        for cell, r in map(parse_job_id, s.folder.stored_job_ids()):
            repeats[cell] = max(repeats.get(cell, 0), r)
        jobs = []
        for cell_id in cell_ids:
            if cell_id not in cells:
                raise KdbenchError(
                    f"--rerun-undecided: {s.name}'s suite file {s.suite.path} no longer plans cell {cell_id}; "
                    "it changed since the run: pass --rerun-sides new, or compare without --rerun-undecided"
                )
            k = repeats.get(cell_id, 0) + 1
            jobs.append(CellJob(cells[cell_id], k, k))
        logger.info("measuring again (round %d): %d cell(s) of %s", round_, len(jobs), s.name)
        options = RunOptions(out_dir=s.folder.path.parent, device=s.device, run_id=s.folder.run_id)
        with code_first(s.code):
            outcome = run_suite(s.suite, options, Plan(plan.cells, jobs, tuple(j.job_id for j in jobs)))
        if outcome.interrupted:
            raise KeyboardInterrupt
        stored += outcome.jobs
    return stored
