"""The one run engine: a suite's jobs, through workers, into a run folder.

:func:`run_suite` is the whole orchestration, the same for a plain run and inside a
torchrun/srun allocation:

1. plan: the suite's cells (one share of them with ``--shard``) as jobs, and the
   quality block as one more job (in share 1);
2. open the run folder (a new one, the newest of the suite with ``--resume``, or a
   named one with ``--run-id``) and skip the jobs whose part is stored;
3. hand each job to a worker (:mod:`kdbench.run.workers`; inside an allocation
   :mod:`kdbench.run.allocation`) under the job time-out;
4. stamp its rows with identity, config, environment and the probe's ceiling, store
   them as the job's part, and log a progress line.

The engine never measures: workers do.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from kdbench.config.schema import Suite
from kdbench.core.errors import KdbenchError
from kdbench.core.names import FAILURES, Measurement, Status
from kdbench.core.schema import SCHEMA_VERSION, Row
from kdbench.hw.backends import Backend, detect, resolve, thread_count
from kdbench.hw.contention import RUN_PID_ENV, HostLoad, HostMeter, busy_warning, look_later
from kdbench.measure.step import MeasureOptions
from kdbench.measure.walltime import per_job
from kdbench.run.jobs import CellJob, Job, QualityJob, failure_rows
from kdbench.run.plan import (
    Plan,
    host_skips,
    plan_jobs,
    planned_backend,
    slow_skip,
    warn_cell_notes,
    warn_environment_skips,
    warn_slow_cells,
)
from kdbench.run.progress import JobTiming, Progress, WallSplit
from kdbench.store.probes import ceiling_columns, latest_ceiling
from kdbench.store.results import PROBES_DIR, TRACES_DIR, Invocation, RunFolder, newest_run, open_run
from kdbench.workloads.base import restate_served_precision

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunOptions:
    """How to run a suite, beyond what the suite itself says (its settings carry the command-line
    overrides of threads, time-out, imports and profiling: :func:`kdbench.config.with_overrides`)."""

    out_dir: Path = Path("results")
    device: str | None = None  # overrides the suite's backend
    resume: bool = False  # continue the newest run of the suite in out_dir
    run_id: str | None = None  # run into out_dir/run_id, continuing it when it exists (shards share one)
    shard: tuple[int, int] | None = None  # (I, N): share I of N of the plan
    inline: bool = False  # run jobs in this process (no isolation)
    # The run's options as the run folder records them, so that a continued run keeps them (kdbench.run.resume):
    # written into the manifest of a new folder and into this invocation's record.  None: not recorded.
    record: dict[str, Any] | None = None


@dataclass
class RunOutcome:
    run_id: str
    path: Path  # the run folder
    jobs: int = 0  # jobs stored by this invocation
    rows: int = 0
    failed: list[str] = field(default_factory=list)  # labels of jobs with a failed/oom/timeout row
    interrupted: bool = False
    follower: bool = False  # a rank other than 0 of an allocation: rank 0 stores and reports
    aborted: str | None = None  # why the run stopped before its last job (its failure is stored)
    timed_rows: int = 0  # rows stored by this invocation that say whether they were contended
    steps: list[dict] = field(default_factory=list)  # its ok, not contended distill_step rows' config and median
    contended: list[float] = field(default_factory=list)  # host_busy_share of each contended one
    quality: bool = False  # the quality job ran (and stored its rows) in this invocation
    timings: list[JobTiming] = field(default_factory=list)
    wall: dict[str, float] = field(default_factory=dict)  # WallSplit.finish() of this invocation
    stored_jobs: list[str] = field(default_factory=list)  # ids of the jobs this invocation stored
    split: WallSplit | None = None  # open until close()
    invocation: Invocation | None = None  # this invocation's record in the run folder

    def spent(self, category: str, seconds: float) -> None:
        """Count time spent after the jobs (rendering the report, checking budgets) into the split."""
        if self.split is not None:
            self.split.add(category, seconds)

    def close(self) -> None:
        """End the wall-time split (printed, and kept in this invocation's record) and the record: which jobs
        it stored and how it ended.  Call it once, after whatever follows the jobs (report, budgets)."""
        if self.split is None:
            return
        split, self.split = self.split, None
        if self.timings:
            self.wall = split.finish()
            logger.info("%s%s", WallSplit.line(self.wall), per_job(self.wall, len(self.timings)))
        if self.invocation is not None:
            self.invocation.finish(
                stored=self.stored_jobs,
                interrupted=self.interrupted,
                aborted=self.aborted,
                wall_time=self.wall or None,
            )


def resolve_backend(suite: Suite, options: RunOptions) -> Backend:
    requested = options.device or suite.backend
    try:
        return resolve(requested)
    except KdbenchError as exc:
        raise KdbenchError(f"{suite.path}: backend {requested}: {exc}") from None


def run_suite(
    suite: Suite, options: RunOptions = RunOptions(), plan: Plan | None = None, close: bool = True
) -> RunOutcome:
    """Run every job of the suite (of ``plan``, when the caller has it) not stored yet; every job's rows
    are stored as soon as it finishes.  With ``close=False`` the outcome's wall-time split and
    invocation record stay open for the caller's own work after the jobs (``outcome.close()``)."""
    plan = plan or plan_jobs(suite, options.shard, planned_backend(suite, options.device))
    backend = resolve_backend(suite, options)
    threads = suite.threads or torch.get_num_threads()
    from kdbench.run.allocation import detect_allocation

    alloc = detect_allocation()
    os.environ.setdefault(RUN_PID_ENV, str(os.getpid()))  # the run's process tree: this engine and what it starts
    look = None
    if alloc is None or alloc.rank == 0:  # measured once, where the engine runs
        look = HostMeter(threads if backend.device_type == "cpu" else 1)
        look.start()  # ended before the first cell: is the machine busy?
        warn_cell_notes(plan)  # a choice the user may not have meant (uld on one tokenizer)
        slow = warn_slow_cells(plan, backend, options.out_dir / PROBES_DIR, threads, suite.slow_precisions == "skip")
        if suite.slow_precisions == "skip":
            plan = replace(plan, skipped={j.job_id: why for j in plan.jobs if (why := slow_skip(j, slow))})
        held = host_skips(plan, backend.device_type, suite.launcher.nnodes, alloc)  # the host cannot hold them
        if held:
            for why in dict.fromkeys(held.values()):
                logger.warning("skipped: %s", why)
            plan = replace(plan, skipped={**held, **plan.skipped})
        lacking = warn_environment_skips(plan, backend)  # a package they need is missing here, ...
        if lacking:
            plan = replace(plan, skipped={**lacking, **plan.skipped})
    if alloc is not None:
        outcome = _run_allocated(suite, plan, backend.name, threads, options, alloc)
        if close:
            outcome.close()
        return outcome
    with thread_count(threads):  # recorded by the environment capture; the workers set their own
        folder = _open(suite, options, threads)
        setup = _setup(suite, backend, threads, folder)
        from kdbench.run.workers import LocalWorkers

        workers = LocalWorkers(setup, options.inline, detect().gpu_count, suite.launcher)
        where = f"{threads} CPU threads"
        outcome = _execute(suite, plan, folder, backend, workers, where, threads, look, options.record)
    from kdbench.hw.speed import check_steps

    for line in check_steps(outcome.steps, backend, threads):  # a cached dtype speed its own steps contradict
        logger.warning("%s", line)
    if close:
        outcome.close()
    return outcome


def _open(suite: Suite, options: RunOptions, threads: int) -> RunFolder:
    run_id = options.run_id
    if options.resume and not run_id:
        folder = newest_run(options.out_dir, suite.name)
        if folder is None:
            logger.info("nothing of suite '%s' in %s to resume; starting a new run", suite.name, options.out_dir)
        else:
            run_id = folder.run_id
    folder = open_run(options.out_dir, suite.name, str(suite.path), run_id, options.record)
    check_threads(folder, threads)
    return folder


def check_threads(folder: RunFolder, threads: int) -> None:
    """Refuse to continue a run at another CPU thread count than it measured at: its rows (and the quality job's
    kept models) would mix thread counts, which change every CPU figure.  The earlier invocations that count are
    those that stored a job, or did not finish (killed: they may have); each records its ``threads``."""
    earlier = {
        r["threads"]
        for r in folder.invocations()
        if r.get("threads") is not None and (r.get("stored") or "finished" not in r)
    }
    if earlier and earlier != {threads}:
        was = " and ".join(str(t) for t in sorted(earlier))
        raise KdbenchError(
            f"--threads {threads}: run {folder.run_id} in {folder.path.parent} was measured at {was} CPU threads "
            f"and one run does not mix thread counts; continue it with --threads {was.split()[0]} (or the suite's "
            f"`threads`), or start a new run (without --resume, or another --run-id)"
        )


def _setup(suite: Suite, backend: Backend, threads: int, folder: RunFolder):
    from kdbench.hw.environment import device_facts
    from kdbench.run.workers import WorkerSetup

    trace_dir = str(folder.path.parent / TRACES_DIR / folder.run_id) if suite.profile else None
    level = logging.getLogger("kdbench").getEffectiveLevel()
    ceiling = latest_ceiling(folder.path.parent / PROBES_DIR, device_facts(backend)["device_name"], backend.name)
    options = MeasureOptions(trace_dir=trace_dir, run_dir=str(folder.path), fit_check=suite.fit_check, ceiling=ceiling)
    return WorkerSetup(backend, suite.allow_imports, threads, options, level)


def _run_allocated(suite: Suite, plan: Plan, backend_name: str, threads: int, options: RunOptions, alloc):
    """Every rank of an allocation calls this; rank 0 runs the engine, the others follow it."""
    import torch.distributed as dist

    from kdbench.run.allocation import AllocationWorkers, export_env, follow, group_timeout_s, subgroups
    from kdbench.run.rank import join_process_group
    from kdbench.run.workers import InlineWorker, ProcessWorker

    export_env(alloc)
    torch.set_num_threads(threads)
    backend = join_process_group(backend_name, alloc.local_rank, group_timeout_s(suite.cell_timeout_s))
    try:
        opened: list[Any] = [None]
        if alloc.rank == 0:
            try:
                opened[0] = _open(suite, options, threads)
            except KdbenchError as exc:
                opened[0] = exc  # the other ranks stop too, rather than wait for a run that never comes
        dist.broadcast_object_list(opened, src=0)  # every rank measures with the same options
        if isinstance(opened[0], Exception):
            if alloc.rank == 0:
                raise opened[0]
            return RunOutcome(run_id="", path=options.out_dir, follower=True)
        folder: RunFolder = opened[0]
        setup = _setup(suite, backend, threads, folder)
        groups = subgroups(alloc, plan.cells)
        if alloc.rank != 0:
            follow(alloc, setup, plan.cells, groups)
            return RunOutcome(run_id=folder.run_id, path=folder.path, follower=True)
        single = InlineWorker(setup) if options.inline else ProcessWorker(setup)
        workers = AllocationWorkers(alloc, setup, single, groups)
        where = f"{alloc.world_size} ranks of a {alloc.source} allocation"
        return _execute(suite, plan, folder, backend, workers, where, threads, record=options.record)
    finally:
        dist.destroy_process_group()


class Stamper:
    """Stamps a job's rows with what identifies them: run, suite, job, config, environment, ceiling."""

    def __init__(self, suite: Suite, backend: Backend, folder: RunFolder):
        from kdbench.hw.environment import capture, suite_commit

        self.suite, self.backend, self.folder = suite, backend, folder
        self.env = capture(backend)
        self.commit = suite_commit(suite.path)
        self.ceiling = latest_ceiling(folder.path.parent / PROBES_DIR, self.env["device_name"], backend.name)

    def __call__(self, job: Job, rows: list[Row]) -> list[Row]:
        identity = {
            "schema_version": SCHEMA_VERSION,
            "run_id": self.folder.run_id,
            "suite": self.suite.name,
            "suite_file": str(self.suite.path),
            "suite_commit": self.commit,
            "cell_id": job.cell_id,
            "cell_label": job.label,
            "backend": self.backend.name,
            "device": str(self.backend.device),
            **job.columns(self.backend.name),
            **self.env,
            **(ceiling_columns(self.ceiling, job.precision, job.teacher_precision) if job.precision else {}),
            "timestamp": datetime.now(UTC),
        }
        return [Row({**identity, **row}) for row in rows]


REUSED = "measured_in_cell"


def _with_reused(job: CellJob, rows: list[Row], reuse: dict, measured: dict) -> list[Row]:
    """The job's rows with the teacher inference rows it reused (copies of the earlier cell's, saying so)
    in their planned places; its own ok teacher rows become the reference for later cells."""
    keys = job.teacher_keys()
    if not rows:
        return rows
    out = list(rows)
    have = {(str(r["measurement"]), r.get("batch_size")) for r in rows}  # a failed cell planned them all
    for bs, (cell_id, label, ref) in reuse.items():
        if (str(Measurement.TEACHER_INFERENCE), bs) in have:
            continue
        note = f"reused: this teacher inference was measured once in this run, in cell {label} ({cell_id})"
        # the measuring cell's note on the teacher's served precision restated for this cell (its teacher_precision)
        here = restate_served_precision(ref.get("notes"), Measurement.TEACHER_INFERENCE, job.cell.config)
        notes = "; ".join(n for n in (here, note) if n)
        out.append(Row(ref, notes=notes, **{REUSED: cell_id}))
    for row in rows if job.world_size == 1 else ():  # a rank's teacher ran beside others: not a reference
        if row["measurement"] == Measurement.TEACHER_INFERENCE and row.get("status") == Status.OK:
            key = keys.get(row["batch_size"])
            if key is not None and key not in measured:
                measured[key] = (job.cell_id, job.label, Row({k: v for k, v in row.items() if k != REUSED}))
    order = {(str(m), bs): i for i, (m, bs) in enumerate(job.planned_order())}
    return sorted(out, key=lambda r: order.get((str(r["measurement"]), r.get("batch_size")), len(order)))


def _invocation(
    suite: Suite,
    plan: Plan,
    folder: RunFolder,
    backend: Backend,
    commit: str | None,
    threads: int,
    record: dict[str, Any] | None = None,
) -> Invocation:
    """This invocation's record: the whole plan's jobs (what a complete run holds), its share, and how it ran
    (with ``record``, its options: what a continued run keeps)."""
    import socket
    import sys

    return folder.start_invocation(
        planned=list(plan.job_ids) or [j.job_id for j in plan.jobs],
        share=[j.job_id for j in plan.jobs],
        shard=list(plan.shard) if plan.shard else None,
        repeats=suite.repeat,
        backend=backend.name,
        threads=threads,
        budgets=[b.model_dump(mode="json", exclude_none=True) for b in suite.budgets],
        suite_commit=commit,
        host=socket.gethostname(),
        pid=os.getpid(),
        argv=sys.argv,
        **(record or {}),
    )


def _execute(
    suite: Suite,
    plan: Plan,
    folder: RunFolder,
    backend: Backend,
    workers: Any,
    where: str,
    threads: int,
    look: HostMeter | None = None,
    record: dict[str, Any] | None = None,
) -> RunOutcome:
    """Run ``plan``'s jobs not stored yet (a part that cannot be read counts as not stored: its job runs again).
    ``look``: a host meter started when the run began, ended (and warned about when the machine is busy) 0.4 s
    after that, in a timer thread beside the first job; ``record``: the run's options, kept in its record."""
    outcome = RunOutcome(run_id=folder.run_id, path=folder.path, split=WallSplit())
    wall = outcome.split
    timer = None
    try:  # whatever happens, the workers are closed (inside an allocation that releases the other ranks)
        began = time.perf_counter()
        stamp = Stamper(suite, backend, folder)
        wall.add("environment capture", time.perf_counter() - began)
        outcome.invocation = _invocation(suite, plan, folder, backend, stamp.commit, threads, record)
        stored = folder.stored_job_ids(readable=True)
        todo = [job for job in plan.jobs if job.job_id not in stored]
        if stored:
            done = len(plan.jobs) - len(todo)
            logger.info(
                "resuming run %s: %d of %d jobs already stored, %d to go",
                folder.run_id,
                done,
                len(plan.jobs),
                len(todo),
            )
        cells = sum(isinstance(j, CellJob) for j in todo)
        extra = " and the quality job" if len(todo) > cells else ""
        logger.info(
            "run %s: %d cells%s of suite '%s' on %s (%s), %s -> %s",
            folder.run_id,
            cells,
            extra,
            suite.name,
            backend.name,
            stamp.env["device_name"],
            where,
            folder.path,
        )
        if not todo:
            return outcome
        if stamp.ceiling:
            logger.info("utilisation against this device's measured ceiling: probe %s", stamp.ceiling["probe_id"])
        else:
            logger.info(
                "no probe of this device in %s: run `kdbench probe` for utilisation against its measured ceiling",
                folder.path.parent / PROBES_DIR,
            )
        if suite.profile:
            logger.info("profiler traces -> %s", folder.path.parent / TRACES_DIR / folder.run_id)
        if look is not None:  # the look ends 0.4 s after the run began, beside the first cell: nobody waits for it
            timer = look_later(look, _warn_if_busy)
        progress = Progress(len(todo))
        if suite.repeat > 1:
            logger.info(
                "%d repeats of every cell, in rounds%s",
                suite.repeat,
                ", each round in a fresh worker process"
                if workers.isolated
                else ", all in this process (--inline): the repeats share one process",
            )
        round_ = None
        measured: dict[tuple, tuple[str, str, Row]] = {}  # teacher key -> (cell_id, label, worker row)
        from kdbench.measure.walltime import MODELS
        from kdbench.run.workers import PROCESS_START

        for job in todo:
            if isinstance(job, QualityJob):
                logger.info("%s", job.describe())
            if round_ is not None and job.repeat != round_:
                workers.fresh()  # a new round of repeats starts in new worker processes
            round_ = job.repeat
            start = time.perf_counter()
            reuse = {}
            if isinstance(job, CellJob) and job.world_size == 1:
                reuse = {bs: measured[key] for bs, key in job.teacher_keys().items() if key in measured}
                job = replace(job, reuse_teacher=tuple(reuse))
            if job.job_id in plan.skipped:  # stored as skipped without a worker
                from kdbench.run.workers import JobResult

                result = JobResult(failure_rows(job, Status.SKIPPED, plan.skipped[job.job_id]), 0.0)
            else:
                result = workers.run(job, suite.cell_timeout_s)
            written = time.perf_counter()
            worker_rows = result.rows
            if isinstance(job, CellJob):
                worker_rows = _with_reused(job, worker_rows, reuse, measured)
            rows = stamp(job, worker_rows) if worker_rows else []
            if rows:
                folder.write_part(job.job_id, rows)
                outcome.stored_jobs.append(job.job_id)
                outcome.jobs += 1
                outcome.rows += len(rows)
                outcome.quality |= isinstance(job, QualityJob)
                if any(r["status"] in FAILURES for r in rows):
                    outcome.failed.append(job.progress_label)
                outcome.timed_rows += sum(r.get("contended") is not None for r in rows)
                outcome.contended += [r.get("host_busy_share") or 0.0 for r in rows if r.get("contended")]
                outcome.steps += [
                    {"config_json": r.get("config_json"), "median_ms": r.get("median_ms")}
                    for r in rows
                    if r["measurement"] == Measurement.DISTILL_STEP
                    and r["status"] == Status.OK
                    and not r.get("contended")
                ]
            writing = time.perf_counter() - written
            outcome.timings.append(
                JobTiming(job.job_id, job.progress_label, time.perf_counter() - start, result.seconds)
            )
            wall.job(time.perf_counter() - start, result.seconds, result.split, writing)
            progress.done(job, rows, result.split.get(PROCESS_START, 0.0) + result.split.get(MODELS, 0.0))
            if result.fatal:  # stored; but the run cannot go on (an allocation whose ranks lost step)
                outcome.aborted = f"{job.progress_label}: {result.fatal}"
                break
        if outcome.contended:
            logger.warning("%s", contended_summary(outcome))
    except KeyboardInterrupt as exc:
        outcome.interrupted = True
        partial = getattr(exc, "result", None)  # the job in flight (kdbench.run.workers.JobInterrupted)
        if partial is not None:  # its time where its worker said it went (a quality job's training: quality)
            wall_s = time.perf_counter() - start
            outcome.timings.append(JobTiming(job.job_id, job.progress_label, wall_s, partial.seconds))
            wall.job(wall_s, partial.seconds, partial.split, 0.0)
    finally:
        if timer is not None:
            timer.cancel()  # a run over before its look: its rows say what the machine did
        workers.close()
    return outcome


def _warn_if_busy(load: HostLoad) -> None:
    if load.contended:
        logger.warning("%s", busy_warning(load, f"as the run starts (a {load.wall_s:.1f} s look)"))


def contended_summary(outcome: RunOutcome) -> str:
    """The run's closing word on rows measured on a busy machine, with the figure and what to do."""
    return (
        f"{len(outcome.contended)} of {outcome.timed_rows} timed rows were measured on a busy machine (contended; "
        f"host_busy_share up to {max(outcome.contended):.2f}): their figures read slow, and compare and budgets "
        "leave them out unless --judge-contended; measure them again in a new run when the machine is idle, with "
        "--threads 1, or pinned to free cores (taskset -c CORES python -m kdbench run ...)"
    )
