"""Benchmark: what each loss implementation costs a language-model distillation step, in memory and time.

The step of suites/llm-cpu.yaml's pair (tiny-llama-teacher -> tiny-llama-student, both with a 32,000-word
vocabulary) at 4 sequences x 1,024 tokens = 4,096 tokens per step, every position but the last of each
sequence counted (prompt_fraction 0), forward KL at T = 2 with alpha 0.5 (CE 0.5), fp32, chunks of 1,024
tokens, for each of dense, chunked and fused_linear (with KDBENCH_LM_BENCH_ALL=1 also liger and torch_linear, those
this environment can run),
each in a fresh process so that its peak is its own.  In that process the step is timed by kdbench's loop (a
cold call, RUNS timed ones) with kdbench's memory meter around it; the cold call's loss and the student's
gradients are kept (the first step from the same weights and batch: every impl must equal dense's,
max |x - dense| / max |dense| <= 1e-5 per tensor; their copies, 40 MB, count in the peak).  The
footprint is the rise of the kernel's high-water mark (VmHWM, reset at entry) over the RSS at entry, which
holds the models, the batch and the optimizer state.  Bounds: fused_linear's footprint at most 40 % of
dense's, chunked's at most 90 %.  Issue 23 set 30 % and 60 % against the dense of then (6,886 MiB here: the
logits of every position, the infinite-logit masks, a float32 copy of every probability); dense written as a
careful user writes it (issue 29: the valid rows only, no masks where no head has a bias) holds 3,284 MiB, while
chunked (2,655 MiB, 81 %) and fused_linear (1,050 MiB, 32 %) hold what they held (2,667 and 1,045 MiB in the same
session).  The figures are printed, attached to pytest-benchmark's record and written to
benchmarks/.results/lm_step_memory.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from kdbench.distill.lm.impls import LOSS_IMPLS, unavailable

BATCH, SEQ, VOCAB, CHUNK = 4, 1024, 32000, 1024
RUNS = 1  # timed steps after the cold one (a dense step takes ~12 s here)
RTOL = 1e-5
BOUNDS = {"fused_linear": 0.40, "chunked": 0.90}  # footprint / dense's footprint
ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).resolve().parent / ".results" / "lm_step_memory.json"
MIB = 2**20


def cell(impl: str) -> dict:
    return {
        "pair": {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
        "overrides": {"teacher": {"vocab_size": VOCAB}, "student": {"vocab_size": VOCAB}},
        "data": {"kind": "tokens", "seq_len": SEQ, "prompt_fraction": 0.0},
        "method": "forward_kl",
        "forward_kl": {"temperature": 2.0, "alpha": 0.5},
        "batch_size": BATCH,
        "loss_impl": impl,
        "chunk_size": CHUNK,
    }


def _child(impl: str, out_dir: Path) -> None:
    from kdbench.config.schema import CellConfig
    from kdbench.distill.step import DistillStep
    from kdbench.hw.backends import resolve
    from kdbench.measure.memory import MemoryMeter
    from kdbench.measure.timing import timed_loop
    from kdbench.models import ModelCache
    from kdbench.workloads.lm.workload import LM

    config = CellConfig.model_validate(cell(impl))
    backend = resolve("cpu")
    teacher, student = LM.build_pair(config, backend, ModelCache())
    x, y = LM.batch(config, BATCH, backend.device, config.seed, (teacher, student))
    step = DistillStep(teacher, student, x, y, config, backend, LM)
    first: dict = {}

    def call() -> None:
        step()
        if not first:  # the cold call is the first step: its loss and gradients, against dense's
            grads = {n: p.grad.clone() for n, p in step.distiller.trainee.named_parameters() if p.grad is not None}
            first.update(loss=step.last_loss.clone(), grads=grads)

    with MemoryMeter(backend) as meter:
        raw = timed_loop(call, backend.clock(), warmup=0, min_iters=RUNS, min_time_s=0.0, max_iters=RUNS)
    torch.save(first, out_dir / f"{impl}.pt")
    usage = meter.result()
    loss = step.distiller.loss_fn
    result = {
        "footprint_bytes": usage.footprint_bytes,
        "peak_bytes": usage.peak_bytes,
        "memory_kind": usage.kind,
        "times_ms": raw.samples_ms,
        "logits_memory": loss.logits_memory(x.numel()),
        "threads": torch.get_num_threads(),
    }
    (out_dir / f"{impl}.json").write_text(json.dumps(result))


def _measure(impl: str, out_dir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, __file__, impl, str(out_dir)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, f"{impl} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads((out_dir / f"{impl}.json").read_text())


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


# The implementations measured: the bounds' three by default (CI's time); KDBENCH_LM_BENCH_ALL=1 adds liger and
# torch_linear where they are available.
MEASURED = LOSS_IMPLS if os.environ.get("KDBENCH_LM_BENCH_ALL") == "1" else ("dense", "chunked", "fused_linear")


def test_lm_step_memory(benchmark, report_line, tmp_path):
    impls = [impl for impl in MEASURED if unavailable(impl) is None]
    skipped = {impl: unavailable(impl) for impl in MEASURED if impl not in impls}
    measured = benchmark.pedantic(lambda: {i: _measure(i, tmp_path) for i in impls}, rounds=1, iterations=1)
    ref = torch.load(tmp_path / "dense.pt")
    rows = {}
    for impl in impls:
        m = measured[impl]
        assert m["memory_kind"] == "rss_hwm", f"{impl}: VmHWM unavailable, got {m['memory_kind']}"
        got = torch.load(tmp_path / f"{impl}.pt")
        assert got["grads"].keys() == ref["grads"].keys()
        errors = {"loss": _rel_err(got["loss"], ref["loss"])}
        errors["grads"] = max(_rel_err(got["grads"][k], ref["grads"][k]) for k in ref["grads"])
        rows[impl] = {
            "footprint_mib": m["footprint_bytes"] / MIB,
            "peak_rss_mib": m["peak_bytes"] / MIB,
            "median_ms": statistics.median(m["times_ms"]),
            "times_ms": m["times_ms"],
            "computed_logits_mib": m["logits_memory"]["bytes"] / MIB,
            "logits_buffers": m["logits_memory"]["text"],
            "rel_err": errors,
            "threads": m["threads"],
        }
    dense = rows["dense"]["footprint_mib"]
    for row in rows.values():
        row["vs_dense"] = row["footprint_mib"] / dense
    result = {"cell": cell("<impl>"), "tokens": BATCH * SEQ, "runs": RUNS, "bounds": BOUNDS, "impls": rows}
    result["unavailable"] = skipped
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    benchmark.extra_info.update(result)

    report_line(
        f"LM distillation step, tiny Llama pair, {BATCH}x{SEQ} = {BATCH * SEQ} tokens, {VOCAB} vocab, forward KL "
        f"(T=2) + CE, fp32, chunk {CHUNK}, {rows['dense']['threads']} threads, each impl in its own process:"
    )
    report_line(f"  {'impl':<13}{'footprint MiB':>14}{'logits MiB':>11}{'vs dense':>10}{'median ms':>11}   max rel err")
    for impl, row in rows.items():
        report_line(
            f"  {impl:<13}{row['footprint_mib']:>14.0f}{row['computed_logits_mib']:>11.0f}{row['vs_dense']:>10.1%}"
            f"{row['median_ms']:>11.0f}   {max(row['rel_err'].values()):.1e}"
        )
    for impl, why in skipped.items():
        report_line(f"  {impl}: not run ({why})")
    report_line(f"  bounds: fused_linear <= 40 % of dense, chunked <= 90 %; saved to {OUT}")

    for impl, row in rows.items():
        assert max(row["rel_err"].values()) <= RTOL, f"{impl} differs from dense: {row['rel_err']}"
    for impl, bound in BOUNDS.items():
        assert rows[impl]["vs_dense"] <= bound, f"{impl}: {rows[impl]['vs_dense']:.1%} of dense > {bound:.0%}"


if __name__ == "__main__":
    _child(sys.argv[1], Path(sys.argv[2]))
