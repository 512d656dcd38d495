"""GPU check: what kdbench's GPU paths measure, checked on a real GPU in one device command.

The command line (``benchmarks/gpu_check.py``), the stages in the plan's order, each guarded so that one broken
check does not hide the others, and what lands in ``--out``: every line printed, teed into check.log, and the
runs, the probe and summary.txt written again after every stage, so that a failure, a time-out or SIGTERM still
leaves what was done."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kdbench.hw.backends import resolve

from .checks.clocks import check_clocks, check_idle
from .checks.fit import check_fit
from .checks.lm import check_lm
from .checks.math_mode import check_math
from .checks.memory import check_memory
from .checks.phases import check_phase_overhead
from .checks.suites import check_levers, check_probe, check_report, check_suite
from .checks.syncs import check_syncs
from .checks.telemetry import check_telemetry
from .plan import (
    CELL_TIMEOUT_S,
    CPU_QUICK_SKIPS,
    GPU_ONLY,
    LEVERS,
    LM_SUITE,
    QUICK_SKIPS,
    ROOT,
    SMOKE,
    STAGES,
    plan,
    print_plan,
)
from .report import Report, Run, figure_keys, software, write_summary
from .runs import quick_lever_case, quick_smoke_case, subset_suite

OUTPUTS = ("summary.txt", "check.log", "results.tar.gz", "report.tar.gz", "probe.parquet")  # all --out holds


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
            "fit": lambda: check_fit(backend, report),
            "report": lambda: check_report(scratch, report),
        }
        planned = {name: (low, high) for name, low, high, _ in plan(args)}
        for name, step in steps.items():
            if name in args.skip:
                continue
            if args.quick and name in QUICK_SKIPS:
                report.section(name)
                report.info(f"--quick skips the {name} stage: `kdbench report` renders results.tar.gz on any machine")
                run.stages[name] = "skipped (--quick)"
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


def _save(scratch: Path, out: Path, report: Report, run: Run) -> None:
    """What was done so far, in ``out``: the packed runs and the summary (after every stage)."""
    try:
        pack(scratch, out)
    except OSError as exc:
        print(f"   packing {scratch} into {out} failed: {exc}", flush=True)
    write_summary(out, report, run)
