"""GPU telemetry over a timed block: power, graphics clock, temperature, utilisation, energy.

:class:`TelemetrySampler` polls ``pynvml`` (CUDA) or ``amdsmi`` (ROCm) from a thread
and integrates power over time into energy.  Readings are what the driver reports
(NVML's power is a ~1 s average on recent GPUs), so short blocks are smeared.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kdbench.hw.backends import Backend

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


class _Nvml:
    """pynvml (nvidia-ml-py): power in mW, clocks in MHz, temperature in C, utilisation in %."""

    def __init__(self, lib: Any, index: int):
        self.lib = lib
        lib.nvmlInit()
        try:
            self.handle = lib.nvmlDeviceGetHandleByIndex(index)
        except BaseException:
            lib.nvmlShutdown()
            raise

    def sample(self) -> tuple[float | None, ...]:
        lib, h = self.lib, self.handle
        power_mw = _read(lambda: lib.nvmlDeviceGetPowerUsage(h))
        return (
            power_mw / 1000 if power_mw is not None else None,
            _read(lambda: lib.nvmlDeviceGetClockInfo(h, lib.NVML_CLOCK_GRAPHICS)),
            _read(lambda: lib.nvmlDeviceGetTemperature(h, lib.NVML_TEMPERATURE_GPU)),
            _read(lambda: lib.nvmlDeviceGetUtilizationRates(h).gpu),
        )

    def close(self) -> None:
        self.lib.nvmlShutdown()


class _AmdSmi:
    """amdsmi: power in W, clock in MHz, temperature in C, gfx activity in %.  Key names
    moved between ROCm releases, so each reading tries the documented alternatives."""

    def __init__(self, lib: Any, index: int):
        self.lib = lib
        lib.amdsmi_init()
        try:
            self.handle = lib.amdsmi_get_processor_handles()[index]
        except BaseException:
            lib.amdsmi_shut_down()
            raise

    def _power(self) -> float | None:
        # current_socket_power: MI300+; average_socket_power: MI200 and earlier; socket_power: ROCm 7.
        info = self.lib.amdsmi_get_power_info(self.handle)
        values = (_num(info.get(k)) for k in ("current_socket_power", "average_socket_power", "socket_power"))
        return next((v for v in values if v is not None), None)

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

    def close(self) -> None:
        self.lib.amdsmi_shut_down()


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
    energy_j: float | None = None  # trapezoidal integral of power over the block
    energy_per_step_j: float | None = None
    samples_per_joule: float | None = None
    source: str | None = None  # "pynvml" or "amdsmi"

    @classmethod
    def unavailable(cls, reason: str, n_samples: int = 0) -> Telemetry:
        return cls(False, reason, n_samples)


class TelemetrySampler:
    """Poll GPU power, clock, temperature and utilisation during a `with` block.

    Samples are taken at entry, every `interval_s` from a daemon thread, and at exit.
    Device index = ``backend.device.index or 0``.  NVML and amdsmi number all physical
    GPUs, ignoring CUDA_/HIP_VISIBLE_DEVICES, so under a remapping the index can name
    another GPU.  `library` replaces the imported pynvml/amdsmi module (tests).
    """

    def __init__(self, backend: Backend, interval_s: float = 0.05, library: Any = None):
        self.backend = backend
        self.interval_s = interval_s
        self.library = library
        self.available = False
        self.reason: str | None = None
        self.samples: list[tuple[float, float | None, float | None, float | None, float | None]] = []
        self.duration_s: float | None = None
        self.source: str | None = None
        self._reader: _Nvml | _AmdSmi | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _open(self) -> None:
        self.available, self.reason, self.samples, self.duration_s = False, None, [], None
        if self.backend.device_type != "cuda":
            self.reason = f"no GPU telemetry on the {self.backend.name} backend"
            return
        module, reader = ("amdsmi", _AmdSmi) if self.backend.name == "rocm" else ("pynvml", _Nvml)
        self.source = module
        try:
            lib = self.library if self.library is not None else importlib.import_module(module)
        except ImportError as exc:
            self.reason = f"{module} is not importable ({exc})"
            return
        try:
            self._reader = reader(lib, self.backend.device.index or 0)
        except Exception as exc:
            self.reason = f"{module} initialisation failed: {exc}"
            return
        self.available = True

    def _sample(self) -> None:
        self.samples.append((time.perf_counter(), *self._reader.sample()))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

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
        try:
            self._sample()
        finally:
            self._reader.close()
        self.duration_s = self.samples[-1][0] - self.samples[0][0]

    def result(self, steps: int, samples_per_step: int, window: tuple[float, float] | None = None) -> Telemetry:
        """Summaries of the samples; energy per step and samples per joule for `steps` steps.

        `window` (perf_counter seconds, e.g. ``RawTiming.window_s``) keeps only the samples
        taken while the `steps` timed steps ran, so cold and warm-up calls stay out.
        """
        if not self.available:
            return Telemetry.unavailable(self.reason or "no telemetry")
        samples = self.samples if window is None else [s for s in self.samples if window[0] <= s[0] <= window[1]]
        if len(samples) < 2:
            return Telemetry.unavailable(
                f"{len(samples)} telemetry sample(s) in the timed region; time a longer region (timing.min_time_s)",
                len(samples),
            )
        table = np.array(samples, dtype=float)  # None (unread) becomes NaN
        power, clock, temp, util = (table[:, i] for i in range(1, 5))

        def mean(xs: np.ndarray) -> float | None:
            return float(np.nanmean(xs)) if not np.isnan(xs).all() else None

        def peak(xs: np.ndarray) -> float | None:
            return float(np.nanmax(xs)) if not np.isnan(xs).all() else None

        read = ~np.isnan(power)
        energy = float(np.trapezoid(power[read], table[read, 0])) if read.sum() >= 2 else None
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
        )


def telemetry_columns(t: Telemetry) -> dict[str, Any]:
    """Telemetry as result columns; when unavailable, only the reason (no invented numbers)."""
    return {
        "telemetry": t.source if t.available else f"unavailable: {t.reason}",
        "power_w_mean": t.mean_power_w,
        "power_w_max": t.max_power_w,
        "clock_mhz_mean": t.mean_clock_mhz,
        "temperature_c_max": t.max_temp_c,
        "gpu_util_pct_mean": t.mean_util_pct,
        "energy_per_step_j": t.energy_per_step_j,
        "samples_per_joule": t.samples_per_joule,
    }
