"""The stages that run ``kdbench`` itself: the probe (every ceiling measured or saying why not), the smoke suite
(every row ok, its utilisation in (0, 1]; first-run number 3 from its resnet50->resnet18 bf16 step), the levers
suite (every lever once, ok or skipped with its reason, every compiled row with its one-off cost) and the report
of the runs."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kdbench import api
from kdbench.hw.backends import Backend

from ..report import Report
from ..runs import count_or_na, ok_rows, run_kdbench, run_suite, said, step_time_text, truthy


def check_probe(backend: Backend, scratch: Path, report: Report) -> None:
    report.section("kdbench probe")
    keys = ("probe_bf16_tflops", "probe_fp32_tflops", "probe_tf32_tflops")
    if not run_kdbench(report, "probe", "--out", str(scratch / "results"), "--device", backend.name):
        report.unmeasured("kdbench probe failed", *keys)
        return
    (newest, *_) = sorted(
        (scratch / "results" / "probes").glob("probe-*.parquet"), key=lambda p: p.stat().st_mtime, reverse=True
    )
    for r in pd.read_parquet(newest).itertuples():
        value = f"{r.value:.4g} {r.unit}" if pd.notna(r.value) else f"not measured: {r.error}"
        key = f"probe_{r.dtype}_tflops"
        if r.kind == "matmul" and key in keys:
            if pd.notna(r.value):
                report.figure(key, float(r.value))
            else:
                report.unmeasured(f"not measured: {r.error}", key)
        report.check(f"{r.kind} {r.dtype} (size {r.size}): {value}", pd.notna(r.value) or r.dtype == "tf32")


def check_suite(backend: Backend, suite: Path, scratch: Path, report: Report, cell_timeout: float) -> None:
    report.section(f"kdbench run {suite.name}")
    keys = ("step_window_ratio", "step_host_ratio", "step_remainder_ratio")
    df = run_suite(backend, suite, scratch, report, cell_timeout)
    if df is None:
        report.unmeasured("the suite did not run", *keys)
        return
    pd.set_option("display.width", 200)
    for r in df.itertuples():
        what = f"{r.cell_label} {r.measurement} bs{r.batch_size}"
        if r.status != "ok":
            allowed = r.status == "skipped" and r.precision == "tf32" and said(r.error)
            report.check(f"{what}: {r.status}: {r.error}", allowed)
            continue
        if pd.notna(r.mfu):
            share, of = r.mfu, f"mfu {r.mfu:.3f} of {r.datasheet_device}"
        elif pd.notna(r.ceiling_utilization):
            share, of = r.ceiling_utilization, f"ceiling_utilization {r.ceiling_utilization:.3f} (no datasheet entry)"
        else:
            share, of = None, "no mfu and no ceiling: no datasheet entry and no probe"
        flags = " launch-bound" if r.launch_bound is True else ""
        if r.measurement == "distill_step":
            flags += step_time_text(r)
        report.check(
            f"{what}: {r.median_ms:.4g} ms, {of}{flags}",
            (share is None and backend.device_type == "cpu") or (share is not None and 0 < share <= 1),
        )
    step_figures(df, report)


def step_figures(df, report: Report) -> None:
    """First-run number 3 from the resnet50->resnet18 bf16 distill_step row."""
    keys = ("step_window_ratio", "step_host_ratio", "step_remainder_ratio")
    rows = df[
        (df.measurement == "distill_step")
        & (df.teacher == "resnet50")
        & (df.student == "resnet18")
        & (df.precision == "bf16")
    ]
    if rows.empty:
        report.unmeasured("no resnet50->resnet18 bf16 step in the suite", *keys)
        return
    r = rows.iloc[-1]
    if r.status != "ok":
        report.unmeasured(f"the resnet50->resnet18 bf16 step is {r.status}: {r.error}", *keys)
        return
    median = r.median_ms
    if pd.notna(r.window_ms) and r.n:
        report.figure("step_window_ratio", r.window_ms / r.n / median)
    if pd.notna(r.host_ms):
        report.figure("step_host_ratio", r.host_ms / median)
    else:
        report.unmeasured("no host_ms (the host clock: the CPU)", "step_host_ratio")
    if pd.notna(r.phase_remainder_ms):
        report.figure("step_remainder_ratio", r.phase_remainder_ms / median)
    report.info(
        f"resnet50->resnet18 bf16 step: median {median:.4g} ms, window_ms/n {r.window_ms / r.n:.4g} ms, host_ms "
        f"{r.host_ms:.4g} ms, phase remainder {r.phase_remainder_ms:.4g} ms"
    )


def check_levers(backend: Backend, suite: Path, scratch: Path, report: Report, cell_timeout: float) -> None:
    report.section(f"kdbench run {suite.name}: every lever once")
    if backend.device_type != "cuda":
        report.info("no GPU: the levers suite needs one")
        return
    df = run_suite(backend, suite, scratch, report, cell_timeout)
    if df is None:
        return
    for r, what in ok_rows(df, report):
        compiled = (r.measurement == "distill_step" and (r.compile != "off" or truthy(r.compile_teacher))) or str(
            r.runtime or ""
        ).startswith("compile")
        one_off = f", one_off_ms {r.one_off_ms:.4g} ({r.one_off_kind})" if pd.notna(r.one_off_ms) else ""
        if compiled:
            one_off += (
                f", {count_or_na(r.compiled_graphs)} graphs, {count_or_na(r.graph_breaks)} breaks, "
                f"{count_or_na(r.recompiles)} recompiles in the window"
            )
        output = f", output {r.output_check}" if isinstance(r.output_check, str) else ""
        good = not output.startswith(", output MISMATCH")
        if compiled:
            good = good and pd.notna(r.one_off_ms) and r.one_off_ms > 0
        report.check(
            f"{what}: {r.median_ms:.4g} ms{one_off}{output}" + (" (compiled: one_off_ms > 0)" if compiled else ""), good
        )


def check_report(scratch: Path, report: Report) -> None:
    report.section("kdbench report of the runs")
    results = scratch / "results"
    runs = (
        sorted(p for p in results.iterdir() if p.is_dir() and p.name not in ("probes", "traces"))
        if results.is_dir()
        else []
    )
    if not runs:
        report.info("no runs to render (the suite stages did not run)")
        return
    index = api.render(runs, scratch / "report")
    files = sum(1 for p in (scratch / "report").rglob("*") if p.is_file())
    report.check(
        f"report of {', '.join(p.name for p in runs)}: {index.name} and {files - 1} more files", index.is_file()
    )
