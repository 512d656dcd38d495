"""The command line's parser: every subcommand, flag and help text (``docs/cli.md`` is generated from it), and
the checks of flag values, which end as one-line errors."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn

from kdbench.cli.fit_flags import add_fit
from kdbench.cli.flags import add_allow_unjudged, can_make, number, out_file
from kdbench.core.errors import KdbenchError, did_you_mean
from kdbench.core.limits import MAX_LOSS_ERR

EPILOG = """examples:
  kdbench probe                               measure this device's ceilings into results/probes/
  kdbench run suites/cpu.yaml                 measure, store a run folder in results/, report in reports/
  kdbench run suites/quality.yaml             methods' speed, then their accuracy on digits (minutes)
  kdbench run suites/methods.yaml --profile   every method, live and cached teacher (~20 min on 2 cores)
  kdbench run suites/amd.yaml --dry-run       validate and list the cells, run nothing
  kdbench fit suites/llm-cuda.yaml --gpu H200  will each cell fit an H200? fake runs, ~10 min for 52 cells on 2 cores
  kdbench fit --pair llama-3.1-8b llama-3.2-1b --seq-len 4096 --batch-size 4 --gpu MI300X --max batch_size
  kdbench fit suites/llm-cuda.yaml --gpu H100 --gpu MI300X --tokens 1B   step time, hours and cost on each
  kdbench run suites/levers-cpu.yaml          the levers (compile, ONNX Runtime, int8) on the CPU, ~2 min
  kdbench run suites/cuda.yaml --shard 2/4 --run-id sweep1   one of four machines, all into results/sweep1/
  kdbench report results/ --out reports/      one report over every run in results/
  kdbench compare results/RUN_A results/RUN_B  is B slower than A? exit 1 on a significant regression
  kdbench export results/RUN --format pytest-benchmark --out run.json   for `pytest-benchmark compare`

exit codes: 0 fine; 1 a regression, a missed budget or a failed cell; 2 a mistake to fix (one line);
  75 could not judge (compare, or the budgets, judged nothing: rows contended, thin or one repeat a side;
  --allow-unjudged exits 0);
  130 interrupted
"""


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are kdbench's one-line errors (exit 2), not a usage dump."""

    def error(self, message: str) -> NoReturn:
        raise KdbenchError(f"{message}; see `{self.prog} --help`")


def _out_folder(flag: str):
    """An argparse type: a folder (created when written), not an existing file."""

    def parse(text: str) -> Path:
        path = Path(text)
        if path.exists() and not path.is_dir():
            raise KdbenchError(
                f"{flag} {text}: is a file, and {flag} names a folder; give a folder, e.g. {path.parent}"
            )
        can_make(flag, path, text)
        return path

    return parse


def _shard(text: str) -> tuple[int, int]:
    from kdbench.config.plan import parse_shard

    return parse_shard(text)


def _run_id(text: str) -> str:
    from kdbench.store.results import check_run_id

    return check_run_id(text)


LIST_TOPICS = ("models", "methods", "suites", "loss_impls")


def _topic(text: str) -> str:
    """A `list` topic (``loss-impls`` as ``loss_impls``)."""
    topic = text.strip().lower().replace("-", "_")
    if topic not in LIST_TOPICS:
        raise KdbenchError(
            f"list {text}: no such topic; {did_you_mean(topic, LIST_TOPICS)}give one of {', '.join(LIST_TOPICS)}"
        )
    return topic


def _threshold(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threshold",
        type=number(float, "--threshold", 0, 99.9),
        default=5.0,
        metavar="PCT",
        help="smallest change that counts, in percent of the base median (default: 5)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kdbench",
        description="Benchmark and profile knowledge distillation in PyTorch on CPU, CUDA and ROCm.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    devices = ["auto", "cpu", "cuda", "rocm"]

    run = sub.add_parser("run", help="run a suite: measure every cell, store parquet, render the report")
    run.add_argument("suite", type=Path, help="suite YAML file, e.g. suites/cpu.yaml")
    run.add_argument(
        "--out",
        type=_out_folder("--out"),
        default=Path("results"),
        help="results folder; the run is stored in OUT/<run id>/ (default: results/)",
    )
    run.add_argument(
        "--report-dir",
        type=_out_folder("--report-dir"),
        default=Path("reports"),
        help="folder for the HTML/PNG report (default: reports/)",
    )
    run.add_argument("--no-report", action="store_true", help="store results only, render no report")
    run.add_argument(
        "--device",
        choices=devices,
        default=None,
        help="where to run, overriding the suite's `backend` (auto picks the GPU when there is one)",
    )
    run.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: the suite's `threads`, else torch's default for this machine)",
    )
    run.add_argument(
        "--allow-imports",
        action="store_true",
        help="allow `module:callable` user models, as `allow_imports: true` in the suite does",
    )
    run.add_argument("--dry-run", action="store_true", help="validate the suite and print the plan; run nothing")
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue the newest run of this suite in --out: run only the jobs not stored yet",
    )
    run.add_argument(
        "--run-id",
        type=_run_id,
        default=None,
        metavar="ID",
        help="store the run in OUT/ID/, continuing it when it exists: the shards of one sweep given the "
        "same ID write into one folder (default: a new id, <suite>-<UTC time>-<random>)",
    )
    run.add_argument(
        "--cell-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop a job (a cell, or the quality block) that runs longer and store it as `timeout` "
        "(default: the suite's `cell_timeout_s`, 3600)",
    )
    run.add_argument(
        "--shard",
        type=_shard,
        default=None,
        metavar="I/N",
        help="run only share I of N of the plan (every N-th cell from the I-th; the quality block in "
        "share 1), e.g. one task of a Slurm job array",
    )
    run.add_argument(
        "--repeat",
        type=number(int, "--repeat", 1, 100),
        default=None,
        metavar="N",
        help="measure every cell N times, in rounds (each cell once per round), each round in fresh worker "
        "processes, so `kdbench compare` sees the run-to-run noise; as `repeat: N` (default: the suite's, 1)",
    )
    run.add_argument(
        "--profile",
        action="store_true",
        help="also write a torch.profiler Chrome trace of each cell's step (a separate pass after "
        "timing) under OUT/traces/<run id>/, and list its top operators in the report; as "
        "`profile: true`",
    )
    fit = run.add_mutually_exclusive_group()
    fit.add_argument(
        "--no-fit-check",
        action="store_true",
        help="leave out the fit planner's prediction beside each step's measured peak (a fake run and one "
        "profiled step per cell: tens of ms for a tiny cell, seconds for a ResNet on the CPU); the rows say so; "
        "as `fit_check: false` and `--fit-check false`",
    )
    fit.add_argument(
        "--fit-check",
        choices=("true", "false", "auto"),
        default=None,
        help="as `fit_check: true | false | auto` (default: the suite's, true): auto skips the check of a cell "
        "whose timed loop took less wall time than the last fit check of a cell of the same pair in its worker "
        "(the first one is checked, data-parallel cells always are); the row's notes and fit_check column say so",
    )
    run.add_argument(
        "--judge-contended",
        action="store_true",
        help="check the budgets on rows measured on a busy machine too (`contended`: other processes took the "
        "cores or GPU a measurement needed); by default they are left out, as thin rows are",
    )
    add_allow_unjudged(run, "the suite's budgets")
    run.add_argument(
        "--inline",
        action="store_true",
        help="run jobs in this process instead of a worker process (no crash isolation; for debugging)",
    )

    rep = sub.add_parser("report", help="render an HTML/PNG report from result files")
    rep.add_argument(
        "results", nargs="+", type=Path, help="run folders, parquet files, or folders searched for them (e.g. results/)"
    )
    rep.add_argument(
        "--out", type=_out_folder("--out"), default=Path("reports"), help="report folder (default: reports/)"
    )
    rep.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="BASE",
        help="a run folder or result file to compare every run with (a table and a forest plot per run); "
        "without it, runs after the first are compared with the first when they share cells",
    )
    _threshold(rep)

    cmp = sub.add_parser(
        "compare",
        help="NEW against BASE, cell by cell: ratio of the centres with an interval between repeats; exit 1 on a "
        "regression",
        description="Compare two runs cell by cell (cells match by cell_id, on any machine). Per timed "
        "measurement: the ratio NEW/BASE of the centres (geometric mean of the repeats' medians) with a t-interval "
        "between repeats (each repeat a fresh worker process: `repeat: N` or `run --repeat N`), simultaneous over "
        "the measurements judged, so that two runs of one suite with nothing changed fail the gate in at most "
        "1 - C of comparisons. A change is significant when the interval excludes 1 and the ratio passes the "
        "threshold. A measurement with a single repeat on each side is not judged (the noise from run to run is "
        "unknown), nor are thin, contended (measured on a busy machine) or skipped rows. Exit 0: nothing fails "
        "the gate; 1: a regression, a measurement that failed in NEW, a failed NEW repeat, a cell an "
        "incomplete NEW run never stored, or with --gate-loss-err a faster LM cell beyond --max-loss-err; "
        "2: bad input.",
    )
    cmp.add_argument("base", type=Path, help="the baseline: a run folder or result file")
    cmp.add_argument("new", type=Path, help="the run to judge: a run folder or result file")
    _threshold(cmp)
    cmp.add_argument(
        "--confidence",
        type=number(float, "--confidence", 0.5, 0.9999),
        default=0.95,
        metavar="C",
        help="confidence of the intervals, for all the judged measurements together (default: 0.95)",
    )
    cmp.add_argument(
        "--gate-single-repeat",
        action="store_true",
        help="judge measurements that have one repeat on each side on the noise within one process; that "
        "understates the noise between runs, so two runs of the same suite fail the gate most of the time "
        "(see docs/verdicts.md)",
    )
    cmp.add_argument(
        "--allow-partial",
        action="store_true",
        help="judge an incomplete NEW run, or one whose repeats partly failed, on what it has: cells it has not "
        "stored and failed repeats are listed but do not fail the gate",
    )
    cmp.add_argument(
        "--fail-on-skipped",
        action="store_true",
        help="a measurement ok in BASE and skipped in NEW (e.g. a runtime missing there) fails the gate",
    )
    cmp.add_argument(
        "--rerun-undecided",
        type=number(int, "--rerun-undecided", 1, 20),
        default=None,
        metavar="N",
        help="measure the undecided cells again (one whose interval straddles the threshold, or not judged for "
        "want of repeats), one more repeat a side per round in fresh worker processes, BASE and NEW interleaved, "
        "stored as new parts of each run folder; up to N rounds, the false-alarm rate kept over the whole "
        "sequence (alpha spending: docs/verdicts.md). A side is measured again only on the host and torch it "
        "was measured with, from its suite file",
    )
    cmp.add_argument(
        "--rerun-sides",
        choices=["both", "new"],
        default="both",
        help="with --rerun-undecided: measure both sides again (those that can be, here), or only NEW, e.g. when "
        "BASE was measured from other code than this machine has now and --base-code cannot give it (default: both)",
    )
    cmp.add_argument(
        "--base-code",
        type=Path,
        default=None,
        metavar="DIR",
        help="with --rerun-undecided: BASE's new repeats import the code they run (its suite's module:callable "
        "models) from DIR first, a checkout or worktree of the commit BASE was measured from, so that both sides "
        "are measured again, interleaved, each from its own code (a side's later repeats alone read a machine "
        "that drifts as a change); kdbench itself is this one",
    )
    cmp.add_argument(
        "--judge-contended",
        action="store_true",
        help="judge rows measured on a busy machine too (`contended`: other processes took the cores or GPU a "
        "measurement needed, so it reads slow); by default they are left out, as thin rows are",
    )
    add_allow_unjudged(cmp, "the comparison")
    cmp.add_argument(
        "--max-loss-err",
        type=number(float, "--max-loss-err", 0.0, above=True),
        default=MAX_LOSS_ERR,
        metavar="E",
        help="the accuracy ledger's bound: an LM cell of NEW whose loss_rel_err or grad_rel_err (its loss_impl in its "
        f"precision against float64) exceeds E is named in a note, with its step's verdict, so that a faster "
        f"loss_impl is never called an improvement silently (default: {MAX_LOSS_ERR:g}; see docs/lm.md)",
    )
    cmp.add_argument(
        "--gate-loss-err",
        action="store_true",
        help="a faster (improved) LM cell beyond --max-loss-err fails the gate (exit 1), not only a note",
    )
    cmp.add_argument("--format", choices=["text", "markdown", "json", "csv"], default="text", help="output format")
    cmp.add_argument("--out", type=out_file, default=None, metavar="FILE", help="write the comparison here, not stdout")

    exp = sub.add_parser(
        "export",
        help="write result rows as csv, json, or pytest-benchmark's JSON (for `pytest-benchmark compare`)",
    )
    exp.add_argument("results", nargs="+", type=Path, help="run folders, parquet files, or folders holding them")
    exp.add_argument(
        "--format",
        choices=["csv", "json", "pytest-benchmark"],
        default="csv",
        help="csv/json: every row and column; pytest-benchmark: its saved-run JSON, one benchmark per timed "
        "row, one machine per file (default: csv)",
    )
    exp.add_argument("--out", type=out_file, default=None, metavar="FILE", help="write here instead of stdout")

    add_fit(sub)

    sub.add_parser("env", help="show the backend, devices and software kdbench detects")

    probe = sub.add_parser(
        "probe", help="measure this device's ceilings (matmul TFLOP/s per dtype, copy GB/s) for later runs' utilisation"
    )
    probe.add_argument(
        "--out",
        type=_out_folder("--out"),
        default=Path("results"),
        help="results folder; the probe goes to OUT/probes/ where `run --out OUT` finds it (default: results/)",
    )
    probe.add_argument(
        "--device",
        choices=devices,
        default="auto",
        help="which device to probe (default: auto, the GPU when there is one)",
    )
    probe.add_argument(
        "--threads",
        type=number(int, "--threads", 1, 4096),
        default=None,
        help="torch CPU threads (default: torch's default)",
    )
    probe.add_argument(
        "--size",
        type=number(int, "--size", 16, 65536),
        default=None,
        help="matmul side n (default: 2048 on the CPU, 8192 on GPUs)",
    )
    probe.add_argument(
        "--min-time",
        type=number(float, "--min-time", 0, above=True),
        default=None,
        metavar="SECONDS",
        help="minimum timed duration per measurement (default: 2 on GPUs, for sustained clocks; 0.5 on the CPU)",
    )

    lst = sub.add_parser("list", help="list models, distillation methods, shipped suites or LM loss implementations")
    lst.add_argument(
        "what",
        type=_topic,
        metavar="{" + ",".join(LIST_TOPICS) + "}",
        help="models: the registry's models by family (LMs and encoders with their vocabulary and positions); "
        "methods: the distillation methods and their parameters; suites: the shipped suites with their cells, "
        "description and recorded CPU time (suites/times.toml); loss_impls: the LM loss implementations, what "
        "each needs and which divergences it computes",
    )
    return p
