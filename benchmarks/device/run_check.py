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
Standard library only, Python 3.9+, POSIX.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

from _device_common import (
    BOX_OWN,
    HERE,
    ROOT,
    Wheel,
    import_name,
    marker_applies,
    normalize,
    project_dependencies,
    project_extras,
    project_requires_python,
    read_wheels,
    satisfies,
    version_key,
    wheel_fits,
    wheel_requirements,
)

PRETEND_ENV = "KDBENCH_DEVICE_PRETEND_MISSING"
DEFAULT_WHEELS = HERE / "wheels"
DEFAULT_TARGET = HERE / ".deps"
DEFAULT_SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
TIMED_OUT = 124
NOT_STARTED = 2
KILL_GRACE_S = 10.0

# Run by the box's python (any 3.9+), with the PYTHONPATH under test: imports each module, reports
# its version and file, the interpreter's tags and marker environment, and the installed distributions.
PROBE = r"""
import importlib, json, os, platform, re, sys
try:
    from importlib import metadata
except ImportError:
    metadata = None
request = json.loads(sys.argv[1])

def version(dist, module):
    try:
        return metadata.version(dist)
    except Exception:
        return getattr(module, "__version__", None)

iv = sys.implementation.version
env = {
    "implementation_name": sys.implementation.name,
    "implementation_version": "%d.%d.%d" % (iv.major, iv.minor, iv.micro),
    "os_name": os.name, "platform_machine": platform.machine(), "platform_release": platform.release(),
    "platform_system": platform.system(), "platform_version": platform.version(),
    "python_full_version": platform.python_version(),
    "platform_python_implementation": platform.python_implementation(),
    "python_version": ".".join(platform.python_version_tuple()[:2]), "sys_platform": sys.platform,
}
try:
    import importlib.util
    has_pip = importlib.util.find_spec("pip") is not None
except Exception:
    has_pip = False
result = {
    "python": {
        "executable": sys.executable, "version": list(sys.version_info[:3]),
        "implementation": sys.implementation.name, "abiflags": getattr(sys, "abiflags", ""),
        "machine": platform.machine(), "libc": list(platform.libc_ver()), "pip": has_pip, "markers": env,
    },
    "modules": {}, "dists": {},
}
for dist, name in request["imports"]:
    try:
        module = importlib.import_module(name)
        entry = {"ok": True, "version": version(dist, module), "file": getattr(module, "__file__", None)}
        if name == "torch":
            entry["cuda"] = getattr(module.version, "cuda", None)
            entry["hip"] = getattr(module.version, "hip", None)
    except BaseException as exc:
        entry = {"ok": False, "error": "%s: %s" % (type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")}
    result["modules"][dist] = entry
if request["dists"] and metadata is not None:
    for d in metadata.distributions():
        name = d.metadata["Name"]
        if name:
            result["dists"].setdefault(re.sub(r"[-_.]+", "-", name).lower(), d.version)
with open(request["out"], "w") as f:
    json.dump(result, f)
"""


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.seconds = seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())


class TimedOut(Exception):
    pass


class SetupError(Exception):
    """The check cannot be started; the message says why."""


class Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class Log:
    """The runner's lines and the child's output, to stdout and (once opened) OUT/runner.log."""

    def __init__(self) -> None:
        self.file = None
        self.lock = threading.Lock()

    def open(self, path: Path) -> None:
        self.file = open(path, "wb", buffering=0)  # noqa: SIM115 (closed in main's finally)

    def write(self, data: bytes) -> None:
        with self.lock:
            try:
                sys.stdout.buffer.write(data)
                sys.stdout.flush()
            except (OSError, ValueError):
                pass
            if self.file is not None:
                self.file.write(data)

    def say(self, text: str) -> None:
        self.write("".join(f"[run_check] {line}\n" for line in text.splitlines() or [""]).encode())

    def line(self, text: str) -> None:
        self.write((text + "\n").encode())

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def pretended_missing() -> set[str]:
    return {normalize(n) for n in os.environ.get(PRETEND_ENV, "").replace(",", " ").split()}


def probe(python: str, imports: list[tuple[str, str]], pythonpath: list[str], deadline: Deadline, dists: bool) -> dict:
    """Import each (distribution, module) in a fresh interpreter with pythonpath ahead of its own path.
    Where the interpreter dies (a crashing extension), each module is tried alone to tell which."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, *filter(None, [os.environ.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix="kdbench-probe-") as tmp:
        out = Path(tmp) / "probe.json"

        def once(these: list[tuple[str, str]]) -> dict:
            request = json.dumps({"imports": these, "dists": dists, "out": str(out)})
            if deadline.left() <= 0:
                raise TimedOut
            try:
                done = subprocess.run(
                    [python, "-c", PROBE, request],
                    cwd=tmp,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    timeout=deadline.left(),
                    check=False,
                )
            except subprocess.TimeoutExpired:
                raise TimedOut from None
            except OSError as exc:
                raise SetupError(f"cannot run {python}: {exc}") from None
            if done.returncode != 0 or not out.is_file():
                return {"crash": done.returncode, "stderr": done.stderr.decode(errors="replace")[-2000:]}
            result = json.loads(out.read_text())
            out.unlink()
            return result

        result = once(imports)
        if "crash" not in result:
            return result
        bare = once([])
        if "crash" in bare:
            raise SetupError(f"{python} could not run the dependency probe:\n{bare['stderr']}")
        for dist, module in imports:
            alone = once([(dist, module)])
            if "crash" in alone:
                error = f"importing {module} killed python (exit {alone['crash']}): {alone['stderr'][-300:]}"
                bare["modules"][dist] = {"ok": False, "error": error}
            else:
                bare["modules"].update(alone["modules"])
        return bare


def assess(requirements, box: dict, pretend: set[str]) -> dict[str, str]:
    """Distribution -> why it is not usable on the box ('' where it is)."""
    problems = {}
    for req in requirements:
        entry = box["modules"].get(req.name, {})
        if req.name in pretend:
            problems[req.name] = f"missing (pretended: {PRETEND_ENV})"
        elif not entry.get("ok"):
            problems[req.name] = f"cannot import {import_name(req.name)}: {entry.get('error', '?')}"
        elif not satisfies(entry.get("version"), req.specifier):
            problems[req.name] = f"too old or too new: {entry.get('version')} does not meet {req.specifier}"
        else:
            problems[req.name] = ""
    return problems


def describe_box(box: dict, requirements, problems: dict[str, str], say) -> None:
    py = box["python"]
    libc = " ".join(py["libc"]) or "unknown libc"
    say(
        f"python {'.'.join(map(str, py['version']))} ({py['implementation']}{py['abiflags']}, {py['machine']}, {libc}) "
        f"at {py['executable']}; pip {'present' if py['pip'] else 'absent'}"
    )
    for req in requirements:
        entry = box["modules"].get(req.name, {})
        problem = problems[req.name]
        own = " (the box's own; never installed here)" if req.name in BOX_OWN else ""
        if not problem:
            extra = ""
            if req.name == "torch":
                extra = f", cuda {entry.get('cuda')}, hip {entry.get('hip')}"
            say(f"  ok       {req.name} {entry.get('version')}{extra}{own}")
        else:
            label = "WRONG   " if entry.get("ok") and req.name not in pretended_missing() else "MISSING "
            say(f"  {label} {req.name}{req.specifier}: {problem}{own}")


def describe_optional(box: dict, optional, problems: dict[str, str], say) -> None:
    """The LM stage's packages (kdbench's lm and liger extras): optional, each with what the box has."""
    for req in optional:
        entry = box["modules"].get(req.name, {})
        if not problems[req.name]:
            say(f"  ok       {req.name} {entry.get('version')} (optional: gpu_check's LM stage)")
        else:
            say(f"  OPTIONAL {req.name}{req.specifier}: {problems[req.name]} (gpu_check's LM stage)")


def suggested_platform(py: dict) -> str:
    libc, version = py["libc"] if py["libc"] else ["", ""]
    parts = version.split(".")
    if libc == "glibc" and len(parts) >= 2 and parts[1].isdigit():
        return f"manylinux_{parts[0]}_{parts[1]}_{py['machine']}"
    return f"manylinux2014_{py['machine']}"


def plan_install(missing: list[str], requirements, wheels: list[Wheel], box: dict, pretend: set[str]):
    """The wheels to install: those of the missing distributions and, through their Requires-Dist,
    of what they need that the box lacks. Returns (wheels, warnings, errors)."""
    py = box["python"]
    have = {name: version for name, version in box["dists"].items() if name not in pretend}
    specs = {r.name: r.specifier for r in requirements}
    fitting: dict[str, list[Wheel]] = {}
    unfit: dict[str, list[Wheel]] = {}
    for wheel in wheels:
        (fitting if wheel_fits(wheel, py) else unfit).setdefault(wheel.name, []).append(wheel)
    chosen: dict[str, Wheel] = {}
    warnings: list[str] = []
    errors: list[str] = []
    queue = [(name, specs.get(name, ""), None) for name in missing]
    while queue:
        name, spec, wanted_by = queue.pop(0)
        if name in chosen or name in BOX_OWN:
            continue
        if wanted_by is not None and name in have and satisfies(have[name], spec):
            continue
        candidates = sorted(fitting.get(name, []), key=lambda w: version_key(w.version), reverse=True)
        good = [w for w in candidates if satisfies(w.version, spec)]
        if not good:
            what = f"{name}{spec}" + (f" (needed by {wanted_by})" if wanted_by else "")
            if unfit.get(name):  # fetched for another python or platform: needed, and unusable here
                errors.append(f"{what}: the wheels there do not fit this python: {_names(unfit[name])}")
            elif candidates:
                errors.append(f"{what}: no version meeting {spec} there: {_names(candidates)}")
            elif wanted_by:  # pip did not fetch it for the box's python: presumably not needed there
                warnings.append(f"{what}: no wheel of it there")
            else:
                errors.append(f"{what}: no wheel of it there")
            continue
        chosen[name] = good[0]
        for req in wheel_requirements(good[0].path):
            if marker_applies(req.marker, py["markers"]):
                queue.append((req.name, req.specifier, name))
    return list(chosen.values()), warnings, errors


def _names(wheels: list[Wheel]) -> str:
    return ", ".join(w.path.name for w in wheels)


def manifest_target(folder: Path) -> str:
    """'python 3.11, manylinux2014_x86_64' from the wheels folder's MANIFEST.txt ('' where there is none)."""
    try:
        lines = (folder / "MANIFEST.txt").read_text(encoding="utf-8").splitlines()
    except OSError:
        return ""
    fields = dict(line.split(": ", 1) for line in lines if ": " in line and not line.startswith((" ", "#")))
    return f"python {fields.get('python-version', '?')}, {fields.get('platforms', '?')}"


def _clear_previous(target: Path, wheel: Wheel) -> None:
    """Remove what an earlier unpack of the same distribution left in target."""
    with zipfile.ZipFile(wheel.path) as archive:
        tops = {n.split("/", 1)[0] for n in archive.namelist()}
    for top in tops:
        if top.endswith(".data"):
            continue
        path = target / top
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    for info in target.glob("*.dist-info"):
        if normalize(info.name[: -len(".dist-info")].rsplit("-", 1)[0]) == wheel.name:
            shutil.rmtree(info)


TARGET_MARK = ".kdbench-device-target"


def prepare_target(target: Path) -> None:
    """Empty the private install folder (it holds what this run installs, nothing older); refuse a
    non-empty folder this runner did not make."""
    if target.exists():
        entries = [e for e in target.iterdir()]
        if entries and not (target / TARGET_MARK).exists():
            raise SetupError(f"{target} is not empty and was not made by run_check.py: give another --target")
        for entry in entries:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    target.mkdir(parents=True, exist_ok=True)
    (target / TARGET_MARK).write_text("made by benchmarks/device/run_check.py; emptied and refilled by each run\n")


def unzip_install(wheels: list[Wheel], target: Path) -> None:
    """Install by unpacking: what importing needs (the packages, .dist-info, .data/purelib and
    .data/platlib); scripts, headers and data files are left out."""
    target.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        _clear_previous(target, wheel)
        with zipfile.ZipFile(wheel.path) as archive:
            for info in archive.infolist():
                parts = info.filename.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue
                    parts = parts[2:]
                if info.is_dir() or not parts or ".." in parts or info.filename.startswith("/"):
                    continue
                dest = target.joinpath(*parts)
                dest.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(info) as src, open(dest, "wb") as out:
                    shutil.copyfileobj(src, out)
                mode = (info.external_attr >> 16) & 0o777
                if mode:
                    os.chmod(dest, mode | 0o600)


def pip_install(python: str, wheels: list[Wheel], folder: Path, target: Path, deadline: Deadline, log: Log) -> bool:
    command = [python, "-m", "pip", "install", "--no-index", "--find-links", str(folder), "--target", str(target)]
    command += ["--no-deps", "--upgrade", "--disable-pip-version-check", "--no-warn-script-location"]
    command += [str(w.path) for w in wheels]
    log.say("$ " + " ".join(command))
    try:
        done = subprocess.run(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=deadline.left(), check=False
        )
    except subprocess.TimeoutExpired:
        raise TimedOut from None
    log.write(done.stdout)
    return done.returncode == 0


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_child(command: list[str], env: dict, deadline: Deadline, log: Log, grace: float) -> tuple[int, bool]:
    """Run command in a session of its own, its output pumped to log as it comes; at the deadline
    SIGTERM its process group (gpu_check then ends its stage and writes its files), and grace
    seconds later SIGKILL whatever is left of it. Returns (exit code, timed out)."""
    child = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        bufsize=0,
    )
    assert child.stdout is not None
    fd = child.stdout.fileno()

    def pump() -> None:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            log.write(chunk)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        child.wait(timeout=deadline.left())
    except subprocess.TimeoutExpired:
        timed_out = True
        log.write(b"\n")
        log.say(f"timed out after {deadline.seconds:.0f} s: terminating gpu_check's process group {child.pid}")
        _kill_group(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    except BaseException:
        _kill_group(child.pid, signal.SIGTERM)
        time.sleep(0.5)
        _kill_group(child.pid, signal.SIGKILL)
        child.wait()
        raise
    finally:
        # Whatever is left of the group (the check's own helpers, or all of it on a timeout) goes, so
        # nothing outlives the runner or holds the output pipe open.
        if not timed_out:
            reader.join(timeout=2.0)
        _kill_group(child.pid, signal.SIGKILL)
        if child.poll() is None:
            child.wait()
        reader.join(timeout=5.0)
        child.stdout.close()
    if timed_out:
        return TIMED_OUT, True
    code = child.returncode
    if code < 0:  # killed by a signal, not by the runner: the shell's convention
        log.say(f"gpu_check was killed by signal {-code}")
        code = 128 - code
    return code, False


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
