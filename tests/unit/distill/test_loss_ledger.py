"""The accuracy ledger (kdbench.distill.lm.ledger): a loss_impl's loss and gradients at the cell's precision
against dense in float64; the objective in words; the columns on a real LM cell's step row, taken outside every
timed figure and memory peak; a failing ledger is a note."""

from __future__ import annotations

import math

import pytest
import torch

from kdbench.config.plan import Cell, cell_id_of
from kdbench.config.schema import CellConfig
from kdbench.distill.lm import token_losses
from kdbench.distill.lm.divergences import TokenLoss
from kdbench.distill.lm.impls import LOSS_IMPLS, lm_loss
from kdbench.distill.lm.impls.base import IMPLS, LossImpl, register_impl
from kdbench.distill.lm.impls.dense import buffers
from kdbench.distill.lm.ledger import LEDGER_COLUMNS, ledger_tokens, loss_ledger, objective_text, rel_err
from kdbench.hw.backends import resolve
from kdbench.measure.step import MeasureOptions
from kdbench.models import ModelCache
from kdbench.run.cell import measure_cell

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

N, V, H = 41, 211, 24
LOSS = TokenLoss("forward_kl", temperature=2.0, kd_weight=0.5, ce_weight=0.5)


def inputs(dtype=torch.float32, bias=False, seed=0):
    """(student hidden, weight, bias, teacher hidden, weight, bias) as a cell hands them (hidden states at
    ``dtype``, heads float32), and labels with every fourth token -100."""
    g = torch.Generator().manual_seed(seed)
    hs, ht = torch.randn(N, H, generator=g), torch.randn(N, H, generator=g)
    ws, wt = torch.randn(V, H, generator=g) * 0.3, torch.randn(V, H, generator=g) * 0.3
    bs, bt = (torch.randn(V, generator=g) * 0.1, torch.randn(V, generator=g) * 0.1) if bias else (None, None)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::4] = -100
    return (hs.to(dtype), ws, bs, ht.to(dtype), wt, bt), labels


def ledger(impl, dtype=torch.float32, loss=LOSS, bias=False):
    cell, labels = inputs(dtype, bias)
    reference = [None if t is None else t.double() for t in cell]
    return loss_ledger(impl, cell, reference, labels, loss, chunk_size=8)


def test_float64_logits_stay_float64_and_float32_results_do_not_change():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(5, 30, generator=g), torch.randn(5, 30, generator=g)
    assert token_losses.upcast(s) is s  # float32: no copy, the same arithmetic as before
    assert token_losses.upcast(s.bfloat16()).dtype == torch.float32
    got = token_losses.forward_kl(s.double(), t.double(), temperature=2.0)
    assert got.dtype == torch.float64
    # an independent float64 formula: p_t (log p_t − log p_s) at T = 2, × 4, mean over the 5 tokens
    lps, lpt = torch.log_softmax(s.double() / 2, -1), torch.log_softmax(t.double() / 2, -1)
    want = (lpt.exp() * (lpt - lps)).sum() / 5 * 4
    assert abs(got.item() - want.item()) < 1e-14
    assert token_losses.forward_kl(s, t, temperature=2.0).dtype == torch.float32


@pytest.mark.parametrize("impl", LOSS_IMPLS)
def test_fp32_against_float64_is_tiny_for_every_impl(impl):
    row, notes = ledger(impl)
    assert set(row) == set(LEDGER_COLUMNS) and notes == []
    assert row["loss_rel_err"] < 1e-6, row
    assert row["grad_rel_err"] < 1e-5 and row["grad_rel_err_hidden"] < 1e-5 and row["grad_rel_err_head"] < 1e-5, row


def test_the_reference_is_dense_in_float64_by_hand():
    (hs, ws, _, ht, wt, _), labels = inputs()
    row, _ = ledger("dense")
    keep = labels != -100
    hs64 = hs.double().requires_grad_()
    ws64 = ws.double().requires_grad_()
    s, t = (hs64 @ ws64.T)[keep], (ht.double() @ wt.double().T)[keep]
    ce = torch.nn.functional.cross_entropy(s, labels[keep])
    kl = token_losses.forward_kl(s, t, temperature=2.0)
    want = 0.5 * ce + 0.5 * kl
    want.backward()
    got = lm_loss("dense", hs, ws, None, ht, wt, None, labels, LOSS)
    assert row["loss_rel_err"] == pytest.approx(abs(got.item() - want.item()) / abs(want.item()), rel=1e-6)


def test_bf16_hidden_states_give_a_measurably_larger_error():
    fp32, _ = ledger("dense")
    for impl in ("dense", "fused_linear"):
        bf16, _ = ledger(impl, torch.bfloat16)
        assert bf16["loss_rel_err"] > 100 * fp32["loss_rel_err"], (impl, bf16, fp32)
        assert bf16["grad_rel_err"] > 100 * fp32["grad_rel_err"], (impl, bf16, fp32)
        assert 1e-4 < bf16["grad_rel_err"] < 0.1  # bf16's 8 bits of mantissa: about 2⁻⁸ relative per entry


def test_a_silently_different_objective_shows_as_a_large_error():
    # Liger's GKD bug, in small: an impl that trains T = 0.9 where the loss says T = 2 (its value and gradient)
    def wrong(heads, loss, rows, settings):
        other = TokenLoss(loss.divergence, temperature=0.9, kd_weight=loss.kd_weight, ce_weight=loss.ce_weight)
        return IMPLS["dense"].compute(heads, other, rows, settings)

    register_impl(LossImpl("wrong_temperature", wrong, buffers))
    try:
        row, _ = ledger("wrong_temperature")
    finally:
        del IMPLS["wrong_temperature"]
    assert row["loss_rel_err"] > 1e-2 and row["grad_rel_err"] > 1e-2


def test_a_reference_of_zero_has_no_relative_error_and_says_so():
    # forward KL alone, the student equal to the teacher: the float64 loss is 0 (its gradients round to ~1e-17:
    # a reference that is not exactly 0 keeps its relative error, however large)
    cell, labels = inputs()
    same = (cell[0], cell[1], None, cell[0], cell[1], None)
    reference = [None if t is None else t.double() for t in same]
    row, notes = loss_ledger("dense", same, reference, labels, TokenLoss("forward_kl"), 8)
    assert row["loss_rel_err"] is None and row["grad_rel_err"] is not None
    assert notes == ["accuracy ledger: the float64 reference of loss_rel_err is 0: no relative error"]
    assert rel_err(torch.tensor(0.5), torch.tensor(0.0)) is None
    assert rel_err(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 4.0])) == 0.75  # ‖(3, 0)‖ / ‖(0, 4)‖


def test_a_bias_counts_in_the_head_gradient():
    row, _ = ledger("chunked", bias=True)
    assert row["grad_rel_err_head"] < 1e-5 and row["loss_rel_err"] < 1e-6


def test_the_ledger_takes_the_batchs_first_counted_tokens_at_most():
    hs, ht = torch.arange(2 * 8 * 3.0).reshape(2, 8, 3), -torch.arange(2 * 8 * 2.0).reshape(2, 8, 2)
    labels = torch.full((2, 8), 5)
    labels[:, :3] = -100  # counted: positions 3..7 and 11..15 of the flattened batch
    s, t, lab, rows = ledger_tokens(hs, ht, labels, most=7)
    assert rows.tolist() == [3, 4, 5, 6, 7, 11, 12] and lab.shape == (13,) and s.shape == (13, 3) and t.shape == (13, 2)
    assert torch.equal(s, hs.reshape(-1, 3)[:13]) and torch.equal(t, ht.reshape(-1, 2)[:13])
    s, _, lab, rows = ledger_tokens(hs, ht, labels)  # fewer than LEDGER_TOKENS: all of them
    assert rows.numel() == 10 and lab.shape == (16,) and s.shape == (16, 3)


def test_the_objective_in_words():
    assert (
        objective_text(LOSS, 32000, (50257, 32000))
        == "0.5·CE + 0.5·forward_kl(T=2, ×T²) over 32000 shared entries (vocab_policy slice of 50257 teacher / "
        "32000 student)"
    )
    assert objective_text(TokenLoss("jsd", beta=0.2, kd_weight=1.0), 4096, (4096, 4096)) == (
        "jsd(beta=0.2, T=1) over 4096 entries"
    )
    assert objective_text(TokenLoss(None, ce_weight=1.0), 100) == "CE over 100 entries"
    assert (
        objective_text(TokenLoss("forward_kl", kd_weight=0.5, ce_weight=0.5), 100, features=[(2.0, "hidden_mse")])
        == "0.5·CE + 0.5·forward_kl(T=1) over 100 entries + 2·hidden_mse"
    )
    assert "over the teacher's top-8 log-probs" in objective_text(LOSS, 100, topk=8)


# --------------------------------------------------------------------------------------------- on a cell's row


def lm_config(**over) -> CellConfig:
    """A tiny LM cell (tests/unit/workloads/test_lm_workload.py's pair), its step alone."""
    base = {
        "pair": {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
        "overrides": {"teacher": {"num_hidden_layers": 2}, "student": {"num_hidden_layers": 1}},
        "method": "forward_kl",
        "batch_size": 2,
        "data": {"kind": "tokens", "seq_len": 16},
        "timing": {"warmup": 0, "min_iters": 2, "min_time_s": 0.0},
        "inference": {"batch_sizes": []},
    }
    return CellConfig.model_validate({**base, **over})


def step_row(config: CellConfig):
    rows = measure_cell(Cell(0, cell_id_of(config), config), resolve("cpu"), ModelCache(), MeasureOptions())
    assert rows[0]["status"] == "ok", rows[0].get("error")
    return rows[0]


def test_a_cell_row_carries_the_ledger_and_its_objective():
    config = lm_config(method="jsd+hidden_mse", jsd={"temperature": 2.0, "alpha": 0.6}, loss_impl="fused_linear")
    row = step_row(config)
    assert row["loss_rel_err"] < 1e-5 and row["grad_rel_err"] < 1e-4, row
    assert row["grad_rel_err_hidden"] < 1e-4 and row["grad_rel_err_head"] < 1e-4
    assert row["loss_objective"] == "0.4·CE + 0.6·jsd(beta=0.5, T=2, ×T²) over 4096 entries + hidden_mse"
    assert "accuracy ledger" not in (row["notes"] or "")


def test_a_topk_cached_teacher_says_why_no_ledger():
    config = lm_config(teacher={"mode": "topk_cache", "k": 8})
    row = step_row(config)
    assert all(row.get(c) is None for c in LEDGER_COLUMNS)
    assert "accuracy ledger not taken: the top-k cached teacher's sparse KL" in row["notes"]
    assert "top-8 log-probs" in row["loss_objective"]


def test_the_ledger_runs_outside_the_timed_loop_and_every_memory_peak(monkeypatch):
    import kdbench.measure.memory as memory
    import kdbench.measure.rows as rows
    import kdbench.measure.step as step
    import kdbench.workloads.lm.workload as lm

    events: list[str] = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            events.append(f"{name} in")
            try:
                return fn(*args, **kwargs)
            finally:
                events.append(f"{name} out")

        return wrapped

    monkeypatch.setattr(memory.MemoryMeter, "__enter__", spy("meter", memory.MemoryMeter.__enter__))
    monkeypatch.setattr(memory.MemoryMeter, "__exit__", spy("meter-exit", memory.MemoryMeter.__exit__))
    monkeypatch.setattr(rows, "timed_loop", spy("timed", rows.timed_loop))
    monkeypatch.setattr(step, "step_live_peak", spy("live", step.step_live_peak))
    monkeypatch.setattr(lm, "accuracy_ledger", spy("ledger", lm.accuracy_ledger))
    row = step_row(lm_config())
    assert row["loss_rel_err"] is not None and row["live_peak_bytes"] > 0
    ledger = events.index("ledger in"), events.index("ledger out")
    assert events.index("meter-exit out") < ledger[0] and ledger[1] < events.index("live in"), events
    assert events.index("timed out") < events.index("meter-exit in"), events
    assert events.count("ledger in") == 1


def test_a_failing_ledger_is_a_note_and_the_row_stands(monkeypatch):
    from kdbench.distill.lm.loss import LMLoss

    def boom(self, *args):
        raise RuntimeError("boom")

    monkeypatch.setattr(LMLoss, "ledger", boom)
    row = step_row(lm_config())
    assert row["median_ms"] > 0 and row.get("loss_rel_err") is None
    assert "accuracy ledger failed: RuntimeError: boom" in row["notes"]
    assert math.isfinite(row["final_loss"])


def test_objective_text_says_pad_and_uld():
    pad = objective_text(LOSS, 50257, (50257, 32000), policy="pad")
    assert pad.endswith(
        "over 50257 entries (vocab_policy pad: the smaller of 50257 teacher / 32000 student padded with -inf)"
    )
    uld = objective_text(TokenLoss(None, ce_weight=0.4), 1024, (256, 1024), uld=[(0.6, 1.0)])
    assert uld == (
        "0.4·CE + 0.6·uld(T=1, sorted probabilities, L1, positions paired after the prompt) over each side's own "
        "entries (256 teacher / 1024 student)"
    )
