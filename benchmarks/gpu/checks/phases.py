"""The phases stage: a cell's step timed with and without its phase events, over paired rounds in alternating
order, so that what the phase stamps cost the step is seen apart from the machine's drift."""

from __future__ import annotations

import statistics

from kdbench.hw.backends import Backend
from kdbench.measure.timing import timed_loop

from ..report import Report
from ..steps import cell_step, vision_config

PHASE_TOLERANCE = 0.05


def check_phase_overhead(backend: Backend, report: Report, pairs: int = 16) -> None:
    report.section("phase stamps: a step with and without its phase events")
    config = vision_config()
    step = cell_step(backend, config)
    clock = step.clock
    for _ in range(3):
        step()
    ratios = []
    medians: dict[str, list[float]] = {"stamped": [], "plain": []}
    for i in range(pairs):
        for name in ("stamped", "plain") if i % 2 == 0 else ("plain", "stamped"):
            step.clock = clock if name == "stamped" else None
            raw = timed_loop(step, backend.clock(), warmup=1, min_iters=5, min_time_s=0.2, max_iters=10_000)
            medians[name].append(statistics.median(raw.samples_ms))
        ratios.append(medians["stamped"][-1] / medians["plain"][-1])
    step.clock = clock
    step.close()
    ratio = statistics.median(ratios)
    report.check(
        f"resnet56->resnet20 kd+at bs128: stamped {statistics.median(medians['stamped']):.3f} ms, plain "
        f"{statistics.median(medians['plain']):.3f} ms; median of {pairs} paired ratios {ratio:.4f} "
        f"(within 1 ± {PHASE_TOLERANCE})",
        abs(ratio - 1) <= PHASE_TOLERANCE,
    )
