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

    With `path` None, only run the calls (a data-parallel rank keeping step with the one
    that traces) and return nothing."""
    from torch.profiler import ProfilerActivity, profile

    if path is None:
        for _ in range(calls):
            fn()
        return {}

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
