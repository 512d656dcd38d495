"""Suite -> Plan: the matrix expanded into Cells, each checked before anything runs.

A cell is ``defaults`` overlaid with one combination of the matrix values (the
cartesian product, first axis slowest), minus the combinations an ``exclude``
entry matches.  An exclude entry matches a cell when every key it gives equals
the cell's value; a mapping value matches partially (``{pair: {student: x}}``
matches every pair whose student is x).

``cell_id`` is a hash of the resolved config, not of where it runs: the same cell
measured on a ROCm box and on a CUDA box has the same id, which is what lets runs be
compared cell by cell, resumed and sharded.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kdbench.config.schema import IMAGE_DATA_KEYS, TOKEN_DATA_KEYS, CellConfig, Suite
from kdbench.config.yaml_errors import sub_model, unknown_key_hint, validation_error
from kdbench.core.errors import KdbenchError
from kdbench.distill.losses import METHODS, method_parts

logger = logging.getLogger(__name__)

CASES = "cases"  # the matrix axis whose values are whole partial cells (several keys at once)
# The levers (suite key: its default); a cell pulls a lever when its value differs from the default.
LEVER_DEFAULTS = {
    "compile": "off",
    "compile_teacher": False,
    "graphs": False,
    "optimizer.impl": "default",
    "conv_autotune": False,
    "tunableop": False,
    "inference.runtime": "eager",
    "loss_impl": "dense",
    "generation.cache": "dynamic",
    "generation.compile": False,
}
IDENTITY_DEFAULTS = {
    **LEVER_DEFAULTS,
    "timing.target_rel_ci": None,
    "timing.max_time_s": 10.0,
    "timing.cell_budget_s": None,
    "chunk_size": 1024,
    "on_policy": None,
    "parallel": "ddp",
    "inference.decode_tokens": 32,
    "inference.speculative": None,
    "overrides.teacher": {},
    "overrides.student": {},
    "data.seq_len": 512,
    "data.prompt_fraction": 0.25,
    "data.vocab_policy": "error",
    "data.tokenizers": None,
    "uld.alignment": "position",
    "teacher.weights": "fp32",
    "fsdp.param_dtype": None,
    "fsdp.reduce_dtype": None,
}


@dataclass(frozen=True)
class Cell:
    index: int
    cell_id: str
    config: CellConfig = field(compare=False)
    # `key=value` of the settings that tell this cell apart from others of its plan with the same short label
    # (set by :func:`distinct_labels`)
    label_extra: str = field(default="", compare=False)
    # the settings the plan sweeps (their values differ between its cells): shown in the label even at their
    # defaults (set by :func:`distinct_labels`)
    swept: frozenset[str] = field(default=frozenset(), compare=False)

    @property
    def label(self) -> str:
        return f"{self.short_label} {self.label_extra}" if self.label_extra else self.short_label

    @property
    def short_label(self) -> str:
        """The pair, method, precision, batch size and the settings away from their defaults that most cells
        sweep, or that this cell's plan sweeps (``swept``: then shown at their defaults too, ``dense`` beside
        ``chunked``); :func:`distinct_labels` adds what else tells the plan's cells apart."""
        c = self.config

        def shown(key: str, away: bool) -> bool:
            return away or key in self.swept

        parts = [f"{c.pair.teacher}->{c.pair.student}", c.method, c.precision]
        if shown("teacher.mode", c.teacher.mode != "live"):
            parts.append(f"teacher-{c.teacher.mode}")
        if shown("teacher_precision", c.teacher_precision != "fp32"):
            parts.append(f"teacher-{c.teacher_precision}")
        if shown("teacher.weights", c.teacher.weights != "fp32"):
            parts.append(f"teacher-weights-{c.teacher.weights}")
        parts.append(f"bs{c.batch_size}")
        if c.data.is_tokens:
            parts.append(f"seq{c.data.seq_len}")
            if c.on_policy is not None:
                parts.append(f"on-policy{c.on_policy.new_tokens}")
            if shown("loss_impl", c.loss_impl != "dense"):
                parts.append(c.loss_impl)
            if c.data.tokenizers is not None:  # a cross-tokenizer pair: each side's tokenizer
                sides = (c.data.tokenizers.teacher, c.data.tokenizers.student)
                parts.append("tok-" + "->".join(side.replace("\\", "/").rsplit("/", 1)[-1] for side in sides))
            if c.method == "uld" and c.uld.alignment != "position":  # ULD's rows paired by the text read
                parts.append(f"uld-{c.uld.alignment}")
            if c.generation.cache != "dynamic" or c.generation.compile:  # the decode rows' generation backend
                parts.append(f"{c.generation.cache}-cache" + ("-compiled" if c.generation.compile else ""))
            if c.inference.speculative is not None:
                parts.append("spec-draft" + ",".join(str(g) for g in c.inference.speculative.draft_tokens))
        if shown("memory_format", c.memory_format != "contiguous"):
            parts.append(c.memory_format)
        if shown("alignment", c.alignment != 64):
            parts.append(f"align{c.alignment}")
        if shown("pad_to", c.pad_to != 1):
            parts.append(f"pad{c.pad_to}")
        if shown("world_size", c.world_size != 1):
            parts.append(f"ws{c.world_size}" + ("-fsdp" if c.parallel == "fsdp" else ""))
        if shown("seed", c.seed != 0):
            parts.append(f"seed{c.seed}")
        if shown("compile", c.compile != "off"):
            parts.append(f"compile-{c.compile}")
        if shown("optimizer.impl", c.optimizer.impl != "default"):
            parts.append(c.optimizer.impl if c.optimizer.impl != "default" else "optimizer-default")
        for key, on, text in (
            ("compile_teacher", c.compile_teacher, "compile-teacher"),
            ("conv_autotune", c.conv_autotune, "conv-autotune"),
            ("tunableop", c.tunableop, "tunableop"),
            ("graphs", c.graphs, "graphs"),
        ):
            if shown(key, bool(on)):
                parts.append(text if on else f"{text}-off")
        if shown("inference.runtime", c.inference.runtime != "eager"):
            parts.append(f"serve-{c.inference.runtime}")
        return " ".join(parts)


# --------------------------------------------------------------------------- sweep helpers


def axis_path(axis: str) -> tuple[str, ...]:
    return tuple(axis.split("."))


def nest(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    for key in reversed(path):
        value = {key: value}
    return value  # type: ignore[return-value]


def overlay(axis: str, value: Any) -> dict[str, Any]:
    """What one matrix value lays over the defaults."""
    return value if axis == CASES else nest(axis_path(axis), value)


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` laid on `base`; nested mappings merge key by key, anything else replaces."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "pair":
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def check_axis_name(suite: Suite, loc: tuple, key: str) -> tuple[str, ...]:
    """A matrix axis or exclude key (at `loc`) must name a cell setting, dotted for nested ones."""
    path = axis_path(key)
    model: Any = CellConfig
    for i, part in enumerate(path):
        names = list(model.model_fields) if model else []
        if part not in names:
            raise suite.error(loc, f"unknown key '{key}'; {unknown_key_hint(part, model, path[:i]).rstrip()}")
        model = sub_model(model, part)
        if model is None and i < len(path) - 1:
            raise suite.error(loc, f"'{part}' has no sub-keys; sweep '{'.'.join(path[: i + 1])}' itself")
    return path


# --------------------------------------------------------------------------- identity


def used_methods(config: CellConfig) -> list:
    """The registered methods among the terms of the cell's method (unknown terms are the checks' to report)."""
    return [METHODS[p] for p in method_parts(config.method) if p in METHODS]


def config_dict(config: CellConfig) -> dict[str, Any]:
    """The resolved config, without the settings of methods the cell does not use.

    A kd cell does not depend on `at.beta` (nor a world_size 1 cell on `ddp`), so sweeping
    it there gives the same cell (and the plan says so) instead of copies with different ids.
    """
    out = config.model_dump(mode="json")
    used = used_methods(config)
    for name in set(METHODS) - {m.name for m in used}:
        out.pop(name, None)
    if not any(m.cls.needs_features for m in used):
        out.pop("features", None)
    if config.world_size == 1 or config.parallel != "ddp":
        out.pop("ddp", None)  # DDP options do not touch a single-device cell, nor an FSDP one
    if config.parallel != "fsdp":
        out.pop("fsdp", None)
    if config.teacher.mode not in ("topk_cache", "offline"):
        out["teacher"].pop("k", None)  # only the top-k cache and an offline store keep k entries
    if config.teacher.mode != "offline":  # the store's settings: an offline teacher's alone
        for key in ("store", "values", "indices", "compression", "top_p", "store_tokens", "page_cache", "corpus"):
            out["teacher"].pop(key, None)
    if out["teacher"].get("corpus", 0) is None:
        out["teacher"].pop("corpus")  # the stdlib text: the ids of offline cells from before teacher.corpus
    # Image data has no tokens, token data no image shape or classes.
    for key in (*IMAGE_DATA_KEYS, *TOKEN_DATA_KEYS):
        if key not in config.data.applies:
            out["data"].pop(key, None)
    # A lever (or a later timing setting) at its default is left out, so cells that use none keep the ids
    # they had before it existed.
    for key, default in IDENTITY_DEFAULTS.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.get(p, {})
        if node.get(leaf, default) == default:
            node.pop(leaf, None)
    if not out.get("overrides"):
        out.pop("overrides", None)  # no model overrides: the ids of cells from before they existed
    if not out.get("generation"):
        out.pop("generation", None)  # the default generation backend: the ids of cells from before it existed
    return out


def cell_id_of(config: CellConfig) -> str:
    canonical = json.dumps(config_dict(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def method_params(config: CellConfig) -> dict[str, Any]:
    """The hyper-parameters of the cell's method terms (and `weights` when set), by suite key."""
    keys = {m.name for m in used_methods(config)} | ({"weights"} if config.weights else set())
    return {k: v for k, v in config_dict(config).items() if k in keys}


# --------------------------------------------------------------------------- expansion


def _matches(entry: Any, value: Any) -> bool:
    if isinstance(entry, dict) and isinstance(value, dict):
        return all(k in value and _matches(v, value[k]) for k, v in entry.items())
    return entry == value


def _excluded(config: dict[str, Any], excludes: list[dict[str, Any]]) -> bool:
    return any(all(_matches(nest(axis_path(k), v), config) for k, v in entry.items()) for entry in excludes)


def with_corpus_path(config: CellConfig, suite_path: Path | str | None) -> CellConfig:
    """``config`` with a relative ``teacher.corpus`` path made absolute against the suite file's folder (where the
    user who wrote it looked), so every worker and rank reads the same file whatever its working folder."""
    corpus = config.teacher.corpus
    if corpus is None or suite_path is None or Path(corpus.path).expanduser().is_absolute():
        return config
    path = str(Path(suite_path).resolve().parent / corpus.path)
    teacher = config.teacher.model_copy(update={"corpus": corpus.model_copy(update={"path": path})})
    return config.model_copy(update={"teacher": teacher})


Check = Callable[[CellConfig, bool, int], list[tuple[tuple[str, ...], str]]]


def expand(suite: Suite, check: Check) -> list[Cell]:
    """The suite's cells, in matrix order, each checked by ``check(config, allow_imports, nnodes)``, which returns
    what cannot run in a cell as (setting path, message): the first of them is raised, naming the file and the
    key (:func:`kdbench.workloads.check_cell` knows the families; config does not).  Raises KdbenchError on an
    empty plan."""
    axes = list(suite.matrix)
    cells: list[Cell] = []
    seen: set[str] = set()
    repeats = 0
    for combo in itertools.product(*(suite.matrix[a] for a in axes)):
        raw = dict(suite.defaults)
        for axis, value in zip(axes, combo):
            raw = deep_merge(raw, overlay(axis, value))
        if raw.get("pair") is None:
            raise suite.error(("defaults",), "no teacher/student pair; set defaults.pair or a matrix.pair axis")
        try:
            config = CellConfig.model_validate(raw)
        except ValidationError as exc:
            raise validation_error(suite.path, suite.lines, exc, ("defaults",), CellConfig) from None
        config = with_corpus_path(config, suite.path)
        if _excluded(config_dict(config), suite.exclude):
            continue
        cell = Cell(index=len(cells), cell_id=cell_id_of(config), config=config)
        if cell.cell_id in seen:
            repeats += 1
            continue
        seen.add(cell.cell_id)
        cells.append(cell)
    if not cells:
        raise suite.error(("exclude",), "excludes every cell, so there is nothing to run; loosen the exclude entries")
    if repeats:
        logger.info(
            "%d combination(s) of the matrix repeat a planned cell: they differ from it only in settings it does not "
            "use (ddp at world_size 1, the parameters of a method it does not use) or repeat a value; each cell is "
            "planned once",
            repeats,
        )
    for cell in cells:
        for key, message in check(cell.config, suite.allow_imports, suite.launcher.nnodes):
            raise suite.error(suite.locate(*key), message)
    return distinct_labels(cells, tuple(suite.matrix))


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys and their values' JSON."""
    out: dict[str, str] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v, sort_keys=True, separators=(",", ":"))
    return out


# The settings a short label shows away from their defaults (Cell.short_label), by their dotted keys.
LABEL_KEYS = (
    "teacher.mode",
    "teacher_precision",
    "teacher.weights",
    "loss_impl",
    "memory_format",
    "alignment",
    "pad_to",
    "world_size",
    "seed",
    "compile",
    "optimizer.impl",
    "compile_teacher",
    "conv_autotune",
    "tunableop",
    "graphs",
    "inference.runtime",
)


def swept_keys(cells: list[Cell], axes: tuple[str, ...] = ()) -> frozenset[str]:
    """The :data:`LABEL_KEYS` that a matrix axis of ``axes`` names (itself or a mapping above it: ``optimizer`` for
    ``optimizer.impl``) and whose values differ between ``cells``.  A ``cases`` list is no axis of a setting: each
    case's own settings show as they are away from their defaults, the others' defaults are left out."""
    named = [k for k in LABEL_KEYS if any(k == a or k.startswith(a + ".") for a in axes if a != CASES)]
    flats = [_flat(c.config.model_dump(mode="json")) for c in cells]
    return frozenset(k for k in named if len({f.get(k) for f in flats}) > 1)


def distinct_labels(cells: list[Cell], axes: tuple[str, ...] = ()) -> list[Cell]:
    """The cells, each labelled with the settings the plan's matrix ``axes`` sweep (:func:`swept_keys`: a swept
    setting shows at its default too, ``dense`` beside ``chunked``), and those whose short labels still coincide
    told apart by `key=value` of every setting in which they differ (``kd.temperature=2.0``,
    ``data.shape=[3,64,64]``): the report keys its charts by label."""
    swept = swept_keys(cells, axes)
    cells = [replace(c, swept=swept) for c in cells]
    groups: dict[str, list[Cell]] = {}
    for cell in cells:
        groups.setdefault(cell.short_label, []).append(cell)
    extra: dict[str, str] = {}
    for group in groups.values():
        if len(group) < 2:
            continue
        flats = [_flat(config_dict(c.config)) for c in group]
        keys = sorted({k for f in flats for k in f})
        differ = [k for k in keys if len({f.get(k) for f in flats}) > 1]
        for cell, f in zip(group, flats):
            extra[cell.cell_id] = " ".join(f"{k}={f.get(k, 'null')}" for k in differ)
    return [replace(c, label_extra=extra[c.cell_id]) if c.cell_id in extra else c for c in cells]


# --------------------------------------------------------------------------- shards


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' (1 <= I <= N) -> (I, N)."""
    try:
        i, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise KdbenchError(f"--shard {text!r}: write I/N, e.g. 2/4 for the second of four shares") from None
    if not 1 <= i <= n:
        raise KdbenchError(f"--shard {text!r}: I must be between 1 and N")
    return i, n


def shard(cells: list[Cell], i: int, n: int) -> list[Cell]:
    """Share I of N: every N-th cell of the plan, starting at the I-th. The N shares partition the
    plan exactly, and depend only on the plan, so N machines given the same suite split it."""
    return [c for c in cells if c.index % n == i - 1]
