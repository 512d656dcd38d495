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
import ast
import functools
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the repository this module belongs to

START = "<!-- generated: {name} (python -m kdbench.docgen) -->"
END = "<!-- end generated: {name} -->"

WIDTH = 100  # argparse's usage lines wrap at this width, whatever the terminal
NONE = "—"  # a table cell with nothing to say


class DocgenError(Exception):
    """A docs file cannot take its generated blocks (missing file or markers)."""


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repository root, with forward slashes
    generate: Callable[[], str]


# --- helpers ------------------------------------------------------------------------------------------------


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


# --- cli: the argparse reference ------------------------------------------------------------------------------


def _cli_parser() -> argparse.ArgumentParser:
    """kdbench's parser, from the function :mod:`kdbench.cli` builds it with."""
    from kdbench import cli

    return cli.build_parser()


def _formatter(parser: argparse.ArgumentParser) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(prog=parser.prog, width=WIDTH)


def _usage(parser: argparse.ArgumentParser) -> str:
    f = _formatter(parser)
    f.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return f.format_help().strip()


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _argument_row(parser: argparse.ArgumentParser, action: argparse.Action) -> tuple[str, str, str, str]:
    takes_value = action.nargs != 0
    many = {"+": "one or more", "*": "any number", "?": "optional"}.get(action.nargs, "")
    if action.option_strings:
        name = ", ".join(code(o) for o in action.option_strings)
    else:
        name = code(action.metavar or action.dest)
    if not takes_value:
        value = "flag"
    elif action.choices is not None:
        value = code(" | ".join(str(c) for c in action.choices))
    elif action.option_strings:
        value = code(action.metavar or action.dest.upper())
    else:
        value = ""
    value = ", ".join(v for v in (value, many) if v) or NONE
    if action.required or (not action.option_strings and action.nargs not in ("?", "*")):
        default = "required"
    elif not takes_value:
        default = "off"
    elif action.default is None or action.default is argparse.SUPPRESS:
        default = NONE
    else:
        default = code(yaml_value(action.default))
    help_text = _formatter(parser)._expand_help(action) if action.help else ""
    return name, value, default, help_text


def cli_reference() -> str:
    """Every subcommand of ``kdbench``: heading, help line, usage, arguments; then the examples epilog."""
    parser = _cli_parser()
    sub = _subparsers(parser)
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    out = [prose(first_paragraph(parser.description)), "", "```text", _usage(parser), "```"]
    for name, sp in sub.choices.items():
        out += ["", f"### kdbench {name}", ""]
        if helps.get(name):
            out += [prose(helps[name][:1].upper() + helps[name][1:]) + ".", ""]
        if sp.description and sp.description != helps.get(name):
            out += [prose(" ".join(sp.description.split())), ""]
        out += ["```text", _usage(sp), "```", ""]
        rows = [_argument_row(sp, a) for a in sp._actions if not isinstance(a, argparse._HelpAction)]
        out += table(["argument", "value", "default", "meaning"], rows) if rows else ["No arguments."]
    if parser.epilog:
        out += ["", "### Examples", "", "```text", parser.epilog.strip("\n"), "```"]
    return "\n".join(out)


# --- cell-keys: the suite's cell settings from the pydantic schema ---------------------------------------------


def _cell_model() -> type:
    from kdbench.config import schema

    return schema.CellConfig


def _is_model(tp: Any) -> bool:
    from pydantic import BaseModel

    return isinstance(tp, type) and issubclass(tp, BaseModel)


def type_name(tp: Any) -> str:
    """A readable type: Literal values as ``a | b``, ``X | null``, ``list[int]``, a nested model as mapping."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is typing.Literal:
        return " | ".join(yaml_value(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is not None:
        base = getattr(origin, "__name__", str(origin))
        return f"{base}[{', '.join(type_name(a) for a in args)}]" if args else base
    if _is_model(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _constraints(info: Any) -> list[str]:
    """ge/gt/le/lt as one range, lengths, patterns: from a pydantic field's metadata."""
    bounds: dict[str, Any] = {}
    for m in info.metadata:
        for key in ("ge", "gt", "le", "lt", "min_length", "max_length", "pattern", "multiple_of"):
            value = getattr(m, key, None)
            if value is not None:
                bounds[key] = value
    out = []
    low = next(((op, number(bounds[k])) for k, op in (("ge", "<="), ("gt", "<")) if k in bounds), None)
    high = next(((op, number(bounds[k])) for k, op in (("le", "<="), ("lt", "<")) if k in bounds), None)
    if low and high:
        out.append(code(f"{low[1]} {low[0]} x {high[0]} {high[1]}"))
    elif low:
        out.append(code(f"x {low[0].replace('<', '>')} {low[1]}"))
    elif high:
        out.append(code(f"x {high[0]} {high[1]}"))
    lo, hi = bounds.get("min_length"), bounds.get("max_length")
    if lo is not None and hi is not None:
        out.append(f"length {lo} to {hi}")
    elif lo is not None:
        out.append("non-empty" if lo == 1 else f"length >= {lo}")
    elif hi is not None:
        out.append(f"length <= {hi}")
    if "multiple_of" in bounds:
        out.append(f"multiple of {bounds['multiple_of']}")
    if "pattern" in bounds:
        out.append(f"matches {code(bounds['pattern'])}")
    return out


_PLACEHOLDER = "\x00"


def _message(node: ast.expr, scope: dict[str, Any]) -> str | None:
    """The text of a ``raise ValueError(...)`` message: f-string fields that name module constants filled
    in, the others (the value, ``self.x``) dropped with their ``, got ...`` / ``(...)``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if not isinstance(node, ast.JoinedStr):
        return None
    parts = []
    for v in node.values:
        if isinstance(v, ast.Constant):
            parts.append(str(v.value))
        elif isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Name) and v.value.id in scope:
            value = scope[v.value.id]
            parts.append(str(value) if isinstance(value, (int, float, str)) else _PLACEHOLDER)
        else:
            parts.append(_PLACEHOLDER)
    text = "".join(parts)
    text = re.sub(rf",? got \S*{_PLACEHOLDER}\S*$", "", text)
    text = re.sub(rf"\s*\({_PLACEHOLDER}\)", "", text)
    return text.replace(_PLACEHOLDER, "…").strip()


def _validator_rules(func: Any) -> list[tuple[str | None, str]]:
    """(first field named ``self.x`` in the test, message) of each ``raise ValueError`` of a validator."""
    func = getattr(func, "__func__", func)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError):
        return []
    scope = getattr(func, "__globals__", {})
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        for stmt in node.body:
            if not (isinstance(stmt, ast.Raise) and isinstance(stmt.exc, ast.Call) and stmt.exc.args):
                continue
            message = _message(stmt.exc.args[0], scope)
            if not message:
                continue
            named = [
                n.attr
                for n in ast.walk(node.test)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
            ]
            out.append((min(named, key=lambda a: _position(node.test, a)) if named else None, message))
    return out


def _position(test: ast.expr, attr: str) -> tuple[int, int]:
    for n in ast.walk(test):
        if isinstance(n, ast.Attribute) and n.attr == attr:
            return n.lineno, n.col_offset
    return (0, 0)


def _validators(model: type) -> dict[str, list[str]]:
    """Field name -> the rules a model's validators check (their ``raise ValueError`` messages)."""
    decorators = model.__pydantic_decorators__
    rules: dict[str, list[str]] = {}
    for d in decorators.field_validators.values():
        for _, message in _validator_rules(d.func):
            for f in d.info.fields:
                rules.setdefault(f, []).append(message)
    for d in decorators.model_validators.values():
        for field, message in _validator_rules(d.func):
            if field in model.model_fields:
                rules.setdefault(field, []).append(message)
    return rules


def _strip_comment(text: str) -> str:
    """A source comment's text, without ``type: ignore[...]`` / ``noqa`` pragmas."""
    parts = [p.strip() for p in text.split("#")]
    return " ".join(p for p in parts if p and not re.match(r"(type:\s*ignore|noqa)\b", p))


@functools.cache
def _comments(cls: type) -> dict[str, str]:
    """Field name -> the comment that documents it in ``cls``'s source: the one on its line(s), else the
    block of comment lines right above it."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
        tree = ast.parse(source)
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (OSError, TypeError, SyntaxError, tokenize.TokenError):
        return {}
    lines = source.splitlines()
    by_line: dict[int, str] = {}
    for t in tokens:
        if t.type == tokenize.COMMENT:
            by_line[t.start[0]] = t.string
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        end = node.end_lineno or node.lineno
        own = [by_line[n] for n in range(node.lineno, end + 1) if n in by_line]
        text = " ".join(_strip_comment(c) for c in own).strip()
        if not text:
            above, n = [], node.lineno - 1
            while n >= 1 and lines[n - 1].strip().startswith("#"):
                above.insert(0, _strip_comment(lines[n - 1].strip()))
                n -= 1
            text = " ".join(a for a in above if a)
        if text:
            out[node.target.id] = text
    return out


def _own_doc(cls: type) -> str:
    return first_paragraph(cls.__dict__.get("__doc__"))


def field_meaning(model: type, name: str, info: Any) -> str:
    """A field's description, else the source comment of the class that declares it."""
    if info.description:
        return " ".join(info.description.split())
    for cls in model.__mro__:
        if name in inspect.get_annotations(cls):
            return _comments(cls).get(name, "")
    return ""


def _default(info: Any) -> Any:
    from pydantic_core import PydanticUndefined

    if info.default is not PydanticUndefined:
        return info.default
    if info.default_factory is not None:
        return info.default_factory()
    return PydanticUndefined


@dataclass(frozen=True)
class Key:
    key: str  # dotted
    type: str
    default: str
    constraints: str
    meaning: str


def walk(model: type, prefix: str = "", defaults: Any = None) -> Iterator[Key]:
    """Every key of ``model``, nested models as a ``mapping`` row followed by their dotted keys.

    A nested key's default is read from its parent's default instance (what a cell really starts from),
    falling back to the nested model's own field default.
    """
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    rules = _validators(model)
    for name, info in model.model_fields.items():
        key = prefix + name
        tp = info.annotation
        default = _default(info)
        if isinstance(defaults, BaseModel) and name in type(defaults).model_fields:
            default = getattr(defaults, name)
        meaning = field_meaning(model, name, info)
        nested = _is_model(tp)
        if nested and not meaning:
            meaning = _own_doc(tp)
        shown = (
            "required"
            if default is PydanticUndefined
            else NONE
            if nested and isinstance(default, BaseModel)
            else code(yaml_value(default))
        )
        checks = [*_constraints(info), *rules.get(name, [])]
        yield Key(key, code(type_name(tp)), shown, "; ".join(checks) or NONE, rst_to_md(meaning))
        if nested:
            yield from walk(tp, key + ".", default if isinstance(default, BaseModel) else None)


def cell_keys() -> str:
    """The table of every key a cell (``defaults`` or a matrix axis) may set, from ``CellConfig``."""
    rows = [(code(k.key), k.type, k.default, k.constraints, k.meaning) for k in walk(_cell_model())]
    return "\n".join(table(["key", "type", "default", "range / constraints", "meaning"], rows))


# --- methods: the distillation method registry ----------------------------------------------------------------


def _methods() -> dict[str, Any]:
    from kdbench.distill.losses import METHODS

    return METHODS


def _what(doc: str) -> str:
    """A method's registered doc, ``citation: formula``, with the formula as code (it holds ``*`` and ``|``)."""
    doc = first_paragraph(doc)
    citation, sep, formula = doc.partition(": ")
    return f"{citation}: {code(formula)}" if sep else doc


def methods_table() -> str:
    """Every registered method: what it computes, its paper, its parameters' defaults, whether it needs features."""
    rows = []
    for m in _methods().values():
        params = ", ".join(f"{k}={yaml_value(v)}" for k, v in m.params().model_dump().items())
        paper = rst_to_md(first_paragraph(sys.modules[m.cls.__module__].__doc__))
        rows.append((code(m.name), _what(m.doc), paper, code(params) if params else NONE, _yes(m.cls.needs_features)))
    return "\n".join(table(["method", "what it is", "source", "parameters (defaults)", "needs features"], rows))


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


# --- models: the model registry -------------------------------------------------------------------------------

# torchvision's models differ by release (the pins allow 0.20-0.29): the page lists the ones the shipped suites and
# the field's tables use, all in every release the pins allow, and says where the rest are
TORCHVISION_SHOWN = (
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "mobilenet_v2",
    "mobilenet_v3_small",
    "mobilenet_v3_large",
    "shufflenet_v2_x1_0",
    "efficientnet_b0",
    "convnext_tiny",
    "vit_b_16",
    "swin_t",
)


def _data_defaults() -> tuple[int, tuple[int, ...]]:
    from kdbench.config.schema import DataConfig

    data = DataConfig()
    return data.num_classes, tuple(data.shape)


def models_table() -> str:
    """Every family and model of the catalogue (:mod:`kdbench.models.catalogue`, as ``kdbench list models``
    lists it), with its parameter count; torchvision's shown ones."""
    from kdbench.models.catalogue import (
        CALLABLE_NOTE,
        FAMILY_NOTES,
        TORCHVISION_CLASSES,
        TORCHVISION_SHAPE,
        families,
        natural,
    )

    classes, shape = _data_defaults()
    rows = []
    for family in families(classes, shape):
        names = family.models
        if family.name == "torchvision":
            names = tuple(sorted((k for k in TORCHVISION_SHOWN if k in names), key=natural))
        counted = f"{family.num_classes} classes, {_shape(family.shape)}" if family.shape else "its registered config"
        for name in names:
            count = family.parameters(name)
            rows.append((code(name), family.name, f"{count:,}", f"{count / 1e6:.2f} M", counted))
    lead = (
        f"Parameters as built for the cell defaults ({classes} classes, {_shape(shape)} inputs; "
        f"`data.num_classes`, `data.shape`), torchvision's classifiers for ImageNet ({TORCHVISION_CLASSES} classes, "
        f"{_shape(TORCHVISION_SHAPE)}). A model's count changes with the classes (its head) and, for ViTs, "
        "the image size."
    )
    lines = [lead, "", *table(["model", "family", "parameters", "millions", "counted for"], rows)]
    lines += [
        "",
        f"lm: {FAMILY_NOTES['lm']}",
        "",
        f"encoder: {FAMILY_NOTES['encoder']} ([lm.md](lm.md)).",
        "",
        "torchvision: the models above, and every other classification model of the installed torchvision "
        "(`torchvision.models.list_models(module=torchvision.models)`; `kdbench list models` lists them).",
        "",
        f"{CALLABLE_NOTE}.",
    ]
    return "\n".join(lines)


def _shape(shape: tuple[int, ...]) -> str:
    return "×".join(str(d) for d in shape)


# --- results-columns -------------------------------------------------------------------------------------------


def results_columns() -> str:
    from kdbench.schema import schema_markdown

    return schema_markdown()


# --- the blocks, and writing / checking them ---------------------------------------------------------------------

BLOCKS: dict[str, Block] = {
    "cli": Block("docs/cli.md", cli_reference),
    "cell-keys": Block("docs/suites.md", cell_keys),
    "methods": Block("docs/methods.md", methods_table),
    "models": Block("docs/models.md", models_table),
    "results-columns": Block("docs/results.md", results_columns),
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
