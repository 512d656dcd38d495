"""Budgets: absolute limits in a suite; a missed one makes `run` exit 1 and shows in the report."""

from __future__ import annotations

import pandas as pd
import pytest

from kdbench.cli import main
from kdbench.config.budgets import Budget, check
from kdbench.core.schema import Row
from tests.support.helpers import run_folder, write_suite
from tests.support.rows import result_row
from tests.support.suites import tiny_suite

SUITE = tiny_suite(name="budgets", defaults={"inference": {"batch_sizes": [1, 4], "teacher": False}})


def _row(cell: str, measurement: str, bs: int, **values) -> Row:
    """A row of ``cell`` (labelled ``label-<cell>``; cell b runs in bf16)."""
    precision = "bf16" if cell == "b" else "fp32"
    row = result_row(cell_id=cell, cell_label=f"label-{cell}", measurement=measurement, batch_size=bs, error=None)
    return row | {"precision": precision, **values}


def test_checks_take_the_centre_over_repeats_and_a_failure_misses():
    df = pd.DataFrame(
        [
            *(_row("a", "student_inference", 1, p95_ms=v, throughput=900.0) for v in (4.0, 6.0, 4.5)),
            _row("b", "student_inference", 1, p95_ms=1.0, throughput=3000.0),
            _row("b", "student_inference", 4, status="oom", error="out of memory", p95_ms=None),
            _row("a", "distill_step", 4, median_ms=150.0, peak_memory_bytes=9_000_000_000),  # int64 bytes, not 9e9
        ]
    )
    p95 = Budget(measurement="student_inference", batch_size=1, stat="p95_ms", max=5)
    latency = {c.cell_id: (c.value, c.met, c.note) for c in check(df, [p95])}
    centre = (4.0 * 6.0 * 4.5) ** (1 / 3)  # the geometric mean, as compare centres repeats
    assert latency == {"a": (pytest.approx(centre), True, "centre of 3 repeats"), "b": (1.0, True, "")}
    every_bs = Budget(measurement="student_inference", stat="p95_ms", max=5, where={"precision": "bf16"})
    [(bs1, met1), (bs4, met4)] = [(c.batch_size, c.met) for c in check(df, [every_bs])]
    assert (bs1, met1, bs4, met4) == (1, True, 4, False)
    assert check(df, [every_bs])[1].note == "oom: out of memory"
    floor = Budget.model_validate({"measurement": "student_inference", "stat": "throughput", "min": 1000})
    assert [(c.cell_id, c.met) for c in check(df, [floor])] == [("a", False), ("b", True), ("b", False)]
    memory = Budget.model_validate({"measurement": "distill_step", "stat": "peak_memory_bytes", "max": "8e9"})
    [mem] = check(df, [memory])
    assert (mem.value, mem.met) == (9e9, False)
    assert memory.describe() == "distill_step peak_memory_bytes <= 8e+09 bytes"


def test_a_missed_budget_exits_1_names_the_budget_and_shows_in_the_report(tmp_path, capsys):
    budgets = [
        {"measurement": "distill_step", "stat": "median_ms", "max": 60_000},
        {"measurement": "student_inference", "batch_size": 4, "stat": "p99_ms", "max": 1e-6, "name": "tiny"},
    ]
    suite = write_suite(tmp_path / "s.yaml", **SUITE, budgets=budgets)
    code = main(["run", str(suite), "--out", str(tmp_path / "res"), "--report-dir", str(tmp_path / "rep")])
    out, err = capsys.readouterr()
    assert code == 1
    assert "budgets: 1 of 2 checks met" in out
    assert "MISSED tiny: linear->linear kd fp32 bs4, student_inference bs4:" in err
    page = (tmp_path / "rep" / "index.html").read_text()
    section = page.split('<h2 id="budgets">')[1].split("<h2")[0]
    assert "1 of 2\n  budget checks met; 1 missed" in section
    assert section.index("✗ missed") < section.index("✓ met")  # missed first
    assert "distill_step median_ms &lt;= 60000 ms" in section
    # The report of the stored run shows the same, from the budgets kept in its manifest.
    assert [Budget.model_validate(b) for b in run_folder(tmp_path / "res").budgets()] == [
        Budget.model_validate(b) for b in budgets
    ]
    main(["report", str(tmp_path / "res"), "--out", str(tmp_path / "rep2")])
    assert "✗ missed" in (tmp_path / "rep2" / "index.html").read_text()


@pytest.mark.parametrize(
    "budget, message",
    [
        ({"measurement": "distill_step", "stat": "p95", "max": 1}, "unknown statistic 'p95'; did you mean p95_ms"),
        ({"measurement": "distill_step"}, "give a limit: max (for times and memory) or min (for throughput)"),
        ({"measurement": "distill_step", "max": 1, "where": {"precison": "bf16"}}, "did you mean precision"),
        ({"measurement": "student_inference", "batch_size": 64, "max": 1}, "matches no measurement of the plan"),
        ({"measurement": "distill_step", "max": 1, "where": {"precision": "bf16"}}, "matches no measurement"),
    ],
)
def test_budget_mistakes_are_one_line_errors(tmp_path, capsys, budget, message):
    suite = write_suite(tmp_path / "s.yaml", **SUITE, budgets=[budget])
    assert main(["run", str(suite), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and "budgets" in err and len(err.strip().splitlines()) == 1
    assert err.startswith(f"kdbench: error: {suite}:")
