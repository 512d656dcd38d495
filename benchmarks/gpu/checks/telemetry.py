"""The telemetry stage: the management library (NVML or amdsmi) reads the GPU torch uses (its UUID or PCI
address, read back from the library), and the energy counter agrees with the integral of the sampled power over
a window of GEMMs."""

from __future__ import annotations

import os

import numpy as np
import torch

from kdbench.hw.backends import Backend
from kdbench.measure.telemetry import TelemetrySampler, _same_bdf, device_ids
from kdbench.measure.timing import timed_loop

from ..report import Report

ENERGY_TOLERANCE = 0.25


def _gemm_loop(backend: Backend, seconds: float, on_window=None):
    n = 8192
    a = torch.randn(n, n, device=backend.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=backend.device, dtype=torch.bfloat16)
    return timed_loop(
        lambda: torch.mm(a, b),
        backend.clock(),
        warmup=5,
        min_iters=20,
        min_time_s=seconds,
        max_iters=1_000_000,
        on_window=on_window,
    )


def check_telemetry(backend: Backend, report: Report) -> None:
    report.section("telemetry: the GPU torch uses, and energy from its counter")
    if backend.device_type != "cuda":
        report.info("no GPU: nothing to check")
        report.unmeasured("the CPU has no energy counter kdbench reads", "energy_ratio")
        return
    visible = {
        k: os.environ[k]
        for k in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
        if k in os.environ
    }
    ids = device_ids(backend)
    report.info(f"torch device {backend.device}: uuid {ids.uuid}, PCI {ids.bdf}; visible devices {visible or 'all'}")
    with TelemetrySampler(backend, interval_s=0.05) as sampler:
        raw = _gemm_loop(backend, 6.0, on_window=sampler.on_window)
    t = sampler.result(len(raw.samples_ms), 1, raw.window_s)
    if not report.check(f"telemetry available ({t.source or sampler.source}): {t.reason or 'yes'}", t.available):
        report.unmeasured(f"no telemetry: {t.reason}", "energy_ratio")
        return
    reader = sampler._reader
    lib, handle = reader.lib, reader.handle
    if sampler.source == "pynvml":
        uuid = lib.nvmlDeviceGetUUID(handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        bus = lib.nvmlDeviceGetPciInfo(handle).busId
        bus = bus.decode() if isinstance(bus, bytes) else bus
        same = (ids.uuid and uuid.removeprefix("GPU-").lower() == ids.uuid.lower()) or _same_bdf(bus, ids.bdf)
        report.check(f"NVML matched {t.device}; its UUID {uuid}, PCI {bus}", bool(same))
    else:
        bdf = lib.amdsmi_get_gpu_device_bdf(handle)
        report.check(f"amdsmi matched {t.device}; its PCI address {bdf}", _same_bdf(bdf, ids.bdf))
    window = raw.window_s
    points = np.array([(s[0], s[1]) for s in sampler.samples if window[0] <= s[0] <= window[1] and s[1] is not None])
    sampled = float(np.trapezoid(points[:, 1], points[:, 0])) if len(points) >= 2 else None
    report.info(
        f"{len(raw.samples_ms)} GEMMs over {t.window_s:.2f} s: mean power {t.mean_power_w} W, clock {t.mean_clock_mhz} "
        f"MHz, kernel-active {t.mean_util_pct} %"
    )
    if t.energy_source != "counter":
        report.check(f"energy counter readable (energy from: {t.energy_source})", False)
        report.unmeasured(f"no energy counter (energy from: {t.energy_source})", "energy_ratio")
        return
    if sampled is None:
        report.check("at least two power samples in the window", False)
        report.unmeasured("under two power samples in the window", "energy_ratio")
        return
    # the sampled integral spans first to last sample, a little less than the window
    span = points[-1, 0] - points[0, 0]
    sampled_full = sampled * t.window_s / span
    ratio = t.energy_j / sampled_full
    report.figure("energy_ratio", ratio)
    report.check(
        f"energy: counter {t.energy_j:.1f} J, sampled power {sampled_full:.1f} J over the window (ratio {ratio:.3f}, "
        f"within 1 ± {ENERGY_TOLERANCE})",
        abs(ratio - 1) <= ENERGY_TOLERANCE,
    )
