"""ULD (kdbench.distill.lm.uld) against the authors' own code, transcribed below from Nicolas-BZRD/llm-recipes
(``models/distillation_model.py``, ``DistillationLoss.forward`` and ``__get_start_and_size_answers``, read at
ab6e798; debug printing left out), in value and gradient."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kdbench.distill.lm.impls import uld_lm_loss
from kdbench.distill.lm.uld import uld_alignment, uld_loss, uld_rows


class AuthorsDistillationLoss(torch.nn.Module):
    """The authors' loss, as written (their names, their loops)."""

    def __init__(self, crossentropy_weight=1, distillation_weight=1, student_temperature=1, teacher_temperature=1,
                 skip_student_eos=False, skip_teacher_eos=False, ignore_index=-100):  # fmt: skip
        super().__init__()
        self.crossentropy_weight = crossentropy_weight
        self.distillation_weight = distillation_weight
        self.student_temperature = student_temperature
        self.teacher_temperature = teacher_temperature
        self.skip_student_eos = skip_student_eos
        self.skip_teacher_eos = skip_teacher_eos
        self.ignore_index = ignore_index

    def forward(self, student_predictions, teacher_predictions, student_targets, teacher_targets, rank=0):
        student = student_predictions.logits
        teacher = teacher_predictions.logits
        student_answer_index, student_answer_size = self._get_start_and_size_answers(student_targets)
        teacher_answer_index, teacher_answer_size = self._get_start_and_size_answers(teacher_targets)
        if self.skip_student_eos:
            student_answer_size = [size - 1 for size in student_answer_size]
        if self.skip_teacher_eos:
            teacher_answer_size = [size - 1 for size in teacher_answer_size]
        for i in range(student.size(0)):
            shift = student_answer_index[i]
            size = student_answer_size[i]
            end_shift = shift + size
            student[i] = torch.cat((
                torch.nn.functional.softmax(student[i, shift:end_shift, :] / self.student_temperature, dim=-1),
                torch.zeros_like(student[i, :(student.size(1) - size), :])), dim=0
            )  # fmt: skip
        for i in range(teacher.size(0)):
            shift = teacher_answer_index[i]
            size = teacher_answer_size[i]
            end_shift = shift + size
            teacher[i] = torch.cat((
                torch.nn.functional.softmax(teacher[i, shift:end_shift, :] / self.teacher_temperature, dim=-1),
                torch.zeros_like(teacher[i, :(teacher.size(1) - size), :])), dim=0
            )  # fmt: skip
        mex_length = max(max(student_answer_size), max(teacher_answer_size))
        student = student[:, :mex_length, :]
        teacher = teacher[:, :mex_length, :]
        student = student.sort(dim=-1, descending=True).values
        teacher = teacher.sort(dim=-1, descending=True).values
        diff_size = student.size(2) - teacher.size(2)
        if diff_size > 0:
            teacher = F.pad(teacher, (0, diff_size), value=0)
        elif diff_size < 0:
            student = F.pad(student, (0, abs(diff_size)), value=0)
        crossentropy_loss = self.crossentropy_weight * student_predictions.loss
        distillation_loss = torch.zeros(student.size(0), device=student.device)
        for i in range(student.size(0)):
            size = min(student_answer_size[i], teacher_answer_size[i])
            distillation_loss[i] = abs(student[i][:size] - teacher[i][:size]).sum(-1).mean(-1)
        distillation_loss = distillation_loss.mean()
        distillation_loss = self.distillation_weight * (distillation_loss)
        return crossentropy_loss + distillation_loss, crossentropy_loss, distillation_loss

    def _get_start_and_size_answers(self, answer_tensors):
        answers_index = []
        answers_size = []
        for answer in answer_tensors:
            is_value = answer.eq(self.ignore_index)
            answers_size.append(len(answer) - int(is_value.sum()))
            indices = is_value.nonzero(as_tuple=True)[0]
            if len(indices) == 0 or indices[0] != 0:
                answers_index.append(0)
            else:
                diff_indices = indices[1:] - indices[:-1]
                break_index = (diff_indices != 1).nonzero()
                length = (break_index[0].item() + 1) if len(break_index) > 0 else len(indices)
                answers_index.append(length - 1)
        return answers_index, answers_size


def _hf_labels(ids: torch.Tensor, prompts: list[int], ends: list[int]) -> torch.Tensor:
    """Hugging Face's unshifted labels, as the authors' code takes them: the prompt and the padding -100."""
    labels = ids.clone()
    for b, (p, e) in enumerate(zip(prompts, ends)):
        labels[b, :p] = -100
        labels[b, e:] = -100
    return labels


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """kdbench's next-token targets: the label at a position is the token its logits predict."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def _case(vs: int, vt: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    s_len, t_len = 9, 14  # the student's tokenizer makes fewer, longer tokens of the same text
    s_ids = torch.randint(0, vs, (3, s_len), generator=g)
    t_ids = torch.randint(0, vt, (3, t_len), generator=g)
    s_labels = _hf_labels(s_ids, prompts=[2, 3, 1], ends=[9, 7, 9])
    t_labels = _hf_labels(t_ids, prompts=[4, 5, 2], ends=[14, 11, 8])
    s_logits = (torch.randn(3, s_len, vs, generator=g, dtype=torch.float64) * 3).requires_grad_()
    t_logits = torch.randn(3, t_len, vt, generator=g, dtype=torch.float64) * 3
    return s_logits, t_logits, s_labels, t_labels


@pytest.mark.parametrize(("vs", "vt"), [(50, 80), (80, 50), (64, 64)])
@pytest.mark.parametrize("temps", [(1.0, 1.0), (2.0, 0.5)])
def test_uld_equals_the_authors_code_in_value_and_gradient(vs, vt, temps):
    s_logits, t_logits, s_labels, t_labels = _case(vs, vt)
    ce = F.cross_entropy(s_logits[:, :-1].reshape(-1, vs), s_labels[:, 1:].reshape(-1), ignore_index=-100)
    authors = AuthorsDistillationLoss(1.0, 1.5, *temps)
    total, _ce_part, distil = authors(
        SimpleNamespace(logits=s_logits * 1, loss=ce), SimpleNamespace(logits=t_logits.clone()), s_labels, t_labels
    )
    (ref_grad,) = torch.autograd.grad(distil, s_logits, retain_graph=True)

    ours = uld_loss(s_logits, t_logits, _shifted(s_labels), _shifted(t_labels), *temps)
    (grad,) = torch.autograd.grad(ours, s_logits)
    assert ours.dtype == torch.float64  # float64 in, float64 work (the ledger's reference)
    # the authors collect each sequence's term in a float32 buffer (torch.zeros' default): float32 tolerances
    torch.testing.assert_close(1.5 * ours, distil.double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(1.5 * grad, ref_grad, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(ce + 1.5 * ours, total.double(), rtol=1e-6, atol=1e-7)
    assert distil.item() > 0.05  # a real distance, not two equal vectors


def authors_in_float64(s_logits, t_logits, s_labels, t_labels, temps):
    """The authors' ULD term run with float64 as torch's default dtype: their per-sequence buffer (torch.zeros'
    default dtype, float32 as they run it) float64 too, so that every step is float64."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _, _, distil = AuthorsDistillationLoss(1.0, 1.0, *temps)(
            SimpleNamespace(logits=s_logits * 1, loss=torch.zeros((), dtype=torch.float64)),
            SimpleNamespace(logits=t_logits.clone()),
            s_labels,
            t_labels,
        )
    finally:
        torch.set_default_dtype(before)
    assert distil.dtype == torch.float64
    return distil


@pytest.mark.parametrize(("vs", "vt"), [(50, 80), (80, 50), (64, 64)])
@pytest.mark.parametrize("temps", [(1.0, 1.0), (2.0, 0.5)])
@pytest.mark.parametrize("seed", [0, 1])
def test_uld_in_float64_is_the_authors_loss_in_float64_within_1e_12(vs, vt, temps, seed):
    # issue 45: the alignment's float32 row weights left a float64 ULD 5e-8 from it (the ledger's reference)
    s_logits, t_logits, s_labels, t_labels = _case(vs, vt, seed)
    distil = authors_in_float64(s_logits, t_logits, s_labels, t_labels, temps)
    (ref_grad,) = torch.autograd.grad(distil, s_logits)
    ours = uld_loss(s_logits, t_logits, _shifted(s_labels), _shifted(t_labels), *temps)
    (grad,) = torch.autograd.grad(ours, s_logits)
    assert abs(ours.item() - distil.item()) < 1e-12 and distil.item() > 0.05
    assert (grad - ref_grad).abs().max().item() < 1e-12 and ref_grad.abs().max() > 1e-3


def test_the_ledgers_float64_reference_of_uld_is_the_authors_loss_in_float64_within_1e_12():
    # the accuracy ledger's reference (kdbench.distill.lm.loss, _uld_ledger): dense on the heads upcast to float64,
    # with the alignment the cell's own loss takes (float64 weights, which a float32 loss casts to what it had)
    g = torch.Generator().manual_seed(3)
    vs, vt, h = 50, 80, 16
    _, _, s_labels, t_labels = _case(vs, vt)
    hs, ht, ws, wt = (
        torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((3, 9, h), (3, 14, h), (vs, h), (vt, h))
    )
    align = uld_alignment(_shifted(s_labels), _shifted(t_labels))
    counts = torch.tensor([7] * 7 + [4] * 4 + [6] * 6)  # aligned positions of each row's sequence, of 3
    assert align.weight.dtype == torch.float64 and align.weight.tolist() == [1 / (3 * n) for n in counts.tolist()]
    assert torch.equal(align.weight.float(), 1.0 / (counts.float() * 3))  # a float32 loss's weights as they were
    term = uld_lm_loss("dense", hs, ws, None, ht, wt, None, align, 2.0, 0.5)
    assert term.dtype == torch.float64
    want = authors_in_float64(hs @ ws.T, ht @ wt.T, s_labels, t_labels, (2.0, 0.5))
    assert abs(term.item() - want.item()) < 1e-12


def test_alignment_pairs_the_ith_answer_tokens_per_sequence():
    s_labels = torch.tensor([[-100, 5, 6, 7, -100], [-100, -100, -100, 1, 2]])
    t_labels = torch.tensor([[-100, -100, 8, 9, -100, -100], [3, 4, 5, 6, 7, -100]])
    align = uld_alignment(s_labels, t_labels)
    # sequence 0: 3 student answer tokens, 2 teacher ones: 2 pairs; sequence 1: 2 and 5: 2 pairs
    assert align.student.tolist() == [1, 2, 5 + 3, 5 + 4]
    assert align.teacher.tolist() == [2, 3, 6 + 0, 6 + 1]
    assert align.sequence.tolist() == [0, 0, 1, 1]
    torch.testing.assert_close(align.weight, torch.full((4,), 0.25, dtype=torch.float64))


def test_a_sequence_without_answer_tokens_is_left_out_not_nan():
    s_labels = torch.tensor([[-100, 5, 6], [-100, -100, -100]])
    t_labels = torch.tensor([[-100, 1, 2, 3], [-100, 4, 5, 6]])
    s = torch.randn(2, 3, 7, requires_grad=True)
    t = torch.randn(2, 4, 11)
    loss = uld_loss(s, t, s_labels, t_labels)
    align = uld_alignment(s_labels, t_labels)
    expected = uld_rows(s.reshape(-1, 7)[[1, 2]], t.reshape(-1, 11)[[1, 2]]).mean()
    torch.testing.assert_close(loss, expected)
    none = uld_loss(s, t, torch.full_like(s_labels, -100), t_labels)
    assert none.item() == 0.0 and none.requires_grad and len(align) == 2


def test_equal_distributions_under_a_permutation_are_at_distance_zero():
    """ULD sees only the sorted probabilities: a teacher whose vocabulary is the student's permuted, with the
    same values, is at distance 0; padding adds the longer vector's tail mass."""
    s = torch.randn(4, 10, dtype=torch.float64)
    perm = torch.randperm(10)
    assert uld_rows(s, s[:, perm]).abs().max().item() < 1e-12
    wider = torch.cat([s, torch.full((4, 3), -1e9, dtype=torch.float64)], dim=1)  # three entries of ~0 mass
    assert uld_rows(s, wider).abs().max().item() < 1e-12
    p = torch.softmax(s, -1).sort(-1, descending=True).values
    short = s[:, :6]  # a teacher with 6 entries only
    q = torch.softmax(short, -1).sort(-1, descending=True).values
    expected = (p[:, :6] - q).abs().sum(-1) + p[:, 6:].sum(-1)
    torch.testing.assert_close(uld_rows(s, short), expected)


def test_float32_work_for_bf16_inputs():
    s = torch.randn(5, 33).to(torch.bfloat16).requires_grad_()
    t = torch.randn(5, 40).to(torch.bfloat16)
    out = uld_rows(s, t)
    assert out.dtype == torch.float32
    ref = uld_rows(s.detach().double(), t.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


def test_the_uld_method_is_alpha_times_the_term_and_keeps_the_authors_ratio():
    from kdbench.distill.losses import METHODS, LossInputs

    method = METHODS["uld"]
    params = method.params()
    term = method.cls(params)
    assert (params.alpha, params.temperature, term.ce_weight) == (0.6, 1.0, pytest.approx(0.4))
    assert params.alpha / term.ce_weight == pytest.approx(1.5)  # the authors' CE 1 : ULD 1.5
    s_logits, t_logits, s_labels, t_labels = _case(40, 70, seed=3)
    s_t, t_t = _shifted(s_labels), _shifted(t_labels)
    value = term(LossInputs(s_logits, t_logits, s_t, teacher_targets=t_t))
    torch.testing.assert_close(value, 0.6 * uld_loss(s_logits, t_logits, s_t, t_t))
