"""GPU check: what kdbench's GPU paths measure, checked on a real GPU in about five minutes.

Run it by hand on a fresh CUDA or ROCm machine (pytest does not collect it):

    python benchmarks/gpu_check.py                    # the first visible GPU; results under a temp folder
    python benchmarks/gpu_check.py --out gpu-check    # keep the probe, results and report

It checks, printing each figure beside its verdict:

1. clocks: a GPU-bound GEMM and a host-bound loop of tiny kernels, timed with kdbench's
   device-event clock and with synchronised wall time, agree within 10 %; the GEMM is not
   flagged launch-bound and the loop is;
2. math: every precision sets the TF32 switches it should (fp32, bf16, fp16: off; tf32: on),
   and fp32 matmuls and convolutions are IEEE fp32 by their error against float64;
3. telemetry: the management library (NVML or amdsmi) reads the GPU torch uses (UUID or
   PCI address, read back from the library), and the energy counter agrees with the
   integral of the sampled power within 25 %;
4. memory: after a cell, the device's allocated memory is back at its baseline, and a
   cell measured twice reports the same peaks;
5. phase stamps: the step time with and without phase events, over paired rounds (5 %);
6. `kdbench probe`: every ceiling is measured or says why not;
7. suites/gpu-smoke.yaml: every row is ok (tf32 may be skipped, with its reason) and
   0 < mfu <= 1 (or, on a GPU without a datasheet entry, 0 < ceiling_utilization <= 1).

It ends with exit code 0 when every check passed, 1 otherwise.  ``--device cpu`` runs the
checks that mean something on the CPU (clocks, math flags, probe, a suite given with
``--suite``), to try the script itself on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kdbench.hw.backends import Backend, choose_autocast, math_flags, math_mode, resolve
from kdbench.measure.timing import timed_loop
from kdbench.names import PRECISIONS

ROOT = Path(__file__).resolve().parents[1]
CLOCK_TOLERANCE = 0.10
ENERGY_TOLERANCE = 0.25
PHASE_TOLERANCE = 0.05


class Report:
    """Prints each check as it is decided and keeps the verdicts."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.passed = 0

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

    cases = ((f"GEMM {n}x{n} {str(dtype)[6:]}", lambda: torch.mm(a, b), False), ("200 tiny adds", host_bound, True))
    for name, fn, launch_bound in cases:
        raw = timed_loop(fn, backend.clock(), warmup=5, min_iters=20, min_time_s=1.0, max_iters=100_000)
        event = statistics.median(raw.samples_ms)
        wall = _synced_wall_ms(fn, backend, len(raw.samples_ms))
        report.check(
            f"{name}: {raw.clock} median {event:.4g} ms, synced wall {wall:.4g} ms per call "
            f"(ratio {event / wall:.3f}, within 1 ± {CLOCK_TOLERANCE})",
            abs(event / wall - 1) <= CLOCK_TOLERANCE,
        )
        flagged = raw.launch_bound(event)
        host = f"{statistics.median(raw.host_ms):.4g} ms" if raw.host_ms else "n/a"
        expected = launch_bound if gpu else None  # host clocks: host time is all there is
        report.check(
            f"{name}: host issue time {host}, launch_bound {flagged} (expected {expected})", flagged is expected
        )


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


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
            continue
        with math_mode(tf32):
            errors[tf32] = (
                _relative_error(a @ b, mm_ref),
                _relative_error(torch.nn.functional.conv2d(x, w, padding=1), conv_ref),
            )
    mm32, conv32 = errors[False]
    report.check(
        f"fp32 matmul error {mm32:.2e}, conv error {conv32:.2e} (IEEE fp32: below 1e-5)", max(mm32, conv32) < 1e-5
    )
    if True in errors:
        mm_tf, conv_tf = errors[True]
        report.check(f"tf32 matmul error {mm_tf:.2e}, conv error {conv_tf:.2e} (TF32 in use: above 1e-5)", mm_tf > 1e-5)


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
    import os

    from kdbench.measure.telemetry import TelemetrySampler, _same_bdf, device_ids

    report.section("telemetry: the GPU torch uses, and energy from its counter")
    if backend.device_type != "cuda":
        report.info("no GPU: nothing to check")
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
        return
    if sampled is None:
        report.check("at least two power samples in the window", False)
        return
    # the sampled integral spans first to last sample, a little less than the window
    span = points[-1, 0] - points[0, 0]
    sampled_full = sampled * t.window_s / span
    ratio = t.energy_j / sampled_full
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


def check_memory(backend: Backend, report: Report) -> None:
    from kdbench.config.plan import Cell
    from kdbench.measure.cell import measure_cell
    from kdbench.models.cache import ModelCache

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
    for i in range(2):
        rows = measure_cell(cell, backend, cache)
        after = allocated()
        report.check(f"after cell {i + 2}: allocated {after} B, baseline {baseline} B", after == baseline)
        peaks.append({r["measurement"]: r.get("peak_memory_bytes") for r in rows})
    report.check(f"all rows ok: {[r['status'] for r in first + rows]}", all(r["status"] == "ok" for r in first + rows))
    report.check(f"the same peaks when measured again: {peaks[0]} and {peaks[1]}", peaks[0] == peaks[1])


def check_phase_overhead(backend: Backend, report: Report) -> None:
    from kdbench.distill.step import DistillStep
    from kdbench.hw.data import synthetic_batch
    from kdbench.models import build_model

    report.section("phase stamps: a step with and without its phase events")
    config = _config()
    torch.manual_seed(0)
    teacher = build_model("resnet56", 100, (3, 32, 32)).to(backend.device)
    student = build_model("resnet20", 100, (3, 32, 32)).to(backend.device)
    x, y = synthetic_batch(config, config.batch_size, backend.device, 0)
    step = DistillStep(teacher, student, x, y, config, backend)
    clock = step.clock
    for _ in range(3):
        step()
    ratios = []
    medians: dict[str, list[float]] = {"stamped": [], "plain": []}
    for i in range(16):
        for name in ("stamped", "plain") if i % 2 == 0 else ("plain", "stamped"):
            step.clock = clock if name == "stamped" else None
            raw = timed_loop(step, backend.clock(), warmup=1, min_iters=5, min_time_s=0.2, max_iters=10_000)
            medians[name].append(statistics.median(raw.samples_ms))
        ratios.append(medians["stamped"][-1] / medians["plain"][-1])
    step.clock = clock
    ratio = statistics.median(ratios)
    report.check(
        f"resnet56->resnet20 kd+at bs128: stamped {statistics.median(medians['stamped']):.3f} ms, plain "
        f"{statistics.median(medians['plain']):.3f} ms; median paired ratio {ratio:.4f} (within 1 ± {PHASE_TOLERANCE})",
        abs(ratio - 1) <= PHASE_TOLERANCE,
    )


def _kdbench(report: Report, *args: str) -> bool:
    command = [sys.executable, "-m", "kdbench", *args]
    report.info("$ " + " ".join(command))
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, check=False)
    return report.check(
        f"kdbench {args[0]} exit code {done.returncode} ({time.perf_counter() - start:.0f} s)", done.returncode == 0
    )


def check_probe(backend: Backend, out: Path, report: Report) -> None:
    import pandas as pd

    report.section("kdbench probe")
    if not _kdbench(report, "probe", "--out", str(out / "results"), "--device", backend.name):
        return
    (newest, *_) = sorted(
        (out / "results" / "probes").glob("probe-*.parquet"), key=lambda p: p.stat().st_mtime, reverse=True
    )
    for r in pd.read_parquet(newest).itertuples():
        value = f"{r.value:.4g} {r.unit}" if pd.notna(r.value) else f"not measured: {r.error}"
        report.check(f"{r.kind} {r.dtype} (size {r.size}): {value}", pd.notna(r.value) or r.dtype == "tf32")


def check_suite(backend: Backend, suite: Path, out: Path, report: Report) -> None:
    import pandas as pd

    from kdbench import api
    from kdbench.store.results import read_results

    report.section(f"kdbench run {suite.name}")
    results = out / "results"  # the probe's ceiling is read from results/probes/
    if not _kdbench(report, "run", str(suite), "--out", str(results), "--device", backend.name, "--no-report"):
        return
    df = read_results([results])
    pd.set_option("display.width", 200)
    for r in df.itertuples():
        what = f"{r.cell_label} {r.measurement} bs{r.batch_size}"
        if r.status != "ok":
            allowed = r.status == "skipped" and r.precision == "tf32" and bool(r.error)
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
    index = api.render([results], out / "report")
    report.info(f"report: {index}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto (the first visible GPU), cuda, rocm or cpu")
    parser.add_argument("--suite", type=Path, default=ROOT / "suites" / "gpu-smoke.yaml")
    parser.add_argument("--out", type=Path, default=None, help="keep the probe, results and report here")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["clocks", "math", "telemetry", "memory", "phases", "probe", "suite"]
    )
    args = parser.parse_args(argv)
    backend = resolve(args.device)
    if backend.device_type == "cuda":
        torch.cuda.set_device(backend.device)
        props = torch.cuda.get_device_properties(backend.device)
        runtime = getattr(torch.version, "hip", None) or torch.version.cuda
        print(f"{props.name} ({backend.name}, torch {torch.__version__}, runtime {runtime})")
    else:
        print(f"{backend.name}: no GPU; only the checks that mean something on the CPU run")
    out = args.out or Path(tempfile.mkdtemp(prefix="kdbench-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    report = Report()
    start = time.perf_counter()
    steps = {
        "clocks": lambda: check_clocks(backend, report),
        "math": lambda: check_math(backend, report),
        "telemetry": lambda: check_telemetry(backend, report),
        "memory": lambda: check_memory(backend, report),
        "phases": lambda: check_phase_overhead(backend, report),
        "probe": lambda: check_probe(backend, out, report),
        "suite": lambda: check_suite(backend, args.suite, out, report),
    }
    for name, step in steps.items():
        if name in args.skip:
            continue
        try:
            step()
        except Exception as exc:  # one broken check must not hide the others
            report.check(f"{name}: raised {type(exc).__name__}: {exc}", False)
    print(
        f"\n{report.passed} passed, {len(report.failed)} failed in {time.perf_counter() - start:.0f} s; files in {out}"
    )
    for what in report.failed:
        print(f"FAIL {what}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
