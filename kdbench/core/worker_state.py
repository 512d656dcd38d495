"""What one worker remembers between its measurements, in one object.

A worker (a process of its own, or the caller's process with ``--inline``, or one torchrun rank) measures
job after job.  A few facts outlive a measurement, and each belongs to the worker, not to a module:

* ``wall_s`` and ``wall_listener``: where the worker's wall time went, by category, since the engine last took
  it (:mod:`kdbench.measure.walltime`), and the hook that tells the engine as it grows;
* ``device_lost``: the error that poisoned the device context, after which no measurement of the worker can
  run (:mod:`kdbench.measure.failures`);
* ``tunableop_used``: a cell of this worker has run with TunableOp, whose tunings stay in memory
  (:mod:`kdbench.measure.levers`);
* ``inference_flops``: FLOP counts of served models, counted once per model and input
  (:mod:`kdbench.workloads.vision`);
* ``telemetry_readers``: the NVML / amdsmi handles, opened once per library and device
  (:mod:`kdbench.measure.telemetry`);
* ``unwritable_slowdowns``: slow-precision measurements a cache file refused to store
  (:mod:`kdbench.hw.speed`);
* ``fit_check_s``: per pair (teacher, student), what its last cell's fit check took, the yardstick of
  ``fit_check: auto`` (:func:`kdbench.measure.step.auto_fit_skip`);
* ``finished_rows`` and ``rows_listener``: the rows the running job has finished so far (the quality job's, model
  by model: :func:`finished`), and the hook that sends them to the engine, so a job whose worker dies keeps them.

The worker's context (:class:`kdbench.run.jobs.WorkerContext`) makes one and installs it (:func:`install`)
for as long as its jobs run; the code that measures reads it with :func:`current`.  Outside a worker (a
test, a notebook) :func:`current` is a state of the process's own.  Torch-free: every floor may read it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class WorkerState:
    wall_s: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    wall_listener: Callable[[dict[str, float]], Any] | None = None
    device_lost: str | None = None
    tunableop_used: bool = False
    inference_flops: dict[tuple, int] = field(default_factory=dict)
    telemetry_readers: dict[tuple, Any] = field(default_factory=dict)
    unwritable_slowdowns: dict[tuple[str, str, str], Any] = field(default_factory=dict)
    fit_check_s: dict[tuple[str, str], float] = field(default_factory=dict)
    finished_rows: list[dict[str, Any]] = field(default_factory=list)
    rows_listener: Callable[[list[dict[str, Any]]], Any] | None = None


_state = [WorkerState()]  # the installed one (a list: no `global` statements)


def current() -> WorkerState:
    """The state of the worker this code runs in."""
    return _state[0]


def install(state: WorkerState) -> WorkerState:
    """Make ``state`` the current one; returns the one it replaces."""
    previous, _state[0] = _state[0], state
    return previous


def finished(rows: list[dict[str, Any]]) -> None:
    """The running job has finished ``rows``, the first of those it planned (in order): should its worker die
    now, they are stored as they are and only the rest as failed (:func:`kdbench.run.jobs.failure_rows`)."""
    state = current()
    state.finished_rows = list(rows)
    if state.rows_listener is not None:
        state.rows_listener(state.finished_rows)
