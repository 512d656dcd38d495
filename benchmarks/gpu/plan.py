"""The check's plan: its stages in order, each with its estimated seconds on a warm H200 (gpu-review-2, -3), in
full and with ``--quick``, and the bounds the whole plan must fit (one device command).  The plan is printed
first, so a reader knows how long to wait and a stage that runs long is seen as such."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "suites" / "gpu-smoke.yaml"
LEVERS = ROOT / "suites" / "gpu-levers.yaml"
LM_SUITE = ROOT / "suites" / "gpu-lm.yaml"
CELL_TIMEOUT_S = 240.0
DEVICE_COMMAND_S = 480  # --quick's bound on a warm H200: 8 minutes of a 10-minute device command, with margin
FULL_COMMAND_S = 600  # the full plan's: one 10-minute command on a warm box


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
    Stage("lm", 40, 90, 40, 90, "gpu-lm.yaml: 8 tiny-Llama cells, 16 rows (--quick: all of them)"),
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
