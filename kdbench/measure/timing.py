"""Timers and the timed loop.

A ``Clock`` hands out stamps and turns pairs of them into milliseconds *after* the
loop: on the host a stamp is ``time.perf_counter_ns()``; on a GPU it is a
recorded ``torch.cuda.Event`` (a HIP event on ROCm), whose elapsed time is read
only once the loop is over and the device synchronised, so timing never adds a
host-device sync inside the loop.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class Clock(Protocol):
    name: str

    def stamp(self) -> Any: ...

    def elapsed_ms(self, start: Any, end: Any) -> float: ...

    def sync(self) -> None: ...


class HostClock:
    """The host's monotonic clock: right for the CPU, where work is synchronous."""

    name = "perf_counter_ns"
    host = True  # what it times is host time already

    def stamp(self) -> int:
        return time.perf_counter_ns()

    def elapsed_ms(self, start: int, end: int) -> float:
        return (end - start) / 1e6

    def sync(self) -> None:
        pass


class EventClock:
    """Device events recorded on the current stream; read after synchronising."""

    name = "device_event"
    host = False

    def __init__(self, device: torch.device):
        self.device = device
        # The stream the measured work runs on, looked up at the first stamp and kept: a stamp inside a
        # timed loop is then only an event and its record (launch-bound cells feel every microsecond).
        self._stream: torch.cuda.Stream | None = None

    def stamp(self) -> torch.cuda.Event:
        if self._stream is None:
            self._stream = torch.cuda.current_stream(self.device)
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        return event

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return float(start.elapsed_time(end))

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)


@dataclass(frozen=True)
class RawTiming:
    first_ms: float  # the cold first call, kept out of the samples
    samples_ms: list[float]
    clock: str
    warmup_ms: list[float] = field(default_factory=list)  # the untimed warm-up calls, in order
    window_s: tuple[float, float] | None = None  # host perf_counter() at the start and end of the timed calls
    host_ms: list[float] = field(default_factory=list)  # device clocks: host time to issue each warm-up call

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


def timed_loop(
    fn: Callable[[], Any],
    clock: Clock,
    *,
    warmup: int,
    min_iters: int,
    min_time_s: float,
    max_iters: int,
    on_window: tuple[Callable[[], Any], Callable[[], Any]] | None = None,
) -> RawTiming:
    """Time `fn`: one cold call, `warmup` untimed calls, then timed calls until both
    `min_iters` and `min_time_s` are reached (or `max_iters`).

    ``on_window`` (start, end) are called at the edges of the timed window, right after the
    synchronisations that open and close it (e.g. to read an energy counter there).

    With a device clock each warm-up call starts on an idle device and the host's time to
    issue it is kept (``host_ms``): what the host costs per call, apart from the device's
    work, which tells launch-bound calls apart (:meth:`RawTiming.launch_bound`)."""
    start = clock.stamp()
    fn()
    end = clock.stamp()
    clock.sync()
    first = clock.elapsed_ms(start, end)
    warm: list[tuple[Any, Any]] = []
    host: list[float] = []
    issue = not getattr(clock, "host", True)
    for _ in range(warmup):
        began = time.perf_counter_ns()
        start = clock.stamp()
        fn()
        warm.append((start, clock.stamp()))
        if issue:
            host.append((time.perf_counter_ns() - began) / 1e6)
            clock.sync()  # the next call starts on an idle device too
    if not (issue and warmup):  # else the last warm-up call's sync stands
        clock.sync()
    if on_window is not None:
        on_window[0]()
    marks: list[tuple[Any, Any]] = []
    window_start = time.perf_counter()
    deadline = window_start + min_time_s
    while True:
        start = clock.stamp()
        fn()
        marks.append((start, clock.stamp()))
        n = len(marks)
        if n >= max_iters or (n >= min_iters and time.perf_counter() >= deadline):
            break
    clock.sync()
    window = (window_start, time.perf_counter())
    if on_window is not None:
        on_window[1]()
    samples = [clock.elapsed_ms(a, b) for a, b in marks]
    return RawTiming(first, samples, clock.name, [clock.elapsed_ms(a, b) for a, b in warm], window, host)
