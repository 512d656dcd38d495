"""Real copies on this machine: does `compare --rerun-undecided` catch a real 1.5x slower step, and keep quiet when
nothing changed?  Not collected by pytest (a measurement of the machine, minutes long); run it on an idle machine:

    python benchmarks/verdict_copies.py [--copies 8] [--repeat 3] [--rounds 4] [--work DIR]

Each copy makes three real runs of a tiny suite (two cells: two MLP students, each distilled from a small MLP
teacher; CPU, one thread, batch 64; a step and a student inference each) into a fresh results folder:

* BASE and AGAIN with the student module of "commit A" on PYTHONPATH (the same code, measured twice: an A/A pair);
* NEW with the student module of "commit B", in which the student `first` has a 1.5x wider hidden layer,
  so its steps do 1.5x the student's work (honestly slower code: no sleep, nothing in kdbench), under the same
  model name, so the cell's config and cell_id are the same as BASE's;

then `compare BASE NEW --rerun-undecided R --base-code commit-A` with commit B's code on PYTHONPATH (BASE was
measured from other code: its new repeats import commit A's module first, so both sides are measured again,
interleaved; `--sides new` compares as `--rerun-sides new` instead, NEW alone measured again) and `compare BASE
AGAIN --rerun-undecided R` with commit A's (both sides measured again, interleaved).  It prints, per copy, both exit
codes, how many repeats each side ended with, the slow step's verdict and ratio and any measurement of the unchanged
cell called regressed or improved, then the catch count (exit 1 and the slow cell's step regressed), the gate's
failures, the A/A false alarms (exit 1) and A/A comparisons with any measurement regressed or improved, and the
comparisons that judged nothing (exit 75, EXIT_NOT_JUDGED: every row contended on a busy machine), which count as
neither a catch nor a pass.

Time: on the idle 2-core VM (2026-12-03) a copy with `--sides new` (3 repeats, 4 rounds at most) took 2.5 min, 12
copies 30 min; it then found: the gate failed in 12 of 12 copies, the slow step regressed in 9 of 12, the unchanged
cell called regressed once (drift between BASE and NEW's later reruns), A/A 0 of 12; at the default `--sides both`
(8 copies, 23 min): the slow step regressed in 8 of 8, no unchanged cell regressed, A/A 0 of 8 (docs/verdicts.md).
It writes summary.json into its work folder.  `--copies 1 --repeat 2 --rounds 1` is a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kdbench.core.errors import EXIT_NOT_JUDGED  # noqa: E402

# compare's exit codes this benchmark reads: 0 passes, 1 fails the gate, EXIT_NOT_JUDGED judged nothing (a busy
# machine: every row contended) and is neither a catch nor a pass; anything else is an error of the benchmark.
COMPARE_CODES = (0, 1, EXIT_NOT_JUDGED)

# The student of every cell: an MLP whose hidden width the "commit" sets; the first cell's is wider in commit B.
MODULE = '''"""The student models of one commit of a user's code base (written by benchmarks/verdict_copies.py)."""
import torch.nn as nn

WIDE = {wide}  # the first cell's hidden width, by this commit


def _mlp(width, num_classes, in_shape):
    size = 1
    for d in in_shape:
        size *= d
    return nn.Sequential(nn.Flatten(), nn.Linear(size, width), nn.ReLU(), nn.Linear(width, num_classes))


def first(num_classes, in_shape):
    return _mlp(WIDE, num_classes, in_shape)


def other(num_classes, in_shape):
    return _mlp(768, num_classes, in_shape)


def teacher(num_classes, in_shape):  # small, so that the student's work is most of a step
    return _mlp(64, num_classes, in_shape)
'''


def suite(repeat: int) -> dict:
    return {
        "name": "verdict-copies",
        "backend": "cpu",
        "threads": 1,
        "allow_imports": True,
        "repeat": repeat,
        "defaults": {
            "batch_size": 64,
            "precision": "fp32",
            "data": {"kind": "synthetic", "shape": [3, 32, 32], "num_classes": 10},
            "timing": {"warmup": 3, "min_iters": 15, "min_time_s": 0.2},
            "inference": {"batch_sizes": [64], "teacher": False},
        },
        "matrix": {
            "pair": [
                {"teacher": "kdcopy_students:teacher", "student": "kdcopy_students:first"},
                {"teacher": "kdcopy_students:teacher", "student": "kdcopy_students:other"},
            ],
        },
    }


def kdbench(args: list[str], code: Path, log: Path) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with log.open("a") as out:
        out.write(f"\n$ kdbench {' '.join(args)}\n")
        out.flush()
        return subprocess.run([sys.executable, "-m", "kdbench", *args], env=env, stdout=out, stderr=out).returncode


def verdict(path: Path) -> tuple[str, str, float | None, int]:
    """The slow cell's step verdict, the repeats each side ended with, the step's ratio, and how many measurements
    of the unchanged cell were called regressed or improved (false verdicts inside an A/B comparison)."""
    doc = json.loads(path.read_text())
    slow = next(c for c in doc["changes"] if c["measurement"] == "distill_step" and "first" in c["cell_label"])
    reps = f"{doc['base']['repeats']}/{doc['new']['repeats']}"
    false = sum(c["verdict"] in ("regressed", "improved") for c in doc["changes"] if "other" in c["cell_label"])
    return slow["verdict"], reps, slow["ratio"], false


def aa_false_verdicts(path: Path) -> int:
    """How many measurements an A/A comparison (the same code on both sides) called regressed or improved: the
    family-wise rate bounds the comparisons with any, in either direction (docs/verdicts.md)."""
    doc = json.loads(path.read_text())
    return sum(c["verdict"] in ("regressed", "improved") for c in doc["changes"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4, help="--rerun-undecided N")
    ap.add_argument("--width", type=int, default=1024, help="the first cell's hidden width in commit A")
    ap.add_argument(
        "--sides",
        choices=["both", "new"],
        default="both",
        help="A/B: BASE measured again from commit A's code (--base-code), or NEW alone (--rerun-sides new)",
    )
    ap.add_argument("--work", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="kdbench-copies-"))
    work.mkdir(parents=True, exist_ok=True)
    commits = {}
    for name, wide in (("A", args.width), ("B", int(args.width * 1.5))):
        folder = work / f"commit-{name}"
        folder.mkdir(exist_ok=True)
        (folder / "kdcopy_students.py").write_text(MODULE.format(wide=wide))
        commits[name] = folder
    suite_file = work / "suite.yaml"  # JSON is YAML
    suite_file.write_text(json.dumps(suite(args.repeat), indent=2))
    log = work / "log.txt"
    caught = alarms = gate = false_ab = aa_false = 0
    unjudged = {"A/B": 0, "A/A": 0}  # exit EXIT_NOT_JUDGED: nothing judged, neither caught nor passed
    copies = []
    began = time.perf_counter()
    for copy in range(1, args.copies + 1):
        out = work / f"copy-{copy}"
        shutil.rmtree(out, ignore_errors=True)
        for run_id, commit in (("base", "A"), ("new", "B"), ("again", "A")):
            rc = kdbench(
                ["run", str(suite_file), "--out", str(out), "--run-id", run_id, "--no-report"], commits[commit], log
            )
            if rc:
                print(f"copy {copy}: run {run_id} exited {rc}; see {log}", file=sys.stderr)
                return 2
        rerun = ["--rerun-undecided", str(args.rounds), "--format", "json"]
        ab = kdbench(
            [
                "compare",
                str(out / "base"),
                str(out / "new"),
                *rerun,
                *(["--base-code", str(commits["A"])] if args.sides == "both" else ["--rerun-sides", "new"]),
                "--out",
                str(out / "ab.json"),
            ],
            commits["B"],
            log,
        )
        aa = kdbench(
            ["compare", str(out / "base"), str(out / "again"), *rerun, "--out", str(out / "aa.json")], commits["A"], log
        )
        for name, rc in (("A/B", ab), ("A/A", aa)):
            if rc not in COMPARE_CODES:
                print(f"copy {copy}: the {name} compare exited {rc}; see {log}", file=sys.stderr)
                return 2
            unjudged[name] += rc == EXIT_NOT_JUDGED
        slow, reps, ratio, false = verdict(out / "ab.json")
        caught += ab == 1 and slow == "regressed"
        gate += ab == 1
        false_ab += false
        alarms += aa == 1
        aa_false_here = aa_false_verdicts(out / "aa.json")
        aa_false += aa_false_here > 0
        _, aa_reps, _, _ = verdict(out / "aa.json")
        copies.append(
            {
                "ab_exit": ab,
                "slow_step": slow,
                "step_ratio": ratio,
                "unchanged_cell_regressed": false,
                "ab_repeats": reps,
                "aa_exit": aa,
                "aa_false_verdicts": aa_false_here,
                "aa_repeats": aa_reps,
            }
        )
        at = f"{ratio:.2f}" if ratio is not None else "no ratio"
        print(
            f"copy {copy}: 1.5x copy exit {_exit(ab)} (slow step {slow} at {at}, repeats {reps}; unchanged cell "
            f"regressed or improved {false}); A/A exit {_exit(aa)} ({aa_false_here} measurement(s) regressed or "
            f"improved; repeats {aa_reps}); {time.perf_counter() - began:.0f} s so far",
            flush=True,
        )
    summary = {
        "caught": caught,
        "gate_failed": gate,
        "unchanged_cell_regressed": false_ab,
        "false_alarms": alarms,
        "aa_with_false_verdicts": aa_false,
        "not_judged": unjudged,
        "copies": args.copies,
        "repeat": args.repeat,
        "rerun_undecided": args.rounds,
        "sides": args.sides,
        "seconds": round(time.perf_counter() - began, 1),
        "per_copy": copies,
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"caught {caught} of {args.copies} real 1.5x slower copies (the step regressed; the gate failed in {gate}, "
        f"and called the unchanged cell regressed or improved {false_ab} times); A/A false alarms (exit 1) "
        f"{alarms} of {args.copies}, A/A comparisons with a measurement regressed or improved {aa_false}; not judged "
        f"(exit {EXIT_NOT_JUDGED}, a busy machine: neither caught nor passed) A/B {unjudged['A/B']}, A/A "
        f"{unjudged['A/A']} (--repeat {args.repeat}, --rerun-undecided {args.rounds}, A/B sides {args.sides}); "
        f"runs, log and summary.json in {work}"
    )
    return 0


def _exit(code: int) -> str:
    return f"{code}, not judged" if code == EXIT_NOT_JUDGED else str(code)


if __name__ == "__main__":
    sys.exit(main())
