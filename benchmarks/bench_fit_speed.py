"""Benchmark: how long the fit planner takes to predict the headline cell, and what it predicts.

Issue 31's goal: a fake step of the Llama-3.1-8B -> Llama-3.2-1B pair at 4 x 4,096 tokens plans in under a minute on
the 2-core CPU, allocating nothing.  Two cells (bf16 autocast, fused_linear, a bf16-held teacher): one device, and
8-rank FSDP2 (rank 0's device; the fake process group of torch's ``fake`` backend).  Each prediction runs in this
process after a first, untimed one that pays the imports and transformers' first model build; its peak, phase and
breakdown are printed, attached to pytest-benchmark's record and written to benchmarks/.results/fit_speed.json.
The process's resident peak is printed beside them: a fake run holds no tensor's bytes.  Bound: 60 s per cell.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

from kdbench.config.schema import CellConfig
from kdbench.fit.planner import predict

BOUND_S = 60.0
OUT = Path(__file__).resolve().parent / ".results" / "fit_speed.json"
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
