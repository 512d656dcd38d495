"""The memory stage: after a cell, the device's allocated memory is back at its baseline (the libraries'
workspaces, left by the first cell, aside), and a cell measured twice reports the same peaks."""

from __future__ import annotations

import gc

import torch

from kdbench.config.plan import Cell
from kdbench.hw.backends import Backend
from kdbench.models.cache import ModelCache
from kdbench.run.cell import measure_cell

from ..report import Report
from ..steps import vision_config


def check_memory(backend: Backend, report: Report, repeats: int = 2) -> None:
    report.section("memory: back at the baseline after a cell")
    if backend.device_type != "cuda":
        report.info("no GPU: the CPU has no allocator counters to check")
        return
    cache = ModelCache()
    cell = Cell(0, "memory-check", vision_config())

    def allocated() -> int:
        gc.collect()
        backend.synchronize()
        return torch.cuda.memory_allocated(backend.device)

    before = allocated()
    first = measure_cell(cell, backend, cache)
    baseline = allocated()  # library workspaces (cuBLAS, MIOpen) stay after the first cell
    report.info(f"allocated before any cell {before} B, after the first {baseline} B (workspaces)")
    peaks = []
    rows: list[dict] = []
    for i in range(repeats):
        rows = measure_cell(cell, backend, cache)
        after = allocated()
        report.check(f"after cell {i + 2}: allocated {after} B, baseline {baseline} B", after == baseline)
        peaks.append({r["measurement"]: r.get("peak_memory_bytes") for r in rows})
    report.check(f"all rows ok: {[r['status'] for r in first + rows]}", all(r["status"] == "ok" for r in first + rows))
    if len(peaks) >= 2:
        report.check(f"the same peaks when measured again: {peaks[0]} and {peaks[1]}", peaks[0] == peaks[1])
    else:
        report.info(f"peaks {peaks[0]} (--quick: measured once after the first, so not compared)")
