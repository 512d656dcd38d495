"""A cross-tokenizer cell with ULD aligned by bytes (``uld: {alignment: bytes}``, issue 45 item 4): the step's align
phase pairs the positions that have read the same text, the row says which alignment and how much of the student it
pairs, the loss and its ledger take the step's pairs, and a cell without text is refused."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kdbench.config.plan import Cell, cell_id_of
from kdbench.distill.lm.uld import Alignment, uld_loss
from kdbench.distill.losses import LossInputs
from kdbench.models import ModelCache
from kdbench.run.cell import measure_cell
from kdbench.workloads import check_cell
from kdbench.workloads.lm.workload import LM
from kdbench.workloads.lm.xtok import paired, text_batch, tokenizer_columns, tokenizer_of
from tests.unit.workloads.test_lm_workload import CPU, lm_config
from tests.unit.workloads.test_lm_xtok import XTOK

pytest.importorskip("transformers")


def _config(alignment: str, **over):
    return lm_config(method="uld", uld={"alignment": alignment}, **{**XTOK, **over})


def test_the_align_phase_pairs_the_positions_that_have_read_the_same_text():
    config = _config("bytes")
    s_ids, s_labels, t_ids, _t_labels, *parts = paired(config, 2, config.seed)
    align = Alignment(*parts)
    bpe = tokenizer_of("bpe:1024")
    batch = text_batch("bytes", "bpe:1024", 2, 64, 0.25, config.seed)
    counted = int((s_labels != -100).sum())
    assert len(align) == counted > 0  # a byte teacher has a position at every BPE boundary: all paired
    s_w, t_w = s_ids.shape[1], t_ids.shape[1]
    for s, t in zip(align.student.tolist(), align.teacher.tolist()):
        b = s // s_w
        assert t // t_w == b
        read = bpe.decode(s_ids[b, : s % s_w + 1].tolist())
        assert read == bytes(t_ids[b, : t % t_w + 1].tolist()) and batch.windows[b].startswith(read)
    by_position = Alignment(*paired(_config("position"), 2, config.seed)[4:])
    assert torch.equal(by_position.student, align.student) and not torch.equal(by_position.teacher, align.teacher)
    assert tokenizer_columns(config)["uld_alignment"] == "bytes" and tokenizer_columns(config)["uld_matched"] == 1.0
    assert tokenizer_columns(_config("position"))["uld_alignment"] == "position"
    assert tokenizer_columns(lm_config())["uld_alignment"] is None  # not a uld cell


@pytest.mark.slow  # the plan's checks of an LM cell count its models (about 20 s here)
def test_bytes_without_text_is_refused_at_plan_time_and_with_text_it_plans():
    bare = lm_config(method="uld", uld={"alignment": "bytes"})
    problems = check_cell(bare, False)
    assert any(
        key == ("uld", "alignment") and "give data.tokenizers, or use uld.alignment: position" in why
        for key, why in problems
    ), problems
    assert check_cell(_config("bytes"), False) == []


def test_the_loss_takes_the_steps_byte_pairs_and_says_so():
    config = _config("bytes")
    teacher, student = LM.build_pair(config, CPU, ModelCache())
    x, y = LM.batch(config, config.batch_size, CPU.device, config.seed, (teacher, student))
    loss = LM.loss(config, None, teacher, student, CPU)
    assert "positions paired by bytes read" in loss.objective
    s_x, s_y, t_x, extra = LM.paired_batch(type("D", (), {"fixed_input": x})(), config)(x, y)
    with torch.no_grad():
        ht, hs = teacher(t_x), student(s_x)
        got = loss(LossInputs(hs, ht, s_y, **extra))
        s_logits, t_logits = student.head(hs), teacher.head(ht)
    ce = F.cross_entropy(s_logits.reshape(-1, 1024), s_y.reshape(-1), ignore_index=-100)
    align = extra["alignment"]
    want = 0.4 * ce + 0.6 * uld_loss(s_logits, t_logits, s_y, extra["teacher_targets"], alignment=align)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # untrained heads are near uniform, so the two pairings' terms differ in the last digits only, but differ
    by_bytes = uld_loss(s_logits.double(), t_logits.double(), s_y, extra["teacher_targets"], alignment=align)
    assert by_bytes != uld_loss(s_logits.double(), t_logits.double(), s_y, extra["teacher_targets"])


@pytest.mark.slow
def test_a_bytes_cell_runs_with_its_alignment_share_and_ledger_on_the_row():
    config = _config("bytes", loss_impl="chunked", chunk_size=16)
    rows = measure_cell(Cell(0, cell_id_of(config), config), CPU, ModelCache())
    assert [r["status"] for r in rows] == ["ok"], [r.get("error") for r in rows]
    step = rows[0]
    assert step["uld_alignment"] == "bytes" and step["uld_matched"] == 1.0 and math.isfinite(step["final_loss"])
    assert step["loss_objective"] == (
        "0.4·CE + 0.6·uld(T=1, sorted probabilities, L1, positions paired by bytes read) over each side's own "
        "entries (256 teacher / 1024 student)"
    )
    # the ledger evaluates the step's pairs (chunked fp32 against dense float64)
    assert 0 < step["loss_rel_err"] < 1e-5 and 0 < step["grad_rel_err"] < 1e-4, step["notes"]
