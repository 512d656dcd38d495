"""`fit_check: auto` (issue 45, item 6: a tiny cell's base cost is mostly its fit check): a cell whose timed loop took
less wall time than the last fit check of a cell of the same pair in its worker skips the check, and its row says so
(note and `fit_check` column); the first cell of a pair is checked and what its check took is kept; `true` and
`false` mean what they meant.  The fit check's cost is set in the worker's state, not left to this machine's speed."""

from __future__ import annotations

import re

import pytest

import kdbench.fit.planner as planner
from kdbench.config.plan import Cell, cell_id_of
from kdbench.core.names import FIT_NOTE
from kdbench.core.worker_state import WorkerState, install
from kdbench.fit.columns import NOT_CHECKED
from kdbench.hw.backends import resolve
from kdbench.measure import walltime
from kdbench.measure.step import MeasureOptions, auto_fit_skip
from kdbench.measure.timing import RawTiming
from kdbench.models import ModelCache
from kdbench.run.cell import measure_cell
from tests.support.helpers import make_config

CPU = resolve("cpu")
PAIR = ("linear", "linear")
SKIP_NOTE = re.compile(
    rf"{re.escape(FIT_NOTE)}fit check skipped \(auto\): step loop ([0-9,]+) ms < last fit check ([0-9,]+) ms"
)


@pytest.fixture
def state():
    """A worker's state of its own (as a fresh worker has), the process's put back after."""
    mine = WorkerState()
    previous = install(mine)
    yield mine
    install(previous)


def _config():
    return make_config(
        pair={"teacher": "linear", "student": "linear"},
        timing={"warmup": 0, "min_iters": 2, "min_time_s": 0.0},
        inference={"batch_sizes": [1]},
    )


def _step(fit_check) -> dict:
    config = _config()
    rows = measure_cell(Cell(0, cell_id_of(config), config), CPU, ModelCache(), MeasureOptions(fit_check=fit_check))
    step = rows[0]
    assert step["measurement"] == "distill_step" and step["status"] == "ok", step.get("error")
    return step


def _must_not_run(monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the fit check ran")

    monkeypatch.setattr(planner, "predict", must_not_run)
    monkeypatch.setattr("kdbench.measure.step.step_live_peak", must_not_run)


def test_the_rule_compares_the_timed_loop_with_the_pairs_last_fit_check(state):
    config = _config()
    short, long = (RawTiming(20.0, [10.0] * 4, "host", window_s=(10.0, 10.0 + s)) for s in (0.04, 0.5))
    assert auto_fit_skip(config, short, None) is None  # no check of this pair yet in this worker: checked
    state.fit_check_s[PAIR] = 0.41
    assert auto_fit_skip(config, short, None) == "step loop 40 ms < last fit check 410 ms"
    assert auto_fit_skip(config, long, None) is None  # a loop longer than the check: checked
    assert auto_fit_skip(config, short, dp=object()) is None  # data parallel: every rank checks
    state.fit_check_s.clear()
    state.fit_check_s[("resnet20", "resnet8")] = 0.41  # another pair's check is no yardstick
    assert auto_fit_skip(config, short, None) is None


def test_auto_checks_the_first_cell_of_a_pair_and_keeps_what_its_check_took(state):
    walltime.take()
    step = _step("auto")
    spent = walltime.take()["fit check"]
    assert step["fit_check"] == "checked" and step["predicted_peak_bytes"] > 0 and step["live_peak_bytes"] > 0
    assert not SKIP_NOTE.search(step.get("notes") or "")
    assert state.fit_check_s[PAIR] == pytest.approx(spent) and spent > 0  # both halves, as the split counts them


def test_auto_skips_a_cell_whose_loop_is_shorter_than_the_last_fit_check_and_says_so(state, monkeypatch):
    _must_not_run(monkeypatch)
    state.fit_check_s[PAIR] = 1000.0  # the pair's last check took 1000 s: a two-step linear loop is shorter
    walltime.take()
    step = _step("auto")
    assert step["fit_check"] == "skipped (auto)"
    for column in ("predicted_peak_bytes", "live_peak_bytes", "predicted_peak_ratio", "fit_seconds"):
        assert step.get(column) is None
    [(loop_ms, last_ms)] = SKIP_NOTE.findall(step["notes"])
    assert last_ms == "1,000,000" and 0 <= int(loop_ms.replace(",", "")) < 1_000_000
    assert NOT_CHECKED not in step["notes"]  # not the note of a run that turned the check off
    assert walltime.take().get("fit check", 0) == 0  # neither half ran
    assert state.fit_check_s[PAIR] == 1000.0  # a skipped cell leaves the yardstick as it was


def test_auto_checks_a_cell_whose_loop_is_longer_and_keeps_its_new_cost(state):
    state.fit_check_s[PAIR] = 1e-9  # a check shorter than any loop
    walltime.take()
    step = _step("auto")
    spent = walltime.take()["fit check"]
    assert step["fit_check"] == "checked" and step["predicted_peak_bytes"] > 0
    assert state.fit_check_s[PAIR] == pytest.approx(spent) and spent > 1e-9


def test_true_and_false_mean_what_they_meant(state, monkeypatch):
    state.fit_check_s[PAIR] = 1000.0  # would make auto skip: true checks all the same
    step = _step(True)
    assert step["fit_check"] == "checked" and step["predicted_peak_bytes"] > 0 and step["live_peak_bytes"] > 0
    assert not SKIP_NOTE.search(step.get("notes") or "")
    _must_not_run(monkeypatch)
    step = _step(False)
    assert step["fit_check"] == "off" and step.get("predicted_peak_bytes") is None
    assert f"{FIT_NOTE}{NOT_CHECKED}" in step["notes"] and not SKIP_NOTE.search(step["notes"])


@pytest.mark.parametrize(
    ("flags", "suite_value", "expected"),
    [
        ([], None, True),
        (["--fit-check", "auto"], None, "auto"),
        (["--fit-check", "false"], None, False),
        (["--no-fit-check"], None, False),
        ([], "auto", "auto"),
        (["--fit-check", "true"], "auto", True),
    ],
)
def test_the_command_line_and_the_suite_reach_the_workers_options(tmp_path, monkeypatch, flags, suite_value, expected):
    from tests.support.helpers import planned_fit_check

    line = f"fit_check: {suite_value}\n" if suite_value else ""
    seen = planned_fit_check(tmp_path, monkeypatch, flags, line)
    assert seen == [expected] and type(seen[0]) is type(expected)


def test_a_continued_run_keeps_auto_and_refuses_another_value(tmp_path, capsys):
    import json

    from kdbench.cli import main
    from kdbench.run.resume import GIVEN, OPTIONS, Setting
    from kdbench.store.results import INVOCATIONS_DIR
    from tests.support.helpers import run_folder, write_suite
    from tests.support.suites import tiny_suite

    suite, out = write_suite(tmp_path / "s.yaml", **tiny_suite(name="auto")), tmp_path / "res"

    def run(*extra: str) -> int:
        return main(["run", str(suite), "--out", str(out), "--no-report", "--inline", *extra])

    assert run("--fit-check", "auto") == 0
    folder = run_folder(out)
    assert run("--resume") == 0  # nothing to go, the options kept
    records = [json.loads(p.read_text()) for p in sorted((folder.path / INVOCATIONS_DIR).glob("*.json"))]
    assert [r[OPTIONS]["fit_check"] for r in records] == ["auto", "auto"] and records[-1][GIVEN] == ["fit_check"]
    capsys.readouterr()
    assert run("--resume", "--no-fit-check") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--no-fit-check: run " in err[0] and "was started with --fit-check auto" in err[0], err
    setting = Setting("fit_check", "--fit-check", True)
    assert [setting.words(v) for v in (True, False, "auto")] == [
        ["--fit-check", "true"],
        ["--no-fit-check"],
        ["--fit-check", "auto"],
    ]
