"""Contention: how much of the machine other processes used while kdbench measured.

A figure measured while other work runs on the same cores reads slow (the issue that brought this in: a CPU
step 3.5x the README's, every cell noisy, and nothing on any row saying the machine was busy).  So every timed
measurement is watched by a :class:`HostMeter` over its timed window: the CPU time the cores this process may
run on (its affinity) spent busy, from psutil's per-core times, minus the CPU time of this run's own process
tree (the engine, its workers and ranks: :func:`own_processes`) over the same wall interval.  What is left is
the others' (:class:`HostLoad`):

- ``host_busy_share`` = others' CPU seconds / (wall seconds x usable cores): 0 on an idle machine, 1 when
  others kept every usable core busy;
- ``contended``: the others left this run fewer cores than its threads need, with a margin:
  ``usable - others' cores < FREE_SHARE x min(threads, usable)``.

Why that rule and margin: on CI's 2-core machine a measurement with 1 torch thread runs beside the other
pytest-xdist worker (one more single-threaded process); that one takes a core and leaves 1.0 free of the 1.0
needed: not contended, and kernel threads and daemons (a few hundredths of a core) stay well inside the
margin.  Two CPU-bound processes more on those 2 cores share them fairly with this run's thread, leave it
2/3 of a core (others' CPU time is what they *got*, not what they asked for: with 3 runnable threads on 2
cores each gets 2/3): under the 0.75 needed, so contended.  More load only leaves less.

On GPUs the device's other processes (NVML / amdsmi process lists, read by :mod:`kdbench.measure.telemetry`)
are counted by :func:`others_on_device` and any one of them makes the row contended too.

:func:`look_later` ends the short look a run takes as it starts (its warning, :func:`busy_warning`).
Torch-free.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import psutil

from kdbench.core.limits import CONTENDED_FREE_SHARE
from kdbench.core.names import CONTENDED_NOTE

FREE_SHARE = CONTENDED_FREE_SHARE  # the share of the cores its threads need a measurement must have had (limits.py)
SAMPLE_S = 0.4  # the look before a run's first cell
# psutil's per-core times tick every 10 ms (USER_HZ): over a 0.25 s window on 2 cores the share is good to about
# +-0.06 (0.12 of a core, within the rule's 0.25-core margin).  A shorter timed window is read from the
# measurement's start (cold and warm-up calls included); shorter still, nothing is said (null).
MIN_WINDOW_S = 0.25
RUN_PID_ENV = "KDBENCH_RUN_PID"  # the engine's process id, inherited by its workers and ranks: the run's tree
# The GPU contexts the run's own processes hold beyond the measuring one, where the driver lists host pids (another
# pid namespace) and none can be matched: a caller that holds one itself while it runs kdbench (the device check,
# which also roots the run at itself through KDBENCH_RUN_PID) sets it to 1.
OWN_CONTEXTS_ENV = "KDBENCH_OWN_GPU_CONTEXTS"
_NOT_BUSY = ("idle", "iowait", "guest", "guest_nice")  # guest times are already inside user (Linux)


@dataclass(frozen=True)
class HostLoad:
    """What other processes used of the cores this run may use, over one wall interval."""

    wall_s: float
    cores: int  # the cores this process may run on (its affinity)
    others_cpu_s: float  # CPU seconds other processes used on them
    threads: int  # threads this measurement needs (torch's intra-op threads x ranks on this host)

    @property
    def busy_share(self) -> float:
        return self.others_cpu_s / (self.wall_s * self.cores) if self.wall_s > 0 and self.cores else 0.0

    @property
    def others_cores(self) -> float:
        return self.others_cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def needed(self) -> int:
        return max(1, min(self.threads, self.cores))

    @property
    def free_cores(self) -> float:
        return max(0.0, self.cores - self.others_cores)

    @property
    def contended(self) -> bool:
        return self.wall_s > 0 and self.free_cores < FREE_SHARE * self.needed

    def describe(self) -> str:
        """'other processes used 1.4 of the 2 cores kdbench may run on (host_busy_share 0.70), leaving 0.6
        for its 1 thread(s)'."""
        return (
            f"other processes used {self.others_cores:.1f} of the {self.cores} cores kdbench may run on "
            f"(host_busy_share {self.busy_share:.2f}), leaving {self.free_cores:.1f} for its {self.threads} thread(s)"
        )


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity; every core where the platform has none)."""
    try:
        return sorted(psutil.Process().cpu_affinity())
    except (AttributeError, psutil.Error, OSError):  # macOS has no affinity
        return list(range(psutil.cpu_count() or 1))


def busy_cpu_s(cores: Iterable[int]) -> float:
    """CPU seconds the given cores have spent busy since boot (every process's), from psutil's per-core times."""
    per_core = psutil.cpu_times(percpu=True)
    chosen = [per_core[i] for i in cores if i < len(per_core)] or per_core
    fields = per_core[0]._fields
    return sum(sum(getattr(t, f) for f in fields if f not in _NOT_BUSY) for t in chosen)


def _root() -> psutil.Process:
    """The run's root process: the engine named by ``KDBENCH_RUN_PID`` when it is this process or an ancestor,
    else this process."""
    me = psutil.Process()
    pid = os.environ.get(RUN_PID_ENV, "")
    if pid.isdigit() and int(pid) != me.pid:
        try:
            for parent in me.parents():
                if parent.pid == int(pid):
                    return parent
        except psutil.Error:
            pass
    return me


def own_processes() -> list[psutil.Process]:
    """This run's process tree: its root (:func:`_root`) and every descendant alive now."""
    root = _root()
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return [root]


def own_cpu_s(processes: Iterable[psutil.Process]) -> dict[tuple[int, float], float]:
    """CPU seconds of each process (user + system, and its reaped children's), keyed by (pid, start time)."""
    out = {}
    for p in processes:
        try:
            with p.oneshot():
                t = p.cpu_times()
                out[(p.pid, p.create_time())] = t.user + t.system + t.children_user + t.children_system
        except psutil.Error:  # gone since it was listed
            continue
    return out


Reader = Callable[[], tuple[float, float, float]]  # (wall s, busy CPU s of the usable cores, own CPU s)


class HostMeter:
    """Watch the host over a window: call :meth:`start` and :meth:`stop` (or use :attr:`on_window`, the
    callbacks :func:`kdbench.measure.timing.timed_loop` calls at its timed window's edges); :meth:`result`
    is the others' share of it.  ``reader`` replaces psutil (tests); ``cores`` the usable core count."""

    def __init__(self, threads: int, reader: Reader | None = None, cores: int | None = None):
        self.threads = threads
        self.cores_list = usable_cores() if cores is None else list(range(cores))
        self.reader = reader or self._read
        self._marks: list[tuple[float, float, float]] = []
        self._begin: tuple[float, float, float] | None = None
        self._own: dict[tuple[int, float], float] = {}

    def _read(self) -> tuple[float, float, float]:
        now = own_cpu_s(own_processes())
        # the tree's CPU seconds since the first reading: a process seen then counts from there, a later one whole
        own = sum(v - self._own.get(k, 0.0) for k, v in now.items()) if self._own else 0.0
        if not self._own:
            self._own = now
        return time.perf_counter(), busy_cpu_s(self.cores_list), own

    def begin(self) -> None:
        """Mark the measurement's start (before its cold call): the fallback for a window too short to read."""
        self._own, self._marks = {}, []
        self._begin = self.reader()

    def start(self) -> None:
        self._marks = [self.reader()]

    def stop(self) -> None:
        if self._marks:
            self._marks.append(self.reader())

    @property
    def on_window(self) -> tuple[Callable[[], None], Callable[[], None]]:
        return self.start, self.stop

    def result(self) -> HostLoad | None:
        """The others' load over the window, or from :meth:`begin` where the window is shorter than
        :data:`MIN_WINDOW_S`; None when even that is (per-core times tick every 10 ms: too coarse) or the window
        was not opened and closed."""
        if len(self._marks) != 2:
            return None
        start, end = self._marks
        if end[0] - start[0] < MIN_WINDOW_S and self._begin is not None:
            start = self._begin
        (t0, busy0, own0), (t1, busy1, own1) = start, end
        if t1 - t0 < MIN_WINDOW_S:
            return None
        cores = len(self.cores_list)
        others = min(max(0.0, (busy1 - busy0) - (own1 - own0)), (t1 - t0) * cores)
        return HostLoad(t1 - t0, cores, others, self.threads)


def look_later(meter: HostMeter, then: Callable[[HostLoad], None], seconds: float = SAMPLE_S) -> threading.Timer:
    """End the look ``meter`` began (:meth:`HostMeter.start`) ``seconds`` after it began, in a timer thread so
    that the run does not wait for it, and hand its load to ``then``; ``cancel()`` the timer to drop it."""

    def end() -> None:
        meter.stop()
        load = meter.result()
        if load is not None:
            then(load)

    began = meter._marks[0][0] if meter._marks else time.perf_counter()
    timer = threading.Timer(max(0.0, seconds - (time.perf_counter() - began)), end)
    timer.daemon = True
    timer.start()
    return timer


def others_on_device(listed: Iterable[int], own: Iterable[int], extra_contexts: int | None = None) -> int:
    """How many of the processes a GPU lists (their pids) are not this run's.  None of ours among them means
    another pid namespace (a container: the driver lists host pids): then ours are among them, unnamed: the
    measuring process and ``extra_contexts`` more (default: :data:`OWN_CONTEXTS_ENV`, else 0)."""
    listed, own = set(listed), set(own)
    if not listed:
        return 0
    if listed & own:
        return len(listed - own)
    if extra_contexts is None:
        value = os.environ.get(OWN_CONTEXTS_ENV, "")
        extra_contexts = int(value) if value.isdigit() else 0
    return max(0, len(listed) - 1 - extra_contexts)


def contention_columns(host: HostLoad | None, device_others: int | None) -> tuple[dict[str, Any], str]:
    """The row's contention columns and its note ('' when not contended)."""
    contended = bool((host is not None and host.contended) or device_others)
    columns = {
        "host_busy_share": host.busy_share if host is not None else None,
        "device_other_processes": device_others,
        "contended": contended if host is not None or device_others is not None else None,
    }
    if not contended:
        return columns, ""
    why = []
    if host is not None and host.contended:
        why.append(host.describe())
    if device_others:
        why.append(f"{device_others} other process(es) ran on the GPU (device_other_processes)")
    note = (
        f"{CONTENDED_NOTE}{'; '.join(why)} while this was measured, so it reads slow; compare and budgets leave it out "
        "unless --judge-contended"
    )
    return columns, note


def busy_warning(load: HostLoad, when: str) -> str:
    """The run's warning about a busy machine, with the figure and what to do."""
    return (
        f"the machine is busy {when}: {load.describe()}; figures measured now read slow and their rows are "
        "flagged contended: wait until it is idle, run with --threads 1, or pin kdbench to free cores "
        "(taskset -c CORES python -m kdbench run ...)"
    )
