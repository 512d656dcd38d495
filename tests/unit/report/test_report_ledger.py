"""The accuracy ledger in the report (kdbench.report.ledger: the table per loss_impl × precision and objective) and
in compare (a faster cell beyond --max-loss-err is named in a note; a gate only with --gate-loss-err)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from kdbench.cli import main
from kdbench.core.limits import MAX_LOSS_ERR
from kdbench.report import render_report
from kdbench.report.compare.compare import compare_frames
from kdbench.report.compare.verdicts import Policy
from kdbench.report.format import MISSING
from kdbench.report.ledger import ledger_rows, ledger_table
from kdbench.store import read_results
from kdbench.store.results import job_id, open_run
from tests.support.helpers import as_read
from tests.support.rows import result_row

OBJECTIVE = "0.5·CE + 0.5·forward_kl(T=2, ×T²) over 32000 entries"
BF16_SKIP = "bf16: this CPU has no native bf16 (AVX512_BF16 / AMX): autocast would emulate it"
# (loss_impl, precision, seq_len): loss_rel_err, grad_rel_err; None: skipped
LEDGER = {
    ("dense", "fp32", 64): (2e-7, 3e-7),
    ("dense", "fp32", 128): (4e-7, 1e-7),
    ("fused_linear", "fp32", 64): (1e-7, 2e-7),
    ("fused_linear", "bf16", 64): None,
    ("liger", "bf16", 64): (3e-3, 4e-2),
}


def _step(impl, precision, seq_len, run_id="run", median_ms=100.0, errors=None, **extra):
    rng = np.random.default_rng(seq_len)
    samples = (median_ms * rng.lognormal(0, 0.01, 30)).tolist()
    row = result_row(
        run_id=run_id,
        suite="llm",
        cell_id=f"id-{impl}-{precision}-{seq_len}",
        cell_label=f"t→s {precision} seq{seq_len} {impl}",
        teacher="t",
        student="s",
        precision=precision,
        teacher_precision=precision,
        method="forward_kl",
        data_kind="tokens",
        seq_len=seq_len,
        loss_impl=impl,
        vocab_size=32000,
        loss_objective=OBJECTIVE,
        device_name="cpu-x",
        backend="cpu",
        timestamp=datetime(2026, 12, 3, tzinfo=UTC),
        samples_ms=samples,
        median_ms=float(np.median(samples)),
        n=30,
    )
    if errors is not None:
        row.update(loss_rel_err=errors[0], grad_rel_err=errors[1])
        row.update(grad_rel_err_hidden=errors[1] / 2, grad_rel_err_head=errors[1])
    return row | extra


def _rows(run_id="run"):
    rows = []
    for (impl, precision, seq), errors in LEDGER.items():
        if errors is None:
            rows.append(_step(impl, precision, seq, run_id, status="skipped", error=BF16_SKIP))
            rows[-1].update(samples_ms=None, median_ms=None, n=None)
        else:
            rows.append(_step(impl, precision, seq, run_id, errors=errors))
    rows.append(
        _step(
            "dense", "bf16", 64, run_id, notes="accuracy ledger not taken: the top-k cached teacher's sparse KL",
            loss_objective="0.5·CE + 0.5·forward_kl over the teacher's top-8 log-probs(T=1) over 32000 entries",
        )
    )  # fmt: skip
    return rows


def test_the_table_is_the_worst_error_per_impl_precision_and_objective_and_says_why_none():
    table = ledger_table(as_read(_rows()))
    by = {(r["loss_impl"], r["precision"], r["loss_objective"][:20]): r for r in table.to_dict("records")}
    dense = by[("dense", "fp32", OBJECTIVE[:20])]
    assert dense["cells"] == 2 and dense["measured"] == 2  # seq 64 and 128: the worst of each error
    assert dense["loss_rel_err"] == 4e-7 and dense["grad_rel_err"] == 3e-7 and dense["grad_rel_err_head"] == 3e-7
    skipped = by[("fused_linear", "bf16", OBJECTIVE[:20])]
    assert skipped["status"] == "skipped" and skipped["why"] == f"skipped: {BF16_SKIP}" and skipped["measured"] == 0
    topk = next(r for r in table.to_dict("records") if "top-8" in r["loss_objective"])
    assert topk["measured"] == 0 and topk["why"].startswith("accuracy ledger not taken: the top-k cached")
    rows = {(r["loss_impl"], r["precision"]): r for r in ledger_rows(table) if "top-8" not in r["loss_objective"]}
    assert rows[("liger", "bf16")]["beyond"] and rows[("liger", "bf16")]["grad_rel_err"] == "4.0e-02"
    assert not rows[("dense", "fp32")]["beyond"] and rows[("dense", "fp32")]["loss_rel_err"] == "4.0e-07"


def test_the_report_shows_the_ledger_table(tmp_path):
    html = render_report(as_read(_rows()), tmp_path).read_text()
    assert "Accuracy ledger: each loss implementation against float64" in html
    body = html.split('<table class="lm-ledger">')[1].split("</table>")[0]
    rows = re.findall(r'<tr class="lm-ledger-row[^"]*">(.*?)</tr>', body, re.S)
    assert len(rows) == 5
    liger = next(r for r in rows if "<td>liger</td>" in r)
    assert "3.0e-03" in liger and "4.0e-02" in liger and "⚠" in liger and OBJECTIVE in liger
    assert f"beyond {MAX_LOSS_ERR:g}" in html
    assert any("skipped: bf16: this CPU has no native bf16" in r for r in rows)


def test_a_report_without_ledger_columns_shows_no_ledger_table(tmp_path):
    rows = [_step("dense", "fp32", 64)]  # an older run: no ledger columns, no objective
    html = render_report(as_read(rows), tmp_path).read_text()
    body = html.split('<table class="lm-ledger">')[1].split("</table>")[0]
    assert "<td>dense</td>" in body and f'<td class="num loss-err">{MISSING}</td>' in body  # listed, no errors


# --------------------------------------------------------------------------------------------------- compare


def _pair(new_errors, faster=0.5, repeats=3):
    """BASE and NEW of one fused_linear bf16 cell, NEW ``faster`` × BASE's time, with NEW's ledger errors."""
    base, new = [], []
    for r in range(repeats):
        spread = 1 + 0.01 * (r - 1)
        base.append(_step("fused_linear", "bf16", 64, "base", 100.0 * spread, errors=(1e-3, 2e-3), repeat=r + 1))
        new.append(_step("fused_linear", "bf16", 64, "new", 100.0 * faster * spread, errors=new_errors, repeat=r + 1))
    return as_read(base), as_read(new)


def test_a_faster_cell_beyond_the_bound_is_named_in_a_note_not_a_gate():
    cmp = compare_frames(*_pair((5e-2, 2e-2)))
    assert [str(c.verdict) for c in cmp.changes] == ["improved"]
    assert cmp.exit_code == 0
    note = next(n for n in cmp.notes() if n.startswith("accuracy ledger"))
    assert "1 NEW cell(s) compute their loss beyond the bound" in note and "> 0.01, --max-loss-err" in note
    assert "t→s bf16 seq64 fused_linear (its step: improved): loss_rel_err 5.0e-02, grad_rel_err 2.0e-02" in note
    assert "1 of them faster (improved), which is no improvement of the same loss" in note


def test_within_the_bound_no_note_fires():
    cmp = compare_frames(*_pair((5e-3, 9e-3)))
    assert not any(n.startswith("accuracy ledger") for n in cmp.notes()) and cmp.ledger == []


def test_the_bound_is_the_policys_and_the_gate_is_opt_in():
    base, new = _pair((5e-3, 9e-3))
    strict = compare_frames(base, new, policy=Policy(max_loss_err=1e-3))
    assert [f.errors for f in strict.ledger] == [(("loss_rel_err", 5e-3), ("grad_rel_err", 9e-3))]
    assert strict.exit_code == 0
    gated = compare_frames(base, new, policy=Policy(max_loss_err=1e-3, gate_loss_err=True))
    assert gated.exit_code == 1 and [f.cell_id for f in gated.inaccurate] == ["id-fused_linear-bf16-64"]
    assert "fails the gate (--gate-loss-err)" in next(n for n in gated.notes() if n.startswith("accuracy ledger"))


def test_a_slower_cell_beyond_the_bound_is_named_but_never_gated():
    cmp = compare_frames(*_pair((5e-2, 2e-2), faster=1.0), policy=Policy(gate_loss_err=True))
    assert cmp.exit_code == 0 and cmp.ledger and cmp.inaccurate == []
    assert "none of them called improved" in next(n for n in cmp.notes() if n.startswith("accuracy ledger"))


def _run(tmp: Path, run_id: str, frame) -> Path:
    folder = open_run(tmp, "llm", "llm.yaml", run_id)
    rows = [result_row(**{k: v for k, v in r.items() if v is not None and k in LEDGER_KEYS}) for r in frame]
    for rep in sorted({r["repeat"] for r in rows}):
        folder.write_part(job_id(rows[0]["cell_id"], rep), [r for r in rows if r["repeat"] == rep])
    return folder.path


LEDGER_KEYS = set(_step("dense", "fp32", 64, errors=(1, 1), repeat=1))


def test_the_cli_takes_the_bound_and_the_gate(tmp_path, capsys):
    base = [_step("fused_linear", "bf16", 64, "base", 100.0 * (1 + 0.01 * r), errors=(1e-3, 2e-3), repeat=r + 1)
            for r in range(3)]  # fmt: skip
    new = [_step("fused_linear", "bf16", 64, "new", 50.0 * (1 + 0.01 * r), errors=(3e-2, 2e-3), repeat=r + 1)
           for r in range(3)]  # fmt: skip
    b, n = _run(tmp_path, "base", base), _run(tmp_path, "new", new)
    assert len(read_results([n])) == 3
    assert main(["compare", str(b), str(n)]) == 0
    out = capsys.readouterr().out
    assert "note: accuracy ledger: 1 NEW cell(s)" in out and "loss_rel_err 3.0e-02" in out
    assert main(["compare", str(b), str(n), "--max-loss-err", "0.05"]) == 0
    assert "accuracy ledger" not in capsys.readouterr().out
    assert main(["compare", str(b), str(n), "--gate-loss-err"]) == 1
    err = capsys.readouterr().err
    assert "improved beyond --max-loss-err 0.01: t→s bf16 seq64 fused_linear (its step: improved)" in err


@pytest.mark.parametrize("value", ["0", "-1", "inf", "x"])
def test_a_bad_bound_is_a_one_line_error(tmp_path, capsys, value):
    assert main(["compare", str(tmp_path), str(tmp_path), "--max-loss-err", value]) == 2
    err = capsys.readouterr().err
    assert "--max-loss-err" in err and len(err.strip().splitlines()) == 1
