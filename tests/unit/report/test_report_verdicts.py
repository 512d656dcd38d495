"""The report shows what the verdicts judged: repeats pooled as compare centres them, one bar per cell, thin
rows marked, a suite's history over its runs, budgets and break-even that respect thin and skipped rows."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import numpy as np
import pandas as pd
import pytest

from kdbench.config.budgets import Budget, check
from kdbench.core.schema import Row
from kdbench.report import render_report
from kdbench.report.charts import add_variant, with_keys
from kdbench.report.compare.plots import history_runs
from kdbench.report.summaries import pooled
from tests.support.helpers import as_read
from tests.support.rows import result_row

START = datetime(2026, 1, 1, tzinfo=UTC)


def _row(run: int, cell: str, measurement: str, median: float, repeat: int = 1, **extra) -> Row:
    """Repeat ``repeat`` of ``cell`` in run ``run`` of suite nightly: 40 samples around ``median``; ``config``
    (a dict) is added to the cell's resolved config."""
    rng = np.random.default_rng(hash((run, cell, measurement, repeat)) % 2**32)
    samples = (median * rng.lognormal(0, 0.01, 40)).tolist()
    config = {"pair": {"teacher": "t", "student": "s"}, **extra.pop("config", {})}
    row = result_row(
        run_id=f"run{run}",
        suite="nightly",
        suite_commit=f"{run:07x}abcde",
        cell_id=cell,
        cell_label=f"t->s {cell}",
        repeat=repeat,
        measurement=measurement,
        batch_size=8 if measurement == "distill_step" else 1,
        teacher="t",
        student="s",
        precision="fp32",
        backend="cpu",
        device_name="cpu-x",
        samples_ms=samples,
        median_ms=float(np.median(samples)),
        p25_ms=float(np.percentile(samples, 25)),
        p75_ms=float(np.percentile(samples, 75)),
        n=40,
        min_iters=10,
        throughput=8 / float(np.median(samples)) * 1e3,
        config_json=json.dumps(config, sort_keys=True),
        timestamp=START + timedelta(hours=run, minutes=repeat),
    )
    return row | extra


def _run(run: int, slow: float = 1.0) -> list[Row]:
    rows = []
    for repeat in (1, 2, 3):
        level = 1 + 0.01 * (repeat - 2)
        rows.append(_row(run, "a", "distill_step", 20.0 * level * slow, repeat))
        rows.append(_row(run, "a", "student_inference", 2.0 * level, repeat))
        rows.append(_row(run, "b", "distill_step", 40.0 * level, repeat))
    return rows


def test_pooled_rows_centre_the_repeats_as_compare_does():
    df = as_read(_run(0))
    step = pooled(df).set_index(["cell_id", "measurement"]).loc[("a", "distill_step")]
    medians = df[(df["cell_id"] == "a") & (df["measurement"] == "distill_step")]["median_ms"]
    assert step["median_ms"] == pytest.approx(np.exp(np.log(medians).mean()))
    assert step["repeats"] == 3 and step["n"] == 120
    assert step["centre_low_ms"] < step["median_ms"] < step["centre_high_ms"]


def test_thin_repeats_are_left_out_of_the_pool_and_a_thin_only_measurement_stays_thin():
    rows = _run(0)
    for r in rows:
        if r["cell_id"] == "a" and r["measurement"] == "distill_step" and r["repeat"] == 3:
            r.update(thin=True, median_ms=500.0)  # a budget-shrunk repeat: its figure must not count
        if r["cell_id"] == "b":
            r["thin"] = True
    pool = pooled(as_read(rows)).set_index(["cell_id", "measurement"])
    assert pool.loc[("a", "distill_step"), "repeats"] == 2 and pool.loc[("a", "distill_step"), "median_ms"] < 25
    assert bool(pool.loc[("b", "distill_step"), "thin"]) and pool.loc[("b", "distill_step"), "repeats"] == 3


def test_cells_that_differ_only_by_a_lever_never_share_a_bar():
    rows = [
        _row(0, "plain", "distill_step", 20.0),
        _row(0, "comp", "distill_step", 18.0, compile="default", config={"compile": "default"}),
        _row(0, "fused", "distill_step", 19.0, optimizer_impl="fused", config={"optimizer": {"impl": "fused"}}),
        _row(0, "hidden", "distill_step", 19.5, config={"something": "else"}),  # a difference no column shows
    ]
    bars = add_variant(with_keys(pooled(as_read(rows))), within=("source", "pair"))
    assert bars["variant"].nunique() == 4
    labels = dict(zip(bars["cell_id"], bars["variant"]))
    assert "compile-default" in labels["comp"] and "fused" in labels["fused"]
    assert labels["hidden"].endswith("#hidden") and labels["plain"].endswith("#plain")  # told apart by their ids


def test_a_suites_history_marks_the_run_that_regressed(tmp_path):
    rows = _run(0) + _run(1) + _run(2, slow=1.5) + _run(3, slow=1.5)
    df = as_read(rows)
    runs = history_runs(df)
    assert [r.label for r in runs] == [f"{i:07x}abcde" for i in range(4)]
    assert [r.failing for r in runs] == [None, 0, 1, 0]  # run 2 regressed against run 1; run 3 holds
    page = render_report(df, tmp_path).read_text()
    section = page.split('<h2 id="history-1">')[1].split("<h2")[0]
    assert "History of suite nightly on cpu-x (cpu)" in section and 'src="history_1.png"' in section
    assert section.count("fail the gate</span>") == 1 and "1 regressed" in section
    assert (tmp_path / "history_1.png").read_bytes().startswith(b"\x89PNG")


def test_budgets_judge_neither_thin_nor_skipped_rows():
    rows = _run(0)
    for r in rows:
        if r["cell_id"] == "b":
            r["thin"] = True
    rows.append(_row(0, "c", "distill_step", 1.0, status="skipped", error="no onnxruntime here"))
    rows.append(_row(0, "d", "distill_step", 1.0, status="oom", error="out of memory"))
    checks = {c.cell_id: c for c in check(pd.DataFrame(rows), [Budget(measurement="distill_step", max=30)])}
    assert {k: c.outcome for k, c in checks.items()} == {"a": "met", "b": "thin", "c": "skipped", "d": "failed"}
    assert [k for k, c in checks.items() if c.missed] == ["d"]
    assert "no onnxruntime here" in checks["c"].note


def test_break_even_matches_repeats_subtracts_the_twins_cold_calls_and_gives_a_range():
    plain, lever = {}, {"compile": "default"}
    rows = []
    for repeat, (base, fast) in enumerate([(20.0, 15.0), (22.0, 16.5), (21.0, 16.0)], 1):
        rows.append(_row(0, "plain", "distill_step", base, repeat, cold_excess_ms=300.0, config=plain))
        rows.append(
            _row(
                0,
                "comp",
                "distill_step",
                fast,
                repeat,
                compile="default",
                one_off_ms=5300.0,
                one_off_kind="torch.compile",
                config=lever,
            )
        )
    df = as_read(rows)
    comp = df[df["cell_id"].eq("comp")]
    gains = [
        a - b
        for a, b in zip(
            df[df["cell_id"].eq("plain")].sort_values("repeat")["median_ms"], comp.sort_values("repeat")["median_ms"]
        )
    ]
    row = comp.iloc[0]
    assert row["lever_gain_ms"] == pytest.approx(np.mean(gains))
    assert row["lever_one_off_net_ms"] == pytest.approx(
        5000.0
    )  # the plain cell's 300 ms cold excess is not the lever's
    assert row["break_even_steps"] == np.ceil(5000.0 / np.mean(gains))
    assert row["lever_gain_low_ms"] < row["lever_gain_ms"] < row["lever_gain_high_ms"]
    assert row["break_even_low_steps"] <= row["break_even_steps"] <= row["break_even_high_steps"]
    assert comp["break_even_steps"].nunique() == 1  # one figure for the cell, on each of its repeats
    # a thin twin is no baseline
    for r in rows:
        if r["cell_id"] == "plain":
            r["thin"] = True
    assert as_read(rows)["lever_gain_ms"].isna().all()


def test_the_runs_table_says_which_run_is_incomplete(tmp_path):
    from kdbench.store.results import RunState

    df = as_read(_run(0) + _run(1))
    states = {
        "run0": RunState("run0", frozenset({"a", "b"}), frozenset({"a", "b"})),
        "run1": RunState("run1", frozenset({"a", "b"}), frozenset({"a"}), 1, 1),
    }
    page = render_report(df, tmp_path, states=states).read_text()
    runs = page.split("<h2>Runs</h2>")[1].split("</table>")[0]
    assert "complete: 2 of 2 planned jobs stored" in runs
    assert re.search(r'class="run-row not-ok">.*run1', runs, re.S)
    assert "INCOMPLETE: 1 of 2 planned jobs stored" in runs
