"""Measure one Cell: the only module that touches models, devices and timers.

``measure_cell`` returns one row (a dict of result columns) per planned
measurement: the distillation step, then student and teacher inference at each
inference batch size.  A measurement that raises becomes a ``failed`` row (``oom``
when the device ran out of memory) and the cell's other measurements still run.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kdbench.config.plan import Cell, planned_measurements
from kdbench.config.schema import CellConfig
from kdbench.distill.step import DistillStep
from kdbench.hw.backends import Backend, choose_autocast
from kdbench.hw.data import memory_format_of, synthetic_batch
from kdbench.hw.layout import pad_classifier, padded_width, verify_memory_format
from kdbench.measure.flops import (
    MemoryMeter,
    TelemetrySampler,
    count_flops,
    memory_columns,
    optimizer_state_bytes,
    telemetry_columns,
    trace,
)
from kdbench.measure.stats import summarize
from kdbench.measure.timing import RawTiming, timed_loop
from kdbench.models import build_model, count_params


class ModelCache:
    """Builds each model once per worker and hands out fresh copies of its initial weights.

    Building (random init of every layer) costs far more than copying, and a copy
    per cell keeps cells independent: no optimizer state, trained weights or
    batch-norm statistics leak from one cell into the next.
    """

    def __init__(self, allow_imports: bool = False, capacity: int = 6):
        self.allow_imports = allow_imports
        self.capacity = capacity
        self._models: OrderedDict[tuple, nn.Module] = OrderedDict()
        self.builds = 0

    def get(self, name: str, config: CellConfig) -> nn.Module:
        key = (name, config.data.num_classes, tuple(config.data.shape), config.seed)
        if key not in self._models:
            torch.manual_seed(config.seed)
            self._models[key] = build_model(
                name, config.data.num_classes, tuple(config.data.shape), allow_imports=self.allow_imports
            )
            self.builds += 1
            while len(self._models) > self.capacity:
                self._models.popitem(last=False)
        self._models.move_to_end(key)
        return copy.deepcopy(self._models[key])


def _status_of(exc: BaseException) -> str:
    return "oom" if isinstance(exc, torch.OutOfMemoryError) else "failed"


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:2000]


def failure_row(
    measurement: str, batch_size: int, exc: BaseException | None, status: str | None = None, error: str | None = None
) -> dict[str, Any]:
    return {
        "measurement": measurement,
        "batch_size": batch_size,
        "status": status or _status_of(exc),  # type: ignore[arg-type]
        "error": error or _error_text(exc),  # type: ignore[arg-type]
    }


def _timing_row(raw: RawTiming, world_size: int, batch_size: int) -> dict[str, Any]:
    summary = summarize(raw.samples_ms)
    return {
        **summary.as_row(),
        "first_ms": raw.first_ms,
        "samples_ms": raw.samples_ms,
        "timer": raw.clock,
        "throughput": world_size * batch_size / (summary.median_ms / 1e3) if summary.median_ms > 0 else None,
    }


def _time(fn: Callable[[], Any], config: CellConfig, backend: Backend) -> RawTiming:
    t = config.timing
    return timed_loop(
        fn, backend.clock(), warmup=t.warmup, min_iters=t.min_iters, min_time_s=t.min_time_s, max_iters=t.max_iters
    )


def _notes(*choices, alignment: str | None = None) -> str | None:
    notes = [f"{c.precision}: {c.note}" for c in choices if c.note] + ([alignment] if alignment else [])
    return "; ".join(dict.fromkeys(notes)) or None


def _alignment_note(x: torch.Tensor, config: CellConfig) -> str | None:
    if config.alignment < x.element_size():
        return (
            f"alignment {config.alignment} is below the {x.element_size()}-byte element size of the input; "
            f"placed at {x.element_size()}"
        )
    return None


def _layout(model: nn.Module, x: torch.Tensor, config: CellConfig) -> dict[str, Any]:
    """What the cell's layout settings realised, checked on the real tensors."""
    out = model.module if hasattr(model, "module") else model  # DDP wraps the student
    return {
        "data_ptr_mod64": x.data_ptr() % 64,
        "memory_format_verified": verify_memory_format(out, x, config.memory_format),
        "padded_classes": padded_width(config.data.num_classes, config.pad_to),
    }


def _on_device(model: nn.Module, config: CellConfig, backend: Backend) -> nn.Module:
    fmt = memory_format_of(config.memory_format) if len(config.data.shape) == 3 else torch.contiguous_format
    return model.to(device=backend.device, memory_format=fmt)


def model_pair(config: CellConfig, backend: Backend, cache: ModelCache) -> tuple[nn.Module, nn.Module]:
    """Fresh copies of the cell's teacher and student, on the device in the cell's memory format."""
    assert config.pair is not None
    models = []
    for name in (config.pair.teacher, config.pair.student):
        model = cache.get(name, config)
        pad_classifier(model, config.data.num_classes, config.pad_to)  # before the memory format: new weights
        models.append(_on_device(model, config, backend))
    return models[0], models[1]


@dataclass(frozen=True)
class MeasureOptions:
    """How a worker measures, beyond the cell's config (not part of the cell's identity)."""

    trace_dir: str | None = None  # write a torch.profiler Chrome trace of each cell's step here


def timed_with_profile(
    fn: Callable[[], Any], config: CellConfig, backend: Backend, batch_size: int
) -> tuple[RawTiming, dict[str, Any]]:
    """The timed loop, with memory and (on GPUs) telemetry watched over it."""
    with MemoryMeter(backend) as memory, TelemetrySampler(backend) as telemetry:
        raw = _time(fn, config, backend)
    tele = telemetry.result(len(raw.samples_ms), batch_size, raw.window_s)
    steady = raw.time_to_steady()
    return raw, {
        **memory_columns(memory.result()),
        **telemetry_columns(tele),
        "time_to_steady_ms": steady[0] if steady else None,
        "steady_after_iters": steady[1] if steady else None,
    }


def step_flops(step: DistillStep) -> dict[str, Any]:
    """FLOPs of one more step, counted after the timed loop (teacher forward apart when live)."""
    teacher = None if step.cache is not None else count_flops(lambda: step.distiller.teacher_outputs(step.x))
    total = count_flops(step)
    return {"flops": total, "teacher_forward_flops": teacher, "student_flops": total - (teacher or 0)}


def measure_distill_step(
    teacher: nn.Module,
    student: nn.Module,
    config: CellConfig,
    backend: Backend,
    options: MeasureOptions = MeasureOptions(),
    trace_name: str = "cell",
) -> dict[str, Any]:
    x, y = synthetic_batch(config, config.batch_size, backend.device, config.seed)
    step = DistillStep(teacher, student, x, y, config, backend)
    raw, profile = timed_with_profile(step, config, backend, config.batch_size)
    loss = float(step.last_loss) if step.last_loss is not None else math.nan
    row = distill_row(step, raw, config, x, loss)
    row.update(profile, **step_flops(step), optimizer_state_bytes=optimizer_state_bytes(step.optimizer))
    if options.trace_dir:
        row.update(trace(step, backend, Path(options.trace_dir) / f"{trace_name}.json"))
    return row


def phase_columns(step: DistillStep, raw: RawTiming) -> dict[str, Any]:
    """Median of each phase over the timed iterations, and of what the phases leave out of the step."""
    phases = step.phase_ms(len(raw.samples_ms))
    if not phases:
        return {}
    row = {f"phase_{p}_ms": statistics.median(v) for p, v in phases.items()}
    rest = [total - sum(parts) for total, *parts in zip(raw.samples_ms, *phases.values())]
    row["phase_remainder_ms"] = statistics.median(rest)
    return row


def distill_row(step: DistillStep, raw: RawTiming, config: CellConfig, x: torch.Tensor, loss: float) -> dict[str, Any]:
    """The distill_step row of a timed step; failed when the loss is not finite."""
    d = step.distiller
    row = {
        "measurement": "distill_step",
        "batch_size": config.batch_size,
        "status": "ok",
        **_timing_row(raw, config.world_size, config.batch_size),
        "final_loss": loss,
        "autocast": step.student_ac.applied,
        "teacher_autocast": step.teacher_ac.applied,
        "grad_scaler": step.scaler is not None,
        "nonfinite_steps": d.nonfinite_steps,
        "scaler_skips": d.scaler_skips,
        "adapter_params": d.adapter_params,
        "trainable_params": count_params(d.trainee),
        "teacher_features": ",".join(d.paths.teacher) if d.paths else None,
        "student_features": ",".join(d.paths.student) if d.paths else None,
        "teacher_cache_ms": step.cache_ms,
        **phase_columns(step, raw),
        **_layout(step.student, x, config),
        "notes": _notes(step.student_ac, step.teacher_ac, alignment=_alignment_note(x, config)),
    }
    if not math.isfinite(loss):
        row.update(status="failed", error=f"the distillation loss is not finite ({loss}); lower lr or use bf16/fp32")
    return row


def measure_inference(
    model: nn.Module, role: str, batch_size: int, config: CellConfig, backend: Backend
) -> dict[str, Any]:
    """Forward latency in eval() under inference_mode, at the cell's precision."""
    x, _ = synthetic_batch(config, batch_size, backend.device, config.seed + 1)
    choice = choose_autocast(backend, config.precision)
    model.eval()

    def forward() -> None:
        with torch.inference_mode(), choice.context(backend.device_type):
            model(x)

    raw, profile = timed_with_profile(forward, config, backend, batch_size)
    return {
        "measurement": f"{role}_inference",
        "batch_size": batch_size,
        "status": "ok",
        **_timing_row(raw, 1, batch_size),
        **profile,
        "flops": count_flops(forward),
        "autocast": choice.applied,
        **_layout(model, x, config),
        "notes": _notes(choice, alignment=_alignment_note(x, config)),
    }


def _guarded(measurement: str, batch_size: int, backend: Backend, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as exc:  # a failing measurement is a result, not a crash
        if backend.device_type == "cuda":
            torch.cuda.empty_cache()
        return failure_row(measurement, batch_size, exc)


def measure_cell(
    cell: Cell, backend: Backend, cache: ModelCache, options: MeasureOptions = MeasureOptions()
) -> list[dict[str, Any]]:
    config = cell.config
    planned = planned_measurements(config)
    try:
        teacher, student = model_pair(config, backend, cache)
    except Exception as exc:
        return [failure_row(m, bs, exc) for m, bs in planned]
    params = {"student_params": count_params(student), "teacher_params": count_params(teacher)}

    rows = [
        _guarded(
            "distill_step",
            config.batch_size,
            backend,
            lambda: measure_distill_step(teacher, student, config, backend, options, cell.cell_id),
        )
    ]
    for bs in config.inference.batch_sizes:
        srow = _guarded(
            "student_inference", bs, backend, lambda: measure_inference(student, "student", bs, config, backend)
        )
        rows.append(srow)
        if config.inference.teacher:
            trow = _guarded(
                "teacher_inference", bs, backend, lambda: measure_inference(teacher, "teacher", bs, config, backend)
            )
            rows.append(trow)
            if srow["status"] == trow["status"] == "ok":
                srow["speedup_vs_teacher"] = trow["median_ms"] / srow["median_ms"]
    for row in rows:
        row.update(params)
    return rows
