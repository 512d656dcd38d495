"""Reading a suite file: parse it safely, validate it, and check every sweep value where it was written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kdbench.config.plan import CASES, check_axis_name, deep_merge, overlay
from kdbench.config.schema import CellDefaults, Suite
from kdbench.config.yaml_errors import describe, load_yaml, validation_error, where
from kdbench.core.errors import KdbenchError


def load_suite(path: str | Path) -> Suite:
    """Read, parse and validate a suite file (the sweep itself is expanded by :func:`kdbench.config.plan.expand`)."""
    path = Path(path)
    raw, lines = load_yaml(path)
    if raw is None:
        raise KdbenchError(
            f"{path}: the suite is empty; it needs at least `defaults` (`name` defaults to the file's name; "
            "see suites/cpu.yaml)"
        )
    if not isinstance(raw, dict):
        raise KdbenchError(
            f"{path}:1: a suite must be a mapping of keys (name, defaults, matrix, ...), not a {type(raw).__name__}"
        )
    if "name" not in raw:
        raw = {**raw, "name": path.stem}
    try:
        suite = Suite.model_validate(raw).located(path, lines)
    except ValidationError as exc:
        raise validation_error(path, lines, exc, (), Suite) from None
    _validate_sweep(suite)
    return suite


def with_overrides(suite: Suite, options: dict[str, tuple[str, Any]]) -> Suite:
    """The suite with top-level settings replaced by command-line options, ``{field: (flag, value)}``
    (None: not given), validated by the suite's own rules; an error names the flag."""
    given = {name: value for name, (_flag, value) in options.items() if value is not None}
    if not given:
        return suite
    try:
        return Suite.model_validate({**suite.model_dump(), **given}).located(suite.path, suite.lines)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise KdbenchError(f"{options[err['loc'][0]][0]}: {describe(err, Suite)}") from None


def _validate_sweep(suite: Suite) -> None:
    """Check defaults, each matrix value and each exclude entry where the user wrote it."""
    try:
        CellDefaults.model_validate(suite.defaults)
    except ValidationError as exc:
        raise validation_error(suite.path, suite.lines, exc, ("defaults",), CellDefaults) from None
    for axis, values in suite.matrix.items():
        if not values:
            raise suite.error(("matrix", axis), "has no values; list at least one or remove the axis")
        path = () if axis == CASES else check_axis_name(suite, ("matrix", axis), axis)
        for i, value in enumerate(values):
            if axis == CASES and not isinstance(value, dict):
                raise suite.error(
                    ("matrix", axis, i), f"each case is a mapping of cell keys, not {type(value).__name__}"
                )
            try:
                CellDefaults.model_validate(deep_merge(suite.defaults, overlay(axis, value)))
            except ValidationError as exc:
                for err in exc.errors():
                    loc = tuple(err["loc"])
                    if loc[: len(path)] == path:
                        at = ("matrix", axis, i) + loc[len(path) :]
                        raise KdbenchError(
                            f"{where(suite.path, suite.lines, at)}: {describe(err, CellDefaults)}"
                        ) from None
    for i, entry in enumerate(suite.exclude):
        if not entry:
            raise suite.error(("exclude", i), "is empty and would exclude every cell; give the keys to match")
        for key in entry:
            check_axis_name(suite, ("exclude", i, key), key)
