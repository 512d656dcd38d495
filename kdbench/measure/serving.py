"""What every way of serving a model shares: the skip, the built forward, and the timing of one-off costs.

:class:`LeverSkip` is raised where a lever cannot run here (the row is stored as skipped, with its
reason); :class:`Built` is one runtime's forward as built (:mod:`kdbench.measure.runtimes`,
:mod:`kdbench.measure.onnx`), with its one-off cost and notes; :func:`excess_ms` times a one-off
cost as what a user waits for: host time between synchronizations.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kdbench.hw.backends import Backend
from kdbench.measure.failures import SkipMeasurement

STEADY_CALLS = 3


class LeverSkip(SkipMeasurement):
    """The lever cannot run here (a GPU-only lever on the CPU, a missing ONNX Runtime provider, int8 on a GPU):
    the row is stored as skipped with this reason."""


@dataclass
class Built:
    """One runtime's forward as built, before the output check: the call to time, its one-off cost and notes."""

    forward: Callable[[], Any]
    one_off_ms: float | None
    one_off_kind: str | None
    notes: list[str]
    graph_breaks: int | None = None
    compiled_graphs: int | None = None
    compiled: bool = False
    synchronous: bool = False
    own_memory: bool = False


def call_ms(fn: Callable[[], Any], backend: Backend) -> tuple[float, Any]:
    """One call of ``fn`` in host time between synchronizations (what a user waits for: one-off costs are
    host-side compiles and builds), and its result."""
    backend.synchronize()
    start = time.perf_counter()
    out = fn()
    backend.synchronize()
    return wall_ms(start), out


def excess_ms(fn: Callable[[], Any], backend: Backend, first_calls: int) -> tuple[float, Any]:
    """How much longer the first ``first_calls`` calls took than a steady call (median of the next few),
    and the first call's result."""
    first = [call_ms(fn, backend) for _ in range(first_calls)]
    steady = statistics.median(call_ms(fn, backend)[0] for _ in range(STEADY_CALLS))
    return sum(max(ms - steady, 0.0) for ms, _ in first), first[0][1]


def wall_ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3
