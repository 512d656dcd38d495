"""The commands: what each subcommand does with its parsed arguments (the work itself is :mod:`kdbench.api`'s)."""

from __future__ import annotations

import argparse
import sys


def cmd_run(args: argparse.Namespace) -> int:
    from kdbench.core.install import check_install

    check_install()  # before anything imports torchvision; transformers is checked where an LM is built
    from kdbench import api
    from kdbench.run.engine import RunOptions
    from kdbench.run.resume import resolve

    given = {  # the run's options as given; a continued run keeps those it was started with (kdbench.run.resume)
        "repeat": args.repeat,
        "device": args.device,
        "threads": args.threads,
        "profile": True if args.profile else None,
        "fit_check": False if args.no_fit_check else {"true": True, "false": False}.get(args.fit_check, args.fit_check),
        "cell_timeout_s": args.cell_timeout,
        "allow_imports": True if args.allow_imports else None,
    }
    args.resolved = resolve(api.load_suite(args.suite), given, args.out, args.run_id, args.resume)
    suite = args.resolved.suite
    options = RunOptions(
        out_dir=args.out,
        device=args.resolved.device,
        resume=args.resume,
        run_id=args.run_id,
        shard=args.shard,
        inline=args.inline,
        record=args.resolved.record,
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
    from kdbench.run.resume import resume_command
    from kdbench.store.results import RunFolder

    if outcome.follower:
        return 0  # rank 0 stores, reports and sets the exit code
    if outcome.interrupted:
        again = resume_command(args, outcome.run_id)
        print(f"interrupted: {outcome.jobs} jobs stored in {outcome.path}; resume with:\n  {again}", file=sys.stderr)
        return 130
    print(f"{outcome.jobs} jobs, {outcome.rows} rows -> {outcome.path}")
    if outcome.aborted:
        print(
            f"kdbench: the run stopped after {outcome.aborted}\n  its rows are stored; continue after it with: "
            f"{resume_command(args, outcome.run_id)}",
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
    checks = api.budget_checks([outcome.path], args.judge_contended) if stored else []
    missed = _budgets(checks)
    outcome.spent("budget checks", time.perf_counter() - began)
    if outcome.failed or outcome.aborted:
        print(f"{len(outcome.failed)} job(s) had failures:", file=sys.stderr)
        for label in outcome.failed:
            print(f"  {label}", file=sys.stderr)
    if outcome.failed or outcome.aborted or missed:
        return 1
    return _unjudged_budgets(checks, args.allow_unjudged)


def _unjudged_budgets(checks, allow: bool) -> int:
    """EXIT_NOT_JUDGED when the suite has budgets and none of their checks was judged (every one contended, thin
    or skipped): budgets that judged nothing must not pass a CI gate, unless --allow-unjudged; else 0."""
    from kdbench.config.budgets import judged_none
    from kdbench.core.errors import EXIT_NOT_JUDGED

    if not judged_none(checks):
        return 0
    if allow:
        print("budgets: none was judged (--allow-unjudged: exit 0)")
        return 0
    print(
        f"budgets: none of {len(checks)} checks was judged (rows contended, thin or skipped): exit {EXIT_NOT_JUDGED}, "
        "not judged; measure on a quieter machine, or pass --allow-unjudged to exit 0",
        file=sys.stderr,
    )
    return EXIT_NOT_JUDGED


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
    from kdbench.hw.backends import detect
    from kdbench.run.jobs import CellJob
    from kdbench.workloads import planned_measurements

    plan = api.plan(suite, options.shard, options.device)
    requested = options.device or suite.backend
    d = detect()
    here = (
        "available here"
        if requested in ("auto", "cpu") or d.best == requested
        else f"NOT available here: {d.describe()}"
    )
    device_type = "cpu" if (d.best if requested == "auto" else requested) == "cpu" else "cuda"
    n_rows = 0
    for job in plan.jobs:
        if isinstance(job, CellJob) and job.repeat > 1:
            continue  # the same cells again, in later rounds
        if isinstance(job, CellJob):
            n_rows += len(planned_measurements(job.cell.config))
            inf = ",".join(str(b) for b in job.cell.config.inference.batch_sizes) or "-"
            host = _host_line(job.cell.config, device_type, suite.launcher.nnodes, here == "available here")
            print(f"{job.cell.index + 1:4d}  {job.job_id}  {job.label}  (inference bs {inf}; {host})")
        else:
            print(f"after the cells, {job.describe()}")
    cells = sum(isinstance(j, CellJob) and j.repeat == 1 for j in plan.jobs)
    times = f" x {suite.repeat} repeats" if suite.repeat > 1 else ""
    print(f"{cells} cells, {n_rows} measurements{times}; suite '{suite.name}', backend {requested} ({here})")
    from kdbench.run.plan import warn_cell_notes

    warn_cell_notes(plan)  # a choice the user may not have meant (uld on one tokenizer)
    if here == "available here":  # the plan-time warnings a run would print (slow precisions, missing packages)
        from kdbench.hw.backends import resolve
        from kdbench.run.plan import warn_environment_skips, warn_slow_cells
        from kdbench.store.results import PROBES_DIR

        backend = resolve(requested)
        skip = suite.slow_precisions == "skip"
        warn_slow_cells(plan, backend, options.out_dir / PROBES_DIR, suite.threads, skip)
        warn_environment_skips(plan, backend)
    return 0


def _host_line(config, device_type: str, nnodes: int, here: bool) -> str:
    """A cell's host figure per rank, and, where its backend is this machine's, whether the host can hold it; then
    the floor of its step's peak per device (:func:`kdbench.fit.floor.floor_words`: no fake run), flagged where it
    is over what this machine's device has."""
    from kdbench.fit.floor import floor_words
    from kdbench.run.plan import host_memory, host_refusal, ranks_on_node
    from kdbench.workloads import workload_of

    line = workload_of(config).host_footprint(config, device_type).summary(config.world_size)
    if here:
        available, total = host_memory()
        if host_refusal(config, device_type, ranks_on_node(config.world_size, nnodes), available, total):
            line += ": more than this machine has available, a run here skips it"
    return line + floor_words(config, device_type, here)


def cmd_report(args: argparse.Namespace) -> int:
    from kdbench import api

    print(f"report -> {api.render(args.results, args.out, baseline=args.baseline, threshold=args.threshold / 100)}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from kdbench import api
    from kdbench.report.compare.format import render, verdict_line
    from kdbench.report.compare.verdicts import Policy
    from kdbench.store.files import write_text

    policy = Policy(
        args.gate_single_repeat,
        args.allow_partial,
        args.fail_on_skipped,
        args.judge_contended,
        max_loss_err=args.max_loss_err,
        gate_loss_err=args.gate_loss_err,
        allow_unjudged=args.allow_unjudged,
    )
    cmp = api.compare(
        args.base,
        args.new,
        args.threshold / 100,
        args.confidence,
        policy,
        args.rerun_undecided or 0,
        args.rerun_sides,
        args.base_code,
    )
    text = render(cmp, args.format)
    if args.out is None:
        print(text, end="")
    else:
        write_text(text, args.out)
        print(f"{verdict_line(cmp)}; comparison -> {args.out}")
    for c in cmp.bad:
        print(f"{c.verdict}: {c.name}: {c.note or f'x{c.ratio:.3f}'}", file=sys.stderr)
    for f in cmp.inaccurate:
        print(f"improved beyond --max-loss-err {args.max_loss_err:g}: {f.text()}", file=sys.stderr)
    return cmp.exit_code


def cmd_export(args: argparse.Namespace) -> int:
    from kdbench.report.export import write_export
    from kdbench.store import read_results

    text = write_export(read_results(args.results), args.format, args.out)
    if args.out is None:
        print(text, end="")
    else:
        print(f"{args.format} -> {args.out}")
    return 0


def cmd_env(_args: argparse.Namespace) -> int:
    from kdbench.core.install import check_install

    check_install(transformers=True)
    from kdbench.hw.environment import describe_lines

    print("\n".join(describe_lines()))
    print("(tf32_* and float32_matmul_precision are this process's torch defaults: a run sets them per measurement)")
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    from kdbench.core.install import check_install

    check_install()
    import torch

    from kdbench.hw.backends import resolve, thread_count
    from kdbench.measure.probe import measure_ceilings, probe_env
    from kdbench.measure.probe_classes import measure_classes
    from kdbench.store.probes import write_probe
    from kdbench.store.results import PROBES_DIR

    backend = resolve(args.device)
    with thread_count(args.threads):
        env = probe_env(backend)  # records the thread count the probe runs with
        print(f"probing {backend.name} ({env['device_name']}), {torch.get_num_threads()} CPU threads ...")
        rows = measure_ceilings(backend, matmul_n=args.size, min_time_s=args.min_time)
        rows += measure_classes(backend)  # what the step-time model prices each operator class with
    for r in rows:
        value = f"{r['value']:.3f} {r['unit']}" if r["value"] is not None else f"unavailable ({r.get('error')})"
        print(f"  {r['kind']:12s} {r['dtype']:13s} size {r['size']}: {value}")
    print(f"probe -> {write_probe(rows, env, args.out / PROBES_DIR)}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    {"models": _list_models, "methods": _list_methods, "suites": _list_suites, "loss_impls": _list_loss_impls}[
        args.what
    ]()
    return 0


def _list_models() -> None:
    from kdbench.config.schema import DataConfig
    from kdbench.models.catalogue import CALLABLE_NOTE, CONFIG_JSON_NOTE, families, shape_text, tokens_text

    data = DataConfig()  # the cell defaults the image classifiers are counted at
    for family in families(data.num_classes, tuple(data.shape)):
        if family.name == "torchvision":  # ImageNet classifiers: names only (building 80 of them takes seconds)
            print(f"{family.name} ({len(family.models)}): {', '.join(family.models)}")
            continue
        at = f"at {family.num_classes} classes, {shape_text(family.shape)}" if family.shape else "as registered"
        print(f"{family.name} ({len(family.models)}): {family.title}, parameters {at}:")
        for name in family.models:
            tokens = family.tokens(name)
            sizes = f"  {tokens_text(tokens)}" if tokens else ""
            print(f"  {name:<20} {family.parameters(name) / 1e6:8.2f} M{sizes}")
    print(
        "positions: a model's max_position_embeddings; data.seq_len (with an LM's serving rows, + "
        "inference.decode_tokens) must not exceed them, checked before a run"
    )
    print(CONFIG_JSON_NOTE)
    print(CALLABLE_NOTE)


def _list_methods() -> None:
    from kdbench.distill.losses import METHODS

    for m in METHODS.values():
        params = ", ".join(f"{k}={v}" for k, v in m.params().model_dump().items())
        feats = " (feature method: hooks on `features.teacher` / `features.student`)" if m.cls.needs_features else ""
        print(f"{m.name}: {m.doc}{feats}\n    suite key `{m.name}`: {params}")
    print("a+b: any combination, e.g. kd+at; CE counted once; `weights: {kd: 1.0, at: 1.0}` scales each term")


def _list_suites() -> None:
    from kdbench import api
    from kdbench.config.suite_times import default_machine

    suites = api.shipped_suites()
    usual = default_machine({s.file: s.time for s in suites if s.time})
    on = f" on a {usual}, unless said" if usual else ""
    print(f"{len(suites)} suites in {api.SUITES_DIR}; CPU: the wall time of `kdbench run SUITE --device cpu`{on}")
    for s in suites:
        then = ", then the quality job" if s.quality else ""
        print(f"{s.file} ({s.name}): {s.cells} cells{then}; {s.description}")
        if s.time is None:
            print("    CPU: no entry in suites/times.toml")
            continue
        print(f"    CPU: {s.time.cpu_line()}")
        if s.time.gpu:
            print(f"    one GPU: {s.time.gpu} (estimate)")


def _list_loss_impls() -> None:
    import sys

    from kdbench.distill.lm.impls import LOSS_IMPLS, computes, unavailable
    from kdbench.distill.lm.impls.base import get_impl

    print("LM loss implementations (`loss_impl`), all equal to dense in loss and gradients; each computes CE and:")
    for name in LOSS_IMPLS:
        impl = get_impl(name)
        doc = " ".join((sys.modules[impl.compute.__module__].__doc__ or "").replace("``", "`").split())
        what = doc.split(": ", 1)[-1].split(". ")[0].rstrip(".")
        missing = unavailable(name)
        here = f"not here: {missing}" if missing else "available here"
        print(f"{name}: {what}")
        print(f"    divergences: {', '.join(computes(name))}")
        print(f"    needs: {impl.needs or 'nothing beyond kdbench [lm]'} ({here})")


# --------------------------------------------------------------------------- fit

# --pair's cell options: argument -> (flag, the cell key's path)
_PAIR_OPTIONS = {
    "method": ("--method", ("method",)),
    "batch_size": ("--batch-size", ("batch_size",)),
    "seq_len": ("--seq-len", ("data", "seq_len")),
    "precision": ("--precision", ("precision",)),
    "teacher_precision": ("--teacher-precision", ("teacher_precision",)),
    "teacher_weights": ("--teacher-weights", ("teacher", "weights")),
    "loss_impl": ("--loss-impl", ("loss_impl",)),
    "chunk_size": ("--chunk-size", ("chunk_size",)),
    "world_size": ("--world-size", ("world_size",)),
    "parallel": ("--parallel", ("parallel",)),
}


def cmd_fit(args: argparse.Namespace) -> int:
    """Check the flags, then print :func:`kdbench.api.fit`'s report line by line and write its JSON record."""
    import json

    from kdbench import api
    from kdbench.core.errors import KdbenchError
    from kdbench.fit.cost import steps_budget
    from kdbench.fit.devices import find_device, sized_device

    devices = []
    for name in args.gpu or ():
        d = find_device(name)
        if all(d.name != other.name for other in devices):  # H100 and h100-80gb are one device
            devices.append(d)
    if args.device_memory:
        devices = [sized_device(args.device_memory)]
    if args.max and not devices:
        raise KdbenchError(f"--max {args.max}: needs a device to fit into; add --gpu NAME or --device-memory SIZE")
    given = [flag for dest, (flag, _) in _PAIR_OPTIONS.items() if getattr(args, dest) is not None]
    if args.suite is not None and args.pair:
        raise KdbenchError(f"fit {args.suite} --pair: give a suite or --pair TEACHER STUDENT, not both")
    if args.suite is None and not args.pair:
        raise KdbenchError(
            "fit: give a suite file (kdbench fit SUITE) or one pair (kdbench fit --pair TEACHER STUDENT)"
        )
    if args.suite is not None and given:
        raise KdbenchError(f"{given[0]}: sets the cell of --pair; a suite's cells are set in the suite (or use --pair)")
    budget = args.tokens if args.tokens is not None else steps_budget(args.steps) if args.steps else None
    prices = _prices(args.price or [], devices, budget)
    cells = args.suite if args.suite is not None else [_pair_cell(args)]
    report = api.fit(
        cells, devices or None, args.max, bool(args.allow_imports), talk=lambda line: print(line, flush=True),
        budget=budget, prices=prices, progress=lambda line: print(line, file=sys.stderr, flush=True),
        epochs=args.epochs,
    )  # fmt: skip
    if args.out is not None:
        from kdbench.store.files import write_text

        write_text(json.dumps(report.record(), indent=1) + "\n", args.out)
        print(f"predictions -> {args.out}")
    return 0


def _prices(given: list, devices: list, budget) -> dict[str, float]:
    """``--price`` as {card name: USD per device-hour}: a bare price is the one --gpu's; a named one must be one of
    the --gpu devices.  Each mistake names the flag and the fix."""
    from kdbench.core.devices import find_card
    from kdbench.core.errors import KdbenchError, did_you_mean

    if not given:
        return {}
    if budget is None:
        raise KdbenchError(f"--price {given[0][2]}: prices a budget's device-hours; add --tokens N or --steps N")
    gpus = [d for d in devices if d.card is not None]
    names = ", ".join(d.name for d in gpus) or "none"
    out: dict[str, float] = {}
    for name, usd, text in given:
        if name is None:
            if len(gpus) != 1:
                raise KdbenchError(
                    f"--price {text}: a bare price is the one --gpu's, and {len(gpus)} are given ({names}); write "
                    f"--price DEVICE={text}"
                )
            card = gpus[0].card
        else:
            card = find_card(name)
            if card is None:
                close = did_you_mean(name.strip().upper(), [d.card.name for d in gpus], cutoff=0.5)
                raise KdbenchError(f"--price {text}: unknown device {name!r}; {close}the --gpu devices: {names}")
            if all(d.card is not card for d in gpus):
                raise KdbenchError(
                    f"--price {text}: {card.name} is not one of the --gpu devices ({names}); add --gpu {name} or "
                    "leave its price out"
                )
        out[card.name] = usd
    return out


def _pair_cell(args: argparse.Namespace):
    """The one cell of --pair (a plan's :class:`kdbench.config.plan.Cell`): the schema's defaults, the pair's
    family's own (token data, its method), the options."""
    from pydantic import ValidationError

    from kdbench.cli.fit_flags import lm_pair_defaults
    from kdbench.config.plan import Cell, cell_id_of, deep_merge, nest
    from kdbench.config.schema import CellConfig
    from kdbench.config.yaml_errors import describe
    from kdbench.core.errors import KdbenchError
    from kdbench.workloads.registry import check_cell, workload_of

    teacher, student = args.pair
    raw: dict = {"pair": {"teacher": teacher, "student": student}}
    raw = deep_merge(raw, workload_of(CellConfig.model_validate(raw)).cell_defaults)
    values = {dest: getattr(args, dest) for dest in _PAIR_OPTIONS}
    added, said = lm_pair_defaults(workload_of(CellConfig.model_validate(raw)).takes, values)
    values.update(added)  # an LM pair as it is run: bf16 (kdbench.cli.fit_flags), said first
    if said:
        print(said, flush=True)
    if values["teacher_weights"] is not None and values["teacher_precision"] is None:
        values["teacher_precision"] = values["teacher_weights"]  # a teacher held in bf16 computes in bf16
    for dest, value in values.items():
        if value is not None:
            raw = deep_merge(raw, nest(_PAIR_OPTIONS[dest][1], value))
    flags = {path: flag for flag, path in _PAIR_OPTIONS.values()}
    try:
        config = CellConfig.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        flag = flags.get(tuple(str(p) for p in err["loc"]), "--pair")
        raise KdbenchError(f"{flag}: {describe(err, CellConfig)}") from None
    for path, message in check_cell(config, args.allow_imports):
        flag = flags.get(
            tuple(path), "--pair" if path and path[0] == "pair" else "--" + "-".join(path).replace("_", "-")
        )
        raise KdbenchError(f"{flag}: {message}")
    return Cell(0, cell_id_of(config), config)
