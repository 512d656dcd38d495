"""`kdbench probe`: this device's achievable ceilings, measured.

:func:`measure_ceilings` times a dense n x n matmul per dtype and a byte copy with
:func:`kdbench.measure.timing.timed_loop`, giving achievable TFLOP/s and GB/s; the
store keeps them (:mod:`kdbench.store.probes`) and every later run on the device
reports its cells' share of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from kdbench.core.errors import KdbenchError
from kdbench.core.stats.samples import summarize
from kdbench.hw.backends import DTYPES, Backend, math_mode, tf32_problem
from kdbench.hw.environment import capture
from kdbench.measure.timing import timed_loop

GPU_MIN_TIME_S = 2.0  # long enough for sustained, not boost, clocks
CPU_MIN_TIME_S = 0.5
SLOW_CALL_S = 0.25  # a dtype whose n x n matmul would take longer per call is probed at a smaller n (a CPU that
# emulates bf16 and fp16 took 70 s over them at 2 s per call; its ceiling for them is "very slow" either way)


def _matmul_size(
    dtype: torch.dtype, n: int, backend: Backend, max_call_s: float, timer: Callable[[], float] = time.perf_counter
) -> int:
    """``n``, or a smaller size whose matmul takes at most ``max_call_s``: a dtype the device only
    emulates (fp16 on many CPUs runs hundreds of times slower) would otherwise keep the probe busy
    for many minutes.  The size doubles from 256 while a call at the next size, predicted from one
    timed call at this one, fits; each prediction comes from a size close to it, since small
    matmuls run far below the device's rate and would understate what larger ones reach.  ``timer``
    reads seconds (tests give a simulated one)."""
    size = min(n, 256)
    while size < n:
        a = torch.randn(size, size, device=backend.device).to(dtype)
        torch.mm(a, a)  # the first call at a size may set things up
        backend.synchronize()
        start = timer()
        torch.mm(a, a)
        backend.synchronize()
        elapsed = timer() - start
        bigger = min(2 * size, n)
        if elapsed * (bigger / size) ** 3 > max_call_s:
            break
        size = bigger
    return size


def times_ms(fn: Callable[[], Any], backend: Backend, min_time_s: float) -> tuple[float, float]:
    """(median, p05) of the timed iterations of `fn`."""
    raw = timed_loop(fn, backend.clock(), warmup=2, min_iters=5, min_time_s=min_time_s, max_iters=10_000)
    summary = summarize(raw.samples_ms)
    return summary.median_ms, summary.p05_ms


def measure_ceilings(
    backend: Backend,
    dtypes: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16"),
    matmul_n: int | None = None,
    copy_bytes: int | None = None,
    min_time_s: float | None = None,
    max_call_s: float = SLOW_CALL_S,
    timer: Callable[[], float] = time.perf_counter,
) -> list[dict]:
    """Achievable dense-matmul TFLOP/s per dtype (2n^3 FLOPs per n x n @ n x n) and copy
    bandwidth in GB/s (read + write: 2 x bytes per dst.copy_(src)) on `backend`.

    A ceiling is what the device can do, so `value` comes from the fast end of the timed
    iterations (their 5th percentile, `p05_ms`), which a busy or drifting machine drags
    down less than the median (`median_ms`, kept beside it).  A dtype the device cannot
    multiply gives value None and an `error` (tf32 on the CPU, or on a GPU without TF32); one it
    multiplies very slowly is measured at a smaller n (:func:`_matmul_size`; the row's `size`
    says which; ``timer`` times the calls that choose it).  fp32 is measured in IEEE fp32 and tf32 in
    the TF32 math mode, as cells run them.

    Each measurement runs for at least ``min_time_s`` (default 2 s on GPUs, whose boost clocks fall
    under a sustained GEMM, and 0.5 s on the CPU).  A copy the device cannot hold gives an error row
    too: no failure ends the probe."""
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise KdbenchError(f"unknown dtype(s) {unknown}; use {', '.join(DTYPES)}")
    gpu = backend.device_type == "cuda"
    n = matmul_n or (8192 if gpu else 2048)
    nbytes = copy_bytes or (2**30 if gpu else 64 * 2**20)
    if min_time_s is None:
        min_time_s = GPU_MIN_TIME_S if gpu else CPU_MIN_TIME_S
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
        problem = tf32_problem(backend) if d == "tf32" else ""
        if problem:
            row["error"] = problem
            rows.append(row)
            continue
        try:
            with math_mode(d == "tf32"):  # fp32 is IEEE fp32, as every cell runs it
                size = _matmul_size(DTYPES[d], n, backend, max_call_s, timer)
                a = torch.randn(size, size, device=backend.device).to(DTYPES[d])
                b = torch.randn(size, size, device=backend.device).to(DTYPES[d])
                median, fast = times_ms(lambda a=a, b=b: torch.mm(a, b), backend, min_time_s)
            row.update(size=size, median_ms=median, p05_ms=fast, value=2 * size**3 / (fast / 1e3) / 1e12)
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            row["error"] = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        finally:
            a = b = None
        rows.append(row)
    copy = {
        "kind": "copy",
        "dtype": "uint8",
        "size": nbytes,
        "value": None,
        "unit": "GB/s",
        "median_ms": None,
        "p05_ms": None,
        "error": None,
    }
    try:
        src = torch.ones(nbytes, dtype=torch.uint8, device=backend.device)
        dst = torch.empty_like(src)
        median, fast = times_ms(lambda: dst.copy_(src), backend, min_time_s)
        copy.update(median_ms=median, p05_ms=fast, value=2 * nbytes / (fast / 1e3) / 1e9)
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        copy["error"] = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    finally:
        src = dst = None
    rows.append(copy)
    return rows


def probe_env(backend: Backend) -> dict[str, Any]:
    """Environment columns for a probe: :func:`kdbench.hw.environment.capture` plus `backend`."""
    return {**capture(backend), "backend": backend.name}
