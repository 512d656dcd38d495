"""Benchmark: kdbench's step timing agrees with torch.utils.benchmark.Timer.

Same step object, same process, same torch thread count.  The two timers are run
in short alternating rounds, each timer first in every other round (so the drift of
a noisy machine hits both alike); the median over rounds of each round's ratio
(kdbench's median / the Timer's median) must be within 5 % of 1.  The figures are
printed, attached to pytest-benchmark's saved record (`extra_info`) and written to
benchmarks/.results/timer_agreement.json.
"""

import json
import statistics
from pathlib import Path

import torch
import torch.utils.benchmark as tbench

from kdbench.measure.timing import timed_loop

ROUNDS = 48
ROUND_S = 0.2  # seconds per timer per round
TOLERANCE = 0.05
OUT = Path(__file__).resolve().parent / ".results" / "timer_agreement.json"


def test_step_median_agrees_with_torch_benchmark_timer(benchmark, report_line, cpu_step):
    step, backend = cpu_step("kd")
    threads = torch.get_num_threads()
    for _ in range(5):  # warm up both paths once
        step()
    timer = tbench.Timer(stmt="step()", globals={"step": step}, num_threads=threads)

    ours_all: list[float] = []
    theirs_all: list[float] = []

    def ours() -> float:
        raw = timed_loop(step, backend.clock(), warmup=1, min_iters=5, min_time_s=ROUND_S, max_iters=10_000)
        ours_all.extend(raw.samples_ms)
        return statistics.median(raw.samples_ms)

    def theirs() -> float:
        m = timer.blocked_autorange(min_run_time=ROUND_S)
        theirs_all.extend(t * 1e3 / m.number_per_run for t in m.raw_times)
        return m.median * 1e3

    rounds = []
    for i in range(ROUNDS):  # short, alternating halves: the machine's drift hits both alike
        if i % 2:
            theirs_ms, ours_ms = theirs(), ours()
        else:
            ours_ms, theirs_ms = ours(), theirs()
        rounds.append({"kdbench_ms": ours_ms, "torch_timer_ms": theirs_ms, "ratio": ours_ms / theirs_ms})
    assert torch.get_num_threads() == threads, "a timer changed torch's thread count"
    # Each round pairs the two timers within the same second or so, so the machine's drift cancels
    # in the round's ratio; the median over rounds drops the rounds a burst of load hit unevenly.
    # (Pooled medians over all samples are reported too: they mix rounds of different speed and,
    # on this drifting VM, strayed to 0.946 in one CI run whose paired median was 0.990.)
    ratio = statistics.median(r["ratio"] for r in rounds)
    pooled = statistics.median(ours_all) / statistics.median(theirs_all)
    result = {
        "threads": threads,
        "rounds": rounds,
        "kdbench_median_ms": statistics.median(ours_all),
        "torch_timer_median_ms": statistics.median(theirs_all),
        "ratio": ratio,
        "pooled_ratio": pooled,
        "tolerance": TOLERANCE,
        "step": "resnet20->resnet8 kd fp32 bs16 3x32x32 cpu",
    }
    report_line(f"kdbench vs torch.utils.benchmark.Timer, {result['step']}, {threads} threads (ms per step):")
    for i, r in enumerate(rounds):
        report_line(
            f"  round {i}: kdbench {r['kdbench_ms']:.3f}  Timer {r['torch_timer_ms']:.3f}  ratio {r['ratio']:.4f}"
        )
    report_line(
        f"  pooled medians: kdbench {result['kdbench_median_ms']:.3f} ms over {len(ours_all)} steps, "
        f"Timer {result['torch_timer_median_ms']:.3f} ms over {len(theirs_all)}; ratio {pooled:.4f}"
    )
    report_line(
        f"  median of the {ROUNDS} paired round ratios: {ratio:.4f} (must be within 1 ± {TOLERANCE}); saved to {OUT}"
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    benchmark.extra_info.update(result)
    benchmark.pedantic(step, rounds=20, iterations=1, warmup_rounds=2)  # saved by pytest-benchmark
    assert abs(ratio - 1) <= TOLERANCE
