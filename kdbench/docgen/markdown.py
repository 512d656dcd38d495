"""Markdown for the generated blocks: table rows, cells, code spans, prose from docstrings and comments."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

WIDTH = 100  # argparse's usage lines wrap at this width, whatever the terminal


NONE = "—"  # a table cell with nothing to say


def prose(text: object) -> str:
    """Text for Markdown: ``<`` outside code spans as ``&lt;``, so ``OUT/<run id>/`` is not read as an HTML tag."""
    parts = re.split(r"(`+[^`]*?`+)", str(text))
    return "".join(p if p.startswith("`") else p.replace("<", "&lt;") for p in parts)


def cell(text: object) -> str:
    """A Markdown table cell: one line, ``|`` escaped (GitHub renders ``\\|`` as ``|``, in code spans too)."""
    return prose(" ".join(str(text).split())).replace("|", "\\|")


def row(*cells: object) -> str:
    return "| " + " | ".join(cell(c) for c in cells) + " |"


def table(header: list[str], rows: list[tuple]) -> list[str]:
    return [row(*header), "|" + "---|" * len(header), *(row(*r) for r in rows)]


def code(text: object) -> str:
    """``text`` as a code span (backticks doubled around text that holds one)."""
    text = str(text)
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def rst_to_md(text: str) -> str:
    """reST's ``literal`` to Markdown's `literal`, and :role:`x` to `x`."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def first_paragraph(doc: str | None) -> str:
    if not doc:
        return ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def number(value: Any) -> str:
    """A number as written in code: floats by their shortest repr, big round floats as ``1e7``."""
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e6:
        mantissa, exponent = f"{value:e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return repr(value) if isinstance(value, float) else str(value)


def yaml_value(value: Any) -> str:
    """A default as a suite would write it: null, true/false, [1, 32], {}, plain strings and numbers."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Path):
        return value.as_posix()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (int, float)):
        return number(value)
    return str(value)
