"""What every way of serving a model shares: the skip, the built forward, the timing of one-off costs, and the row
of a served model's call on token ids.

:class:`LeverSkip` is raised where a lever cannot run here (the row is stored as skipped, with its
reason); :class:`Built` is one runtime's forward as built (:mod:`kdbench.measure.runtimes`,
:mod:`kdbench.measure.onnx`), with its one-off cost and notes; :func:`excess_ms` times a one-off
cost as what a user waits for: host time between synchronizations.  :func:`token_serving_row` is the row of
every family's token serving (an encoder's forward, an LM's prefill, decode and speculative decode): it asks the
workload only for the tokens a call processes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kdbench.config.schema import CellConfig
from kdbench.core.names import INFERENCE_MODE, Measurement
from kdbench.core.schema import Row
from kdbench.hw.backends import AutocastChoice, Backend
from kdbench.measure.failures import SkipMeasurement
from kdbench.measure.flops import count, kernel_label
from kdbench.measure.levers import quiesce_compile_workers
from kdbench.measure.rows import measured_loop, timed_row

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


class TokenWorkload(Protocol):
    """What :func:`token_serving_row` asks of the pair's family (:class:`kdbench.workloads.base.Workload` is one)."""

    def tokens(self, measurement: Measurement, batch_size: int, config: CellConfig) -> int | None: ...


class _Quiesce:
    """The timed window of a compiled decode starts with inductor's compile workers ended (they start while the cold
    call compiles and import torch in the background for seconds after: :func:`quiesce_compile_workers`)."""

    def chain(self, other):
        def start() -> None:
            quiesce_compile_workers()
            if other:
                other[0]()

        return start, (other[1] if other else (lambda: None))


def compile_counters() -> dict[str, Any]:
    """The graph breaks and compiled graphs torch._dynamo counted since its counters were cleared."""
    from torch._dynamo.utils import counters

    return {
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "compiled_graphs": int(counters["stats"]["unique_graphs"]),
    }


def token_serving_row(
    workload: TokenWorkload,
    measurement: Measurement,
    batch_size: int,
    config: CellConfig,
    backend: Backend,
    budget_s: float | None,
    choice: AutocastChoice,
    call: Callable[[], Any],
    ids: torch.Tensor,
    columns: dict[str, Any],
    notes: tuple[str, ...] = (),
    start: Callable[[], Any] | None = None,
    compiled: bool = False,
) -> Row:
    """The row of a served model's timed ``call`` on the token ``ids`` (LM prefill and decode, encoder forwards):
    timed at the cell's math mode after ``start`` (untimed, in inference mode) within ``budget_s``, FLOPs counted
    (and the attention kernels the call ran, read in the same pass; a ``compiled`` call's eagerly), tokens per
    second from the workload's token count, with the family's ``columns`` and ``notes``."""

    def started() -> None:
        with torch.inference_mode(), choice.context(backend.device_type):
            start()

    what = f"{config.pair.teacher}->{config.pair.student} {config.precision} {measurement} bs{batch_size}"
    watch = _Quiesce() if compiled else None
    m = measured_loop(
        call,
        config,
        backend,
        batch_size,
        budget_s,
        choice.tf32,
        lambda: count(call),
        start=started if start is not None else None,
        watch=watch,
        what=what,
        eager_count=compiled,
    )
    counted = m.counted
    return timed_row(
        measurement,
        batch_size,
        m.raw,
        tokens=workload.tokens(measurement, batch_size, config),
        choices=(choice,),
        notes=(m.note, m.raw.note or "", *notes),
        **m.profile,
        **m.flags,
        flops=counted.flops if counted is not None else None,
        attention_kernel=kernel_label(counted.attention) if counted is not None else None,
        autocast=choice.applied,
        runtime="eager",
        grad_mode=INFERENCE_MODE,  # call runs under torch.inference_mode(), as every serving call
        seq_len=config.data.seq_len,
        **columns,
        data_ptr_mod64=ids.data_ptr() % 64,
    )
