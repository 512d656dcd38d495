"""Benchmark: the harness's own cost per timed iteration.

An EMPTY step (a Python callable that does nothing) is run through kdbench's timed loop
(`kdbench.measure.timing.timed_loop`) with the host clock the CPU backend hands out
(`resolve("cpu").clock()`, a HostClock), in short rounds.  Two figures per round:

* the cost per iteration: the timed window's wall time / its iterations (the stamps, the
  call, the bookkeeping and the deadline check: everything the loop adds around a step);
* the median of `samples_ms`: stamp to stamp around one empty call (what the harness adds
  to a step's reported time).

It also times the phase stamps a `DistillStep` takes inside each step: `train_step` stamps
the six phase boundaries with `marks.append(clock.stamp())` and `DistillStep.__call__` keeps
the step's marks.  That pattern is replayed here without the model (a real step's noise would
swamp it; bench_phase_overhead.py checks it against real steps), alternating with the empty
step in each round, and its cost is the median over rounds of (stamped - empty) per iteration.
Where a GPU is available the same is done with device events (`EventClock`): the host's cost of
recording them.  The bound: the median over rounds of the empty step's cost per iteration is
under 20 µs.  The figures are printed, attached to pytest-benchmark's record (`extra_info`)
and written to benchmarks/.results/harness_overhead.json.
"""

import json
import statistics
from pathlib import Path

import torch

from kdbench.hw.backends import resolve
from kdbench.hw.clock import EventClock
from kdbench.measure.timing import timed_loop

ROUNDS = 20
ROUND_S = 0.05  # seconds per variant per round
BOUND_US = 20.0
STAMPS = 6  # phase-boundary stamps per step (kdbench.distill.step.Distiller.train_step)
OUT = Path(__file__).resolve().parent / ".results" / "harness_overhead.json"


def empty() -> None:
    pass


def stamping(clock):
    """What a DistillStep does with its clock on each call, model work left out: train_step's six
    ``marks.append(clock.stamp())`` (through the same lambda) and __call__ keeping the marks."""
    kept: list[list] = []

    def step() -> None:
        marks: list = []
        stamp = lambda: marks.append(clock.stamp())  # noqa: E731  (as train_step writes it)
        stamp()
        stamp()
        stamp()
        stamp()
        stamp()
        stamp()
        kept.append(marks)

    return step, kept


def measure(clock, rounds: int, round_s: float, max_iters: int) -> dict:
    """Alternating rounds of the empty step and the stamping step through timed_loop with `clock`."""
    stamped, kept = stamping(clock)
    variants = {"empty": empty, "stamped": stamped}
    per_iter = {name: [] for name in variants}  # µs per iteration, one figure per round
    sample_median = {name: [] for name in variants}  # µs, median stamp-to-stamp sample per round
    iters = {name: 0 for name in variants}
    for i in range(rounds):
        order = ("empty", "stamped") if i % 2 == 0 else ("stamped", "empty")
        for name in order:
            raw = timed_loop(variants[name], clock, warmup=100, min_iters=1000, min_time_s=round_s, max_iters=max_iters)
            n = len(raw.samples_ms)
            per_iter[name].append((raw.window_s[1] - raw.window_s[0]) / n * 1e6)
            sample_median[name].append(statistics.median(raw.samples_ms) * 1e3)
            iters[name] += n
            kept.clear()  # the marks of a round are not needed afterwards
    stamp_cost = [s - e for s, e in zip(per_iter["stamped"], per_iter["empty"])]
    return {
        "clock": clock.name,
        "iterations": iters,
        "per_iteration_us": {k: statistics.median(v) for k, v in per_iter.items()},
        "sample_median_us": {k: statistics.median(v) for k, v in sample_median.items()},
        "per_iteration_us_rounds": per_iter,
        "phase_stamps_per_step_us": statistics.median(stamp_cost),
        "per_stamp_us": statistics.median(stamp_cost) / STAMPS,
    }


def test_harness_cost_per_empty_iteration(benchmark, report_line):
    clock = resolve("cpu").clock()
    host = measure(clock, ROUNDS, ROUND_S, max_iters=1_000_000)
    result = {
        "threads": torch.get_num_threads(),
        "rounds": ROUNDS,
        "round_s": ROUND_S,
        "bound_us": BOUND_US,
        "host": host,
        "event": None,
        "event_note": "",
    }
    if torch.cuda.is_available():
        # Device events: what recording them costs the host per iteration (the loop never syncs inside).
        result["event"] = measure(EventClock(torch.device("cuda", torch.cuda.current_device())), 10, 0.05, 50_000)
        result["event"]["device"] = torch.cuda.get_device_name()
    else:
        result["event_note"] = "not measured: no GPU here (torch.cuda.is_available() is False), so no device events"

    e, s = host["per_iteration_us"]["empty"], host["sample_median_us"]["empty"]
    report_line(f"harness cost of an empty step, timed_loop + {host['clock']} (HostClock), {ROUNDS} rounds:")
    report_line(
        f"  per iteration (timed window / iterations, median over rounds) {e:.3f} µs "
        f"(must be under {BOUND_US:.0f} µs); median stamp-to-stamp sample {s:.3f} µs; "
        f"{host['iterations']['empty']} iterations"
    )
    report_line(
        f"  DistillStep phase stamps ({STAMPS} per step): {host['phase_stamps_per_step_us']:.3f} µs per step, "
        f"{host['per_stamp_us']:.3f} µs per stamp (stamped {host['per_iteration_us']['stamped']:.3f} "
        f"- empty {e:.3f} µs per iteration, paired by round)"
    )
    if result["event"] is not None:
        ev = result["event"]
        report_line(
            f"  device events (EventClock, {ev['device']}): empty step {ev['per_iteration_us']['empty']:.3f} µs "
            f"per iteration on the host; {STAMPS} phase stamps {ev['phase_stamps_per_step_us']:.3f} µs per step "
            f"({ev['per_stamp_us']:.3f} µs per event recorded)"
        )
    else:
        report_line(f"  device events (EventClock): {result['event_note']}")
    report_line(f"  saved to {OUT}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    benchmark.extra_info.update(result)
    # pytest-benchmark's record: 1000 empty iterations through the timed loop.
    benchmark.pedantic(
        timed_loop,
        args=(empty, clock),
        kwargs={"warmup": 0, "min_iters": 1000, "min_time_s": 0.0, "max_iters": 1000},
        rounds=20,
        iterations=1,
        warmup_rounds=2,
    )
    assert all(v > 0 for v in host["per_iteration_us"].values())
    assert e < BOUND_US
