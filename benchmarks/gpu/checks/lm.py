"""The LM stage: suites/gpu-lm.yaml (every loss_impl, a bf16-held teacher, the top-k cache, an on-policy step,
prefill and decode), every row ok or skipped with its reason, every ok row with its attention kernel and, on a
step, 0 < mfu <= 1; and the fit planner's predicted peak against the measured one, as information."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd

from kdbench.hw.backends import Backend

from ..report import Report
from ..runs import ok_rows, run_suite, said


def lm_row_problems(r) -> list[str]:
    """What an ok row of the LM suite lacks: its attention kernel, a utilisation in (0, 1] on a step, and what
    its cell's path must leave on it (a bf16-held teacher, the top-k cache's bytes, the generation phase)."""
    problems = []
    if not said(getattr(r, "attention_kernel", None)):
        problems.append("no attention_kernel")
    if r.measurement != "distill_step":
        return problems
    share = r.mfu if pd.notna(r.mfu) else r.ceiling_utilization
    if pd.isna(share) or not 0 < share <= 1:
        problems.append(f"mfu / ceiling_utilization {share} not in (0, 1]")
    if r.teacher_mode == "topk_cache" and not (r.teacher_cache_bytes_per_token or 0) > 0:
        problems.append("no teacher_cache_bytes_per_token")
    if pd.notna(r.on_policy_new_tokens) and not (r.phase_generate_ms or 0) > 0:
        problems.append("no phase_generate_ms")
    return problems


def check_lm(backend: Backend, suite: Path, scratch: Path, report: Report, cell_timeout: float) -> None:
    report.section(f"kdbench run {suite.name}: the LM paths")
    if backend.device_type != "cuda":
        report.info("no GPU: the LM suite needs one")
        return
    if importlib.util.find_spec("transformers") is None:
        report.check("transformers is installed (kdbench's lm extra; run_check.py installs it from wheels)", False)
        return
    df = run_suite(backend, suite, scratch, report, cell_timeout)
    if df is None:
        return
    for r, what in ok_rows(df, report):
        share = ""
        if r.measurement == "distill_step":
            share = f", mfu {r.mfu:.3g}" if pd.notna(r.mfu) else f", ceiling_utilization {r.ceiling_utilization:.3g}"
        flags = " launch-bound" if r.launch_bound is True else ""
        problems = lm_row_problems(r)
        kernel = r.attention_kernel if said(r.attention_kernel) else "not recorded"
        report.check(
            f"{what}: {r.median_ms:.4g} ms, {r.tokens_per_s:.4g} tokens/s, attention {kernel}{share}{flags}"
            + (f": {'; '.join(problems)}" if problems else ""),
            not problems,
        )
    kernels = sorted({k for k in df.attention_kernel.dropna()})
    report.info(f"attention kernels that ran: {', '.join(kernels) or 'none recorded'}")
    report_fit(df, report)


def report_fit(df, report: Report) -> None:
    """The fit planner's predicted peak (a fake run of the step on the CPU) against the measured one
    (``torch.cuda.max_memory_allocated`` over one more step) of every LM step: information, not a check — the first
    GPU figures of issue 31's planner, whose tolerance was measured on the CPU."""
    if "predicted_peak_ratio" not in df.columns:
        return
    steps = df[(df.measurement == "distill_step") & (df.status == "ok")]
    ratios = []
    for r in steps.itertuples():
        if pd.isna(r.predicted_peak_bytes) or pd.isna(r.live_peak_bytes):
            why = "unpredictable" if pd.isna(r.predicted_peak_bytes) else "no measured peak"
            report.info(f"fit {r.cell_label}: {why}")
            continue
        ratios.append(r.predicted_peak_ratio)
        report.info(
            f"fit {r.cell_label}: predicted {r.predicted_peak_bytes / 2**30:.3f} GiB in {r.predicted_peak_phase}, "
            f"measured {r.live_peak_bytes / 2**30:.3f} GiB (max_memory_allocated), measured/predicted "
            f"{r.predicted_peak_ratio:.3f}"
        )
    if ratios:
        report.info(
            f"fit planner on this GPU: measured/predicted {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} steps"
        )
