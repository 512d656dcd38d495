"""What fetch_wheels.py and run_check.py share: kdbench's dependencies read from pyproject.toml,
versions and specifiers, environment markers, and wheel file names, tags and metadata.

Standard library only, for Python 3.9 and newer: run_check.py imports it on a GPU box before
anything is installed. The version and marker handling is a small subset of PEP 440 and PEP 508,
enough for the requirements kdbench and its dependencies declare; where it cannot decide, it
answers "yes" (a requirement applies, a version satisfies), so a doubt installs a wheel rather
than leaving one out.
"""

from __future__ import annotations

import email.parser
import re
import zipfile
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PYPROJECT = ROOT / "pyproject.toml"

# The box's own: never fetched, never installed. torchvision must match the box's torch build, and so must triton
# (pytorch-triton-rocm on ROCm), which the torch wheels bring.
BOX_OWN = ("torch", "torchvision", "triton", "pytorch-triton-rocm")

# kdbench's extras that gpu_check uses: transformers (lm) and, for its liger cell, liger-kernel (liger) in its LM
# stage; nvidia-ml-py (nvidia) for its telemetry stage and each row's device_other_processes (GPU review 4, M11).
# Optional: installed from the wheels where the box lacks them and a wheel is there; without them the stage says so.
LM_EXTRAS = ("lm", "liger", "nvidia")

# Distribution name (normalized) -> the module to import, where they differ.
IMPORT_NAMES = {
    "pyyaml": "yaml",
    "scikit-learn": "sklearn",
    "pillow": "PIL",
    "python-dateutil": "dateutil",
    "nvidia-ml-py": "pynvml",
    "typing-extensions": "typing_extensions",
}


def normalize(name: str) -> str:
    """PEP 503's normalized project name: 'PyYAML' -> 'pyyaml', 'typing_extensions' -> 'typing-extensions'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def import_name(dist: str) -> str:
    name = normalize(dist)
    return IMPORT_NAMES.get(name, name.replace("-", "_"))


class Requirement(NamedTuple):
    name: str  # normalized
    specifier: str  # e.g. ">=2.6,<3", or ""
    marker: str  # e.g. 'python_version < "3.11"', or ""
    text: str  # as written


_REQUIREMENT = re.compile(
    r"^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*\(?(?P<spec>[^;()@]*)\)?\s*(?:;\s*(?P<marker>.*))?$"
)


def parse_requirement(text: str) -> Requirement | None:
    """A PEP 508 requirement without URLs; None where it is not one (a 'name @ url' requirement, say)."""
    match = _REQUIREMENT.match(text)
    if not match:
        return None
    spec = re.sub(r"\s+", "", match.group("spec") or "")
    return Requirement(normalize(match.group("name")), spec, (match.group("marker") or "").strip(), text.strip())


def project_dependencies(pyproject: Path = PYPROJECT) -> list[Requirement]:
    """[project] dependencies of pyproject.toml, in order (tomllib where there is one: Python 3.11+)."""
    text = pyproject.read_text(encoding="utf-8")
    try:
        import tomllib
    except ImportError:  # Python 3.9, 3.10
        strings = _dependency_strings(text)
    else:
        strings = tomllib.loads(text).get("project", {}).get("dependencies", [])
    requirements = [parse_requirement(s) for s in strings]
    return [r for r in requirements if r is not None]


def project_extras(names=LM_EXTRAS, pyproject: Path = PYPROJECT) -> list[Requirement]:
    """[project.optional-dependencies] of pyproject.toml for the extras ``names``, in order, each once."""
    text = pyproject.read_text(encoding="utf-8")
    try:
        import tomllib
    except ImportError:  # Python 3.9, 3.10
        strings = [s for name in names for s in _extra_strings(text, name)]
    else:
        extras = tomllib.loads(text).get("project", {}).get("optional-dependencies", {})
        strings = [s for name in names for s in extras.get(name, [])]
    requirements = [parse_requirement(s) for s in strings]
    seen: dict[str, Requirement] = {}
    for r in requirements:
        if r is not None:
            seen.setdefault(r.name, r)
    return list(seen.values())


def _extra_strings(text: str, name: str) -> list[str]:
    """The strings of [project.optional-dependencies] NAME = [...], for Pythons without tomllib."""
    section = re.search(r"^\[project\.optional-dependencies\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if not section:
        return []
    array = re.search(r"^" + re.escape(name) + r"\s*=\s*\[(.*?)\]", section.group(1), re.M | re.S)
    if not array:
        return []
    body = "\n".join(line.split("#", 1)[0] for line in array.group(1).splitlines())
    return [a or b for a, b in re.findall(r'"([^"]*)"|\'([^\']*)\'', body)]


def project_requires_python(pyproject: Path = PYPROJECT) -> str:
    """[project] requires-python of pyproject.toml, e.g. '>=3.11' ('' where there is none)."""
    text = pyproject.read_text(encoding="utf-8")
    section = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    found = re.search(r"^requires-python\s*=\s*[\"']([^\"']*)[\"']", section.group(1), re.M) if section else None
    return re.sub(r"\s+", "", found.group(1)) if found else ""


def _dependency_strings(text: str) -> list[str]:
    """The strings of [project] dependencies = [...], for Pythons without tomllib."""
    section = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if not section:
        return []
    array = re.search(r"^dependencies\s*=\s*\[(.*?)\]", section.group(1), re.M | re.S)
    if not array:
        return []
    body = "\n".join(line.split("#", 1)[0] for line in array.group(1).splitlines())
    return [a or b for a, b in re.findall(r'"([^"]*)"|\'([^\']*)\'', body)]


# ---- versions and specifiers (a subset of PEP 440) ----

_STAGES = {"dev": 0, "a": 1, "alpha": 1, "b": 2, "beta": 2, "c": 3, "rc": 3, "pre": 3, "preview": 3}


def version_key(version: str) -> tuple:
    """A sort key: '2.11.0+cu128' == '2.11', '1.0rc1' < '1.0' < '1.0.post1'; unknown suffixes sort as final."""
    text = version.strip().lower().split("+", 1)[0]
    text = re.sub(r"^v|^\d+!", "", text)
    match = re.match(r"(\d+(?:\.\d+)*)(.*)$", text)
    if not match:
        return ((0,) * 8, 4, 0)
    release = tuple(int(part) for part in match.group(1).split("."))
    release = (release + (0,) * 8)[:8]
    rest = match.group(2)
    stage = re.match(r"[-_.]?(dev|alpha|beta|preview|pre|rc|a|b|c)[-_.]?(\d*)", rest)
    if stage:
        return (release, _STAGES[stage.group(1)], int(stage.group(2) or 0))
    post = re.match(r"[-_.]?(post|rev|r)[-_.]?(\d*)", rest)
    if post:
        return (release, 5, int(post.group(2) or 0))
    return (release, 4, 0)


def _release(version: str) -> list[int]:
    match = re.match(r"(\d+(?:\.\d+)*)", version.strip().lower().lstrip("v"))
    return [int(p) for p in match.group(1).split(".")] if match else [0]


def satisfies(version: str | None, specifier: str) -> bool:
    """Whether version meets a specifier such as '>=2.6,<3'; an unknown version or clause counts as met."""
    if not version or not specifier:
        return True
    for clause in specifier.split(","):
        clause = clause.strip()
        match = re.match(r"(===|==|!=|~=|<=|>=|<|>)\s*(.+)$", clause)
        if not match:
            continue
        op, want = match.groups()
        if op == "===":
            ok = version.strip() == want
        elif op in ("==", "!=") and want.endswith(".*"):
            prefix = _release(want[:-2])
            ok = _release(version)[: len(prefix)] == prefix
            ok = ok if op == "==" else not ok
        elif op == "~=":
            prefix = _release(want)[:-1]
            ok = version_key(version) >= version_key(want) and _release(version)[: len(prefix)] == prefix
        else:
            have, ref = version_key(version), version_key(want)
            ok = {
                "==": have == ref,
                "!=": have != ref,
                "<=": have <= ref,
                ">=": have >= ref,
                "<": have < ref,
                ">": have > ref,
            }[op]
        if not ok:
            return False
    return True


# ---- environment markers (PEP 508) ----

_MARKER_TOKEN = re.compile(
    r"""\s*(?:(?P<lp>\()|(?P<rp>\))|(?P<op>===|==|!=|~=|<=|>=|<|>|not\s+in\b|in\b)"""
    r"""|(?P<bool>and\b|or\b)|(?P<str>'[^']*'|"[^"]*")|(?P<var>[A-Za-z_][A-Za-z0-9_.]*))"""
)
_VERSION_VARS = {"python_version", "python_full_version", "implementation_version"}


class _Undecided(Exception):
    pass


def marker_applies(marker: str, env: dict[str, str]) -> bool:
    """Whether a marker holds in env (the box's, as run_check's probe reports it). A marker naming an
    extra is False (kdbench asks for none); one this parser cannot read is True."""
    if not marker:
        return True
    if re.search(r"\bextra\b", marker):
        return False
    tokens = []
    pos = 0
    marker = marker.strip()
    while pos < len(marker):
        match = _MARKER_TOKEN.match(marker, pos)
        if not match or match.end() == pos:
            return True
        pos = match.end()
        kind = match.lastgroup
        tokens.append((kind, re.sub(r"\s+", " ", match.group(kind))))
    try:
        value, rest = _or_expr(tokens, env)
    except (_Undecided, IndexError, KeyError):
        return True
    return value if not rest else True


def _or_expr(tokens, env):
    value, tokens = _and_expr(tokens, env)
    while tokens and tokens[0] == ("bool", "or"):
        right, tokens = _and_expr(tokens[1:], env)
        value = value or right
    return value, tokens


def _and_expr(tokens, env):
    value, tokens = _atom(tokens, env)
    while tokens and tokens[0] == ("bool", "and"):
        right, tokens = _atom(tokens[1:], env)
        value = value and right
    return value, tokens


def _atom(tokens, env):
    if tokens[0][0] == "lp":
        value, tokens = _or_expr(tokens[1:], env)
        if not tokens or tokens[0][0] != "rp":
            raise _Undecided
        return value, tokens[1:]
    (lkind, left), (okind, op), (rkind, right) = tokens[:3]
    if okind != "op" or lkind not in ("var", "str") or rkind not in ("var", "str"):
        raise _Undecided
    version_like = (lkind == "var" and left in _VERSION_VARS) or (rkind == "var" and right in _VERSION_VARS)
    lval = env[left] if lkind == "var" else left[1:-1]
    rval = env[right] if rkind == "var" else right[1:-1]
    if op == "in":
        return lval in rval, tokens[3:]
    if op == "not in":
        return lval not in rval, tokens[3:]
    if version_like and lkind == "var":
        return satisfies(lval, op + rval), tokens[3:]
    if op == "==":
        return lval == rval, tokens[3:]
    if op == "!=":
        return lval != rval, tokens[3:]
    raise _Undecided


# ---- wheels ----


class Wheel(NamedTuple):
    path: Path
    name: str  # normalized
    version: str
    python_tags: tuple[str, ...]
    abi_tags: tuple[str, ...]
    platform_tags: tuple[str, ...]


def parse_wheel(path: Path) -> Wheel | None:
    """name-version(-build)?-python-abi-platform.whl, each tag possibly compressed ('py2.py3')."""
    if not path.name.endswith(".whl"):
        return None
    parts = path.name[: -len(".whl")].split("-")
    if len(parts) not in (5, 6):
        return None
    py, abi, plat = parts[-3:]
    return Wheel(
        path, normalize(parts[0]), parts[1], tuple(py.split(".")), tuple(abi.split(".")), tuple(plat.split("."))
    )


def is_manylinux_or_pure(wheel: Wheel) -> bool:
    return all(p == "any" or p.startswith("manylinux") for p in wheel.platform_tags)


_MANYLINUX_LEGACY = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


def manylinux_glibc(tag: str) -> tuple[tuple[int, int], str] | None:
    """'manylinux_2_28_x86_64' -> ((2, 28), 'x86_64'); 'manylinux2014_aarch64' -> ((2, 17), 'aarch64')."""
    match = re.match(r"manylinux_(\d+)_(\d+)_(.+)$", tag)
    if match:
        return (int(match.group(1)), int(match.group(2))), match.group(3)
    legacy, _, arch = tag.partition("_")
    if legacy in _MANYLINUX_LEGACY and arch:
        return _MANYLINUX_LEGACY[legacy], arch
    return None


def expand_platforms(platforms: list[str]) -> list[str]:
    """Each manylinux platform with the older manylinux tags a box of that glibc also runs, as pip
    itself accepts on such a box ('manylinux_2_28_x86_64' -> 2_28 ... 2_17, manylinux2014, 2010, 1);
    pip download takes a given --platform literally."""
    out: list[str] = []
    for platform in platforms:
        parsed = manylinux_glibc(platform)
        tags = [platform]
        if parsed:
            (major, minor), arch = parsed
            tags = [f"manylinux_{major}_{m}_{arch}" for m in range(minor, 4, -1)]
            tags += [legacy + "_" + arch for legacy, glibc in _MANYLINUX_LEGACY.items() if glibc <= (major, minor)]
        out += [t for t in tags if t not in out]
    return out


def wheel_fits(wheel: Wheel, python: dict) -> bool:
    """Whether the box's interpreter can import wheel (a subset of PEP 425 for CPython on Linux).
    python: the probe's 'python' entry (version, implementation, abiflags, machine, libc)."""
    major, minor = python["version"][:2]
    cpython = python["implementation"] == "cpython"
    abiflags = python.get("abiflags", "")
    machine = python["machine"]
    libc, libc_version = python.get("libc") or ["", ""]

    def python_ok(tag: str, abi: str) -> bool:
        if tag in (f"py{major}", "py" + f"{major}{minor}"):
            return True
        found = re.match(r"(py|cp)(\d)(\d+)$", tag)
        if not found or int(found.group(2)) != major:
            return False
        tag_minor = int(found.group(3))
        if found.group(1) == "py":
            return tag_minor <= minor
        if not cpython:
            return False
        if abi == "abi3":
            return tag_minor <= minor and "t" not in abiflags
        return tag_minor == minor

    def abi_ok(abi: str) -> bool:
        return abi == "none" or (cpython and abi in ("abi3", f"cp{major}{minor}{abiflags}"))

    def platform_ok(tag: str) -> bool:
        if tag == "any":
            return True
        if tag == f"linux_{machine}":
            return True
        parsed = manylinux_glibc(tag)
        if not parsed or libc != "glibc":
            return False
        glibc, arch = parsed
        have = tuple(int(p) for p in re.findall(r"\d+", libc_version)[:2])
        return arch == machine and have >= glibc

    tags_ok = any(python_ok(py, abi) and abi_ok(abi) for py in wheel.python_tags for abi in wheel.abi_tags)
    return tags_ok and any(platform_ok(p) for p in wheel.platform_tags)


def wheel_requirements(path: Path) -> list[Requirement]:
    """Requires-Dist of a wheel, read from its .dist-info/METADATA."""
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if re.match(r"[^/]+\.dist-info/METADATA$", n)]
        if not names:
            return []
        text = archive.read(names[0]).decode("utf-8", "replace")
    metadata = email.parser.Parser().parsestr(text, headersonly=True)
    requirements = [parse_requirement(r) for r in metadata.get_all("Requires-Dist") or []]
    return [r for r in requirements if r is not None]


def read_wheels(folder: Path) -> list[Wheel]:
    wheels = [parse_wheel(p) for p in sorted(folder.glob("*.whl"))] if folder.is_dir() else []
    return [w for w in wheels if w is not None]
