"""The timed loop and its raw result.

:func:`timed_loop` times a call with a :class:`kdbench.hw.clock.Clock` (host
``perf_counter_ns`` or device events, read only after the loop, so timing adds no
host-device sync inside it) and returns :class:`RawTiming`: the cold call, the
warm-up calls and the timed samples, with what a time budget did to them.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kdbench.hw.clock import Clock


@dataclass(frozen=True)
class RawTiming:
    first_ms: float  # the cold first call, kept out of the samples
    samples_ms: list[float]
    clock: str
    warmup_ms: list[float] = field(default_factory=list)  # the untimed warm-up calls, in order
    window_s: tuple[float, float] | None = None  # host perf_counter() at the start and end of the timed calls
    host_ms: list[float] = field(default_factory=list)  # device clocks: host time to issue each warm-up call
    note: str | None = None  # why the loop ran other counts than asked (a time budget shrank them)
    warmup_s: float = 0.0  # host wall time of the warm-up calls
    planned_iters: int = 0  # the timed calls asked for (min_iters): fewer makes the measurement thin
    cold_s: float = 0.0  # host wall time of the cold call (compiles, autotuning, first-use set-up)

    @property
    def thin(self) -> bool:
        """Fewer timed calls than asked (a time budget stopped the loop): kept and shown, never judged."""
        return len(self.samples_ms) < self.planned_iters

    def first_calls_ms(self) -> float:
        """How long the cold and warm-up calls took, as the host waited for them: host time from a synchronize
        before the cold call to one after the last warm-up call (what a one-off cost is; device events
        would have to span host-side compiles on an idle stream, which no vendor documents).  The clock's
        own times where no host time was kept."""
        if self.cold_s > 0:
            return (self.cold_s + self.warmup_s) * 1e3
        return self.first_ms + sum(self.warmup_ms)

    def cold_excess_ms(self, median_ms: float) -> float:
        """What the cold and warm-up calls cost beyond as many median calls: paid once per measurement."""
        return max(0.0, self.first_calls_ms() - (1 + len(self.warmup_ms)) * median_ms)

    def launch_bound(self, median_ms: float) -> bool | None:
        """Whether issuing a call costs the host about as long as the device needs to run it (>= 90 %):
        then the device waits for Python and kernel launches, and the cell measures those, not the
        device.  None without host times (host clocks: there host time is all there is)."""
        if not self.host_ms:
            return None
        return statistics.median(self.host_ms) >= 0.9 * median_ms

    def time_to_steady(self, tolerance: float = 0.10) -> tuple[float, int] | None:
        """(ms, calls) from the cold call's start until the end of the first call within
        `tolerance` of the median timed call: what a short job pays before full speed."""
        if not self.samples_ms:
            return None
        median = statistics.median(self.samples_ms)
        elapsed = 0.0
        for i, ms in enumerate([self.first_ms, *self.warmup_ms, *self.samples_ms]):
            elapsed += ms
            if ms <= median * (1 + tolerance):
                return elapsed, i + 1
        return None


PROGRESS_EVERY_S = 10.0  # a long measurement reports its progress at most this often


Progress = Callable[[str, int, int, float], None]  # (phase, calls done, calls planned, seconds per call)


def budget_note(budget_s: float, warmup: int, warm_done: int, min_iters: int, timed: int, cold_s: float) -> str | None:
    """What a time budget did to a measurement's counts, or None when it left them as asked."""
    if warm_done >= warmup and timed >= min_iters:
        return None
    parts = [f"warm-up {warmup} -> {warm_done}"] if warm_done < warmup else []
    if timed < min_iters:
        parts.append(f"timed calls {min_iters} -> {timed}: thin, so compare, budgets and break-even leave it out")
    return (
        f"shrunk to fit a {budget_s:.3g} s time budget (timing.cell_budget_s over the cell's measurements; the cold "
        f"call took {cold_s:.3g} s, later calls estimated from the warm ones): {', '.join(parts)}; FLOPs not counted"
    )


def timed_loop(
    fn: Callable[[], Any],
    clock: Clock,
    *,
    warmup: int,
    min_iters: int,
    min_time_s: float,
    max_iters: int,
    on_window: tuple[Callable[[], Any], Callable[[], Any]] | None = None,
    target_rel_ci: float | None = None,
    max_time_s: float | None = None,
    budget_s: float | None = None,
    progress: Progress | None = None,
) -> RawTiming:
    """Time `fn`: one cold call, `warmup` untimed calls, then timed calls until both
    `min_iters` and `min_time_s` are reached (or `max_iters`).

    With ``target_rel_ci`` the timed calls go on past that point while the 95 % confidence
    interval of their median is wider than ``target_rel_ci`` × the median, up to
    ``max_time_s`` of timed calls (or `max_iters`).  The interval is checked after every
    eighth or so of the calls made (a geometric schedule: O(log n) checks); with a device
    clock a check reads only the calls the device has finished (their end events are ready),
    with no synchronize: the device's queue never drains, so no idle gap enters the next
    sample or the window.

    ``budget_s`` bounds the whole measurement, cold call included: every later call is estimated
    from the latest warm call (never from the cold call, which pays compiles and autotuning), the
    warm-up stops where the rest of it and ``min_iters`` timed calls would not fit, and the timed
    calls stop where the next one would pass the budget (``min_time_s``, ``max_time_s`` and
    ``target_rel_ci`` within it).  The first warm-up call and the first timed call are always made,
    so the measurement has a warm estimate and a sample: the budget may be passed by those two calls
    (and, as it must, by a cold call longer than the budget).  Fewer timed calls
    than ``min_iters`` make the result thin (:attr:`RawTiming.thin`; ``note`` says so).
    ``progress`` is called at most every ``PROGRESS_EVERY_S`` during a long measurement.

    ``on_window`` (start, end) are called at the edges of the timed window, right after the
    synchronisations that open and close it (e.g. to read an energy counter there).

    With a device clock each warm-up call starts on an idle device and the host's time to
    issue it is kept (``host_ms``): what the host costs per call, apart from the device's
    work, which tells launch-bound calls apart (:meth:`RawTiming.launch_bound`)."""
    clock.sync()  # the cold call's host time (``cold_s``) starts on an idle device
    began = time.perf_counter()
    budget_end = began + budget_s if budget_s is not None else math.inf
    start = clock.stamp()
    fn()
    end = clock.stamp()
    clock.sync()
    first = clock.elapsed_ms(start, end)
    cold_s = time.perf_counter() - began
    per_call = max(first / 1e3, 1e-9)  # seconds per call: the cold call's until a warm one is seen
    shown = time.perf_counter()

    def tell(phase: str, done: int, planned: int, now: float) -> None:
        nonlocal shown
        if progress is not None and now - shown >= PROGRESS_EVERY_S:
            shown = now
            progress(phase, done, planned, per_call)

    warm: list[tuple[Any, Any]] = []
    host: list[float] = []
    issue = not getattr(clock, "host", True)
    warm_began = time.perf_counter()
    for i in range(warmup):
        # the first warm call always runs: it tells what later calls cost, which the cold call does not
        if i and (warmup - i + min_iters) * per_call > budget_end - time.perf_counter():
            break
        began_call = time.perf_counter()
        start = clock.stamp()
        fn()
        warm.append((start, clock.stamp()))
        if issue:
            host.append((time.perf_counter() - began_call) * 1e3)
            clock.sync()  # the next call starts on an idle device too
        elif budget_s is not None:
            clock.sync()
        now = time.perf_counter()
        if issue or budget_s is not None:  # synchronised: the wall time is the call's
            per_call = max(now - began_call, 1e-9)
        tell("warm-up", i + 1, warmup, now)
    if not (issue and warm):  # else the last warm-up call's sync stands
        clock.sync()
    warmup_s = time.perf_counter() - warm_began
    if on_window is not None:
        on_window[0]()
    marks: list[tuple[Any, Any]] = []
    window_start = time.perf_counter()
    deadline = min(window_start + min_time_s, budget_end)
    cap = min(window_start + max_time_s if max_time_s is not None else math.inf, budget_end)
    next_check = min_iters
    done = 0  # timed calls the device is known to have finished
    while True:
        start = clock.stamp()
        fn()
        marks.append((start, clock.stamp()))
        n = len(marks)
        if n >= max_iters:
            break
        now = time.perf_counter()
        per_call = (now - window_start) / n
        if now + per_call > budget_end:  # the next call would pass the budget
            break
        if n >= min_iters and now >= deadline:
            if target_rel_ci is None or now >= cap:
                break
            if n >= next_check:  # is the median known well enough? (geometric schedule)
                next_check = n + max(4, n // 8)
                done = _finished(clock, marks, done)  # no synchronize: the device keeps its queue
                if (
                    done >= min_iters
                    and relative_ci([clock.elapsed_ms(a, b) for a, b in marks[:done]]) <= target_rel_ci
                ):
                    break
        tell("timed", n, max(min_iters, n), now)  # the clock read above: nothing more between calls
    clock.sync()
    window = (window_start, time.perf_counter())
    if on_window is not None:
        on_window[1]()
    samples = [clock.elapsed_ms(a, b) for a, b in marks]
    warm_ms = [clock.elapsed_ms(a, b) for a, b in warm]
    note = budget_note(budget_s, warmup, len(warm), min_iters, len(samples), cold_s) if budget_s else None
    return RawTiming(first, samples, clock.name, warm_ms, window, host, note, warmup_s, min_iters, cold_s)


def _finished(clock: Clock, marks: list[tuple[Any, Any]], done: int) -> int:
    """How many of the timed calls in ``marks`` have finished, from the ``done`` known before: their end
    stamps are ready (device events complete in the order recorded on one stream; host stamps always are)."""
    ready = getattr(clock, "ready", None)
    if ready is None:
        return len(marks)
    while done < len(marks) and ready(marks[done][1]):
        done += 1
    return done


def relative_ci(samples_ms: list[float]) -> float:
    """Width of the median's 95 % confidence interval over the median (inf with too few samples)."""
    from kdbench.core.stats.samples import median_ci

    low, high = median_ci(samples_ms)
    median = statistics.median(samples_ms)
    return (high - low) / median if median > 0 and math.isfinite(high - low) else math.inf
