"""The LM stage: suites/gpu-lm.yaml (every loss_impl, a bf16-held teacher, the top-k cache, an on-policy step,
prefill and decode on every generation backend, speculative decoding at temperature 0 and 1, a cross-tokenizer
cell), every row ok or skipped with its reason, every ok row with its attention kernel and, on a step, 0 < mfu <= 1
and the accuracy ledger within its bound; a decode row with what it served and its tokens checked; and the fit
planner's predicted peak against the measured one and the allocator's reserve, as information."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd

from kdbench.core.limits import MAX_LOSS_ERR
from kdbench.hw.backends import Backend

from ..report import Report
from ..runs import ok_rows, run_suite, said, step_time_text

DECODES = ("student_decode", "teacher_decode", "speculative_decode")


def lm_row_problems(r) -> list[str]:
    """What an ok row of the LM suite lacks: its attention kernel, a utilisation in (0, 1] on a step, and what
    its cell's path must leave on it (a bf16-held teacher, the top-k cache's bytes, the generation phase, the
    alignment phase of a cross-tokenizer step, the accuracy ledger within its bound; on a decode row what was served,
    its bytes per token and its tokens checked against the dynamic cache's; on a speculative row its acceptance)."""
    problems = []
    if not said(getattr(r, "attention_kernel", None)):
        problems.append("no attention_kernel")
    if r.measurement in DECODES:
        return problems + decode_problems(r)
    if r.measurement != "distill_step":
        return problems
    share = r.mfu if pd.notna(r.mfu) else r.ceiling_utilization
    if pd.isna(share) or not 0 < share <= 1:
        problems.append(f"mfu / ceiling_utilization {share} not in (0, 1]")
    if r.teacher_mode == "topk_cache" and not (r.teacher_cache_bytes_per_token or 0) > 0:
        problems.append("no teacher_cache_bytes_per_token")
    if pd.notna(r.on_policy_new_tokens) and not (r.phase_generate_ms or 0) > 0:
        problems.append("no phase_generate_ms")
    if said(getattr(r, "student_tokenizer", None)) and not (getattr(r, "phase_align_ms", None) or 0) > 0:
        problems.append("a cross-tokenizer step without phase_align_ms")
    return problems + ledger_problems(r)


def ledger_problems(r) -> list[str]:
    """The accuracy ledger of an LM step (loss_rel_err, grad_rel_err against float64): finite and within
    :data:`MAX_LOSS_ERR` where it was taken; a top-k cached teacher's step has none, by design."""
    if getattr(r, "teacher_mode", None) == "topk_cache":
        return []
    problems = []
    for name in ("loss_rel_err", "grad_rel_err"):
        value = getattr(r, name, None)
        if value is None or pd.isna(value):
            problems.append(f"no {name} (the accuracy ledger was not taken)")
        elif not 0 <= value <= MAX_LOSS_ERR:
            problems.append(f"{name} {value:.3g} outside [0, {MAX_LOSS_ERR:g}]")
    return problems


def decode_problems(r) -> list[str]:
    """A decode row: served weights said, its bytes per token counted, a backend's tokens checked (``ok`` or ``ok
    to a near-tie``: GPU review 4, M3), a speculative row's acceptance in [0, 1]."""
    problems = []
    if r.measurement != "speculative_decode" and not said(getattr(r, "served_weights", None)):
        problems.append("no served_weights")
    if not (getattr(r, "decode_bytes_per_token", None) or 0) > 0:
        problems.append("no decode_bytes_per_token")
    check = getattr(r, "output_check", None)
    if said(check) and not check.startswith("ok"):
        problems.append(f"output_check {check}")
    if r.measurement == "speculative_decode":
        alpha = getattr(r, "spec_alpha", None)
        if alpha is None or pd.isna(alpha) or not 0 <= alpha <= 1:
            problems.append(f"spec_alpha {alpha} not in [0, 1]")
    return problems


def decode_details(r) -> str:
    """What a decode row served and how: its attention path, held weights, bytes per token, floor share, check."""
    parts = []
    for name, fmt in (
        ("attention_path", "path {}"),
        ("served_weights", "served {}"),
        ("decode_bytes_per_token", "{:.4g} B/token"),
        ("bandwidth_share", "bandwidth_share {:.3g}"),
        ("spec_temperature", "T={:g}"),
        ("spec_alpha", "alpha {:.3g}"),
        ("spec_speedup", "spec_speedup {:.3g}"),
        ("output_check", "{}"),
    ):
        value = getattr(r, name, None)
        if value is not None and not (isinstance(value, float) and pd.isna(value)):
            parts.append(fmt.format(value))
    return ", ".join(parts)


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
            share += step_time_text(r)
        elif r.measurement in DECODES:
            share = f" ({decode_details(r)})"
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
        reserved = ""
        if pd.notna(getattr(r, "peak_reserved_bytes", None)) and (r.peak_memory_bytes or 0) > 0:
            reserved = (
                f"; reserved {r.peak_reserved_bytes / 2**30:.3f} GiB, reserved/allocated "
                f"{r.peak_reserved_bytes / r.peak_memory_bytes:.3f} (the allocator's rounding and fragmentation)"
            )
        report.info(
            f"fit {r.cell_label}: predicted {r.predicted_peak_bytes / 2**30:.3f} GiB in {r.predicted_peak_phase}, "
            f"measured {r.live_peak_bytes / 2**30:.3f} GiB (max_memory_allocated), measured/predicted "
            f"{r.predicted_peak_ratio:.3f}{reserved}"
        )
    if ratios:
        report.info(
            f"fit planner on this GPU: measured/predicted {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} steps"
        )
