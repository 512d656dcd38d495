"""The layout holds: imports go down the floors of kdbench/core/floors.py (the one place their order is written), no
import circle crosses folders, the family is decided in one place, no private name crosses modules, and no module
is over 500 lines but a data table."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

from kdbench.core.floors import DELIBERATE, FLOORS, floor_of, level
from tests.support.paths import ROOT

PACKAGE = ROOT / "kdbench"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports() -> dict[str, set[tuple[str, int]]]:
    """Every kdbench module's imports of kdbench modules (module level, in functions, under TYPE_CHECKING alike),
    with their lines."""
    out: dict[str, set[tuple[str, int]]] = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kdbench"):
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("kdbench")]
            for name in names:
                if _is_module(name) and name != module:
                    out[module].add((name, node.lineno))
    return out


IMPORTS = _imports()


def test_every_module_is_on_a_floor():
    modules = {_module(p) for p in PACKAGE.rglob("*.py")}
    assert sorted(m for m in modules if floor_of(m) is None) == []


def test_imports_never_climb_a_floor():
    climbs = []
    for module, targets in IMPORTS.items():
        here = floor_of(module)
        for target, line in targets:
            there = floor_of(target)
            if level(there) > level(here) and (here, there) not in DELIBERATE:
                climbs.append(f"{module}:{line} imports {target} ({here} -> {there})")
    assert climbs == []


def test_no_import_circle_crosses_folders():
    graph = {m: {t for t, _ in ts} for m, ts in IMPORTS.items()}
    crossing = [sorted(c) for c in _circles(graph) if len({floor_of(m) for m in c}) > 1]
    assert crossing == []


def test_no_import_circle_inside_a_folder():
    """Nor between the modules of one floor (kdbench/workloads/base.py and placement.py imported each other, and
    the LM workload and its speculative rows did, each dodging the circle by an import inside a function)."""
    graph = {m: {t for t, _ in ts} for m, ts in IMPORTS.items()}
    inside = [sorted(c) for c in _circles(graph) if len({floor_of(m) for m in c}) == 1]
    assert inside == []


def test_one_decode_loop_steps_a_model_on_its_cache():
    """Generation with a KV cache is written once (kdbench/models/generation.py): no other module feeds a model
    its cache, crops one, or draws tokens."""
    pattern = re.compile(r"use_cache=True|\.crop\(|torch\.multinomial\(")
    found = sorted(str(path.relative_to(PACKAGE.parent)) for path, text in _sources() if pattern.search(text))
    assert found == ["kdbench/models/generation.py"]
    loops = re.findall(
        r"^\s*for .* in range\(", (PACKAGE / "models" / "generation.py").read_text(encoding="utf-8"), re.M
    )
    assert len(loops) == 1


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(component)
    return out


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_the_floors_are_the_design_order():
    assert [f for f, _ in FLOORS] == [
        "face", "run", "quality", "fit", "report", "workloads", "measure", "distill", "data", "hw", "config",
        "store", "models", "core",
    ]  # fmt: skip


def _sources() -> list[tuple[Path, str]]:
    return [(p, p.read_text(encoding="utf-8")) for p in sorted(PACKAGE.rglob("*.py"))]


@pytest.mark.parametrize(
    "pattern",
    [r'data\.kind\s*[!=]=\s*"tokens"', r'family\s*[!=]=\s*"(lm|vision|encoder)"'],
    ids=["data-kind-as-family", "family-name-test"],
)
def test_the_family_is_decided_in_the_workloads_package_alone(pattern):
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{text.count(chr(10), 0, m.start()) + 1}"
        for path, text in _sources()
        if "workloads" not in path.parts
        for m in re.finditer(pattern, text)
    ]
    assert found == []


def test_no_private_name_is_imported_across_modules():
    private = re.compile(r"from kdbench\.[a-z_.]+ import .*\b_[a-z]")
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{n}"
        for path, text in _sources()
        for n, line in enumerate(text.splitlines(), 1)
        if private.search(line)
    ]
    assert found == []


# Data tables, exempt from the size rule: what they hold is one table, not several jobs.
DATA_TABLES = {"kdbench/core/schema.py": "COLUMNS, the result columns with their types, units and docs"}
MAX_LINES = 500


def test_no_module_is_over_500_lines_but_the_data_tables():
    sizes = {
        p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8").count("\n")
        for folder in ("kdbench", "benchmarks")
        for p in (ROOT / folder).rglob("*.py")
    }
    assert {p: n for p, n in sizes.items() if n > MAX_LINES and p not in DATA_TABLES} == {}
    assert all(sizes[p] > MAX_LINES for p in DATA_TABLES)  # a table that shrank below leaves the list


def test_a_run_worker_and_a_fit_helper_start_without_pandas():
    """pandas costs a process about 0.3 s to import (more on a busy machine), and every run's worker and every fit
    helper is a fresh process that reads no table: the modules they start from import none (pyarrow.dataset, which
    imports it, is imported where results are read; the budgets' check imports it where it checks rows)."""
    import subprocess
    import sys

    code = (
        "import sys, kdbench.run.workers, kdbench.run.cell, kdbench.fit.planner, kdbench.fit.ahead\n"
        "print(sorted(m for m in ('pandas', 'matplotlib', 'scipy') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
