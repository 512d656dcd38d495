"""The ``cell-keys`` block (docs/suites.md): every cell setting of a suite, from the pydantic schema: its type,
default, constraints (the validators' included) and meaning (the comment above it)."""

from __future__ import annotations

import ast
import functools
import inspect
import io
import re
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kdbench.docgen.markdown import NONE, code, first_paragraph, number, rst_to_md, table, yaml_value


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
