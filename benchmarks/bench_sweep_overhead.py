"""Benchmark: the engine's cost per cell does not grow with the run.

A sweep of 400 tiny cells (linear -> linear on 1x4x4 inputs, 20 timed iterations, one
inference batch size) runs through the real engine and worker process.  For every
cell the engine records its wall time (from handing it to the worker until its part
is stored) and the time the worker spent running it; their difference is the
harness's overhead for that cell: the pipe, stamping, the parquet part, the progress
line.  Its growth over the run is the Theil-Sen line through every cell's figure
(scipy.stats.theilslopes: the median of the slopes between all pairs of cells, which
the shared machine's passing slowdowns hardly move), read at the middle of the last
hundred cells over its value at the middle of cells 2-100: at most 1.2 (a run that
rewrote one file per cell grew from about 60 ms to about 100 ms here).  Not the two
hundreds' own quartiles: on the 2-core VM those move by chance more than the bound
allows (idle runs of one commit read 0.92-1.32 for the engine's overhead, 50-cell lower
quartiles of the whole cell wandered 145-181 ms with no trend), while a cost that grows
with the run tilts the line through all 400.  The quartiles are printed beside it.
And a tiny cell must cost at most 100 ms in all (median over the last hundred) plus 100 ms for its fit check
(issue 31: a fake run of the step and one more step under torch.profiler, which every step row gets; the fit
check's own bound is 100 ms a cell, read from the run's wall-time split): about 44 ms here before the fit
check and 105-189 ms with it, while a full garbage collection of torch's objects before each measurement
once made it 500 ms without changing the ratio.  The figures
are printed, attached to pytest-benchmark's record and written to
benchmarks/.results/sweep_overhead.json.

Issue 45 (item 6): the whole of a cell must not grow either, worker included. A cell's whole wall time is the time
between its progress line and the one before (handing it to the worker, the worker's run, stamping, the part and the
line itself: what a user's sweep waits for); its Theil-Sen line must read at most 1.1 times as much over the last
hundred cells as over cells 2-100. That bound is judged on a machine the others left this run's core (the run's own
host meter, :class:`kdbench.hw.contention.HostMeter`, read over each hundred: neither hundred ``contended`` by the
project's rule); on a busier one the figures are printed and the verdict says it was not judged, rather than fail or
pass on the other processes' load. A sweep's growth is otherwise looked for by counting, not timing:
tests/unit/run/test_sweep_growth.py (objects, the worker's tables and the Python calls per cell stay flat). The
issue's 400 cells (about 65 s of CI); ``KDBENCH_SWEEP_CELLS`` sets another count by hand.

Both growths are judged in units of each cell's own timed step (its distillation row's median: the same 20 steps of
the same tiny pair in every cell), not in milliseconds. The 2-core VM's speed drifts by a third over tens of seconds
with nothing else running and no steal time in /proc/stat: at one commit, idle, the whole cell's 25-cell medians went
146 -> 112 -> 190 ms and back while the cells' own step medians went 0.58 -> 0.86 ms with them (correlation 0.76);
in milliseconds the whole cell's growth read 0.95, 1.28 and 1.31 in three idle runs of one commit and 1.13 and 1.19
in two CI runs, in step times 1.03 where milliseconds read 1.11. A cost the harness adds per cell (a file rewritten,
a list walked) does not slow the tiny step and still tilts the line; a slowdown of the whole process (the garbage
collector walking more objects) would slow both, and is what the counting test above looks for. The milliseconds'
growths are printed and saved beside the judged ones.
"""

import itertools
import json
import logging
import os
import statistics
from pathlib import Path

from kdbench.config import load_suite
from kdbench.hw.contention import HostLoad, HostMeter
from kdbench.measure.walltime import FIT, LEDGER
from kdbench.run.engine import RunOptions, run_suite
from kdbench.store import read_results
from tests.support.helpers import write_suite
from tests.support.suites import tiny_suite

CELLS = int(os.environ.get("KDBENCH_SWEEP_CELLS", "400"))  # issue 45's sweep
BLOCK = 100


def quartile(values: list[float]) -> float:
    """The lower quartile (numpy's linear interpolation)."""
    import numpy as np

    return float(np.percentile(values, 25))


def growth(values: list[float], first: int, block: int = BLOCK) -> tuple[float, float, float]:
    """How much a per-cell figure grew over the run: the Theil-Sen line through ``values`` (cell ``first`` onwards,
    in run order) at the middle of the last ``block`` cells over its value at the middle of the first block (cells
    ``first``..``block``), and the same ratio at the ends of the slope's 95 % interval (low, high)."""
    from scipy.stats import theilslopes

    x = list(range(first, first + len(values)))
    fit = theilslopes(values, x, alpha=0.95)
    start, end = (first + block) / 2, x[-1] - (block - 1) / 2
    at_start = fit.intercept + fit.slope * start

    def ratio(slope: float) -> float:
        return (at_start + slope * (end - start)) / at_start

    return ratio(fit.slope), ratio(fit.low_slope), ratio(fit.high_slope)


LIMIT = 1.2
WHOLE_LIMIT = 1.1  # a cell's whole wall time, last hundred against the first (issue 45)
CELL_LIMIT_MS = 100.0  # median wall time of a tiny cell, worker included, before issue 31's fit check
FIT_LIMIT_MS = 100.0  # the fit check's time per tiny cell (issue 31; 55-77 ms on the 2-core VM), and its allowance
# in the cell's: in CI the rest of a tiny cell read 44 ms before the fit check and 44-112 ms with it (unexplained)
OUT = Path(__file__).resolve().parent / ".results" / "sweep_overhead.json"

SUITE = tiny_suite(
    name="sweep-overhead",
    defaults={
        "data": {"kind": "synthetic", "shape": [1, 4, 4], "num_classes": 10},
        "timing": {"min_iters": 20, "max_iters": 20},
    },
    matrix={"seed": list(range(CELLS))},
)


class CellEnds(logging.Handler):
    """When each cell's progress line was logged (kept here, not printed), and the host meter's reading at the ends
    of the first and last hundred cells."""

    def __init__(self, marks: set[int]):
        super().__init__(logging.INFO)
        self.ends: list[float] = []
        self.marks, self.readings = marks, {}
        self.meter = HostMeter(1)

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("["):
            self.ends.append(record.created)
            if len(self.ends) in self.marks:
                self.readings[len(self.ends)] = self.meter.reader()

    def load(self, first: int, last: int) -> HostLoad:
        """What other processes used of this run's cores between the progress lines of cells ``first`` and
        ``last``."""
        (t0, busy0, own0), (t1, busy1, own1) = self.readings[first], self.readings[last]
        cores = len(self.meter.cores_list)
        return HostLoad(t1 - t0, cores, min(max(0.0, busy1 - busy0 - (own1 - own0)), (t1 - t0) * cores), 1)


def step_ms(rows) -> list[float]:
    """Each cell's timed distillation step (its ``median_ms``), in run order: the same 20 steps of the same tiny pair
    in every cell, so what moves it is the machine's speed at that cell, not the harness."""
    table = rows.to_pandas() if hasattr(rows, "to_pandas") else rows
    steps = table[table["measurement"] == "distill_step"].sort_values("timestamp")
    return [float(v) for v in steps["median_ms"]]


def in_steps(values: list[float], steps: list[float]) -> list[float]:
    """Each cell's figure in units of its own timed step (``values[i] / steps[i]``)."""
    return [v / s for v, s in zip(values, steps, strict=True)]


def whole_cells_ms(ends: list[float]) -> list[float]:
    """Each cell's whole wall time (ms) from the progress lines' times: from the one before to its own; the first
    cell's has no line before it and is left out (it also starts the worker process)."""
    return [(b - a) * 1e3 for a, b in itertools.pairwise(ends)]


def test_cost_per_cell_does_not_grow_with_the_run(benchmark, report_line, tmp_path):
    path = write_suite(tmp_path / "sweep.yaml", **SUITE)
    logging.getLogger("kdbench").setLevel(logging.WARNING)  # 300 progress lines are not the point here
    lines = logging.getLogger("kdbench.run.progress")  # but their times are: each ends a cell
    ends = CellEnds({1, BLOCK, CELLS - BLOCK, CELLS})
    level, propagate = lines.level, lines.propagate
    lines.setLevel(logging.INFO)
    lines.propagate = False
    lines.addHandler(ends)
    try:
        outcome = run_suite(load_suite(path), RunOptions(out_dir=tmp_path / "res"))
    finally:
        lines.removeHandler(ends)
        lines.setLevel(level)
        lines.propagate = propagate
    assert outcome.jobs == CELLS and not outcome.failed
    timings = outcome.timings
    rows = read_results([outcome.path])
    assert len(rows) == 3 * CELLS  # every row stored once
    steps = step_ms(rows)  # each cell's own timed step: the machine's speed at that cell, for the verdicts
    assert len(steps) == CELLS
    overhead_ms = [(t.wall_s - t.worker_s) * 1e3 for t in timings]
    wall_ms = [t.wall_s * 1e3 for t in timings]
    first, last = overhead_ms[1:BLOCK], overhead_ms[-BLOCK:]  # the first cell also starts the worker process
    raw_ratio = growth(overhead_ms[1:], first=2)[0]
    ratio, ratio_low, ratio_high = growth(in_steps(overhead_ms[1:], steps[1:]), first=2)
    quartile_ratio = quartile(last) / quartile(first)
    assert len(ends.ends) == CELLS
    whole = whole_cells_ms(ends.ends)  # whole[k - 2] is cell k's (cells 2..300)
    whole_first, whole_last = whole[: BLOCK - 1], whole[-BLOCK:]
    raw_whole_ratio = growth(whole, first=2)[0]
    whole_ratio, whole_low, whole_high = growth(in_steps(whole, steps[1:]), first=2)
    whole_quartile_ratio = quartile(whole_last) / quartile(whole_first)
    loads = ends.load(1, BLOCK), ends.load(CELLS - BLOCK, CELLS)
    judged = not any(load.contended for load in loads)
    result = {
        "cells": CELLS,
        "overhead_ms_median_first_100": statistics.median(first),
        "overhead_ms_median_last_100": statistics.median(last),
        "overhead_ms_mean_first_100": statistics.fmean(first),
        "overhead_ms_mean_last_100": statistics.fmean(last),
        "overhead_ms_p25_first_100": quartile(first),
        "overhead_ms_p25_last_100": quartile(last),
        "ratio_last_to_first": ratio,  # the Theil-Sen line's (growth()), in each cell's own step times
        "raw_ratio_last_to_first": raw_ratio,  # the same line in milliseconds (not judged: the VM's speed drifts)
        "ratio_95_interval": [ratio_low, ratio_high],
        "quartile_ratio_last_to_first": quartile_ratio,
        "limit": LIMIT,
        "wall_ms_median_first_100": statistics.median(wall_ms[1:BLOCK]),
        "wall_ms_median_last_100": statistics.median(wall_ms[-BLOCK:]),
        "worker_start_s": timings[0].wall_s - timings[0].worker_s,
        "total_s": sum(t.wall_s for t in timings),
        "in_worker_share": sum(t.worker_s for t in timings) / sum(t.wall_s for t in timings),
        "overhead_ms": overhead_ms,
        # issue 31's fit check, in the worker's wall-time split: a fake run of the cell's step and one more step
        # under torch.profiler's memory events, a fixed cost per cell (kineto's start and stop most of it)
        "fit_check_ms_per_cell": outcome.wall.get(FIT, 0.0) * 1e3 / CELLS,
        "fit_limit_ms": FIT_LIMIT_MS,
        "ledger_ms_per_cell": outcome.wall.get(LEDGER, 0.0) * 1e3 / CELLS,  # an LM loss's ledger: none here
        # issue 45: the whole cell, worker included, from one progress line to the next
        "whole_ms_p25_first_100": quartile(whole_first),
        "whole_ms_p25_last_100": quartile(whole_last),
        "whole_ms_median_first_100": statistics.median(whole_first),
        "whole_ms_median_last_100": statistics.median(whole_last),
        "whole_ms_mean_first_100": statistics.fmean(whole_first),
        "whole_ms_mean_last_100": statistics.fmean(whole_last),
        "whole_ratio_last_to_first": whole_ratio,  # the Theil-Sen line's (growth()), in each cell's own step times
        "raw_whole_ratio_last_to_first": raw_whole_ratio,  # the same line in milliseconds (not judged)
        "step_ms_median_first_100": statistics.median(steps[1:BLOCK]),
        "step_ms_median_last_100": statistics.median(steps[-BLOCK:]),
        "whole_ratio_95_interval": [whole_low, whole_high],
        "whole_quartile_ratio_last_to_first": whole_quartile_ratio,
        "whole_limit": WHOLE_LIMIT,
        "host_busy_share_first_100": loads[0].busy_share,
        "host_busy_share_last_100": loads[1].busy_share,
        "whole_judged": judged,
        "whole_ms": whole,
        "step_ms": steps,
    }
    report_line(f"sweep of {CELLS} tiny cells (linear -> linear, 20 iterations), engine overhead per cell:")
    report_line(
        f"  growth {ratio:.3f} in the cells' own step times (the Theil-Sen line, last hundred over cells 2-100; 95 % "
        f"interval {ratio_low:.3f}-{ratio_high:.3f}; must be <= {LIMIT}; in ms {raw_ratio:.3f}); lower quartiles "
        f"{result['overhead_ms_p25_first_100']:.1f} / "
        f"{result['overhead_ms_p25_last_100']:.1f} ms (ratio {quartile_ratio:.3f}); "
        f"medians {result['overhead_ms_median_first_100']:.1f} / {result['overhead_ms_median_last_100']:.1f} ms; "
        f"means {result['overhead_ms_mean_first_100']:.1f} / {result['overhead_ms_mean_last_100']:.1f} ms"
    )
    report_line(
        f"  per cell in all {result['wall_ms_median_first_100']:.0f} / {result['wall_ms_median_last_100']:.0f} ms "
        f"(the last hundred's must be <= {CELL_LIMIT_MS + FIT_LIMIT_MS:.0f} ms with the fit check's "
        f"{result['fit_check_ms_per_cell']:.0f} ms a cell, itself <= {FIT_LIMIT_MS:.0f} ms); "
        f"{result['total_s']:.1f} s for the sweep, "
        f"{result['in_worker_share']:.0%} of it in the worker; "
        f"saved to {OUT}"
    )
    verdict = (
        f"must be <= {WHOLE_LIMIT}"
        if judged
        else "NOT JUDGED: other processes left this run less than its core ("
        + "; ".join(f"{w} hundred: {load.describe()}" for w, load in zip(("first", "last"), loads))
        + ")"
    )
    report_line(
        f"  whole cell (progress line to progress line, worker included): growth {whole_ratio:.3f} in the cells' own "
        f"step times (Theil-Sen, 95 % interval {whole_low:.3f}-{whole_high:.3f}; {verdict}; in ms "
        f"{raw_whole_ratio:.3f}, with the timed step's median {result['step_ms_median_first_100']:.3f} / "
        f"{result['step_ms_median_last_100']:.3f} ms); lower quartiles "
        f"{result['whole_ms_p25_first_100']:.1f} / {result['whole_ms_p25_last_100']:.1f} ms (ratio "
        f"{whole_quartile_ratio:.3f}); medians {result['whole_ms_median_first_100']:.1f} / "
        f"{result['whole_ms_median_last_100']:.1f} ms; means {result['whole_ms_mean_first_100']:.1f} / "
        f"{result['whole_ms_mean_last_100']:.1f} ms; host_busy_share {loads[0].busy_share:.2f} / "
        f"{loads[1].busy_share:.2f}; of a cell, the fit check {result['fit_check_ms_per_cell']:.0f} ms and the "
        f"accuracy ledger {result['ledger_ms_per_cell']:.0f} ms"
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    benchmark.extra_info.update({k: v for k, v in result.items() if k not in ("overhead_ms", "whole_ms", "step_ms")})
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    assert ratio <= LIMIT
    assert result["wall_ms_median_last_100"] <= CELL_LIMIT_MS + FIT_LIMIT_MS
    assert result["fit_check_ms_per_cell"] <= FIT_LIMIT_MS
    if judged:  # a busy machine's verdict is printed as not judged (above), not passed
        assert whole_ratio <= WHOLE_LIMIT
