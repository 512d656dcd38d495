"""Benchmark: the accuracy ledger of every loss implementation at a 32,000-entry vocabulary, in fp32 and bf16.

suites/llm-cpu.yaml's pair (tiny-llama-teacher -> tiny-llama-student, a 32,000-entry vocabulary) and objective
(forward KL at T = 1, alpha 0.5: + 0.5 CE), a batch of BATCH sequences of SEQ tokens with the first quarter the
prompt (190 counted tokens; the suite's cells count 382 and 1534), chunks of 64 tokens, on the CPU.  Both models
run their forwards (fp32, or under bf16 autocast), then each available ``loss_impl`` computes the token loss and
the student's gradients from those hidden states in the precision's dtype, against ``dense`` in float64 on the
same inputs (:meth:`kdbench.distill.lm.loss.LMLoss.ledger`, what a step row records): ``loss_rel_err``,
``grad_rel_err`` (hidden states and LM head together, the Euclidean norm) and its two parts.

bf16 is evaluated on every CPU, also where bf16 is emulated (AVX2 only: autocast runs it, slowly; the suite skips
those cells by measurement, ``slow_precisions: skip``): the rounding to bf16 is the same, the kernels that
accumulate may differ from a native bf16 CPU's, and at these token counts it costs seconds.  The printed line
says whether the suite would skip bf16 here (:func:`kdbench.hw.speed.slow_precision`: measured at least 3x slower
than fp32).

Bounds (asserted): fp32 loss and gradient errors < 1e-4 for every impl; bf16 errors finite, below 0.1, and
above the same impl's fp32 ones (bf16 rounding is measurable).  No time is asserted.  The figures are printed,
attached to pytest-benchmark's record and written to benchmarks/.results/loss_ledger.json.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from kdbench.config.schema import CellConfig
from kdbench.distill.lm.impls import LOSS_IMPLS, unavailable
from kdbench.hw.backends import resolve
from kdbench.models import ModelCache
from kdbench.workloads.lm.workload import LM

VOCAB, BATCH, SEQ = 32000, 2, 128
PRECISIONS = ("fp32", "bf16")
ERRORS = ("loss_rel_err", "grad_rel_err", "grad_rel_err_hidden", "grad_rel_err_head")
OUT = Path(__file__).resolve().parent / ".results" / "loss_ledger.json"


def _config(impl: str, precision: str) -> CellConfig:
    return CellConfig.model_validate(
        {
            "pair": {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
            "overrides": {"teacher": {"vocab_size": VOCAB}, "student": {"vocab_size": VOCAB}},
            "data": {"kind": "tokens", "seq_len": SEQ, "prompt_fraction": 0.25},
            "method": "forward_kl",
            "forward_kl": {"temperature": 1.0, "alpha": 0.5},
            "batch_size": BATCH,
            "chunk_size": 64,
            "loss_impl": impl,
            "precision": precision,
            "teacher_precision": precision,
        }
    )


def _ledger() -> dict:
    from kdbench.hw.backends import choose_autocast
    from kdbench.hw.speed import slow_precision

    backend = resolve("cpu")
    impls = [i for i in LOSS_IMPLS if unavailable(i) is None]
    teacher, student = LM.build_pair(_config("dense", "fp32"), backend, ModelCache())
    x, y = LM.batch(_config("dense", "fp32"), BATCH, backend.device, 0, (teacher, student))
    out: dict = {"impls": impls, "missing": {i: unavailable(i) for i in LOSS_IMPLS if i not in impls}, "rows": []}
    out["bf16_slow"] = slow_precision(backend, "bf16") or ""  # what the suite's slow_precisions: skip reads
    for precision in PRECISIONS:
        choice = choose_autocast(backend, precision)
        with torch.no_grad(), choice.context("cpu"):
            ht, hs = teacher(x), student(x)
        for impl in impls:
            loss = LM.loss(_config(impl, precision), None, teacher, student, backend)
            row, notes = loss.ledger(hs, ht, y)
            out["rows"].append({"impl": impl, "precision": precision, **row, "notes": notes})
        out.setdefault("objective", loss.objective)
        out.setdefault("valid_tokens", int((y != -100).sum()))
    return out


def test_loss_ledger(benchmark, report_line):
    result = benchmark.pedantic(_ledger, rounds=1, iterations=1)
    result.update(vocab=VOCAB, batch=BATCH, seq_len=SEQ, threads=torch.get_num_threads())
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    benchmark.extra_info.update(result)

    bf16 = result["bf16_slow"] or "not measured 3x slower than fp32 here (the suite would measure its cells)"
    report_line(
        f"Accuracy ledger, tiny Llama pair, {VOCAB} vocab, {result['valid_tokens']} counted tokens "
        f"({BATCH} × {SEQ}), {result['objective']}; each loss_impl in its precision against dense in float64; "
        f"bf16: {bf16}:"
    )
    report_line(f"  {'loss_impl':<14}{'precision':<11}" + "".join(f"{c:>21}" for c in ERRORS))
    for row in result["rows"]:
        figures = "".join(f"{row[c]:>21.2e}" if row[c] is not None else f"{'—':>21}" for c in ERRORS)
        report_line(f"  {row['impl']:<14}{row['precision']:<11}{figures}")
    for impl, why in result["missing"].items():
        report_line(f"  {impl}: not available here ({why})")
    report_line(f"  saved to {OUT}")

    by = {(r["impl"], r["precision"]): r for r in result["rows"]}
    for impl in result["impls"]:
        fp32, low = by[(impl, "fp32")], by[(impl, "bf16")]
        assert not fp32["notes"] and not low["notes"], (impl, fp32["notes"], low["notes"])
        for column in ("loss_rel_err", "grad_rel_err"):
            assert fp32[column] < 1e-4, f"{impl} fp32 {column} {fp32[column]:.2e} >= 1e-4"
            assert math.isfinite(low[column]) and low[column] < 0.1, f"{impl} bf16 {column} {low[column]:.2e}"
        assert low["grad_rel_err"] > fp32["grad_rel_err"], f"{impl}: bf16's gradients no worse than fp32's"
