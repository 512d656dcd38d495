"""Measure one Cell: the distillation step, then inference, on one device or as one data-parallel rank.

:func:`measure_cell` returns one row (a dict of result columns) per planned
measurement (:func:`kdbench.config.plan.planned_measurements`): the distillation
step, then student and teacher inference at each inference batch size.  Every
measurement is guarded the same way: one that raises becomes a ``failed`` row
(``oom`` when the device ran out of memory) and the cell's other measurements still
run.

Data parallelism.  With ``dp``, every rank of the group calls :func:`measure_cell`
with the same cell and runs the same step measurement (:mod:`kdbench.measure.parallel`:
DDP, one agreed iteration count, each iteration at its slowest rank).  A step that
raises on one rank cannot be turned into a row there: its partners are waiting in a
collective, so the exception ends the rank and the launcher stores the cell as
failed.  Rank 0 then measures inference alone, guarded as everywhere, and returns
the rows; the other ranks return None.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kdbench.config.plan import Cell, planned_measurements
from kdbench.config.schema import CellConfig
from kdbench.distill.step import DistillStep
from kdbench.hw.backends import AutocastChoice, Backend, choose_autocast, math_flags, math_mode
from kdbench.hw.data import synthetic_batch
from kdbench.hw.layout import pad_classifier, padded_width, place_model, verify_memory_format
from kdbench.measure import walltime
from kdbench.measure.failures import (
    device_fatal,
    device_lost,
    error_text,
    failure_row,
    not_run_after_device_lost,
    note_device_lost,
    status_of,
)
from kdbench.measure.flops import count_flops
from kdbench.measure.levers import (
    LeverWatch,
    device_kind,
    device_levers,
    eager,
    quiesce_compile_workers,
    release_compiled,
    skip_reason,
    tunableop_file,
)
from kdbench.measure.memory import MemoryMeter, memory_columns, model_state_bytes, optimizer_state_bytes
from kdbench.measure.parallel import DataParallel
from kdbench.measure.runtimes import Served, serve
from kdbench.measure.serving import LeverSkip
from kdbench.measure.stats import summarize
from kdbench.measure.telemetry import TelemetrySampler, telemetry_columns
from kdbench.measure.timing import Progress, RawTiming, timed_loop
from kdbench.measure.trace import trace
from kdbench.models import ModelCache, count_params
from kdbench.names import GENERATE, PHASES, REMAINDER_COLUMN, Measurement, Status
from kdbench.schema import Row
from kdbench.workloads import workload_of


@dataclass(frozen=True)
class MeasureOptions:
    """How a worker measures, beyond the cell's config (not part of the cell's identity)."""

    trace_dir: str | None = None  # write a torch.profiler Chrome trace of each cell's step here
    run_dir: str | None = None  # the run's folder: TunableOp's results file is kept there


def cell_model(name: str, config: CellConfig, backend: Backend, cache: ModelCache) -> nn.Module:
    """A fresh copy of model ``name`` as the cell uses it: its classifier padded, on the device in the
    cell's memory format."""
    model = cache.get(name, config.data.num_classes, tuple(config.data.shape), config.seed)
    pad_classifier(model, config.data.num_classes, config.pad_to)  # before the memory format: new weights
    return place_model(model, backend.device, config.memory_format, len(config.data.shape) == 3)


def model_pair(config: CellConfig, backend: Backend, cache: ModelCache) -> tuple[nn.Module, nn.Module]:
    """Fresh copies of the cell's teacher and student, on the device in the cell's memory format."""
    teacher = cell_model(config.pair.teacher, config, backend, cache)
    return teacher, cell_model(config.pair.student, config, backend, cache)


# --------------------------------------------------------------------------- timing


CELL_BUDGET_S = {"cpu": 300.0}  # a cell's default time budget per backend (none on GPUs)
logger = logging.getLogger(__name__)


def measurement_budget_s(config: CellConfig, backend: Backend) -> float | None:
    """A measurement's share of its cell's time budget (``timing.cell_budget_s``, else the backend's)."""
    budget = config.timing.cell_budget_s or CELL_BUDGET_S.get(backend.name)
    return budget / len(planned_measurements(config)) if budget else None


def _progress(what: str) -> Progress:
    def tell(phase: str, done: int, planned: int, per_call_s: float) -> None:
        left = max(planned - done, 0) * per_call_s
        logger.info(
            "  ... %s: %s %d/%d, %.3g s per call, ~%.0f s left of this measurement",
            what,
            phase,
            done,
            planned,
            per_call_s,
            left,
        )

    return tell


def _time(
    fn: Callable[[], Any],
    config: CellConfig,
    backend: Backend,
    dp: DataParallel | None,
    on_window=None,
    what: str = "",
) -> RawTiming:
    if dp is not None:
        return dp.timed(fn, config, backend, on_window)
    t = config.timing
    return timed_loop(
        fn,
        backend.clock(),
        warmup=t.warmup,
        min_iters=t.min_iters,
        min_time_s=t.min_time_s,
        max_iters=t.max_iters,
        on_window=on_window,
        target_rel_ci=t.target_rel_ci,
        max_time_s=t.max_time_s,
        budget_s=measurement_budget_s(config, backend),
        progress=_progress(what),
    )


def timed_with_profile(
    fn: Callable[[], Any],
    config: CellConfig,
    backend: Backend,
    batch_size: int,
    dp: DataParallel | None = None,
    watch: LeverWatch | None = None,
    what: str = "",
) -> tuple[RawTiming, Row, str]:
    """The timed loop, with memory and (on GPUs) telemetry watched over it, and the levers' counters
    (``watch``); and a note on them."""
    with MemoryMeter(backend) as memory, TelemetrySampler(backend) as telemetry:
        on_window = watch.chain(telemetry.on_window) if watch is not None else telemetry.on_window
        raw = _time(fn, config, backend, dp, on_window, what)
    walltime.add(walltime.COLD, raw.cold_s)
    walltime.add(walltime.WARMUP, raw.warmup_s)
    if raw.window_s:
        walltime.add(walltime.MEASURING, raw.window_s[1] - raw.window_s[0])
    tele = telemetry.result(len(raw.samples_ms), batch_size, raw.window_s)
    return raw, {**memory_columns(memory.result()), **telemetry_columns(tele)}, tele.note


def timing_columns(raw: RawTiming, world_size: int, batch_size: int) -> Row:
    summary = summarize(raw.samples_ms)
    steady = raw.time_to_steady()
    window_ms = (raw.window_s[1] - raw.window_s[0]) * 1e3 if raw.window_s else None
    return {
        "host_ms": statistics.median(raw.host_ms) if raw.host_ms else None,
        "launch_bound": raw.launch_bound(summary.median_ms),
        "window_ms": window_ms,
        **summary.as_row(),
        "thin": raw.thin,
        "first_ms": raw.first_ms,
        "cold_excess_ms": raw.cold_excess_ms(summary.median_ms),
        "samples_ms": raw.samples_ms,
        "timer": raw.clock,
        "throughput": world_size * batch_size / (summary.median_ms / 1e3) if summary.median_ms > 0 else None,
        "window_throughput": (world_size * batch_size * len(raw.samples_ms) / (window_ms / 1e3) if window_ms else None),
        "time_to_steady_ms": steady[0] if steady else None,
        "steady_after_iters": steady[1] if steady else None,
    }


def token_columns(tokens: int | None, median_ms: float, ranks: int = 1) -> Row:
    """Tokens per timed call (per rank) and per second (all ``ranks``) of a token workload's measurement, at the
    median call (:func:`timing_columns`' ``median_ms``); nothing for other workloads."""
    if tokens is None:
        return {}
    per_s = ranks * tokens / (median_ms / 1e3) if median_ms > 0 else None
    return {"tokens": tokens, "tokens_per_s": per_s}


# --------------------------------------------------------------------------- row parts


LAUNCH_BOUND = (
    "launch-bound: issuing a call costs the host about as long as the device runs it, so this measures Python "
    "and kernel launches, not the GPU"
)


def _notes(*choices, alignment: str | None = None, extra: tuple[str, ...] = ()) -> str | None:
    notes = [f"{c.precision}: {c.note}" for c in choices if c.note] + [n for n in (*extra, alignment) if n]
    return "; ".join(dict.fromkeys(notes)) or None


def layout_note(config: CellConfig, device_type: str) -> str:
    """ROCm: PyTorch hands MIOpen NCHW tensors unless PYTORCH_MIOPEN_SUGGEST_NHWC=1, so a channels_last
    cell measures layout conversions around NCHW kernels (the strides still verify)."""
    rocm = device_type == "cuda" and bool(getattr(torch.version, "hip", None))
    if not rocm or config.memory_format != "channels_last" or os.environ.get("PYTORCH_MIOPEN_SUGGEST_NHWC") == "1":
        return ""
    return (
        "channels_last on ROCm without PYTORCH_MIOPEN_SUGGEST_NHWC=1: MIOpen runs NCHW kernels with layout "
        "conversions around them (set it, and PYTORCH_MIOPEN_SUGGEST_NHWC_BATCHNORM=1, for NHWC kernels)"
    )


def _alignment_note(x: torch.Tensor, config: CellConfig) -> str | None:
    if config.alignment < x.element_size():
        return (
            f"alignment {config.alignment} is below the {x.element_size()}-byte element size of the input; "
            f"placed at {x.element_size()}"
        )
    return None


def _layout(model: nn.Module, x: torch.Tensor, config: CellConfig) -> Row:
    """What the cell's layout settings realised, checked on the real tensors."""
    return {
        "data_ptr_mod64": x.data_ptr() % 64,
        "memory_format_verified": verify_memory_format(model, x, config.memory_format),
        "padded_classes": padded_width(config.data.num_classes, config.pad_to),
    }


def step_flops(step: DistillStep) -> Row:
    """FLOPs of one more step, counted after the timed loop (teacher forward apart when live)."""
    d = step.distiller  # the teacher's input of the last step (an on-policy step's is its generated batch)
    teacher = None if step.cache is not None else count_flops(lambda: d.teacher_outputs(d.last_input))
    total = count_flops(step)
    return {"flops": total, "teacher_forward_flops": teacher, "student_flops": total - (teacher or 0)}


def phase_columns(step: DistillStep, raw: RawTiming) -> Row:
    """Median of each phase over the timed iterations, and of what the phases leave out of the step.

    Read right after the timed loop: any later call of the step (FLOP counting, tracing)
    adds stamps of its own.  ``raw`` is this process's own timing (under data parallelism
    the phases are rank 0's, and so is the step time they are taken from)."""
    phases = step.phase_ms(len(raw.samples_ms))
    if not phases:
        return {}
    row = {p.column: statistics.median(phases[p.name]) for p in (*PHASES, GENERATE) if p.name in phases}
    rest = [total - sum(parts) for total, *parts in zip(raw.samples_ms, *phases.values())]
    row[REMAINDER_COLUMN] = statistics.median(rest)
    return row


def distill_row(
    step: DistillStep,
    raw: RawTiming,
    config: CellConfig,
    x: torch.Tensor,
    loss: float,
    local: RawTiming | None = None,
    note: str = "",
) -> Row:
    """The distill_step row of a timed step; failed when the loss is not finite.  ``local`` is this
    process's own timing when ``raw`` was gathered from data-parallel ranks (the phases come from it)."""
    d = step.distiller
    workload = workload_of(config)
    timing = timing_columns(raw, config.world_size, config.batch_size)
    timing.update(
        token_columns(
            workload.tokens(Measurement.DISTILL_STEP, config.batch_size, config), timing["median_ms"], config.world_size
        )
    )
    family, family_notes = workload.step_columns(step, config, x)
    launch = LAUNCH_BOUND if timing["launch_bound"] else ""
    row = Row(
        {
            "measurement": Measurement.DISTILL_STEP,
            "batch_size": config.batch_size,
            "status": Status.OK,
            **timing,
            "final_loss": loss,
            "autocast": d.student_ac.applied,
            "teacher_autocast": d.teacher_ac.applied,
            "grad_scaler": d.scaler is not None,
            "nonfinite_steps": d.nonfinite_steps,
            "scaler_skips": d.scaler_skips,
            "adapter_params": d.adapter_params,
            "trainable_params": count_params(d.trainee),
            "teacher_features": ",".join(d.paths.teacher) if d.paths else None,
            "student_features": ",".join(d.paths.student) if d.paths else None,
            "teacher_cache_ms": step.cache_ms,
            **phase_columns(step, local or raw),
            **family,
            "notes": _notes(
                d.student_ac,
                d.teacher_ac,
                extra=(launch, d.optimizer_note, note, *family_notes, raw.note or ""),
            ),
        }
    )
    if not math.isfinite(loss):
        row.update(
            status=Status.FAILED, error=f"the distillation loss is not finite ({loss}); lower lr or use bf16/fp32"
        )
    return row


# --------------------------------------------------------------------------- measurements


def measure_distill_step(
    teacher: nn.Module,
    student: nn.Module,
    config: CellConfig,
    backend: Backend,
    options: MeasureOptions = MeasureOptions(),
    trace_name: str = "cell",
    dp: DataParallel | None = None,
) -> Row | None:
    """The distill_step row (None on data-parallel ranks other than 0, which only take part)."""
    rank = dp.rank if dp is not None else 0
    x, y = workload_of(config).batch(config, config.batch_size, backend.device, config.seed + rank)
    watch = LeverWatch(config)  # before the step is built: it resets torch._dynamo
    wrap, wrap_teacher = (dp.wrapper(config, backend), dp.teacher_wrapper(config, backend)) if dp else (None, None)
    step = DistillStep(teacher, student, x, y, config, backend, wrap=wrap, wrap_teacher=wrap_teacher)
    try:
        with math_mode(step.distiller.student_ac.tf32):
            what = f"{config.pair.teacher}->{config.pair.student} {config.precision} distill_step"
            raw, profile, note = timed_with_profile(step, config, backend, config.batch_size, dp, watch, what)
            loss = float(step.last_loss) if step.last_loss is not None else math.nan
            local = raw
            if dp is not None:
                raw, loss = dp.slowest(raw, backend), dp.mean(loss, backend)
            row = distill_row(step, raw, config, x, loss, local, note) if rank == 0 else None
            if raw.note:  # over its time budget: no extra step to count FLOPs
                flops = {}
            else:
                with eager() if watch.compiled else contextlib.nullcontext(), walltime.spent(walltime.FLOPS):
                    flops = step_flops(step)  # every rank: under DDP the counted step runs the collectives
            traced = {}
            if options.trace_dir:  # every rank runs the traced calls; rank 0 writes the trace
                path = Path(options.trace_dir) / f"{trace_name}.json" if rank == 0 else None
                with walltime.spent(walltime.PROFILING):
                    traced = trace(step, backend, path)
            flags = math_flags()
        if row is not None:
            row.update(profile, **flops, **traced, **flags, **watch.columns(raw, row["median_ms"]))
            d = step.distiller
            row["optimizer_state_bytes"] = optimizer_state_bytes(d.optimizer)
            row["model_state_bytes"] = model_state_bytes((d.teacher, d.trainee), d.optimizer)
        return row
    finally:
        step.close()
        if watch.compiled:  # its CUDA graph pool would count in the next measurement's peaks
            release_compiled(backend)


def inference_forward(
    model: nn.Module, batch_size: int, config: CellConfig, backend: Backend
) -> tuple[Callable[[], Any], torch.Tensor, AutocastChoice]:
    """The call inference measurements time: ``model`` (put in eval()) on a fixed synthetic batch, under
    inference_mode and the cell's precision; with that batch and the precision's choice.  Time it
    inside ``math_mode(choice.tf32)``."""
    x, _ = synthetic_batch(config, batch_size, backend.device, config.seed + 1)
    choice = choose_autocast(backend, config.precision)
    model.eval()

    def forward() -> Any:
        with torch.inference_mode(), choice.context(backend.device_type):
            return model(x)

    return forward, x, choice


_FLOPS: dict[tuple, int] = {}  # this worker's inference FLOP counts: identical models and inputs count once


def inference_flops(forward: Callable[[], Any], model: str, batch_size: int, config: CellConfig) -> int:
    """The FLOPs of ``model``'s eager forward at ``batch_size`` (the same at every precision), counted once
    per worker process for each model, classifier width and input."""
    key = (model, config.data.num_classes, config.pad_to, tuple(config.data.shape), batch_size, config.seed)
    if key not in _FLOPS:
        _FLOPS[key] = count_flops(forward)
    return _FLOPS[key]


def served_columns(served: Served) -> Row:
    check = served.check
    return {
        "one_off_ms": served.one_off_ms,
        "one_off_kind": served.one_off_kind,
        "graph_breaks": served.graph_breaks,
        "compiled_graphs": served.compiled_graphs,
        "output_check": check.text() if check is not None else None,
        "output_max_abs_diff": check.max_abs_diff if check is not None else None,
        "output_top1_agreement": check.top1_agreement if check is not None else None,
    }


def measure_inference(model: nn.Module, role: str, batch_size: int, config: CellConfig, backend: Backend) -> Row:
    """Forward latency in eval() under inference_mode, at the cell's precision; the student served by the
    cell's ``inference.runtime`` (and replayed from a graph with ``graphs``), its outputs checked against
    eager's first (:mod:`kdbench.measure.runtimes`).  The teacher is served eagerly."""
    forward, x, choice = inference_forward(model, batch_size, config, backend)
    served = None
    if role == "student" and (config.inference.runtime != "eager" or config.graphs):
        with walltime.spent(walltime.LEVERS):
            served = serve(model, x, config.inference.runtime, config, backend, graphs=config.graphs)
            if config.inference.runtime == "compile":
                quiesce_compile_workers()  # inductor's worker pool would start up while this is timed
    with math_mode(choice.tf32):
        timed = served.forward if served is not None else forward
        what = f"{config.pair.teacher}->{config.pair.student} {config.precision} {role}_inference bs{batch_size}"
        raw, profile, note = timed_with_profile(timed, config, backend, batch_size, what=what)
        flags = math_flags()
        with walltime.spent(walltime.FLOPS):
            flops = None if raw.note else inference_flops(forward, getattr(config.pair, role), batch_size, config)
    if served is not None and served.compiled:
        release_compiled(backend)  # the compiled forward's CUDA graph pool, before the next measurement's peaks
    timing = timing_columns(raw, 1, batch_size)
    sync_notes = _synchronous_runtime(served, timing, profile, backend)
    launch = LAUNCH_BOUND if timing["launch_bound"] else ""
    served_row = served_columns(served) if served is not None else {}
    if served_row.get("one_off_ms") is not None:  # what serving this way paid once: the build and its cold calls
        served_row["one_off_ms"] += timing["cold_excess_ms"]
    return Row(
        {
            "measurement": Measurement(f"{role}_inference"),
            "batch_size": batch_size,
            "status": Status.OK,
            **timing,
            **profile,
            **flags,
            "flops": flops,
            "autocast": choice.applied,
            "runtime": served.runtime if served is not None else "eager",
            **served_row,
            **_layout(model, x, config),
            "notes": _notes(
                choice,
                alignment=_alignment_note(x, config),
                extra=(
                    launch,
                    note,
                    layout_note(config, backend.device_type),
                    raw.note or "",
                    *(served.notes if served else ()),
                    *sync_notes,
                ),
            ),
        }
    )


SYNCHRONOUS_RUNTIME = (
    "{runtime}'s calls block the host until the device is done, so host and device time agree by construction: "
    "launch-bound is not judged"
)
OWN_ALLOCATOR = (
    "{runtime} allocates device memory from its own arena, which torch's memory statistics do not see: the "
    "memory columns are left empty"
)


def _synchronous_runtime(served: Served | None, timing: Row, profile: Row, backend: Backend) -> list[str]:
    """A runtime outside torch (ONNX Runtime) on a GPU: never flagged launch-bound, memory columns empty;
    the notes that say so (``timing`` and ``profile`` are changed in place)."""
    if served is None or backend.device_type != "cuda" or not (served.synchronous or served.own_memory):
        return []
    notes = []
    if served.synchronous:
        timing["launch_bound"] = None
        notes.append(SYNCHRONOUS_RUNTIME.format(runtime=served.runtime))
    if served.own_memory:
        for column in ("peak_memory_bytes", "peak_reserved_bytes", "memory_growth_bytes", "memory_footprint_bytes"):
            profile[column] = None
        notes.append(OWN_ALLOCATOR.format(runtime=served.runtime))
    return notes


def failure_rows(config: CellConfig, status: Status, error: str) -> list[Row]:
    """Every planned row of the cell, marked."""
    planned = planned_measurements(config)
    return [Row(measurement=m, batch_size=bs, status=status, error=error) for m, bs in planned]


def guarded(measurement: str, batch_size: int, backend: Backend, fn: Callable[[], Row]) -> Row:
    """``fn()``'s row, or a failure row when it raises: a failing measurement is a result, not a crash.  Once a
    measurement has lost the device context, the later ones are not run (failed rows that say why)."""
    if device_lost():
        return Row(
            measurement=measurement, batch_size=batch_size, status=Status.FAILED, error=not_run_after_device_lost()
        )
    try:
        return fn()
    except LeverSkip as exc:  # a lever this backend lacks: skipped, with the reason
        row = Row(measurement=measurement, batch_size=batch_size, status=Status.SKIPPED, error=str(exc))
    except Exception as exc:
        if device_fatal(exc):
            note_device_lost(exc)  # the worker stores this job's rows, then ends (the next job gets a fresh one)
        row = failure_row(measurement, batch_size, exc)
    release(backend)  # after the handler: the traceback no longer pins the failed frames' tensors
    return row


def release(backend: Backend) -> None:
    """Free what a failed measurement left: collect it, and return the device's cached blocks."""
    gc.collect()
    if backend.device_type == "cuda" and not device_lost():
        try:
            torch.cuda.empty_cache()
        except RuntimeError:
            pass


def build_for_step(workload, config: CellConfig, backend: Backend, cache: ModelCache):
    """The pair the step trains. An FSDP2 cell on a GPU keeps its teacher on the host: ``fully_shard`` moves each
    unit to the device as it shards it, so no rank ever holds the whole teacher on its device (the pair that does
    not fit one device is the point of sharding). The student goes to the device whole, as under DDP."""
    if config.parallel != "fsdp" or backend.device_type == "cpu":
        return workload.build_pair(config, backend, cache)
    teacher, student = workload.build_pair(config, Backend("cpu", torch.device("cpu")), cache)
    return teacher, student.to(backend.device)


def measure_cell(
    cell: Cell,
    backend: Backend,
    cache: ModelCache,
    options: MeasureOptions = MeasureOptions(),
    dp: DataParallel | None = None,
    skip_teacher: tuple[int, ...] = (),
) -> list[Row] | None:
    """The cell's rows, one per planned measurement (None on data-parallel ranks other than 0), but the
    teacher inference at the batch sizes in ``skip_teacher`` (the engine reuses an earlier cell's)."""
    config = cell.config
    choices = [choose_autocast(backend, p) for p in (config.precision, config.teacher_precision)]
    workload = workload_of(config)
    skip = (
        next((c.skip for c in choices if c.skip), None)
        or skip_reason(config, backend)
        or workload.skip_reason(config, backend)
    )
    if skip:  # every rank sees the same, before any collective
        return None if dp is not None and not dp.root else failure_rows(config, Status.SKIPPED, skip)
    try:
        with walltime.spent(walltime.MODELS):
            teacher, student = build_for_step(workload, config, backend, cache)
    except Exception as exc:
        if dp is not None:
            raise
        return failure_rows(config, status_of(exc), error_text(exc))
    # Device-wide levers (cudnn.benchmark, TunableOp) hold for the cell: its step and its inference.
    tunable = tunableop_file(options.run_dir, device_kind(backend)) if config.tunableop else None
    with device_levers(config, backend, tunable) as lever_row:
        measure_step = partial(measure_distill_step, teacher, student, config, backend, options, cell.cell_id, dp)
        # A data-parallel step that raises ends the rank (see the module docstring): it is not guarded.
        step = (
            guarded(Measurement.DISTILL_STEP, config.batch_size, backend, measure_step)
            if dp is None
            else measure_step()
        )
        if dp is not None and not dp.root:
            dp.barrier()  # rank 0 measures inference alone
            return None
        if config.parallel == "fsdp":  # the step sharded the pair in place: rank 0 serves whole copies alone
            measure_step = teacher = student = None  # the shards are freed before the whole copies are built
            with walltime.spent(walltime.MODELS):
                teacher, student = workload.build_pair(config, backend, cache)
        rows = [step]
        for measurement, bs in planned_measurements(config)[1:]:  # serving, in the planned order
            if measurement == Measurement.TEACHER_INFERENCE and bs in skip_teacher:
                continue
            measure = partial(workload.measure, measurement, bs, teacher, student, config, backend)
            rows.append(guarded(measurement, bs, backend, measure))
    params = {"student_params": count_params(student), "teacher_params": count_params(teacher)}
    lever_notes = lever_row.pop("notes", None)
    for row in rows:
        row.update(params, **lever_row)
        if lever_notes and row["status"] == Status.OK:
            row["notes"] = "; ".join(n for n in (row.get("notes"), lever_notes) if n)
    if dp is not None:
        dp.barrier()
    return rows
