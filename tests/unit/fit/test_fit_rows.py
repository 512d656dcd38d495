"""Will it fit, on the step rows (issue 31): each measured distill_step row gets the fit planner's predicted peak,
the live tensor peak measured during one more step, their ratio, and a note when the cell is unpredictable or
the ratio is outside the stated tolerance (kdbench.core.limits.FIT_TOLERANCE)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import kdbench.fit.planner as planner
from kdbench.config.plan import Cell, cell_id_of
from kdbench.core.limits import FIT_TOLERANCE
from kdbench.core.names import FIT_NOTE, PHASES
from kdbench.fit.columns import NOT_CHECKED, fit_columns
from kdbench.fit.planner import Prediction
from kdbench.fit.tracker import KINDS
from kdbench.hw.backends import resolve
from kdbench.measure import walltime
from kdbench.measure.step import MeasureOptions
from kdbench.models import ModelCache
from kdbench.run.cell import measure_cell
from tests.support.helpers import make_config

CPU = resolve("cpu")
MIB = 2**20


def _lm_config():
    return make_config(
        pair={"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
        overrides={"teacher": {"num_hidden_layers": 2}, "student": {"num_hidden_layers": 1}},
        method="forward_kl",
        batch_size=2,
        data={"kind": "tokens", "seq_len": 64},
        timing={"warmup": 0, "min_iters": 2, "min_time_s": 0.0},
        inference={"batch_sizes": [1], "decode_tokens": 2},
    )


def _linear_config():
    return make_config(
        pair={"teacher": "linear", "student": "linear"},
        timing={"warmup": 0, "min_iters": 2, "min_time_s": 0.0},
        inference={"batch_sizes": [1]},
    )


def _step_row(config, cache=None):
    rows = measure_cell(Cell(0, cell_id_of(config), config), CPU, cache or ModelCache())
    step = rows[0]
    assert step["measurement"] == "distill_step" and step["status"] == "ok", step.get("error")
    return step


def _fit_notes(row) -> list[str]:
    """The row's notes of its peak (a CPU row without a probe also says its step time was not predicted)."""
    notes = (row.get("notes") or "").split("; ")
    return [n for n in notes if n.startswith(FIT_NOTE) and not n.startswith(f"{FIT_NOTE}step time not predicted")]


def test_a_tiny_lm_step_row_is_predicted_within_two_percent_of_its_live_peak():
    cache = ModelCache()  # keeps the pair's masters, as a worker does: they are not the step's and are not counted
    walltime.take()
    row = _step_row(_lm_config(), cache)
    assert cache.kept_tensors()  # the masters were there while the step was measured
    assert row["predicted_peak_bytes"] > 0 and row["live_peak_bytes"] > 0
    assert row["predicted_peak_ratio"] == pytest.approx(row["live_peak_bytes"] / row["predicted_peak_bytes"])
    assert 0.98 <= row["predicted_peak_ratio"] <= 1.02, (row["live_peak_bytes"], row["predicted_peak_bytes"])
    assert row["predicted_peak_phase"] in {p.name for p in PHASES}
    breakdown = json.loads(row["predicted_breakdown"])
    assert list(breakdown) == [k for k in KINDS if k in breakdown] and breakdown["parameters"] > 0
    assert sum(breakdown.values()) == row["predicted_peak_bytes"]
    assert row["fit_seconds"] > 0
    assert _fit_notes(row) == []  # within the tolerance: nothing to say
    assert walltime.take()["fit check"] > 0  # the extra step and the fake run have their own wall-time category


def test_an_unpredictable_cell_keeps_null_predictions_and_says_why(monkeypatch):
    def unpredictable(config, device_type, allow_imports=False, shapes=False):
        return Prediction(None, error="not predicted: simulated reason")

    monkeypatch.setattr(planner, "predict", unpredictable)
    row = _step_row(_linear_config())
    assert row["live_peak_bytes"] > 0  # measured whatever the planner says
    for column in ("predicted_peak_bytes", "predicted_peak_phase", "predicted_breakdown", "predicted_peak_ratio"):
        assert row.get(column) is None
    assert _fit_notes(row) == [f"{FIT_NOTE}peak not predicted: simulated reason"]


def test_a_planner_that_raises_is_an_unpredictable_cell_and_the_row_stands(monkeypatch):
    def broken(config, device_type, allow_imports=False, shapes=False):
        raise RuntimeError("no host table\nsecond line")

    monkeypatch.setattr(planner, "predict", broken)
    row = _step_row(_linear_config())
    assert row.get("predicted_peak_bytes") is None and row["median_ms"] > 0
    assert _fit_notes(row) == [f"{FIT_NOTE}peak not predicted: the fit planner raised RuntimeError: no host table"]


def test_a_ratio_outside_the_tolerance_adds_a_note_with_both_figures(monkeypatch):
    real = planner.predict

    # the real prediction, half of it: the measured peak reads twice the predicted
    def halved(config, device_type, allow_imports=False, shapes=False):
        p = real(config, device_type, allow_imports, shapes=shapes)
        return dataclasses.replace(p, peak_bytes=p.peak_bytes // 2)

    monkeypatch.setattr(planner, "predict", halved)
    row = _step_row(_linear_config())
    ratio = row["predicted_peak_ratio"]
    assert not FIT_TOLERANCE[0] <= ratio <= FIT_TOLERANCE[1] and ratio == pytest.approx(2.0, rel=0.1)
    [note] = _fit_notes(row)
    assert f"{ratio:.3f}x" in note and "outside the tolerance 0.90-1.10" in note
    assert f"({row['live_peak_bytes'] / MIB:,.1f} MiB)" in note
    assert f"({row['predicted_peak_bytes'] / MIB:,.1f} MiB)" in note


@pytest.mark.parametrize(
    ("live", "flagged"), [(90 * MIB, False), (110 * MIB, False), (89 * MIB, True), (111 * MIB, True)]
)
def test_the_tolerance_is_inclusive_at_its_ends(live, flagged):
    prediction = Prediction(100 * MIB, phase="loss", breakdown={"parameters": 60 * MIB, "activations": 40 * MIB})
    columns, notes = fit_columns(prediction, live)
    assert columns["predicted_peak_ratio"] == live / (100 * MIB)
    assert bool(notes) is flagged
    assert json.loads(columns["predicted_breakdown"]) == {"parameters": 60 * MIB, "activations": 40 * MIB}


def test_a_row_without_a_measured_peak_gets_the_prediction_and_no_ratio():
    columns, notes = fit_columns(Prediction(100 * MIB, phase="backward", notes=("a caveat",)), None)
    assert columns["predicted_peak_bytes"] == 100 * MIB and "predicted_peak_ratio" not in columns
    assert notes == [f"{FIT_NOTE}a caveat"]


def test_a_profiler_that_cannot_start_costs_the_live_peak_not_the_row(monkeypatch):
    import torch.profiler

    from kdbench.measure.step import measure_distill_step
    from kdbench.models import build_model
    from kdbench.workloads.vision import VISION

    def refused(*args, **kwargs):
        raise RuntimeError("profiler already running\nmore")

    monkeypatch.setattr(torch.profiler, "profile", refused)
    config = make_config(pair={"teacher": "linear", "student": "linear"}, data={"shape": [1, 4, 4], "num_classes": 4})
    teacher, student = build_model("linear", 4, (1, 4, 4)), build_model("linear", 4, (1, 4, 4))
    row = measure_distill_step(VISION, teacher, student, config, CPU, None)
    assert row["status"] == "ok" and row["median_ms"] > 0 and row["live_peak_bytes"] is None
    assert _fit_notes(row) == [
        f"{FIT_NOTE}live peak not measured: the profiler failed: RuntimeError: profiler already running"
    ]


def test_a_step_over_its_time_budget_measures_no_live_peak_and_says_so():
    from kdbench.measure.step import measure_distill_step
    from kdbench.models import build_model
    from kdbench.workloads.vision import VISION

    config = make_config(
        pair={"teacher": "linear", "student": "linear"},
        data={"shape": [1, 4, 4], "num_classes": 4},
        timing={"warmup": 1, "min_iters": 5, "min_time_s": 0.0},
    )
    teacher, student = build_model("linear", 4, (1, 4, 4)), build_model("linear", 4, (1, 4, 4))
    row = measure_distill_step(VISION, teacher, student, config, CPU, 1e-6)
    assert row["status"] == "ok" and "shrunk to fit" in row["notes"] and row.get("live_peak_bytes") is None
    assert _fit_notes(row) == [f"{FIT_NOTE}live peak not measured: the step ran over its time budget"]


def test_on_a_gpu_the_live_peak_is_the_allocators_peak_over_the_one_step(monkeypatch):
    import torch

    from kdbench.measure.memory import step_live_peak
    from tests.support.helpers import simulated_gpu

    log = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: log.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: log.append("read") or 123 * MIB)
    assert step_live_peak(lambda: log.append("step"), simulated_gpu()) == (123 * MIB, None)
    assert log == ["sync", "reset", "step", "sync", "read"]  # the peak of that step alone, read after it finished


def test_a_suite_that_allows_imports_has_its_user_models_predicted(monkeypatch):
    from kdbench.fit.columns import add_fit

    asked = []

    def predict(config, device_type, allow_imports=False, shapes=False):
        asked.append((device_type, allow_imports))
        return Prediction(None, error="not predicted: simulated")

    monkeypatch.setattr(planner, "predict", predict)
    row = {"status": "ok", "notes": None, "live_peak_bytes": 10}
    add_fit(row, make_config(), "cpu", allow_imports=True)
    add_fit(row, make_config(), "cuda")
    assert asked == [("cpu", True), ("cuda", False)]


def test_a_run_without_the_fit_check_neither_predicts_nor_profiles_and_says_so(monkeypatch):
    """`fit_check: false` / --no-fit-check: no fake run, no extra profiled step, no fit time; the row says why its
    fit columns are null."""

    def must_not_run(*args, **kwargs):
        raise AssertionError("the fit check ran")

    monkeypatch.setattr(planner, "predict", must_not_run)
    monkeypatch.setattr("kdbench.measure.step.step_live_peak", must_not_run)
    config = _linear_config()
    walltime.take()
    rows = measure_cell(Cell(0, cell_id_of(config), config), CPU, ModelCache(), MeasureOptions(fit_check=False))
    row = rows[0]
    assert row["status"] == "ok" and row["median_ms"] > 0
    for column in ("predicted_peak_bytes", "live_peak_bytes", "predicted_peak_ratio", "fit_seconds"):
        assert row.get(column) is None
    assert _fit_notes(row) == [f"{FIT_NOTE}{NOT_CHECKED}"]
    assert walltime.take().get("fit check", 0) == 0


def test_no_fit_check_on_the_command_line_reaches_the_workers_options(tmp_path, monkeypatch):
    from tests.support.helpers import planned_fit_check

    seen = [v for flags in ([], ["--no-fit-check"]) for v in planned_fit_check(tmp_path, monkeypatch, flags)]
    assert seen == [True, False]


def test_fake_tensors_left_alive_are_not_counted_and_raise_no_warning():
    # a compile or the fit check can leave FakeTensors alive; reading their data pointer warns (an error to come)
    import warnings

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kdbench.measure.memory import live_tensor_bytes

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        before = live_tensor_bytes()
        with FakeTensorMode():
            fake = torch.empty(1 << 20)  # 4 MiB, were it real
        assert live_tensor_bytes() == before
        real = torch.ones(1 << 20)
        assert live_tensor_bytes() - before == real.nbytes and fake.shape == real.shape


def test_the_cpu_live_peak_leaves_no_profiler_lines_on_stderr():
    # kineto printed 'USDT: ... profiler_start/stop' and 'ERROR: ... gpuGetDeviceCount failed' between every CPU
    # run's progress lines; a fresh process, as a worker is (kineto reads its level when it first starts)
    import os
    import subprocess
    import sys

    code = (
        "import torch\nfrom kdbench.measure.memory import live_tensor_peak\n"
        "print(live_tensor_peak(lambda: torch.ones(1 << 16) * 2) > 0)"
    )
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr
    assert not [line for line in done.stderr.splitlines() if line.startswith(("USDT:", "ERROR:", "STAGE:"))]
