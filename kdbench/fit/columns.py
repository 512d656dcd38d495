"""A distill_step row's fit columns: the fit planner's predicted peak beside the measured one, and a note where the
two differ by more than the stated tolerance (:data:`kdbench.core.limits.FIT_TOLERANCE`).

:func:`add_fit` runs the planner (:func:`kdbench.fit.planner.predict`, a fake run of the cell's own step) for a
row whose step has been measured, on a GPU with the BLAS workspaces that GPU's step holds as a term of its own
(:func:`kdbench.fit.runtime.with_runtime`: the measured peak holds them too), and sets ``predicted_peak_bytes``,
``predicted_peak_phase``, ``predicted_breakdown``, ``fit_seconds`` and ``predicted_peak_ratio`` =
``live_peak_bytes`` (the peak of live tensor bytes measured during one more step,
:func:`kdbench.measure.memory.step_live_peak`) / the prediction.  An unpredictable cell keeps the predicted columns
null and says why in its notes; every fit note begins with
:data:`kdbench.core.names.FIT_NOTE`.

Beside the peak, the step's time (:func:`step_time_columns`): the same fake run's operator census priced by
:func:`kdbench.fit.steptime.predict_step_time`, ``predicted_step_ms``, and ``predicted_step_ratio`` = the measured
``median_ms`` / the prediction, noted outside :data:`kdbench.core.limits.STEP_TIME_TOLERANCE`.  The rates are the
machine's own where a probe of it is known (the run's newest probe of this device, handed down as ``ceiling``, or
the row's own ceiling columns), else the device table's entry for the GPU this process runs on, else none: the
columns stay null and a note says why.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kdbench.config.schema import CellConfig
from kdbench.core.devices import find_card
from kdbench.core.errors import KdbenchError
from kdbench.core.limits import FIT_TOLERANCE, STEP_TIME_TOLERANCE
from kdbench.core.names import FIT_NOTE, Status
from kdbench.core.schema import Row
from kdbench.fit import planner
from kdbench.fit.census import Census
from kdbench.fit.cost import other_devices
from kdbench.fit.runtime import BLAS_TERM, live_runtime, with_runtime
from kdbench.fit.steptime import Rates, predict_step_time, rates_for, rates_from_probe, rates_from_row, with_calls
from kdbench.fit.tracker import KINDS
from kdbench.hw.backends import Backend
from kdbench.measure.replay import time_signatures

MIB = 2**20


def prediction_of(config: CellConfig, device_type: str, allow_imports: bool = False) -> planner.Prediction:
    """The planner's prediction for ``config`` on ``device_type``, for a GPU with the BLAS workspaces of the GPU this
    process runs on (:func:`kdbench.fit.runtime.live_runtime`); one that raises is an unpredictable cell whose error
    says so (the planner guards its fake run, not what it asks the workload before it)."""
    try:
        prediction = planner.predict(config, device_type, allow_imports, shapes=True)  # timed here: step_time_columns
        return with_runtime(prediction, config, live_runtime(device_type))
    except Exception as exc:  # the measured row stands whatever the planner does
        text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        return planner.Prediction(None, error=f"the fit planner raised {type(exc).__name__}: {text}".rstrip(": "))


def within_tolerance(ratio: float) -> bool:
    low, high = FIT_TOLERANCE
    return low <= ratio <= high


def fit_columns(prediction: planner.Prediction, live_peak_bytes: int | None) -> tuple[Row, list[str]]:
    """The fit columns of a row whose measured live peak is ``live_peak_bytes`` (None: not measured), and its fit
    notes (each beginning with :data:`~kdbench.core.names.FIT_NOTE`)."""
    columns = Row(fit_seconds=float(prediction.seconds))
    if not prediction.ok:
        reason = (prediction.error or "no reason given").removeprefix("not predicted: ")
        return columns, [f"{FIT_NOTE}peak not predicted: {reason}"]
    predicted = int(prediction.peak_bytes)
    columns.update(
        predicted_peak_bytes=predicted,
        predicted_peak_phase=prediction.phase,
        predicted_breakdown=json.dumps(
            {k: int(prediction.breakdown[k]) for k in (*KINDS, BLAS_TERM) if k in prediction.breakdown}
        ),
    )
    notes = [FIT_NOTE + n for n in prediction.notes]
    if live_peak_bytes is not None and predicted > 0:
        ratio = live_peak_bytes / predicted
        columns["predicted_peak_ratio"] = ratio
        if not within_tolerance(ratio):
            low, high = FIT_TOLERANCE
            notes.append(
                f"{FIT_NOTE}the measured peak ({live_peak_bytes / MIB:,.1f} MiB) is {ratio:.3f}x the predicted "
                f"({predicted / MIB:,.1f} MiB), outside the tolerance {low:.2f}-{high:.2f}"
            )
    return columns, notes


def no_fit_check(row: Row) -> None:
    """An ok row of a run without the fit check (``fit_check: false``, ``--no-fit-check``) says so: its predicted
    columns are null because nobody asked, not because the cell is unpredictable."""
    if row["status"] == Status.OK:
        row["notes"] = "; ".join(n for n in (row.get("notes"), f"{FIT_NOTE}{NOT_CHECKED}") if n)


NOT_CHECKED = "not checked (fit_check: false / --no-fit-check)"


def rates_of(
    row: Row, config: CellConfig, device_type: str, ceiling: Mapping[str, Any] | None = None
) -> tuple[Rates | None, str]:
    """The rates a row's step is priced with (module docstring), or None and why not."""
    if ceiling:
        rates = rates_from_probe(ceiling, config.precision, device_type)
        if rates is not None:
            return rates, ""
    rates = rates_from_row(row, config.precision, config.teacher_precision)
    if rates is not None:
        return rates, ""
    card = _this_gpu() if device_type != "cpu" else None
    if card is not None:
        try:
            return rates_for(card, config.precision), ""
        except KdbenchError as exc:
            return None, str(exc)
    where = "this GPU is not in the device table" if device_type != "cpu" else "a CPU has no datasheet entry"
    return None, f"no probe of this device (run `kdbench probe`) and {where}"


def _this_gpu():
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return find_card(props.name, int(props.multi_processor_count), getattr(props, "gcnArchName", "") or None)


def timed_here(rates: Rates, census: Census, backend: Backend, precision: str) -> Rates:
    """``rates`` with the census's operator calls timed at their shapes on ``backend``'s device, the machine the row
    was measured on (:func:`kdbench.measure.replay.time_signatures`; :func:`kdbench.fit.steptime.with_calls`)."""
    return with_calls(rates, time_signatures(census.signatures(), backend, tf32=precision == "tf32"))


def step_time_columns(
    prediction: planner.Prediction,
    row: Row,
    config: CellConfig,
    device_type: str,
    ceiling: Mapping | None = None,
    backend: Backend | None = None,
) -> tuple[Row, list[str]]:
    """``predicted_step_ms`` and ``predicted_step_ratio`` of a row (its ``median_ms`` measured) and their notes; an
    unpredictable cell gets neither and no note of its own (its peak's note says why).  With ``backend`` (the
    device the row ran on) the census's calls are timed there at their shapes (:func:`timed_here`)."""
    if not prediction.ok or prediction.census is None:
        return Row(), []
    rates, why = rates_of(row, config, device_type, ceiling)
    if rates is None:
        return Row(), [f"{FIT_NOTE}step time not predicted: {why}"]
    if backend is not None:
        rates = timed_here(rates, prediction.census, backend, config.precision)
    predicted = predict_step_time(prediction, rates, config.precision).ms
    columns = Row(predicted_step_ms=predicted)
    notes = []
    median = row.get("median_ms")
    if median and predicted > 0:
        ratio = median / predicted
        columns["predicted_step_ratio"] = ratio
        low, high = STEP_TIME_TOLERANCE
        if not low <= ratio <= high:
            notes.append(
                f"{FIT_NOTE}the measured step ({median:,.2f} ms) is {ratio:.3f}x the predicted ({predicted:,.2f} ms, "
                f"{rates.name}), outside the tolerance {low:.2f}-{high:.2f}"
            )
    return columns, notes


def add_fit(
    row: Row,
    config: CellConfig,
    device_type: str,
    allow_imports: bool = False,
    ceiling: Mapping[str, Any] | None = None,
    backend: Backend | None = None,
) -> None:
    """Set ``row``'s fit columns from a prediction of ``config`` on ``device_type`` (``allow_imports``: the suite's,
    for ``module:callable`` models; ``ceiling``: the run's probe of this device,
    :func:`kdbench.store.probes.latest_ceiling`'s form; ``backend``: the device the row ran on, where the step's
    operator calls are timed at their shapes), its fit notes added to an ok row's notes."""
    prediction = prediction_of(config, device_type, allow_imports)
    columns, notes = fit_columns(prediction, row.get("live_peak_bytes"))
    times, time_notes = step_time_columns(prediction, row, config, device_type, ceiling, backend)
    columns.update(times, predicted_step_devices=other_devices(prediction, config))  # the report's other devices
    notes += time_notes
    row.update(columns)
    if notes and row["status"] == Status.OK:
        row["notes"] = "; ".join(n for n in (row.get("notes"), *notes) if n)
