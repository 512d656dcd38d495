"""GPU telemetry over a timed block: power, graphics clock, temperature, kernel activity, energy.

The device is the one torch measures on, matched in ``pynvml`` (CUDA) or ``amdsmi``
(ROCm) by its UUID or PCI address (:func:`device_ids`), never by torch's index: NVML and
amdsmi number the physical GPUs, torch the visible ones (``CUDA_VISIBLE_DEVICES``,
per-task binding), and amdsmi's order can differ from HIP's even without masks.  The id
used is stored with the rows.

Energy comes from the hardware counters read at the edges of the timed window, right
after its synchronisations (NVML's total energy consumption, amdsmi's energy count);
sampled power is integrated only where there is no counter.  A thread samples power,
clock, temperature and activity for their means and maxima; what the driver reports is
smoothed (NVML's power is a ~1 s average on recent GPUs), so figures over windows shorter
than :data:`SHORT_WINDOW_S` are flagged as rough.  At the same edges the device's process list is
read (NVML's compute processes, amdsmi's process list): the processes on it other than this run's
(:func:`kdbench.hw.contention.others_on_device`) make the row ``contended``.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kdbench.core.worker_state import current
from kdbench.hw.backends import Backend
from kdbench.hw.contention import others_on_device, own_processes

SHORT_WINDOW_S = 5.0  # energy over a shorter timed window is flagged: counter granularity, power averaging
_SENTINELS = {0xFFFF, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF}  # "not supported" in amdsmi/NVML structs


def _num(value: Any) -> float | None:
    """A reading as float; None for 'N/A' strings, sentinels and anything non-numeric."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value in _SENTINELS:
        return None
    return float(value)


def _read(getter: Callable[[], Any]) -> float | None:
    try:
        return _num(getter())
    except Exception:  # an unsupported sensor raises; that metric is simply unknown
        return None


@dataclass(frozen=True)
class DeviceIds:
    """How the management libraries can find torch's device: its UUID and its PCI address."""

    uuid: str | None = None  # as torch reports it, without NVML's "GPU-" prefix
    # PCI domain:bus:device.function, e.g. "0000:3b:00.0".  torch reports no function: it is written .0, right for
    # NVIDIA (MIG instances share one function) but not for a partitioned MI300X, whose partitions are functions
    # of one slot (matched by UUID, see _AmdSmi)
    bdf: str | None = None


def device_ids(backend: Backend) -> DeviceIds:
    """The UUID and PCI address of ``backend``'s GPU, as torch sees it."""
    import torch

    props = torch.cuda.get_device_properties(backend.device)
    uuid = str(getattr(props, "uuid", "") or "") or None
    bus = getattr(props, "pci_bus_id", None)
    bdf = None
    if bus is not None:
        bdf = f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
    return DeviceIds(uuid, bdf)


def _slot(bdf: str) -> tuple[int, str]:
    """A PCI address's domain (as a number) and bus:device, without the function."""
    domain, rest = bdf.lower().split(":", 1)
    return int(domain, 16), rest.split(".")[0]


def _same_slot(a: str | None, b: str | None) -> bool:
    """The same PCI slot (domain, bus, device), whatever the function: one GPU, or partitions of one."""
    return bool(a and b) and _slot(a) == _slot(b)  # type: ignore[arg-type]


def _same_bdf(a: str | None, b: str | None) -> bool:
    """PCI addresses compared whatever the domain width and case ("00000000:3B:00.0" == "0000:3b:00.0")."""
    if not a or not b:
        return False
    (da, rest_a), (db, rest_b) = a.lower().split(":", 1), b.lower().split(":", 1)
    return int(da, 16) == int(db, 16) and rest_a == rest_b


class _Nvml:
    """pynvml (nvidia-ml-py): power in mW, clocks in MHz, temperature in C, activity in %, energy in mJ."""

    name = "pynvml"

    def __init__(self, lib: Any, ids: DeviceIds):
        self.lib = lib
        lib.nvmlInit()
        self.handle, self.matched = None, None
        if ids.uuid:
            uuid = ids.uuid if ids.uuid.startswith(("GPU-", "MIG-")) else f"GPU-{ids.uuid}"
            try:
                self.handle, self.matched = lib.nvmlDeviceGetHandleByUUID(uuid), uuid
            except Exception:
                pass
        if self.handle is None and ids.bdf:
            get = getattr(lib, "nvmlDeviceGetHandleByPciBusId_v2", None) or lib.nvmlDeviceGetHandleByPciBusId
            try:
                self.handle, self.matched = get(ids.bdf), ids.bdf
            except Exception:
                pass
        if self.handle is None:
            raise LookupError(f"no NVML device has torch's UUID {ids.uuid} or PCI address {ids.bdf}")

    def sample(self) -> tuple[float | None, ...]:
        lib, h = self.lib, self.handle
        power_mw = _read(lambda: lib.nvmlDeviceGetPowerUsage(h))
        return (
            power_mw / 1000 if power_mw is not None else None,
            _read(lambda: lib.nvmlDeviceGetClockInfo(h, lib.NVML_CLOCK_GRAPHICS)),
            _read(lambda: lib.nvmlDeviceGetTemperature(h, lib.NVML_TEMPERATURE_GPU)),
            _read(lambda: lib.nvmlDeviceGetUtilizationRates(h).gpu),
        )

    def energy_mj(self) -> float | None:
        """The energy counter since the driver loaded (Volta and newer), in mJ."""
        return _read(lambda: self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle))

    def pids(self) -> list[int] | None:
        """The processes with a compute context on the device (None where the driver will not say)."""
        try:
            return [int(p.pid) for p in self.lib.nvmlDeviceGetComputeRunningProcesses(self.handle)]
        except Exception:
            return None


class _AmdSmi:
    """amdsmi: power in W, clock in MHz, temperature in C, gfx activity in %, energy in µJ counts.  Key
    names moved between ROCm releases, so each reading tries the documented alternatives."""

    name = "amdsmi"

    def __init__(self, lib: Any, ids: DeviceIds):
        self.lib = lib
        lib.amdsmi_init()
        self.handle, self.matched = None, None
        found = [
            (
                handle,
                _read_str(lambda h=handle: lib.amdsmi_get_gpu_device_bdf(h)),
                _read_str(lambda h=handle: lib.amdsmi_get_gpu_device_uuid(h)),
            )
            for handle in lib.amdsmi_get_processor_handles()
        ]
        # The UUID first: a partitioned MI300X (CPX, DPX ...) shows its partitions as functions of one PCI slot,
        # and torch reports no function; by slot only where one device is in it.
        by_uuid = [f for f in found if f[2] and ids.uuid and f[2].lower() == ids.uuid.lower()]
        in_slot = [f for f in found if _same_slot(f[1], ids.bdf)]
        if by_uuid or len(in_slot) == 1:
            self.handle, bdf, uuid = (by_uuid or in_slot)[0]
            self.matched = bdf or uuid
        elif in_slot:
            functions = ", ".join(sorted(str(f[1]) for f in in_slot))
            raise LookupError(
                f"{len(in_slot)} amdsmi devices share torch's PCI slot {ids.bdf} (a partitioned GPU: {functions}) "
                f"and none has torch's UUID {ids.uuid}: telemetry cannot tell which partition torch uses"
            )
        else:
            raise LookupError(f"no amdsmi device has torch's PCI address {ids.bdf} or UUID {ids.uuid}")

    def _power(self) -> float | None:
        # current_socket_power: MI300+; average_socket_power: MI200 and earlier; socket_power: ROCm 7.
        # amdsmi_get_power_info reads the power cap last and raises where a VF or container has none,
        # although the power was read: the GPU metrics table has it too.
        keys = ("current_socket_power", "average_socket_power", "socket_power")
        for source in (self.lib.amdsmi_get_power_info, getattr(self.lib, "amdsmi_get_gpu_metrics_info", None)):
            try:
                info = source(self.handle) if source is not None else {}
            except Exception:
                continue
            value = next((v for v in (_num(info.get(k)) for k in keys) if v is not None), None)
            if value is not None:
                return value
        return None

    def _clock(self) -> float | None:
        info = self.lib.amdsmi_get_clock_info(self.handle, self.lib.AmdSmiClkType.GFX)
        return _num(info.get("clk", info.get("cur_clk")))  # "cur_clk" before ROCm 6.1

    def _temp(self) -> float | None:
        kinds = self.lib.AmdSmiTemperatureType
        for name in ("HOTSPOT", "JUNCTION", "EDGE"):  # MI300 has no edge sensor
            kind = getattr(kinds, name, None)
            if kind is not None:
                value = _read(
                    lambda kind=kind: self.lib.amdsmi_get_temp_metric(
                        self.handle, kind, self.lib.AmdSmiTemperatureMetric.CURRENT
                    )
                )
                if value is not None:
                    return value
        return None

    def sample(self) -> tuple[float | None, ...]:
        return (
            _read(self._power),
            _read(self._clock),
            self._temp(),
            _read(lambda: self.lib.amdsmi_get_gpu_activity(self.handle)["gfx_activity"]),
        )

    def energy_mj(self) -> float | None:
        """The energy accumulator times its resolution (µJ per count), in mJ ("power" before ROCm 6.4)."""

        def read() -> float | None:
            info = self.lib.amdsmi_get_energy_count(self.handle)
            count = _num(info.get("energy_accumulator", info.get("power")))
            resolution = _num(info.get("counter_resolution"))
            return count * resolution / 1000 if count is not None and resolution is not None else None

        return _read(read)

    def pids(self) -> list[int] | None:
        """The processes on the device: amdsmi's list holds dicts with a pid (ROCm 6+), or process handles whose
        info has one (earlier); None where it will not say."""
        try:
            listed = self.lib.amdsmi_get_gpu_process_list(self.handle)
            pids = []
            for item in listed:
                if not isinstance(item, dict):
                    item = self.lib.amdsmi_get_gpu_process_info(self.handle, item)
                pids.append(int(item["pid"]))
            return pids
        except Exception:
            return None


def _read_str(getter: Callable[[], Any]) -> str | None:
    try:
        value = getter()
    except Exception:
        return None
    return str(value) if value else None


@dataclass(frozen=True)
class Telemetry:
    available: bool
    reason: str | None = None  # why not available
    n_samples: int = 0
    mean_power_w: float | None = None
    max_power_w: float | None = None
    mean_clock_mhz: float | None = None
    max_temp_c: float | None = None
    mean_util_pct: float | None = None
    energy_j: float | None = None  # over the timed window
    energy_per_step_j: float | None = None
    samples_per_joule: float | None = None
    source: str | None = None  # "pynvml" or "amdsmi"
    device: str | None = None  # the UUID or PCI address the library matched
    energy_source: str | None = None  # "counter" (hardware energy counter) or "sampled power"
    window_s: float | None = None  # the timed window the energy covers

    @classmethod
    def unavailable(cls, reason: str, n_samples: int = 0) -> Telemetry:
        return cls(False, reason, n_samples)

    @property
    def note(self) -> str:
        """A caveat for the row's notes: energy over a window too short to trust."""
        if self.energy_j is None or self.window_s is None or self.window_s >= SHORT_WINDOW_S:
            return ""
        return (
            f"energy over a {self.window_s:.2g} s window (under {SHORT_WINDOW_S:g} s: the counters' granularity and "
            "the driver's power averaging make it rough; raise timing.min_time_s)"
        )


class TelemetrySampler:
    """Watch the GPU during a `with` block: samples every `interval_s` from a thread (and at entry and
    exit), and the energy counter at the edges of the timed window (:meth:`on_window`).

    `library` replaces the imported pynvml/amdsmi module and `ids` torch's device ids (tests).
    """

    def __init__(self, backend: Backend, interval_s: float = 0.05, library: Any = None, ids: DeviceIds | None = None):
        self.backend = backend
        self.interval_s = interval_s
        self.library = library
        self.ids = ids
        self.available = False
        self.reason: str | None = None
        self.samples: list[tuple[float, float | None, float | None, float | None, float | None]] = []
        self.duration_s: float | None = None
        self.source: str | None = None
        self.energy_marks: list[tuple[float, float | None]] = []  # (perf_counter, mJ) at the window's edges
        self.others_marks: list[int] = []  # other processes on the device at the window's edges
        self._reader: _Nvml | _AmdSmi | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _open(self) -> None:
        self.available, self.reason, self.samples, self.duration_s, self.energy_marks = False, None, [], None, []
        self.others_marks = []
        if self.backend.device_type != "cuda":
            self.reason = f"no GPU telemetry on the {self.backend.name} backend"
            return
        module, reader = ("amdsmi", _AmdSmi) if self.backend.name == "rocm" else ("pynvml", _Nvml)
        self.source = module
        try:
            lib = self.library if self.library is not None else importlib.import_module(module)
        except Exception as exc:  # amdsmi without its library raises KeyError or OSError, not ImportError
            self.reason = f"{module} is not importable ({type(exc).__name__}: {exc})"
            return
        try:
            ids = self.ids or device_ids(self.backend)
            # One reader per library, device and worker (kdbench.core.worker_state): amdsmi's init is process-wide and
            # not reference-counted (one shut-down would tear it down for everyone), and enumerating GPUs is slow
            # on big nodes.
            readers = current().telemetry_readers
            key = (module, id(lib), ids)
            if key not in readers:
                readers[key] = reader(lib, ids)
            self._reader = readers[key]
        except Exception as exc:
            self.reason = f"{module} initialisation failed: {exc}"
            return
        self.available = True

    def _sample(self) -> None:
        self.samples.append((time.perf_counter(), *self._reader.sample()))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _mark(self) -> None:
        if self.available:
            self.energy_marks.append((time.perf_counter(), self._reader.energy_mj()))
            pids = self._reader.pids()
            if pids is not None:
                self.others_marks.append(others_on_device(pids, (p.pid for p in own_processes())))

    @property
    def other_processes(self) -> int | None:
        """The most other processes seen on the device at the timed window's edges (None: not read)."""
        return max(self.others_marks) if self.others_marks else None

    @property
    def on_window(self) -> tuple[Callable[[], None], Callable[[], None]]:
        """The callbacks :func:`kdbench.measure.timing.timed_loop` calls at the window's edges."""
        return self._mark, self._mark

    def __enter__(self) -> TelemetrySampler:
        self._open()
        if self.available:
            self._sample()
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="kdbench-telemetry", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.available:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._sample()
        self.duration_s = self.samples[-1][0] - self.samples[0][0]

    def result(self, steps: int, samples_per_step: int, window: tuple[float, float] | None = None) -> Telemetry:
        """Summaries of the samples; energy per step and samples per joule for `steps` steps.

        `window` (perf_counter seconds, e.g. ``RawTiming.window_s``) keeps only the samples
        taken while the `steps` timed steps ran, so cold and warm-up calls stay out.  Energy
        is the counter's difference between the window's edges where both were read.
        """
        if not self.available:
            return Telemetry.unavailable(self.reason or "no telemetry")
        samples = self.samples if window is None else [s for s in self.samples if window[0] <= s[0] <= window[1]]
        counter = None
        if len(self.energy_marks) == 2 and None not in (self.energy_marks[0][1], self.energy_marks[1][1]):
            (t0, e0), (t1, e1) = self.energy_marks
            counter = ((e1 - e0) / 1000, t1 - t0)  # J, s
        if len(samples) < 2 and counter is None:
            return Telemetry.unavailable(
                f"{len(samples)} telemetry sample(s) in the timed region and no energy counter; time a longer "
                "region (timing.min_time_s)",
                len(samples),
            )
        table = np.array(samples, dtype=float).reshape(-1, 5)  # None (unread) becomes NaN
        power, clock, temp, util = (table[:, i] for i in range(1, 5))

        def mean(xs: np.ndarray) -> float | None:
            return float(np.nanmean(xs)) if xs.size and not np.isnan(xs).all() else None

        def peak(xs: np.ndarray) -> float | None:
            return float(np.nanmax(xs)) if xs.size and not np.isnan(xs).all() else None

        if counter is not None:
            energy, energy_source, span = counter[0], "counter", counter[1]
        else:
            read = ~np.isnan(power)
            energy = float(np.trapezoid(power[read], table[read, 0])) if read.sum() >= 2 else None
            energy_source = "sampled power" if energy is not None else None
            span = (window[1] - window[0]) if window is not None else self.duration_s
        positive = energy is not None and energy > 0
        return Telemetry(
            source=self.source,
            available=True,
            reason=None,
            n_samples=len(samples),
            mean_power_w=mean(power),
            max_power_w=peak(power),
            mean_clock_mhz=mean(clock),
            max_temp_c=peak(temp),
            mean_util_pct=mean(util),
            energy_j=energy,
            energy_per_step_j=energy / steps if positive and steps > 0 else None,
            samples_per_joule=steps * samples_per_step / energy if positive else None,
            device=self._reader.matched,
            energy_source=energy_source if positive else None,
            window_s=span,
        )


def telemetry_columns(t: Telemetry) -> dict[str, Any]:
    """Telemetry as result columns; when unavailable, only the reason (no invented numbers)."""
    return {
        "telemetry": t.source if t.available else f"unavailable: {t.reason}",
        "telemetry_device": t.device,
        "power_w_mean": t.mean_power_w,
        "power_w_max": t.max_power_w,
        "clock_mhz_mean": t.mean_clock_mhz,
        "temperature_c_max": t.max_temp_c,
        "gpu_util_pct_mean": t.mean_util_pct,
        "energy_per_step_j": t.energy_per_step_j,
        "samples_per_joule": t.samples_per_joule,
        "energy_source": t.energy_source,
        "energy_window_s": t.window_s if t.energy_source else None,
    }
