"""References generated from the code, so the docs cannot drift from it.

A generated block is the text of a Markdown file between two marker lines::

    <!-- generated: NAME (python -m kdbench.docgen) -->
    ...generated text...
    <!-- end generated: NAME -->

:data:`BLOCKS` maps each block's name to the file that holds it and the function that
writes it.  ``python -m kdbench.docgen`` replaces the text between the markers of every
block with freshly generated text, leaving the rest of each file alone, and prints the
files it changed; ``python -m kdbench.docgen --check`` changes nothing, lists the blocks
that differ from the code (or whose markers are missing) and exits 1, else 0 (CI runs it).

Importing this module is cheap: each block imports what it reads (torch included) when
it is generated.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository this package belongs to

START = "<!-- generated: {name} (python -m kdbench.docgen) -->"
END = "<!-- end generated: {name} -->"


class DocgenError(Exception):
    """A docs file cannot take its generated blocks (missing file or markers)."""


from kdbench.docgen.cell_keys import cell_keys  # noqa: E402  (the blocks' writers, imported cheaply)
from kdbench.docgen.cli_reference import cli_reference  # noqa: E402
from kdbench.docgen.layout import layout  # noqa: E402
from kdbench.docgen.suites import suites_table  # noqa: E402
from kdbench.docgen.tables import methods_table, models_table, results_columns  # noqa: E402


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repository root, with forward slashes
    generate: Callable[[], str]


BLOCKS: dict[str, Block] = {
    "cli": Block("docs/cli.md", cli_reference),
    "cell-keys": Block("docs/suites.md", cell_keys),
    "suites": Block("docs/suites.md", suites_table),
    "methods": Block("docs/methods.md", methods_table),
    "models": Block("docs/models.md", models_table),
    "results-columns": Block("docs/results.md", results_columns),
    "layout": Block("CONTRIBUTING.md", layout),
}


def markers(name: str) -> tuple[str, str]:
    """The start and end marker lines of block ``name``."""
    return START.format(name=name), END.format(name=name)


def generate(name: str) -> str:
    """Block ``name``'s text as the code says it now (no trailing newline)."""
    return BLOCKS[name].generate().strip("\n")


def _span(text: str, name: str, file: str) -> tuple[int, int]:
    """Where block ``name``'s body lies in ``text``: (just after the start marker's line, the end marker)."""
    start, end = markers(name)
    found = [m.start() for m in re.finditer(rf"^{re.escape(start)}[ \t]*$", text, re.M)]
    if not found:
        raise DocgenError(f"{file} has no generated block {name}")
    if len(found) > 1:
        raise DocgenError(f"{file} has generated block {name} {len(found)} times")
    body = text.index("\n", found[0]) + 1 if "\n" in text[found[0] :] else len(text)
    close = re.compile(rf"^{re.escape(end)}[ \t]*$", re.M).search(text, body)
    if close is None:
        raise DocgenError(f"{file}: generated block {name} has no end marker {end!r}")
    return body, close.start()


def _read(root: Path, file: str, name: str) -> str:
    path = root / file
    if not path.is_file():
        raise DocgenError(f"{file} is missing (it holds generated block {name})")
    return path.read_text(encoding="utf-8")


def _files() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, block in BLOCKS.items():
        out.setdefault(block.file, []).append(name)
    return out


def _render(text: str, file: str, names: list[str], texts: dict[str, str]) -> str:
    for name in names:
        body, close = _span(text, name, file)
        text = text[:body] + texts[name] + "\n" + text[close:]
    return text


def write(root: Path = ROOT) -> list[Path]:
    """Regenerate every block in place; the files that changed.  DocgenError (nothing written) when a file or
    a block's markers are missing."""
    root = Path(root)
    files = _files()
    problems = []
    for file, names in files.items():
        try:
            text = _read(root, file, names[0])
            for name in names:
                _span(text, name, file)
        except DocgenError as err:
            problems.append(str(err))
    if problems:
        raise DocgenError("; ".join(problems))
    texts = {name: generate(name) for name in BLOCKS}
    changed = []
    for file, names in files.items():
        path = root / file
        old = path.read_text(encoding="utf-8")
        new = _render(old, file, names, texts)
        if new != old:
            path.write_text(new, encoding="utf-8")
            changed.append(path)
    return changed


def check(root: Path = ROOT) -> list[str]:
    """One line per block that is stale or cannot be found; empty when the docs agree with the code."""
    root = Path(root)
    stale = []
    for name, block in BLOCKS.items():
        try:
            text = _read(root, block.file, name)
            body, close = _span(text, name, block.file)
        except DocgenError as err:
            stale.append(str(err))
            continue
        want, have = generate(name) + "\n", text[body:close]
        if want != have:
            stale.append(f"{block.file}: generated block {name} is stale ({_first_difference(want, have)})")
    return stale


def _first_difference(want: str, have: str) -> str:
    w, h = want.splitlines(), have.splitlines()
    for i, (a, b) in enumerate(zip(w, h)):
        if a != b:
            return f"line {i + 1} of the block: the code gives {_short(a)}, the file has {_short(b)}"
    return f"the code gives {len(w)} lines, the file has {len(h)}"


def _short(line: str, limit: int = 80) -> str:
    return repr(line if len(line) <= limit else line[: limit - 3] + "...")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kdbench.docgen", description="Regenerate (or --check) the docs' generated blocks."
    )
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 listing the stale blocks")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository root (default: this checkout)")
    args = parser.parse_args(argv)
    if args.check:
        stale = check(args.root)
        for line in stale:
            print(line, file=sys.stderr)
        if stale:
            print(f"{len(stale)} generated block(s) stale; run `python -m kdbench.docgen`", file=sys.stderr)
            return 1
        print(f"all {len(BLOCKS)} generated blocks agree with the code")
        return 0
    try:
        changed = write(args.root)
    except DocgenError as err:
        print(f"docgen: error: {err}", file=sys.stderr)
        return 2
    for path in changed:
        print(path.relative_to(args.root).as_posix())
    if not changed:
        print("no changes: every generated block agrees with the code")
    return 0


if __name__ == "__main__":
    sys.exit(main())
