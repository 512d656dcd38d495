"""Command line: run, report, env, list.

User mistakes (KdbenchError) print one line, `kdbench: error: ...`, and exit 2.
`run` exits 0 when every runnable cell succeeded and 1 when any failed.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from kdbench.errors import KdbenchError

EPILOG = """examples:
  kdbench probe                               measure this device's ceilings into results/probes/
  kdbench run suites/cpu.yaml                 measure, store in results/, report in reports/
  kdbench run suites/quality.yaml             methods' speed, then their accuracy on real data (digits)
  kdbench run suites/methods.yaml --profile   every method, live and cached teacher, with traces
  kdbench run suites/amd.yaml --dry-run       validate and list the cells, run nothing
  kdbench run suites/cuda.yaml --device cpu   run a GPU suite on the CPU
  kdbench report results/ --out reports/      one report over every result file in results/
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kdbench",
        description="Benchmark and profile knowledge distillation in PyTorch on CPU, CUDA and ROCm.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run a suite: measure every cell, store parquet, render the report")
    run.add_argument("suite", type=Path, help="suite YAML file, e.g. suites/cpu.yaml")
    run.add_argument(
        "--out", type=Path, default=Path("results"), help="folder for the run's parquet file (default: results/)"
    )
    run.add_argument(
        "--report-dir", type=Path, default=Path("reports"), help="folder for the HTML/PNG report (default: reports/)"
    )
    run.add_argument("--no-report", action="store_true", help="store results only, render no report")
    run.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda", "rocm"],
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
        help="continue the newest run of this suite in --out: measure only the cells not stored yet",
    )
    run.add_argument(
        "--cell-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop a cell that runs longer and record it as `timeout` (default: the suite's `cell_timeout_s`, 3600)",
    )
    run.add_argument(
        "--shard",
        default=None,
        metavar="I/N",
        help="run only share I of N of the plan (every N-th cell from the I-th), e.g. one task of a "
        "Slurm job array; `report` merges the shares' files",
    )
    run.add_argument(
        "--profile",
        action="store_true",
        help="also write a torch.profiler Chrome trace of each cell's step (a separate pass after "
        "timing) under OUT/traces/, and list its top operators in the report; as `profile: true`",
    )
    run.add_argument(
        "--inline",
        action="store_true",
        help="measure in this process instead of a worker process (no crash isolation; for debugging)",
    )

    rep = sub.add_parser("report", help="render an HTML/PNG report from result files")
    rep.add_argument("results", nargs="+", type=Path, help="parquet files, or folders searched for them")
    rep.add_argument("--out", type=Path, default=Path("reports"), help="report folder (default: reports/)")

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
        choices=["auto", "cpu", "cuda", "rocm"],
        default="auto",
        help="which device to probe (default: auto, the GPU when there is one)",
    )
    probe.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's default)")
    probe.add_argument("--size", type=int, default=None, help="matmul side n (default: 2048 on the CPU, 8192 on GPUs)")
    probe.add_argument(
        "--min-time",
        type=float,
        default=0.5,
        metavar="SECONDS",
        help="minimum timed duration per measurement (default: 0.5)",
    )

    lst = sub.add_parser("list", help="list models or distillation methods")
    lst.add_argument("what", choices=["models", "methods"])
    return p


def _cmd_run(args: argparse.Namespace) -> int:
    import torch

    from kdbench.config.plan import expand, parse_shard, planned_measurements, shard
    from kdbench.config.schema import load_suite
    from kdbench.hw.backends import detect, resolve
    from kdbench.run.allocation import detect_allocation, run_allocated
    from kdbench.run.engine import run_plan, run_quality_cell

    suite = load_suite(args.suite)
    if args.allow_imports and not suite.allow_imports:
        from dataclasses import replace

        suite = replace(suite, allow_imports=True)
    cells = expand(suite)
    if args.shard:
        i, n = parse_shard(args.shard)
        cells = shard(cells, i, n)
        if not cells:
            print(f"shard {i}/{n} of suite '{suite.name}' holds no cells; nothing to run")
            return 0
    run_quality_here = suite.quality is not None and (not args.shard or parse_shard(args.shard)[0] == 1)
    if suite.quality is not None:
        from kdbench.quality.protocol import check_quality, quality_jobs

        try:
            check_quality(suite.quality, [c.config for c in cells])
        except KdbenchError as exc:
            raise suite.error(("quality",), str(exc)) from None
    requested = args.device or suite.backend
    if args.dry_run:
        n_rows = 0
        for cell in cells:
            rows = planned_measurements(cell.config)
            n_rows += len(rows)
            inf = ",".join(str(b) for b in cell.config.inference.batch_sizes) or "-"
            print(f"{cell.index + 1:4d}  {cell.cell_id}  {cell.label}  (inference bs {inf})")
        d = detect()
        here = (
            "available here"
            if requested in ("auto", "cpu") or d.best == requested
            else f"NOT available here: {d.describe()}"
        )
        if run_quality_here:
            q = suite.quality
            jobs = quality_jobs(c.config for c in cells)
            print(
                f"after the cells, quality on {q.dataset}: {q.seeds} seed(s) x (teachers, scratch students and "
                f"{len(jobs)} distillation(s)), {q.epochs} epochs each"
            )
        print(f"{len(cells)} cells, {n_rows} measurements; suite '{suite.name}', backend {requested} ({here})")
        return 0
    try:
        backend = resolve(requested)
    except KdbenchError as exc:
        raise KdbenchError(f"{suite.path}: backend {requested}: {exc}") from None
    if args.threads is not None and args.threads < 1:
        raise KdbenchError(f"--threads must be >= 1, got {args.threads}")
    threads = args.threads or suite.threads or torch.get_num_threads()
    if args.cell_timeout is not None and args.cell_timeout <= 0:
        raise KdbenchError(f"--cell-timeout must be > 0 seconds, got {args.cell_timeout}")
    alloc = detect_allocation()
    if alloc is not None:  # started once per rank by torchrun or srun
        outcome = run_allocated(
            suite,
            cells,
            backend.name,
            args.out,
            threads,
            alloc=alloc,
            resume=args.resume,
            inline=args.inline,
            cell_timeout_s=args.cell_timeout,
        )
        if outcome is None:
            return 0  # rank 0 stores, reports and sets the exit code
    else:
        outcome = run_plan(
            suite,
            cells,
            backend,
            args.out,
            threads,
            resume=args.resume,
            inline=args.inline,
            cell_timeout_s=args.cell_timeout,
            profile=args.profile or suite.profile,
        )
    if not outcome.interrupted and alloc is None and run_quality_here:
        qual = run_quality_cell(suite, cells, backend, args.out, threads, resume=True)
        if qual is not None:
            outcome.cells += qual.cells
            outcome.rows += qual.rows
            outcome.failed += qual.failed
            outcome.interrupted = qual.interrupted
            outcome.path = qual.path if not outcome.path.exists() else outcome.path
    if outcome.interrupted:
        again = " ".join(
            shlex.quote(a)
            for a in [
                "kdbench",
                "run",
                str(args.suite),
                "--out",
                str(args.out),
                "--resume",
                *(["--device", args.device] if args.device else []),
            ]
        )
        print(f"interrupted: {outcome.cells} cells stored in {outcome.path}; resume with:\n  {again}", file=sys.stderr)
        return 130
    print(f"{outcome.cells} cells, {outcome.rows} rows -> {outcome.path}")
    if not args.no_report and outcome.path.exists():
        from kdbench.report import render_report
        from kdbench.store.schema import read_results

        index = render_report(read_results([outcome.path]), args.report_dir)
        print(f"report -> {index}")
    if outcome.failed:
        print(f"{len(outcome.failed)} cell(s) had failures:", file=sys.stderr)
        for label in outcome.failed:
            print(f"  {label}", file=sys.stderr)
        return 1
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from kdbench.report import render_report
    from kdbench.store.schema import read_results

    index = render_report(read_results(args.results), args.out)
    print(f"report -> {index}")
    return 0


def _cmd_env(_args: argparse.Namespace) -> int:
    from kdbench.hw.environment import describe_lines

    print("\n".join(describe_lines()))
    return 0


def _cmd_probe(args: argparse.Namespace) -> int:
    import torch

    from kdbench.hw.backends import resolve
    from kdbench.measure.flops import measure_ceilings, probe_env, write_probe
    from kdbench.store.schema import PROBES_DIR

    backend = resolve(args.device)
    if args.threads is not None and args.threads < 1:
        raise KdbenchError(f"--threads must be >= 1, got {args.threads}")
    if args.size is not None and not 16 <= args.size <= 65536:
        raise KdbenchError(f"--size must be between 16 and 65536, got {args.size}")
    if args.min_time <= 0:
        raise KdbenchError(f"--min-time must be > 0 seconds, got {args.min_time}")
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads or before)
    try:
        env = probe_env(backend)  # records the thread count the probe runs with
        print(f"probing {backend.name} ({env['device_name']}), {torch.get_num_threads()} CPU threads ...")
        rows = measure_ceilings(backend, matmul_n=args.size, min_time_s=args.min_time)
    finally:
        torch.set_num_threads(before)
    for r in rows:
        value = f"{r['value']:.3f} {r['unit']}" if r["value"] is not None else f"unavailable ({r.get('error')})"
        print(f"  {r['kind']:6s} {r['dtype']:5s} size {r['size']}: {value}")
    path = write_probe(rows, env, args.out / PROBES_DIR)
    print(f"probe -> {path}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    if args.what == "models":
        from kdbench.models import available_models

        models = available_models()
        for family in sorted(set(models.values())):
            names = [n for n, f in models.items() if f == family]
            print(f"{family} ({len(names)}): {', '.join(names)}")
        print("module:callable: a user's own model factory (needs `allow_imports: true` or --allow-imports)")
        return 0
    from kdbench.config.schema import CellConfig
    from kdbench.distill.losses import METHODS

    for m in METHODS.values():
        defaults = CellConfig.model_fields[m.params].default.model_dump()
        params = ", ".join(f"{k}={v}" for k, v in defaults.items())
        feats = " (feature method: hooks on `features.teacher` / `features.student`)" if m.cls.needs_features else ""
        print(f"{m.name}: {m.doc}{feats}\n    suite key `{m.params}`: {params}")
    print("a+b: any combination, e.g. kd+at; CE counted once; `weights: {kd: 1.0, at: 1.0}` scales each term")
    return 0


COMMANDS = {"run": _cmd_run, "report": _cmd_report, "env": _cmd_env, "probe": _cmd_probe, "list": _cmd_list}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except KdbenchError as exc:
        print(f"kdbench: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("kdbench: interrupted", file=sys.stderr)
        return 130
