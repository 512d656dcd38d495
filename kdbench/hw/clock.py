"""Clocks: what a timed loop reads, on the host or on a GPU.

A ``Clock`` hands out stamps and turns pairs of them into milliseconds *after* the
loop: on the host a stamp is ``time.perf_counter_ns()``; on a GPU it is a
recorded ``torch.cuda.Event`` (a HIP event on ROCm), whose elapsed time is read
only once the loop is over and the device synchronised, so timing never adds a
host-device sync inside the loop.  The backend hands out the clock that fits it
(:meth:`kdbench.hw.backends.Backend.clock`); :func:`kdbench.measure.timing.timed_loop` reads it.
"""

from __future__ import annotations

import time
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

    def ready(self, stamp: int) -> bool:
        return True


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

    def ready(self, stamp: torch.cuda.Event) -> bool:
        """Whether the device has reached the event (no synchronize)."""
        return bool(stamp.query())

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)
