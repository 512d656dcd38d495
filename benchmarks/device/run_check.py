"""Run benchmarks/gpu_check.py on a bare GPU box without network, with the box's own python and torch.

    python3 benchmarks/device/run_check.py --check                 # what the box lacks (for fetch_wheels --only)
    python3 benchmarks/device/run_check.py --timeout 540 -- --quick

It finds which of kdbench's dependencies (pyproject.toml [project] dependencies) the box's python
cannot import, or has too old, installs those from the wheels folder (fetch_wheels.py fills it on a
machine with a registry) into a private target folder -- `pip install --no-index --no-deps --target`,
or where the box has no pip, by unpacking the wheels there -- never touching site-packages, and runs
`python benchmarks/gpu_check.py --out OUT ARGS...` with PYTHONPATH=TARGET:<checkout> (so kdbench is
imported from this checkout, uninstalled). torch and torchvision are the box's own: never installed;
where either is missing the runner says so and stops. kdbench's lm and liger extras (transformers,
liger-kernel), which gpu_check's LM stage uses, are optional: installed from the wheels folder like the
rest where the box lacks them and a wheel is there; otherwise the runner says so and the stage runs
without them, saying so (without liger-kernel its liger cell is skipped with the reason; without
transformers its checks fail, naming the missing extra).

The whole run, the dependency check and install included, is held to --timeout seconds: at the
deadline gpu_check's process group (it runs in a session of its own) gets SIGTERM (gpu_check ends
its stage and writes its files), --grace seconds later SIGKILL, and the runner exits 124; so it
ends within --timeout + --grace (540 + 10 s by default). gpu_check's output is printed as it comes
and kept, with the runner's own lines, in OUT/runner.log; OUT/runner.json sums the run up. Exit
code: gpu_check's; 124 on timeout; 2 where the check could not be started (torch missing, a wheel
missing, a bad argument).

KDBENCH_DEVICE_PRETEND_MISSING=jinja2,markupsafe (a test hook) has the runner treat those
distributions as absent from the box, so the install path can be tried on a machine that has them.
Standard library only, Python 3.9+, POSIX. Its parts, beside this command: _device_box.py (what the box has),
_device_install.py (the wheels to install, and installing them into the target), _device_child.py (the deadline,
the log and the check's process group) and _device_common.py (shared with fetch_wheels.py: requirements,
versions, markers, wheels).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from _device_box import (
    PRETEND_ENV,
    assess,
    describe_box,
    describe_optional,
    pretended_missing,
    probe,
    suggested_platform,
)
from _device_child import TIMED_OUT, Deadline, Interrupted, Log, SetupError, TimedOut, run_child
from _device_common import (
    BOX_OWN,
    HERE,
    ROOT,
    import_name,
    project_dependencies,
    project_extras,
    project_requires_python,
    read_wheels,
    satisfies,
)
from _device_install import manifest_target, pip_install, plan_install, prepare_target, unzip_install

DEFAULT_WHEELS = HERE / "wheels"
DEFAULT_TARGET = HERE / ".deps"
DEFAULT_SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
NOT_STARTED = 2
KILL_GRACE_S = 10.0


def _split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1 :]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    own, passed = _split_argv(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Arguments after -- go to gpu_check.py unchanged."
    )
    parser.add_argument("--check", action="store_true", help="print what the box lacks and exit 0")
    parser.add_argument("--out", type=Path, default=Path("gpu-check-out"), help="gpu_check's --out, and runner.log")
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds for the whole run (default 540)")
    parser.add_argument(
        "--grace",
        type=float,
        default=KILL_GRACE_S,
        help="seconds from the SIGTERM at --timeout to the SIGKILL (default %(default)g)",
    )
    parser.add_argument("--wheels", type=Path, default=DEFAULT_WHEELS, help="the wheels folder (default: %(default)s)")
    parser.add_argument("--target", type=Path, default=DEFAULT_TARGET, help="the private install folder")
    parser.add_argument("--installer", choices=["auto", "pip", "unzip"], default="auto", help="auto: pip if present")
    parser.add_argument("--python", default=sys.executable, help="the box's python (default: the one running this)")
    parser.add_argument("--script", type=Path, default=DEFAULT_SCRIPT, help="the check to run (default: gpu_check.py)")
    parser.add_argument("--skip-deps", action="store_true", help="neither check nor install dependencies")
    args = parser.parse_args(own)
    if any(a == "--out" or a.startswith("--out=") for a in passed):
        parser.error("give --out before --: the runner passes it on to gpu_check and keeps runner.log there")
    if args.check and args.skip_deps:
        parser.error("--check checks the dependencies: leave out --skip-deps")
    if args.timeout <= 0 or args.grace < 0:
        parser.error("--timeout must be positive and --grace not negative")

    started = time.time()
    deadline = Deadline(args.timeout)
    log = Log()
    out = args.out.resolve()
    target = args.target.resolve()
    summary: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv, "out": str(out)}

    def handle(signum, frame):
        raise Interrupted(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handle)

    code = NOT_STARTED
    try:
        if not args.check:
            out.mkdir(parents=True, exist_ok=True)
            log.open(out / "runner.log")
            log.say(f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(sys.argv)}")
        code = _run(args, passed, deadline, log, out, target, summary)
    except SetupError as exc:
        log.say(str(exc))
        code = NOT_STARTED
    except TimedOut:
        log.say(f"timed out after {args.timeout:.0f} s before gpu_check ran")
        code = TIMED_OUT
        summary["timed_out"] = True
    except Interrupted as exc:
        log.say(f"stopped by signal {exc.signum}")
        code = 128 + exc.signum
    except KeyboardInterrupt:
        log.say("interrupted")
        code = 130
    finally:
        if not args.check:
            summary.update(exit_code=code, elapsed_s=round(time.time() - started, 1))
            summary.setdefault("timed_out", code == TIMED_OUT)
            try:
                (out / "runner.json").write_text(json.dumps(summary, indent=2) + "\n")
            except OSError:
                pass
            log.say(f"exit {code} after {time.time() - started:.0f} s; output in {out}")
        log.close()
    return code


def _run(args, passed: list[str], deadline: Deadline, log: Log, out: Path, target: Path, summary: dict) -> int:
    pythonpath = [str(ROOT)]
    if not args.skip_deps:
        requirements = project_dependencies()
        optional = [r for r in project_extras() if r.name not in {q.name for q in requirements}]
        pretend = pretended_missing()
        if pretend:
            log.say(f"{PRETEND_ENV}: treating {' '.join(sorted(pretend))} as absent from the box (a test hook)")
        imports = [(r.name, import_name(r.name)) for r in requirements + optional]
        box = probe(args.python, imports, [], deadline, dists=True)
        problems = assess(requirements + optional, box, pretend)
        describe_box(box, requirements, problems, log.say)
        describe_optional(box, optional, problems, log.say)
        missing = [r.name for r in requirements if problems[r.name] and r.name not in BOX_OWN]
        optional_missing = [r.name for r in optional if problems[r.name]]
        own_missing = [r.name for r in requirements if r.name in BOX_OWN and not box["modules"][r.name].get("ok")]
        summary.update(python=box["python"], torch=box["modules"].get("torch"), missing=missing)
        summary.update(optional_missing=optional_missing)
        version = "{}.{}".format(*box["python"]["version"][:2])
        needs = project_requires_python()
        too_old = (
            ""
            if satisfies(".".join(map(str, box["python"]["version"])), needs)
            else (
                f"kdbench needs Python {needs} (pyproject.toml requires-python); this one is {version}: "
                "gpu_check cannot run with it"
            )
        )
        fetch = (
            f"python benchmarks/device/fetch_wheels.py --python-version {version} "
            f"--platform {suggested_platform(box['python'])} --only {' '.join(missing + optional_missing)}"
        )
        if args.check:
            if too_old:
                log.say(too_old)
            if own_missing:
                log.say(f"the box must bring its own {' and '.join(own_missing)}: these scripts never install them")
            if (missing or optional_missing) and not too_old:
                log.line(
                    "fetch them where pip reaches a registry, then copy benchmarks/device/wheels here:\n  " + fetch
                )
            if optional_missing:
                log.line(f"missing for gpu_check's LM stage (optional): {' '.join(optional_missing)}")
            log.line(f"missing: {' '.join(missing) if missing else '(none)'}")
            return 0
        if too_old:
            raise SetupError(too_old)
        if own_missing:
            raise SetupError(
                f"cannot run: the box's python has no working {' or '.join(own_missing)}. Install the box's own "
                "torch and a torchvision built for it; these scripts never install either."
            )
        for name in BOX_OWN:
            if problems.get(name):
                log.say(f"warning: {name}: {problems[name]}; running anyway with the box's own")
        wheels = read_wheels(args.wheels)
        chosen, optional_chosen = [], []
        if missing:
            chosen, warnings, errors = plan_install(missing, requirements, wheels, box, pretend)
            for warning in warnings:
                log.say(f"warning: {warning}")
            if errors:
                for error in errors:
                    log.say(f"missing wheel: {error}")
                fetched_for = manifest_target(args.wheels)
                if fetched_for:
                    log.say(f"{args.wheels} was fetched for {fetched_for} (MANIFEST.txt)")
                raise SetupError(f"fetch them into {args.wheels} where pip reaches a registry:\n  {fetch}")
        if optional_missing:
            optional_chosen, warnings, errors = plan_install(optional_missing, optional, wheels, box, pretend)
            for warning in warnings + errors:  # optional: the LM stage runs without them and says so
                log.say(f"warning: {warning} (gpu_check's LM stage runs without it and says so)")
            unplanned = {w.name for w in optional_chosen}
            if not set(optional_missing) <= unplanned:
                log.say(f"  to bring them: {fetch}")
        to_install = list({w.name: w for w in chosen + optional_chosen}.values())
        if to_install:
            log.say(f"installing into {target}: {' '.join(w.path.name for w in to_install)}")
            prepare_target(target)
            installer = args.installer
            if installer == "auto":
                installer = "pip" if box["python"]["pip"] else "unzip"
            if installer == "pip" and not pip_install(args.python, to_install, args.wheels, target, deadline, log):
                log.say("pip install failed; unpacking the wheels instead")
                installer = "unzip"
            if installer == "unzip":
                unzip_install(to_install, target)
            summary.update(installed=[w.path.name for w in to_install], installer=installer)
            # What gpu_check will see: the installed distributions first, from the target.
            installed = {w.name for w in to_install}
            checked = [r for r in requirements + optional if r.name in missing or r.name in installed]
            after = probe(
                args.python,
                [(r.name, import_name(r.name)) for r in checked],
                [str(target), str(ROOT)],
                deadline,
                dists=False,
            )
            still = assess(checked, after, set())
            for req in checked:
                entry = after["modules"][req.name]
                if still[req.name]:
                    log.say(f"  FAILED   {req.name}: {still[req.name]}")
                else:
                    where = entry.get("file") or "?"
                    note = "" if where.startswith(str(target)) else f" (not from {target}!)"
                    log.say(f"  ok       {req.name} {entry.get('version')} from {where}{note}")
            if any(still[name] for name in missing):
                raise SetupError("cannot run: the installed wheels do not import (see above)")
            pythonpath.insert(0, str(target))
    elif target.is_dir():
        pythonpath.insert(0, str(target))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.pop(PRETEND_ENV, None)
    command = [args.python, str(args.script.resolve()), "--out", str(out), *passed]
    log.say(f"PYTHONPATH={env['PYTHONPATH']}")
    log.say(f"$ {' '.join(command)}  (time left: {deadline.left():.0f} s)")
    summary["command"] = command
    if deadline.left() <= 0:
        raise TimedOut
    code, timed_out = run_child(command, env, deadline, log, args.grace)
    summary["timed_out"] = timed_out
    return code


if __name__ == "__main__":
    sys.exit(main())
