"""uld in LM cells and cross-tokenizer cells (data.tokenizers): ULD's term under each loss_impl that computes it,
the plan's note on a shared tokenizer, the text batch each side reads in its own tokens, and a cross-tokenizer cell
through the real workload (its align phase, tokenizer columns, ULD's value)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kdbench.config.plan import Cell, cell_id_of
from kdbench.core.errors import KdbenchError
from kdbench.distill.lm.impls import uld_computers, uld_lm_loss, uld_unsupported
from kdbench.distill.lm.uld import uld_alignment, uld_loss
from kdbench.distill.losses import LossInputs
from kdbench.models import ModelCache
from kdbench.run.cell import measure_cell
from kdbench.workloads import check_cell
from kdbench.workloads.lm.checks import ULD_NOTE
from kdbench.workloads.lm.workload import LM
from tests.unit.workloads.test_lm_workload import CPU, lm_config

pytest.importorskip("transformers")

XTOK = {
    "overrides": {
        "teacher": {"num_hidden_layers": 1, "vocab_size": 256},
        "student": {"num_hidden_layers": 1, "vocab_size": 1024},
    },
    "data": {"kind": "tokens", "seq_len": 64, "tokenizers": {"teacher": "bytes", "student": "bpe:1024"}},
    "inference": {"batch_sizes": []},
}


def _heads(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, ss, st, hs_, ht_, vs, vt = 2, 7, 9, 5, 6, 11, 17

    def rand(*shape, grad=False):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(grad)

    hs, ws, bs = rand(b, ss, hs_, grad=True), rand(vs, hs_, grad=True), rand(vs, grad=True)
    ht, wt = rand(b, st, ht_), rand(vt, ht_)
    ls, lt = torch.randint(0, vs, (b, ss), generator=g), torch.randint(0, vt, (b, st), generator=g)
    ls[:, :2], lt[:, :3], ls[1, 5:] = -100, -100, -100  # prompts of their own lengths, a shorter answer
    return hs, ws, bs, ht, wt, ls, lt


@pytest.mark.parametrize("impl", ["dense", "chunked", "fused_linear"])
def test_each_impl_computes_uld_equal_to_uld_loss_on_the_heads_logits(impl):
    hs, ws, bs, ht, wt, ls, lt = _heads()
    want = uld_loss(F.linear(hs, ws, bs), F.linear(ht, wt), ls, lt, 1.5, 2.0)
    grads_want = torch.autograd.grad(want, (hs, ws, bs))
    got = uld_lm_loss(impl, hs, ws, bs, ht, wt, None, uld_alignment(ls, lt), 1.5, 2.0, chunk_size=3)
    grads = torch.autograd.grad(got, (hs, ws, bs))
    # the chunked forms accumulate their value in float32, as every token loss of kdbench does
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)
    for g, w in zip(grads, grads_want):
        torch.testing.assert_close(g, w, rtol=1e-7, atol=1e-7)


def test_the_impls_that_cannot_compute_uld_say_why_and_what_to_use():
    assert uld_computers() == ["dense", "chunked", "fused_linear"]
    for impl in ("liger", "torch_linear"):
        why = uld_unsupported(impl)
        assert why.startswith(f"loss_impl {impl} cannot compute uld (") and why.endswith(
            "use loss_impl dense or chunked or fused_linear"
        )


def test_a_uld_cell_on_one_tokenizer_runs_with_a_note_and_its_loss_is_ce_plus_uld():
    config = lm_config(method="uld", uld={"alpha": 0.6, "temperature": 2.0}, inference={"batch_sizes": []})
    assert check_cell(config, False) == []
    assert LM.plan_notes(config) == [f"uld on a pair that shares one tokenizer: {ULD_NOTE}"]
    assert LM.plan_notes(lm_config()) == []
    teacher, student = LM.build_pair(config, CPU, ModelCache())
    x, y = LM.batch(config, 2, CPU.device, 0, (teacher, student))
    loss = LM.loss(config, None, teacher, student, CPU)
    with torch.no_grad():
        ht = teacher(x)
    hs = student(x)
    got = loss(LossInputs(hs, ht, y))
    s_logits, t_logits = student.head(hs), teacher.head(ht)
    ce = F.cross_entropy(s_logits.reshape(-1, s_logits.shape[-1]), y.reshape(-1), ignore_index=-100)
    want = 0.4 * ce + 0.6 * uld_loss(s_logits, t_logits, y, y, 2.0, 2.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_text_batch_is_one_text_in_each_sides_tokens_with_the_prompt_by_text_position():
    from kdbench.data.tokenizers import ByteTokenizer
    from kdbench.workloads.lm.xtok import encode_side, paired, paired_step, text_batch, tokenizer_of

    config = lm_config(method="uld", **XTOK)
    batch = text_batch("bytes", "bpe:1024", 2, 64, 0.25, 0)
    assert [len(w) for w in batch.windows] == [64, 64] and batch.prompt_bytes == (16, 16)  # bytes: 1 token a byte
    bpe = tokenizer_of("bpe:1024")
    assert bpe.vocab_size == 1024 and tokenizer_of("bpe:1024") is bpe  # trained once per process
    s_ids, s_labels = encode_side("bpe:1024", batch, batch.student_len)
    for b, window in enumerate(batch.windows):
        n = len(bpe.encode(window))
        assert bpe.decode(s_ids[b, :n].tolist()) == window and (s_labels[b, n - 1 :] == -100).all()
        lengths = torch.tensor([len(bpe.decode([i])) for i in s_ids[b, :n].tolist()]).cumsum(0)
        within = int((lengths <= batch.prompt_bytes[b]).sum())  # the student's tokens wholly within the prompt
        assert (s_labels[b, :within] == -100).all() and (s_labels[b, within : n - 1] == s_ids[b, within + 1 : n]).all()
    t_ids, t_labels = encode_side("bytes", batch, 64)
    assert ByteTokenizer().decode(t_ids[0].tolist()) == batch.windows[0]
    assert (t_labels[:, :16] == -100).all() and (t_labels[:, 16:-1] == t_ids[:, 17:]).all()
    made = paired(config, 2, config.seed)
    assert torch.equal(made[0], s_ids) and torch.equal(made[2], t_ids)
    step = paired_step(config, t_ids)  # bound to the batch it was built for: another one is refused, not replaced
    assert torch.equal(step(t_ids, t_labels)[0], s_ids)
    with pytest.raises(KdbenchError, match="tokenizes its cell's own text batch"):
        step(t_ids.clone(), t_labels)


@pytest.mark.slow
def test_a_cross_tokenizer_cell_runs_with_its_align_phase_tokenizers_and_uld_on_the_row():
    config = lm_config(method="uld", loss_impl="chunked", chunk_size=16, **XTOK)
    assert check_cell(config, False) == [] and LM.plan_notes(config) == []
    rows = measure_cell(Cell(0, cell_id_of(config), config), CPU, ModelCache())
    assert [r["status"] for r in rows] == ["ok"], [r.get("error") for r in rows]
    step = rows[0]
    assert step["phase_align_ms"] > 0 and math.isfinite(step["final_loss"])
    assert step["teacher_tokenizer"] == "bytes"
    assert step["student_tokenizer"].startswith("bpe:1024 (1024 tokens, sha256 ")
    assert step["vocab_size"] == 1024 and ULD_NOTE not in (step["notes"] or "")
    assert step["predicted_peak_bytes"] > 0  # the fit planner ran the step, its align phase made for real
    # the accuracy ledger of CE + ULD, chunked in fp32 against dense in float64, each side on its own tokens
    assert 0 < step["loss_rel_err"] < 1e-5 and 0 < step["grad_rel_err"] < 1e-4, step["notes"]
    assert step["loss_objective"] == (
        "0.4·CE + 0.6·uld(T=1, sorted probabilities, L1, positions paired after the prompt) over each side's own "
        "entries (256 teacher / 1024 student)"
    )

    # ULD's value through the step's own inputs (its align phase) equals uld_loss on the heads' logits
    teacher, student = LM.build_pair(config, CPU, ModelCache())
    x, y = LM.batch(config, config.batch_size, CPU.device, config.seed, (teacher, student))
    loss = LM.loss(config, None, teacher, student, CPU)
    s_x, s_y, t_x, extra = LM.paired_batch(type("D", (), {"fixed_input": x})(), config)(x, y)
    assert torch.equal(t_x, x) and s_x.shape[1] < x.shape[1]  # the student reads fewer, longer tokens
    with torch.no_grad():
        ht, hs = teacher(t_x), student(s_x)
        got = loss(LossInputs(hs, ht, s_y, **extra))
        s_logits, t_logits = student.head(hs), teacher.head(ht)
    ce = F.cross_entropy(s_logits.reshape(-1, 1024), s_y.reshape(-1), ignore_index=-100)
    want = 0.4 * ce + 0.6 * uld_loss(s_logits, t_logits, s_y, extra["teacher_targets"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _pad_config(impl: str, method: str, padded: str):
    sizes = {"teacher": 4096, "student": 4096, padded: 4000}
    overrides = {role: {"num_hidden_layers": 1, "vocab_size": sizes[role]} for role in ("teacher", "student")}
    return lm_config(
        method=method,
        loss_impl=impl,
        chunk_size=8,
        overrides=overrides,
        data={"kind": "tokens", "seq_len": 12, "vocab_policy": "pad"},
    )


@pytest.mark.parametrize(
    ("impl", "method", "padded"),
    [
        ("dense", "forward_kl", "student"),
        ("chunked", "forward_kl", "student"),
        ("fused_linear", "forward_kl", "student"),
        ("dense", "reverse_kl", "teacher"),
        ("chunked", "reverse_kl", "teacher"),
        ("fused_linear", "forward_kl", "teacher"),
    ],
)
def test_vocab_pad_gives_the_hand_computed_loss_and_gradients(impl, method, padded):
    """The smaller head padded with -inf up to 4096 entries: the divergence over the entries both models give
    (an entry where one logit is -inf left out, token_losses' convention), CE over the student's own, finite."""
    config = _pad_config(impl, method, padded)
    assert check_cell(config, False) == []
    teacher, student = LM.build_pair(config, CPU, ModelCache())
    x, y = LM.batch(config, 2, CPU.device, 0, (teacher, student))
    assert int(x.max()) < 4000  # ids both models read
    loss = LM.loss(config, None, teacher, student, CPU)
    assert loss.vocab == 4096 and "padded with -inf logits to 4096 entries" in loss.notes[0]
    with torch.no_grad():
        ht = teacher(x)
    hs = student(x).detach().requires_grad_(True)
    got = loss(LossInputs(hs, ht, y))
    (g_got,) = torch.autograd.grad(got, hs)

    hs2 = hs.detach().requires_grad_(True)
    valid = y.reshape(-1) != -100
    s = student.head(hs2).reshape(-1, student.vocab_size)[valid]  # each head as it is, unpadded
    t = teacher.head(ht).reshape(-1, teacher.vocab_size)[valid]
    ls, lt, v = s.log_softmax(-1), t.log_softmax(-1), 4000  # the entries both models give: the first 4000
    if method == "forward_kl":
        div = (lt[:, :v].exp() * (lt[:, :v] - ls[:, :v])).sum(-1).mean()
    else:
        div = (ls[:, :v].exp() * (ls[:, :v] - lt[:, :v])).sum(-1).mean()
    want = 0.5 * F.cross_entropy(s, y.reshape(-1)[valid]) + 0.5 * div
    (g_want,) = torch.autograd.grad(want, hs2)
    assert math.isfinite(float(got.detach())) and torch.isfinite(g_got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("impl", ["liger", "torch_linear"])
def test_vocab_pad_is_refused_where_the_loss_cannot_take_minus_inf(impl):
    problems = check_cell(_pad_config(impl, "forward_kl", "student"), False)
    assert [k for k, _ in problems] == [("loss_impl",)]
    assert (
        f"loss_impl {impl} cannot take them" in problems[0][1]
        and "use loss_impl dense or natural or chunked" in problems[0][1]
    )


def test_the_plan_says_the_uld_note_before_anything_runs(tmp_path, capsys):
    from kdbench.cli import main

    suite = tmp_path / "uld.yaml"
    suite.write_text(
        "name: n\ndefaults:\n  pair: {teacher: tiny-llama-teacher, student: tiny-llama-student}\n"
        "  method: uld\n  data: {kind: tokens, seq_len: 32}\n"
    )
    assert main(["run", str(suite), "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert f"note: cell 1: uld on a pair that shares one tokenizer: {ULD_NOTE}" in captured.err + captured.out


def test_the_report_shows_the_align_phase_first_where_a_row_has_one():
    import pandas as pd

    from kdbench.core.names import ALIGN, PHASES
    from kdbench.report.summaries import phase_gap, shown_phases

    phases = {p.column: 1.0 for p in PHASES}
    rows = pd.DataFrame([{"median_ms": 8.0, ALIGN.column: 2.0, **phases}, {"median_ms": 6.0, **phases}])
    assert shown_phases(rows) == (ALIGN, *PHASES) and shown_phases(rows.drop(columns=ALIGN.column)) == PHASES
    assert phase_gap(rows).tolist() == [1.0, 1.0]  # the align phase counted where timed


@pytest.mark.slow
def test_a_uld_row_on_one_tokenizer_carries_the_note():
    config = lm_config(method="uld", loss_impl="fused_linear", chunk_size=8, inference={"batch_sizes": []})
    rows = measure_cell(Cell(0, cell_id_of(config), config), CPU, ModelCache())
    assert rows[0]["status"] == "ok" and math.isfinite(rows[0]["final_loss"])
    assert f"uld on a pair that shares one tokenizer: {ULD_NOTE}" in rows[0]["notes"]
    assert rows[0]["teacher_tokenizer"] is None and rows[0].get("phase_align_ms") is None
    assert 0 < rows[0]["loss_rel_err"] < 1e-5 and 0 < rows[0]["grad_rel_err"] < 1e-4, rows[0]["notes"]


def test_a_gpu_step_stages_its_tokens_through_two_pinned_sets_without_a_sync():
    """GPU review 4, M7: the tokens go host -> pinned -> device without blocking; a pinned set is rewritten only
    after the copy made from it two calls before is done (its event)."""
    from kdbench.workloads.lm.xtok import Staging

    pinned, events = [], []

    class Event:
        def __init__(self):
            self.waited = False
            events.append(self)

        def synchronize(self):
            self.waited = True

    def pin(t):
        pinned.append(torch.empty_like(t))
        return pinned[-1]

    staging = Staging(torch.device("cpu"), asynchronous=True, pin=pin, event=Event)
    calls = [[torch.full((2, 3), float(n)), torch.arange(4) + n] for n in range(4)]
    outs = [staging(made) for made in calls]
    assert len(pinned) == 4  # two sets of two tensors, made once
    assert [e.waited for e in events] == [True, True, False, False]  # calls 3 and 4 waited for calls 1 and 2
    assert all(o[0] is outs[0][0] for o in outs)  # the same device tensors every call
    torch.testing.assert_close(outs[-1][0], calls[-1][0])
    torch.testing.assert_close(outs[-1][1], calls[-1][1])
    assert torch.equal(pinned[0], calls[2][0]) and torch.equal(pinned[2], calls[3][0])  # each set holds its last call
    plain = Staging(torch.device("cpu"))  # the CPU: a plain copy, no pinning
    assert not plain.asynchronous and torch.equal(plain(calls[1])[1], calls[1][1])
