"""Configuration: suite YAML -> validated Suite -> Plan of Cells.

``schema`` holds the pydantic models (``quality`` the quality block's, ``optimizer`` the optimizer's),
``yaml_errors`` the location of every key and the one-line messages, ``load`` reads a suite file, ``plan``
expands and checks the sweep.
``base`` (the strict model base every method's parameters use) imports nothing else,
so a method module can import it while the schema is being built from the methods.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Cell": "kdbench.config.plan",
    "expand": "kdbench.config.plan",
    "CellConfig": "kdbench.config.schema",
    "Suite": "kdbench.config.schema",
    "load_suite": "kdbench.config.load",
    "with_overrides": "kdbench.config.load",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_EXPORTS)
