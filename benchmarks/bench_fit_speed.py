"""Benchmark: how long the fit planner takes to predict the headline cell, and what it predicts.

Issue 31's goal: a fake step of the Llama-3.1-8B -> Llama-3.2-1B pair at 4 x 4,096 tokens plans in under a minute on
the 2-core CPU, allocating nothing.  Two cells (bf16 autocast, fused_linear, a bf16-held teacher): one device, and
8-rank FSDP2 (rank 0's device; the fake process group of torch's ``fake`` backend).  Each prediction runs in this
process after a first, untimed one that pays the imports and transformers' first model build; its peak, phase and
breakdown are printed, attached to pytest-benchmark's record and written to benchmarks/.results/fit_speed.json.
The process's resident peak is printed beside them: a fake run holds no tensor's bytes.  Bound: 60 s per cell.

Issue 43 (opt-in, ``KDBENCH_FIT_SUITE=1``: about a minute of both cores): ``kdbench fit suites/llm-cuda.yaml --gpu
H100 --gpu MI300X --tokens 1B`` run as a user runs it (a fresh process, its helpers), every cell priced on both
devices; the seconds its last line gives for the fake runs (helpers' start included) must be under 60, judged where
other processes left this run its cores (the project's ``contended`` rule over the command's wall time), printed as
not judged otherwise. The VM's speed drifts from hour to hour: one commit read 56.9 to 74.0 s idle on one evening.
Written to benchmarks/.results/fit_suite.json.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdbench.config.schema import CellConfig
from kdbench.fit.planner import predict
from kdbench.hw.contention import HostLoad, busy_cpu_s

BOUND_S = 60.0
OUT = Path(__file__).resolve().parent / ".results" / "fit_speed.json"
SUITE_OUT = OUT.with_name("fit_suite.json")
ROOT = Path(__file__).resolve().parents[1]
SUITE_COMMAND = ("fit", "suites/llm-cuda.yaml", "--gpu", "H100", "--gpu", "MI300X", "--tokens", "1B")
SUITE_BOUND_S = 60.0  # issue 43: the fake runs of the whole command
SUMMARY = re.compile(r"^(\d+) cells: .*; (\d+) fake runs in ([\d.]+) s$")
GIB = 2**30
BASE = {
    "pair": {"teacher": "llama-3.1-8b", "student": "llama-3.2-1b"},
    "method": "forward_kl",
    "batch_size": 4,
    "data": {"kind": "tokens", "seq_len": 4096},
    "precision": "bf16",
    "teacher_precision": "bf16",
    "teacher": {"weights": "bf16"},
    "loss_impl": "fused_linear",
}
CELLS = {"one device": {}, "FSDP2, 8 ranks": {"parallel": "fsdp", "world_size": 8}}


def test_the_headline_cell_is_predicted_within_a_minute(benchmark, report_line):
    predict(CellConfig.model_validate({**BASE, "data": {"kind": "tokens", "seq_len": 64}, "batch_size": 1}))  # warm

    def run():
        out = {}
        for name, over in CELLS.items():
            start = time.perf_counter()
            p = predict(CellConfig.model_validate({**BASE, **over}), "cuda")
            out[name] = (p, time.perf_counter() - start)
        return out

    results = benchmark.pedantic(run, rounds=1, iterations=1)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rows = {}
    report_line("fit planner, Llama-3.1-8B -> Llama-3.2-1B, 4 x 4,096 tokens, bf16, fused_linear, bf16 teacher:")
    for name, (p, seconds) in results.items():
        assert p.ok, f"{name}: {p.error}"
        assert seconds < BOUND_S, f"{name}: {seconds:.1f} s"
        rows[name] = {
            "seconds": seconds,
            "peak_gib": p.peak_bytes / GIB,
            "phase": p.phase,
            "breakdown_gib": {k: v / GIB for k, v in p.breakdown.items()},
            "host": p.host,
        }
        parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in p.breakdown.items() if v)
        report_line(f"  {name:<15} {seconds:5.1f} s  peak {p.peak_bytes / GIB:6.2f} GiB in {p.phase} ({parts} GiB)")
    report_line(f"  process resident peak {rss / GIB:.2f} GiB (nothing allocated for the models)")
    result = {"cells": rows, "bound_s": BOUND_S, "process_peak_rss_bytes": rss}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    benchmark.extra_info.update(result)
    assert rss < 4 * GIB  # an 8B teacher held for real would be 16 GB


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.mark.skipif(not os.environ.get("KDBENCH_FIT_SUITE"), reason="a minute of both cores: KDBENCH_FIT_SUITE=1")
def test_the_llm_cuda_suite_is_fitted_on_two_gpus_within_a_minute(report_line):
    cores = sorted(os.sched_getaffinity(0))
    busy, children, start = busy_cpu_s(cores), _children_cpu_s(), time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "kdbench", *SUITE_COMMAND], cwd=ROOT, capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - start
    others = busy_cpu_s(cores) - busy - (_children_cpu_s() - children)  # the command's helpers are its children
    load = HostLoad(wall, len(cores), min(max(0.0, others), wall * len(cores)), len(cores))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    found = SUMMARY.match(lines[-1])
    assert found, lines[-1]
    cells, runs, fake_s = int(found[1]), int(found[2]), float(found[3])
    for device in ("H100 80GB", "MI300X"):  # every cell priced on both devices, with the budget's hours and cost
        priced = [line for line in lines if line.lstrip().startswith(f"step on {device}")]
        assert len(priced) == cells and all("device-hours" in line for line in priced), device
    judged = not load.contended
    verdict = f"must be < {SUITE_BOUND_S:.0f} s" if judged else f"NOT JUDGED: {load.describe()}"
    report_line(f"kdbench {' '.join(SUITE_COMMAND)}:")
    report_line(
        f"  {cells} cells, {runs} fake runs in {fake_s:.1f} s ({verdict}); {wall:.1f} s wall, {len(lines)} lines; "
        f"host_busy_share {load.busy_share:.2f}; saved to {SUITE_OUT}"
    )
    result = {
        "command": list(SUITE_COMMAND),
        "cells": cells,
        "fake_runs": runs,
        "fake_runs_s": fake_s,
        "wall_s": wall,
        "lines": len(lines),
        "bound_s": SUITE_BOUND_S,
        "host_busy_share": load.busy_share,
        "judged": judged,
    }
    SUITE_OUT.parent.mkdir(parents=True, exist_ok=True)
    SUITE_OUT.write_text(json.dumps(result, indent=2))
    if judged:
        assert fake_s < SUITE_BOUND_S
