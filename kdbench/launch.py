"""Where cells are measured: in a worker process (default) or inline.

``ProcessWorker`` keeps one child process (started with ``spawn``, safe with CUDA)
that measures cell after cell and keeps its model cache between them.  A cell
that kills its worker — a segfault, the OS out-of-memory killer, ``os._exit`` —
or outlives its time-out is recorded as a failure and the next cell gets a fresh
worker, so one bad cell never takes the sweep down.  ``InlineWorker`` measures in
the calling process: no isolation, but a debugger and profiler see everything.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import torch

from kdbench.backends import Backend
from kdbench.plan import Cell, planned_measurements
from kdbench.worker import ModelCache, failure_row, measure_cell

STARTUP_TIMEOUT_S = 600.0  # importing torch on a cold, busy machine can take minutes
_POLL_S = 0.2


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (even by kill -9)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _serve(conn: Any, backend: Backend, allow_imports: bool, threads: int) -> None:
    """The worker process: measure each cell it is sent, until told to stop or orphaned."""
    _die_with_parent()
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
        conn.send(("rows", measure_cell(cell, backend, cache)))


def _rows_for(cell: Cell, status: str, error: str) -> list[dict[str, Any]]:
    return [failure_row(m, bs, None, status=status, error=error) for m, bs in planned_measurements(cell.config)]


def _death_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        sig = signal.Signals(-exitcode).name
        hint = " (the OS out-of-memory killer, or kill -9)" if sig == "SIGKILL" else ""
        return f"the worker process was killed by {sig}{hint}"
    return f"the worker process exited with code {exitcode}"


class InlineWorker:
    """Measure in this process."""

    def __init__(self, backend: Backend, allow_imports: bool, threads: int):
        torch.set_num_threads(threads)
        self.backend = backend
        self.cache = ModelCache(allow_imports=allow_imports)

    def measure(self, cell: Cell, timeout_s: float | None = None) -> list[dict[str, Any]]:
        return measure_cell(cell, self.backend, self.cache)

    def close(self) -> None:
        pass


class ProcessWorker:
    """Measure in a reusable child process; replace it when it dies or hangs."""

    def __init__(self, backend: Backend, allow_imports: bool, threads: int):
        self.args = (backend, allow_imports, threads)
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
                return _rows_for(cell, "failed", str(exc))
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
                return _rows_for(cell, "timeout", f"the cell exceeded its time-out of {timeout_s:g} s and was stopped")

    def _died(self, cell: Cell) -> list[dict[str, Any]]:
        self.proc.join(5)
        reason = _death_reason(self.proc.exitcode)
        self._kill()
        return _rows_for(cell, "failed", f"{reason} while measuring this cell")

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(None)
                self.proc.join(10)
            except (OSError, BrokenPipeError):
                pass
        self._kill()
