"""Memory of one measurement: the peak and the growth inside a ``with`` block.

Before the block, garbage is collected (and on GPUs the allocator's cache emptied), so
nothing an earlier measurement left behind counts.  On GPUs the caching allocator's peak
counters (exact, tensor memory only); on the CPU the kernel's high-water mark of this
process (VmHWM, reset at entry through /proc/self/clear_refs), or where that is
unavailable RSS sampled from a thread (a sampled maximum: a spike shorter than the
interval can be missed).

The host's peak is read beside the device's on every backend (``host_peak_bytes``): the
process's VmHWM over the block, reset at entry; on the CPU it is the same peak as the
device's.  On a GPU where the kernel keeps no resettable high-water mark (not Linux) it is
not read (None): a sampling thread would compete with the timed launches.

The live tensor peak of one more step (:func:`step_live_peak`, ``live_peak_bytes``) is the figure the fit
planner's prediction is checked against: on GPUs the allocator's peak over that step, on the CPU the bytes of
the live tensors before it plus the peak of the allocations during it (:func:`live_tensor_peak`), not the
process's resident memory (which holds the interpreter, the libraries and the allocator's free pages too).
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import psutil
import torch
from torch._subclasses.fake_tensor import FakeTensor  # torch 2.5-2.14 keep it here

from kdbench.hw.backends import Backend


@dataclass(frozen=True)
class MemoryUsage:
    kind: str  # "rss_hwm" (kernel high-water mark), "rss" (sampled) or "device" (allocator counters)
    peak_bytes: int  # max RSS sampled / torch.cuda.max_memory_allocated
    peak_reserved_bytes: int | None  # torch.cuda.max_memory_reserved (None for rss)
    growth_bytes: int  # at exit minus at entry (RSS, or memory_allocated)
    footprint_bytes: int  # the peak minus what was in use at entry: what this measurement needed
    host_peak_bytes: int | None = None  # the process's peak resident memory over the block (None: not readable)


def _hwm_bytes() -> int | None:
    """This process's peak resident set (VmHWM) as the Linux kernel keeps it."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return _hwm_bytes() is not None


def freeze_imports() -> None:
    """Hide what is alive now from the garbage collector, once per measuring process, after its imports.

    The ``gc.collect()`` before each measurement (:class:`MemoryMeter`) would otherwise scan torch's and
    the other modules' objects every time, several hundred thousand: 150 ms a collection on this
    machine, three per cell, which made a sweep of tiny cells 13x slower.  Frozen objects are still
    freed by reference counting; only cycles among them would never be collected, and imports make
    none that matter.  What the measurements create later is collected as before.

    The modules every cell imports on first use (torch._dynamo, through the optimizers; torchvision's
    models and PIL, through the model registry) are imported first, so that they are frozen too: they
    hold most of the objects (a collection after one tiny cell scanned 141 000 objects in 65 ms
    without them, 18 000 in 4 ms with them)."""
    import torch._dynamo  # noqa: F401
    import torchvision.models  # noqa: F401

    gc.collect()
    gc.freeze()


class MemoryMeter:
    """Peak and growth of memory inside a `with` block, on `backend`'s device.

    On the CPU it prefers the kernel's exact high-water mark (VmHWM, reset at entry
    through /proc/self/clear_refs; kind ``rss_hwm``): no sampling thread competes with
    the measured code for the GIL.  Where that is unavailable it samples RSS from a
    thread (kind ``rss``).
    """

    def __init__(self, backend: Backend, interval_s: float = 0.002):
        self.backend = backend
        self.interval_s = interval_s
        self.rss_before: int | None = None
        self.allocated_before: int | None = None
        self._usage: MemoryUsage | None = None
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc = psutil.Process()
        self._hwm = False

    @property
    def _gpu(self) -> bool:
        return self.backend.device_type == "cuda"

    def __enter__(self) -> MemoryMeter:
        # What earlier measurements left unreferenced (cycles included) goes first, so the peak is this one's.
        gc.collect()
        if self._gpu:
            device = self.backend.device
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # the pool earlier measurements grew: max_memory_reserved starts from here
            torch.cuda.reset_peak_memory_stats(device)
            self.allocated_before = int(torch.cuda.memory_allocated(device))
            self._hwm = _reset_hwm()  # the host's peak beside the device's
            return self
        self.rss_before = self._peak = self._proc.memory_info().rss
        self._hwm = _reset_hwm()
        if self._hwm:
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="kdbench-rss", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, self._proc.memory_info().rss)

    def __exit__(self, *exc: Any) -> None:
        device = self.backend.device
        if self._gpu:
            peak = int(torch.cuda.max_memory_allocated(device))
            host = self._proc.memory_info().rss if self._hwm else None
            self._usage = MemoryUsage(
                kind="device",
                peak_bytes=peak,
                peak_reserved_bytes=int(torch.cuda.max_memory_reserved(device)),
                growth_bytes=int(torch.cuda.memory_allocated(device)) - self.allocated_before,
                footprint_bytes=peak - self.allocated_before,
                host_peak_bytes=max(_hwm_bytes() or host, host) if host is not None else None,
            )
            return
        rss_after = self._proc.memory_info().rss
        if self._hwm:
            peak = max(_hwm_bytes() or rss_after, rss_after)
            growth, footprint = rss_after - self.rss_before, peak - self.rss_before
            self._usage = MemoryUsage("rss_hwm", peak, None, growth, footprint, host_peak_bytes=peak)
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        peak = max(self._peak, rss_after)
        self._usage = MemoryUsage("rss", peak, None, rss_after - self.rss_before, peak - self.rss_before, peak)

    def result(self) -> MemoryUsage:
        if self._usage is None:
            raise RuntimeError("MemoryMeter.result() is available after the `with` block")
        return self._usage


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: an FSDP2 DTensor's local shard, else the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors an optimizer keeps per parameter (moments, step counters ...), on this rank (an FSDP2
    cell's states are DTensors: their local shards)."""
    return sum(_local(v).nbytes for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


def model_state_bytes(modules, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds of the modules' parameters and gradients and of the optimizer's state (an FSDP2
    cell's: their local shards; a DDP or single-device cell's: whole copies)."""
    params = {id(p): p for m in modules for p in m.parameters()}.values()
    held = sum(_local(p).nbytes + (_local(p.grad).nbytes if p.grad is not None else 0) for p in params)
    return held + optimizer_state_bytes(optimizer)


def memory_columns(usage: MemoryUsage) -> dict[str, Any]:
    return {
        "memory_kind": usage.kind,
        "peak_memory_bytes": usage.peak_bytes,
        "peak_reserved_bytes": usage.peak_reserved_bytes,
        "memory_growth_bytes": usage.growth_bytes,
        "memory_footprint_bytes": usage.footprint_bytes,
        "host_peak_bytes": usage.host_peak_bytes,
    }


def _storage_key(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage (None: it has none of its own, as a DTensor, a sparse tensor or a fake tensor
    a compile or the fit check left alive, whose data pointer torch warns about reading)."""
    if isinstance(t, FakeTensor):
        return None
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return ptr or None


def live_tensor_bytes(device_type: str = "cpu", not_counted: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of every tensor storage alive in this process on ``device_type``, each storage once: the tensors the
    garbage collector's walk of Python objects finds (parameters, gradients, optimizer state, batches, caches),
    but the storages of ``not_counted`` (what the process keeps besides the measured work: a worker's model cache)."""
    skip = {k for k in map(_storage_key, not_counted) if k is not None}
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor) or obj.device.type != device_type:  # type(): no __class__ lookup
            continue
        key = _storage_key(obj)  # None: no storage of its own (a DTensor), or one FSDP2 freed in place
        if key is not None and key not in skip:
            storages[key] = obj.untyped_storage().nbytes()
    return sum(storages.values())


class LivePeakUnavailable(RuntimeError):
    """The live tensor peak could not be read (the profiler would not start, or its memory events could not be
    read); the measured call ran all the same."""


def live_tensor_peak(fn, not_counted: Iterable[torch.Tensor] = ()) -> int:
    """The peak of live tensor bytes on the CPU during ``fn()``: what is alive before (:func:`live_tensor_bytes`,
    ``not_counted`` left out) plus the peak of the allocations made during the call net of its frees, in the order
    ``torch.profiler``'s memory profiling records them (``profile_memory``: every allocation and free of torch's
    CPU allocator, kernels' own workspaces included).  Independent of the fit planner's count, which it checks
    (``predicted_peak_ratio``).  A profiler that cannot start or be read raises :class:`LivePeakUnavailable` after
    ``fn()`` has run (data-parallel partners count on the call); ``fn``'s own errors pass through."""
    base = live_tensor_bytes("cpu", not_counted)
    # kineto (torch's profiler library) prints 'USDT: ... profiler_start', '... profiler_stop' and, on a machine
    # without a GPU, 'ERROR: ... gpuGetDeviceCount failed' on stderr each time: between every CPU run's progress
    # lines.  Its level 6 is above all of them; it is read when the profiler first starts in the process, and a
    # KINETO_LOG_LEVEL of the user's own stands.  Only this CPU path sets it (a GPU's live peak is its allocator's).
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    try:
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        prof.__enter__()
    except Exception as exc:
        fn()
        raise LivePeakUnavailable(_profiler_failed(exc)) from exc
    try:
        fn()
    finally:
        try:
            prof.__exit__(None, None, None)
        except Exception as exc:
            raise LivePeakUnavailable(_profiler_failed(exc)) from exc
    try:
        events: list[tuple[int, int]] = []
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                events.append((node.start_time_ns, node.extra_fields.alloc_size))
            stack.extend(node.children)
    except Exception as exc:
        raise LivePeakUnavailable(_profiler_failed(exc)) from exc
    net = peak = 0
    for _, size in sorted(events):
        net += size
        peak = max(peak, net)
    return base + peak


def _profiler_failed(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"the profiler failed: {type(exc).__name__}: {text[0] if text else ''}"[:300]


def step_live_peak(fn, backend: Backend, not_counted: Iterable[torch.Tensor] = ()) -> tuple[int | None, str | None]:
    """The peak of this device's live tensor bytes during one more call of ``fn`` (a step after the timed loop),
    or None and why it could not be read: on GPUs the caching allocator's peak of allocated bytes over the call
    (``max_memory_allocated``, reset to what is allocated as it starts, garbage collected first), on the CPU
    :func:`live_tensor_peak` (``not_counted``: host tensors that are not the step's, left out).  What
    ``live_peak_bytes`` stores."""
    if backend.device_type != "cuda":
        try:
            return live_tensor_peak(fn, not_counted), None
        except LivePeakUnavailable as exc:
            return None, str(exc)
    device = backend.device
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device)), None
