"""Benchmark: the step-time model's prediction against the measured step, for the step cells of the CPU suites.

For each cell of suites/cpu.yaml, suites/llm-cpu.yaml and suites/methods.yaml (issue 43's cells), in this one
process: :func:`kdbench.fit.planner.predict` (the cell's own step on fake tensors, its operator census) priced by
:func:`kdbench.fit.steptime.predict_step_time` on this machine's rates (:func:`~kdbench.fit.steptime.
rates_from_probe`: a probe measured here at the start, :func:`kdbench.measure.probe.measure_ceilings`, with the
census's operator calls timed at their shapes, :func:`kdbench.fit.columns.timed_here`, as a run's rows are), against the
median of the cell's real step timed as a run times it (:func:`kdbench.measure.timing.timed_loop` with the cell's
own timing), the host's load over it read by kdbench's contention meter.  Printed per cell: predicted, measured,
their ratio, the ratio to the probe's class rates alone (no call timed: the roofline a table device gets) and the
prediction's bound shares; then the median |ln ratio| of both.  Also printed: what the model's two
CPU constants (:data:`~kdbench.fit.steptime.CPU_LAUNCH_US`, :data:`~kdbench.fit.steptime.CPU_FIRST_TOUCH_GBPS`)
measure on this machine now, beside their stated values (the model uses the constants; nothing is fitted).

Issue 43's target, on an idle 2-core machine over every ok step cell of the three suites: every ratio within
:data:`kdbench.core.limits.STEP_TIME_TOLERANCE` (0.67-1.5) and the median |ln ratio| at most 0.15.

Not in the benchmark lane by default (it skips): its three quick cells took 107 s on the shared 2-core VM, over
the lane's minute.  Which cells, by environment variable:

* ``KDBENCH_STEP_TIME=1``: :data:`QUICK`, one cell of each suite (a vision pair, the LM pair, a feature method);
* ``KDBENCH_STEP_TIME_ALL=1``: every cell of the three suites (methods.yaml's 72 with them: many minutes), or
  with ``KDBENCH_STEP_TIME_MATCH=a|b`` those whose label holds ``a`` or ``b``;
* ``KDBENCH_STEP_TIME_RESULTS=<folder>``: no cell run, the ``distill_step`` rows of a results folder read instead
  (``kdbench run`` of the suites after ``kdbench probe``: their ``predicted_step_ms`` and ``median_ms``).

Bounds are asserted only where the contention meter found the machine idle (and the median's only over every
cell); otherwise printed with the reason.  Written to benchmarks/.results/step_time.json.
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import time
from pathlib import Path

import pytest
import torch

from kdbench.config.load import load_suite
from kdbench.core.limits import STEP_TIME_TOLERANCE
from kdbench.core.stats.samples import summarize
from kdbench.distill.step import DistillStep
from kdbench.fit.columns import timed_here
from kdbench.fit.planner import predict
from kdbench.fit.steptime import CPU_FIRST_TOUCH_GBPS, CPU_LAUNCH_US, predict_step_time, rates_from_probe
from kdbench.hw.backends import resolve
from kdbench.hw.contention import HostMeter
from kdbench.measure.probe import measure_ceilings
from kdbench.measure.probe_classes import measure_classes
from kdbench.measure.timing import timed_loop
from kdbench.models import ModelCache
from kdbench.store.probes import ceiling_key
from kdbench.workloads import expand_checked, workload_of

ROOT = Path(__file__).resolve().parent.parent
SUITES = ("suites/cpu.yaml", "suites/llm-cpu.yaml", "suites/methods.yaml")
OUT = Path(__file__).resolve().parent / ".results" / "step_time.json"
# The lane's default: one cell of each suite, a vision pair and the LM pair (labels as the suites expand them)
QUICK = (
    ("suites/cpu.yaml", "resnet56->resnet20 kd fp32 bs32"),
    ("suites/llm-cpu.yaml", "tiny-llama-teacher->tiny-llama-student forward_kl fp32 bs2 seq256 dense"),
    ("suites/methods.yaml", "resnet56->resnet20 fitnet fp32 teacher-live bs32"),
)
SLOW = 3.0  # a precision at least this much slower than fp32 in the probe is skipped, as the suites skip it


def _cells(slow: set[str]) -> list[tuple[str, object]]:
    every = [(suite, cell) for suite in SUITES for cell in expand_checked(load_suite(ROOT / suite))]
    every = [(s, c) for s, c in every if c.config.precision not in slow]
    if os.environ.get("KDBENCH_STEP_TIME_ALL") == "1":
        match = os.environ.get("KDBENCH_STEP_TIME_MATCH")  # cells whose label holds one of these (|-separated)
        return [(s, c) for s, c in every if not match or any(m in c.label for m in match.split("|"))]
    picked = [(s, c) for s, c in every if (s, c.label) in QUICK]
    return picked or every[:3]


def step_us_per_operator() -> float:
    """The linear -> linear cell's step (nothing but overhead) over its census's operators: µs per operator."""
    from kdbench.config.schema import CellConfig

    config = CellConfig.model_validate(
        {"pair": {"teacher": "linear", "student": "linear"}, "batch_size": 2,
         "data": {"kind": "synthetic", "shape": [3, 4, 4], "num_classes": 4}}
    )  # fmt: skip
    backend = resolve("cpu")
    census = predict(config, "cpu").census
    operators = sum(r.launches for r in census.records)
    workload = workload_of(config)
    pair = workload.step_pair(config, backend, ModelCache(capacity=0), None)
    x, y = workload.batch(config, config.batch_size, backend.device, config.seed, pair)
    step = DistillStep(*pair, x, y, config, backend, workload)
    try:
        raw = timed_loop(step, backend.clock(), warmup=20, min_iters=200, min_time_s=0.2, max_iters=2000)
    finally:
        step.close()
    return summarize(raw.samples_ms).median_ms * 1e3 / operators


def machine_constants() -> dict[str, float]:
    """What the model's CPU constants measure on this machine now: µs per operator of the smallest step, µs per bare
    operator (an add of two 1-element tensors, from Python), and GB/s filling a new 64 MiB tensor (its pages mapped
    anew) against one reused."""
    x = torch.ones(1)
    for _ in range(100):
        x + x
    start = time.perf_counter()
    for _ in range(5000):
        x + x
    tiny_us = (time.perf_counter() - start) / 5000 * 1e6
    n = 16 * 2**20
    kept = torch.empty(n)

    def best(fn) -> float:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    fresh = n * 4 / best(lambda: torch.empty(n).fill_(1.0)) / 1e9
    reused = n * 4 / best(lambda: kept.fill_(1.0)) / 1e9
    return {
        "step_us_per_operator": step_us_per_operator(),
        "tiny_op_us": tiny_us,
        "first_touch_gbps": fresh,
        "fill_reused_gbps": reused,
    }


def _measure(config, ceiling: dict) -> dict:
    """One cell: its predicted step and its measured median (the cell's own timing), and the host's load."""
    backend = resolve("cpu")
    prediction = predict(config, "cpu", shapes=True)
    if not prediction.ok:
        return {"unpredictable": prediction.error}
    rates = rates_from_probe(ceiling, config.precision)
    roofline = predict_step_time(prediction, rates, config.precision)  # the probe's class rates alone
    predicted = predict_step_time(prediction, timed_here(rates, prediction.census, backend, config.precision))
    workload = workload_of(config)
    teacher, student = workload.step_pair(config, backend, ModelCache(capacity=0), None)
    x, y = workload.batch(config, config.batch_size, backend.device, config.seed, (teacher, student))
    step = DistillStep(teacher, student, x, y, config, backend, workload)
    meter = HostMeter(torch.get_num_threads())
    try:
        t = config.timing
        raw = timed_loop(
            step, backend.clock(), warmup=max(1, t.warmup), min_iters=t.min_iters, min_time_s=t.min_time_s,
            max_iters=t.max_iters, max_time_s=t.max_time_s, on_window=meter.on_window,
        )  # fmt: skip
    finally:
        step.close()
    del step, teacher, student, x, y
    gc.collect()
    measured = summarize(raw.samples_ms).median_ms
    load = meter.result()
    return {
        "predicted_ms": predicted.ms,
        "measured_ms": measured,
        "ratio": measured / predicted.ms,
        "roofline_ms": roofline.ms,
        "roofline_ratio": measured / roofline.ms,
        "bound": predicted.bound,
        "phases_ms": predicted.phases,
        "fit_s": prediction.seconds,
        "host": load.describe() if load is not None else "not read",
        "contended": bool(load is not None and load.contended),
    }


def _from_results(folder: str) -> list[dict]:
    """The distill_step rows of a results folder that carry both figures."""
    from kdbench.store.results import read_results

    df = read_results([folder])
    steps = df[(df["measurement"] == "distill_step") & df["predicted_step_ms"].notna() & df["median_ms"].notna()]
    return [
        {
            "suite": r["suite"],
            "cell": r["cell_label"],
            "predicted_ms": float(r["predicted_step_ms"]),
            "measured_ms": float(r["median_ms"]),
            "ratio": float(r["predicted_step_ratio"]),
            "host": f"host_busy_share {r.get('host_busy_share')}",
            "contended": bool(r.get("contended")) if r.get("contended") is not None else False,
        }
        for _, r in steps.iterrows()
    ]


ASKED = any(os.environ.get(k) for k in ("KDBENCH_STEP_TIME", "KDBENCH_STEP_TIME_ALL", "KDBENCH_STEP_TIME_RESULTS"))


@pytest.mark.skipif(not ASKED, reason="minutes on a shared 2-core VM: set KDBENCH_STEP_TIME=1 (module docstring)")
def test_step_time(benchmark, report_line):
    threads = torch.get_num_threads()
    results = os.environ.get("KDBENCH_STEP_TIME_RESULTS")
    constants = machine_constants()
    ceiling: dict = {}
    skipped: list[str] = []

    def run() -> list[dict]:
        if results:
            return _from_results(results)
        rows = measure_ceilings(resolve("cpu"), dtypes=("fp32", "bf16"))
        rows += measure_classes(resolve("cpu"), dtypes=("fp32", "bf16"))
        ceiling.update({ceiling_key(r["kind"], r["dtype"]): r["value"] for r in rows if r["value"] is not None})
        ceiling.update(probe_id="this benchmark's probe")
        fp32 = ceiling.get("matmul_fp32") or 0
        slow = {p for p in ("bf16",) if not ceiling.get(f"matmul_{p}") or fp32 / ceiling[f"matmul_{p}"] >= SLOW}
        skipped.extend(sorted(slow))
        out = []
        for suite, cell in _cells(slow):
            out.append({"suite": suite, "cell": cell.label, **_measure(cell.config, ceiling)})
        return out

    start = time.perf_counter()
    rows = benchmark.pedantic(run, rounds=1, iterations=1)
    total_s = time.perf_counter() - start
    low, high = STEP_TIME_TOLERANCE
    measured = [r for r in rows if "ratio" in r]
    ln = [abs(math.log(r["ratio"])) for r in measured]
    median_ln = statistics.median(ln) if ln else None
    result = {
        "tolerance": [low, high],
        "threads": threads,
        "probe": ceiling,
        "constants": {"CPU_LAUNCH_US": CPU_LAUNCH_US, "CPU_FIRST_TOUCH_GBPS": CPU_FIRST_TOUCH_GBPS},
        "measured_now": constants,
        "median_abs_ln_ratio": median_ln,
        "seconds": total_s,
        "rows": rows,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    benchmark.extra_info.update({k: v for k, v in result.items() if k != "rows"})

    report_line(
        f"Step-time model against the measured step, {len(measured)} cells of {', '.join(SUITES)}, {threads} threads, "
        f"{total_s:.0f} s (target: every ratio within {low:.2f}-{high:.2f}, median |ln ratio| <= 0.15):"
    )
    if ceiling:
        report_line(
            f"  probe: fp32 {ceiling.get('matmul_fp32', 0) * 1e3:.0f} GFLOP/s, bf16 "
            f"{(ceiling.get('matmul_bf16') or 0) * 1e3:.0f} GFLOP/s, copy {ceiling.get('copy', 0):.1f} GB/s"
        )
    report_line(
        f"  CPU constants: launch floor {CPU_LAUNCH_US} us (now: {constants['step_us_per_operator']:.1f} us per "
        f"operator of the linear -> linear step, {constants['tiny_op_us']:.2f} us a bare add); "
        f"first touch {CPU_FIRST_TOUCH_GBPS} GB/s (measures {constants['first_touch_gbps']:.2f} now, "
        f"{constants['fill_reused_gbps']:.1f} GB/s into touched pages)"
    )
    width = max((len(r["cell"]) for r in rows), default=10)
    report_line(
        f"  {'cell':<{width}}{'predicted ms':>14}{'measured ms':>13}{'ratio':>8}{'roofline ratio':>16}   "
        "bound (compute/memory/launch)"
    )
    for r in rows:
        if "ratio" not in r:
            report_line(f"  {r['cell']:<{width}}  not predicted: {r['unpredictable']}")
            continue
        bound = "/".join(f"{v:.0%}" for v in r.get("bound", {}).values())
        busy = "  (busy: " + r["host"] + ")" if r["contended"] else ""
        report_line(
            f"  {r['cell']:<{width}}{r['predicted_ms']:>14,.1f}{r['measured_ms']:>13,.1f}{r['ratio']:>8.3f}"
            f"{r.get('roofline_ratio', math.nan):>16.3f}   {bound}{busy}"
        )
    if median_ln is not None:
        roof = [abs(math.log(r["roofline_ratio"])) for r in measured if "roofline_ratio" in r]
        alone = f"; the probe's class rates alone (no call timed): {statistics.median(roof):.3f}" if roof else ""
        report_line(f"  median |ln ratio| {median_ln:.3f} over {len(ln)} cells{alone}")
    for precision in skipped:
        report_line(f"  {precision} cells not run: {SLOW:.0f}x or more slower than fp32 in this probe (as the suites)")
    assert measured, "no cell measured"
    idle = [r for r in measured if not r["contended"]]
    outside = [f"{r['cell']}: {r['ratio']:.3f}" for r in idle if not low <= r["ratio"] <= high]
    assert not outside, f"measured / predicted outside {low:.2f}-{high:.2f} on an idle machine: {outside}"
    every = os.environ.get("KDBENCH_STEP_TIME_ALL") == "1" or results
    if every and len(idle) == len(measured):
        assert median_ln <= 0.15, f"median |ln ratio| {median_ln:.3f} > 0.15"
