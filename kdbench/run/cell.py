"""Measure one Cell: its workload looked up once, its pair built, then the distillation step and the serving
measurements, on one device or as one data-parallel rank.

:func:`measure_cell` returns one row per planned measurement (:meth:`kdbench.workloads.base.Workload.planned`):
the distillation step (:mod:`kdbench.measure.step`), then the family's serving measurements (inference of image
classifiers and encoders, prefill and decode of LMs) at each inference batch size.  Every measurement is guarded
the same way: one that raises becomes a ``failed`` row (``oom`` when the device ran out of memory; ``skipped`` when
it cannot be taken here) and the cell's other measurements still run.  Last, once everything is measured, the fit
planner predicts the step's peak (:func:`kdbench.fit.columns.add_fit`: a fake run, nothing allocated) beside the
peak the step measured (``live_peak_bytes``); under ``fit_check: auto`` not for a cell whose timed loop was shorter
than the last fit check of its pair in this worker (:func:`kdbench.measure.step.auto_fit_skip`); what a checked
cell's check took (both halves) is kept in the worker's state as the next cell's yardstick.

Data parallelism (DDP or FSDP2).  With ``dp``, every rank of the group calls :func:`measure_cell` with the same cell
and runs the same step measurement (:mod:`kdbench.measure.parallel`: one agreed iteration count, each iteration
at its slowest rank).  A step that raises on one rank cannot be turned into a row there: its partners are waiting
in a collective, so the exception ends the rank and the launcher stores the cell as failed (``oom`` when a rank
ran out of memory).  Rank 0 then measures serving alone, guarded as everywhere, and returns the rows; the other
ranks return None.  A step that sharded the pair in place (FSDP2) leaves serving whole copies, built after the
shards are freed.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from functools import partial

import torch

from kdbench.config.plan import Cell
from kdbench.core.names import Measurement, Status, planned_row
from kdbench.core.schema import Row
from kdbench.core.worker_state import current
from kdbench.fit.columns import add_fit, no_fit_check
from kdbench.hw.backends import Backend, choose_autocast
from kdbench.measure import walltime
from kdbench.measure.failures import (
    SkipMeasurement,
    device_fatal,
    device_lost,
    error_text,
    failure_row,
    not_run_after_device_lost,
    note_device_lost,
    status_of,
)
from kdbench.measure.levers import device_kind, device_levers, skip_reason, tunableop_file
from kdbench.measure.parallel import DataParallel
from kdbench.measure.rows import failure_rows, measurement_budget_s
from kdbench.measure.step import (
    FIT_CHECK_AUTO_SKIPPED,
    FIT_CHECK_OFF,
    FIT_CHECKED,
    MeasureOptions,
    measure_distill_step,
    pair_key,
)
from kdbench.models import ModelCache, count_params
from kdbench.workloads import workload_of


def guarded(measurement: str, batch_size: int, backend: Backend, fn: Callable[[], Row]) -> Row:
    """``fn()``'s row, or a failure row when it raises: a failing measurement is a result, not a crash.  Once a
    measurement has lost the device context, the later ones are not run (failed rows that say why)."""
    if device_lost():
        return Row(
            measurement=measurement, batch_size=batch_size, status=Status.FAILED, error=not_run_after_device_lost()
        )
    try:
        return fn()
    except SkipMeasurement as exc:  # what this backend or model cannot take: skipped, with the reason
        row = Row(measurement=measurement, batch_size=batch_size, status=Status.SKIPPED, error=str(exc))
    except Exception as exc:
        if device_fatal(exc):
            note_device_lost(exc)  # the worker stores this job's rows, then ends (the next job gets a fresh one)
        row = failure_row(measurement, batch_size, exc)
    free_device_memory(backend)  # after the handler: the traceback no longer pins the failed frames' tensors
    return row


def free_device_memory(backend: Backend) -> None:
    """Free what is no longer referenced (a failed measurement's tensors): collect it, and return the device's
    cached blocks."""
    gc.collect()
    if backend.device_type == "cuda" and not device_lost():
        try:
            torch.cuda.empty_cache()
        except RuntimeError:
            pass


def cell_skip(config, backend: Backend, workload=None) -> str | None:
    """Why the cell cannot run in this environment (None: it can): a precision this device cannot autocast, a lever
    it lacks, a package or an API its workload needs (:meth:`kdbench.workloads.base.Workload.skip_reason`).  Known
    before anything is built: the plan says it before the run (:func:`kdbench.run.plan.environment_skips`)."""
    workload = workload or workload_of(config)
    choices = [choose_autocast(backend, p) for p in (config.precision, config.teacher_precision)]
    return (
        next((c.skip for c in choices if c.skip), None)
        or skip_reason(config, backend)
        or workload.skip_reason(config, backend)
    )


def measure_cell(
    cell: Cell,
    backend: Backend,
    cache: ModelCache,
    options: MeasureOptions | None = None,
    dp: DataParallel | None = None,
    skip_teacher: tuple[int, ...] = (),
) -> list[Row] | None:
    """The cell's rows, one per planned measurement (None on data-parallel ranks other than 0), but the
    teacher serving at the batch sizes in ``skip_teacher`` (the engine reuses an earlier cell's)."""
    config = cell.config
    options = options or MeasureOptions()
    workload = workload_of(config)
    planned = workload.planned(config)
    budget_s = measurement_budget_s(config, backend, len(planned))
    skip = cell_skip(config, backend, workload)
    planned_rows = [planned_row(m, bs) for m, bs in planned]
    if skip:  # every rank sees the same, before any collective
        return None if dp is not None and not dp.root else failure_rows(planned_rows, Status.SKIPPED, skip)
    try:
        with walltime.spent(walltime.MODELS):
            pair = workload.step_pair(config, backend, cache, dp)
    except Exception as exc:
        if dp is not None:
            raise
        return failure_rows(planned_rows, status_of(exc), error_text(exc))
    fit_before = walltime.so_far(walltime.FIT)  # this cell's fit check: what is counted to it from here
    # Device-wide levers (cudnn.benchmark, TunableOp) hold for the cell: its step and its inference.
    tunable = tunableop_file(options.run_dir, device_kind(backend)) if config.tunableop else None
    with device_levers(config, backend, tunable) as lever_row:
        measure_step = partial(
            measure_distill_step,
            workload,
            *pair,
            config,
            backend,
            budget_s,
            options,
            cell.cell_id,
            dp,
            not_counted=cache.kept_tensors,
        )
        # A data-parallel step that raises ends the rank (see the module docstring): it is not guarded.
        step = (
            guarded(Measurement.DISTILL_STEP, config.batch_size, backend, measure_step)
            if dp is None
            else measure_step()
        )
        if dp is not None and not dp.root:
            dp.barrier()  # rank 0 measures serving alone
            return None
        if not workload.step_keeps_pair(config):  # rank 0 serves whole copies alone
            measure_step = pair = None  # the step's copies are freed before the whole ones are built
            with walltime.spent(walltime.MODELS):
                pair = workload.build_pair(config, backend, cache)
        rows = [step]
        for measurement, bs in planned[1:]:  # serving, in the planned order
            if measurement == Measurement.TEACHER_INFERENCE and bs in skip_teacher:
                continue
            serve = partial(workload.serve, measurement, bs, pair, config, backend, budget_s)
            rows.append(Row(guarded(measurement, bs, backend, serve), **planned_row(measurement, bs)))
    if step["status"] != Status.SKIPPED and not device_lost():  # after every measurement: it changes none
        if step.get("fit_check") == FIT_CHECK_AUTO_SKIPPED:  # fit_check: auto, a loop shorter than the check
            pass  # the step's row says so (kdbench.measure.step.auto_fit_skip)
        elif options.fit_check:  # true, or auto for a cell that is checked
            with walltime.spent(walltime.FIT):
                add_fit(
                    step,
                    config,
                    backend.device_type,
                    getattr(cache, "allow_imports", False),
                    options.ceiling,
                    backend,
                )
            step["fit_check"] = FIT_CHECKED
            # both halves (the live peak's step and this fake run): what the next cell of the pair is held to
            current().fit_check_s[pair_key(config)] = walltime.so_far(walltime.FIT) - fit_before
        else:
            no_fit_check(step)
            step["fit_check"] = FIT_CHECK_OFF
    params = {"student_params": count_params(pair[1]), "teacher_params": count_params(pair[0])}
    lever_notes = lever_row.pop("notes", None)
    for row in rows:
        row.update(params, **lever_row)
        if lever_notes and row["status"] == Status.OK:
            row["notes"] = "; ".join(n for n in (row.get("notes"), lever_notes) if n)
    if dp is not None:
        dp.barrier()
    return rows
