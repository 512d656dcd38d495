"""The clocks and idle stages: kdbench's device-event clock against synchronised wall time, on a GPU-bound GEMM
and a host-bound loop of tiny kernels (and its launch-bound flag on each), and device events around a host
sleep on an idle stream, which every ``one_off_ms`` relies on."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from kdbench.hw.backends import Backend, choose_autocast
from kdbench.measure.timing import timed_loop

from ..report import Report

CLOCK_TOLERANCE = 0.10
IDLE_GAP_MS = 200.0
IDLE_MIN_MS = 190.0


def _synced_wall_ms(fn: Callable[[], object], backend: Backend, calls: int) -> float:
    backend.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    backend.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def check_clocks(backend: Backend, report: Report) -> None:
    report.section("clocks: device events against synchronised wall time")
    gpu = backend.device_type == "cuda"
    n = 8192 if gpu else 512
    dtype = torch.bfloat16 if gpu and choose_autocast(backend, "bf16").applied else torch.float32
    a = torch.randn(n, n, device=backend.device, dtype=dtype)
    b = torch.randn(n, n, device=backend.device, dtype=dtype)
    one = torch.ones(1, device=backend.device)

    def host_bound() -> None:
        x = one
        for _ in range(200):
            x = x + 1

    cases = (
        (f"GEMM {n}x{n} {str(dtype)[6:]}", lambda: torch.mm(a, b), False, "clock_gemm"),
        ("200 tiny adds", host_bound, True, "clock_adds"),
    )
    for name, fn, launch_bound, key in cases:
        raw = timed_loop(fn, backend.clock(), warmup=5, min_iters=20, min_time_s=1.0, max_iters=100_000)
        event = statistics.median(raw.samples_ms)
        wall = _synced_wall_ms(fn, backend, len(raw.samples_ms))
        report.figure(f"{key}_ratio", event / wall)
        report.check(
            f"{name}: {raw.clock} median {event:.4g} ms, synced wall {wall:.4g} ms per call "
            f"(ratio {event / wall:.3f}, within 1 ± {CLOCK_TOLERANCE})",
            abs(event / wall - 1) <= CLOCK_TOLERANCE,
        )
        flagged = raw.launch_bound(event)
        if launch_bound:
            report.figure(f"{key}_launch_bound", flagged)
        host = f"{statistics.median(raw.host_ms):.4g} ms" if raw.host_ms else "n/a"
        expected = launch_bound if gpu else None  # host clocks: host time is all there is
        report.check(
            f"{name}: host issue time {host}, launch_bound {flagged} (expected {expected})", flagged is expected
        )


def check_idle(backend: Backend, report: Report) -> None:
    report.section(f"idle: device events around a {IDLE_GAP_MS:.0f} ms host sleep on an idle stream")
    if backend.device_type != "cuda":
        report.info("no GPU: the host clock times the sleep by construction")
        return
    clock = backend.clock()
    torch.ones(1, device=backend.device).add_(1)  # the context and the stream exist before the first event
    backend.synchronize()
    start = clock.stamp()
    host = time.perf_counter()
    time.sleep(IDLE_GAP_MS / 1e3)
    end = clock.stamp()
    host_ms = (time.perf_counter() - host) * 1e3
    clock.sync()
    event_ms = clock.elapsed_ms(start, end)
    report.check(
        f"{clock.name}: {event_ms:.1f} ms between the events, host {host_ms:.1f} ms (the gap included: "
        f">= {IDLE_MIN_MS:.0f} ms; one_off_ms relies on it)",
        event_ms >= IDLE_MIN_MS,
    )
