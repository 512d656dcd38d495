"""Tests of the HTML report on a small synthetic result frame."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest

from kdbench.core.errors import KdbenchError
from kdbench.core.schema import Row
from kdbench.report import render_report
from kdbench.report.format import format_ms
from tests.support.helpers import as_read
from tests.support.rows import result_row, timing

SCRIPT = "<script>alert(1)</script>"
RUNS = {
    "run-a": {"device_name": "NVIDIA H200", "backend": "cuda", "hostname": "gpu-a", "cuda_version": "12.4"},
    "run-b": {"device_name": "AMD Instinct MI300X", "backend": "rocm", "hostname": "gpu-b", "hip_version": "6.2"},
}
CELLS = {  # cell_label: (run_id, teacher, student, precision)
    "resnet50→resnet18 fp16": ("run-a", "resnet50", "resnet18", "fp16"),
    "resnet50→mobilenet_v3_small bf16": ("run-b", "resnet50", "mobilenet_v3_small", "bf16"),
}
STUDENT_MEDIAN = 1.23456  # student_inference, batch 1, first cell
NULL_STATS = dict.fromkeys(("n", "median_ms", "iqr_ms", "p05_ms", "p95_ms", "samples_ms", "noisy", "throughput"))


def _row(label: str, measurement: str, batch_size: int, median_ms: float, **extra) -> Row:
    """A row of the cell ``label`` (:data:`CELLS`), its statistics from ``median_ms``."""
    run_id, teacher, student, precision = CELLS[label]
    cell = dict(schema_version=1, run_id=run_id, suite="smoke", cell_id=f"id-{label}", cell_label=label)
    setting = dict(precision=precision, teacher=teacher, student=student, method="kd", world_size=1)
    row = result_row(**cell, measurement=measurement, batch_size=batch_size, **setting, **RUNS[run_id])
    row.update(timestamp=datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC), torch_version="2.5.1")
    return row | timing(median_ms, batch_size, n=50, iqr=0.04, p05=0.95, p95=1.1) | extra


def _rows() -> list[dict]:
    """Per cell: a distill step and student/teacher inference at batch 1 and 64.

    The first cell's distill step is noisy, the second's launch-bound; the second cell's teacher failed at batch 64
    (null statistics, an error holding a script tag, so no speed-up for that batch).
    """
    rows = []
    for i, label in enumerate(CELLS):
        rows.append(
            _row(
                label,
                "distill_step",
                64,
                40.0 + 10 * i,
                noisy=i == 0,
                iqr_ms=8.0 if i == 0 else 1.0,
                launch_bound=i == 1,
            )
        )
        for bs in (1, 64):
            student = STUDENT_MEDIAN if (i, bs) == (0, 1) else 0.5 * bs**0.5 + i
            if (i, bs) == (1, 64):
                teacher = _row(label, "teacher_inference", bs, 1.0)
                teacher.update(NULL_STATS, status="failed", error=f"RuntimeError: {SCRIPT} boom")
            else:
                teacher = _row(label, "teacher_inference", bs, 3 * student)  # a speed-up of 3 at read time
            rows += [_row(label, "student_inference", bs, student), teacher]
    return rows


def _frame(rows):
    return as_read(rows)


def _table_rows(page: str, *needles: str) -> list[str]:
    """The measurement-table rows (``<tr>...</tr>``) that contain every needle."""
    return [
        tr for tr in re.findall(r"<tr class=\"(?:ok|not-ok)\">.*?</tr>", page, re.S) if all(n in tr for n in needles)
    ]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    index = render_report(_frame(_rows()), out / "nested")
    return index, index.read_text(encoding="utf-8")


def test_page_lists_every_cell_and_links_valid_pngs(report):
    index, page = report
    assert index.name == "index.html" and index.exists()
    for label in CELLS:
        assert label in page
    images = re.findall(r'<img src="([^"]+)"', page)
    assert sorted(images) == ["distill_step.png", "inference_latency.png", "speedup.png"]
    for name in images:
        assert "/" not in name
        assert (index.parent / name).read_bytes().startswith(b"\x89PNG")


def test_result_strings_are_escaped(report):
    _, page = report
    assert SCRIPT not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_failed_row_is_marked(report):
    _, page = report
    (row,) = _table_rows(page, "teacher_inference", "run-b", ">64<")
    assert 'class="not-ok"' in row and ">failed<" in row
    assert "failed: 1" in page and "ok: 9" in page


def test_noisy_row_is_marked(report):
    _, page = report
    (row,) = _table_rows(page, "run-a", "distill_step")
    assert "⚠ noisy" in row
    assert all("⚠ noisy" not in r for r in _table_rows(page, "run-b"))


def test_launch_bound_row_is_marked(report):
    _, page = report
    (row,) = _table_rows(page, "run-b", "distill_step")
    assert ">launch-bound<" in row and "⚠ noisy" not in row
    assert all(">launch-bound<" not in r for r in _table_rows(page, "run-a"))


def test_environment_shows_both_runs(report):
    _, page = report
    env = page.split("<h2>Environment</h2>")[1]
    for run_id, info in RUNS.items():
        assert f"run {run_id}" in env and info["device_name"] in env
    assert "12.4" in env and "6.2" in env
    assert "driver_version" not in env  # null everywhere: left out


def test_median_is_formatted_to_three_significant_digits(report):
    _, page = report
    (row,) = _table_rows(page, "student_inference", "run-a", ">1<")
    assert re.search(r'class="num median">([^<]*)<', row).group(1) == format_ms(STUDENT_MEDIAN) == "1.23"


@pytest.mark.parametrize(
    "value, text",
    [(1234.5, "1230"), (12.345, "12.3"), (1.0, "1.00"), (0.012345, "0.0123"), (999.7, "1000"), (None, "—")],
)
def test_format_ms(value, text):
    assert format_ms(value) == text


def test_empty_frame_is_an_error(tmp_path):
    with pytest.raises(KdbenchError):
        render_report(_frame([]), tmp_path)


def test_only_failed_rows_render_without_charts(tmp_path):
    rows = [r | {"status": "failed", "median_ms": None, "error": "OOM"} for r in _rows()]
    page = render_report(_frame(rows), tmp_path, title="All <failed>").read_text(encoding="utf-8")
    assert "<img" not in page and not list(tmp_path.glob("*.png"))
    # the three timing charts and the phase chart are skipped, each with its reason
    assert page.count('class="skipped"') == 4 and "Not drawn: no successful distill_step measurement." in page
    assert "Not drawn: no successful distill_step measurement has phase timings." in page
    assert "All &lt;failed&gt;" in page
    assert len(_table_rows(page, 'class="not-ok"')) == len(rows)


def test_rendering_a_report_never_imports_torch(tmp_path):
    # The report reads data only: pandas, pyarrow, matplotlib and jinja2.
    import subprocess
    import sys

    from kdbench.store.results import open_run

    run = open_run(tmp_path / "res", "suite", "suite.yaml")
    for i, label in enumerate(CELLS):
        run.write_part(f"c{i}", [r for r in _rows() if r["cell_label"] == label])
    script = (
        "import sys\n"
        "from kdbench.cli import main\n"
        f"assert main(['report', {str(tmp_path / 'res')!r}, '--out', {str(tmp_path / 'rep')!r}]) == 0\n"
        "from kdbench import api\n"
        f"api.render([{str(run.path)!r}], {str(tmp_path / 'rep2')!r})\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "rep" / "index.html").is_file() and (tmp_path / "rep2" / "distill_step.png").is_file()
