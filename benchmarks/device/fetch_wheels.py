"""Fetch the wheels of kdbench's dependencies for a GPU box without network (run it where pip reaches a registry).

    python benchmarks/device/fetch_wheels.py --python-version 3.11
    python benchmarks/device/fetch_wheels.py --python-version 3.12 --platform manylinux_2_28_x86_64 --only pandas pyyaml

It runs `pip download --only-binary=:all: --python-version V --implementation cp --platform P ...`
for [project] dependencies of pyproject.toml (or those named by --only, as `run_check.py --check`
prints them on the box), with their dependencies as pip resolves them for that target, into
--dest (default benchmarks/device/wheels), and writes DEST/MANIFEST.txt. torch and torchvision are
never fetched: the box's own are used; a dependency that requires torch is left out, and said so.
Only pure-Python (none-any) and manylinux wheels are kept. Standard library only (Python 3.9+).
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
    normalize,
    parse_wheel,
    project_dependencies,
    project_requires_python,
    read_wheels,
    satisfies,
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


def _names(values: list[str]) -> list[str]:
    """--only a b,c -> [a, b, c]; import names (yaml, sklearn) read as their distributions."""
    by_import = {module.lower(): dist for dist, module in IMPORT_NAMES.items()}
    names = [normalize(n) for value in values for n in re.split(r"[,\s]+", value) if n]
    return [by_import.get(n.replace("-", "_"), n) for n in names]


def choose_requirements(only: list[str] | None) -> tuple[list[str], list[str]]:
    """The requirement strings to download and notes on what was left out or added."""
    deps = [r for r in project_dependencies() if r.name not in BOX_OWN]
    if only is None:
        return [r.text for r in deps], []
    by_name = {r.name: r for r in deps}
    wanted, notes = [], []
    for name in _names(only):
        if name in BOX_OWN:
            raise SystemExit(f"fetch_wheels: {name} is never fetched: the box's own torch and torchvision are used")
        if name in by_name:
            wanted.append(by_name[name].text)
        else:
            wanted.append(name)
            notes.append(f"{name} is not among kdbench's dependencies; fetched as asked")
    return list(dict.fromkeys(wanted)), notes


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def _pip_download(requirements: list[str], args, dest: Path, constraints: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--disable-pip-version-check"]
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

    excluded: list[str] = []
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
            for requirement in excluded:
                print(
                    f"fetch_wheels: left out {requirement}: it requires torch or torchvision, which are never fetched"
                )
            requirements = [r for r in requirements if r not in excluded]
            result = _pip_download(requirements, args, dest, constraints) if requirements else None
    if result is not None and result.returncode != 0:
        sys.stdout.write(result.stdout[-6000:])
        print(f"fetch_wheels: pip download failed (exit {result.returncode}); is the registry reachable?")
        return result.returncode or 1

    fetched = sorted({Path(m).name for m in _SAVED.findall(result.stdout)} if result is not None else set())
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
        f"requirements: {' '.join(requirements)}",
        f"never fetched: {' '.join(BOX_OWN)} (the box's own)",
    ]
    lines += [f"left out (requires torch): {r}" for r in excluded]
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
