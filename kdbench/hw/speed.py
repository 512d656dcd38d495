"""How much slower a 16-bit precision runs than fp32 on this device: measured, not read off flags.

Flags mislead both ways: a 2-core AMD EPYC with AVX2 (no AVX-512) emulates bf16 autocast and ran a
distillation step 8x slower in bf16 than in fp32, while another EPYC with avx512_bf16 multiplies bf16
twice as fast as fp32; CPUs that report AVX512-FP16 may still run fp16 matmuls ~76x slower.  So
:func:`dtype_slowdown` asks, in order:

1. the newest ``kdbench probe`` of this device (:func:`kdbench.store.probes.latest_ceiling`): fp32's
   matmul TFLOP/s over the precision's;
2. on the CPU, a small JSON cache per machine (``$KDBENCH_CACHE_DIR`` or ``~/.cache/kdbench``), keyed
   by the CPU model, the torch version, torch's CPU capability and the thread count;
3. on the CPU, a measurement (a 512 x 512 matmul per dtype, or smaller for a dtype whose first call is slow,
   in at least 7 interleaved rounds and 0.3 s, the fastest call of each: :func:`measure_slowdown`; about a
   second even where fp16 is emulated), watched by the contention meter (:mod:`kdbench.hw.contention`):
   stored in that cache with when and under what load it was taken, and never stored when the machine was
   busy (issue 32: a busy moment cached bf16 as 280x slower on a CPU whose bf16 is faster than its fp32).

A cached figure that a run's own steps contradict (:func:`check_steps`: the precision's measured step over
fp32's, cells otherwise equal, off by more than :data:`DISAGREE` times) is dropped, so the next run measures it
again.

GPUs are never measured here: that would create a CUDA context in the parent process, which the
cells' workers must not inherit.  Without a probe a GPU keeps the flag rule (bf16 before compute
capability 8.0 on NVIDIA).  A precision at least :data:`SLOW_FACTOR` times slower is *slow*: the
run warns about it before anything runs (:func:`warning_line`, one per slow precision of
:func:`slow_precisions`), or skips its cells
(:func:`skip_reason_for_slow`) under the suite's ``slow_precisions: skip``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from kdbench.core.worker_state import current
from kdbench.hw.backends import DTYPES, Backend, thread_count
from kdbench.hw.contention import HostLoad, HostMeter

SLOW_FACTOR = 3.0  # a precision this many times slower than fp32 (or more) is slow
# The measurement (issue 32): a busy moment once cached bf16 as 280x slower than fp32 on a CPU with native
# AVX-512 BF16 (measured with care it is faster), and three fresh 192-256^2 measurements beside one other 2-thread
# process gave bf16 15x, 0.37x and 0.26x.  So: larger matmuls, the two dtypes interleaved round by round (a busy
# spell slows both alike), the fastest call of each, and the host watched meanwhile (never cached when contended).
MEASURE_N = 512  # the measured matmul's size: 0.27 GFLOP, a few ms in fp32 on one core
ROUNDS = 7  # interleaved rounds at least (fp32 and the precision once each, the order alternating) ...
MIN_TIME_S = 0.3  # ... and until this much time has passed (the contention meter's window: MIN_WINDOW_S)
MAX_ROUNDS = 40
SLOW_CALL_S = 0.05  # a dtype whose first call takes longer is measured at a smaller size (emulated fp16: ~0.6 s
SHRUNK_CALL_S = 0.02  # at 512), one whose calls take about this long (fp32 at the same size)
# A first call up to this long is timed once more before the size is shrunk: it may be one-time set-up (oneDNN
# builds its bf16 kernel on the first call: ~60-100 ms on a CPU with AVX-512 BF16, whose next 512^2 call takes a
# few ms; shrunk after the first call, that CPU's bf16 was measured at 136^2, the small size the issue warned of).
# Emulated fp16's 0.6-2.7 s first call is not timed twice.
RECHECK_CALL_S = 0.3
MIN_N = 32
CACHE_FILE = "dtype_speed.json"
CACHE_FORMAT = 2  # 2: interleaved rounds, with the host's load; entries of format 1 are measured again
# A cached factor this many times off a run's own measured step ratio (the precision's distill_step over fp32's,
# cells otherwise equal) is dropped from the cache (:func:`check_steps`): a step is not a matmul (casts, memory-bound
# ops), so only a gross disagreement says the cached figure was taken at a bad moment.
DISAGREE = 4.0

MEASURED_NOW = "measured now"
MEASURED_BUSY = "measured now on a busy machine, not cached"
CACHED = "cached measurement"
FLAGS = "flags"

logger = logging.getLogger(__name__)

Clock = Callable[[], float]  # seconds, like time.perf_counter
Matmul = Callable[[torch.Tensor, torch.Tensor], Any]  # like torch.mm


@dataclass(frozen=True)
class Slowdown:
    """How many times slower a dense matmul runs at ``precision`` than in fp32 here, and whence."""

    precision: str
    factor: float | None  # fp32's matmul rate over the precision's: 8.0 is 8x slower, 0.5 twice as fast;
    #                       None: no figure, only the flag rule (a GPU without a probe)
    source: str  # "probe <probe id>", "cached measurement", "measured now" or "flags"
    sizes: Mapping[str, int] = field(default_factory=dict)  # the matmuls' n per dtype ({} if unknown)
    reason: str = ""  # the flag rule's reason, when factor is None

    @property
    def slow(self) -> bool:
        return self.factor >= SLOW_FACTOR if self.factor is not None else bool(self.reason)

    def basis(self) -> str:
        """Where the figure came from, e.g. 'a 256x256 matmul, measured now'."""
        if self.factor is None:
            return f"{self.reason}; no probe of this device: `kdbench probe` measures it"
        mine, fp32 = self.sizes.get(self.precision), self.sizes.get("fp32")
        if mine is None or fp32 is None:
            what = ""
        elif mine != fp32:
            what = f"a {mine}x{mine} {self.precision} matmul against a {fp32}x{fp32} fp32 one, "
        elif self.source.startswith("probe"):
            what = f"{mine}x{mine} matmuls, "
        else:
            what = f"a {mine}x{mine} matmul, "
        return f"{what}{self.source}"

    def describe(self) -> str:
        """'bf16 runs 8.0x slower than fp32 here (a 256x256 matmul, measured now)'."""
        if self.factor is None:
            how = "far slower than"
        elif self.factor >= 1:
            how = f"{_times(self.factor)} slower than"
        else:
            how = f"{_times(1 / self.factor)} faster than"
        return f"{self.precision} runs {how} fp32 here ({self.basis()})"


def _times(factor: float) -> str:
    return f"{factor:.1f}x" if factor < 100 else f"{factor:.0f}x"


# --------------------------------------------------------------------------- the figure


def dtype_slowdown(
    backend: Backend,
    precision: str,
    probes_dir: Path | None = None,
    *,
    threads: int | None = None,
    cache_file: Path | None = None,
    clock: Clock = time.perf_counter,
    matmul: Matmul = torch.mm,
    meter: HostMeter | None = None,
) -> Slowdown | None:
    """How many times slower a dense matmul runs at ``precision`` ("fp16" or "bf16") than in fp32 on
    ``backend``'s device; None for fp32 and tf32 (fp32 tensors), and where nothing is known (a GPU
    with neither a probe nor a flag against it, or a CPU that cannot multiply the dtype at all).

    From the newest probe of the device in ``probes_dir``; else, on the CPU, from the cache
    (``cache_file``, default :func:`default_cache_file`) or a measurement stored there, made with
    ``threads`` torch threads (None: as set now), timed with ``clock`` on ``matmul`` while ``meter`` (default:
    a :class:`~kdbench.hw.contention.HostMeter`) watches the host: a measurement taken while it was contended is
    used but not cached.  Else, on a GPU, from the flag rule."""
    if precision not in DTYPES or DTYPES[precision] is torch.float32:
        return None
    name = device_name(backend)
    found = _from_probe(probes_dir, name, backend.name, precision) if probes_dir is not None else None
    if found is not None:
        return found
    if backend.device_type != "cpu":
        reason = _flag_rule(backend, precision)
        return Slowdown(precision, None, FLAGS, {}, reason) if reason else None
    with thread_count(threads) as used:
        path = Path(cache_file) if cache_file is not None else default_cache_file()
        key = machine_key(name, used)
        cached = _read_cache(path, key, precision)
        if cached is not None:
            return cached
        host = meter if meter is not None else HostMeter(used)
        host.start()
        try:
            size, factor, rounds = measure_slowdown(precision, clock=clock, matmul=matmul)
        except (RuntimeError, TypeError, NotImplementedError):  # the CPU cannot multiply the dtype
            return None
        finally:
            host.stop()
        load = host.result()
        busy = load is not None and load.contended
        result = Slowdown(precision, factor, MEASURED_BUSY if busy else MEASURED_NOW, {precision: size, "fp32": size})
        if busy:  # a figure taken under load never outlives this run (issue 32: a cached 280x)
            logger.warning("%s: %s", result.describe(), load.describe())
        else:
            _write_cache(path, key, name, used, result, load, rounds)
        return result


def measure_slowdown(
    precision: str, n: int = MEASURE_N, *, clock: Clock = time.perf_counter, matmul: Matmul = torch.mm
) -> tuple[int, float, int]:
    """(size, factor, rounds): an n x n matmul's time at ``precision`` over fp32's, on the CPU, at the size the
    precision was measured at (``n``, or smaller where its first call is slow: fp32 is measured at that smaller
    size too, so both run equally far below the device's rate).  After a warm-up call each, the two dtypes are
    timed in interleaved rounds (the order alternating), at least ROUNDS and MIN_TIME_S, at most MAX_ROUNDS; each
    dtype's fastest call counts: a busy spell slows both, and the least disturbed call of each is compared."""
    generator = torch.Generator().manual_seed(0)  # leaves the global RNG as the caller had it
    dtype = DTYPES[precision]
    size = n
    a = torch.randn(size, size, generator=generator).to(dtype)
    first = _timed(matmul, a, clock)
    if SLOW_CALL_S < first <= RECHECK_CALL_S:
        first = min(first, _timed(matmul, a, clock))  # set-up or a slow dtype?
    if first > SLOW_CALL_S and size > MIN_N:
        # the warm-up call, maybe setting things up, overestimates a later one: the prediction errs on the fast side
        size = max(MIN_N, int(size * (SHRUNK_CALL_S / first) ** (1 / 3)) // 8 * 8)
        a = torch.randn(size, size, generator=generator).to(dtype)
        _timed(matmul, a, clock)
    b = torch.randn(size, size, generator=generator)
    _timed(matmul, b, clock)  # fp32's warm-up call
    best = {dtype: math.inf, torch.float32: math.inf}
    began, rounds = clock(), 0
    while rounds < MAX_ROUNDS and (rounds < ROUNDS or clock() - began < MIN_TIME_S):
        pair = ((a, dtype), (b, torch.float32))
        for x, d in pair if rounds % 2 == 0 else reversed(pair):
            best[d] = min(best[d], _timed(matmul, x, clock))
        rounds += 1
    return size, best[dtype] / max(best[torch.float32], 1e-12), rounds


def _timed(matmul: Matmul, a: torch.Tensor, clock: Clock) -> float:
    start = clock()
    matmul(a, a)
    return clock() - start


def device_name(backend: Backend) -> str:
    """The device's name as the environment capture (and so a probe) records it."""
    if backend.device_type == "cuda":
        return torch.cuda.get_device_properties(backend.device).name
    from kdbench.hw.environment import cpu_model

    return cpu_model()


def _flag_rule(backend: Backend, precision: str) -> str:
    """Why flags say ``precision`` runs far slower than fp32 on this GPU ('' where they do not)."""
    if backend.device_type == "cuda" and precision == "bf16" and not getattr(torch.version, "hip", None):
        try:
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        except (TypeError, RuntimeError, AssertionError):
            return ""
        if not native:
            return "bf16 on this GPU is emulated: no native bf16 before compute capability 8.0"
    return ""


def _from_probe(probes_dir: Path, name: str, backend_name: str, precision: str) -> Slowdown | None:
    from kdbench.store.probes import latest_ceiling

    ceiling = latest_ceiling(Path(probes_dir), name, backend_name)
    if not ceiling:
        return None
    fp32, rate = ceiling.get("matmul_fp32"), ceiling.get(f"matmul_{precision}")
    if not fp32 or not rate or fp32 <= 0 or rate <= 0:
        return None
    probe_id = ceiling["probe_id"]
    return Slowdown(precision, fp32 / rate, f"probe {probe_id}", _probe_sizes(Path(probes_dir), probe_id, precision))


def _probe_sizes(probes_dir: Path, probe_id: str, precision: str) -> dict[str, int]:
    """The probe's matmul sizes of fp32 and ``precision`` ({} where its file cannot be read)."""
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(probes_dir / f"{probe_id}.parquet", columns=["kind", "dtype", "size"]).to_pylist()
    except Exception:  # a probe file named otherwise, or gone since: the figure stands without sizes
        return {}
    return {
        r["dtype"]: int(r["size"])
        for r in rows
        if r["kind"] == "matmul" and r["dtype"] in ("fp32", precision) and r["size"] is not None
    }


# --------------------------------------------------------------------------- the cache


def default_cache_file() -> Path:
    """``$KDBENCH_CACHE_DIR/dtype_speed.json``, else ``~/.cache/kdbench/dtype_speed.json``."""
    folder = os.environ.get("KDBENCH_CACHE_DIR") or Path.home() / ".cache" / "kdbench"
    return Path(folder) / CACHE_FILE


def _cpu_capability() -> str | None:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return None


def machine_key(name: str, threads: int) -> str:
    """What a measurement holds for: the CPU model, torch, its CPU capability and the thread count."""
    return f"{name} | torch {torch.__version__} | {_cpu_capability()} | {threads} threads"


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    ok = isinstance(data, dict) and data.get("format") == CACHE_FORMAT and isinstance(data.get("machines"), dict)
    return data if ok else {}


def _read_cache(path: Path, key: str, precision: str) -> Slowdown | None:
    refused = current().unwritable_slowdowns  # measurements a cache file refused, remembered by the worker
    if (str(path), key, precision) in refused:
        return refused[(str(path), key, precision)]
    machine = _load(path).get("machines", {}).get(key)
    entry = machine.get("precisions", {}).get(precision) if isinstance(machine, dict) else None
    if not isinstance(entry, dict):
        return None
    factor, sizes = entry.get("factor"), entry.get("sizes")
    if not isinstance(factor, int | float) or not math.isfinite(factor) or factor <= 0 or not isinstance(sizes, dict):
        return None
    return Slowdown(precision, float(factor), CACHED, {str(k): int(v) for k, v in sizes.items()})


def _write_cache(
    path: Path, key: str, name: str, threads: int, result: Slowdown, load: HostLoad | None = None, rounds: int = 0
) -> None:
    """Add ``result`` to the cache file, atomically, with when it was taken, in how many rounds and under what
    load (``load``: the host's other processes meanwhile; None where the measurement was too short to tell); a
    file that cannot be written is remembered in this process instead (the next run measures again)."""
    from kdbench.store.files import write_text

    data = _load(path) or {"format": CACHE_FORMAT, "machines": {}}
    machine = data["machines"].get(key)
    if not isinstance(machine, dict) or not isinstance(machine.get("precisions"), dict):
        machine = data["machines"][key] = {
            "device_name": name,
            "torch": torch.__version__,
            "cpu_capability": _cpu_capability(),
            "threads": threads,
            "precisions": {},
        }
    machine["precisions"][result.precision] = {
        "factor": result.factor,
        "sizes": dict(result.sizes),
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "rounds": rounds,
        "host_busy_share": round(load.busy_share, 3) if load is not None else None,
        "load": load.describe() if load is not None else "not read (too short a measurement)",
    }
    try:
        write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", path)
    except OSError:
        current().unwritable_slowdowns[(str(path), key, result.precision)] = result


def _drop_cache(path: Path, key: str, precision: str) -> bool:
    """Remove one cached factor (atomically); whether there was one to remove and the file could be written."""
    from kdbench.store.files import write_text

    data = _load(path)
    entries = data.get("machines", {}).get(key, {}).get("precisions", {}) if data else {}
    if not isinstance(entries, dict) or precision not in entries:
        return False
    del entries[precision]
    try:
        write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", path)
    except OSError:
        return False
    return True


def step_ratios(steps: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Per 16-bit precision, the median over matching cells of its distill_step median over fp32's, the cells
    otherwise equal (their ``config_json`` without the precisions); ``steps``: ok distill_step rows."""
    by_key: dict[str, dict[str, float]] = {}
    for row in steps:
        try:
            config = json.loads(row["config_json"])
        except (KeyError, TypeError, ValueError):
            continue
        precision, teacher = config.pop("precision", None), config.pop("teacher_precision", None)
        if teacher not in (None, precision) or not row.get("median_ms"):
            continue  # mixed precisions: not one precision's step
        by_key.setdefault(json.dumps(config, sort_keys=True), {})[precision] = float(row["median_ms"])
    ratios: dict[str, list[float]] = {}
    for medians in by_key.values():
        for precision in ("bf16", "fp16"):
            if precision in medians and medians.get("fp32"):
                ratios.setdefault(precision, []).append(medians[precision] / medians["fp32"])
    return {p: float(sorted(r)[len(r) // 2]) for p, r in ratios.items()}


def check_steps(
    steps: Iterable[Mapping[str, Any]], backend: Backend, threads: int, cache_file: Path | None = None
) -> list[str]:
    """Drop the cached factors that a run's own steps contradict (off by more than :data:`DISAGREE` times either
    way: :func:`step_ratios`), so that the next run measures them again; a line for each one dropped."""
    if backend.device_type != "cpu":
        return []
    path = Path(cache_file) if cache_file is not None else default_cache_file()
    key = machine_key(device_name(backend), threads)
    lines = []
    for precision, ratio in step_ratios(steps).items():
        cached = _read_cache(path, key, precision)
        if cached is None or cached.factor is None:
            continue
        off = max(cached.factor / ratio, ratio / cached.factor)
        if off > DISAGREE and _drop_cache(path, key, precision):
            lines.append(
                f"the cached {precision} speed ({cached.describe()}) is {off:.0f}x off this run's own steps "
                f"({precision} {_times(ratio)} fp32's time): dropped from {path}, measured again next run"
            )
    return lines


# --------------------------------------------------------------------------- what a run does with it


def slow_precisions(
    precisions: Iterable[str],
    backend: Backend,
    probes_dir: Path | None = None,
    *,
    threads: int | None = None,
    cache_file: Path | None = None,
    clock: Clock = time.perf_counter,
    matmul: Matmul = torch.mm,
) -> dict[str, Slowdown]:
    """The slow ones (factor >= SLOW_FACTOR, or the flag rule) of the distinct ``precisions``, in the
    order first given; each is looked up or measured once (see :func:`dtype_slowdown`)."""
    out = {}
    for precision in dict.fromkeys(precisions):
        found = dtype_slowdown(
            backend, precision, probes_dir, threads=threads, cache_file=cache_file, clock=clock, matmul=matmul
        )
        if found is not None and found.slow:
            out[precision] = found
    return out


def slow_precision(backend: Backend, precision: str, probes_dir: Path | None = None) -> str | None:
    """Why ``precision`` runs far slower than fp32 on ``backend`` (None: it does not), from a probe, a
    cached or a quick measurement on the CPU, or the flag rule on a GPU without a probe: flags alone
    mislead (see :func:`dtype_slowdown`)."""
    found = dtype_slowdown(backend, precision, probes_dir)
    return found.describe() if found is not None and found.slow else None


def warning_line(slowdown: Slowdown) -> str:
    """'bf16 runs 8.0x slower than fp32 here (a 256x256 matmul, measured now): its cells will take about
    that much longer'."""
    longer = "about that much longer" if slowdown.factor is not None else "much longer"
    return f"{slowdown.describe()}: its cells will take {longer}"


def skip_reason_for_slow(precision: str, slowdown: Slowdown) -> str:
    """Why a cell at ``precision`` is skipped under ``slow_precisions: skip``, in one line."""
    return (
        f"skipped as slow (slow_precisions: skip): {slowdown.describe()}; "
        f"set slow_precisions: measure in the suite to measure its {precision} cells anyway"
    )
