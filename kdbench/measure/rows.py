"""The row toolkit every measurement shares, whatever the pair's family: the timed loop with its profile, the
one builder of a timed row, and the rows of measurements that did not run.

A timed row (:func:`timed_row`) is the measurement's name and batch size, the timing columns of its timed loop
(:func:`timing_columns`: median, interval, samples, cold call, throughput; tokens per second for token
workloads), its notes (the precision choices', launch-bound, the caller's) and the caller's own columns.  The
distillation step (:mod:`kdbench.measure.step`), image inference (:mod:`kdbench.workloads.vision`) and token
serving (:func:`kdbench.measure.serving.token_serving_row`) all build their rows with it, the last two timing
their call by :func:`measured_loop` (the math mode, the timed loop, the math flags, the FLOPs counted after).
Nothing here asks the plan: a measurement's share of its cell's time budget is handed in.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kdbench.config.schema import CellConfig
from kdbench.core.names import Measurement, Status
from kdbench.core.schema import Row
from kdbench.core.stats.samples import summarize
from kdbench.hw.backends import Backend, math_flags, math_mode
from kdbench.hw.contention import HostMeter, contention_columns
from kdbench.measure import walltime
from kdbench.measure.levers import LeverWatch, eager
from kdbench.measure.memory import MemoryMeter, memory_columns
from kdbench.measure.telemetry import TelemetrySampler, telemetry_columns
from kdbench.measure.timing import Progress, RawTiming, timed_loop

if TYPE_CHECKING:
    from kdbench.measure.parallel import DataParallel

logger = logging.getLogger(__name__)

CELL_BUDGET_S = {"cpu": 300.0}  # a cell's default time budget per backend (none on GPUs)

LAUNCH_BOUND = (
    "launch-bound: issuing a call costs the host about as long as the device runs it, so this measures Python "
    "and kernel launches, not the GPU"
)


def measurement_budget_s(config: CellConfig, backend: Backend, measurements: int) -> float | None:
    """A measurement's share of its cell's time budget (``timing.cell_budget_s``, else the backend's), the cell
    making ``measurements`` rows."""
    budget = config.timing.cell_budget_s or CELL_BUDGET_S.get(backend.name)
    return budget / measurements if budget else None


def _progress(what: str) -> Progress:
    def tell(phase: str, done: int, planned: int, per_call_s: float) -> None:
        left = max(planned - done, 0) * per_call_s
        logger.info(
            "  ... %s: %s %d/%d, %.3g s per call, ~%.0f s left of this measurement",
            what,
            phase,
            done,
            planned,
            per_call_s,
            left,
        )

    return tell


def profiled_loop(
    fn: Callable[[], Any],
    config: CellConfig,
    backend: Backend,
    batch_size: int,
    budget_s: float | None,
    dp: DataParallel | None = None,
    watch: LeverWatch | None = None,
    what: str = "",
) -> tuple[RawTiming, Row, str]:
    """``fn`` timed by the cell's timing settings (within ``budget_s``; under data parallelism the ranks' agreed
    loop), with memory and (on GPUs) telemetry watched over the loop, and the levers' counters (``watch``):
    the timing, the profile columns and a note on them.  The host's other processes (and the GPU's) are
    watched over the timed window too (:mod:`kdbench.hw.contention`): the contention columns, and a note when
    the row is contended."""
    host = HostMeter(threads_needed(backend, dp))
    host.begin()
    with MemoryMeter(backend) as memory, TelemetrySampler(backend) as telemetry:
        edges = _both(telemetry.on_window, host.on_window)
        on_window = watch.chain(edges) if watch is not None else edges
        if dp is not None:
            raw = dp.timed(fn, config, backend, on_window)
        else:
            t = config.timing
            raw = timed_loop(
                fn,
                backend.clock(),
                warmup=t.warmup,
                min_iters=t.min_iters,
                min_time_s=t.min_time_s,
                max_iters=t.max_iters,
                on_window=on_window,
                target_rel_ci=t.target_rel_ci,
                max_time_s=t.max_time_s,
                budget_s=budget_s,
                progress=_progress(what),
            )
    walltime.add(walltime.COLD, raw.cold_s)
    walltime.add(walltime.WARMUP, raw.warmup_s)
    if raw.window_s:
        walltime.add(walltime.MEASURING, raw.window_s[1] - raw.window_s[0])
    tele = telemetry.result(len(raw.samples_ms), batch_size, raw.window_s)
    contention, busy = contention_columns(host.result(), telemetry.other_processes)
    note = "; ".join(n for n in (tele.note, busy) if n)
    return raw, {**memory_columns(memory.result()), **telemetry_columns(tele), **contention}, note


@dataclass
class Measured:
    """A call timed by :func:`measured_loop`: its timing, profile columns and note, the math flags it ran under,
    and what its count returned (None: over its time budget, or nothing counted)."""

    raw: RawTiming
    profile: Row
    note: str
    flags: Row
    counted: Any = None


def measured_loop(
    fn: Callable[[], Any],
    config: CellConfig,
    backend: Backend,
    batch_size: int,
    budget_s: float | None,
    tf32: bool,
    count: Callable[[], Any] | None = None,
    *,
    start: Callable[[], Any] | None = None,
    watch: LeverWatch | None = None,
    what: str = "",
    eager_count: bool = False,
) -> Measured:
    """``fn`` measured as a serving row measures it, under the math mode ``tf32``: ``start()`` first (untimed),
    then :func:`profiled_loop`, the math flags the loop ran under, and ``count()`` (its FLOPs, counted apart in the
    wall-time split; eagerly with ``eager_count``, a compiled call's eager ops being the same) unless the loop
    ran over its time budget."""
    with math_mode(tf32):
        if start is not None:
            start()
        raw, profile, note = profiled_loop(fn, config, backend, batch_size, budget_s, watch=watch, what=what)
        flags = math_flags()
        counted = None
        if count is not None and not raw.note:
            with eager() if eager_count else contextlib.nullcontext(), walltime.spent(walltime.FLOPS):
                counted = count()
    return Measured(raw, profile, note, flags, counted)


def threads_needed(backend: Backend, dp: DataParallel | None = None) -> int:
    """The host threads a measurement keeps busy: torch's intra-op threads on the CPU (one per rank on a GPU,
    which launches), times the ranks (on one host: kdbench starts a cell's ranks together)."""
    import torch

    per_rank = torch.get_num_threads() if backend.device_type == "cpu" else 1
    return per_rank * (dp.world_size if dp is not None else 1)


def _both(*pairs: tuple[Callable[[], Any], Callable[[], Any]]) -> tuple[Callable[[], None], Callable[[], None]]:
    """One (start, end) pair of window callbacks that calls each pair's, the ends in reverse order."""

    def start() -> None:
        for pair in pairs:
            pair[0]()

    def end() -> None:
        for pair in reversed(pairs):
            pair[1]()

    return start, end


def timing_columns(raw: RawTiming, world_size: int, batch_size: int) -> Row:
    summary = summarize(raw.samples_ms)
    steady = raw.time_to_steady()
    window_ms = (raw.window_s[1] - raw.window_s[0]) * 1e3 if raw.window_s else None
    return {
        "host_ms": statistics.median(raw.host_ms) if raw.host_ms else None,
        "launch_bound": raw.launch_bound(summary.median_ms),
        "window_ms": window_ms,
        **summary.as_row(),
        "thin": raw.thin,
        "first_ms": raw.first_ms,
        "cold_excess_ms": raw.cold_excess_ms(summary.median_ms),
        "samples_ms": raw.samples_ms,
        "timer": raw.clock,
        "throughput": world_size * batch_size / (summary.median_ms / 1e3) if summary.median_ms > 0 else None,
        "window_throughput": (world_size * batch_size * len(raw.samples_ms) / (window_ms / 1e3) if window_ms else None),
        "time_to_steady_ms": steady[0] if steady else None,
        "steady_after_iters": steady[1] if steady else None,
    }


def token_columns(tokens: int | None, median_ms: float, ranks: int = 1) -> Row:
    """Tokens per timed call (per rank) and per second (all ``ranks``) of a token workload's measurement, at the
    median call (:func:`timing_columns`' ``median_ms``); nothing for other workloads."""
    if tokens is None:
        return {}
    per_s = ranks * tokens / (median_ms / 1e3) if median_ms > 0 else None
    return {"tokens": tokens, "tokens_per_s": per_s}


def join_notes(*choices: Any, extra: Iterable[str] = ()) -> str | None:
    """A row's notes: each precision choice's caveat (``"bf16: ..."``), then ``extra``, blanks and repeats left
    out; None when there is none."""
    notes = [f"{c.precision}: {c.note}" for c in choices if c.note] + [n for n in extra if n]
    return "; ".join(dict.fromkeys(notes)) or None


def timed_row(
    measurement: Measurement,
    batch_size: int,
    raw: RawTiming,
    *,
    world_size: int = 1,
    tokens: int | None = None,
    choices: tuple = (),
    notes: Iterable[str] = (),
    judge_launch: bool = True,
    **columns: Any,
) -> Row:
    """The row of one timed measurement: its timing columns (``world_size`` ranks' throughput; with ``tokens``
    per call, tokens per second), the caller's ``columns``, and notes: the precision ``choices``' caveats, the
    launch-bound warning where it applies, then ``notes`` in order.  ``judge_launch`` False: the calls block the
    host until the device is done (a runtime outside torch), so host and device time agree by construction and
    launch-bound is not judged."""
    timing = timing_columns(raw, world_size, batch_size)
    timing.update(token_columns(tokens, timing["median_ms"], world_size))
    if not judge_launch:
        timing["launch_bound"] = None
    launch = LAUNCH_BOUND if timing["launch_bound"] else ""
    return Row(
        {
            "measurement": measurement,
            "batch_size": batch_size,
            "status": Status.OK,
            **timing,
            **columns,
            "notes": join_notes(*choices, extra=(launch, *notes)),
        }
    )


def failure_rows(planned: Iterable[Mapping[str, Any]], status: Status, error: str) -> list[Row]:
    """The rows of measurements that did not run or did not finish: each planned row (its measurement, batch size
    and whatever else it names) marked with ``status`` and ``error``."""
    return [Row({**row, "status": status, "error": error}) for row in planned]
