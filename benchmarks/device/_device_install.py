"""Installing what the box lacks: the wheels to install (the missing distributions and, through their
Requires-Dist, what they need that the box lacks), and the private target folder they go into, by pip
(``--no-index --no-deps --target``) or, where the box has no pip, by unpacking them; site-packages is never
touched.

Standard library only, for Python 3.9 and newer (a GPU box's own python).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from pathlib import Path

from _device_child import Deadline, Log, SetupError, TimedOut
from _device_common import (
    BOX_OWN,
    Wheel,
    marker_applies,
    normalize,
    satisfies,
    version_key,
    wheel_fits,
    wheel_requirements,
)


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
