"""Tests of the report's Will it fit section (kdbench.report.fit) on a small synthetic frame: the fit planner's
predicted peak against the measured live peak, per distill_step row, flagged outside the tolerance."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime

import pytest

from kdbench.core.names import FIT_NOTE
from kdbench.core.schema import Row
from kdbench.report import render_report
from kdbench.report.fit import breakdown_text, fit_notes, fit_points, fit_rows
from tests.support.helpers import as_read
from tests.support.rows import result_row

MIB = 2**20
FAR_NOTE = (
    f"{FIT_NOTE}the measured peak (130.0 MiB) is 1.300x the predicted (100.0 MiB), outside the tolerance 0.90-1.10"
)
WHY = "the fake run cannot run aten.nonzero.default (DynamicOutputShapeException): it reads values"
BREAKDOWN = json.dumps({"parameters": 60 * MIB, "gradients": 0, "activations": 40 * MIB})


def _row(cell: str, predicted: int | None, live: int | None, measurement: str = "distill_step", **extra) -> Row:
    row = result_row(
        run_id="run-fit",
        suite="cpu-quick",
        cell_id=f"id-{cell}",
        cell_label=cell,
        measurement=measurement,
        teacher="resnet56",
        student="resnet20",
        precision="fp32",
        device_name="AMD EPYC",
        backend="cpu",
        timestamp=datetime(2026, 12, 3, 1, 0, tzinfo=UTC),
        predicted_peak_bytes=predicted,
        live_peak_bytes=live,
        host_peak_bytes=None if live is None else live + 300 * MIB,
    )
    if predicted is not None:
        row.update(predicted_peak_phase="loss", predicted_breakdown=BREAKDOWN, fit_seconds=0.5)
        if live is not None:
            row["predicted_peak_ratio"] = live / predicted
    return row | extra


def _rows() -> list[Row]:
    return [
        _row("close", 100 * MIB, 103 * MIB),
        _row("far", 100 * MIB, 130 * MIB, notes=f"adamw: foreach; {FAR_NOTE}"),
        _row("unpredictable", None, 50 * MIB, notes=f"{FIT_NOTE}peak not predicted: {WHY}"),
        _row("oom", 90 * MIB, None, status="oom", error="OutOfMemoryError"),
        _row("close", 100 * MIB, 103 * MIB, measurement="student_inference"),  # not a step row: no fit figure shown
        _row("old", None, None),  # a row stored before the fit columns: not in the section
    ]


@pytest.fixture(scope="module")
def frame():
    return as_read(_rows())


@pytest.fixture(scope="module")
def page(tmp_path_factory, frame):
    out = tmp_path_factory.mktemp("fit-report")
    index = render_report(frame, out)
    return out, index.read_text(encoding="utf-8")


def _section(page: str) -> str:
    return page.split('<h2 id="fit">')[1].split('<h2 id="profile">')[0]


def _fit_row(html: str, cell: str) -> str:
    [tr] = [tr for tr in re.findall(r'<tr class="fit-row[^"]*">.*?</tr>', html, re.S) if f"<td>{cell}</td>" in tr]
    return tr


def _cell(tr: str, cls: str) -> str:
    return re.search(rf'class="num {cls}">([^<]*)<', tr).group(1)


def test_fit_points_are_the_step_rows_with_a_figure_or_a_note(frame):
    points = fit_points(frame).set_index("cell_label")
    assert sorted(points.index) == ["close", "far", "oom", "unpredictable"]
    assert points.loc["close", "ratio"] == pytest.approx(1.03) and not points.loc["close", "flagged"]
    assert points.loc["far", "ratio"] == pytest.approx(1.3) and points.loc["far", "flagged"]
    assert points.loc["unpredictable", "ratio"] != points.loc["unpredictable", "ratio"]  # NaN: nothing to judge
    assert not points.loc["unpredictable", "flagged"] and not points.loc["oom", "flagged"]
    assert points.loc["far", "fit_note"] == FAR_NOTE.removeprefix(FIT_NOTE)  # the other notes left out
    assert points.loc["unpredictable", "fit_note"] == f"peak not predicted: {WHY}"


def test_the_ratio_is_computed_where_a_row_lacks_the_stored_one():
    row = _row("computed", 200 * MIB, 170 * MIB)
    del row["predicted_peak_ratio"]
    [point] = fit_points(as_read([row])).to_dict("records")
    assert point["ratio"] == pytest.approx(0.85) and point["flagged"]


def test_fit_notes_and_the_breakdown_read_as_text():
    assert fit_notes(f"a; {FIT_NOTE}b; c; {FIT_NOTE}d") == "b; d"
    assert fit_notes(None) == ""
    assert breakdown_text(BREAKDOWN) == "parameters 60.0 MiB, activations 40.0 MiB"  # zero kinds left out


def test_fit_rows_are_formatted_and_flagged(frame):
    rows = {r["cell_label"]: r for r in fit_rows(fit_points(frame))}
    assert rows["close"]["predicted"] == "100.0 MiB" and rows["close"]["measured"] == "103.0 MiB"
    assert rows["close"]["ratio"] == "1.030" and not rows["close"]["flagged"]
    assert rows["far"]["flagged"] and rows["far"]["phase"] == "loss"
    assert rows["unpredictable"]["predicted"] == "—" and rows["unpredictable"]["ratio"] == "—"
    assert rows["oom"]["status"] == "oom" and not rows["oom"]["ok"] and rows["oom"]["measured"] == "—"
    assert rows["close"]["host_peak"] == "403.0 MiB"


def test_the_page_has_the_chart_and_the_table(page):
    out, html = page
    section = _section(html)
    assert (out / "fit_peak.png").stat().st_size > 0 and 'src="fit_peak.png"' in section
    assert "1 here" in section  # one row outside the tolerance
    far = _fit_row(section, "far")
    assert _cell(far, "ratio") == "1.300" and "⚠ outside 0.90–1.10" in far
    assert f'title="{breakdown_text(BREAKDOWN)}"' in far
    close = _fit_row(section, "close")
    assert _cell(close, "predicted") == "100.0 MiB" and _cell(close, "measured") == "103.0 MiB" and "✓" in close
    assert "aten.nonzero.default" in _fit_row(section, "unpredictable")
    assert 'class="fit-row not-ok"' in _fit_row(section, "oom")


def test_a_frame_without_fit_figures_has_no_section(tmp_path):
    html = render_report(as_read([_row("old", None, None)]), tmp_path).read_text(encoding="utf-8")
    assert 'id="fit"' not in html and not (tmp_path / "fit_peak.png").exists()


def test_no_row_with_both_figures_is_said_not_drawn(tmp_path):
    html = render_report(as_read([_row("unpredictable", None, 50 * MIB)]), tmp_path).read_text(encoding="utf-8")
    assert "Not drawn: no distill_step row has both a predicted and a measured peak." in _section(html)
