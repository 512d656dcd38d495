"""Where cells are measured: in a worker process (default), inline, or under torchrun.

``ProcessWorker`` keeps one child process (started with ``spawn``, safe with CUDA)
that measures cell after cell and keeps its model cache between them.  A cell
that kills its worker — a segfault, the OS out-of-memory killer, ``os._exit`` —
or outlives its time-out is recorded as a failure and the next cell gets a fresh
worker, so one bad cell never takes the sweep down.  ``InlineWorker`` measures in
the calling process: no isolation, but a debugger and profiler see everything.
``TorchrunWorker`` runs a ``world_size > 1`` cell as ``torchrun --standalone``
over ``kdbench.run.rank``, in its own process group so a hung rank can be killed whole.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kdbench.config.plan import Cell, planned_measurements
from kdbench.config.schema import LauncherConfig
from kdbench.hw.backends import Backend
from kdbench.measure.cell import MeasureOptions, ModelCache, failure_row, measure_cell

STARTUP_TIMEOUT_S = 600.0  # importing torch on a cold, busy machine can take minutes
_POLL_S = 0.2


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (even by kill -9)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _serve(conn: Any, backend: Backend, allow_imports: bool, threads: int, options: MeasureOptions) -> None:
    """The worker process: measure each cell it is sent, until told to stop or orphaned."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    torch.set_num_threads(threads)
    cache = ModelCache(allow_imports=allow_imports)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            cell = conn.recv()
        except (EOFError, OSError):
            return
        if cell is None:
            return
        conn.send(("rows", measure_cell(cell, backend, cache, options)))


def rows_for(cell: Cell, status: str, error: str) -> list[dict[str, Any]]:
    return [failure_row(m, bs, None, status=status, error=error) for m, bs in planned_measurements(cell.config)]


def _death_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        sig = signal.Signals(-exitcode).name
        hint = " (the OS out-of-memory killer, or kill -9)" if sig == "SIGKILL" else ""
        return f"the worker process was killed by {sig}{hint}"
    return f"the worker process exited with code {exitcode}"


class InlineWorker:
    """Measure in this process."""

    def __init__(self, backend: Backend, allow_imports: bool, threads: int, options: MeasureOptions = MeasureOptions()):
        torch.set_num_threads(threads)
        self.backend = backend
        self.options = options
        self.cache = ModelCache(allow_imports=allow_imports)

    def measure(self, cell: Cell, timeout_s: float | None = None) -> list[dict[str, Any]]:
        return measure_cell(cell, self.backend, self.cache, self.options)

    def close(self) -> None:
        pass


class ProcessWorker:
    """Measure in a reusable child process; replace it when it dies or hangs."""

    def __init__(self, backend: Backend, allow_imports: bool, threads: int, options: MeasureOptions = MeasureOptions()):
        self.args = (backend, allow_imports, threads, options)
        self.ctx = mp.get_context("spawn")
        self.proc: Any = None
        self.conn: Any = None
        self.started = 0  # worker processes started so far

    def _start(self) -> None:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_serve, args=(child, *self.args), daemon=True, name="kdbench-worker")
        proc.start()
        child.close()
        self.proc, self.conn = proc, parent
        self.started += 1
        if not parent.poll(STARTUP_TIMEOUT_S):
            self._kill()
            raise RuntimeError(f"the worker process did not start within {STARTUP_TIMEOUT_S:.0f} s")
        try:
            parent.recv()
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

    def measure(self, cell: Cell, timeout_s: float | None = None) -> list[dict[str, Any]]:
        if self.proc is None or not self.proc.is_alive():
            self._kill()
            try:
                self._start()
            except RuntimeError as exc:
                return rows_for(cell, "failed", str(exc))
        self.conn.send(cell)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self.conn.poll(_POLL_S):
                try:
                    return self.conn.recv()[1]
                except (EOFError, OSError):  # the pipe closed: the worker is dying
                    return self._died(cell)
            if not self.proc.is_alive():
                return self._died(cell)
            if deadline is not None and time.monotonic() > deadline:
                self._kill()
                return rows_for(cell, "timeout", f"the cell exceeded its time-out of {timeout_s:g} s and was stopped")

    def _died(self, cell: Cell) -> list[dict[str, Any]]:
        self.proc.join(5)
        reason = _death_reason(self.proc.exitcode)
        self._kill()
        return rows_for(cell, "failed", f"{reason} while measuring this cell")

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
    """Run data-parallel cells under `torchrun --standalone` on this machine."""

    def __init__(
        self,
        backend: Backend,
        allow_imports: bool,
        threads: int,
        gpu_count: int = 0,
        launcher: LauncherConfig | None = None,
    ):
        self.backend = backend
        self.allow_imports = allow_imports
        self.threads = threads
        self.gpu_count = gpu_count
        self.launcher = launcher or LauncherConfig()

    def torchrun_args(self, cell: Cell) -> list[str]:
        """torchrun's flags for a cell: standalone on one node, or the suite's rendezvous."""
        la = self.launcher
        per_node = cell.config.world_size // la.nnodes
        if la.nnodes == 1 and la.rdzv_endpoint is None:
            args = ["--standalone", "--nnodes=1"]
        else:
            args = [
                f"--nnodes={la.nnodes}",
                f"--rdzv-backend={la.rdzv_backend}",
                f"--rdzv-endpoint={la.rdzv_endpoint}",
                f"--rdzv-id={la.rdzv_id or 'kdbench-' + cell.cell_id}",
            ]
        return [*args, f"--nproc-per-node={per_node}", "--max-restarts=0", *la.extra_args]

    def measure(self, cell: Cell, timeout_s: float | None = None) -> list[dict[str, Any]]:
        ws = cell.config.world_size
        per_node = ws // self.launcher.nnodes
        if self.backend.device_type == "cuda" and per_node > self.gpu_count:
            return rows_for(
                cell,
                "skipped",
                f"world_size {ws} needs {per_node} GPUs on each of "
                f"{self.launcher.nnodes} node(s); this machine has {self.gpu_count}",
            )
        timeout = timeout_s or 3600.0
        rank_threads = max(1, self.threads // per_node)
        with tempfile.TemporaryDirectory(prefix="kdbench-ddp-") as tmp:
            job, rows_file, log = Path(tmp) / "cell.pkl", Path(tmp) / "rows.pkl", Path(tmp) / "output.log"
            job.write_bytes(
                pickle.dumps(
                    {
                        "cell": cell,
                        "backend": self.backend.name,
                        "allow_imports": self.allow_imports,
                        "threads": rank_threads,
                        "timeout_s": timeout,
                    }
                )
            )
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                *self.torchrun_args(cell),
                "-m",
                "kdbench.run.rank",
                str(job),
                str(rows_file),
            ]
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                "OMP_NUM_THREADS": str(rank_threads),
            }
            # Output goes to a file, not a pipe: a rank that outlived torchrun would hold a pipe open.
            with open(log, "w") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    _kill_tree(proc, str(job))
                    return rows_for(
                        cell,
                        "timeout",
                        f"the cell exceeded its time-out of {timeout:g} s and its "
                        f"{ws} ranks were stopped; last output: {_error_lines(log.read_text())}",
                    )
                except BaseException:  # Ctrl-C: leave nothing behind
                    _kill_tree(proc, str(job))
                    raise
                _kill_tree(proc, str(job))  # ranks that outlived a failed torchrun
            if proc.returncode == 0 and not rows_file.exists() and self.launcher.nnodes > 1:
                return []  # global rank 0 ran on another node, which stores the rows
            if proc.returncode != 0 or not rows_file.exists():
                return rows_for(
                    cell, "failed", f"torchrun exited with code {proc.returncode}: {_error_lines(log.read_text())}"
                )
            return pickle.loads(rows_file.read_bytes())

    def close(self) -> None:
        pass
