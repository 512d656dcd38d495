"""GPU check: what kdbench's GPU paths measure, checked on a real GPU in one device command.

Run it by hand on a fresh CUDA or ROCm machine (pytest does not collect it):

    python benchmarks/gpu_check.py                    # the first visible GPU; files under a temp folder
    python benchmarks/gpu_check.py --out gpu-check    # the few files to copy back, in gpu-check/
    python benchmarks/gpu_check.py --quick            # a selection with margin in a 10-minute command

It prints its plan (each stage's seconds on a warm H200, from gpu-review-2) and checks, printing
each figure beside its verdict:

1. clocks: a GPU-bound GEMM and a host-bound loop of tiny kernels, timed with kdbench's
   device-event clock and with synchronised wall time, agree within 10 %; the GEMM is not
   flagged launch-bound and the loop is;
2. math: every precision sets the TF32 switches it should (fp32, bf16, fp16: off; tf32: on),
   the legacy and the new flag getters answer inside ``math_mode`` and agree with it, and fp32
   matmuls and convolutions are IEEE fp32 by their error against float64;
3. idle: a device event pair around a 200 ms host sleep times the gap (every one_off_ms relies on it);
4. syncs: a distillation step has no host-device sync (``torch.cuda.set_sync_debug_mode("error")``), and
   an LM step (fused_linear) none either; a liger step has exactly liger-kernel's own (LIGER_SYNCS per
   step, counted in ``"warn"`` mode), and transformers' LM forward its own
   (TRANSFORMERS_SYNCS_PER_FORWARD), said so;
5. telemetry: the management library (NVML or amdsmi) reads the GPU torch uses (UUID or
   PCI address, read back from the library), and the energy counter agrees with the
   integral of the sampled power within 25 %;
6. memory: after a cell, the device's allocated memory is back at its baseline, and a
   cell measured twice reports the same peaks;
7. phase stamps: the step time with and without phase events, over paired rounds (5 %);
8. `kdbench probe`: every ceiling is measured or says why not;
9. suites/gpu-smoke.yaml: every row is ok (tf32 may be skipped, with its reason) and
   0 < mfu <= 1 (or, on a GPU without a datasheet entry, 0 < ceiling_utilization <= 1);
10. suites/gpu-levers.yaml: every lever once; every row ok or skipped with its reason, every
    compiled row with one_off_ms > 0;
11. suites/gpu-lm.yaml: every loss_impl, a bf16-held teacher, the top-k cache, an on-policy step,
    prefill and decode; every row ok or skipped with its reason, every ok row with its attention
    kernel (attention_kernel) and 0 < mfu <= 1 on its steps;
12. the report of the runs renders.

Every ``kdbench run`` gets ``--cell-timeout`` (default 240 s), so no cell outlasts a device command.
``--quick`` measures memory once fewer, pairs fewer phase rounds, and runs a subset of each image suite
(written into the scratch folder), and the LM suite whole (7 tiny cells, every ``loss_impl``).  It says
which torch, transformers and liger-kernel it ran with.  Everything lands in ``--out`` in a few files:
``summary.txt`` (the review's five first-run numbers against their H200 ranges, the counts, the
wall time, torch, device, date), ``check.log`` (all that was printed), ``results.tar.gz`` (the
runs and the probe), ``report.tar.gz`` and ``probe.parquet``; they are rewritten after every
stage, so a failure, a time-out or SIGTERM still leaves what was done.

It ends with exit code 0 when every check passed, 1 otherwise (the first-run numbers are
reported, not counted).  ``--device cpu`` runs the checks that mean something on the CPU
(clocks, math flags, phases, probe, a suite), to try the script itself on a machine without a
GPU; ``--device cpu --quick`` runs the math flags and the probe only, and the rest say "no GPU".
The LM stage needs transformers (kdbench's ``lm`` extra) and, for its liger cell, liger-kernel; a box
without them gets them from benchmarks/device/run_check.py's wheels (docs/gpu-check.md).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from kdbench.core.names import PRECISIONS
from kdbench.hw.backends import Backend, choose_autocast, math_flags, math_mode, resolve
from kdbench.measure.timing import timed_loop

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "suites" / "gpu-smoke.yaml"
LEVERS = ROOT / "suites" / "gpu-levers.yaml"
LM_SUITE = ROOT / "suites" / "gpu-lm.yaml"
CLOCK_TOLERANCE = 0.10
ENERGY_TOLERANCE = 0.25
PHASE_TOLERANCE = 0.05
IDLE_GAP_MS = 200.0
IDLE_MIN_MS = 190.0
CELL_TIMEOUT_S = 240.0
DEVICE_COMMAND_S = 480  # --quick's bound on a warm H200: 8 minutes of a 10-minute device command, with margin
FULL_COMMAND_S = 600  # the full plan's: one 10-minute command on a warm box
OUTPUTS = ("summary.txt", "check.log", "results.tar.gz", "report.tar.gz", "probe.parquet")  # all --out holds


# --------------------------------------------------------------------------- plan


class Stage(NamedTuple):
    """A stage's estimated seconds on a warm H200 (gpu-review-2), in full and with --quick."""

    name: str
    low: float
    high: float
    quick_low: float
    quick_high: float
    what: str


PLAN = (
    Stage("start-up", 10, 15, 10, 15, "import torch and kdbench, the CUDA context"),
    Stage("clocks", 4, 5, 4, 5, "a GEMM and 200 tiny adds, events against wall time"),
    Stage("math", 2, 5, 2, 5, "flags, flag getters, IEEE and TF32 errors"),
    Stage("idle", 1, 2, 1, 2, "events around a 200 ms host sleep"),
    Stage("syncs", 10, 18, 10, 18, "resnet20->resnet8 and tiny-Llama LM steps in sync debug mode"),
    Stage("telemetry", 7, 8, 7, 8, "6 s of GEMMs under NVML/amdsmi"),
    Stage("memory", 12, 15, 8, 10, "a cell three times (--quick: twice)"),
    Stage("phases", 6, 8, 2, 3, "16 paired rounds (--quick: 4)"),
    Stage("probe", 20, 25, 20, 25, "kdbench probe"),
    Stage("suite", 80, 110, 30, 45, "gpu-smoke.yaml: 9 cells (--quick: 3)"),
    Stage("levers", 180, 240, 60, 100, "gpu-levers.yaml: 10 cells, ~5 compiles (--quick: 7, 1)"),
    Stage("lm", 40, 90, 40, 90, "gpu-lm.yaml: 7 tiny-Llama cells, 15 rows (--quick: all of them)"),
    Stage("report", 15, 30, 15, 30, "the report of the runs"),
)
STAGES = tuple(s.name for s in PLAN if s.name != "start-up")
GPU_ONLY = ("idle", "syncs", "telemetry", "memory", "levers", "lm")  # on the CPU they say "no GPU", check nothing
CPU_QUICK_SKIPS = ("clocks", "phases", "suite", "report")  # slow or noise on a small shared CPU


def plan(args: argparse.Namespace) -> list[tuple[str, float, float, str]]:
    """The stages ``args`` runs, each with its (low, high) seconds on a warm H200."""
    return [
        (s.name, *((s.quick_low, s.quick_high) if args.quick else (s.low, s.high)), s.what)
        for s in PLAN
        if s.name not in args.skip
    ]


def plan_bounds(args: argparse.Namespace) -> tuple[float, float]:
    stages = plan(args)
    return sum(s[1] for s in stages), sum(s[2] for s in stages)


def print_plan(args: argparse.Namespace) -> None:
    print(f"\nplan{' (--quick)' if args.quick else ''}: seconds on a warm H200 (gpu-review-2, -3: estimates)")
    for name, low, high, what in plan(args):
        print(f"   {name:<10} {low:>4.0f}-{high:<4.0f} {what}")
    low, high = plan_bounds(args)
    budget = (
        f"within {DEVICE_COMMAND_S} s, the device command's budget"
        if args.quick
        else f"within {FULL_COMMAND_S} s, a whole 10-minute command on a warm box"
    )
    print(f"   {'total':<10} {low:>4.0f}-{high:<4.0f} ({budget})", flush=True)


# --------------------------------------------------------------------------- the report and the numbers


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


def software() -> str:
    """The torch this check runs (with its CUDA or HIP runtime) and the LM stage's packages, by their metadata
    (nothing imported): 'torch 2.11.0+cu128 (cuda 12.8), transformers 5.17.0, liger-kernel not installed'."""
    from importlib import metadata

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


# --------------------------------------------------------------------------- output


class _Tee:
    """A stream that writes to the terminal and to check.log."""

    def __init__(self, stream, log) -> None:
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.log.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.log.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _tar(folder: Path, dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    os.replace(tmp, dest)


def pack(scratch: Path, out: Path) -> None:
    """The scratch folder's runs, probe and report as single files in ``out``."""
    for name in ("results", "report"):
        if (scratch / name).is_dir() and any(p.is_file() for p in (scratch / name).rglob("*")):
            _tar(scratch / name, out / f"{name}.tar.gz")
    probes = sorted((scratch / "results" / "probes").glob("probe-*.parquet"), key=lambda p: p.stat().st_mtime)
    if probes:
        shutil.copyfile(probes[-1], out / "probe.parquet")


class Stopped(BaseException):
    """SIGTERM (a time-out): end the stage, keep what was done."""


def _stop(signum, frame) -> None:
    raise Stopped(f"stopped by {signal.Signals(signum).name}")


# --------------------------------------------------------------------------- checks


def _synced_wall_ms(fn: Callable[[], object], backend: Backend, calls: int) -> float:
    backend.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    backend.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def check_clocks(backend: Backend, report: Report) -> None:
    report.section("clocks: device events against synchronised wall time")
    gpu = backend.device_type == "cuda"
    n = 8192 if gpu else 512
    dtype = torch.bfloat16 if gpu and choose_autocast(backend, "bf16").applied else torch.float32
    a = torch.randn(n, n, device=backend.device, dtype=dtype)
    b = torch.randn(n, n, device=backend.device, dtype=dtype)
    one = torch.ones(1, device=backend.device)

    def host_bound() -> None:
        x = one
        for _ in range(200):
            x = x + 1

    cases = (
        (f"GEMM {n}x{n} {str(dtype)[6:]}", lambda: torch.mm(a, b), False, "clock_gemm"),
        ("200 tiny adds", host_bound, True, "clock_adds"),
    )
    for name, fn, launch_bound, key in cases:
        raw = timed_loop(fn, backend.clock(), warmup=5, min_iters=20, min_time_s=1.0, max_iters=100_000)
        event = statistics.median(raw.samples_ms)
        wall = _synced_wall_ms(fn, backend, len(raw.samples_ms))
        report.figure(f"{key}_ratio", event / wall)
        report.check(
            f"{name}: {raw.clock} median {event:.4g} ms, synced wall {wall:.4g} ms per call "
            f"(ratio {event / wall:.3f}, within 1 ± {CLOCK_TOLERANCE})",
            abs(event / wall - 1) <= CLOCK_TOLERANCE,
        )
        flagged = raw.launch_bound(event)
        if launch_bound:
            report.figure(f"{key}_launch_bound", flagged)
        host = f"{statistics.median(raw.host_ms):.4g} ms" if raw.host_ms else "n/a"
        expected = launch_bound if gpu else None  # host clocks: host time is all there is
        report.check(
            f"{name}: host issue time {host}, launch_bound {flagged} (expected {expected})", flagged is expected
        )


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


FLAG_GETTERS = (  # name, getter, whether it is a process-wide default level ("none": the levels below decide)
    ("cudnn.allow_tf32", lambda: torch.backends.cudnn.allow_tf32, False),
    ("cuda.matmul.allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32, False),
    ("get_float32_matmul_precision()", lambda: torch.get_float32_matmul_precision(), False),
    ("backends.fp32_precision", lambda: torch.backends.fp32_precision, True),
    ("cudnn.fp32_precision", lambda: torch.backends.cudnn.fp32_precision, False),
    ("cuda.matmul.fp32_precision", lambda: torch.backends.cuda.matmul.fp32_precision, False),
    ("cudnn.conv.fp32_precision", lambda: torch.backends.cudnn.conv.fp32_precision, False),
)


def flag_getters(tf32: bool) -> list[tuple[str, str, bool]]:
    """Inside ``math_mode(tf32)``: every fp32 flag getter this torch has, as (name, value or what it raised,
    agrees with the mode).  IEEE: allow_tf32 False, precision highest or ieee; TF32: True, high or tf32."""
    want = {True, "high", "tf32"} if tf32 else {False, "highest", "ieee"}
    found = []
    with math_mode(tf32):
        for name, getter, inherits in FLAG_GETTERS:
            try:
                value = getter()
            except AttributeError:  # an older torch without the new API
                continue
            except Exception as exc:  # what a getter raises is the finding
                text = (str(exc).strip().splitlines() or [""])[0]
                found.append((name, f"raised {type(exc).__name__}: {text}", False))
                continue
            ok = value in want or (inherits and value == "none")
            found.append((name, repr(value), ok))
    return found


def check_flag_getters(report: Report) -> None:
    """The legacy and the new fp32 flag getters (torch's compiler reads both) inside math_mode (gpu-review-2 G2)."""
    for tf32, mode, want in ((False, "IEEE", "False, 'highest' or 'ieee'"), (True, "TF32", "True, 'high' or 'tf32'")):
        found = flag_getters(tf32)
        shown = ", ".join(f"{name} {value}{'' if ok else ' (WRONG)'}" for name, value, ok in found)
        report.check(f"math_mode({tf32}) ({mode}; expected {want}): {shown}", all(ok for *_, ok in found))


def check_math(backend: Backend, report: Report) -> None:
    report.section("math: the flags each precision sets, and fp32 that is IEEE fp32")
    for precision in PRECISIONS:
        choice = choose_autocast(backend, precision)
        if choice.skip:
            report.check(f"{precision}: skipped here: {choice.skip}", precision == "tf32")
            continue
        with math_mode(choice.tf32):
            flags = math_flags()
        want = precision == "tf32"
        report.check(
            f"{precision}: tf32_matmul {flags['tf32_matmul']}, tf32_cudnn {flags['tf32_cudnn']}, "
            f"float32_matmul_precision {flags['float32_matmul_precision']} (TF32 expected: {want})",
            flags["tf32_matmul"] is want and flags["tf32_cudnn"] is want,
        )
    check_flag_getters(report)
    torch.manual_seed(0)
    a = torch.randn(2048, 2048, device=backend.device)
    b = torch.randn(2048, 2048, device=backend.device)
    x = torch.randn(32, 64, 28, 28, device=backend.device)
    w = torch.randn(128, 64, 3, 3, device=backend.device)
    mm_ref = a.double() @ b.double()
    conv_ref = torch.nn.functional.conv2d(x.double(), w.double(), padding=1)
    errors = {}
    for tf32 in (False, True):
        if tf32 and not choose_autocast(backend, "tf32").tf32:
            report.unmeasured(choose_autocast(backend, "tf32").skip or "no TF32 here", "math_tf32_error")
            continue
        with math_mode(tf32):
            errors[tf32] = (
                _relative_error(a @ b, mm_ref),
                _relative_error(torch.nn.functional.conv2d(x, w, padding=1), conv_ref),
            )
    mm32, conv32 = errors[False]
    report.figure("math_ieee_error", mm32)
    report.check(
        f"fp32 matmul error {mm32:.2e}, conv error {conv32:.2e} (IEEE fp32: below 1e-5)", max(mm32, conv32) < 1e-5
    )
    if True in errors:
        mm_tf, conv_tf = errors[True]
        report.figure("math_tf32_error", mm_tf)
        report.check(f"tf32 matmul error {mm_tf:.2e}, conv error {conv_tf:.2e} (TF32 in use: above 1e-5)", mm_tf > 1e-5)


def check_idle(backend: Backend, report: Report) -> None:
    report.section(f"idle: device events around a {IDLE_GAP_MS:.0f} ms host sleep on an idle stream")
    if backend.device_type != "cuda":
        report.info("no GPU: the host clock times the sleep by construction")
        return
    clock = backend.clock()
    torch.ones(1, device=backend.device).add_(1)  # the context and the stream exist before the first event
    backend.synchronize()
    start = clock.stamp()
    host = time.perf_counter()
    time.sleep(IDLE_GAP_MS / 1e3)
    end = clock.stamp()
    host_ms = (time.perf_counter() - host) * 1e3
    clock.sync()
    event_ms = clock.elapsed_ms(start, end)
    report.check(
        f"{clock.name}: {event_ms:.1f} ms between the events, host {host_ms:.1f} ms (the gap included: "
        f">= {IDLE_MIN_MS:.0f} ms; one_off_ms relies on it)",
        event_ms >= IDLE_MIN_MS,
    )


def _step(backend: Backend, config):
    from kdbench.data.synthetic import synthetic_batch
    from kdbench.distill.step import DistillStep
    from kdbench.models import build_model

    torch.manual_seed(0)
    shape = tuple(config.data.shape)
    teacher = build_model(config.pair.teacher, config.data.num_classes, shape).to(backend.device)
    student = build_model(config.pair.student, config.data.num_classes, shape).to(backend.device)
    x, y = synthetic_batch(config, config.batch_size, backend.device, 0)
    from kdbench.workloads import workload_of

    return DistillStep(teacher, student, x, y, config, backend, workload_of(config))


def check_syncs(backend: Backend, report: Report) -> None:
    report.section('syncs: distillation steps under torch.cuda.set_sync_debug_mode("error")')
    if backend.device_type != "cuda":
        report.info("no GPU: nothing synchronises on the CPU")
        return
    config = _config(
        pair={"teacher": "resnet20", "student": "resnet8"},
        precision="bf16",
        batch_size=64,
        inference={"batch_sizes": [64]},
    )
    step = _step(backend, config)
    for _ in range(2):  # lazy initialisation (cuDNN handles, optimizer state) before the check
        step()
    backend.synchronize()
    error = ""
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    except RuntimeError as exc:
        error = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    backend.synchronize()
    step.close()
    report.check(
        f"resnet20->resnet8 {config.method} bf16 bs64, 3 steps: "
        + (f"synchronised: {error}" if error else "no host-device sync"),
        not error,
    )
    check_lm_syncs(backend, report)


# liger-kernel's backward, once a step (0.8.5: chunked_loss/fused_linear_distillation.py:299):
# `if torch.ne(grad_output, torch.tensor(1.0, device=grad_output.device))` -- one sync point of the step, which
# torch's sync debug mode reports as two synchronising calls: the scalar's blocking host-to-device copy
# (pytorch/pytorch#120996) and the comparison read back by the `if` (#62092).
LIGER_SYNCS = 2
# transformers, where masking_utils has find_packed_sequence_indices (5.x), reads the position ids back once per
# forward that has neither an attention mask nor a cache, to find packed sequences (`.all()` in an `if`): every LM
# forward of a step, the teacher's and the student's; the model's own, not kdbench's.
TRANSFORMERS_SYNCS_PER_FORWARD = 1
LM_SYNC_STEPS = 3


def lm_config(**changes):
    """The syncs stage's LM cell: the tiny Llama pair, bf16, 32k vocabulary, 2 x 256 tokens."""
    from kdbench.config.schema import CellConfig

    base = {
        "pair": {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
        "overrides": {"teacher": {"vocab_size": 32000}, "student": {"vocab_size": 32000}},
        "data": {"kind": "tokens", "seq_len": 256, "prompt_fraction": 0.25},
        "method": "forward_kl",
        "precision": "bf16",
        "teacher_precision": "bf16",
        "batch_size": 2,
        "chunk_size": 256,
        "inference": {"batch_sizes": []},
    }
    return CellConfig.model_validate({**base, **changes})


def lm_step(backend: Backend, config):
    """The distillation step of an LM cell, built as a cell builds it (its workload's pair and batch)."""
    from kdbench.distill.step import DistillStep
    from kdbench.models import ModelCache
    from kdbench.workloads import workload_of

    workload = workload_of(config)
    torch.manual_seed(0)
    teacher, student = workload.build_pair(config, backend, ModelCache())
    x, y = workload.batch(config, config.batch_size, backend.device, config.seed, (teacher, student))
    return DistillStep(teacher, student, x, y, config, backend, workload)


class without_packed_check:
    """transformers' packed-sequence check off (it finds none): what is left of a step's syncs is kdbench's and
    its loss's.  Nothing where this transformers has no such check."""

    def __enter__(self):
        import transformers.masking_utils as masking

        self.module = masking
        self.saved = getattr(masking, "find_packed_sequence_indices", None)
        if self.saved is not None:
            masking.find_packed_sequence_indices = lambda position_ids: None
        return self

    def __exit__(self, *exc) -> None:
        if self.saved is not None:
            self.module.find_packed_sequence_indices = self.saved


def lm_sync_expectations(impl: str, packed_check: bool) -> tuple[int, int, str]:
    """(syncs per step with transformers' packed-sequence check off, with it on, why) for an LM step of ``impl``
    with a live teacher: kdbench's own step none, liger's LIGER_SYNCS, transformers' one per forward."""
    own = LIGER_SYNCS if impl == "liger" else 0
    model = 2 * TRANSFORMERS_SYNCS_PER_FORWARD if packed_check else 0
    why = (
        f"liger-kernel's backward: {LIGER_SYNCS} (the host-to-device copy of torch.tensor(1.0) and the `if` on the "
        "comparison, one line)"
        if impl == "liger"
        else "kdbench's LM step is sync-free"
    )
    return own, own + model, why


def check_lm_syncs(backend: Backend, report: Report) -> None:
    """LM steps (tiny Llama, bf16): syncs counted per step in sync debug mode ``"warn"``; kdbench's fused_linear
    step none, a liger step exactly liger-kernel's (said so), and transformers' packed-sequence check apart."""
    from kdbench.distill.lm.impls import unavailable
    from kdbench.measure.syncs import sync_calls

    try:
        import transformers.masking_utils as masking
    except ImportError as exc:
        report.check(f"LM steps: transformers does not import ({exc}): install kdbench's lm extra", False)
        return
    packed = hasattr(masking, "find_packed_sequence_indices")
    n = LM_SYNC_STEPS
    for impl in ("fused_linear", "liger"):
        why_not = unavailable(impl)
        if why_not:
            report.check(f"tiny-Llama {impl} LM step: not checked: {why_not}", impl == "liger")
            continue
        step = lm_step(backend, lm_config(loss_impl=impl))
        try:
            for _ in range(2):  # lazy initialisation (cuBLAS handles, the optimizer's state) before counting
                step()
            backend.synchronize()
            own, with_model, why = lm_sync_expectations(impl, packed)
            steps = _repeat(step, n)
            with without_packed_check():
                calls = sync_calls(steps, backend)
            report.check(
                f"tiny-Llama {impl} bf16 LM step, {n} steps, transformers' packed-sequence check off: {len(calls)} "
                f"synchronising calls (expected {own} a step: {why})",
                len(calls) == own * n,
            )
            calls = sync_calls(steps, backend)
            model = with_model - own
            report.check(
                f"tiny-Llama {impl} bf16 LM step, {n} steps, as transformers {_version('transformers')} runs it: "
                f"{len(calls)} synchronising calls (expected {with_model} a step: {own} of the step's, {model} of "
                "transformers' causal-mask builder, which reads the position ids back once per forward)",
                len(calls) == with_model * n,
            )
        finally:
            step.close()


def _repeat(fn: Callable[[], object], n: int) -> Callable[[], None]:
    def calls() -> None:
        for _ in range(n):
            fn()

    return calls


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def _gemm_loop(backend: Backend, seconds: float, on_window=None):
    n = 8192
    a = torch.randn(n, n, device=backend.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=backend.device, dtype=torch.bfloat16)
    return timed_loop(
        lambda: torch.mm(a, b),
        backend.clock(),
        warmup=5,
        min_iters=20,
        min_time_s=seconds,
        max_iters=1_000_000,
        on_window=on_window,
    )


def check_telemetry(backend: Backend, report: Report) -> None:
    from kdbench.measure.telemetry import TelemetrySampler, _same_bdf, device_ids

    report.section("telemetry: the GPU torch uses, and energy from its counter")
    if backend.device_type != "cuda":
        report.info("no GPU: nothing to check")
        report.unmeasured("the CPU has no energy counter kdbench reads", "energy_ratio")
        return
    visible = {
        k: os.environ[k]
        for k in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
        if k in os.environ
    }
    ids = device_ids(backend)
    report.info(f"torch device {backend.device}: uuid {ids.uuid}, PCI {ids.bdf}; visible devices {visible or 'all'}")
    with TelemetrySampler(backend, interval_s=0.05) as sampler:
        raw = _gemm_loop(backend, 6.0, on_window=sampler.on_window)
    t = sampler.result(len(raw.samples_ms), 1, raw.window_s)
    if not report.check(f"telemetry available ({t.source or sampler.source}): {t.reason or 'yes'}", t.available):
        report.unmeasured(f"no telemetry: {t.reason}", "energy_ratio")
        return
    reader = sampler._reader
    lib, handle = reader.lib, reader.handle
    if sampler.source == "pynvml":
        uuid = lib.nvmlDeviceGetUUID(handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        bus = lib.nvmlDeviceGetPciInfo(handle).busId
        bus = bus.decode() if isinstance(bus, bytes) else bus
        same = (ids.uuid and uuid.removeprefix("GPU-").lower() == ids.uuid.lower()) or _same_bdf(bus, ids.bdf)
        report.check(f"NVML matched {t.device}; its UUID {uuid}, PCI {bus}", bool(same))
    else:
        bdf = lib.amdsmi_get_gpu_device_bdf(handle)
        report.check(f"amdsmi matched {t.device}; its PCI address {bdf}", _same_bdf(bdf, ids.bdf))
    window = raw.window_s
    points = np.array([(s[0], s[1]) for s in sampler.samples if window[0] <= s[0] <= window[1] and s[1] is not None])
    sampled = float(np.trapezoid(points[:, 1], points[:, 0])) if len(points) >= 2 else None
    report.info(
        f"{len(raw.samples_ms)} GEMMs over {t.window_s:.2f} s: mean power {t.mean_power_w} W, clock {t.mean_clock_mhz} "
        f"MHz, kernel-active {t.mean_util_pct} %"
    )
    if t.energy_source != "counter":
        report.check(f"energy counter readable (energy from: {t.energy_source})", False)
        report.unmeasured(f"no energy counter (energy from: {t.energy_source})", "energy_ratio")
        return
    if sampled is None:
        report.check("at least two power samples in the window", False)
        report.unmeasured("under two power samples in the window", "energy_ratio")
        return
    # the sampled integral spans first to last sample, a little less than the window
    span = points[-1, 0] - points[0, 0]
    sampled_full = sampled * t.window_s / span
    ratio = t.energy_j / sampled_full
    report.figure("energy_ratio", ratio)
    report.check(
        f"energy: counter {t.energy_j:.1f} J, sampled power {sampled_full:.1f} J over the window (ratio {ratio:.3f}, "
        f"within 1 ± {ENERGY_TOLERANCE})",
        abs(ratio - 1) <= ENERGY_TOLERANCE,
    )


def _config(**changes):
    from kdbench.config.schema import CellConfig

    base = {
        "pair": {"teacher": "resnet56", "student": "resnet20"},
        "method": "kd+at",
        "batch_size": 128,
        "data": {"shape": [3, 32, 32], "num_classes": 100},
        "timing": {"warmup": 3, "min_iters": 10, "min_time_s": 0.3},
        "inference": {"batch_sizes": [128]},
    }
    return CellConfig.model_validate({**base, **changes})


def check_memory(backend: Backend, report: Report, repeats: int = 2) -> None:
    from kdbench.config.plan import Cell
    from kdbench.models.cache import ModelCache
    from kdbench.run.cell import measure_cell

    report.section("memory: back at the baseline after a cell")
    if backend.device_type != "cuda":
        report.info("no GPU: the CPU has no allocator counters to check")
        return
    cache = ModelCache()
    cell = Cell(0, "memory-check", _config())

    def allocated() -> int:
        gc.collect()
        backend.synchronize()
        return torch.cuda.memory_allocated(backend.device)

    before = allocated()
    first = measure_cell(cell, backend, cache)
    baseline = allocated()  # library workspaces (cuBLAS, MIOpen) stay after the first cell
    report.info(f"allocated before any cell {before} B, after the first {baseline} B (workspaces)")
    peaks = []
    rows: list[dict] = []
    for i in range(repeats):
        rows = measure_cell(cell, backend, cache)
        after = allocated()
        report.check(f"after cell {i + 2}: allocated {after} B, baseline {baseline} B", after == baseline)
        peaks.append({r["measurement"]: r.get("peak_memory_bytes") for r in rows})
    report.check(f"all rows ok: {[r['status'] for r in first + rows]}", all(r["status"] == "ok" for r in first + rows))
    if len(peaks) >= 2:
        report.check(f"the same peaks when measured again: {peaks[0]} and {peaks[1]}", peaks[0] == peaks[1])
    else:
        report.info(f"peaks {peaks[0]} (--quick: measured once after the first, so not compared)")


def check_phase_overhead(backend: Backend, report: Report, pairs: int = 16) -> None:
    report.section("phase stamps: a step with and without its phase events")
    config = _config()
    step = _step(backend, config)
    clock = step.clock
    for _ in range(3):
        step()
    ratios = []
    medians: dict[str, list[float]] = {"stamped": [], "plain": []}
    for i in range(pairs):
        for name in ("stamped", "plain") if i % 2 == 0 else ("plain", "stamped"):
            step.clock = clock if name == "stamped" else None
            raw = timed_loop(step, backend.clock(), warmup=1, min_iters=5, min_time_s=0.2, max_iters=10_000)
            medians[name].append(statistics.median(raw.samples_ms))
        ratios.append(medians["stamped"][-1] / medians["plain"][-1])
    step.clock = clock
    step.close()
    ratio = statistics.median(ratios)
    report.check(
        f"resnet56->resnet20 kd+at bs128: stamped {statistics.median(medians['stamped']):.3f} ms, plain "
        f"{statistics.median(medians['plain']):.3f} ms; median of {pairs} paired ratios {ratio:.4f} "
        f"(within 1 ± {PHASE_TOLERANCE})",
        abs(ratio - 1) <= PHASE_TOLERANCE,
    )


def _kdbench(report: Report, *args: str) -> bool:
    """``python -m kdbench ARGS``, its output printed (and so in check.log) as it comes."""
    command = [sys.executable, "-m", "kdbench", *args]
    report.info("$ " + " ".join(command))
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        encoding="utf-8",
        errors="replace",
    )
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
        sys.stdout.flush()
        code = proc.wait()
    finally:
        if proc.poll() is None:  # stopped (SIGTERM, Ctrl-C): the child goes too
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stdout.close()
    return report.check(f"kdbench {args[0]} exit code {code} ({time.perf_counter() - start:.0f} s)", code == 0)


def check_probe(backend: Backend, scratch: Path, report: Report) -> None:
    import pandas as pd

    report.section("kdbench probe")
    keys = ("probe_bf16_tflops", "probe_fp32_tflops", "probe_tf32_tflops")
    if not _kdbench(report, "probe", "--out", str(scratch / "results"), "--device", backend.name):
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


def subset_suite(suite: Path, keep: Callable[[dict], bool], folder: Path, name: str) -> Path:
    """A copy of ``suite`` with only the ``matrix.cases`` that ``keep`` accepts, written into ``folder``
    (``kdbench run`` has no cell filter); the suite itself when it has no cases axis."""
    import yaml

    raw = yaml.safe_load(suite.read_text())
    cases = (raw.get("matrix") or {}).get("cases")
    if not isinstance(cases, list):
        return suite
    raw["matrix"]["cases"] = [c for c in cases if keep(c or {})]
    raw["name"] = name
    raw["description"] = f"{raw.get('description', '')} (--quick: {len(raw['matrix']['cases'])} of {len(cases)} cases)"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def quick_smoke_case(case: dict) -> bool:
    """--quick's gpu-smoke cells: CIFAR fp32 and tf32, and the resnet50->resnet18 bf16 step the summary reads."""
    pair = case.get("pair") or {}
    if not pair:
        return case.get("precision") in ("fp32", "tf32")
    return case.get("precision") == "bf16" and pair.get("student") == "resnet18"


def quick_lever_case(case: dict) -> bool:
    """--quick's gpu-levers cells: all but the compiles, bar compile_teacher's graph-tree path (gpu-review-2 G3)."""
    return "compile" not in case or bool(case.get("compile_teacher"))


def _run_suite(backend: Backend, suite: Path, scratch: Path, report: Report, cell_timeout: float):
    """``kdbench run`` of a suite into scratch/results/<suite name>/ (where the probe's ceiling is found);
    its rows, checked to be every planned measurement, or None when the run failed."""
    from kdbench.config.load import load_suite
    from kdbench.store.results import read_results
    from kdbench.workloads import expand_checked, planned_measurements

    loaded = load_suite(suite)
    planned = loaded.repeat * sum(len(planned_measurements(c.config)) for c in expand_checked(loaded))
    results = scratch / "results"
    command = ["run", str(suite), "--out", str(results), "--device", backend.name, "--no-report"]
    command += ["--run-id", loaded.name, "--cell-timeout", f"{cell_timeout:g}"]
    _kdbench(report, *command)
    if not (results / loaded.name).is_dir():
        return None
    df = read_results([results / loaded.name])
    if "timestamp" in df:
        df = df.sort_values("timestamp", kind="stable")  # the order they were measured in
    report.check(f"{len(df)} rows stored of {planned} planned (exit code aside)", len(df) == planned)
    return df


def _count(value: Any) -> str:
    import pandas as pd

    return "n/a" if value is None or pd.isna(value) else str(int(value))


def _said(reason: Any) -> bool:
    """A reason is there: a non-empty string (a null reads as None or NaN)."""
    return isinstance(reason, str) and bool(reason.strip())


def _true(value: Any) -> bool:
    import pandas as pd

    return value is not None and not (isinstance(value, float) and pd.isna(value)) and bool(value)


def check_suite(backend: Backend, suite: Path, scratch: Path, report: Report, cell_timeout: float) -> None:
    import pandas as pd

    report.section(f"kdbench run {suite.name}")
    keys = ("step_window_ratio", "step_host_ratio", "step_remainder_ratio")
    df = _run_suite(backend, suite, scratch, report, cell_timeout)
    if df is None:
        report.unmeasured("the suite did not run", *keys)
        return
    pd.set_option("display.width", 200)
    for r in df.itertuples():
        what = f"{r.cell_label} {r.measurement} bs{r.batch_size}"
        if r.status != "ok":
            allowed = r.status == "skipped" and r.precision == "tf32" and _said(r.error)
            report.check(f"{what}: {r.status}: {r.error}", allowed)
            continue
        if pd.notna(r.mfu):
            share, of = r.mfu, f"mfu {r.mfu:.3f} of {r.datasheet_device}"
        elif pd.notna(r.ceiling_utilization):
            share, of = r.ceiling_utilization, f"ceiling_utilization {r.ceiling_utilization:.3f} (no datasheet entry)"
        else:
            share, of = None, "no mfu and no ceiling: no datasheet entry and no probe"
        flags = " launch-bound" if r.launch_bound is True else ""
        report.check(
            f"{what}: {r.median_ms:.4g} ms, {of}{flags}",
            (share is None and backend.device_type == "cpu") or (share is not None and 0 < share <= 1),
        )
    step_figures(df, report)


def step_figures(df, report: Report) -> None:
    """First-run number 3 from the resnet50->resnet18 bf16 distill_step row."""
    import pandas as pd

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
    import pandas as pd

    report.section(f"kdbench run {suite.name}: every lever once")
    if backend.device_type != "cuda":
        report.info("no GPU: the levers suite needs one")
        return
    df = _run_suite(backend, suite, scratch, report, cell_timeout)
    if df is None:
        return
    for r in df.itertuples():
        what = f"{r.cell_label} {r.measurement} bs{r.batch_size}"
        if r.status != "ok":
            report.check(f"{what}: {r.status}: {r.error}", r.status == "skipped" and _said(r.error))
            continue
        compiled = (r.measurement == "distill_step" and (r.compile != "off" or _true(r.compile_teacher))) or str(
            r.runtime or ""
        ).startswith("compile")
        one_off = f", one_off_ms {r.one_off_ms:.4g} ({r.one_off_kind})" if pd.notna(r.one_off_ms) else ""
        if compiled:
            one_off += (
                f", {_count(r.compiled_graphs)} graphs, {_count(r.graph_breaks)} breaks, "
                f"{_count(r.recompiles)} recompiles in the window"
            )
        output = f", output {r.output_check}" if isinstance(r.output_check, str) else ""
        good = not output.startswith(", output MISMATCH")
        if compiled:
            good = good and pd.notna(r.one_off_ms) and r.one_off_ms > 0
        report.check(
            f"{what}: {r.median_ms:.4g} ms{one_off}{output}" + (" (compiled: one_off_ms > 0)" if compiled else ""), good
        )


def lm_row_problems(r) -> list[str]:
    """What an ok row of the LM suite lacks: its attention kernel, a utilisation in (0, 1] on a step, and what
    its cell's path must leave on it (a bf16-held teacher, the top-k cache's bytes, the generation phase)."""
    import pandas as pd

    problems = []
    if not _said(getattr(r, "attention_kernel", None)):
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
    import importlib.util

    import pandas as pd

    report.section(f"kdbench run {suite.name}: the LM paths")
    if backend.device_type != "cuda":
        report.info("no GPU: the LM suite needs one")
        return
    if importlib.util.find_spec("transformers") is None:
        report.check("transformers is installed (kdbench's lm extra; run_check.py installs it from wheels)", False)
        return
    df = _run_suite(backend, suite, scratch, report, cell_timeout)
    if df is None:
        return
    for r in df.itertuples():
        what = f"{r.cell_label} {r.measurement} bs{r.batch_size}"
        if r.status != "ok":
            report.check(f"{what}: {r.status}: {r.error}", r.status == "skipped" and _said(r.error))
            continue
        share = ""
        if r.measurement == "distill_step":
            share = f", mfu {r.mfu:.3g}" if pd.notna(r.mfu) else f", ceiling_utilization {r.ceiling_utilization:.3g}"
        flags = " launch-bound" if r.launch_bound is True else ""
        problems = lm_row_problems(r)
        kernel = r.attention_kernel if _said(r.attention_kernel) else "not recorded"
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
    import pandas as pd

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


def check_report(scratch: Path, report: Report) -> None:
    from kdbench import api

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


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto (the first visible GPU), cuda, rocm or cpu")
    parser.add_argument("--suite", type=Path, default=None, help=f"the smoke suite (default {SMOKE.relative_to(ROOT)})")
    parser.add_argument("--levers", type=Path, default=LEVERS, help="the levers suite")
    parser.add_argument("--lm", type=Path, default=LM_SUITE, help="the LM suite")
    parser.add_argument("--out", type=Path, default=None, help="the files to copy back (default: a temp folder)")
    parser.add_argument(
        "--cell-timeout",
        type=float,
        default=CELL_TIMEOUT_S,
        metavar="SECONDS",
        help=f"passed to every kdbench run: a cell that runs longer is stored as timeout (default {CELL_TIMEOUT_S:g})",
    )
    parser.add_argument("--quick", action="store_true", help="a selection of every stage, with margin in one command")
    parser.add_argument("--skip", nargs="*", default=[], choices=STAGES)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="kdbench-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:  # an earlier check's files must not pass for this one's
        (out / name).unlink(missing_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="kdbench-gpu-check-scratch-"))  # the runs, packed into out
    saved = sys.stdout, sys.stderr
    term = signal.getsignal(signal.SIGTERM)
    with open(out / "check.log", "w", encoding="utf-8", errors="replace") as log:
        sys.stdout, sys.stderr = _Tee(saved[0], log), _Tee(saved[1], log)
        try:
            signal.signal(signal.SIGTERM, _stop)
        except ValueError:  # not the main thread: no handler, the finally blocks still run on errors
            term = None
        try:
            return _check(args, out, scratch)
        finally:
            if term is not None:
                signal.signal(signal.SIGTERM, term)
            sys.stdout, sys.stderr = saved
            shutil.rmtree(scratch, ignore_errors=True)


def _check(args: argparse.Namespace, out: Path, scratch: Path) -> int:
    report = Report()
    run = Run(args)
    run.stages = {name: "not reached" for name in STAGES if name not in args.skip}
    run.stages.update({name: "skipped (--skip)" for name in args.skip})
    try:
        backend = resolve(args.device)
        run.backend = backend.name
        if backend.device_type == "cuda":
            torch.cuda.set_device(backend.device)
            props = torch.cuda.get_device_properties(backend.device)
            run.device = props.name
            runtime = getattr(torch.version, "hip", None) or torch.version.cuda
            print(f"{props.name} ({backend.name}, torch {torch.__version__}, runtime {runtime})")
        else:
            run.device = backend.name
            print(f"{backend.name}: no GPU; only the checks that mean something on the CPU run")
        print(f"software: {software()}")
        print_plan(args)
        if backend.device_type != "cuda":
            print("   (estimates for the GPU: here the GPU stages say 'no GPU' and take no time)")
        cpu_quick = args.quick and backend.device_type != "cuda"
        smoke = args.suite or SMOKE
        levers = args.levers
        if args.quick and args.suite is None:
            smoke = subset_suite(SMOKE, quick_smoke_case, scratch / "suites", "gpu-smoke-quick")
        if args.quick:
            levers = subset_suite(args.levers, quick_lever_case, scratch / "suites", f"{args.levers.stem}-quick")
        steps = {
            "clocks": lambda: check_clocks(backend, report),
            "math": lambda: check_math(backend, report),
            "idle": lambda: check_idle(backend, report),
            "syncs": lambda: check_syncs(backend, report),
            "telemetry": lambda: check_telemetry(backend, report),
            "memory": lambda: check_memory(backend, report, repeats=1 if args.quick else 2),
            "phases": lambda: check_phase_overhead(backend, report, pairs=4 if args.quick else 16),
            "probe": lambda: check_probe(backend, scratch, report),
            "suite": lambda: check_suite(backend, smoke, scratch, report, args.cell_timeout),
            "levers": lambda: check_levers(backend, levers, scratch, report, args.cell_timeout),
            "lm": lambda: check_lm(backend, args.lm, scratch, report, args.cell_timeout),
            "report": lambda: check_report(scratch, report),
        }
        planned = {name: (low, high) for name, low, high, _ in plan(args)}
        for name, step in steps.items():
            if name in args.skip:
                continue
            if cpu_quick and name in CPU_QUICK_SKIPS and not (name == "suite" and args.suite):
                report.section(name)
                report.info(f"no GPU: --quick on the CPU skips the {name} stage (slow or noise on a small CPU)")
                report.unmeasured(f"no GPU: --quick on the CPU skips the {name} stage", *figure_keys(name))
                run.stages[name] = "skipped (no GPU, --quick)"
                continue
            run.stages[name] = "running"
            started = time.perf_counter()
            try:
                step()
                done = "no GPU" if name in GPU_ONLY and backend.device_type != "cuda" else "done"
                run.stages[name] = f"{done} ({time.perf_counter() - started:.0f} s)"
            except Exception as exc:  # one broken check must not hide the others
                report.check(f"{name}: raised {type(exc).__name__}: {exc}", False)
                run.stages[name] = f"raised {type(exc).__name__} ({time.perf_counter() - started:.0f} s)"
            finally:
                if run.stages[name] != "running":  # not stopped
                    low, high = planned[name]
                    report.info(f"{name}: {time.perf_counter() - started:.0f} s (plan: {low:.0f}-{high:.0f} s)")
                _save(scratch, out, report, run)
    except (Stopped, KeyboardInterrupt) as exc:
        run.stopped = str(exc) or type(exc).__name__
        running = [name for name, state in run.stages.items() if state == "running"]
        for name in running:
            run.stages[name] = run.stopped
        report.check(f"{', '.join(running) or 'the check'}: {run.stopped}", False)
    except Exception as exc:  # before the stages: the backend, the plan, the quick suites
        report.check(f"setting up: raised {type(exc).__name__}: {exc}", False)
    finally:
        _save(scratch, out, report, run)
        files = sorted(p.name for p in out.iterdir() if p.is_file())
        print(
            f"\n{report.passed} passed, {len(report.failed)} failed in {time.perf_counter() - run.start:.0f} s; "
            f"{', '.join(files)} in {out}"
        )
        for what in report.failed:
            print(f"FAIL {what}")
        sys.stdout.flush()
        write_summary(out, report, run)
    return 1 if report.failed else 0


def figure_keys(stage: str) -> list[str]:
    return [f.key for f in FIGURES if f.stage == stage]


def _save(scratch: Path, out: Path, report: Report, run: Run) -> None:
    """What was done so far, in ``out``: the packed runs and the summary (after every stage)."""
    try:
        pack(scratch, out)
    except OSError as exc:
        print(f"   packing {scratch} into {out} failed: {exc}", flush=True)
    write_summary(out, report, run)


if __name__ == "__main__":
    sys.exit(main())
