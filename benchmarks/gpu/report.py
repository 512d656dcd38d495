"""The check's report: each check printed as it is decided and counted (:class:`Report`), the review's five
first-run figures judged against their expected ranges by device (:data:`FIGURES`, :data:`EXPECTED`), and
summary.txt, rewritten after every stage so that a stopped run still leaves what it did."""

from __future__ import annotations

import argparse
import os
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .plan import plan_bounds


class Report:
    """Prints each check as it is decided and keeps the verdicts, and the first-run figures."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.passed = 0
        self.figures: dict[str, Any] = {}  # first-run numbers (FIGURES) as measured
        self.why: dict[str, str] = {}  # why a figure was not measured

    def section(self, title: str) -> None:
        print(f"\n== {title}", flush=True)

    def info(self, text: str) -> None:
        print(f"   {text}", flush=True)

    def check(self, what: str, ok: bool) -> bool:
        print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed.append(what)
        return ok

    def figure(self, key: str, value: Any) -> None:
        self.figures[key] = value

    def unmeasured(self, why: str, *keys: str) -> None:
        for key in keys:
            self.why.setdefault(key, why)


class Figure(NamedTuple):
    number: int  # which of the review's five first-run numbers
    key: str
    label: str
    stage: str
    fmt: str


FIGURES = (
    Figure(1, "probe_bf16_tflops", "probe bf16 matmul, TFLOP/s", "probe", "{:.4g}"),
    Figure(2, "clock_gemm_ratio", "event/wall ratio, GEMM", "clocks", "{:.3f}"),
    Figure(2, "clock_adds_ratio", "event/wall ratio, 200 tiny adds", "clocks", "{:.3f}"),
    Figure(2, "clock_adds_launch_bound", "200 tiny adds flagged launch-bound", "clocks", "{}"),
    Figure(3, "step_window_ratio", "resnet50->resnet18 bf16 step: window_ms/n over median", "suite", "{:.3f}"),
    Figure(3, "step_host_ratio", "resnet50->resnet18 bf16 step: host_ms over median", "suite", "{:.3f}"),
    Figure(3, "step_remainder_ratio", "resnet50->resnet18 bf16 step: phase remainder over median", "suite", "{:+.3f}"),
    Figure(4, "probe_fp32_tflops", "probe fp32 (IEEE) matmul, TFLOP/s", "probe", "{:.4g}"),
    Figure(4, "probe_tf32_tflops", "probe tf32 matmul, TFLOP/s", "probe", "{:.4g}"),
    Figure(4, "math_ieee_error", "math check: fp32 matmul error, IEEE", "math", "{:.1e}"),
    Figure(4, "math_tf32_error", "math check: fp32 matmul error, TF32", "math", "{:.1e}"),
    Figure(5, "energy_ratio", "energy counter over sampled power, GEMM window", "telemetry", "{:.3f}"),
)

# Expected first-run figures by device name (a key the name contains): (low, high, note), or a bool.
EXPECTED: dict[str, dict[str, Any]] = {
    "H200": {
        "probe_bf16_tflops": (
            770,
            800,
            "datasheet 989: above it the events time the wrong stream; below 650, throttling",
        ),
        "clock_gemm_ratio": (0.98, 1.02, ""),
        "clock_adds_ratio": (0.95, 1.05, ""),
        "clock_adds_launch_bound": True,
        "step_window_ratio": (0.97, 1.03, "within 3 % of the median"),
        "step_host_ratio": (0.0, 0.5, "host_ms << median; ~1 means a sync per step"),
        "step_remainder_ratio": (-0.05, 0.05, "the phases sum to the step"),
        "probe_fp32_tflops": (45, 60, "datasheet 67"),
        "probe_tf32_tflops": (350, 480, ""),
        "math_ieee_error": (0.0, 1e-6, "~1e-7"),
        "math_tf32_error": (1e-5, 1e-3, "~1e-4"),
        "energy_ratio": (0.9, 1.15, ""),
    }
}
# The H100 SXM (torch names it "NVIDIA H100 80GB HBM3") has the H200's dense bf16, tf32 and fp32 datasheet figures
# (989, 494, 67 TFLOP/s) and its clocks: the same ranges (GPU review 4, M11).  The PCIe and NVL cards have lower
# figures, and no ranges yet.
EXPECTED["H100 80GB HBM3"] = EXPECTED["H200"]


def expected_for(device: str) -> tuple[str, dict[str, Any]] | None:
    """The expected first-run figures of a device name (e.g. "NVIDIA H200"), with their key; None: none known."""
    for key, figures in EXPECTED.items():
        if key.lower() in device.lower():
            return key, figures
    return None


def judge(fig: Figure, report: Report, device: str, stages: dict[str, str]) -> str:
    """One summary line: the figure against its expected range (PASS/FAIL), INFO without one, or n/a and why."""
    head = f"{fig.number}. {fig.label}:"
    if fig.key not in report.figures:
        why = report.why.get(fig.key) or f"the {fig.stage} stage {stages.get(fig.stage, 'did not run')}"
        return f"{head} n/a: {why}"
    value = report.figures[fig.key]
    shown = fig.fmt.format(value)
    known = expected_for(device)
    if known is None or fig.key not in known[1]:
        return f"{head} {shown}: INFO: no expected range for {device}"
    want = known[1][fig.key]
    if isinstance(want, bool):
        return f"{head} {shown}; expected {want} ({known[0]}): {'PASS' if value is want else 'FAIL'}"
    low, high, note = want
    ok = low <= value <= high
    note = f"; {note}" if note else ""
    return f"{head} {shown}; expected {fig.fmt.format(low)} to {fig.fmt.format(high)} ({known[0]}{note}): " + (
        "PASS" if ok else "FAIL"
    )


def figure_keys(stage: str) -> list[str]:
    return [f.key for f in FIGURES if f.stage == stage]


def software() -> str:
    """The torch this check runs (with its CUDA or HIP runtime) and the LM stage's packages, by their metadata
    (nothing imported): 'torch 2.11.0+cu128 (cuda 12.8), transformers 5.17.0, liger-kernel not installed'."""
    runtime = getattr(torch.version, "hip", None) or torch.version.cuda
    parts = [f"torch {torch.__version__} ({'hip' if getattr(torch.version, 'hip', None) else 'cuda'} {runtime})"]
    if runtime is None:
        parts = [f"torch {torch.__version__} (cpu build)"]
    for dist in ("transformers", "liger-kernel"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist} not installed")
    return ", ".join(parts)


class Run:
    """What summary.txt says about this run besides the checks."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = self.backend = "unknown"
        self.start = time.perf_counter()
        self.date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        self.stages: dict[str, str] = {}
        self.stopped = ""


def write_summary(out: Path, report: Report, run: Run) -> None:
    """summary.txt: the first-run numbers, the counts, the stages, the wall time, torch, device and date."""
    stages = run.stages
    low, high = plan_bounds(run.args)
    lines = [
        "kdbench GPU check (benchmarks/gpu_check.py)",
        f"date:      {run.date}",
        f"device:    {run.device} ({run.backend}); torch {torch.__version__}, "
        f"runtime {getattr(torch.version, 'hip', None) or torch.version.cuda or 'cpu'}",
        f"software:  {software()} (python {sys.version.split()[0]})",
        f"arguments: {' '.join(run.args.argv) or '(none)'}",
        f"wall time: {time.perf_counter() - run.start:.0f} s (plan on a warm H200: {low:.0f}-{high:.0f} s)",
        f"checks:    {report.passed} passed, {len(report.failed)} failed" + (f"; {run.stopped}" if run.stopped else ""),
        "stages:    " + ", ".join(f"{name} {state}" for name, state in stages.items()),
        "",
        "First-run numbers (gpu-review-2; expected ranges for H200, reported, not counted as checks):",
        *(f"  {judge(fig, report, run.device, stages)}" for fig in FIGURES),
    ]
    if report.failed:
        lines += ["", "Failed checks:", *(f"  FAIL {what}" for what in report.failed)]
    tmp = out / "summary.txt.tmp"
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, out / "summary.txt")
