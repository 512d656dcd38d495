"""The distillation step's measurement, the same for every family of pair: its row, FLOPs, phases and profile.

:func:`measure_distill_step` builds the cell's :class:`~kdbench.distill.step.DistillStep` on the workload's
fixed batch, times it (:func:`kdbench.measure.rows.profiled_loop`; under data parallelism every rank takes
part and each iteration counts at its slowest rank), then counts one more step's FLOPs, measures one more step's
live tensor peak (``live_peak_bytes``: what the fit planner's prediction is checked against), traces it when asked,
and returns the ``distill_step`` row (:func:`distill_row`); a non-finite loss makes it ``failed``.  What
differs between families (the batch, the tokens a step processes, the family's own columns) comes from the
workload it is handed (:class:`StepWorkload`); nothing here looks a workload up.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from kdbench.config.schema import CellConfig
from kdbench.core.names import AUTOGRAD, FIT_NOTE, LEAD_PHASES, PHASES, REMAINDER_COLUMN, Measurement, Status
from kdbench.core.schema import Row
from kdbench.core.worker_state import current
from kdbench.distill.step import DistillStep
from kdbench.hw.backends import Backend, math_flags, math_mode
from kdbench.measure import walltime
from kdbench.measure.flops import count, pair_label
from kdbench.measure.levers import LeverWatch, eager, release_compiled
from kdbench.measure.memory import model_state_bytes, optimizer_state_bytes, step_live_peak
from kdbench.measure.parallel import DataParallel
from kdbench.measure.rows import profiled_loop, timed_row
from kdbench.measure.timing import RawTiming
from kdbench.measure.trace import trace
from kdbench.models import count_params

# The step row's ``fit_check`` column: what became of its fit check (kdbench.run.cell writes it)
FIT_CHECKED, FIT_CHECK_AUTO_SKIPPED, FIT_CHECK_OFF = "checked", "skipped (auto)", "off"


@dataclass(frozen=True)
class MeasureOptions:
    """How a worker measures, beyond the cell's config (not part of the cell's identity)."""

    trace_dir: str | None = None  # write a torch.profiler Chrome trace of each cell's step here
    run_dir: str | None = None  # the run's folder: TunableOp's results file is kept there
    # the fit planner's prediction beside the step's measured peak (the suite's fit_check): True, False or "auto"
    # (:func:`auto_fit_skip`)
    fit_check: bool | str = True
    ceiling: dict | None = None  # the run's newest probe of this device (store.probes.latest_ceiling): the step's rates


class StepWorkload(Protocol):
    """What the step's measurement asks of the pair's family (:class:`kdbench.workloads.base.Workload` is one),
    besides what the step itself asks (:class:`kdbench.distill.step.StepFamily`)."""

    def batch(
        self, config: CellConfig, batch_size: int, device: torch.device, seed: int, models: tuple[nn.Module, nn.Module]
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def tokens(self, measurement: Measurement, batch_size: int, config: CellConfig) -> int | None: ...

    def step_columns(self, step: DistillStep, config: CellConfig, x: torch.Tensor) -> tuple[Row, tuple[str, ...]]: ...


def pair_key(config: CellConfig) -> tuple[str, str]:
    """What makes two cells' fit checks comparable under ``fit_check: auto``: their pair (the fit planner's fake run
    costs what the models' graphs cost; one more step, what the cell's step costs)."""
    return config.pair.teacher, config.pair.student


def auto_fit_skip(config: CellConfig, raw: RawTiming, dp: DataParallel | None) -> str | None:
    """Under ``fit_check: auto``, why this cell skips its fit check (None: it is checked): its timed loop took less
    wall time than the last fit check of a cell of the same pair in this worker (``WorkerState.fit_check_s``, both
    halves: the live peak's extra step and the planner's fake run).  The first such cell of a worker is checked, and
    its check's cost is what the next ones are held to; a data-parallel cell is always checked (its ranks must agree,
    and the live peak's step runs the collectives)."""
    last = current().fit_check_s.get(pair_key(config))
    if dp is not None or last is None or not raw.window_s:
        return None
    loop_s = raw.window_s[1] - raw.window_s[0]
    if loop_s >= last:
        return None
    return f"step loop {loop_s * 1e3:,.0f} ms < last fit check {last * 1e3:,.0f} ms"


def step_flops(step: DistillStep) -> Row:
    """FLOPs of one more step, counted after the timed loop (teacher forward apart when live), and the attention
    kernels its models ran (the teacher's: those of its forward counted apart; the student's: the rest)."""
    distiller = step.distiller  # the teacher's input of the last step (an on-policy step's is its generated batch)
    stored = step.cache is not None or step.offline is not None  # no teacher forward in the step
    teacher = None if stored else count(lambda: distiller.teacher_outputs(distiller.last_input))
    total = count(step)
    teacher_flops = teacher.flops if teacher is not None else None
    student_calls = total.attention - teacher.attention if teacher is not None else total.attention
    return {
        "flops": total.flops,
        "teacher_forward_flops": teacher_flops,
        "student_flops": total.flops - (teacher_flops or 0),
        "attention_kernel": pair_label(teacher.attention if teacher is not None else None, student_calls),
    }


def phase_columns(step: DistillStep, raw: RawTiming) -> Row:
    """Median of each phase over the timed iterations, and of what the phases leave out of the step.

    Read right after the timed loop: any later call of the step (FLOP counting, tracing)
    adds stamps of its own.  ``raw`` is this process's own timing (under data parallelism
    the phases are rank 0's, and so is the step time they are taken from)."""
    phases = step.phase_ms(len(raw.samples_ms))
    if not phases:
        return {}
    row = {p.column: statistics.median(phases[p.name]) for p in (*PHASES, *LEAD_PHASES) if p.name in phases}
    rest = [total - sum(parts) for total, *parts in zip(raw.samples_ms, *phases.values())]
    row[REMAINDER_COLUMN] = statistics.median(rest)
    return row


def distill_row(
    workload: StepWorkload,
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
    distiller = step.distiller
    family, family_notes = workload.step_columns(step, config, x)
    paths = distiller.paths
    row = timed_row(
        Measurement.DISTILL_STEP,
        config.batch_size,
        raw,
        world_size=config.world_size,
        tokens=workload.tokens(Measurement.DISTILL_STEP, config.batch_size, config),
        choices=(distiller.student_ac, distiller.teacher_ac),
        notes=(distiller.optimizer_note, note, *family_notes, raw.note or ""),
        final_loss=loss,
        grad_mode=AUTOGRAD,
        autocast=distiller.student_ac.applied,
        teacher_autocast=distiller.teacher_ac.applied,
        grad_scaler=distiller.scaler is not None,
        nonfinite_steps=distiller.nonfinite_steps,
        scaler_skips=distiller.scaler_skips,
        adapter_params=distiller.adapter_params,
        trainable_params=count_params(distiller.trainee),
        teacher_features=",".join(paths.teacher) if paths else None,
        student_features=",".join(paths.student) if paths else None,
        teacher_cache_ms=step.cache_ms,
        **phase_columns(step, local or raw),
        **family,
    )
    if not math.isfinite(loss):
        row.update(
            status=Status.FAILED, error=f"the distillation loss is not finite ({loss}); lower lr or use bf16/fp32"
        )
    return row


def measure_distill_step(
    workload: StepWorkload,
    teacher: nn.Module,
    student: nn.Module,
    config: CellConfig,
    backend: Backend,
    budget_s: float | None,
    options: MeasureOptions = MeasureOptions(),
    trace_name: str = "cell",
    dp: DataParallel | None = None,
    not_counted: Callable[[], Iterable[torch.Tensor]] = tuple,
) -> Row | None:
    """The distill_step row (None on data-parallel ranks other than 0, which only take part), the step timed
    within ``budget_s`` (its share of the cell's time budget).  ``not_counted()``: host tensors the process keeps
    besides the step (the worker's model cache), left out of the live peak on the CPU."""
    rank = dp.rank if dp is not None else 0
    x, y = workload.batch(config, config.batch_size, backend.device, config.seed + rank, (teacher, student))
    watch = LeverWatch(config)  # before the step is built: it resets torch._dynamo
    wrap, wrap_teacher = (dp.wrapper(config, backend), dp.teacher_wrapper(config, backend)) if dp else (None, None)
    step = DistillStep(
        teacher,
        student,
        x,
        y,
        config,
        backend,
        workload,
        wrap=wrap,
        wrap_teacher=wrap_teacher,
        run_dir=options.run_dir,
        dp=dp,
    )
    try:
        with math_mode(step.distiller.student_ac.tf32):
            what = f"{config.pair.teacher}->{config.pair.student} {config.precision} distill_step"
            raw, profile, note = profiled_loop(step, config, backend, config.batch_size, budget_s, dp, watch, what)
            loss = float(step.last_loss) if step.last_loss is not None else math.nan
            local = raw
            if dp is not None:
                raw, loss = dp.slowest(raw, backend), dp.mean(loss, backend)
            row = distill_row(workload, step, raw, config, x, loss, local, note) if rank == 0 else None
            flops, live, why = {}, {}, "the step ran over its time budget"
            if not raw.note:  # over its time budget (a note says so): no extra step to count FLOPs or the live peak
                with eager() if watch.compiled else contextlib.nullcontext(), walltime.spent(walltime.FLOPS):
                    flops = step_flops(step)  # every rank: under DDP the counted step runs the collectives
                skipped = auto_fit_skip(config, raw, dp) if options.fit_check == "auto" else None
                if skipped is not None:  # neither half: kdbench.run.cell reads the column
                    live = {"fit_check": FIT_CHECK_AUTO_SKIPPED}
                    if row is not None:
                        note = f"{FIT_NOTE}fit check skipped (auto): {skipped}"
                        row["notes"] = "; ".join(n for n in (row.get("notes"), note) if n)
                    why = None
                elif options.fit_check:  # its other half: the planner's fake run (kdbench.run.cell)
                    with walltime.spent(walltime.FIT):  # every rank, for the same reason
                        # an offline step's teacher built its store and is not the step's (as the planner counts it)
                        idle = tuple(step.distiller.teacher.parameters()) if step.offline is not None else ()
                        peak, why = step_live_peak(step, backend, (*not_counted(), *idle))
                    live = {"live_peak_bytes": peak}
                else:
                    why = None
            if why and row is not None:
                row["notes"] = "; ".join(n for n in (row.get("notes"), f"{FIT_NOTE}live peak not measured: {why}") if n)
            traced = {}
            if options.trace_dir:  # every rank runs the traced calls; rank 0 writes the trace
                path = Path(options.trace_dir) / f"{trace_name}.json" if rank == 0 else None
                with walltime.spent(walltime.PROFILING):
                    traced = trace(step, backend, path)
            flags = math_flags()
        if row is not None:
            if flops and row.get("extra_flops"):  # the loss_impl's extra work: its own column, not the model's FLOPs
                extra = row["extra_flops"]
                flops = {**flops, "flops": flops["flops"] - extra, "student_flops": flops["student_flops"] - extra}
            row.update(profile, **flops, **live, **traced, **flags, **watch.columns(raw, row["median_ms"]))
            distiller = step.distiller
            row["optimizer_state_bytes"] = optimizer_state_bytes(distiller.optimizer)
            row["model_state_bytes"] = model_state_bytes((distiller.teacher, distiller.trainee), distiller.optimizer)
            row.update(dp.columns() if dp is not None else {})
        return row
    finally:
        step.close()
        # its CUDA graph pool would count in the next measurement's peaks (an on-policy phase's compiled decode too)
        if watch.compiled or (config.on_policy is not None and config.generation.compile):
            release_compiled(backend)
