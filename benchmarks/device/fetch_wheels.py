"""Fetch the wheels of kdbench's dependencies for a GPU box without network (run it where pip reaches a registry).

    python benchmarks/device/fetch_wheels.py --python-version 3.11
    python benchmarks/device/fetch_wheels.py --python-version 3.12 --platform manylinux_2_28_x86_64 --only pandas pyyaml

It runs `pip download --only-binary=:all: --python-version V --implementation cp --platform P ...`
for [project] dependencies of pyproject.toml (or those named by --only, as `run_check.py --check`
prints them on the box), with their dependencies as pip resolves them for that target, into
--dest (default benchmarks/device/wheels), and writes DEST/MANIFEST.txt. torch, torchvision and triton
are never fetched: the box's own are used. A package that requires them (liger-kernel, for gpu_check's
LM stage) is fetched alone, without its dependencies, with those of its other dependencies the box may
lack; --only takes kdbench's LM extras by name too (transformers, liger-kernel), and a pinned version
(liger-kernel==0.8.5). Only pure-Python (none-any) and manylinux wheels are kept. Standard library only
(Python 3.9+).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from _device_common import (
    BOX_OWN,
    HERE,
    IMPORT_NAMES,
    expand_platforms,
    is_manylinux_or_pure,
    marker_applies,
    parse_requirement,
    parse_wheel,
    project_dependencies,
    project_extras,
    project_requires_python,
    read_wheels,
    satisfies,
    wheel_requirements,
)

DEFAULT_DEST = HERE / "wheels"
DEFAULT_PLATFORM = "manylinux2014_x86_64"
_SAVED = re.compile(r"^\s*(?:Saved|File was already downloaded)\s+(.+\.whl)\s*$", re.M)
_NEEDS_BOX_OWN = re.compile(r"depends on (?:%s)\b|\(constraint\) (?:%s)\b" % (("|".join(BOX_OWN),) * 2))


def python_version(text: str) -> str:
    """'3.11', '311', '3.11.4' -> '3.11'."""
    match = re.match(r"^(\d)\.?(\d+)(?:\.\d+)?$", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: give a version such as 3.11 or 311")
    return f"{match.group(1)}.{int(match.group(2))}"


def _names(values: list[str]) -> list[tuple[str, str]]:
    """--only a b,c==1.0 -> [(a, ''), (b, ''), (c, '==1.0')]; import names (yaml, sklearn) read as their
    distributions."""
    by_import = {module.lower(): dist for dist, module in IMPORT_NAMES.items()}
    out = []
    for value in values:
        for text in re.split(r"[,\s]+", value):
            req = parse_requirement(text) if text else None
            if req is not None:
                out.append((by_import.get(req.name.replace("-", "_"), req.name), req.specifier))
    return out


def choose_requirements(only: list[str] | None) -> tuple[list[str], list[str]]:
    """The requirement strings to download and notes on what was left out or added."""
    deps = [r for r in project_dependencies() if r.name not in BOX_OWN]
    if only is None:
        return [r.text for r in deps], []
    by_name = {r.name: r for r in deps}
    extras = {r.name: r for r in project_extras()}
    wanted, notes = [], []
    for name, pinned in _names(only):
        if name in BOX_OWN:
            raise SystemExit(f"fetch_wheels: {name} is never fetched: the box's own torch, torchvision, triton serve")
        known = by_name.get(name) or extras.get(name)
        wanted.append(name + pinned if pinned else known.text if known else name)
        if name in extras:
            notes.append(f"{name}: kdbench's optional {extras[name].text}, which gpu_check's LM stage uses")
        elif known is None:
            notes.append(f"{name} is not among kdbench's dependencies; fetched as asked")
    return list(dict.fromkeys(wanted)), notes


def _other_needs(saved: list[str], python_version: str) -> list[str]:
    """What the wheels pip saved require besides the box's own (torch, triton ...), for a Linux box of that python:
    the requirement strings to fetch with their dependencies."""
    env = {"python_version": python_version, "python_full_version": python_version + ".0", "sys_platform": "linux"}
    env.update(platform_system="Linux", os_name="posix", implementation_name="cpython", platform_machine="x86_64")
    env.update(platform_python_implementation="CPython", implementation_version=python_version + ".0")
    env.update(platform_release="", platform_version="")
    needs = []
    for path in saved:
        for req in wheel_requirements(Path(path)) if path.endswith(".whl") else []:
            if req.name not in BOX_OWN and marker_applies(req.marker, env):
                needs.append(req.text.split(";", 1)[0].strip())
    return list(dict.fromkeys(needs))


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def _pip_download(
    requirements: list[str], args, dest: Path, constraints: Path, no_deps: bool = False
) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--disable-pip-version-check"]
    if no_deps:
        command.append("--no-deps")
    command += ["--python-version", args.python_version, "--implementation", "cp"]
    for platform in expand_platforms(args.platform):
        command += ["--platform", platform]
    command += ["--dest", str(dest), "-c", str(constraints), *requirements]
    return subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", required=True, type=python_version, help="the box's python: 3.11 or 311")
    parser.add_argument(
        "--platform",
        action="append",
        help=f"a wheel platform of the box (repeatable; default {DEFAULT_PLATFORM}); a manylinux_2_N one also "
        "takes the older manylinux wheels a glibc 2.N box runs",
    )
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST, help="the wheels folder (default: %(default)s)")
    parser.add_argument(
        "--only", nargs="+", metavar="NAME", help="only these (as run_check.py --check prints them), with their deps"
    )
    args = parser.parse_args(argv)
    args.platform = args.platform or [DEFAULT_PLATFORM]
    needs = project_requires_python()
    if not satisfies(args.python_version, needs):
        parser.error(
            f"kdbench needs Python {needs} (pyproject.toml requires-python): "
            f"gpu_check cannot run on {args.python_version}"
        )
    dest = args.dest.resolve()
    dest.mkdir(parents=True, exist_ok=True)
    requirements, notes = choose_requirements(args.only)
    for note in notes:
        print(f"fetch_wheels: {note}")
    if not requirements:
        print("fetch_wheels: nothing to fetch")
        return 0
    target = f"python {args.python_version} on {', '.join(args.platform)}"
    print(f"fetch_wheels: for {target} into {dest}: {' '.join(requirements)}")

    asked = list(requirements)
    excluded: list[str] = []
    outputs: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        # A constraint no version meets: pip fails rather than download torch for a dependency that needs it.
        constraints = Path(tmp) / "never-torch.txt"
        constraints.write_text("".join(f"{name}<0\n" for name in BOX_OWN))
        result = _pip_download(requirements, args, dest, constraints)
        if result.returncode != 0 and _NEEDS_BOX_OWN.search(result.stdout):
            # Which of them needs torch: each alone, then the rest together.
            for requirement in requirements:
                alone = _pip_download([requirement], args, dest, constraints)
                if alone.returncode != 0 and _NEEDS_BOX_OWN.search(alone.stdout):
                    excluded.append(requirement)
            requirements = [r for r in requirements if r not in excluded]
            result = _pip_download(requirements, args, dest, constraints) if requirements else None
            # Those that need the box's torch: their own wheel alone, then what else they need (not torch).
            for requirement in excluded:
                alone = _pip_download([requirement], args, dest, constraints, no_deps=True)
                if alone.returncode != 0:
                    result = alone
                    break
                outputs.append(alone.stdout)
                others = _other_needs(_SAVED.findall(alone.stdout), args.python_version)
                print(
                    f"fetch_wheels: {requirement} requires the box's own torch (never fetched): its wheel alone"
                    + (f", and {' '.join(others)}" if others else "")
                )
                if others:
                    also = _pip_download(others, args, dest, constraints)
                    if also.returncode != 0:
                        result = also
                        break
                    outputs.append(also.stdout)
    if result is not None and result.returncode != 0:
        sys.stdout.write(result.stdout[-6000:])
        print(f"fetch_wheels: pip download failed (exit {result.returncode}); is the registry reachable?")
        return result.returncode or 1
    if result is not None:
        outputs.append(result.stdout)

    fetched = sorted({Path(m).name for out in outputs for m in _SAVED.findall(out)})
    kept = []
    for name in fetched:
        wheel = parse_wheel(dest / name)
        if wheel is None or not (dest / name).is_file():
            print(f"fetch_wheels: pip reported {name}, which is not a wheel in {dest}")
            return 1
        if wheel.name in BOX_OWN:
            (dest / name).unlink()
            print(f"fetch_wheels: removed {name}: torch and torchvision are never fetched")
            return 1
        if not is_manylinux_or_pure(wheel):
            (dest / name).unlink()
            print(f"fetch_wheels: removed {name}: only pure-Python and manylinux wheels are kept")
            continue
        kept.append(name)
    others = sorted(w.path.name for w in read_wheels(dest) if w.path.name not in kept)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    lines = [
        "# kdbench device wheels, written by benchmarks/device/fetch_wheels.py; run_check.py installs from here",
        f"date: {now}",
        f"python-version: {args.python_version}",
        "implementation: cp",
        f"platforms: {' '.join(args.platform)}",
        f"requirements: {' '.join(asked)}",
        f"never fetched: {' '.join(BOX_OWN)} (the box's own)",
    ]
    lines += [f"fetched without its dependencies (it requires the box's torch): {r}" for r in excluded]
    lines += ["wheels:"] + [f"  {name}" for name in kept]
    if others:
        lines += ["also in this folder (earlier fetches):"] + [f"  {name}" for name in others]
    (dest / "MANIFEST.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    total = sum((dest / n).stat().st_size for n in kept)
    for name in kept:
        print(f"  {name} ({_size((dest / name).stat().st_size)})")
    print(f"fetch_wheels: {len(kept)} wheels, {_size(total)}, in {dest}; manifest {dest / 'MANIFEST.txt'}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PIP_NO_INPUT", "1")
    sys.exit(main())
