"""Command line: run, report, compare, export, probe, env, list.  It parses and prints; :mod:`kdbench.api` does
the work.

User mistakes (KdbenchError, bad command-line values included) print one line,
`kdbench: error: ...`, and exit 2.  `run` exits 0 when every runnable cell succeeded and every budget
held, 1 when a cell failed or a budget was missed, 130 when interrupted; `compare` exits 1 on a
significant regression.  Progress goes through `logging` (logger
``kdbench``): INFO lines to stdout, warnings to stderr.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from kdbench.errors import KdbenchError

EPILOG = """examples:
  kdbench probe                               measure this device's ceilings into results/probes/
  kdbench run suites/cpu.yaml                 measure, store a run folder in results/, report in reports/
  kdbench run suites/quality.yaml             methods' speed, then their accuracy on digits (minutes)
  kdbench run suites/methods.yaml --profile   every method, live and cached teacher (~20 min on 2 cores)
  kdbench run suites/amd.yaml --dry-run       validate and list the cells, run nothing
  kdbench run suites/levers-cpu.yaml          the levers (compile, ONNX Runtime, int8) on the CPU, ~2 min
  kdbench run suites/cuda.yaml --shard 2/4 --run-id sweep1   one of four machines, all into results/sweep1/
  kdbench report results/ --out reports/      one report over every run in results/
  kdbench compare results/RUN_A results/RUN_B  is B slower than A? exit 1 on a significant regression
  kdbench export results/RUN --format pytest-benchmark --out run.json   for `pytest-benchmark compare`
"""


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are kdbench's one-line errors (exit 2), not a usage dump."""

    def error(self, message: str) -> NoReturn:
        raise KdbenchError(f"{message}; see `{self.prog} --help`")


def _number(kind: type, flag: str, low: float | None = None, high: float | None = None, above: bool = False):
    """An argparse type: a ``kind`` number within [low, high] (strictly above ``low`` with ``above``)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise KdbenchError(f"{flag}: expected a{'n integer' if kind is int else ' number'}, got {text!r}") from None
        if (low is not None and (value <= low if above else value < low)) or (high is not None and value > high):
            bounds = f"> {low:g}" if above and high is None else f">= {low:g}" if high is None else f"{low:g}..{high:g}"
            raise KdbenchError(f"{flag}: must be {bounds}, got {text}")
        return value

    return parse


def _out_file(text: str) -> Path:
    """An --out FILE: not an existing folder (its own folders are created when written)."""
    path = Path(text)
    if path.is_dir():
        raise KdbenchError(f"--out {text}: is a folder; give a file name, e.g. {path / 'compare.md'}")
    return path


def _shard(text: str) -> tuple[int, int]:
    from kdbench.config.plan import parse_shard

    return parse_shard(text)


def _run_id(text: str) -> str:
    from kdbench.store.results import check_run_id

    return check_run_id(text)


def _threshold(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threshold",
        type=_number(float, "--threshold", 0, 99.9),
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
        type=Path,
        default=Path("results"),
        help="results folder; the run is stored in OUT/<run id>/ (default: results/)",
    )
    run.add_argument(
        "--report-dir", type=Path, default=Path("reports"), help="folder for the HTML/PNG report (default: reports/)"
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
        type=_number(int, "--repeat", 1, 100),
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
    run.add_argument(
        "--inline",
        action="store_true",
        help="run jobs in this process instead of a worker process (no crash isolation; for debugging)",
    )

    rep = sub.add_parser("report", help="render an HTML/PNG report from result files")
    rep.add_argument(
        "results", nargs="+", type=Path, help="run folders, parquet files, or folders searched for them (e.g. results/)"
    )
    rep.add_argument("--out", type=Path, default=Path("reports"), help="report folder (default: reports/)")
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
        "unknown), nor are thin or skipped rows. Exit 0: nothing fails the gate; 1: a regression, a measurement "
        "that failed in NEW, a failed NEW repeat, or a cell an incomplete NEW run never stored; 2: bad input.",
    )
    cmp.add_argument("base", type=Path, help="the baseline: a run folder or result file")
    cmp.add_argument("new", type=Path, help="the run to judge: a run folder or result file")
    _threshold(cmp)
    cmp.add_argument(
        "--confidence",
        type=_number(float, "--confidence", 0.5, 0.9999),
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
    cmp.add_argument("--format", choices=["text", "markdown", "json", "csv"], default="text", help="output format")
    cmp.add_argument(
        "--out", type=_out_file, default=None, metavar="FILE", help="write the comparison here, not stdout"
    )

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
    exp.add_argument("--out", type=_out_file, default=None, metavar="FILE", help="write here instead of stdout")

    sub.add_parser("env", help="show the backend, devices and software kdbench detects")

    probe = sub.add_parser(
        "probe", help="measure this device's ceilings (matmul TFLOP/s per dtype, copy GB/s) for later runs' utilisation"
    )
    probe.add_argument(
        "--out",
        type=Path,
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
        type=_number(int, "--threads", 1, 4096),
        default=None,
        help="torch CPU threads (default: torch's default)",
    )
    probe.add_argument(
        "--size",
        type=_number(int, "--size", 16, 65536),
        default=None,
        help="matmul side n (default: 2048 on the CPU, 8192 on GPUs)",
    )
    probe.add_argument(
        "--min-time",
        type=_number(float, "--min-time", 0, above=True),
        default=None,
        metavar="SECONDS",
        help="minimum timed duration per measurement (default: 2 on GPUs, for sustained clocks; 0.5 on the CPU)",
    )

    lst = sub.add_parser("list", help="list models or distillation methods")
    lst.add_argument(
        "what",
        choices=["models", "methods"],
        help="models: the registry's models by family; methods: the distillation methods and their parameters",
    )
    return p


def _cmd_run(args: argparse.Namespace) -> int:
    from kdbench import api
    from kdbench.config import with_overrides
    from kdbench.run.engine import RunOptions

    suite = api.load_suite(args.suite)
    suite = with_overrides(
        suite,
        {
            "threads": ("--threads", args.threads),
            "cell_timeout_s": ("--cell-timeout", args.cell_timeout),
            "allow_imports": ("--allow-imports", True if args.allow_imports else None),
            "profile": ("--profile", True if args.profile else None),
            "repeat": ("--repeat", args.repeat),
        },
    )
    options = RunOptions(
        out_dir=args.out,
        device=args.device,
        resume=args.resume,
        run_id=args.run_id,
        shard=args.shard,
        inline=args.inline,
    )
    if args.dry_run:
        return _dry_run(suite, options)
    plan = api.plan(suite, options.shard, options.device)
    if not plan.jobs:
        i, n = options.shard
        print(f"shard {i}/{n} of suite '{suite.name}' holds no cells; nothing to run")
        return 0
    outcome = api.run_suite(suite, options, plan, close=False)
    try:
        return _after_run(args, outcome)
    finally:
        outcome.close()  # the wall-time split ends after the report and the budget checks


def _after_run(args: argparse.Namespace, outcome) -> int:
    """What `run` does once the jobs are done: say how it ended, render the report, check the budgets."""
    import time

    from kdbench import api
    from kdbench.store.results import RunFolder

    if outcome.follower:
        return 0  # rank 0 stores, reports and sets the exit code
    if outcome.interrupted:
        again = ["kdbench", "run", str(args.suite), "--out", str(args.out)]
        again += ["--run-id", args.run_id] if args.run_id else ["--resume"]
        again += ["--device", args.device] if args.device else []
        print(
            f"interrupted: {outcome.jobs} jobs stored in {outcome.path}; resume with:\n  {shlex.join(again)}",
            file=sys.stderr,
        )
        return 130
    print(f"{outcome.jobs} jobs, {outcome.rows} rows -> {outcome.path}")
    if outcome.aborted:
        print(
            f"kdbench: the run stopped after {outcome.aborted}\n  its rows are stored; continue after it with: "
            f"kdbench run {shlex.quote(str(args.suite))} --out {shlex.quote(str(args.out))} --resume",
            file=sys.stderr,
        )
    stored = bool(RunFolder(outcome.path).parts())
    if outcome.quality:
        print(api.quality_table([outcome.path]), end="")
    if not args.no_report and stored:
        began = time.perf_counter()
        print(f"report -> {api.render([outcome.path], args.report_dir)}")
        outcome.spent("report", time.perf_counter() - began)
    began = time.perf_counter()
    missed = _budgets(api.budget_checks([outcome.path]) if stored else [])
    outcome.spent("budget checks", time.perf_counter() - began)
    if outcome.failed or outcome.aborted:
        print(f"{len(outcome.failed)} job(s) had failures:", file=sys.stderr)
        for label in outcome.failed:
            print(f"  {label}", file=sys.stderr)
    return 1 if outcome.failed or outcome.aborted or missed else 0


def _budgets(checks) -> int:
    """Print the budget checks (misses to stderr); the number missed (failed measurements included)."""
    from kdbench.config.budgets import OUTCOMES, format_value, where_text

    if not checks:
        return 0
    missed = [c for c in checks if c.missed]
    counts = ", ".join(f"{n} {o}" for o in OUTCOMES if (n := sum(c.outcome == o for c in checks)) and o != "met")
    met = sum(c.met for c in checks)
    print(f"budgets: {met} of {len(checks)} checks met" + (f" ({counts})" if counts else ""))
    for c in missed:
        value = format_value(c.value, c.stat) + (f" ({c.note})" if c.note else "")
        print(f"  {c.outcome.upper()} {c.budget}: {where_text(c)}: {value}", file=sys.stderr)
    return len(missed)


def _dry_run(suite, options) -> int:
    from kdbench import api
    from kdbench.config.plan import planned_measurements
    from kdbench.hw.backends import detect
    from kdbench.run.jobs import CellJob

    plan = api.plan(suite, options.shard, options.device)
    n_rows = 0
    for job in plan.jobs:
        if isinstance(job, CellJob) and job.repeat > 1:
            continue  # the same cells again, in later rounds
        if isinstance(job, CellJob):
            n_rows += len(planned_measurements(job.cell.config))
            inf = ",".join(str(b) for b in job.cell.config.inference.batch_sizes) or "-"
            print(f"{job.cell.index + 1:4d}  {job.job_id}  {job.label}  (inference bs {inf})")
        else:
            print(f"after the cells, {job.describe()}")
    requested = options.device or suite.backend
    d = detect()
    here = (
        "available here"
        if requested in ("auto", "cpu") or d.best == requested
        else f"NOT available here: {d.describe()}"
    )
    cells = sum(isinstance(j, CellJob) and j.repeat == 1 for j in plan.jobs)
    times = f" x {suite.repeat} repeats" if suite.repeat > 1 else ""
    print(f"{cells} cells, {n_rows} measurements{times}; suite '{suite.name}', backend {requested} ({here})")
    if here == "available here":  # the plan-time warnings a run would print (slow precisions)
        from kdbench.hw.backends import resolve
        from kdbench.run.engine import warn_slow_cells
        from kdbench.store.results import PROBES_DIR

        skip = suite.slow_precisions == "skip"
        warn_slow_cells(plan, resolve(requested), options.out_dir / PROBES_DIR, suite.threads, skip)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from kdbench import api

    print(f"report -> {api.render(args.results, args.out, baseline=args.baseline, threshold=args.threshold / 100)}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from kdbench import api
    from kdbench.report.compare_format import render, verdict_line
    from kdbench.report.verdicts import Policy
    from kdbench.store.files import write_text

    policy = Policy(args.gate_single_repeat, args.allow_partial, args.fail_on_skipped)
    cmp = api.compare(args.base, args.new, args.threshold / 100, args.confidence, policy)
    text = render(cmp, args.format)
    if args.out is None:
        print(text, end="")
    else:
        write_text(text, args.out)
        print(f"{verdict_line(cmp)}; comparison -> {args.out}")
    for c in cmp.bad:
        print(f"{c.verdict}: {c.name}: {c.note or f'x{c.ratio:.3f}'}", file=sys.stderr)
    return cmp.exit_code


def _cmd_export(args: argparse.Namespace) -> int:
    from kdbench.report.export import write_export
    from kdbench.store import read_results

    text = write_export(read_results(args.results), args.format, args.out)
    if args.out is None:
        print(text, end="")
    else:
        print(f"{args.format} -> {args.out}")
    return 0


def _cmd_env(_args: argparse.Namespace) -> int:
    from kdbench.hw.environment import describe_lines

    print("\n".join(describe_lines()))
    print("(tf32_* and float32_matmul_precision are this process's torch defaults: a run sets them per measurement)")
    return 0


def _cmd_probe(args: argparse.Namespace) -> int:
    import torch

    from kdbench.hw.backends import resolve, thread_count
    from kdbench.hw.probe import measure_ceilings, probe_env
    from kdbench.store.probes import write_probe
    from kdbench.store.results import PROBES_DIR

    backend = resolve(args.device)
    with thread_count(args.threads):
        env = probe_env(backend)  # records the thread count the probe runs with
        print(f"probing {backend.name} ({env['device_name']}), {torch.get_num_threads()} CPU threads ...")
        rows = measure_ceilings(backend, matmul_n=args.size, min_time_s=args.min_time)
    for r in rows:
        value = f"{r['value']:.3f} {r['unit']}" if r["value"] is not None else f"unavailable ({r.get('error')})"
        print(f"  {r['kind']:6s} {r['dtype']:5s} size {r['size']}: {value}")
    print(f"probe -> {write_probe(rows, env, args.out / PROBES_DIR)}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    if args.what == "models":
        from kdbench.config.schema import DataConfig
        from kdbench.models import available_models
        from kdbench.models.registry import parameter_count

        models = available_models()
        data = DataConfig()  # the cell defaults the parameters are counted at
        shape = "x".join(map(str, data.shape))
        for family in sorted(set(models.values())):
            names = [n for n, f in models.items() if f == family]
            if family == "torchvision":  # ImageNet classifiers: names only (building 80 of them takes seconds)
                print(f"{family} ({len(names)}): {', '.join(names)}")
                continue
            print(f"{family} ({len(names)}), parameters at {data.num_classes} classes, {shape}:")
            for name in names:
                print(f"  {name:<20} {parameter_count(name, data.num_classes, tuple(data.shape)) / 1e6:8.2f} M")
        from kdbench.models.lm import LM_CONFIGS, lm_parameter_count

        print(f"lm ({len(LM_CONFIGS)}): causal language models (data.kind: tokens), parameters as registered:")
        for name in LM_CONFIGS:
            print(f"  {name:<20} {lm_parameter_count(name) / 1e6:8.2f} M")
        from kdbench.models.encoders import ENCODER_CONFIGS, encoder_parameter_count

        print(f"encoder ({len(ENCODER_CONFIGS)}): BERT-shaped encoders (data.kind: tokens), parameters as registered:")
        for name in ENCODER_CONFIGS:
            print(f"  {name:<20} {encoder_parameter_count(name) / 1e6:8.2f} M")
        print("config.json: a local transformers config (its model_type a causal LM) as a model name")
        print("module:callable: a user's own model factory (needs `allow_imports: true` or --allow-imports)")
        return 0
    from kdbench.distill.losses import METHODS

    for m in METHODS.values():
        params = ", ".join(f"{k}={v}" for k, v in m.params().model_dump().items())
        feats = " (feature method: hooks on `features.teacher` / `features.student`)" if m.cls.needs_features else ""
        print(f"{m.name}: {m.doc}{feats}\n    suite key `{m.name}`: {params}")
    print("a+b: any combination, e.g. kd+at; CE counted once; `weights: {kd: 1.0, at: 1.0}` scales each term")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": _cmd_run,
    "report": _cmd_report,
    "compare": _cmd_compare,
    "export": _cmd_export,
    "env": _cmd_env,
    "probe": _cmd_probe,
    "list": _cmd_list,
}


class _Console(logging.Handler):
    """kdbench's log lines as a user sees them: the message alone, INFO to stdout, warnings to stderr
    (the streams looked up when written, so a caller's redirection applies)."""

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        stream.write(self.format(record) + "\n")
        stream.flush()


def configure_logging(level: int = logging.INFO) -> None:
    logger = logging.getLogger("kdbench")
    logger.handlers[:] = [_Console()]
    logger.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except KdbenchError as exc:
        print(f"kdbench: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("kdbench: interrupted", file=sys.stderr)
        return 130
