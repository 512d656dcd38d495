"""A worker's cost per cell must not grow over a sweep (issue 45, item 6).

What a worker keeps between cells is counted, not timed (the machine these tests run on is shared): a sweep of
tiny cells of different seeds runs through the code path a worker runs (:func:`kdbench.run.workers.execute` in one
:class:`kdbench.run.jobs.WorkerContext`), and after every cell the objects the garbage collector tracks, the
worker's tables (:class:`kdbench.core.worker_state.WorkerState`) and the Python calls the cell made must stay
what they were after its first cells.  The wall-clock side of it is benchmarks/bench_sweep_overhead.py.
"""

from __future__ import annotations

import gc
import sys
from collections import Counter

import pytest

from kdbench.config import load_suite
from kdbench.core.names import Status
from kdbench.core.worker_state import current, install
from kdbench.hw.backends import resolve
from kdbench.measure import walltime
from kdbench.measure.step import MeasureOptions
from kdbench.run.engine import RunOptions, run_suite
from kdbench.run.plan import plan_jobs
from kdbench.run.workers import WorkerSetup, context, execute
from tests.support.helpers import log_lines, write_suite
from tests.support.suites import tiny_suite

CELLS = 7


def _python_calls(job, ctx) -> tuple[int, list]:
    """The Python function calls ``job`` makes in the worker (psutil's left out: it reads one /proc file per process
    on the host, which other processes change), and its rows."""
    calls: Counter = Counter()

    def count(frame, event, arg):
        if event == "call" and "psutil" not in frame.f_code.co_filename:
            calls[frame.f_code.co_name] += 1

    sys.setprofile(count)
    try:
        result = execute(job, ctx)
    finally:
        sys.setprofile(None)
    return sum(calls.values()), result.rows


@pytest.mark.slow
def test_a_seed_sweep_keeps_the_worker_flat(tmp_path):
    suite = tiny_suite(name="growth", matrix={"seed": list(range(CELLS))})
    plan = plan_jobs(load_suite(write_suite(tmp_path / "s.yaml", **suite)), None, "cpu")
    assert len(plan.jobs) == CELLS
    previous = current()
    ctx = context(WorkerSetup(resolve("cpu"), False, 1, MeasureOptions(run_dir=str(tmp_path))))
    ctx.cache.capacity = 2  # the model cache holds its last two seeds' models (6 by default): full after cell 2
    try:
        calls, objects, flops = [], [], []
        for job in plan.jobs:
            n, rows = _python_calls(job, ctx)
            assert [r["status"] for r in rows] == [Status.OK] * 3
            gc.collect()
            calls.append(n)
            objects.append(len(gc.get_objects()))
            flops.append(len(ctx.state.inference_flops))
    finally:
        install(previous)
    # the served model's FLOPs are counted once, not once a seed (they were, and the table grew a key a cell)
    assert flops == [1] * CELLS
    # nothing the cells leave behind piles up: the tracked objects after cell 3 and after the last agree
    assert abs(objects[-1] - objects[2]) <= 10, objects
    # and a cell's Python work is the same at the end as after the first cells (the first pays one-off imports)
    assert max(calls[2:]) <= 1.01 * min(calls[2:]), calls


def test_the_closing_split_names_what_a_job_pays_besides_its_measurements():
    split = {"measuring": 3.0, "fit check": 18.6, "accuracy ledger": 1.2, "total": 40.0}
    assert walltime.per_job(split, 300) == "; a job's fit check 62 ms, accuracy ledger 4 ms (300 jobs)"
    assert walltime.per_job({"fit check": 0.5, "total": 1.0}, 1) == "; a job's fit check 500 ms (1 job)"
    assert walltime.per_job({"measuring": 3.0, "total": 4.0}, 10) == ""  # --no-fit-check, no LM ledger: nothing


@pytest.mark.slow
def test_a_run_says_its_fit_check_per_job(tmp_path):
    path = write_suite(tmp_path / "s.yaml", **tiny_suite(matrix={"seed": [0, 1]}))
    with log_lines() as lines:
        outcome = run_suite(load_suite(path), RunOptions(out_dir=tmp_path / "res", inline=True))
    closing = [line for line in lines if line.startswith("wall time")]
    assert len(closing) == 1 and outcome.wall["fit check"] > 0
    per_job = outcome.wall["fit check"] * 1e3 / 2
    assert closing[0].endswith(f"; a job's fit check {per_job:,.0f} ms (2 jobs)"), closing[0]
