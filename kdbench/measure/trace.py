"""torch.profiler traces of a measured callable, in a separate pass after the timed loop."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kdbench.hw.backends import Backend

TOP_OPS = 10


def trace(fn: Callable[[], Any], backend: Backend, path: Path | None, calls: int = 3) -> dict[str, Any]:
    """Run `fn` `calls` times under torch.profiler (a separate pass, after the timed loop),
    write a Chrome trace to `path`, and return it with the top operators by self time.

    With `path` None, only run the calls (a data-parallel rank keeping step with the one that
    traces).  A profiler that cannot start (CUPTI refused, no roctracer) or fails later costs
    the trace, not the measured row: the calls still run (the other ranks count on them) and
    ``trace_error`` says why.  On GPUs the top operators are device kernels alone (an operator
    and the kernel it launches would count the same time twice); on the CPU, CPU operators."""
    if path is None:
        return _run(fn, calls)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    gpu = backend.device_type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    try:
        prof = profile(activities=activities)
        prof.__enter__()
    except Exception as exc:
        return {**_run(fn, calls), "trace_error": _why(exc)}
    try:
        _run(fn, calls)
        backend.synchronize()
    finally:
        try:
            prof.__exit__(None, None, None)
        except Exception as exc:
            return {"trace_error": _why(exc)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        if gpu:
            events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
            self_us = [float(e.self_device_time_total) for e in events]
        else:
            events = list(prof.key_averages())
            self_us = [float(e.self_cpu_time_total) for e in events]
    except Exception as exc:
        return {"trace_error": _why(exc)}
    top = sorted(zip(self_us, events), key=lambda pair: pair[0], reverse=True)[:TOP_OPS]
    ops = [{"op": e.key, "self_ms_per_call": us / 1e3 / calls, "count": int(e.count) // calls} for us, e in top]
    return {"trace_file": str(path), "top_ops": json.dumps(ops)}


def _run(fn: Callable[[], Any], calls: int) -> dict[str, Any]:
    for _ in range(calls):
        fn()
    return {}


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"the profiler failed: {type(exc).__name__}: {text[0] if text else ''}"[:500]
