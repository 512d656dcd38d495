"""How kdbench and the packages it stands on are installed: the install line for a missing extra that fits how
kdbench was installed (:func:`extra_hint`, from PEP 610's ``direct_url.json``), and the torch / torchvision /
transformers set checked to work together before anything imports torchvision (:func:`check_install`: one line
with the fix, never a traceback).

torchvision 0.N is built for torch 2.(N - 15) and for one torch build (CPU, a CUDA or a ROCm release): torchvision's
compatibility table (https://github.com/pytorch/vision#installation; the PyTorch wiki's "PyTorch Versions" page,
https://github.com/pytorch/pytorch/wiki/PyTorch-Versions) pairs 0.15 with 2.0, 0.20 with 2.5, 0.29 with 2.14.
A pair that breaks the rule, or a CUDA torchvision beside a CPU torch, fails at ``import torchvision`` with
``operator torchvision::nms does not exist`` (its C++ operators do not load into that torch).  Versions are read
from the installed metadata (importlib.metadata) and torchvision's ``version.py`` as text, so the check itself
never imports a broken torchvision; then the import is tried, and torchvision's own ``version.cuda`` and
``torch.ops.torchvision.nms`` are read.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from kdbench.core.errors import KdbenchError

TORCHVISION_OFFSET = 15  # torchvision 0.N pairs with torch 2.(N - 15): torchvision's compatibility table
WHEEL_INDEX = "https://download.pytorch.org/whl"  # PyTorch's own wheel index: /cpu, /cu128, /rocm6.4, ...
PACKAGE_DIR = Path(__file__).resolve().parent  # the kdbench package this process imported


# --------------------------------------------------------------------------- the extra hint


@dataclass(frozen=True)
class Origin:
    """How the imported kdbench was installed: ``editable`` (pip install -e FOLDER), ``folder`` (pip install FOLDER),
    ``vcs`` (pip install git+URL), ``index`` (a wheel from a package index) or ``source`` (a source tree on the path,
    not installed)."""

    kind: str
    folder: Path | None = None
    url: str | None = None

    def line(self, extra: str) -> str:
        """The pip command that adds ``extra`` to this install."""
        if self.kind == "vcs":
            return f"pip install {shlex.quote(f'kdbench[{extra}] @ {self.url}')}"
        if self.kind in ("editable", "folder", "source") and self.folder is not None:
            where = "." if self.folder == Path.cwd().resolve() else str(self.folder)
            dash_e = "-e " if self.kind != "folder" else ""
            line = f"pip install {dash_e}{shlex.quote(f'{where}[{extra}]')}"
            if self.kind == "source":
                line += f" (kdbench runs from the source tree {self.folder}, not installed)"
            return line
        return f"pip install {shlex.quote(f'kdbench[{extra}]')}"


def _file_folder(url: str) -> Path | None:
    parsed = urlparse(url)
    return Path(unquote(parsed.path)).resolve() if parsed.scheme == "file" else None


def origin_of(dist: importlib.metadata.Distribution | None, package_dir: Path = PACKAGE_DIR) -> Origin:
    """How ``package_dir`` (the kdbench imported) was installed, from its distribution's PEP 610 ``direct_url.json``
    (None: no kdbench is installed).  A kdbench imported from elsewhere than the installed one (a source tree on
    PYTHONPATH) is ``source``."""
    root = package_dir.parent
    source = Origin("source", root) if (root / "pyproject.toml").is_file() else Origin("index")
    if dist is None:
        return source
    try:
        info = json.loads(dist.read_text("direct_url.json") or "{}")
    except (json.JSONDecodeError, OSError):
        info = {}
    url = info.get("url", "") if isinstance(info, dict) else ""
    folder = _file_folder(url)
    if info.get("dir_info", {}).get("editable") and folder is not None:
        return Origin("editable", folder) if package_dir.is_relative_to(folder) else source
    installed = dist.locate_file("kdbench/__init__.py")
    if Path(str(installed)).resolve().parent != package_dir:
        return source
    if "vcs_info" in info:
        vcs = info["vcs_info"]
        commit = f"@{vcs['commit_id']}" if vcs.get("commit_id") else ""
        return Origin("vcs", url=f"{vcs.get('vcs', 'git')}+{url}{commit}")
    if "dir_info" in info and folder is not None and folder.is_dir():
        return Origin("folder", folder)
    return Origin("index")


def origin() -> Origin:
    """How this process's kdbench was installed (:func:`origin_of` its installed distribution)."""
    try:
        dist = importlib.metadata.distribution("kdbench")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    return origin_of(dist)


def extra_hint(extra: str) -> str:
    """The pip line that installs kdbench's ``extra`` the way kdbench was installed: ``pip install -e '.[lm]'`` in an
    editable clone, ``pip install 'kdbench[lm]'`` from an index; every missing-extra message ends with it."""
    return origin().line(extra)


# --------------------------------------------------------------------------- the torch set


@dataclass(frozen=True)
class Build:
    """What a torch or torchvision wheel was built for: ``cpu``, ``cuda`` or ``rocm`` and its release ("12.8", "6.4");
    ``kind`` "" when unknown."""

    kind: str = ""
    release: str | None = None

    @classmethod
    def of_tag(cls, version: str) -> Build:
        """From a version's local tag: 2.13.0+cpu, 0.28.0+cu128, 2.9.0+rocm6.4 (none: unknown)."""
        tag = version.partition("+")[2]
        if tag == "cpu":
            return cls("cpu")
        if m := re.fullmatch(r"cu(\d+)(\d)", tag):
            return cls("cuda", f"{m[1]}.{m[2]}")
        if m := re.fullmatch(r"rocm(\d+\.\d+)(?:\.\d+)*", tag):
            return cls("rocm", m[1])
        return cls()

    def text(self) -> str:
        if self.kind == "cpu":
            return "the CPU"
        return f"{'CUDA' if self.kind == 'cuda' else 'ROCm'} {self.release}" if self.kind else "an unknown build"

    def index(self) -> str:
        """PyTorch's wheel index for this build."""
        if self.kind == "cuda" and self.release:
            return f"{WHEEL_INDEX}/cu{self.release.replace('.', '')}"
        if self.kind == "rocm" and self.release:
            return f"{WHEEL_INDEX}/rocm{self.release}"
        return f"{WHEEL_INDEX}/cpu"

    def clashes(self, other: Build) -> bool:
        """Two known builds that cannot share a process: CPU beside CUDA, CUDA beside ROCm, two CUDA majors."""
        if not self.kind or not other.kind:
            return False
        if self.kind != other.kind:
            return True
        return self.kind == "cuda" and (self.release or "").split(".")[0] != (other.release or "").split(".")[0]


@dataclass(frozen=True)
class Installed:
    """The installed torch set, read without importing torchvision: versions (with their local tags where known),
    builds, and transformers' own requirement on torch (its ``torch`` extra)."""

    torch: str
    torch_build: Build
    torchvision: str | None = None
    torchvision_build: Build = Build()
    transformers: str | None = None
    transformers_needs: str | None = None  # e.g. ">=2.6"


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torchvision_version() -> str | None:
    """torchvision's ``__version__`` read from its version.py as text (it carries the local tag, +cpu or +cu128, which
    PyPI's metadata lacks), without importing torchvision; the metadata's version where the file cannot be read."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        return None
    for folder in spec.submodule_search_locations or ():
        try:
            text = (Path(folder) / "version.py").read_text()
        except OSError:
            continue
        if m := re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M):
            return m[1]
    return _version("torchvision")


def _torch_requirement(package: str, extra: str) -> str | None:
    """``package``'s requirement on torch (under ``extra``), as its metadata says: ">=2.6"."""
    from packaging.requirements import InvalidRequirement, Requirement

    for line in importlib.metadata.requires(package) or ():
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name == "torch" and (req.marker is None or req.marker.evaluate({"extra": extra})):
            return str(req.specifier) or None
    return None


def installed() -> Installed:
    """What is installed (imports torch, never torchvision)."""
    import torch

    hip, cuda = getattr(torch.version, "hip", None), getattr(torch.version, "cuda", None)
    if hip:
        build = Build("rocm", ".".join(str(hip).split(".")[:2]))
    elif cuda:
        build = Build("cuda", str(cuda))
    else:
        build = Build("cpu")
    tv = _torchvision_version()
    transformers = _version("transformers") if importlib.util.find_spec("transformers") else None
    needs = _torch_requirement("transformers", "torch") if transformers else None
    return Installed(str(torch.__version__), build, tv, Build.of_tag(tv) if tv else Build(), transformers, needs)


def _minor(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2])) if m else None


def torchvision_for(torch_version: str) -> str | None:
    """The torchvision release torch ``torch_version`` pairs with ("2.14.1" -> "0.29"); None outside torch 2."""
    mm = _minor(torch_version)
    return f"0.{mm[1] + TORCHVISION_OFFSET}" if mm and mm[0] == 2 else None


def _fix(facts: Installed, wanted: str) -> str:
    return (
        f"pip install --force-reinstall --no-deps 'torchvision=={wanted}.*' --index-url {facts.torch_build.index()} "
        f"(torchvision 0.N pairs with torch 2.(N-{TORCHVISION_OFFSET}): https://github.com/pytorch/vision#installation)"
    )


def mismatch(facts: Installed) -> str | None:
    """Why the installed torch and torchvision do not work together, with the fix (None: nothing seen); from the
    versions and builds alone."""
    if facts.torchvision is None:
        return f"torchvision is not installed (kdbench needs it beside torch {facts.torch}): " + _fix(
            facts, torchvision_for(facts.torch) or "0"
        ).replace("--force-reinstall --no-deps ", "")
    wanted = torchvision_for(facts.torch)
    have = _minor(facts.torchvision)
    pair = f"torch {facts.torch} and torchvision {facts.torchvision} do not work together"
    if wanted is not None and have is not None and f"{have[0]}.{have[1]}" != wanted:
        return f"{pair}: torchvision {have[0]}.{have[1]} is built for torch 2.{have[1] - TORCHVISION_OFFSET}; " + _fix(
            facts, wanted
        )
    if facts.torchvision_build.clashes(facts.torch_build):
        return (
            f"{pair}: this torchvision is built for {facts.torchvision_build.text()}, torch for "
            f"{facts.torch_build.text()}; " + _fix(facts, wanted or ".".join(map(str, have or (0, 0))))
        )
    return None


def transformers_mismatch(facts: Installed) -> str | None:
    """Why the installed transformers does not work with the installed torch (its own requirement), with the fix."""
    if facts.transformers is None or not facts.transformers_needs:
        return None
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        ok = Version(facts.torch.partition("+")[0]) in SpecifierSet(facts.transformers_needs)
    except InvalidVersion:
        return None
    if ok:
        return None
    return (
        f"transformers {facts.transformers} needs torch{facts.transformers_needs} (its own requirement) and torch "
        f"{facts.torch} is installed, so it leaves torch out and its models do not build: install a transformers for "
        f"this torch, pip install 'transformers>=4.46,<{facts.transformers}', or a torch{facts.transformers_needs} "
        f"with its torchvision ({facts.torch_build.index()})"
    )


def import_torchvision():
    """``import torchvision`` (a function, so that a test can stand a failing one in)."""
    import torchvision

    return torchvision


def import_problem(facts: Installed) -> str | None:
    """Why torchvision does not load beside this torch: its import fails (``operator torchvision::nms does not
    exist``), its own CUDA (``torchvision.version.cuda``) is not torch's, or its operators are missing."""
    import torch

    wanted = torchvision_for(facts.torch) or ".".join(facts.torchvision.split(".")[:2])
    pair = f"torchvision {facts.torchvision} does not load beside torch {facts.torch}"
    try:
        tv = import_torchvision()
    except Exception as exc:  # RuntimeError (its operators), ImportError / OSError (its library): all mean the same
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        return f"{pair} ({type(exc).__name__}: {first}); " + _fix(facts, wanted)
    tv_cuda = getattr(getattr(tv, "version", None), "cuda", None)
    torch_cuda = getattr(torch.version, "cuda", None)
    if tv_cuda and not torch_cuda and not getattr(torch.version, "hip", None):
        return f"{pair}: this torchvision is built for CUDA {tv_cuda}, torch for the CPU; " + _fix(facts, wanted)
    try:
        _ = torch.ops.torchvision.nms  # raises where torchvision's operators did not register
    except (AttributeError, RuntimeError):
        return f"{pair}: its operators (torchvision::nms) are not registered; " + _fix(facts, wanted)
    return None


def check_install(transformers: bool = False) -> None:
    """KdbenchError, one line with the fix, when torch and torchvision (and with ``transformers``, an installed
    transformers) do not work together.  ``KDBENCH_SKIP_INSTALL_CHECK=1`` skips it (a torch kdbench does not know
    the pairing of)."""
    if os.environ.get("KDBENCH_SKIP_INSTALL_CHECK") == "1":
        return
    try:
        facts = installed()
    except Exception as exc:  # torch itself does not import
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        raise KdbenchError(
            f"torch does not import here ({type(exc).__name__}: {first}); reinstall it with its torchvision: "
            f"pip install --force-reinstall torch torchvision --index-url {WHEEL_INDEX}/cpu (or your CUDA/ROCm index)"
        ) from None
    problem = mismatch(facts) or import_problem(facts)
    if problem is None and transformers:
        problem = transformers_mismatch(facts)
    if problem is not None:
        raise KdbenchError(problem)


def check_transformers() -> None:
    """KdbenchError when the installed transformers does not work with the installed torch (see
    :func:`transformers_mismatch`); nothing when it does or is not installed.  Read once per process."""
    if os.environ.get("KDBENCH_SKIP_INSTALL_CHECK") == "1":
        return
    problem = transformers_problem()
    if problem is not None:
        raise KdbenchError(problem)


@functools.cache
def transformers_problem() -> str | None:
    """:func:`transformers_mismatch` of what is installed, read once per process."""
    return transformers_mismatch(installed())
