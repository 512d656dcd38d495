"""The report agrees with the rows it comes from (issue 45): every speed-up it prints is the quotient of the two
latencies shown beside it, two cells of one pair with other model overrides are two rows and two bars, the headline
counts contended and noisy rows apart, every chart marks them (a speed-up from a batch slower than a larger one
too), legends sit beside the axes and long tick labels are written vertically, and progress lines write
milliseconds with thousands separators."""

from __future__ import annotations

import html as html_lib
import json
import re
from datetime import UTC, datetime

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text

from kdbench.core.schema import Row
from kdbench.report import render_report
from kdbench.report.charts import CONTENDED_HATCH, CONTENDED_NOTE, NOISY_HATCH, rotate_labels
from kdbench.report.lm.tables import serving_rows, serving_table
from kdbench.run.progress import summary_line
from tests.support.helpers import as_read
from tests.support.rows import result_row, timing

SOURCE = dict(device_name="AMD EPYC", backend="cpu", hostname="host", torch_version="2.5.1")
STAMP = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
# Three cells of one LM pair that differ only in their loss: (student, teacher) prefill ms at batch 1. The median
# of each side is 720 and 641 ms; the median of the three cells' own speed-ups (2.64, 2.14, 0.56) is 2.14: the
# report used to print that beside 720 and 641.
PREFILL = {"dense": (720.0, 1900.0), "chunked": (300.0, 641.0), "fused_linear": (900.0, 500.0)}


def _config(student_layers: int = 1) -> str:
    return json.dumps({"overrides": {"student": {"n_layer": student_layers, "vocab_size": 512}}}, sort_keys=True)


def _lm_row(cell: str, measurement: str, batch_size: int, median_ms: float, **extra) -> Row:
    row = result_row(
        schema_version=1, run_id="run-lm", suite="lm", cell_id=f"id-{cell}", cell_label=f"gpt2->gpt2 {cell}",
        measurement=measurement, batch_size=batch_size, precision="fp32", teacher="gpt2", student="gpt2",
        method="forward_kl", world_size=1, data_kind="tokens", seq_len=32, loss_impl=extra.pop("loss_impl", cell),
        timestamp=STAMP, config_json=extra.pop("config_json", _config()), **SOURCE,
    )  # fmt: skip
    tokens = batch_size * (32 if measurement.endswith("prefill") else 4)
    row.update(timing(median_ms, batch_size, n=20, iqr=0.02, p05=0.97, p95=1.05))
    row.update(tokens=tokens, tokens_per_s=tokens / median_ms * 1e3)
    if measurement.endswith("decode"):
        row["decode_tokens"] = 4
    return row | extra


def _serving(cell: str, prefill: tuple[float, float], **extra) -> list[Row]:
    student, teacher = prefill
    return [
        _lm_row(cell, "student_prefill", 1, student, **extra),
        _lm_row(cell, "teacher_prefill", 1, teacher, **extra),
        _lm_row(cell, "student_decode", 1, student / 10, **extra),
        _lm_row(cell, "teacher_decode", 1, teacher / 7, **extra),
    ]


def _num(text: str) -> float:
    return float(text.replace(",", "").rstrip("×"))


def _cell(tr: str, cls: str) -> str:
    return re.search(rf'class="num {cls}">([^<]*)<', tr).group(1)


def _agrees(speedup: str, over: str, under: str) -> None:
    """``speedup`` (2 decimals) is ``over`` / ``under`` (3 significant digits each) within their rounding."""
    ratio, shown = _num(over) / _num(under), _num(speedup)
    assert abs(shown - ratio) <= 0.005 + ratio * 0.011, (speedup, over, under)


def _cells() -> list[Row]:
    """The three cells of :data:`PREFILL`: each a distill step and its serving rows."""
    steps = [_lm_row(cell, "distill_step", 2, 20.0, phase_loss_ms=5.0) for cell in PREFILL]
    return steps + [r for cell, prefill in PREFILL.items() for r in _serving(cell, prefill)]


@pytest.fixture(scope="module")
def lm_page(tmp_path_factory):
    rows = _cells()
    out = tmp_path_factory.mktemp("agrees")
    return render_report(as_read(rows), out).read_text(encoding="utf-8")


def test_each_serving_speed_up_is_the_quotient_of_the_two_figures_beside_it(lm_page):
    table = serving_table(as_read(_cells()))
    (row,) = table.to_dict("records")
    assert row["cells"] == 3
    assert row["student_prefill_median_ms"] == pytest.approx(720.0)
    assert row["teacher_prefill_median_ms"] == pytest.approx(641.0)
    # the teacher's time over the student's, as shown: 0.89, not the median of the cells' own speed-ups (2.14)
    assert row["student_prefill_speedup"] == pytest.approx(641.0 / 720.0)
    section = lm_page.split('<h2 id="lm">')[1]
    trs = re.findall(r'<tr class="lm-serving-row[^"]*">.*?</tr>', section, re.S)
    assert trs
    for tr in trs:
        _agrees(_cell(tr, "prefill-speedup"), _cell(tr, "teacher-prefill"), _cell(tr, "student-prefill"))
        _agrees(_cell(tr, "decode-speedup"), _cell(tr, "student-decode"), _cell(tr, "teacher-decode"))
    assert _cell(trs[0], "prefill-speedup") == "0.89×"


def test_each_measurement_rows_speed_up_is_its_teachers_median_over_its_own(lm_page):
    """The measurements table: a student row's speed-up is the same cell's teacher row's median over its own."""
    medians, speedups = {}, []
    for tr in re.findall(r'<tr class="(?:ok|not-ok)">.*?</tr>', lm_page, re.S):
        cells = [html_lib.unescape(c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)]
        label, measurement, batch = cells[1], cells[2], cells[4]
        medians[(label, measurement, batch)] = _cell(tr, "median")
        if _cell(tr, "row-speedup") != "—":
            speedups.append((label, measurement, batch, _cell(tr, "row-speedup")))
    assert len(speedups) == 2 * len(PREFILL)  # prefill and decode of each cell
    for label, measurement, batch, speedup in speedups:
        teacher = medians[(label, measurement.replace("student", "teacher"), batch)]
        _agrees(speedup, teacher, medians[(label, measurement, batch)])


def test_two_cells_of_one_pair_with_other_overrides_are_two_rows_named_by_them(tmp_path):
    rows = _serving("one", (10.0, 40.0), config_json=_config(1), loss_impl="dense")
    rows += _serving("two", (30.0, 40.0), config_json=_config(2), loss_impl="dense")
    table = serving_table(as_read(rows))
    assert list(table["pair"]) == ["gpt2 → gpt2 (n_layer=1)", "gpt2 → gpt2 (n_layer=2)"]
    assert list(table["cells"]) == [1, 1]  # not one row at the median of two other students
    assert [r["prefill_speedup"] for r in serving_rows(table)] == ["4.00×", "1.33×"]
    page = render_report(as_read(rows), tmp_path).read_text(encoding="utf-8")
    assert "gpt2 → gpt2 (n_layer=1)" in page and "gpt2 → gpt2 (n_layer=2)" in page
    # two runs, one per override, each labelled `gpt2->gpt2 ...` by its own plan: told apart by their configs
    same_label = [r | {"cell_label": "gpt2->gpt2 forward_kl fp32 bs1 seq32", "run_id": r["cell_id"]} for r in rows]
    page = render_report(as_read(same_label), tmp_path / "runs").read_text(encoding="utf-8")
    labels = {html_lib.unescape(m) for m in re.findall(r"<td>(gpt2-&gt;gpt2 forward_kl[^<]*)</td>", page)}
    assert labels == {f"gpt2->gpt2 forward_kl fp32 bs1 seq32 overrides.student.n_layer={n}" for n in (1, 2)}
    # one model name with one set of overrides everywhere is named as it is
    same = serving_table(as_read(_serving("one", (10.0, 40.0)) + _serving("two", (30.0, 40.0))))
    assert list(same["pair"]) == ["gpt2 → gpt2"] and list(same["cells"]) == [2]


# --- the headline, and the charts' marks ---------------------------------------------------------


def _image_rows(contended: bool = False) -> list[Row]:
    """A distill step and student/teacher inference at batch 1 and 32 of one image cell; the teacher's batch 1
    (300 ms) is slower than its batch 32 (200 ms): noise, which made a 150× speed-up at batch 1."""

    def row(measurement: str, batch_size: int, median_ms: float) -> Row:
        r = result_row(
            schema_version=1, run_id="run-img", suite="img", cell_id="id-img", cell_label="resnet50->resnet18 fp32",
            measurement=measurement, batch_size=batch_size, precision="fp32", teacher="resnet50",
            student="resnet18", method="kd", world_size=1, timestamp=STAMP, **SOURCE,
        )  # fmt: skip
        r.update(timing(median_ms, batch_size, n=20, iqr=0.02, p05=0.97, p95=1.05))
        return r | {"contended": contended, "host_busy_share": 0.8 if contended else 0.0}

    step = row("distill_step", 32, 50.0) | {"phase_loss_ms": 10.0, "phase_backward_ms": 30.0}
    return [
        step,
        row("student_inference", 1, 2.0),
        row("teacher_inference", 1, 300.0),
        row("student_inference", 32, 20.0),
        row("teacher_inference", 32, 200.0),
    ]


@pytest.fixture
def drawn(monkeypatch):
    """Every figure the report saves, by file name."""
    figures: dict[str, Figure] = {}
    save = Figure.savefig

    def keep(fig, fname, *args, **kwargs):
        figures[str(fname).rsplit("/", 1)[-1]] = fig
        return save(fig, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures


def _hatches(fig: Figure) -> list[str]:
    return [p.get_hatch() or "" for ax in fig.get_axes() for p in ax.patches]


def _legend_texts(fig: Figure) -> list[str]:
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.get_axes() if ax.get_legend())]
    return [t.get_text() for legend in legends for t in legend.get_texts()]


def test_the_headline_counts_contended_rows_apart_in_the_warning_colour(tmp_path):
    page = render_report(as_read(_image_rows(contended=True)), tmp_path).read_text(encoding="utf-8")
    counts = page.split('<p class="counts">')[1].split("</p>")[0]
    assert "ok: 5 (5 contended)" in counts and "status-flagged" in counts
    quiet = render_report(as_read(_image_rows()), tmp_path / "quiet").read_text(encoding="utf-8")
    counts = quiet.split('<p class="counts">')[1].split("</p>")[0]
    assert '<span class="status status-ok">ok: 5</span>' in counts and "status-flagged" not in counts


def test_every_chart_marks_contended_rows_and_says_so_in_its_legend(tmp_path, drawn):
    render_report(as_read(_image_rows(contended=True)), tmp_path)
    assert {"distill_step.png", "speedup.png", "inference_latency.png", "phases.png"} <= set(drawn)
    for name in ("distill_step.png", "speedup.png"):  # bars: hatched
        assert any(CONTENDED_HATCH in h for h in _hatches(drawn[name])), name
        assert any("contended" in t for t in _legend_texts(drawn[name])), name
    for name in ("inference_latency.png", "phases.png"):  # points: ringed
        assert CONTENDED_NOTE in _legend_texts(drawn[name]), name


def test_a_speed_up_from_a_batch_slower_than_a_larger_one_is_marked_noisy(tmp_path, drawn):
    page = render_report(as_read(_image_rows()), tmp_path).read_text(encoding="utf-8")
    (ax,) = drawn["speedup.png"].get_axes()
    bars = sorted(ax.patches, key=lambda p: -p.get_height())
    # the 150x at batch 1 (the teacher slower there than at batch 32) leads the chart, hatched noisy; 10x is not
    assert bars[0].get_height() == pytest.approx(150.0) and NOISY_HATCH in bars[0].get_hatch()
    assert bars[1].get_height() == pytest.approx(10.0) and not bars[1].get_hatch()
    texts = sorted(t.get_text() for t in ax.texts)
    assert texts == ["10.0×", "150.0× noisy"]  # said on the bar too
    assert "1 of them slower at a smaller batch than at a larger one" in page


def test_legends_sit_beside_the_axes_and_long_tick_labels_do_not_overlap(tmp_path, drawn):
    """Four students of one name (other overrides) at two sequence lengths: four long labels in each of two
    panels, which side by side overlapped (only more than four groups were written vertically)."""
    steps = []
    for layers in (1, 2, 3, 4):
        for seq_len in (32, 64):
            step = _lm_row(f"{layers}-{seq_len}", "distill_step", 2, 20.0 + layers, loss_impl="dense",
                           config_json=_config(layers), phase_loss_ms=5.0)  # fmt: skip
            steps.append(step | {"seq_len": seq_len, "tokens_per_s": 2 * seq_len / (20.0 + layers) * 1e3})
    render_report(as_read(steps), tmp_path)
    for name in ("lm_tokens_per_s.png", "lm_loss_share.png", "distill_step.png"):
        fig = drawn[name]
        canvas = FigureCanvasAgg(fig)
        canvas.draw()  # the layout, as saved
        renderer = canvas.get_renderer()
        titles = [t.get_window_extent(renderer) for t in fig.findobj(Text) if t.get_text() == "AMD EPYC (cpu)"]
        for ax in fig.get_axes():  # each axis title whole, clear of the panel's title
            label = ax.yaxis.label.get_window_extent(renderer)
            if ax.yaxis.label.get_text():
                assert fig.bbox.contains(label.x0, label.y0) and fig.bbox.contains(label.x1, label.y1), name
                assert titles and not any(label.overlaps(t) for t in titles), name
        if name == "distill_step.png":
            continue
        (legend,) = fig.legends
        box = legend.get_window_extent(renderer)
        for ax in fig.get_axes():
            assert not box.overlaps(ax.get_window_extent(renderer)), name  # the legend covers no bar
            labels = [t for t in ax.get_xticklabels() if t.get_text()]
            boxes = [t.get_window_extent(renderer) for t in labels]
            assert len(labels) >= 4 and all(t.get_rotation() == 90 for t in labels), name
            assert not any(a.overlaps(b) for k, a in enumerate(boxes) for b in boxes[k + 1 :]), name
            assert all(fig.bbox.contains(b.x0, b.y0) for b in boxes), name  # not cut at the figure's edge


def test_tick_labels_are_rotated_only_where_they_would_overlap():
    assert not rotate_labels(["a → b", "c → d"], width_in=6.0)
    assert rotate_labels(["gpt2 → gpt2 (n_layer=1)\n(fp32, a long setting)", "gpt2 → gpt2 (n_layer=2)"], 3.0)
    assert rotate_labels([f"g{i}" for i in range(5)], width_in=20.0)  # more than 4 groups: always


def test_progress_lines_write_milliseconds_with_thousands_separators():
    row = result_row(measurement="distill_step", median_ms=6390.2, rel_iqr=0.02, noisy=False, tokens_per_s=12345.6)
    line = summary_line([row])
    assert "step 6,390 ms" in line and "12,346 tokens/s" in line and "e+" not in line
    fast = summary_line([row | {"median_ms": 0.012345}])
    assert "step 0.0123 ms" in fast


def test_the_forest_plots_legend_sits_beside_its_intervals_and_the_summary_counts_improvements(tmp_path, drawn):
    from kdbench import api
    from tests.unit.report.test_compare import _rows, _run

    base = _run(tmp_path / "res", "base", _rows("base", repeats=3, spread=0.01))
    scale = {("cell-b", "distill_step"): 1.5, ("cell-a", "distill_step"): 0.6}
    new = _run(tmp_path / "res", "new", _rows("new", scale, repeats=3, seed=1))
    page = api.render([new], tmp_path / "rep", baseline=base).read_text()
    summary = page.split('<h2 id="compare-1">')[1].split('<p class="note">')[0]
    assert "1 regression</span>" in summary and "1 improved</span>" in summary and "4 unchanged</span>" in summary
    fig = drawn["compare_1.png"]
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    (ax,) = fig.get_axes()
    assert ax.get_legend() is None and len(fig.legends) == 1  # a figure legend, outside the axes
    assert not fig.legends[0].get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
