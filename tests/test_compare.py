"""`kdbench compare`: verdicts with confidence intervals, on stored run folders of synthetic rows."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from io import StringIO
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from kdbench.cli import main
from kdbench.report.compare import Verdict, _median_draws, compare_frames, ratio_interval
from kdbench.store import read_results
from kdbench.store.results import open_run

CELLS = {"cell-a": "resnet56->resnet20 kd fp32 bs32", "cell-b": "resnet32x4->resnet8x4 kd bf16 bs32"}
MEASUREMENTS = (("distill_step", 32, 40.0), ("student_inference", 1, 2.0), ("teacher_inference", 1, 6.0))


def _rows(run_id: str, scale: dict | None = None, repeats: int = 1, spread: float = 0.0, seed: int = 0, **status):
    """Rows of two cells x three measurements; ``scale[(cell, measurement)]`` multiplies the samples; each
    repeat is offset by up to ``spread`` (run-to-run noise); ``status[cell]`` marks a cell failed."""
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(repeats):
        level = 1 + spread * rng.uniform(-1, 1)
        for cell, label in CELLS.items():
            for measurement, bs, median in MEASUREMENTS:
                factor = (scale or {}).get((cell, measurement), 1.0) * level
                samples = (median * factor * rng.lognormal(0, 0.02, 60)).tolist()
                row = {
                    "run_id": run_id,
                    "suite": "s",
                    "cell_id": cell,
                    "cell_label": label,
                    "repeat": r + 1 if repeats > 1 else None,
                    "measurement": measurement,
                    "batch_size": bs,
                    "status": "ok",
                    "samples_ms": samples,
                    "median_ms": float(np.median(samples)),
                    "device_name": "cpu-x",
                    "timestamp": datetime(2026, 1, 1, tzinfo=UTC),
                }
                if status.get(cell):
                    row.update(status=status[cell], error="CUDA out of memory", samples_ms=None, median_ms=None)
                rows.append(row)
    return rows


def _run(tmp: Path, run_id: str, rows: list[dict]) -> Path:
    folder = open_run(tmp, "s", "s.yaml", run_id)
    for cell in {r["cell_id"] for r in rows}:
        for rep in sorted({r["repeat"] or 1 for r in rows}):
            part = [r for r in rows if r["cell_id"] == cell and (r["repeat"] or 1) == rep]
            folder.write_part(f"{cell}-r{rep}", part)
    return folder.path


def _cli(capsys, *args) -> tuple[int, str, str]:
    code = main(["compare", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_run_compared_with_itself_exits_0(tmp_path, capsys):
    base = _run(tmp_path, "base", _rows("base"))
    code, out, _ = _cli(capsys, base, base)
    assert code == 0
    assert "6 unchanged" in out and "no significant regression" in out
    cmp = compare_frames(read_results([base]), read_results([base]))
    assert {c.verdict for c in cmp.changes} == {Verdict.UNCHANGED}
    assert all(c.ratio == 1.0 and c.ci_low <= 1 <= c.ci_high for c in cmp.changes)


def test_slower_step_samples_exit_1_and_name_the_cells(tmp_path, capsys):
    base = _run(tmp_path, "base", _rows("base"))
    slow = {(cell, "distill_step"): 1.5 for cell in CELLS}
    new = _run(tmp_path, "new", _rows("new", slow))
    code, out, err = _cli(capsys, base, new)
    assert code == 1
    regressed = out.split("REGRESSED (2), worst first:")[1].split("\n\n")[0]
    assert all(f"{label} · distill_step bs32" in regressed for label in CELLS.values())
    assert "inference" not in regressed
    assert err.count("regressed:") == 2
    cmp = compare_frames(read_results([base]), read_results([new]))
    for c in cmp.bad:
        assert c.ratio == pytest.approx(1.5, rel=0.03)
        assert 1.4 < c.ci_low < 1.5 < c.ci_high < 1.6


def test_a_change_within_the_threshold_is_not_a_regression(tmp_path, capsys):
    base = _run(tmp_path, "base", _rows("base"))
    new = _run(tmp_path, "new", _rows("new", {(c, m): 1.03 for c in CELLS for m, _, _ in MEASUREMENTS}))
    assert _cli(capsys, base, new, "--threshold", "5")[0] == 0
    cmp = compare_frames(read_results([base]), read_results([new]), threshold=0.05)
    assert all(c.ci_low > 1 for c in cmp.changes)  # significant, but smaller than the threshold
    code, out, _ = _cli(capsys, base, new, "--threshold", "1")
    assert code == 1 and "REGRESSED (6)" in out


def test_improvements_failures_and_one_sided_cells_are_listed(tmp_path, capsys):
    base_rows = _rows("base") + [{**r, "cell_id": "gone", "cell_label": "gone cell"} for r in _rows("base")[:1]]
    base = _run(tmp_path, "base", base_rows)
    new = _run(tmp_path, "new", _rows("new", {("cell-a", "student_inference"): 0.5}, **{"cell-b": "oom"}))
    code, out, _ = _cli(capsys, base, new)
    assert code == 1  # cell-b failed in NEW only
    assert "FAILED (3)" in out and "oom: CUDA out of memory" in out
    assert "IMPROVED (1)" in out and "student_inference bs1" in out.split("IMPROVED (1)")[1]
    assert "ONLY IN BASE (1)" in out and "gone cell" in out
    improved = compare_frames(read_results([new]), read_results([base]))
    assert {c.verdict for c in improved.changes if c.cell_id == "cell-b"} == {Verdict.FIXED}


def test_repeats_widen_the_interval_to_the_run_to_run_noise(tmp_path):
    """Within-process samples alone would call a 3 % shift significant; three repeats that differ by up
    to ±4 % between processes do not."""
    one_b, one_n = _rows("b", repeats=1), _rows("n", {(c, m): 1.03 for c in CELLS for m, _, _ in MEASUREMENTS})
    single = compare_frames(pd.DataFrame(one_b), pd.DataFrame(one_n), threshold=0.01)
    assert {c.verdict for c in single.changes} == {Verdict.REGRESSED}
    assert any("single repeat" in n for n in single.notes())
    three_b = _rows("b", repeats=3, spread=0.04, seed=1)
    three_n = _rows("n", {(c, m): 1.03 for c in CELLS for m, _, _ in MEASUREMENTS}, repeats=3, spread=0.04, seed=2)
    repeated = compare_frames(pd.DataFrame(three_b), pd.DataFrame(three_n), threshold=0.01)
    assert repeated.base.repeats == repeated.new.repeats == 3 and not repeated.notes()
    widths = {(c.cell_id, c.measurement): c.ci_high - c.ci_low for c in single.changes}
    for three in repeated.changes:
        assert (three.ci_high - three.ci_low) > 2 * widths[three.cell_id, three.measurement]
    assert not repeated.bad


def test_interval_with_one_repeat_agrees_with_scipys_bootstrap():
    rng = np.random.default_rng(5)
    base, new = rng.lognormal(3, 0.1, 80), rng.lognormal(3.1, 0.1, 50)
    ratio, low, high = ratio_interval([base], [new], 0.9, n_boot=20000)
    ref = stats.bootstrap(
        (base, new),
        lambda b, n, axis: np.median(n, axis=axis) / np.median(b, axis=axis),
        vectorized=True,
        method="percentile",
        confidence_level=0.9,
        n_resamples=20000,
        random_state=0,
    ).confidence_interval
    assert ratio == pytest.approx(np.median(new) / np.median(base))
    assert low == pytest.approx(ref.low, rel=0.01) and high == pytest.approx(ref.high, rel=0.01)


@pytest.mark.parametrize("n", [1, 2, 9, 40])
def test_median_draws_match_resampling(n):
    x = np.random.default_rng(n).lognormal(0, 0.3, n)
    fast = _median_draws(x, (40000,), np.random.default_rng(1))
    slow = np.median(x[np.random.default_rng(2).integers(0, n, (40000, n))], axis=1)
    assert np.quantile(fast, [0.05, 0.5, 0.95]) == pytest.approx(np.quantile(slow, [0.05, 0.5, 0.95]), rel=0.02)


def test_formats_and_out_file(tmp_path, capsys):
    base = _run(tmp_path, "base", _rows("base"))
    new = _run(tmp_path, "new", _rows("new", {("cell-a", "distill_step"): 2.0}))
    code, out, _ = _cli(capsys, base, new, "--format", "json")
    doc = json.loads(out)
    assert code == doc["exit_code"] == 1 and doc["regressions"] == 1
    assert doc["changes"][0]["verdict"] == "regressed" and doc["changes"][0]["ratio"] == pytest.approx(2, rel=0.03)
    _, out, _ = _cli(capsys, base, new, "--format", "csv")
    table = pd.read_csv(StringIO(out))
    assert len(table) == 6 and table.loc[0, "cell_id"] == "cell-a" and table.loc[0, "verdict"] == "regressed"
    target = tmp_path / "cmp" / "compare.md"
    code, out, _ = _cli(capsys, base, new, "--format", "markdown", "--out", target)
    assert code == 1 and "1 regression(s); comparison -> " in out
    text = target.read_text()
    assert (
        "| verdict | cell |" in text and "| regressed | resnet56->resnet20 kd fp32 bs32 | distill_step | 32 |" in text
    )


def test_bad_input_exits_2_with_one_line(tmp_path, capsys):
    base = _run(tmp_path, "base", _rows("base"))
    other = _run(tmp_path, "other", [{**r, "cell_id": "x" + r["cell_id"]} for r in _rows("other")])
    code, _, err = _cli(capsys, base, other)
    assert code == 2 and "no cell in common" in err and len(err.strip().splitlines()) == 1
    junk = tmp_path.parent / f"{tmp_path.name}-junk.parquet"
    junk.write_text("not parquet")
    code, _, err = _cli(capsys, base, junk)
    assert code == 2 and "not a readable parquet file" in err
    code, _, err = _cli(capsys, tmp_path, base)  # a folder of two runs
    assert code == 2 and "holds 2 runs" in err
    code, _, err = _cli(capsys, base, base, "--threshold", "-3")
    assert code == 2 and "--threshold" in err
    code, _, err = _cli(capsys, base, base, "--out", tmp_path)
    assert code == 2 and "is a folder; give a file name" in err


def test_the_report_compares_with_a_baseline_regressions_first(tmp_path):
    from kdbench import api

    base = _run(tmp_path / "res", "base", _rows("base"))
    new = _run(
        tmp_path / "res", "new", _rows("new", {("cell-b", "distill_step"): 1.5, ("cell-a", "distill_step"): 0.6})
    )
    page = api.render([new], tmp_path / "rep", baseline=base).read_text()
    section = page.split('<h2 id="compare-1">')[1].split("<h2")[0]
    assert "Comparison: new against base" in section and "1 regression</span>" in section
    verdicts = re.findall(r'<tr class="compare-row[^"]*"><td>(?:<span class="\w+">)?(\w+)', section)
    assert verdicts == ["regressed", "improved"]  # the unchanged are counted, not listed
    assert "4 unchanged" in section and "1.500" in section
    assert (tmp_path / "rep" / "compare_1.png").stat().st_size > 10_000
    assert 'src="compare_1.png"' in section
    # Without a baseline, two runs that share cells (the same suite on two machines) compare the same way.
    other = _run(tmp_path / "res", "other", [{**r, "device_name": "gpu-y"} for r in _rows("other")])
    page = api.render([tmp_path / "res" / "base", other], tmp_path / "rep2").read_text()
    assert "Comparison: other against base" in page and "different devices: cpu-x vs gpu-y" in page
    assert "compare-2" not in page


def test_intervals_are_simultaneous_over_the_measurements():
    """Each interval is at 1 - (1 - C)/m: with six measurements, 95 % for all of them together."""
    cmp = compare_frames(pd.DataFrame(_rows("b")), pd.DataFrame(_rows("n", seed=3)), confidence=0.95)
    assert cmp.rated == 6 and cmp.each == pytest.approx(1 - 0.05 / 6)
    for c in cmp.changes:
        rows_b = [r for r in _rows("b") if (r["cell_id"], r["measurement"]) == (c.cell_id, c.measurement)]
        rows_n = [r for r in _rows("n", seed=3) if (r["cell_id"], r["measurement"]) == (c.cell_id, c.measurement)]
        b, n = [np.array(r["samples_ms"]) for r in rows_b], [np.array(r["samples_ms"]) for r in rows_n]
        _, low95, high95 = ratio_interval(b, n, 0.95, n_boot=20000)
        assert c.ci_low < low95 and c.ci_high > high95  # wider than one 95 % interval
        _, low, high = ratio_interval(b, n, cmp.each, n_boot=20000)
        assert c.ci_low == pytest.approx(low, rel=0.005) and c.ci_high == pytest.approx(high, rel=0.005)
