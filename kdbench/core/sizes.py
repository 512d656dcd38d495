"""Bytes as text, both ways: the unit table, a size as a user or an allocator's message writes it, and the GiB figure
the fit's lines print.

One table, so that ``141GB`` means the same bytes to ``--device-memory`` (:mod:`kdbench.fit.devices`) as "Tried to
allocate 1.50 GiB" does to the failure rows (:mod:`kdbench.measure.failures`).  ``KB`` / ``MB`` / ``GB`` / ``TB``
(and the bare letters ``k``, ``m``, ``g``, ``t``) are decimal, 10^3 apart, as vendors' datasheets write memory;
``KiB`` / ``MiB`` / ``GiB`` / ``TiB`` binary, 2^10 apart, as torch's allocator writes it.  Torch-free.
"""

from __future__ import annotations

import re

KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12
KIB, MIB, GIB, TIB = 2**10, 2**20, 2**30, 2**40

# Bytes per unit, by the unit in lower case ("" and "b": bytes).
UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": KB,
    "mb": MB,
    "gb": GB,
    "tb": TB,
    "kib": KIB,
    "mib": MIB,
    "gib": GIB,
    "tib": TIB,
    "k": KB,
    "m": MB,
    "g": GB,
    "t": TB,
}

_SIZE = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def to_bytes(number: float | str, unit: str) -> int:
    """``number`` of ``unit`` (any case: ``GiB``, ``gb``) in whole bytes; KeyError for a unit not in :data:`UNITS`."""
    return round(float(number) * UNITS[unit.lower()])


def read_size(text: str) -> float | None:
    """The bytes of a size as written (``141GB``, ``80 GiB``, ``192e9``, ``1.5TB``; a bare number is bytes), not
    rounded; None when ``text`` is not a number and a known unit.  Whether a size may be below one byte, zero or
    negative is the caller's to say (``0.4`` is not rounded to 0 and ``-1GB`` keeps its sign)."""
    found = _SIZE.match(text)
    if found is None or found[2].lower() not in UNITS:
        return None
    return float(found[1]) * UNITS[found[2].lower()]


def gib(nbytes: float) -> str:
    """``nbytes`` in GiB with two decimals (``131.32 GiB``)."""
    return f"{nbytes / GIB:.2f} GiB"
