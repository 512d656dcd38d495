"""The ``layout`` block (CONTRIBUTING.md): the package floor by floor, top first (:mod:`kdbench.core.floors`), each
module and package with the first sentence of its docstring, so the map cannot drift from the tree."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

from kdbench.core.floors import FLOORS

PACKAGE = Path(__file__).resolve().parents[1]
NAME_WIDTH = 30  # the column the descriptions start at
LINE_WIDTH = 118


def first_sentence(path: Path) -> str:
    """The first sentence of the module's docstring (its first paragraph when that has no full stop), as plain
    text: reStructuredText roles and literals lose their markup."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    para = " ".join(doc.split("\n\n")[0].split())
    end = re.search(r"\.(\s|$)", para)
    text = para[: end.start() + 1] if end else para
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)  # :mod:`kdbench.x` -> kdbench.x
    return text.replace("``", "").replace("`", "")


def _line(name: str, depth: int, text: str) -> list[str]:
    head = "  " * depth + name
    if len(head) >= NAME_WIDTH:
        indent = " " * NAME_WIDTH
        return [head, *textwrap.wrap(text, LINE_WIDTH, initial_indent=indent, subsequent_indent=indent)]
    wrapped = textwrap.wrap(text, LINE_WIDTH - NAME_WIDTH) or [""]
    return [head.ljust(NAME_WIDTH) + wrapped[0], *(" " * NAME_WIDTH + w for w in wrapped[1:])]


def _tree(folder: Path, depth: int) -> list[str]:
    """A package: its line, then its modules, then its sub-packages."""
    lines = _line(folder.name + "/", depth, first_sentence(folder / "__init__.py"))
    for path in sorted(folder.glob("*.py")):
        if path.name not in ("__init__.py", "__main__.py"):
            lines += _line(path.name, depth + 1, first_sentence(path))
    for sub in sorted(p for p in folder.iterdir() if (p / "__init__.py").is_file()):
        lines += _tree(sub, depth + 1)
    return lines


def layout() -> str:
    """The layout block: each floor's modules and packages, described by their docstrings."""
    lines = ["kdbench/"]
    for floor, members in FLOORS:
        lines.append(f"  [{floor}]")
        for member in members:
            if member == "kdbench":
                continue
            path = PACKAGE.parent.joinpath(*member.split("."))
            if (path / "__init__.py").is_file():
                lines += _tree(path, 2)
            elif path.with_suffix(".py").is_file():
                lines += _line(path.name + ".py", 2, first_sentence(path.with_suffix(".py")))
    return "```\n" + "\n".join(line.rstrip() for line in lines) + "\n```"
