"""Tests of the report's Language models section (kdbench.report.lm: tables and charts) on a small synthetic frame."""

from __future__ import annotations

import re
import statistics
from datetime import UTC, datetime

import pytest

from kdbench.core.schema import Row
from kdbench.report import render_report
from kdbench.report.lm.tables import (
    GIB,
    floor_points,
    has_lm,
    impl_order,
    loss_shares,
    memory_table,
    serving_rows,
    serving_table,
    step_points,
)
from kdbench.report.summaries import pooled
from tests.support.helpers import as_read
from tests.support.rows import result_row, timing

PAIR = ("llama-3.1-8b", "llama-3.2-1b")
PAIR_TEXT = "llama-3.1-8b → llama-3.2-1b"
SOURCE = "NVIDIA H200 (cuda)"
OOM_ERROR = "OutOfMemoryError: CUDA out of memory. Tried to allocate 15.66 GiB"
LIGER_WHY = "liger-kernel is not installed: pip install liger-kernel"
# (loss_impl, seq_len): step median (ms), loss phase (ms), peak (GiB), logits (GiB); None: the step ran out of memory
STEPS = {
    ("dense", 1024): (100.0, 40.0, 20.0, 4.0),
    ("chunked", 1024): (110.0, 30.0, 16.0, 0.5),
    ("dense", 4096): None,
    ("chunked", 4096): (420.0, 105.0, 24.0, 0.5),
}
DENSE_4096_LOGITS = 16.0  # GiB: computed from the shapes, also on the row that ran out of memory
# (loss_impl, seq_len): the step's footprint (GiB) where a row has one: chunked's is below its computed logits
FOOTPRINTS = {("chunked", 1024): 0.4}
DECODE_TOKENS = 64
FLOOR_BYTES = {"student_decode": 1e9, "teacher_decode": 2e9}  # bytes per generated token
COPY_GBPS = 4000.0


def _row(loss_impl: str, seq_len: int, measurement: str, median_ms: float | None, batch_size: int = 1, **extra) -> Row:
    """A row of the LM cell of ``loss_impl`` at ``seq_len`` (:data:`PAIR`, bf16); ``median_ms`` None: not timed."""
    teacher, student = PAIR
    label = f"{teacher}→{student} bf16 bs1 seq{seq_len}" + ("" if loss_impl == "dense" else f" {loss_impl}")
    row = result_row(
        schema_version=1,
        run_id="run-lm",
        suite="llm-cuda",
        cell_id=f"id-{loss_impl}-{seq_len}",
        cell_label=label,
        measurement=measurement,
        batch_size=batch_size,
        precision="bf16",
        teacher_precision="bf16",
        teacher=teacher,
        student=student,
        method="forward_kl",
        world_size=1,
        data_kind="tokens",
        seq_len=seq_len,
        loss_impl=loss_impl,
        chunk_size=None if loss_impl == "dense" else 1024,
        timestamp=datetime(2025, 3, 4, 5, 6, 7, tzinfo=UTC),
        device_name="NVIDIA H200",
        backend="cuda",
        hostname="gpu-a",
        torch_version="2.5.1",
    )
    if median_ms is not None:
        row.update(timing(median_ms, batch_size, n=20, iqr=0.02, p05=0.97, p95=1.05))
    return row | extra


def _step_row(loss_impl: str, seq_len: int) -> Row:
    figures = STEPS[(loss_impl, seq_len)]
    if figures is None:
        return _row(
            loss_impl, seq_len, "distill_step", None, status="oom", error=OOM_ERROR,
            logits_memory_bytes=DENSE_4096_LOGITS * GIB, logits_buffers="2 × B×S×V bf16",
        )  # fmt: skip
    median, loss, peak, logits = figures
    footprint = FOOTPRINTS.get((loss_impl, seq_len))
    return _row(
        loss_impl, seq_len, "distill_step", median, tokens=seq_len, tokens_per_s=seq_len / median * 1e3,
        phase_loss_ms=loss, peak_memory_bytes=int(peak * GIB), logits_memory_bytes=logits * GIB,
        logits_buffers="B×S×V bf16", memory_kind="device",
        memory_footprint_bytes=None if footprint is None else int(footprint * GIB),
    )  # fmt: skip


def _student_decode_ms(loss_impl: str, batch_size: int) -> float:
    return (300.0 + 10 * batch_size) * (1.1 if loss_impl == "chunked" else 1.0)  # the two cells differ a little


def _serving(loss_impl: str, seq_len: int) -> list[Row]:
    """Per batch size 1 and 8: student prefill 5 ms × bs, teacher 20 ms × bs (4× the student); decode 64 tokens,
    the teacher 3× as slow, except that at seq_len 4096 and batch 8 the teacher's decode ran out of memory."""
    rows = []
    for bs in (1, 8):
        decode = _student_decode_ms(loss_impl, bs)
        for measurement, ms, tokens in (
            ("student_prefill", 5.0 * bs, bs * seq_len),
            ("teacher_prefill", 20.0 * bs, bs * seq_len),
            ("student_decode", decode, bs * DECODE_TOKENS),
            ("teacher_decode", 3 * decode, bs * DECODE_TOKENS),
        ):
            decoding = measurement.endswith("decode")
            extra = {"decode_tokens": DECODE_TOKENS} if decoding else {}
            if decoding:  # the bytes each token must read, the probe's copy bandwidth: the share of the floor
                extra.update(decode_bytes_per_token=FLOOR_BYTES[measurement], ceiling_gbps=COPY_GBPS)
            if (measurement, seq_len, bs) == ("teacher_decode", 4096, 8):
                rows.append(_row(loss_impl, seq_len, measurement, None, bs, status="oom", error=OOM_ERROR, **extra))
                continue
            rows.append(_row(loss_impl, seq_len, measurement, ms, bs, tokens=tokens, tokens_per_s=tokens / ms * 1e3,
                             **extra))  # fmt: skip
    return rows


def _lm_rows() -> list[Row]:
    rows = [_step_row(impl, seq) for impl, seq in STEPS]
    rows.append(_row("liger", 1024, "distill_step", None, status="skipped", error=LIGER_WHY))
    for impl, seq in STEPS:
        rows += _serving(impl, seq)
    return rows


def _image_rows() -> list[Row]:
    """An image cell: a distill step and student/teacher inference at batch 4 (no LM columns)."""
    base = _row("dense", 0, "distill_step", 40.0, batch_size=4)
    base.update(data_kind="synthetic", data_shape="3x32x32", seq_len=None, loss_impl=None, chunk_size=None,
                cell_id="id-image", cell_label="resnet50→resnet18 bf16", teacher="resnet50", student="resnet18",
                method="kd", run_id="run-img")  # fmt: skip
    student = base | {"measurement": "student_inference", "median_ms": 1.0, "throughput": 4000.0}
    teacher = base | {"measurement": "teacher_inference", "median_ms": 3.0, "throughput": 1333.0}
    return [base, student, teacher]


@pytest.fixture(scope="module")
def frame():
    return as_read(_lm_rows() + _image_rows())


@pytest.fixture(scope="module")
def page(tmp_path_factory, frame):
    out = tmp_path_factory.mktemp("lm-report")
    index = render_report(frame, out)
    return index, index.read_text(encoding="utf-8")


def _section(page: str) -> str:
    return page.split('<h2 id="lm">Language models</h2>')[1].split('<h2 id="profile">')[0]


def _rows_of(html: str, cls: str, *needles: str) -> list[str]:
    return [tr for tr in re.findall(rf'<tr class="{cls}[^"]*">.*?</tr>', html, re.S) if all(n in tr for n in needles)]


def _cell(tr: str, cls: str) -> str:
    return re.search(rf'class="num {cls}">([^<]*)<', tr).group(1)


# --- the data functions ----------------------------------------------------------------


def test_step_points_pool_ok_cells_and_keep_the_oom_and_skipped_ones(frame):
    points = step_points(frame)
    lm = points[points["pair"].eq(PAIR_TEXT)]
    assert len(points) == len(lm) == 5  # the image cell is no LM row
    got = {(r.impl, r.seq_len): r.status for r in lm.itertuples()}
    assert got == {
        ("dense", 1024): "ok", ("chunked", 1024): "ok", ("liger", 1024): "skipped",
        ("dense", 4096): "oom", ("chunked", 4096): "ok",
    }  # fmt: skip
    assert set(points["setting"]) == {"bf16"} and set(points["source"]) == {SOURCE}
    assert list(points["seq_len"]) == [1024, 1024, 1024, 4096, 4096]
    assert list(points["impl"]) == ["dense", "chunked", "liger", "dense", "chunked"]  # LOSS_IMPLS order


def test_loss_shares_are_the_loss_phase_over_the_step(frame):
    shares = loss_shares(step_points(frame))
    got = {(r.impl, r.seq_len): r.loss_share for r in shares.itertuples()}
    assert got == pytest.approx({("dense", 1024): 0.4, ("chunked", 1024): 30 / 110, ("chunked", 4096): 0.25})


def test_memory_table_has_peak_and_logits_per_seq_len_and_the_oom(frame):
    table = memory_table(step_points(frame)).set_index(["impl", "seq_len"])
    assert sorted(table.index) == [("chunked", 1024), ("chunked", 4096), ("dense", 1024), ("dense", 4096)]
    assert table.loc[("dense", 1024), "peak_gib"] == pytest.approx(20.0)
    assert table.loc[("dense", 1024), "logits_gib"] == pytest.approx(4.0)
    assert table.loc[("dense", 1024), "logits_share"] == pytest.approx(0.2)
    assert table.loc[("chunked", 4096), "peak_gib"] == pytest.approx(24.0)
    oom = table.loc[("dense", 4096)]
    assert oom["status"] == "oom" and oom["peak_gib"] != oom["peak_gib"]  # no peak: NaN
    assert oom["logits_gib"] == pytest.approx(DENSE_4096_LOGITS)


def test_serving_table_takes_the_median_over_cells_and_keeps_the_speed_up(frame):
    table = serving_table(frame).set_index(["seq_len", "batch_size"])
    assert list(table.index) == [(1024, 1), (1024, 8), (4096, 1), (4096, 8)]
    assert (table["cells"] == 2).all() and (table["decode_tokens"] == DECODE_TOKENS).all()
    row = table.loc[(1024, 8)]
    rates = [8 * DECODE_TOKENS / _student_decode_ms(impl, 8) * 1e3 for impl in ("dense", "chunked")]
    assert row["student_decode_tokens_per_s"] == pytest.approx(statistics.median(rates))
    assert row["student_prefill_median_ms"] == pytest.approx(40.0)
    assert row["teacher_prefill_median_ms"] == pytest.approx(160.0)
    assert row["student_prefill_speedup"] == pytest.approx(4.0)
    assert row["student_decode_speedup"] == pytest.approx(3.0)
    oom = table.loc[(4096, 8)]
    assert oom["teacher_decode_status"] == "oom" and oom["student_decode_status"] == "ok"
    assert oom["student_decode_speedup"] != oom["student_decode_speedup"]  # NaN: no teacher to compare with
    (formatted,) = [r for r in serving_rows(serving_table(frame)) if r["seq_len"] == "4,096" and r["batch_size"] == "8"]
    assert formatted["teacher_decode"] == "OOM" and formatted["decode_speedup"] == "—" and formatted["decode_bad"]


def test_floor_points_are_each_decodes_share_of_the_copy_bandwidth_pooled_over_cells(frame):
    points = floor_points(frame).set_index(["seq_len", "batch_size", "what"])
    # every decode that ran, of both models (the teacher's OOM at 4096 x 8 has no point)
    assert len(points) == 4 * 2 - 1 and (4096, 8, "teacher decode") not in points.index
    for bs in (1, 8):
        shares = [
            FLOOR_BYTES["student_decode"]
            * (bs * DECODE_TOKENS / _student_decode_ms(impl, bs) * 1e3)
            / (COPY_GBPS * 1e9)
            for impl in ("dense", "chunked")
        ]
        assert points.loc[(1024, bs, "student decode"), "bandwidth_share"] == pytest.approx(statistics.median(shares))
    teacher = points.loc[(1024, 1, "teacher decode")]
    assert teacher["decode_bytes_per_token"] == pytest.approx(FLOOR_BYTES["teacher_decode"])
    assert floor_points(frame.assign(ceiling_gbps=None, bandwidth_share=None)).empty  # no probe: nothing to draw


def test_impl_order_follows_the_known_implementations_first():
    assert impl_order(["zeta", "liger", "dense", "torch_linear", "chunked"]) == [
        "dense", "chunked", "liger", "torch_linear", "zeta",
    ]  # fmt: skip


# --- the rendered section --------------------------------------------------------------


def test_section_has_its_three_charts_and_the_decode_floor_as_pngs(page):
    index, html = page
    section = _section(html)
    images = re.findall(r'<img src="([^"]+)"', section)
    assert images == ["lm_tokens_per_s.png", "lm_memory.png", "lm_loss_share.png", "lm_decode_floor.png"]
    for name in images:
        assert (index.parent / name).read_bytes().startswith(b"\x89PNG")
    assert 'class="skipped"' not in section


def test_step_table_shows_tokens_per_s_the_oom_and_why_liger_was_skipped(page):
    section = _section(page[1])
    (dense,) = _rows_of(section, "lm-step-row", ">dense<", ">1,024<")
    assert _cell(dense, "tokens") == "10,240" and _cell(dense, "share") == "40.0 %"
    assert ">20,480.0 MiB<" in dense and ">4,096.0 MiB<" in dense  # bytes as every report table writes them
    (oom,) = _rows_of(section, "lm-step-row", ">dense<", ">4,096<")
    assert "not-ok" in oom and '<span class="flag">OOM</span>' in oom and "CUDA out of memory" in oom
    assert ">16,384.0 MiB<" in oom  # its logits, computed from the shapes
    (liger,) = _rows_of(section, "lm-step-row", ">liger<")
    assert ">skipped<" in liger and LIGER_WHY in liger


def test_serving_table_shows_decode_rate_speed_ups_and_the_oom(page):
    section = _section(page[1])
    rows = _rows_of(section, "lm-serving-row", PAIR_TEXT)
    assert len(rows) == 4
    (row,) = _rows_of(section, "lm-serving-row", ">1,024<", '<td class="num">8</td>')
    rates = [8 * DECODE_TOKENS / _student_decode_ms(impl, 8) * 1e3 for impl in ("dense", "chunked")]
    assert _cell(row, "student-decode") == f"{statistics.median(rates):,.0f}" == "1,286"
    assert _cell(row, "student-prefill") == "40.0" and _cell(row, "teacher-prefill") == "160"
    assert _cell(row, "prefill-speedup") == "4.00×" and _cell(row, "decode-speedup") == "3.00×"
    (oom,) = _rows_of(section, "lm-serving-row", ">4,096<", '<td class="num">8</td>')
    assert "not-ok" in oom and _cell(oom, "teacher-decode") == "OOM" and _cell(oom, "decode-speedup") == "—"
    # the share of the bandwidth floor: 1 GB a token at the median 1,286 tokens/s over 4,000 GB/s; the teacher
    # reads 2 GB a token at a third of the rate
    share = statistics.median(rates) * 1e9 / 4000e9
    assert _cell(row, "student-decode-floor") == f"{share * 100:.1f} %" == "32.2 %"
    assert _cell(row, "teacher-decode-floor") == f"{share * 2 / 3 * 100:.1f} %"
    assert _cell(oom, "teacher-decode-floor") == "OOM"


def test_the_image_cell_keeps_its_charts_beside_the_lm_section(page):
    _, html = page
    charts = html.split("<h2>Charts</h2>")[1].split('<h2 id="lm">')[0]
    assert re.findall(r'<img src="([^"]+)"', charts) == ["distill_step.png", "inference_latency.png", "speedup.png"]


def test_a_frame_without_lm_rows_has_no_lm_section(tmp_path):
    df = as_read(_image_rows())
    assert not has_lm(df)
    html = render_report(df, tmp_path).read_text(encoding="utf-8")
    assert "Language models" not in html and 'id="lm"' not in html
    assert not list(tmp_path.glob("lm_*.png"))


def test_lm_cells_that_all_ran_out_of_memory_skip_their_bar_charts_with_the_reason(tmp_path):
    oom = {"status": "oom", "error": OOM_ERROR, "median_ms": None, "tokens_per_s": None, "peak_memory_bytes": None}
    rows = [r | oom for r in _lm_rows()]
    section = _section(render_report(as_read(rows), tmp_path).read_text(encoding="utf-8"))
    assert re.findall(r'class="skipped">([^<]*)<', section) == [
        "Not drawn: no successful LM distill_step measurement.",
        "Not drawn: no successful LM distill_step measurement has a loss phase timing.",
    ]
    assert re.findall(r'<img src="([^"]+)"', section) == ["lm_memory.png"]  # the OOMs, at their sequence lengths
    assert len(_rows_of(section, "lm-step-row not-ok", '<span class="flag">OOM</span>')) == 5
    assert all(_cell(tr, "student-decode") == "OOM" for tr in _rows_of(section, "lm-serving-row"))


def test_an_lm_run_says_where_its_serving_is_instead_of_an_empty_inference_chart(tmp_path):
    from kdbench.report.plots import draw_charts

    charts = {c.title: c for c in draw_charts(as_read(_lm_rows()), tmp_path)}
    for title in ("Inference latency", "Student speed-up over teacher"):
        assert charts[title].file is None and charts[title].caption.startswith("Not drawn: ")
        assert charts[title].caption.endswith("are in the Language models section.")
    mixed = {c.title: c for c in draw_charts(as_read(_lm_rows() + _image_rows()), tmp_path)}
    assert mixed["Inference latency"].file and "Language models section" not in mixed["Inference latency"].caption


def test_bar_labels_of_a_mixed_run_leave_out_what_a_family_does_not_have(frame):
    from kdbench.report.charts import add_variant, with_keys

    steps = with_keys(pooled(frame))
    variants = set(add_variant(steps[steps.measurement == "distill_step"])["variant"])
    assert "bf16, kd, 3x32x32" in variants and "bf16, forward_kl, dense, seq1024" in variants
    assert not any("?" in v for v in variants)  # no image shape on LM bars, no seq_len or loss_impl on image ones


def test_every_chart_and_table_reads_lm_cells_in_tokens_per_s(frame, page, tmp_path):
    from kdbench.report.charts import rates
    from kdbench.report.plots import draw_charts

    steps = rates(pooled(frame))
    steps = steps[steps["measurement"].eq("distill_step")].set_index("cell_id")
    assert steps.loc["id-dense-1024", "rate_column"] == "tokens_per_s"
    assert steps.loc["id-dense-1024", "rate"] == pytest.approx(1024 / 100.0 * 1e3)  # not its 10 samples/s
    assert steps.loc["id-image", "rate_column"] == "throughput" and steps.loc["id-image", "rate"] == pytest.approx(100)
    (step_chart, *_) = draw_charts(frame, tmp_path)
    assert step_chart.file and "cells are drawn in tokens/s, in a panel of their own" in step_chart.caption
    (lm_only, *_) = draw_charts(as_read(_lm_rows()), tmp_path)
    assert lm_only.caption.endswith("Token workloads' cells (language models) in tokens/s.")
    measurements = page[1].split("<h2>Measurements</h2>")[1]
    rows = re.findall(r'<tr class="ok">.*?</tr>', measurements, re.S)
    (dense,) = [tr for tr in rows if "seq1024<" in tr and ">distill_step<" in tr]  # the dense cell's label
    assert ">10,240 tokens/s<" in dense


def test_adds_up_judges_the_phases_shown_against_the_median_shown():
    from kdbench.report.step_tables import profile_rows

    # each iteration's phases added up to its step (a 0.4 ms median gap), but their medians sum to 4.5 s of 5.78 s
    phases = {"phase_teacher_forward_ms": 1000.0, "phase_student_forward_ms": 500.0, "phase_loss_ms": 1500.0,
              "phase_backward_ms": 1400.0, "phase_optimizer_ms": 100.0, "phase_remainder_ms": 0.4}  # fmt: skip
    (row,) = profile_rows(as_read([_row("dense", 256, "distill_step", 5780.0, **phases)]))
    assert row["remainder"] == "1280 ms (22.1 %)" and row["remainder_bad"] is True
    assert any("phases varied between iterations" in w for w in row["warnings"])
    (fine,) = profile_rows(as_read([_row("dense", 256, "distill_step", 4500.4, **phases)]))
    assert fine["remainder"] == "0.400 ms (0.0 %)" and fine["remainder_bad"] is False and not fine["warnings"]


CPU = {"device_name": "Intel Xeon", "backend": "cpu"}


def test_logits_above_the_footprint_are_compared_with_the_peak_and_say_why(page):
    from kdbench.report.lm.tables import step_rows

    # llm-cpu's dense seq 1,024: 2.99 GiB of logits against a 2.78 GiB footprint (the resident memory's rise) and a
    # 3.9 GiB peak: the step reused memory the process held as it began
    memory = {"memory_kind": "rss_hwm", "peak_memory_bytes": int(3.9 * GIB), "memory_footprint_bytes": int(2.78 * GIB)}
    cpu = _step_row("dense", 1024) | memory | {"logits_memory_bytes": 2.99 * GIB, **CPU}
    fits = _step_row("chunked", 1024) | memory | {"logits_memory_bytes": 0.5 * GIB, **CPU}
    points = step_points(as_read([cpu, fits])).set_index("impl")
    assert points.loc["dense", "logits_share"] == pytest.approx(2.99 / 3.9, rel=1e-3)  # of the peak: below 100 %
    assert "reused memory the process already held" in points.loc["dense", "memory_note"]
    assert points.loc["chunked", "memory_note"] == ""
    assert memory_table(points.reset_index()).set_index("impl").loc["dense", "footprint_gib"] == pytest.approx(2.78)
    dense = step_rows(points.reset_index())[0]
    assert (dense["peak"], dense["footprint"], dense["logits_share"]) == ("3,993.6 MiB", "2,846.7 MiB", "76.7 %")
    # the live tensor peak tells the causes apart: the logits within it (reused memory), or above it (an overcount)
    held = step_points(as_read([cpu | {"live_peak_bytes": int(3.2 * GIB)}])).loc[0, "memory_note"]
    assert "its live tensors peaked at 3.2 GiB, the logits within them" in held
    over = step_points(as_read([cpu | {"live_peak_bytes": int(2.5 * GIB)}])).loc[0, "memory_note"]
    assert over == "the computed logits exceed the footprint and the live tensors' peak: " + OVERCOUNT
    above_peak = step_points(as_read([cpu | {"peak_memory_bytes": int(2.9 * GIB)}])).loc[0, "memory_note"]
    assert above_peak == "the computed logits exceed the measured peak: " + OVERCOUNT
    # on the page (a GPU row: the allocator's counters are exact), flagged and said
    section = _section(page[1])
    (chunked,) = _rows_of(section, "lm-step-row", ">chunked<", ">1,024<")
    assert ">409.6 MiB<" in chunked and re.search(r'>512.0 MiB\s*<span class="flag">⚠</span>', chunked)
    note = (
        "the computed logits exceed the footprint (the allocator's peak minus what was allocated as the step began): "
        "buffers allocated before the step (a cached teacher's outputs) are not in it, or " + OVERCOUNT
    )
    assert f'<span class="flag memory-note">⚠ {note}</span>' in chunked.replace("&#39;", "'")
    assert "memory-note" not in "".join(_rows_of(section, "lm-step-row", ">dense<"))
    assert "In 1 cell the logits exceed the footprint (the table below says why)." in section


OVERCOUNT = "the estimate from the shapes counts more buffers than were alive at once"


def test_the_profile_table_shows_a_loss_impls_extra_flops_apart_from_the_models():
    from kdbench.report.step_tables import profile_rows

    rows = [_step_row("chunked", 1024) | {"flops": 1.0e11, "extra_flops": 0.0},
            _step_row("dense", 1024) | {"flops": 1.0e11, "extra_flops": 2.5e10}]  # fmt: skip
    got = {r["cell_label"].split()[-1]: r["gflops"] for r in profile_rows(as_read(rows))}
    assert got == {"chunked": "100", "seq1024": "100 + 25.0 extra"}
