"""Suite -> Plan: the matrix expanded into Cells.

A cell is ``defaults`` overlaid with one combination of the matrix values (the
cartesian product, first axis slowest), minus the combinations an ``exclude``
entry matches.  An exclude entry matches a cell when every key it gives equals
the cell's value; a mapping value matches partially (``{pair: {student: x}}``
matches every pair whose student is x).

``cell_id`` is a hash of the resolved CellConfig, not of where it runs: the same
cell measured on a ROCm box and on a CUDA box has the same id, which is what lets
runs be compared cell by cell and resumed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from kdbench.config.schema import CellConfig, Suite, axis_path, deep_merge, nest, overlay, validate_cell
from kdbench.errors import KdbenchError

MEASUREMENTS = ("distill_step", "student_inference", "teacher_inference")


@dataclass(frozen=True)
class Cell:
    index: int
    cell_id: str
    config: CellConfig = field(compare=False)

    @property
    def label(self) -> str:
        c = self.config
        assert c.pair is not None
        parts = [f"{c.pair.teacher}->{c.pair.student}", c.method, c.precision]
        if c.teacher.mode != "live":
            parts.append(f"teacher-{c.teacher.mode}")
        if c.teacher_precision != "fp32":
            parts.append(f"teacher-{c.teacher_precision}")
        parts.append(f"bs{c.batch_size}")
        if c.memory_format != "contiguous":
            parts.append(c.memory_format)
        if c.alignment != 64:
            parts.append(f"align{c.alignment}")
        if c.pad_to != 1:
            parts.append(f"pad{c.pad_to}")
        if c.world_size != 1:
            parts.append(f"ws{c.world_size}")
        if c.seed != 0:
            parts.append(f"seed{c.seed}")
        return " ".join(parts)


def config_dict(config: CellConfig) -> dict[str, Any]:
    """The resolved config, without the settings of methods the cell does not use.

    A kd cell does not depend on `at.beta`, so sweeping it there gives the same
    cell (and the plan says so) instead of copies with different ids.
    """
    from kdbench.distill.losses import METHODS

    out = config.model_dump(mode="json")
    used = _used_methods(config)
    for method in METHODS.values():
        if method.params not in {m.params for m in used}:
            out.pop(method.params, None)
    if not any(m.cls.needs_features for m in used):
        out.pop("features", None)
    return out


def _used_methods(config: CellConfig) -> list:
    """The registered methods among the terms of the cell's method (unknown terms are the plan's to report)."""
    from kdbench.distill.losses import METHODS, method_parts

    return [METHODS[p] for p in method_parts(config.method) if p in METHODS]


def cell_id_of(config: CellConfig) -> str:
    canonical = json.dumps(config_dict(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _matches(entry: Any, value: Any) -> bool:
    if isinstance(entry, dict) and isinstance(value, dict):
        return all(k in value and _matches(v, value[k]) for k, v in entry.items())
    return entry == value


def _excluded(config: dict[str, Any], excludes: list[dict[str, Any]]) -> bool:
    for entry in excludes:
        if all(_matches(nest(axis_path(k), v), config) for k, v in entry.items()):
            return True
    return False


def expand(suite: Suite) -> list[Cell]:
    """The suite's cells, in matrix order, each validated; raises KdbenchError on an empty plan."""
    from kdbench.distill.hooks import check_feature_paths
    from kdbench.distill.losses import check_method, check_weights, needs_features
    from kdbench.models import check_model_input, check_model_name

    axes = list(suite.matrix)
    cells: list[Cell] = []
    seen: dict[str, str] = {}
    for combo in itertools.product(*(suite.matrix[a] for a in axes)):
        raw = dict(suite.defaults)
        for axis, value in zip(axes, combo):
            raw = deep_merge(raw, overlay(axis, value))
        config = validate_cell(suite, raw, ("defaults",))
        if config.pair is None:
            raise suite.error(("defaults",), "no teacher/student pair; set defaults.pair or a matrix.pair axis")
        if _excluded(config_dict(config), suite.exclude):
            continue
        cid = cell_id_of(config)
        cell = Cell(index=len(cells), cell_id=cid, config=config)
        if cid in seen:
            raise suite.error(
                ("matrix",), f"two combinations give the same cell ({cell.label}); remove the repeated value"
            )
        seen[cid] = cell.label
        cells.append(cell)
    if not cells:
        raise suite.error(("exclude",), "excludes every cell, so there is nothing to run; loosen the exclude entries")
    # Model names and the input shapes they accept, where the user wrote them.
    for cell in cells:
        pair = cell.config.pair
        for role in ("teacher", "student"):
            name = getattr(pair, role)
            try:
                check_model_name(name, allow_imports=suite.allow_imports)
                check_model_input(name, cell.config.data.shape)
            except KdbenchError as exc:
                loc = ("matrix", "pair") if "pair" in suite.matrix else ("defaults", "pair")
                raise suite.error(loc + (role,), str(exc)) from None
        nnodes = suite.launcher.nnodes
        if cell.config.world_size > 1 and cell.config.world_size % nnodes:
            loc = ("matrix", "world_size") if "world_size" in suite.matrix else ("defaults", "world_size")
            raise suite.error(
                loc,
                f"world_size {cell.config.world_size} does not split over launcher.nnodes {nnodes}; "
                "use a multiple of nnodes",
            )
        try:
            check_method(cell.config.method)
        except KdbenchError as exc:
            loc = ("matrix", "method") if "method" in suite.matrix else ("defaults", "method")
            raise suite.error(loc, str(exc)) from None
        if needs_features(cell.config.method):
            feats = cell.config.features
            if feats.teacher and feats.student and len(feats.teacher) != len(feats.student):
                loc = ("matrix", "features") if "features" in suite.matrix else ("defaults", "features")
                raise suite.error(
                    loc,
                    f"teacher lists {len(feats.teacher)} modules and student "
                    f"{len(feats.student)}; they are compared pairwise, so give both the same number",
                )
            for role in ("teacher", "student"):
                try:
                    check_feature_paths(
                        role,
                        getattr(pair, role),
                        getattr(feats, role),
                        cell.config.data.num_classes,
                        tuple(cell.config.data.shape),
                        suite.allow_imports,
                    )
                except KdbenchError as exc:
                    loc = ("matrix", "features") if "features" in suite.matrix else ("defaults", "features", role)
                    raise suite.error(loc, str(exc)) from None
        try:
            check_weights(cell.config.method, cell.config.weights)
        except KdbenchError as exc:
            loc = ("matrix", "weights") if "weights" in suite.matrix else ("defaults", "weights")
            raise suite.error(loc, str(exc)) from None
    return cells


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


def dist_backend_for(backend_name: str) -> str:
    """gloo on the CPU; nccl on GPUs (RCCL on ROCm, under the same name)."""
    return "gloo" if backend_name == "cpu" else "nccl"


def config_columns(config: CellConfig, backend_name: str) -> dict[str, Any]:
    """The result columns that come from a cell's config."""
    assert config.pair is not None
    return {
        "teacher": config.pair.teacher,
        "student": config.pair.student,
        "method": config.method,
        "precision": config.precision,
        "teacher_precision": config.teacher_precision,
        "memory_format": config.memory_format,
        "alignment": config.alignment,
        "pad_to": config.pad_to,
        "world_size": config.world_size,
        "dist_backend": None if config.world_size == 1 else dist_backend_for(backend_name),
        "ddp_bucket_cap_mb": config.ddp.bucket_cap_mb if config.world_size > 1 else None,
        "ddp_gradient_as_bucket_view": config.ddp.gradient_as_bucket_view if config.world_size > 1 else None,
        "ddp_static_graph": config.ddp.static_graph if config.world_size > 1 else None,
        "data_kind": config.data.kind,
        "data_shape": "x".join(map(str, config.data.shape)),
        "num_classes": config.data.num_classes,
        "kd_temperature": config.kd.temperature,
        "kd_alpha": config.kd.alpha,
        "teacher_mode": config.teacher.mode,
        "method_params": json.dumps(
            {k: v for k, v in config_dict(config).items() if k in _method_param_keys(config)}, sort_keys=True
        ),
        "optimizer": config.optimizer.name,
        "lr": config.optimizer.lr,
        "seed": config.seed,
        "warmup": config.timing.warmup,
        "min_iters": config.timing.min_iters,
        "min_time_s": config.timing.min_time_s,
        "config_json": json.dumps(config_dict(config), sort_keys=True),
    }


def _method_param_keys(config: CellConfig) -> set[str]:
    return {m.params for m in _used_methods(config)} | ({"weights"} if config.weights else set())


def planned_measurements(config: CellConfig) -> list[tuple[str, int]]:
    """(measurement, batch_size) of every row a cell produces, in order."""
    out = [("distill_step", config.batch_size)]
    for bs in config.inference.batch_sizes:
        out.append(("student_inference", bs))
        if config.inference.teacher:
            out.append(("teacher_inference", bs))
    return out
