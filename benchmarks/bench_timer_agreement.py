"""Benchmark: kdbench's step timing agrees with torch.utils.benchmark.Timer.

Same step object, same process, same torch thread count.  The two timers are run
in alternation for several rounds (so drift of a noisy machine hits both alike), and
the median of the per-round ratios must lie within 5 % of 1.  The figures are
printed, attached to pytest-benchmark's saved record (`extra_info`) and written to
benchmarks/.results/timer_agreement.json.
"""

import json
import statistics
from pathlib import Path

import torch
import torch.utils.benchmark as tbench

from kdbench.backends import resolve
from kdbench.data import synthetic_batch
from kdbench.distill.step import DistillStep
from kdbench.models import build_model
from kdbench.suite import CellConfig
from kdbench.timing import timed_loop

ROUNDS = 7
TOLERANCE = 0.05
OUT = Path(__file__).resolve().parent / ".results" / "timer_agreement.json"


def _step():
    config = CellConfig.model_validate({
        "pair": {"teacher": "resnet20", "student": "resnet8"},
        "batch_size": 16,
        "data": {"shape": [3, 32, 32], "num_classes": 100},
    })
    backend = resolve("cpu")
    torch.manual_seed(0)
    teacher = build_model("resnet20", 100, (3, 32, 32))
    student = build_model("resnet8", 100, (3, 32, 32))
    x, y = synthetic_batch(config, config.batch_size, backend.device, 0)
    return DistillStep(teacher, student, x, y, config, backend), backend


def test_step_median_agrees_with_torch_benchmark_timer(benchmark, report_line):
    step, backend = _step()
    threads = torch.get_num_threads()
    for _ in range(5):  # warm up both paths once
        step()
    rounds = []
    for _ in range(ROUNDS):
        ours = timed_loop(step, backend.clock(), warmup=2, min_iters=20, min_time_s=0.5, max_iters=10_000)
        ours_ms = statistics.median(ours.samples_ms)
        timer = tbench.Timer(stmt="step()", globals={"step": step}, num_threads=threads)
        theirs_ms = timer.blocked_autorange(min_run_time=0.5).median * 1e3
        rounds.append({"kdbench_ms": ours_ms, "torch_timer_ms": theirs_ms, "ratio": ours_ms / theirs_ms})
    assert torch.get_num_threads() == threads, "a timer changed torch's thread count"
    ratio = statistics.median(r["ratio"] for r in rounds)
    result = {"threads": threads, "rounds": rounds, "median_ratio": ratio, "tolerance": TOLERANCE,
              "step": "resnet20->resnet8 kd fp32 bs16 3x32x32 cpu"}
    report_line(f"kdbench vs torch.utils.benchmark.Timer, {result['step']}, {threads} threads (ms per step):")
    for i, r in enumerate(rounds):
        report_line(f"  round {i}: kdbench {r['kdbench_ms']:.3f}  Timer {r['torch_timer_ms']:.3f}  "
                    f"ratio {r['ratio']:.4f}")
    report_line(f"  median ratio {ratio:.4f} (must be within 1 ± {TOLERANCE}); saved to {OUT}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    benchmark.extra_info.update(result)
    benchmark.pedantic(step, rounds=20, iterations=1, warmup_rounds=2)  # saved by pytest-benchmark
    assert abs(ratio - 1) <= TOLERANCE
