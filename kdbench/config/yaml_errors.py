"""Where in a suite file a mistake is, and how to say it in one line.

The YAML is composed into its node tree first: that tree gives every key path its
line number, and is checked for what a safe loader alone would let through (aliases
that expand to a huge tree, custom tags, duplicate keys).  Pydantic's validation
errors are then turned into ``FILE:LINE: key.path: what to change``.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from kdbench.core.errors import KdbenchError

Lines = dict[tuple, int]  # key path -> 1-based line

_MAX_NODES = 100_000  # a suite expanded through its aliases; real suites have hundreds


def check_expansion(path: Path, root: Any) -> None:
    """Refuse documents whose aliases expand to a huge tree ("billion laughs") or to an endless one (an alias
    inside the value its anchor names: ``a: &a [*a]``).

    The composed graph shares aliased nodes; the expanded size is counted with a memo per node, so the check itself
    never expands anything; a node met again while it is being counted is inside itself.
    """
    sizes: dict[int, int] = {}
    open_: set[int] = set()  # the nodes being counted, from the root down

    def size(n: Any) -> int:
        if id(n) in open_:
            raise KdbenchError(
                f"{path}:{n.start_mark.line + 1}: this YAML anchor's value holds an alias of itself, so it never "
                "ends; write the values out instead of the alias"
            )
        if id(n) in sizes:
            return sizes[id(n)]
        open_.add(id(n))
        if isinstance(n, yaml.MappingNode):
            total = 1 + sum(size(k) + size(v) for k, v in n.value)
        elif isinstance(n, yaml.SequenceNode):
            total = 1 + sum(size(v) for v in n.value)
        else:
            total = 1
        open_.discard(id(n))
        sizes[id(n)] = min(total, _MAX_NODES + 1)
        if total > _MAX_NODES:
            raise KdbenchError(
                f"{path}:{n.start_mark.line + 1}: the YAML aliases expand to more than {_MAX_NODES} values; "
                "write the values out instead of nesting anchors"
            )
        return sizes[id(n)]

    if root is not None:
        size(root)


def read_text(path: Path) -> str:
    if not path.exists():
        raise KdbenchError(f"{path}: no such suite file; give the path of a suite YAML (see suites/)")
    if path.is_dir():
        raise KdbenchError(f"{path}: is a folder, not a suite file; give a .yaml file such as {path}/cpu.yaml")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise KdbenchError(f"{path}: is not UTF-8 text (byte {exc.start}); save the suite as UTF-8") from None


def yaml_error(path: Path, text: str, exc: yaml.YAMLError) -> KdbenchError:
    mark = getattr(exc, "problem_mark", None)
    line = f":{mark.line + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    bad_line = text.splitlines()[mark.line] if mark is not None and mark.line < len(text.splitlines()) else ""
    hint = "; indent with spaces, not tabs" if "\t" in bad_line else ""
    if "constructor" in problem:
        hint = "; tags that build Python objects are not allowed, remove it"
    return KdbenchError(f"{path}{line}: invalid YAML: {problem}{hint}")


def line_map(path: Path, text: str) -> tuple[Any, dict[tuple, int]]:
    """Compose the YAML node tree: check it, and map each key path to its 1-based line."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise yaml_error(path, text, exc) from None
    lines: dict[tuple, int] = {}
    check_expansion(path, node)

    def walk(n: Any, loc: tuple) -> None:
        if n is None:
            return
        lines.setdefault(loc, n.start_mark.line + 1)
        if n.tag and n.tag.startswith("!") and not n.tag.startswith("!!"):
            raise KdbenchError(f"{path}:{n.start_mark.line + 1}: YAML tag {n.tag} is not allowed; remove it")
        if isinstance(n, yaml.MappingNode):
            seen: set[Any] = set()
            for k, v in n.value:
                key = k.value if isinstance(k, yaml.ScalarNode) else str(k.value)
                if key in seen:
                    raise KdbenchError(
                        f"{path}:{k.start_mark.line + 1}: {dotted(loc + (key,))}: duplicate key; keep one of them"
                    )
                seen.add(key)
                lines[loc + (key,)] = k.start_mark.line + 1
                walk(v, loc + (key,))
        elif isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                walk(v, loc + (i,))

    walk(node, ())
    return node, lines


def dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def where(path: Path, lines: dict[tuple, int], loc: tuple) -> str:
    for n in range(len(loc), -1, -1):
        if loc[:n] in lines:
            return f"{path}:{lines[loc[:n]]}: {dotted(loc)}"
    return f"{path}: {dotted(loc)}"


def load_yaml(path: Path) -> tuple[Any, Lines]:
    """The parsed document (safe loader) and the line of every key path; KdbenchError for bad YAML."""
    text = read_text(path)
    _node, lines = line_map(path, text)
    try:
        raw = yaml.load(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:  # composed fine, but a tag names no safe constructor
        raise yaml_error(path, text, exc) from None
    return raw, lines


def sub_model(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    """The pydantic model a field holds (also inside `X | None`), or None for a plain value."""
    ann = model.model_fields[name].annotation
    args = (ann, *getattr(ann, "__args__", ()))
    sub = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
    return sub[0] if sub else None


def _model_at(loc: tuple, root: type[BaseModel]) -> type[BaseModel] | None:
    """The pydantic model that holds the key at `loc` (for 'did you mean')."""
    model: Any = root
    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue
        if part not in model.model_fields:
            return None
        model = sub_model(model, part)
    return model


def key_paths(model: Any, depth: int = 3) -> list[tuple[str, ...]]:
    """Every key path inside a pydantic model, its nested models' keys included (to ``depth`` levels), and the
    keys of the sections it declares in ``sections`` (a suite's ``defaults`` holds a cell's keys)."""
    if model is None or depth == 0:
        return []
    out: list[tuple[str, ...]] = []
    for name in model.model_fields:
        out.append((name,))
        out += [(name, *p) for p in key_paths(sub_model(model, name), depth - 1)]
    for name, section in getattr(model, "sections", {}).items():
        out += [(name, *p) for p in key_paths(section, depth - 1)]
    return out


def unknown_key_hint(key: str, model: Any, prefix: tuple[str, ...] = ()) -> str:
    """ "did you mean 'x'?" for the key path closest to ``key`` that ``model`` holds (prefixed with ``prefix``, the
    path the model sits at): a key of that name in a section below first (``vocab_policy`` -> ``data.vocab_policy``),
    else the closest name, spelt alike or written with its section (``teacher_weights`` -> ``teacher.weights``),
    else the list of allowed names."""
    names = list(model.model_fields) if model is not None else []
    paths = key_paths(model)
    join = ".".join(prefix + ("",)) if prefix else ""
    inside = [p for p in paths if len(p) > 1 and p[-1] == key]
    if inside:
        shown = [f"'{join}{'.'.join(p)}'" for p in inside[:3]]
        more = f" (or the {key} of another of {len(inside)} sections)" if len(inside) > 3 else ""
        return f"did you mean {', '.join(shown)}?{more} "

    def score(p: tuple[str, ...]) -> float:
        alike = [p[-1], "_".join(p)] if len(p) > 1 else [p[-1]]
        return max(difflib.SequenceMatcher(None, key, a).ratio() for a in alike)

    best = max(paths, key=lambda p: (score(p), len(p) == 1), default=None)
    if best is not None and score(best) >= 0.6:
        return f"did you mean '{join}{'.'.join(best)}'? "
    return f"allowed keys: {', '.join(names)}"


def _higher_up(loc: tuple, root: type[BaseModel]) -> str | None:
    """ "did you mean" for a key written inside a section it does not belong to when a section above holds it
    (``data: {loss_impl: ..}`` for ``loss_impl``, ``data: {decode_tokens: ..}`` for ``inference.decode_tokens``)."""
    key = loc[-1]
    for cut in range(len(loc) - 2, -1, -1):  # the model that holds loc[cut], then the one above it
        if isinstance(loc[cut], int):
            continue
        found = [p for p in key_paths(_model_at(loc[: cut + 1], root)) if p[-1] == key and p[0] != loc[cut]]
        if found:
            if len(found[0]) == 1:
                return f"'{key}' goes beside '{loc[cut]}', not inside it: move it out"
            where = ".".join(str(p) for p in (*loc[:cut], *found[0]))
            return f"did you mean '{where}'? ('{key}' belongs in '{'.'.join(found[0][:-1])}', not in '{loc[-2]}')"
    return None


def describe(err: dict, root: type[BaseModel]) -> str:
    """One pydantic error as a short instruction."""
    loc = tuple(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        hint = unknown_key_hint(str(loc[-1]), _model_at(loc, root)).rstrip()
        joined = "_".join(str(p) for p in loc[-2:])  # `teacher: {precision: ..}` for teacher_precision
        parent = _model_at(loc[:-1], root)
        if hint.startswith("allowed") and len(loc) > 1 and parent is not None and joined in parent.model_fields:
            hint = f"did you mean '{joined}' (beside '{loc[-2]}', not inside it)?"
        elif hint.startswith("allowed"):
            hint = _higher_up(loc, root) or hint
        return f"unknown key '{loc[-1]}'; {hint}"
    if kind == "missing":
        return "is required; add it"
    got = err.get("input")
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    got_text = "" if isinstance(got, (dict, list)) or "got " in msg else f" (got {got!r})"
    hint = ""
    if kind == "dict_type" and loc and not isinstance(loc[-1], int):  # a section given a value: a key of it meant?
        model = _model_at(loc, root)
        inside = [p for p in key_paths(model) if len(p) > 1 and p[-1] == loc[-1]]
        hint = f"; did you mean '{'.'.join(inside[0])}'?" if inside else ""
    return f"{msg[0].lower()}{msg[1:]}{got_text}{hint}"


def validation_error(path: Path, lines: Lines, exc: ValidationError, prefix: tuple, root) -> KdbenchError:
    """The first of pydantic's errors, located in the file, with a count of the others."""
    errors = exc.errors()
    first = errors[0]
    loc = prefix + tuple(first["loc"])
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return KdbenchError(f"{where(path, lines, loc)}: {describe(first, root)}{more}")
