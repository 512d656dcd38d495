"""The report's *predicted on other devices* table (kdbench.report.fit_devices, issue 43 scope 4): each ok step cell's
step as the rows carry it on the table's GPUs (predicted_step_devices), beside the step measured here, once per
cell whatever its repeats, and on the page inside the Will it fit section; absent for rows without the column."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from kdbench.core.schema import Row
from kdbench.report import render_report
from kdbench.report.fit_devices import devices_table
from tests.support.helpers import as_read
from tests.support.rows import result_row

MIB = 2**20
ON = {
    "H100 80GB": {"ms": 21.25, "per_s": 48_188.2, "unit": "tokens"},
    "MI300X": {"ms": 8.5, "per_s": 120_470.6, "unit": "tokens"},
}


def _row(cell: str, on: dict | None, repeat: int = 1, status: str = "ok", **extra) -> Row:
    row = result_row(
        run_id="run-dev",
        suite="llm-cpu",
        cell_id=f"id-{cell}",
        cell_label=cell,
        measurement="distill_step",
        teacher="tiny-llama-teacher",
        student="tiny-llama-student",
        precision="fp32",
        device_name="AMD EPYC",
        backend="cpu",
        timestamp=datetime(2026, 12, 6, 1, 0, tzinfo=UTC),
        predicted_peak_bytes=100 * MIB,
        live_peak_bytes=101 * MIB,
        repeat=repeat,
        status=status,
        predicted_step_ms=250.0,
        predicted_step_devices=None if on is None else json.dumps(on),
    )
    return row | extra


def test_one_row_per_ok_step_cell_with_each_devices_step_and_rate():
    rows = [
        _row("lm", ON),
        _row("lm", {**ON, "MI300X": {"ms": 1.0, "per_s": 1.0, "unit": "tokens"}}, repeat=2),  # a repeat: not again
        _row("bf16", {"H200": {"ms": 12345.0, "per_s": 3.5, "unit": "samples"}}),
        _row("failed", ON, status="error"),
        _row("old", None),
    ]
    table = devices_table(as_read(rows))
    assert table.devices == ["H200", "H100 80GB", "MI300X"]  # in the order first met (rows sorted by label)
    by = {r["cell_label"]: r for r in table.rows}
    assert set(by) == {"lm", "bf16"}
    assert by["lm"]["cells"] == [("—", ""), ("21.2 ms", "48.2k tokens/s"), ("8.50 ms", "120.5k tokens/s")]
    assert by["bf16"]["cells"][0] == ("12,345.0 ms", "4 samples/s") and by["bf16"]["predicted"] == "250.0 ms"


def test_no_table_without_the_column_and_the_page_shows_it_with_it(tmp_path):
    assert devices_table(as_read([_row("old", None)])) is None
    html = render_report(as_read([_row("lm", ON)]), tmp_path).read_text(encoding="utf-8")
    section = html[html.index('<h3 id="fit-devices">') :]
    section = section[: section.index("</table>")]
    assert "Predicted on other devices" in section and "<th>H100 80GB</th><th>MI300X</th>" in section
    assert "21.2 ms<br><small>48.2k tokens/s</small>" in section
    old = render_report(as_read([_row("old", None)]), tmp_path / "old").read_text(encoding="utf-8")
    assert 'id="fit-devices"' not in old
