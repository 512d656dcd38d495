"""Tests of the report's profile, teacher caching, top operators and quality sections."""

from __future__ import annotations

import html
import json
import re
from datetime import UTC, datetime

import numpy as np
import pandas as pd
import pytest

from kdbench.core.schema import Row
from kdbench.report import render_report
from kdbench.report.step_tables import trace_link
from kdbench.report.summaries import summarize_quality
from tests.support.helpers import as_read
from tests.support.rows import result_row

MIB = 2**20
RUNS = {
    "run-p": {
        "device_name": "NVIDIA H200",
        "backend": "cuda",
        "hostname": "gpu-a",
        "cpu_capability": "AVX512",
        "float32_matmul_precision": "highest",
        "tf32_matmul": False,
    },
    "run-q": {"device_name": "AMD Instinct MI300X", "backend": "rocm", "hostname": "gpu-b", "miopen_cache_warm": True},
}
EVIL = '"><script>alert(2)</script>'


def _config(mode: str, batch_size: int = 64) -> str:
    return json.dumps(
        {
            "pair": {"teacher": "resnet50", "student": "resnet18"},
            "batch_size": batch_size,
            "precision": "fp16",
            "teacher": {"mode": mode},
            "features": {"teacher": None},
        },
        sort_keys=True,
    )


def _phases(teacher, student, loss, backward, optimizer, remainder) -> dict:
    return {
        "phase_teacher_forward_ms": teacher,
        "phase_student_forward_ms": student,
        "phase_loss_ms": loss,
        "phase_backward_ms": backward,
        "phase_optimizer_ms": optimizer,
        "phase_remainder_ms": remainder,
    }


def _row(run_id: str, label: str, measurement: str, median_ms: float | None, **extra) -> Row:
    """A row of the cell ``label`` of ``run_id`` (:data:`RUNS`: its machine), at batch size 64 in fp16."""
    row = result_row(
        schema_version=1,
        run_id=run_id,
        suite="profile",
        cell_id=f"id-{run_id}-{label}",
        cell_label=label,
        measurement=measurement,
        batch_size=64,
        precision="fp16",
        teacher="resnet50",
        student="resnet18",
        method="kd",
        world_size=1,
        timestamp=datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC),
        n=20,
        median_ms=median_ms,
        iqr_ms=None if median_ms is None else median_ms * 0.02,
        noisy=False,
        throughput=None if median_ms is None else 64 / median_ms * 1000,
        **RUNS[run_id],
    )
    return row | extra


def _step_rows(out_dir) -> list[Row]:
    """run-p: a live/cached pair (A, B) and a cached cell at another batch size (C); run-q: a live twin of B."""
    a = _row(
        "run-p",
        "A live",
        "distill_step",
        10.0,
        config_json=_config("live"),
        teacher_mode="live",
        **_phases(3.0, 2.0, 0.5, 3.0, 1.37, 0.13),
        first_ms=250.0,
        time_to_steady_ms=312.6,
        steady_after_iters=4,
        flops=1.234e12,  # 123.4 TFLOP/s at 10 ms: 12.5 % of the H200's 989.4, 20 % of the probe's 617
        ceiling_tflops=617.0,
        ceiling_probe_id="probe-42",
        memory_kind="device",
        peak_memory_bytes=512 * MIB,
        optimizer_state_bytes=3 * MIB,
        energy_per_step_j=2.5,
        samples_per_joule=25.6,
        nonfinite_steps=0,
        scaler_skips=0,
        window_throughput=64 / 10.0 * 1000 * 0.97,  # 3 %: within the noise, no warning
        trace_file=str(out_dir / "traces" / "a.json"),
        top_ops=json.dumps(
            [
                {"op": "aten::convolution", "self_ms_per_call": 1.23456, "count": 4},
                {"op": "aten::<lambda>", "self_ms_per_call": 0.5, "count": 12},
            ]
        ),
    )
    b = _row(
        "run-p",
        "B cached",
        "distill_step",
        7.5,
        config_json=_config("cached"),
        teacher_mode="cached",
        teacher_cache_ms=101.0,
        **_phases(0.01, 2.0, 0.5, 3.0, 1.0, 0.99),
        nonfinite_steps=2,
        scaler_skips=1,
        trace_file=str(out_dir / "traces" / f"{EVIL}.json"),
        top_ops=json.dumps([{"op": "aten::addmm", "self_ms_per_call": 0.25, "count": 3}]),
    )
    c = _row(
        "run-p",
        "C cached bs128",
        "distill_step",
        14.0,
        batch_size=128,
        config_json=_config("cached", 128),
        teacher_mode="cached",
        teacher_cache_ms=50.0,
    )
    d = _row(
        "run-q",
        "D live",
        "distill_step",
        9.0,
        config_json=_config("live"),
        teacher_mode="live",
        **_phases(3.0, 2.0, 0.5, 3.0, 1.0, -0.5),
        launch_bound=True,
        energy_window_s=1.5,
        window_throughput=64 / 9.0 * 1000 * 0.9,  # the window sustained 10 % less than the median says
    )
    return [a, b, c, d]


def _inference_rows() -> list[Row]:
    rows = []
    for bs, student_ms, teacher_ms in ((1, 0.4, 2.0), (64, 3.0, 20.0)):
        rows.append(
            _row(
                "run-p",
                "A live",
                "student_inference",
                student_ms,
                batch_size=bs,
                student="linear",
                teacher="resnet8",
            )
        )
        rows.append(
            _row("run-p", "A live", "teacher_inference", teacher_ms, batch_size=bs, student="linear", teacher="resnet8")
        )
    return rows


SCRATCH = {"accuracy": [0.70, 0.72, 0.69], "agreement": [0.75, 0.78, 0.74], "time_to_target_s": [None, 5.0, 6.0]}
DISTILLED = {"accuracy": [0.80, 0.83, 0.81], "agreement": [0.85, 0.88, 0.86], "time_to_target_s": [3.0, 4.0, None]}
TEACHER = {"accuracy": [0.90, 0.92, 0.95], "agreement": [None] * 3, "time_to_target_s": [10.0, 11.0, 12.0]}


def _quality_rows() -> list[Row]:
    rows = []
    for role, student, method, values in (
        ("teacher", None, None, TEACHER),
        ("scratch", "linear", None, SCRATCH),
        ("distilled", "linear", "kd", DISTILLED),
    ):
        for seed in range(3):
            row = {k: values[k][seed] for k in values}
            rows.append(
                _row(
                    "run-p",
                    None,
                    "quality",
                    None,
                    quality_role=role,
                    teacher="resnet8",
                    student=student,
                    method=method,
                    seed=seed,
                    batch_size=32,
                    quality_dataset="digits",
                    quality_epochs=5,
                    quality_target=0.95,
                    cell_id=None,
                    n=None,
                    throughput=None,
                    **row,
                )
            )
    failed = rows[-1] | dict(
        seed=3,
        status="failed",
        error="RuntimeError: boom",
        accuracy=None,
        agreement=None,
        time_to_target_s=None,
    )
    return rows + [failed]


def _frame(rows) -> pd.DataFrame:
    return as_read(rows)


def _cells(tr: str) -> list[str]:
    return [html.unescape(re.sub(r"<[^>]+>", "", td)).strip() for td in re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)]


def _rows_of(page: str, cls: str) -> dict[str, list[str]]:
    """The rows of class ``cls``, as their cells' texts, by their second cell (cell label or student)."""
    rows = [_cells(tr) for tr in re.findall(rf'<tr class="{cls}">(.*?)</tr>', page, re.S)]
    return {r[1]: r for r in rows}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "rep"
    rows = _step_rows(out) + _inference_rows() + _quality_rows()
    index = render_report(_frame(rows), out)
    return index, index.read_text(encoding="utf-8")


PROFILE_HEADER = [
    "run_id",
    "cell_label",
    "repeats",
    "median",
    "teacher fwd",
    "student fwd",
    "loss",
    "backward",
    "optimizer",
    "remainder",
    "adds up",
    "first",
    "to steady",
    "GFLOPs",
    "TFLOP/s",
    "MFU",
    "ceiling",
    "memory",
    "optimizer state",
    "J/step",
    "samples/J",
    "warnings",
]


def test_profile_table_formats_phases_and_flags_the_remainder(report):
    _, page = report
    rows = {label: dict(zip(PROFILE_HEADER, cells)) for label, cells in _rows_of(page, "profile-row").items()}
    assert sorted(rows) == ["A live", "B cached", "C cached bs128", "D live"]
    a, b, c, d = rows["A live"], rows["B cached"], rows["C cached bs128"], rows["D live"]
    assert [a[k] for k in ("median", "teacher fwd", "student fwd", "loss", "backward", "optimizer")] == [
        "10.0",
        "3.00",
        "2.00",
        "0.500",
        "3.00",
        "1.37",
    ]
    assert a["remainder"] == "0.130 ms (1.3 %)" and a["adds up"] == "✓"
    assert b["remainder"] == "0.990 ms (13.2 %)" and b["adds up"] == "⚠ phases don't add up"
    assert d["remainder"] == "-0.500 ms (-5.6 %)" and d["adds up"] == "✓"
    assert c["remainder"] == "—" and c["adds up"] == "—" and c["teacher fwd"] == "—"
    assert (a["first"], a["to steady"]) == ("250", "313 (4 calls)")
    assert (a["GFLOPs"], a["TFLOP/s"], a["MFU"], a["ceiling"]) == ("1230", "123", "12.5 % of H200 SXM", "20.0 %")
    assert (a["memory"], a["optimizer state"], a["J/step"], a["samples/J"]) == (
        "512.0 MiB (device)",
        "3.0 MiB",
        "2.50",
        "25.6",
    )
    assert a["warnings"] == "" and b["warnings"] == "2 non-finite steps1 GradScaler skip"
    assert d["warnings"] == (
        "window 10% below the median's throughput: gaps or stalls"
        "launch-bound: measures the host, not the GPU"
        "energy over 1.5 s: rough"
    )
    assert (b["J/step"], b["samples/J"], b["MFU"], b["memory"]) == ("—", "—", "—", "—")
    (a_tr,) = [tr for tr in re.findall(r'<tr class="profile-row">.*?</tr>', page, re.S) if "A live" in tr]
    assert 'title="measured ceiling 617 TFLOP/s, probe probe-42"' in a_tr
    assert 'title="achieved / datasheet peak 989 TFLOP/s"' in a_tr


def test_caching_table_computes_saving_and_payback(report):
    _, page = report
    rows = _rows_of(page, "caching-row")
    assert list(rows) == ["A live"]  # C differs in batch size; D is in another run
    assert rows["A live"] == ["run-p", "A live", "10.0", "7.50", "2.50", "25.0 %", "101", "41"]  # ceil(101 / 2.5)
    assert 'title="cached: B cached"' in page


def test_caching_without_pairs_says_so(tmp_path):
    rows = [r for r in _step_rows(tmp_path) if r["cell_label"] != "B cached"]
    page = render_report(_frame(rows), tmp_path).read_text(encoding="utf-8")
    assert "No cell pairs differing only in teacher.mode" in page and 'class="caching-row"' not in page


def test_top_ops_are_listed_with_escaped_trace_links(report):
    _, page = report
    blocks = re.findall(r'<details class="top-ops">(.*?)</details>', page, re.S)
    assert len(blocks) == 2
    a = next(b for b in blocks if "A live" in b)
    assert '<a href="traces/a.json">traces/a.json</a>' in a
    ops = [_cells(tr) for tr in re.findall(r"<tr>(<td.*?)</tr>", a, re.S)]
    assert ops == [["aten::convolution", "1.23", "4"], ["aten::<lambda>", "0.500", "12"]]
    assert "aten::&lt;lambda&gt;" in a
    b = next(b for b in blocks if "B cached" in b)
    (href,) = re.findall(r'<a href="([^"]*)">', b)
    assert href == "traces/%22%3E%3Cscript%3Ealert%282%29%3C/script%3E.json"
    assert "traces/&#34;&gt;&lt;script&gt;alert(2)&lt;/script&gt;.json</a>" in b
    assert EVIL not in page and "<script>" not in page


def test_trace_link_cannot_become_another_scheme(tmp_path):
    href, text = trace_link(str(tmp_path / "javascript:alert(1)"), tmp_path)
    assert (href, text) == ("javascript%3Aalert%281%29", "javascript:alert(1)")
    assert trace_link(str(tmp_path / "t r#1.json"), tmp_path / "rep")[0] == "../t%20r%231.json"


def test_quality_summary_matches_numpy():
    df = _frame(_quality_rows())
    summary = summarize_quality(df).set_index("quality_role")
    assert list(summary.index) == ["teacher", "scratch", "distilled"]
    for role, values in (("teacher", TEACHER), ("scratch", SCRATCH), ("distilled", DISTILLED)):
        s = summary.loc[role]
        acc = np.array(values["accuracy"])
        assert s["accuracy_mean"] == pytest.approx(acc.mean()) and s["accuracy_std"] == pytest.approx(acc.std(ddof=1))
        ttt = np.array([t for t in values["time_to_target_s"] if t is not None])
        assert s["reached"] == len(ttt) and s["time_to_target_mean_s"] == pytest.approx(ttt.mean())
        assert s["time_to_target_std_s"] == pytest.approx(ttt.std(ddof=1))
        assert s["n"] == 3
    agr = np.array(SCRATCH["agreement"])
    scratch = summary.loc["scratch"]
    assert scratch["agreement_mean"] == pytest.approx(agr.mean())
    assert scratch["agreement_std"] == pytest.approx(agr.std(ddof=1))
    assert pd.isna(summary.loc["teacher", "agreement_mean"]) and pd.isna(summary.loc["teacher", "student"])
    assert summary.loc["distilled", "failed"] == 1 and summary.loc["scratch", "failed"] == 0
    assert summary.loc["distilled", "method"] == "kd" and pd.isna(summary.loc["scratch", "method"])


def test_quality_section_shows_mean_std_and_reached(report):
    _, page = report
    rows = re.findall(r'<tr class="quality-row">(.*?)</tr>', page, re.S)
    table = {tuple(_cells(tr)[2:4]): _cells(tr) for tr in rows}
    header = ["teacher", "student", "role", "method", "data", "accuracy", "agreement", "ttt", "reached", "seeds"]
    scratch = dict(zip(header, table[("scratch", "—")]))
    acc = np.array(SCRATCH["accuracy"]) * 100
    assert scratch["accuracy"] == f"{acc.mean():.1f} ± {acc.std(ddof=1):.1f}" == "70.3 ± 1.5"
    assert scratch["agreement"] == "75.7 ± 2.1"
    assert scratch["ttt"] == "5.50 ± 0.707" and scratch["reached"] == "2/3 reached" and scratch["seeds"] == "3"
    distilled = dict(zip(header, table[("distilled", "kd")]))
    assert distilled["reached"] == "2/3 reached" and distilled["seeds"] == "3 (1 failed)"
    assert distilled["ttt"] == "3.50 ± 0.707" and distilled["data"] == "digits"
    teacher = dict(zip(header, table[("teacher", "—")]))
    assert teacher["reached"] == "3/3 reached" and teacher["agreement"] == "—" and teacher["student"] == "—"


def test_quality_rows_stay_out_of_timing_table(report):
    _, page = report
    measurements = page.split("<h2>Measurements</h2>")[1].split("<h2>Environment</h2>")[0]
    assert ">quality<" not in measurements
    assert len(re.findall(r'<tr class="(?:ok|not-ok)">', measurements)) == 4 + 4  # steps + inference


def test_charts_are_drawn(report):
    index, page = report
    images = sorted(re.findall(r'<img src="([^"]+)"', page))
    assert images == ["distill_step.png", "inference_latency.png", "phases.png", "quality_front.png", "speedup.png"]
    for name in images:
        data = (index.parent / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000
    assert "1 stack ends past the tick: the phase medians add up to more than the step median" in page  # D's


def test_environment_lists_new_columns(report):
    _, page = report
    env = page.split("<h2>Environment</h2>")[1]
    for text in (
        "<td>cpu_capability</td><td>AVX512</td>",
        "<td>float32_matmul_precision</td><td>highest</td>",
        "<td>tf32_matmul</td><td>False</td>",
        "<td>miopen_cache_warm</td><td>True</td>",
    ):
        assert text in env
    assert "tunableop_cache_warm" not in env  # null everywhere


def test_quality_without_latency_and_steps_without_phases_skip_charts(tmp_path):
    steps = [r for r in _step_rows(tmp_path) if r["cell_label"] == "C cached bs128"]  # no phases
    page = render_report(_frame(steps + _quality_rows()), tmp_path).read_text(encoding="utf-8")
    assert "Not drawn: no successful distill_step measurement has phase timings." in page
    assert "Not drawn: no student_inference or teacher_inference latency of the models" in page
    assert not (tmp_path / "phases.png").exists() and not (tmp_path / "quality_front.png").exists()
    assert 'class="quality-row"' in page


def test_no_quality_rows_no_quality_section(tmp_path):
    page = render_report(_frame(_step_rows(tmp_path)), tmp_path).read_text(encoding="utf-8")
    assert 'id="quality"' not in page and not (tmp_path / "quality_front.png").exists()
    assert (tmp_path / "phases.png").read_bytes().startswith(b"\x89PNG")
