"""What the box has: kdbench's dependencies imported one by one by the box's own python in a fresh interpreter
(:data:`PROBE`, which also reports the interpreter's tags, its marker environment and the installed
distributions), judged against pyproject.toml's requirements and described line by line.

Standard library only, for Python 3.9 and newer (a GPU box's own python).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from _device_child import Deadline, SetupError, TimedOut
from _device_common import BOX_OWN, import_name, normalize, satisfies

PRETEND_ENV = "KDBENCH_DEVICE_PRETEND_MISSING"

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
