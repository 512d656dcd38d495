"""The check's plan: its stages in order, each with its estimated seconds on a warm H100 or H200 (gpu-review-2, -3,
-4: read from the code, not yet measured; the tiny cells are launch-bound, so the two cards' figures are one), in
full and with ``--quick``, and the bounds the whole plan must fit (one device command, with the device runner's
probe and install before it).  The plan is printed first, so a reader knows how long to wait and a stage that runs
long is seen as such."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "suites" / "gpu-smoke.yaml"
LEVERS = ROOT / "suites" / "gpu-levers.yaml"
LM_SUITE = ROOT / "suites" / "gpu-lm.yaml"
CELL_TIMEOUT_S = 240.0
DEVICE_COMMAND_S = 480  # --quick's bound on a warm H100/H200, runner included: 8 minutes of a 10-minute command
RUNNER = (15.0, 25.0)  # benchmarks/device/run_check.py before the check: the box's probe and the wheels' install
FULL_COMMAND_S = 720  # the full plan's: by hand on a GPU box, 12 minutes (not one device command: --quick is)


class Stage(NamedTuple):
    """A stage's estimated seconds on a warm H100 or H200 (gpu-review-2, -3, -4), in full and with --quick."""

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
    Stage("syncs", 15, 26, 15, 26, "resnet20->resnet8, tiny-Llama LM and xtok steps, a decode, in sync debug mode"),
    Stage("telemetry", 7, 8, 7, 8, "6 s of GEMMs under NVML/amdsmi"),
    Stage("memory", 12, 15, 8, 10, "a cell three times (--quick: twice)"),
    Stage("phases", 6, 8, 2, 3, "16 paired rounds (--quick: 4)"),
    Stage("probe", 20, 25, 20, 25, "kdbench probe"),
    Stage("suite", 80, 110, 30, 45, "gpu-smoke.yaml: 9 cells (--quick: 3)"),
    Stage("levers", 180, 240, 45, 80, "gpu-levers.yaml: 10 cells, ~5 compiles (--quick: 6, 1)"),
    Stage("lm", 90, 160, 90, 160, "gpu-lm.yaml: 12 tiny-Llama cells, 30 rows, one decode compile (--quick: all)"),
    Stage("fit", 25, 45, 25, 45, "qwen2.5-1.5b->0.5b, 2 x 2,048 tokens: predicted, allocated, reserved, context"),
    Stage("report", 15, 30, 0, 0, "the report of the runs (--quick: none, `kdbench report` renders results.tar.gz)"),
)
STAGES = tuple(s.name for s in PLAN if s.name != "start-up")
GPU_ONLY = ("idle", "syncs", "telemetry", "memory", "levers", "lm")  # on the CPU they say "no GPU", check nothing
CPU_QUICK_SKIPS = ("clocks", "phases", "suite")  # slow or noise on a small shared CPU
# --quick leaves the report to any machine: `kdbench report` renders the runs results.tar.gz brings back
QUICK_SKIPS = ("report",)


def plan(args: argparse.Namespace) -> list[tuple[str, float, float, str]]:
    """The stages ``args`` runs, each with its (low, high) seconds on a warm H100 or H200."""
    return [
        (s.name, *((s.quick_low, s.quick_high) if args.quick else (s.low, s.high)), s.what)
        for s in PLAN
        if s.name not in args.skip and not (args.quick and s.name in QUICK_SKIPS)
    ]


def plan_bounds(args: argparse.Namespace) -> tuple[float, float]:
    """The plan's (low, high) seconds; --quick's with the device runner's probe and install (:data:`RUNNER`), which
    run before it in the same device command."""
    stages = plan(args)
    low, high = sum(s[1] for s in stages), sum(s[2] for s in stages)
    return (low + RUNNER[0], high + RUNNER[1]) if args.quick else (low, high)


def print_plan(args: argparse.Namespace) -> None:
    print(
        f"\nplan{' (--quick)' if args.quick else ''}: seconds on a warm H100 or H200 (gpu-review-2, -3, -4: estimates)"
    )
    if args.quick:
        print(f"   {'runner':<10} {RUNNER[0]:>4.0f}-{RUNNER[1]:<4.0f} before this: run_check.py's probe and install")
    for name, low, high, what in plan(args):
        print(f"   {name:<10} {low:>4.0f}-{high:<4.0f} {what}")
    low, high = plan_bounds(args)
    budget = (
        f"within {DEVICE_COMMAND_S} s, the device command's budget, the runner included"
        if args.quick
        else f"within {FULL_COMMAND_S} s, by hand on a GPU box (a device command runs --quick)"
    )
    print(f"   {'total':<10} {low:>4.0f}-{high:<4.0f} ({budget})", flush=True)
