"""What a step costs beyond its time: FLOPs, memory, power, and the machine's own ceilings.

* FLOPs: :func:`count_flops` runs a callable once under
  ``torch.utils.flop_counter.FlopCounterMode``, which counts only matmul-like and
  convolution ops (2 FLOPs per multiply-add; bias adds, activations, norms and
  optimizer updates count 0), forward and backward as they actually execute.
* Datasheet peaks: :data:`PEAKS` holds dense (no sparsity) vendor TFLOP/s per dtype;
  :func:`datasheet_peak` maps the name torch reports for a GPU onto it.
* Memory: :class:`MemoryMeter` reads the caching allocator's peak counters on GPUs
  (exact, tensor memory only) and, on the CPU, samples this process's RSS from a
  thread (a sampled maximum: a spike shorter than the interval can be missed).
* Telemetry: :class:`TelemetrySampler` polls power, graphics clock, temperature and
  utilisation through ``pynvml`` (CUDA) or ``amdsmi`` (ROCm) from a thread and
  integrates power over time into energy.  Readings are what the driver reports
  (NVML's power is a ~1 s average on recent GPUs), so short blocks are smeared.
* Ceilings: :func:`measure_ceilings` times a dense n x n matmul per dtype and a byte
  copy on this device with :func:`kdbench.measure.timing.timed_loop`, giving achievable
  TFLOP/s and GB/s; :func:`write_probe` / :func:`latest_ceiling` keep them in parquet.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import secrets
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.flop_counter import FlopCounterMode

from kdbench.errors import KdbenchError
from kdbench.hw.backends import DTYPES, Backend
from kdbench.hw.environment import capture
from kdbench.measure.stats import summarize
from kdbench.measure.timing import timed_loop
from kdbench.store.schema import read_table

# --------------------------------------------------------------------------- FLOPs


def count_flops(fn: Callable[[], Any]) -> int:
    """Run `fn` once and return the FLOPs torch's flop counter attributes to it (2 per multiply-add)."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


# --------------------------------------------------------------------------- datasheet peaks

# Dense peak TFLOP/s (sparsity figures halved back to dense).  fp16/bf16 are the matrix
# (Tensor Core / Matrix Core) figures.  fp32 is the plain, non-tensor FP32 figure:
# - NVIDIA: the non-Tensor-Core FP32 number; torch's fp32 matmul does not use TF32
#   unless torch.backends.cuda.matmul.allow_tf32 is set.
# - AMD CDNA: the "FP32 vector" number.  Caveat: on CDNA2 (MI200) the datasheet's
#   "FP32 matrix" figure is twice the vector one, and rocBLAS/hipBLASLt fp32 GEMMs run
#   on the matrix cores, so a measured fp32 matmul there can exceed this peak (up to 2x).
#   On MI300X the matrix and vector FP32 figures are equal.
PEAKS: dict[str, dict[str, float | None]] = {
    # AMD Instinct MI300X datasheet / amd.com MI300X product page: FP32 vector 163.4,
    # FP16 and BF16 1307.4 (2614.9 with sparsity).
    "MI300X": {"fp32": 163.4, "fp16": 1307.4, "bf16": 1307.4},
    # AMD Instinct MI250X datasheet / amd.com MI250X page, whole card (2 GCDs): FP32 vector
    # 47.9, FP16/BF16 383.0.  Each GCD is its own torch device, so half of the card.  torch
    # names MI250 and MI250X alike ("MI250X/MI250"); an MI250 (45.3 / 362.1) is ~5% slower.
    "MI250X (per GCD)": {"fp32": 47.9 / 2, "fp16": 383.0 / 2, "bf16": 383.0 / 2},
    # AMD Instinct MI210 datasheet / amd.com MI210 page: FP32 vector 22.6, FP16/BF16 181.0.
    "MI210": {"fp32": 22.6, "fp16": 181.0, "bf16": 181.0},
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): FP32 67, FP16/BF16 1,979 with
    # sparsity.  Same GH100 SXM5 compute as H100 SXM, whose dense figure is 989.4.
    "H200 SXM": {"fp32": 67.0, "fp16": 989.4, "bf16": 989.4},
    # NVIDIA H100 Tensor Core GPU datasheet and "NVIDIA H100 Tensor Core GPU Architecture"
    # whitepaper (SXM5): FP32 67, FP16/BF16 989.4 dense (1,979 with sparsity).
    "H100 SXM": {"fp32": 67.0, "fp16": 989.4, "bf16": 989.4},
    # Same datasheet / whitepaper, H100 PCIe: FP32 51, FP16/BF16 756 dense (1,513 sparse).
    "H100 PCIe": {"fp32": 51.0, "fp16": 756.0, "bf16": 756.0},
    # NVIDIA A100 Tensor Core GPU datasheet: FP32 19.5, FP16/BF16 312 (624 sparse);
    # the same for 40GB and 80GB, PCIe and SXM.
    "A100": {"fp32": 19.5, "fp16": 312.0, "bf16": 312.0},
    # NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3, FP16/BF16 242 with sparsity -> 121.
    "L4": {"fp32": 30.3, "fp16": 121.0, "bf16": 121.0},
    # NVIDIA T4 Tensor Core GPU datasheet: FP32 8.1, mixed-precision FP16 65; Turing has no bf16.
    "T4": {"fp32": 8.1, "fp16": 65.0, "bf16": None},
}

# Whole-name patterns (lower case, spaces collapsed) for what torch.cuda.get_device_name
# reports.  Whole-name matching keeps variants with other figures (MI300A, MI325X, H100 NVL,
# H200 NVL, A10, A100X ...) from borrowing a sibling's peak: they return None.
_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"amd instinct mi300x( vf)?", "MI300X"),
    (r"amd instinct mi250x(/mi250)?", "MI250X (per GCD)"),
    (r"amd instinct mi210", "MI210"),
    (r"nvidia h200", "H200 SXM"),
    (r"nvidia h100( sxm5?)? 80gb hbm3", "H100 SXM"),
    (r"nvidia h100 pcie", "H100 PCIe"),
    (r"nvidia a100-(sxm4|pcie)-(40|80)gb|nvidia a100 80gb pcie", "A100"),
    (r"nvidia l4", "L4"),
    (r"(tesla|nvidia) t4", "T4"),
)


def datasheet_peak(device_name: str, dtype: str) -> tuple[str, float] | None:
    """(canonical name, dense peak TFLOP/s) for a GPU name as torch reports it; None for
    CPUs, unknown devices, and dtypes the device lacks."""
    if dtype not in ("fp32", "fp16", "bf16"):
        raise KdbenchError(f"unknown dtype '{dtype}'; use fp32, fp16 or bf16")
    name = " ".join(device_name.lower().split())
    for pattern, canonical in _NAME_PATTERNS:
        if re.fullmatch(pattern, name):
            peak = PEAKS[canonical][dtype]
            return (canonical, peak) if peak is not None else None
    return None


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryUsage:
    kind: str  # "rss_hwm" (kernel high-water mark), "rss" (sampled) or "device" (allocator counters)
    peak_bytes: int  # max RSS sampled / torch.cuda.max_memory_allocated
    peak_reserved_bytes: int | None  # torch.cuda.max_memory_reserved (None for rss)
    growth_bytes: int  # at exit minus at entry (RSS, or memory_allocated)


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
        if self._gpu:
            torch.cuda.reset_peak_memory_stats(self.backend.device)
            self.allocated_before = int(torch.cuda.memory_allocated(self.backend.device))
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
            self._usage = MemoryUsage(
                kind="device",
                peak_bytes=int(torch.cuda.max_memory_allocated(device)),
                peak_reserved_bytes=int(torch.cuda.max_memory_reserved(device)),
                growth_bytes=int(torch.cuda.memory_allocated(device)) - self.allocated_before,
            )
            return
        rss_after = self._proc.memory_info().rss
        if self._hwm:
            peak = _hwm_bytes() or rss_after
            self._usage = MemoryUsage("rss_hwm", max(peak, rss_after), None, rss_after - self.rss_before)
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._usage = MemoryUsage("rss", max(self._peak, rss_after), None, rss_after - self.rss_before)

    def result(self) -> MemoryUsage:
        if self._usage is None:
            raise RuntimeError("MemoryMeter.result() is available after the `with` block")
        return self._usage


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors an optimizer keeps per parameter (moments, step counters ...)."""
    return sum(v.nbytes for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


# --------------------------------------------------------------------------- telemetry

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
                    lambda: self.lib.amdsmi_get_temp_metric(self.handle, kind, self.lib.AmdSmiTemperatureMetric.CURRENT)
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
    reason: str | None  # why not available
    n_samples: int
    mean_power_w: float | None
    max_power_w: float | None
    mean_clock_mhz: float | None
    max_temp_c: float | None
    mean_util_pct: float | None
    energy_j: float | None  # trapezoidal integral of power over the block
    energy_per_step_j: float | None
    samples_per_joule: float | None
    source: str | None = None  # "pynvml" or "amdsmi"


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
            return Telemetry(False, self.reason, 0, None, None, None, None, None, None, None, None)
        samples = self.samples if window is None else [s for s in self.samples if window[0] <= s[0] <= window[1]]
        if len(samples) < 2:
            return Telemetry(
                False,
                f"{len(samples)} telemetry sample(s) in the timed region; time a longer region (timing.min_time_s)",
                len(samples),
                *([None] * 8),
            )
        cols = list(zip(*samples))
        power, clock, temp, util = ([v for v in col if v is not None] for col in cols[1:])
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        timed_power = [(t, p) for t, p, *_ in samples if p is not None]
        energy = None
        if len(timed_power) >= 2:
            energy = sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in zip(timed_power, timed_power[1:]))
        positive = energy is not None and energy > 0
        return Telemetry(
            source=self.source,
            available=True,
            reason=None,
            n_samples=len(samples),
            mean_power_w=mean(power),
            max_power_w=max(power) if power else None,
            mean_clock_mhz=mean(clock),
            max_temp_c=max(temp) if temp else None,
            mean_util_pct=mean(util),
            energy_j=energy,
            energy_per_step_j=energy / steps if positive and steps > 0 else None,
            samples_per_joule=steps * samples_per_step / energy if positive else None,
        )


# --------------------------------------------------------------------------- ceilings


def _times_ms(fn: Callable[[], Any], backend: Backend, min_time_s: float) -> tuple[float, float]:
    """(median, p05) of the timed iterations of `fn`."""
    raw = timed_loop(fn, backend.clock(), warmup=2, min_iters=5, min_time_s=min_time_s, max_iters=10_000)
    summary = summarize(raw.samples_ms)
    return summary.median_ms, summary.p05_ms


def measure_ceilings(
    backend: Backend,
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16"),
    matmul_n: int | None = None,
    copy_bytes: int | None = None,
    min_time_s: float = 0.3,
) -> list[dict]:
    """Achievable dense-matmul TFLOP/s per dtype (2n^3 FLOPs per n x n @ n x n) and copy
    bandwidth in GB/s (read + write: 2 x bytes per dst.copy_(src)) on `backend`.

    A ceiling is what the device can do, so `value` comes from the fast end of the timed
    iterations (their 5th percentile, `p05_ms`), which a busy or drifting machine drags
    down less than the median (`median_ms`, kept beside it).  A dtype the device cannot
    multiply gives value None and an `error`."""
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise KdbenchError(f"unknown dtype(s) {unknown}; use {', '.join(DTYPES)}")
    gpu = backend.device_type == "cuda"
    n = matmul_n or (8192 if gpu else 2048)
    nbytes = copy_bytes or (2**30 if gpu else 64 * 2**20)
    rows = []
    for d in dtypes:
        row = {
            "kind": "matmul",
            "dtype": d,
            "size": n,
            "value": None,
            "unit": "TFLOP/s",
            "median_ms": None,
            "p05_ms": None,
            "error": None,
        }
        try:
            a = torch.randn(n, n, device=backend.device).to(DTYPES[d])
            b = torch.randn(n, n, device=backend.device).to(DTYPES[d])
            median, fast = _times_ms(lambda: torch.mm(a, b), backend, min_time_s)
            row.update(median_ms=median, p05_ms=fast, value=2 * n**3 / (fast / 1e3) / 1e12)
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            row["error"] = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        finally:
            a = b = None
        rows.append(row)
    src = torch.ones(nbytes, dtype=torch.uint8, device=backend.device)
    dst = torch.empty_like(src)
    median, fast = _times_ms(lambda: dst.copy_(src), backend, min_time_s)
    rows.append(
        {
            "kind": "copy",
            "dtype": "uint8",
            "size": nbytes,
            "value": 2 * nbytes / (fast / 1e3) / 1e9,
            "unit": "GB/s",
            "median_ms": median,
            "p05_ms": fast,
            "error": None,
        }
    )
    return rows


_PROBE_SCHEMA = pa.schema(
    [
        ("probe_id", pa.string()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
        ("kind", pa.string()),
        ("dtype", pa.string()),
        ("size", pa.int64()),
        ("value", pa.float64()),
        ("unit", pa.string()),
        ("median_ms", pa.float64()),
        ("p05_ms", pa.float64()),
        ("error", pa.string()),
    ]
)


def probe_env(backend: Backend) -> dict[str, Any]:
    """Environment columns for a probe: :func:`kdbench.hw.environment.capture` plus `backend`."""
    return {**capture(backend), "backend": backend.name}


def write_probe(rows: list[dict], env: dict[str, Any], out_dir: Path) -> Path:
    """Write `rows` of :func:`measure_ceilings`, each with every `env` column, atomically to
    ``out_dir/<probe_id>.parquet``.  Give `env` a `backend` column (see :func:`probe_env`)
    for :func:`latest_ceiling` to find it; keep probes apart from result files."""
    clash = set(env) & set(_PROBE_SCHEMA.names)
    if clash:
        raise ValueError(f"env keys clash with probe columns: {sorted(clash)}")
    now = datetime.now(UTC)
    probe_id = f"probe-{now:%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
    fixed = {name: [r.get(name) for r in rows] for name in _PROBE_SCHEMA.names[2:]}
    table = pa.Table.from_pydict(
        {"probe_id": [probe_id] * len(rows), "timestamp": [now] * len(rows), **fixed}, schema=_PROBE_SCHEMA
    )
    for key, value in env.items():
        table = table.append_column(key, pa.array([value] * len(rows)))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{probe_id}.parquet"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def latest_ceiling(out_dir: Path, device_name: str, backend_name: str) -> dict[str, Any] | None:
    """From the newest probe in `out_dir` for this device and backend: ``{"matmul_<dtype>":
    TFLOP/s, "copy": GB/s, "probe_id": ...}`` (failed measurements left out); None if none."""
    matches: list[dict] = []
    try:
        files = sorted(Path(out_dir).glob("probe-*.parquet"))
    except OSError:
        return None
    for path in files:
        try:
            rows = read_table(path).to_pylist()
        except Exception:  # unreadable or foreign file: not a probe we can use
            continue
        matches += [r for r in rows if r.get("device_name") == device_name and r.get("backend") == backend_name]
    if not matches:
        return None
    newest = max(matches, key=lambda r: (r["timestamp"], r["probe_id"]))["probe_id"]
    out: dict[str, Any] = {"probe_id": newest}
    for r in matches:
        value = r.get("value")
        if r["probe_id"] != newest or value is None or not math.isfinite(value):
            continue
        out["copy" if r["kind"] == "copy" else f"matmul_{r['dtype']}"] = value
    return out


# --------------------------------------------------------------------------- result columns


def memory_columns(usage: MemoryUsage) -> dict[str, Any]:
    return {
        "memory_kind": usage.kind,
        "peak_memory_bytes": usage.peak_bytes,
        "peak_reserved_bytes": usage.peak_reserved_bytes,
        "memory_growth_bytes": usage.growth_bytes,
    }


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


def utilization_columns(
    flops: float | None,
    median_ms: float | None,
    device_name: str | None,
    precision: str,
    ceiling: dict[str, Any] | None,
) -> dict[str, Any]:
    """Achieved TFLOP/s of one device, and its share of the datasheet peak and of the measured ceiling."""
    if not flops or not median_ms or median_ms <= 0:
        return {}
    achieved = flops / (median_ms / 1e3) / 1e12
    row: dict[str, Any] = {"achieved_tflops": achieved}
    peak = datasheet_peak(device_name or "", precision)
    if peak is not None and peak[1]:
        row.update(datasheet_device=peak[0], datasheet_peak_tflops=peak[1], mfu=achieved / peak[1])
    measured = (ceiling or {}).get(f"matmul_{precision}")
    if measured:
        row.update(
            ceiling_tflops=measured, ceiling_utilization=achieved / measured, ceiling_probe_id=ceiling.get("probe_id")
        )  # type: ignore[union-attr]
    return row


# --------------------------------------------------------------------------- profiler traces

TOP_OPS = 10


def trace(fn: Callable[[], Any], backend: Backend, path: Path, calls: int = 3) -> dict[str, Any]:
    """Run `fn` `calls` times under torch.profiler (a separate pass, after the timed loop),
    write a Chrome trace to `path`, and return it with the top operators by self time."""
    from torch.profiler import ProfilerActivity, profile

    gpu = backend.device_type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    path.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        backend.synchronize()
    prof.export_chrome_trace(str(path))

    def self_us(event: Any) -> float:
        if gpu:
            return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))
        return float(event.self_cpu_time_total)

    events = sorted(prof.key_averages(), key=self_us, reverse=True)[:TOP_OPS]
    top = [{"op": e.key, "self_ms_per_call": self_us(e) / 1e3 / calls, "count": int(e.count) // calls} for e in events]
    return {"trace_file": str(path), "top_ops": json.dumps(top)}
