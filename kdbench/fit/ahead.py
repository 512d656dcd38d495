"""A suite's fake runs ahead, on helper processes, while ``kdbench fit`` judges its cells in order.

A fake run is one Python thread's work (``FakeTensorMode`` dispatches every operator in Python: about 4 s for a
Llama-8B cell on the 2-core CI machine type), and a suite's cells are independent.  :class:`Ahead` starts spawned
processes (:func:`processes_for`: the cores this process may run on, at most :data:`MOST`) that run each cell's fake
run as given (:func:`kdbench.fit.planner.predict`, pickled there and back: the same prediction as in this process),
while this process goes through the cells in order, taking each one's prediction when it is ready, and runs what
only its verdict knows it needs (a change that would make it fit, an offline twin, ``--max``'s bisection) itself.

``KDBENCH_FIT_PROCESSES`` sets the number (``1``: none, every fake run in this process).  A helper that fails (it
died, its result cannot be read back) costs nothing but time: the cell's fake run is made here.  Helpers ignore
Ctrl-C (this process stops them), and each runs torch on one thread (a fake run computes nothing).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from typing import Any

from kdbench.core.errors import KdbenchError

ENV = "KDBENCH_FIT_PROCESSES"
MOST = 4  # helpers at most: each holds its own copy of torch and transformers (about 0.5 GB)
FEWEST_RUNS = 3  # fewer fake runs than this are made here: a helper's start (torch's import) costs seconds


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS has no affinity
        return os.cpu_count() or 1


def processes_for(runs: int) -> int:
    """Helper processes for ``runs`` fake runs known ahead: ``KDBENCH_FIT_PROCESSES`` where set (1 or a bad value: a
    one-line error), else the cores (at most :data:`MOST`, at most ``runs``); 0 below :data:`FEWEST_RUNS` runs or on
    one core."""
    given = os.environ.get(ENV, "").strip()
    if given:
        if not given.isdigit() or int(given) < 1:
            raise KdbenchError(f"{ENV}={given!r}: give a whole number of processes, 1 or more (1: no helpers)")
        wanted = int(given)
        return 0 if wanted == 1 or runs < 1 else min(wanted, runs)
    if runs < FEWEST_RUNS or cores() < 2:
        return 0
    return min(cores(), MOST, runs)


def _quiet() -> None:
    """A helper's start: Ctrl-C is the parent's to handle (it stops the helpers); torch on one thread."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    torch.set_num_threads(1)


def _predict(config: Any, device_type: str, allow_imports: bool) -> Any:
    from kdbench.fit.planner import predict

    return predict(config, device_type, allow_imports)


class Ahead:
    """Fake runs submitted to ``processes`` helpers, taken back by their key (:class:`kdbench.fit.cells.FakeRuns`'s)."""

    def __init__(self, processes: int):
        self.processes = processes
        self._pool = multiprocessing.get_context("spawn").Pool(processes, initializer=_quiet)
        self._pending: dict[Any, Any] = {}

    def submit(self, key: Any, config: Any, device_type: str, allow_imports: bool) -> None:
        if key not in self._pending:
            self._pending[key] = self._pool.apply_async(_predict, (config, device_type, allow_imports))

    def take(self, key: Any) -> Any:
        """The prediction submitted under ``key`` (waiting for it), or None: not submitted, or its helper failed."""
        pending = self._pending.pop(key, None)
        if pending is None:
            return None
        try:
            return pending.get()
        except Exception:  # the helper died or its answer could not be read back: the caller runs it itself
            return None

    def close(self) -> None:
        """Stop the helpers, whatever they are running."""
        self._pool.terminate()
        self._pool.join()


def start(predict: Any, seen: set, configs: Any, device_type: str, allow_imports: bool, progress: Any) -> Ahead | None:
    """``configs``' fake runs (those not in ``seen``, by :func:`kdbench.fit.planner.fake_run_key` and device type)
    started on helpers, where they pay: the planner's own fake runs (``predict``, not a stand-in), several of them,
    several cores (:func:`processes_for`); None otherwise.  ``progress`` gets a line saying so."""
    from kdbench.fit import planner

    if predict is not planner.predict:
        return None
    todo = {(planner.fake_run_key(c), device_type): c for c in configs}
    todo = {k: c for k, c in todo.items() if k not in seen}
    processes = processes_for(len(todo))
    if not processes:
        return None
    ahead = Ahead(processes)
    # the longest first (an on-policy step's generation: two to three times a step's run), so that no helper is left
    # running one alone at the end while the other waits
    for key, config in sorted(todo.items(), key=lambda kc: kc[1].on_policy is None):
        ahead.submit(key, config, device_type, allow_imports)
    if progress is not None:
        progress(f"fit: {len(todo)} cells' fake runs started on {processes} helper processes, taken in order")
    return ahead
