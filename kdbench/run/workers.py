"""Where jobs run: in a worker process (default), inline, or under torchrun.

Every worker takes a job (:mod:`kdbench.run.jobs`: a cell, or the quality block) and
returns its rows; the engine neither knows nor cares which worker ran it.

``ProcessWorker`` keeps one child process (started with ``spawn``, safe with CUDA)
that runs job after job and keeps its model cache between them.  A job that kills its
worker — a segfault, the OS out-of-memory killer, ``os._exit`` — or outlives its
time-out is stored as failed (or ``timeout``) and the next job gets a fresh worker, so
one bad job never takes the sweep down.  The worker beats every :data:`HEARTBEAT_S` s from
a thread of its own; a worker that goes silent (no beat for :data:`SILENCE_S` s: stopped,
frozen or swapping past use) is stopped then, not at the cell's time-out an hour on, and
its row says so with the last thing it was heard to do (as a time-out's row does).  The
child's log messages travel to the parent through the same pipe as its rows and are
logged there.  ``InlineWorker`` runs in the calling process: no isolation, but a
debugger and profiler see everything.
``TorchrunWorker`` runs a ``world_size > 1`` cell as ``torchrun --standalone`` over
:mod:`kdbench.run.rank`, in its own session so a hung rank can be killed whole.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kdbench.config.schema import LauncherConfig
from kdbench.core.names import Status
from kdbench.core.schema import Row
from kdbench.core.worker_state import install
from kdbench.hw.backends import Backend
from kdbench.measure.failures import device_fatal, device_lost, error_text, note_device_lost
from kdbench.measure.step import MeasureOptions
from kdbench.run.jobs import CellJob, Job, WorkerContext, failure_rows
from kdbench.run.process import LastWord, Locked, beat, deaf_to_ctrl_c, die_with_parent
from kdbench.run.rank import oom_file

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # importing torch on a cold, busy machine can take minutes
HEARTBEAT_S = 5.0  # a worker's beat, from a thread of its own (torch's operators let go of the GIL)
SILENCE_S = 120.0  # no beat for this long: the worker is stopped, frozen or swapping past use
PROCESS_START = "worker start and imports"
_POLL_S = 0.2


@dataclass(frozen=True)
class WorkerSetup:
    """What every worker of a run is started with."""

    backend: Backend
    allow_imports: bool
    threads: int
    options: MeasureOptions = field(default_factory=MeasureOptions)
    log_level: int = logging.INFO


def context(setup: WorkerSetup) -> WorkerContext:
    """The context a worker started with ``setup`` runs its jobs in."""
    return WorkerContext(setup.backend, setup.options, setup.allow_imports)


@dataclass(frozen=True)
class JobResult:
    rows: list[Row]
    seconds: float  # wall time of the job in its worker (failed starts and deaths: as seen by the engine)
    fatal: str | None = None  # the job's rows are stored, but the run cannot go on (see AllocationWorkers)
    split: dict[str, float] = field(default_factory=dict)  # where the worker's seconds went (measure.walltime)


def execute(job: Job, ctx: WorkerContext) -> JobResult:
    """Run ``job``; an exception it lets through (a bug, or a data-set error of the quality job) fails
    every row it planned, with the error."""
    from kdbench.measure import walltime

    install(ctx.state)  # this worker's state (one process may hold two contexts: an allocation's rank 0)
    walltime.take()
    ctx.state.finished_rows = []
    start = time.perf_counter()
    try:
        rows = job.run(ctx)
    except Exception as exc:
        if device_fatal(exc):
            note_device_lost(exc)
        rows = failure_rows(job, Status.FAILED, error_text(exc), ctx.state.finished_rows)
    return JobResult(rows, time.perf_counter() - start, split=walltime.take())


class JobInterrupted(KeyboardInterrupt):
    """Ctrl-C while a worker ran a job: ``result`` holds no rows, the seconds the job had run and the wall-time
    split its worker had told by then, so the run's split counts them where they went (a quality job's training
    to quality), not to the engine."""

    def __init__(self, result: JobResult):
        super().__init__()
        self.result = result


class _PipeHandler(logging.Handler):
    """In a worker process: hand each kdbench log record to the parent, which logs it."""

    def __init__(self, conn: Any):
        super().__init__()
        self.conn = conn

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.conn.send(("log", record.levelno, record.name, self.format(record)))  # with any traceback
        except Exception:
            self.handleError(record)


def _serve(conn: Any, setup: WorkerSetup) -> None:
    """The worker process: run each job it is sent, until told to stop or orphaned."""
    import threading

    conn = Locked(conn)
    threading.Thread(target=beat, args=(conn, HEARTBEAT_S), daemon=True, name="kdbench-heartbeat").start()
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    root = logging.getLogger("kdbench")
    root.handlers[:] = [_PipeHandler(conn)]
    root.setLevel(setup.log_level)
    root.propagate = False
    torch.set_num_threads(setup.threads)
    if setup.backend.device_type == "cuda":
        torch.cuda.set_device(setup.backend.device)  # events record on this device's current stream
    ctx = context(setup)
    from kdbench.measure import walltime

    walltime.listen(lambda totals: conn.send(("split", totals)))  # a job that times out keeps its split
    ctx.state.rows_listener = lambda rows: conn.send(("finished", rows))  # and one that dies, its finished rows
    conn.send(("ready", os.getpid()))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        result = execute(job, ctx)
        ending = device_lost() is not None  # a device error poisoned this context: a fresh worker for the next job
        conn.send(("rows", result.rows, result.seconds, ending, result.split))
        if ending:
            return


def _log(message: tuple) -> None:
    """A worker's ("log", level, logger, text) message, logged here."""
    if message[0] == "log":
        logging.getLogger(message[2]).log(message[1], message[3])


def _death_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        sig = signal.Signals(-exitcode).name
        hint = " (the OS out-of-memory killer, or kill -9)" if sig == "SIGKILL" else ""
        return f"the worker process was killed by {sig}{hint}"
    return f"the worker process exited with code {exitcode}"


class InlineWorker:
    """Run jobs in this process."""

    isolated = False  # jobs share the caller's process

    def __init__(self, setup: WorkerSetup):
        torch.set_num_threads(setup.threads)
        self.ctx = context(setup)

    def run(self, job: Job, timeout_s: float | None = None) -> JobResult:
        from kdbench.measure import walltime

        start = time.perf_counter()
        try:
            result = execute(job, self.ctx)
        except KeyboardInterrupt:
            raise JobInterrupted(JobResult([], time.perf_counter() - start, split=walltime.take())) from None
        if device_lost():
            logger.warning(
                "the device context of this process is lost (%s): later jobs will fail; run without "
                "--inline to give each a fresh worker",
                device_lost(),
            )
        return result

    def fresh(self) -> None:
        """Jobs run in this process: a repeat cannot start a new one (the engine warns)."""

    def close(self) -> None:
        pass


class ProcessWorker:
    """Run jobs in a reusable child process; replace it when it dies or hangs."""

    isolated = True

    def __init__(self, setup: WorkerSetup):
        self.setup = setup
        self.ctx = mp.get_context("spawn")
        self.proc: Any = None
        self.conn: Any = None
        self.started = 0  # worker processes started so far
        self.seen: dict[str, float] = {}  # the running job's wall-time split, as its worker last told it
        self.finished: list[Row] = []  # the rows the running job had finished, as its worker last told them

    def _start(self) -> None:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_serve, args=(child, self.setup), daemon=True, name="kdbench-worker")
        with deaf_to_ctrl_c():  # from its first instruction: a Ctrl-C while it imports torch is the parent's alone
            proc.start()
        child.close()
        self.proc, self.conn = proc, parent
        self.started += 1
        if not parent.poll(STARTUP_TIMEOUT_S):
            self._kill()
            raise RuntimeError(f"the worker process did not start within {STARTUP_TIMEOUT_S:.0f} s")
        try:
            while (message := parent.recv())[0] != "ready":
                _log(message)
        except EOFError:
            code = proc.exitcode
            self._kill()
            raise RuntimeError(f"the worker process failed to start: {_death_reason(code)}") from None

    def _kill(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(10)
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None

    def run(self, job: Job, timeout_s: float | None = None) -> JobResult:
        start = time.perf_counter()
        self.seen, self.finished = {}, []

        def failed(status: Status, error: str) -> JobResult:
            split = {**self.seen, **started}
            rows = failure_rows(job, status, error, self.finished)
            return JobResult(rows, time.perf_counter() - start, split=split)

        started: dict[str, float] = {}
        if self.proc is None or not self.proc.is_alive():
            self._kill()
            began = time.perf_counter()
            try:
                self._start()
            except RuntimeError as exc:
                return failed(Status.FAILED, str(exc))
            started[PROCESS_START] = time.perf_counter() - began
        self.conn.send(job)
        try:
            return self._wait(timeout_s, failed, started)
        except KeyboardInterrupt:
            seconds = time.perf_counter() - start - started.get(PROCESS_START, 0.0)
            self._kill()  # it is in the middle of the job (SIGINT is the parent's): waiting for it would only delay
            raise JobInterrupted(JobResult([], seconds, split={**self.seen, **started})) from None

    def _wait(self, timeout_s: float | None, failed, started: dict[str, float]) -> JobResult:
        """The job's rows, as the worker sends them; or its failure when the worker dies, outlives ``timeout_s`` or
        goes silent (no beat for :data:`SILENCE_S` s), said with the last thing it was heard to do."""
        began = time.monotonic()
        deadline = None if timeout_s is None else began + timeout_s
        heard = began  # the worker's last message (a beat, a log line, a phase counted)
        last = LastWord()
        while True:
            if self.conn.poll(_POLL_S):
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):  # the pipe closed: the worker is dying
                    return failed(Status.FAILED, self._died())
                heard = time.monotonic()
                last.heard(message)
                if message[0] == "alive":
                    continue
                if message[0] == "rows":
                    if message[3]:  # the worker ends after this job: wait for it, so the next job starts a new one
                        self.proc.join(30)
                        self._kill()
                    return JobResult(message[1], message[2], split={**message[4], **started})
                if message[0] == "split":
                    self.seen = message[1]
                    continue
                if message[0] == "finished":
                    self.finished = message[1]
                    continue
                _log(message)
            elif not self.proc.is_alive():
                return failed(Status.FAILED, self._died())
            now = time.monotonic()
            if deadline is not None and now > deadline:
                self._kill()
                said = f"the job exceeded its time-out of {timeout_s:g} s and was stopped"
                return failed(Status.TIMEOUT, f"{said}; {last.text(now)}")
            if now - heard > SILENCE_S:
                self._kill()
                said = (
                    f"the worker went silent: no heartbeat for {now - heard:.0f} s (stopped, frozen or swapping past "
                    f"use), stopped {now - began:.0f} s into the job"
                )
                return failed(Status.TIMEOUT, f"{said}; {last.text(now)}")

    def fresh(self) -> None:
        """End the worker process: the next job starts a new one (a repeat round of the suite)."""
        self.close()

    def _died(self) -> str:
        self.proc.join(5)
        reason = _death_reason(self.proc.exitcode)
        self._kill()
        return f"{reason} while running this job"

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(None)
                self.proc.join(10)
            except (OSError, BrokenPipeError):
                pass
        self._kill()


def _error_lines(output: str, keep: int = 4) -> str:
    """The informative last lines of torchrun's output: errors, exit codes, signals."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    marks = ("Error", "Exception", "exitcode", "Signal", "error:", "Traceback")
    hits = [ln for ln in lines[-80:] if any(m in ln for m in marks) and not ln.startswith("warnings.warn")]
    return " | ".join((hits or lines)[-keep:])[:2000]


def _kill_tree(proc: subprocess.Popen, marker: str) -> None:
    """Kill torchrun and every rank: torchrun starts each rank in a session of its own, so its
    process group alone would leave them running; they are found by the job file in their command line."""
    import psutil

    victims = [proc.pid]
    for p in psutil.process_iter(["pid", "cmdline"]):
        if marker in " ".join(p.info["cmdline"] or []):
            victims.append(p.info["pid"])
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


class TorchrunWorker:
    """Run data-parallel cells under `torchrun` on this machine (standalone, or the suite's rendezvous)."""

    def __init__(self, setup: WorkerSetup, gpu_count: int = 0, launcher: LauncherConfig | None = None):
        self.setup = setup
        self.gpu_count = gpu_count
        self.launcher = launcher or LauncherConfig()

    def torchrun_args(self, job: CellJob) -> list[str]:
        """torchrun's flags for a cell: standalone on one node, or the suite's rendezvous."""
        la = self.launcher
        per_node = job.world_size // la.nnodes
        if la.nnodes == 1 and la.rdzv_endpoint is None:
            args = ["--standalone", "--nnodes=1"]
        else:
            args = [
                f"--nnodes={la.nnodes}",
                f"--rdzv-backend={la.rdzv_backend}",
                f"--rdzv-endpoint={la.rdzv_endpoint}",
                f"--rdzv-id={la.rdzv_id or 'kdbench-' + job.job_id}",
            ]
        return [*args, f"--nproc-per-node={per_node}", "--max-restarts=0", *la.extra_args]

    def run(self, job: Job, timeout_s: float) -> JobResult:
        start = time.perf_counter()
        rows = self._rows(job, timeout_s)
        return JobResult(rows, time.perf_counter() - start)

    def _rows(self, job: Job, timeout: float) -> list[Row]:
        assert isinstance(job, CellJob)
        ws, backend = job.world_size, self.setup.backend
        per_node = ws // self.launcher.nnodes
        if backend.device_type == "cuda" and per_node > self.gpu_count:
            why = f"world_size {ws} needs {per_node} GPUs on each of {self.launcher.nnodes} node(s); this machine has "
            return failure_rows(job, Status.SKIPPED, why + str(self.gpu_count))
        rank_setup = replace(self.setup, threads=max(1, self.setup.threads // per_node))
        with tempfile.TemporaryDirectory(prefix="kdbench-ddp-") as tmp:
            spec, rows_file, log = Path(tmp) / "job.pkl", Path(tmp) / "rows.pkl", Path(tmp) / "output.log"
            spec.write_bytes(pickle.dumps({"job": job, "setup": rank_setup, "timeout_s": timeout}))
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                *self.torchrun_args(job),
                "-m",
                "kdbench.run.rank",
                str(spec),
                str(rows_file),
            ]
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                "OMP_NUM_THREADS": str(rank_setup.threads),
            }
            # Output goes to a file, not a pipe: a rank that outlived torchrun would hold a pipe open.
            with open(log, "w") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    _kill_tree(proc, str(spec))
                    return failure_rows(
                        job,
                        Status.TIMEOUT,
                        f"the cell exceeded its time-out of {timeout:g} s and "
                        f"its {ws} ranks were stopped; last output: {_error_lines(log.read_text())}",
                    )
                except BaseException:  # Ctrl-C: leave nothing behind
                    _kill_tree(proc, str(spec))
                    raise
                _kill_tree(proc, str(spec))  # ranks that outlived a failed torchrun
            if proc.returncode == 0 and not rows_file.exists() and self.launcher.nnodes > 1:
                return []  # global rank 0 ran on another node, which stores the rows
            if proc.returncode != 0 or not rows_file.exists():
                if oom_file(rows_file).exists():  # a rank ran out of memory: the pair does not fit at this sharding
                    return failure_rows(job, Status.OOM, f"out of memory on {oom_file(rows_file).read_text()}")
                error = f"torchrun exited with code {proc.returncode}: {_error_lines(log.read_text())}"
                return failure_rows(job, Status.FAILED, error)
            return pickle.loads(rows_file.read_bytes())

    def close(self) -> None:
        pass


class LocalWorkers:
    """The workers of a plain run: data-parallel cells under torchrun, every other job in one worker."""

    def __init__(self, setup: WorkerSetup, inline: bool, gpu_count: int, launcher: LauncherConfig):
        self.single = InlineWorker(setup) if inline else ProcessWorker(setup)
        self.parallel = TorchrunWorker(setup, gpu_count=gpu_count, launcher=launcher)

    def run(self, job: Job, timeout_s: float | None) -> JobResult:
        return (self.parallel if job.world_size > 1 else self.single).run(job, timeout_s)

    def fresh(self) -> None:  # torchrun starts new ranks for every job anyway
        self.single.fresh()

    @property
    def isolated(self) -> bool:
        return self.single.isolated

    def close(self) -> None:
        self.single.close()
        self.parallel.close()
