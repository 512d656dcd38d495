"""Benchmark: stamping the phase boundaries does not distort the step time.

DESIGN.md's contract: phase times must not change the step they break down.  kdbench
stamps the five phase boundaries with the step's own clock inside the timed pass, so
this measures one step object with its phase clock switched on and off, in short alternating rounds
(each variant first in every other round), and the median over rounds of each round's
ratio (stamped / plain medians) must be within 5 % of 1.  The figures are
printed, attached to pytest-benchmark's record and written to
benchmarks/.results/phase_overhead.json.
"""

import json
import statistics
from pathlib import Path

import torch

from kdbench.measure.timing import timed_loop

ROUNDS = 48
ROUND_S = 0.2
TOLERANCE = 0.05
OUT = Path(__file__).resolve().parent / ".results" / "phase_overhead.json"


def test_phase_stamps_leave_the_step_time_alone(benchmark, report_line, cpu_step):
    # One step object (same models, same memory), its phase clock switched on and off:
    # the only difference between the two variants is the stamping.
    step, backend = cpu_step("kd+at")
    clock = step.clock
    for _ in range(3):
        step()
    samples = {"stamped": [], "plain": []}
    round_ratios = []

    def run(name) -> float:
        step.clock = clock if name == "stamped" else None
        before = len(step.marks)
        raw = timed_loop(step, backend.clock(), warmup=1, min_iters=5, min_time_s=ROUND_S, max_iters=10_000)
        samples[name].extend(raw.samples_ms)
        assert (len(step.marks) > before) == (name == "stamped")  # stamps taken only when switched on
        return statistics.median(raw.samples_ms)

    for i in range(ROUNDS):
        order = ("stamped", "plain") if i % 2 == 0 else ("plain", "stamped")
        medians = {name: run(name) for name in order}
        round_ratios.append(medians["stamped"] / medians["plain"])
    step.clock = clock
    stamped_ms, plain_ms = statistics.median(samples["stamped"]), statistics.median(samples["plain"])
    # The median of paired round ratios: each round times both variants back to back, so the
    # machine's drift cancels; pooled medians (reported too) mix rounds of different speed.
    ratio = statistics.median(round_ratios)
    phases = step.phase_ms(len(samples["stamped"]) // ROUNDS)  # about the last stamped round
    result = {
        "threads": torch.get_num_threads(),
        "stamped_median_ms": stamped_ms,
        "plain_median_ms": plain_ms,
        "ratio": ratio,
        "pooled_ratio": stamped_ms / plain_ms,
        "round_ratios": round_ratios,
        "tolerance": TOLERANCE,
        "n": {k: len(v) for k, v in samples.items()},
        "phase_medians_ms": {p: statistics.median(v) for p, v in phases.items()},
        "step": "resnet20->resnet8 kd+at fp32 bs16 3x32x32 cpu",
    }
    report_line(f"phase stamps on vs off, {result['step']}, {result['threads']} threads:")
    report_line(
        f"  with stamps {stamped_ms:.3f} ms over {result['n']['stamped']} steps, without {plain_ms:.3f} ms "
        f"over {result['n']['plain']} (pooled ratio {result['pooled_ratio']:.4f}); median of the {ROUNDS} "
        f"paired round ratios {ratio:.4f} (must be within 1 ± {TOLERANCE}); saved to {OUT}"
    )
    report_line("  phase medians (ms): " + ", ".join(f"{p} {v:.3f}" for p, v in result["phase_medians_ms"].items()))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    benchmark.extra_info.update(result)
    benchmark.pedantic(step, rounds=10, iterations=1, warmup_rounds=1)
    assert abs(ratio - 1) <= TOLERANCE
