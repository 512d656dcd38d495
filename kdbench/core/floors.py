"""The package's floors, top first: a module imports from its own floor and the floors below it, never above.

This is the one place the order is written: ``tests/test_architecture.py`` fails when an import climbs a floor
or an import circle crosses folders, and :mod:`kdbench.docgen` writes CONTRIBUTING.md's layout from it and the
packages' docstrings.  Torch-free.
"""

from __future__ import annotations

# (floor, the modules or packages on it), top first
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("face", ("kdbench.cli", "kdbench.api", "kdbench.pytest_plugin", "kdbench.docgen", "kdbench.__main__")),
    ("run", ("kdbench.run",)),
    ("quality", ("kdbench.quality",)),
    ("fit", ("kdbench.fit",)),
    ("report", ("kdbench.report",)),
    ("workloads", ("kdbench.workloads",)),
    ("measure", ("kdbench.measure",)),
    ("distill", ("kdbench.distill",)),
    ("data", ("kdbench.data",)),
    ("hw", ("kdbench.hw",)),
    ("config", ("kdbench.config",)),
    ("store", ("kdbench.store",)),
    ("models", ("kdbench.models",)),
    # the base floor: the column table, names, errors, limits, floors, worker state, devices, stats; and the
    # package's own __init__ (only it: kdbench.x is on no floor unless listed)
    ("core", ("kdbench.core", "kdbench")),
)

# Imports that climb a floor on purpose, with the reason.
DELIBERATE = {
    ("config", "distill"): "the cell schema has a key per registered method (its parameters), read from the registry",
}


def floor_of(module: str) -> str | None:
    """The floor of ``module`` (a dotted name): the floor of its longest listed prefix; None when unlisted."""
    best: tuple[int, str] | None = None
    for floor, members in FLOORS:
        for member in members:
            inside = module == member or (member != "kdbench" and module.startswith(member + "."))
            if inside and (best is None or len(member) > best[0]):
                best = (len(member), floor)
    return best[1] if best else None


def level(floor: str) -> int:
    """How high ``floor`` is: 0 for the base, larger above."""
    names = [f for f, _ in FLOORS]
    return len(names) - 1 - names.index(floor)
