"""kdbench.distill.lm.token_losses against the authors' code, transcribed below (trimmed).

References, read at:
  * huggingface/trl f2cd57710ae345ea6428ae95363267fcf38a3dc8 (v1.9.0-26), file
    trl/experimental/gkd/gkd_trainer.py (last changed in 707a7172e), GKDTrainer.generalized_jsd_loss
    (the beta convention of PR #3043, TRL >= 0.16; the file moved from trl/trainer/gkd_trainer.py).
  * jongwooko/distillm d47e77ff9d27721783b32213be38c1204230cc0a, file distillm/losses.py
    (last changed in 17c0f98bc263b1861a02d5df578c84aea652ee65).
  * pytorch/torchtune bd2a0fc7c31430972728494fa01aaeeb0ebf1ba1, file
    torchtune/modules/loss/kd_losses.py (last changed in 0a08c2f5f), ForwardKLLoss.forward.

Conversions to kdbench's convention (sum over the vocabulary, mean over valid tokens, × T²):
  * DistiLLM and torchtune have no temperature: they are fed logits / T and multiplied by T².
  * TRL divides by T itself but does not scale: multiplied by T².
  * TRL with labels=None ("batchmean") divides by the batch size B, not by the B·S tokens:
    divided by S.  With labels it divides by the valid tokens, as kdbench does.
  * DistiLLM's skewed_forward_kl is the cross-entropy form −Σ p_T log m: kdbench's true KL is
    that minus H(p_T) (the teacher entropy, which adds nothing to the student gradient).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kdbench.core.errors import KdbenchError
from kdbench.distill.lm.token_losses import (
    forward_kl,
    forward_kl_ce_form,
    generalized_jsd,
    log_mixture,
    reverse_kl,
    skew_forward_kl,
    skew_reverse_kl,
    total_variation,
)
from kdbench.fit.tracker import LiveBytes
from kdbench.measure.memory import live_tensor_bytes, live_tensor_peak

# ---------------------------------------------------------------------------------------------
# huggingface/trl @ f2cd57710ae345ea6428ae95363267fcf38a3dc8, trl/experimental/gkd/gkd_trainer.py,
# GKDTrainer.generalized_jsd_loss (staticmethod), trimmed to reduction="batchmean" and
# num_items_in_batch=None.


def trl_generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0):
    student_logits = student_logits / temperature
    teacher_logits = teacher_logits / temperature
    student_log_probs = F.log_softmax(student_logits, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        beta = torch.tensor(beta, dtype=student_log_probs.dtype, device=student_log_probs.device)
        mixture_log_probs = torch.logsumexp(
            torch.stack([student_log_probs + torch.log1p(-beta), teacher_log_probs + torch.log(beta)]),
            dim=0,
        )
        kl_teacher = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture_log_probs, student_log_probs, reduction="none", log_target=True)
        jsd = beta * kl_teacher + (1 - beta) * kl_student
    if labels is not None:
        mask = labels != -100
        jsd = jsd[mask]
    denom = mask.sum().clamp_min(1) if labels is not None else max(jsd.size(0), 1)
    return jsd.sum() / denom


# ---------------------------------------------------------------------------------------------
# jongwooko/distillm @ d47e77ff9d27721783b32213be38c1204230cc0a, distillm/losses.py (verbatim but
# for the no_model_batch dict, passed here as `labels`).


def distillm_forward_kl(logits, teacher_logits, labels):
    teacher_probs = F.softmax(teacher_logits, dim=-1, dtype=torch.float32)
    inf_mask = torch.isinf(logits)
    student_logprobs = F.log_softmax(logits, dim=-1, dtype=torch.float32)
    prod_probs = torch.masked_fill(teacher_probs * student_logprobs, inf_mask, 0)
    x = torch.sum(prod_probs, dim=-1).view(-1)
    mask = (labels != -100).int()
    return -torch.sum(x * mask.view(-1), dim=0) / torch.sum(mask.view(-1), dim=0)


def distillm_reverse_kl(logits, teacher_logits, labels):
    student_probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    student_logprobs = F.log_softmax(logits, dim=-1, dtype=torch.float32)
    teacher_logprobs = F.log_softmax(teacher_logits, dim=-1, dtype=torch.float32)
    inf_mask = torch.isinf(teacher_logits) | torch.isinf(logits)
    prod_probs = torch.masked_fill(student_probs * teacher_logprobs, inf_mask, 0)
    prod_probs -= torch.masked_fill(student_probs * student_logprobs, inf_mask, 0)
    x = torch.sum(prod_probs, dim=-1).view(-1)
    mask = (labels != -100).int()
    return -torch.sum(x * mask.view(-1), dim=0) / torch.sum(mask.view(-1), dim=0)


def distillm_tv_distance(logits, teacher_logits, labels):
    teacher_probs = F.softmax(teacher_logits, dim=-1, dtype=torch.float32)
    student_probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    mask = (labels != -100).int()
    inf_mask = torch.isinf(logits) | torch.isinf(teacher_logits)
    prod_probs = 0.5 * torch.masked_fill(torch.abs(teacher_probs - student_probs), inf_mask, 0)
    x = torch.sum(prod_probs, dim=-1).view(-1)
    return torch.sum(x * mask.view(-1), dim=0) / torch.sum(mask.view(-1), dim=0)


def distillm_skewed_forward_kl(logits, teacher_logits, labels, lam=0.1):
    teacher_probs = F.softmax(teacher_logits, dim=-1, dtype=torch.float32)
    student_probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    mixed_probs = lam * teacher_probs + (1 - lam) * student_probs
    mixed_logprobs = torch.log(mixed_probs)
    mask = (labels != -100).int()
    inf_mask = torch.isinf(logits) | torch.isinf(teacher_logits)
    prod_probs = torch.masked_fill(teacher_probs * mixed_logprobs, inf_mask, 0)
    x = torch.sum(prod_probs, dim=-1).view(-1)
    return -torch.sum(x * mask.view(-1), dim=0) / torch.sum(mask.view(-1), dim=0)


def distillm_skewed_reverse_kl(logits, teacher_logits, labels, lam=0.1):
    teacher_probs = F.softmax(teacher_logits, dim=-1, dtype=torch.float32)
    student_probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    mixed_probs = (1 - lam) * teacher_probs + lam * student_probs
    student_logprobs = F.log_softmax(logits, dim=-1, dtype=torch.float32)
    mixed_logprobs = torch.log(mixed_probs)
    mask = (labels != -100).int()
    inf_mask = torch.isinf(logits) | torch.isinf(teacher_logits)
    prod_probs = torch.masked_fill(student_probs * mixed_logprobs, inf_mask, 0)
    prod_probs -= torch.masked_fill(student_probs * student_logprobs, inf_mask, 0)
    x = torch.sum(prod_probs, dim=-1).view(-1)
    return -torch.sum(x * mask.view(-1), dim=0) / torch.sum(mask.view(-1), dim=0)


# ---------------------------------------------------------------------------------------------
# pytorch/torchtune @ bd2a0fc7c31430972728494fa01aaeeb0ebf1ba1, torchtune/modules/loss/kd_losses.py,
# ForwardKLLoss.forward with ignore_index=-100, normalize=True.


def torchtune_forward_kl_loss(student_logits, teacher_logits, labels, ignore_index=-100):
    teacher_prob = F.softmax(teacher_logits, dim=-1, dtype=torch.float32)
    inf_mask = torch.isinf(student_logits)
    student_logprob = F.log_softmax(student_logits, dim=-1, dtype=torch.float32)
    prod_probs = torch.masked_fill(teacher_prob * student_logprob, inf_mask, 0)
    x = torch.sum(prod_probs, dim=-1).view(-1)
    mask = (labels != ignore_index).int()
    sum_masks = torch.sum(mask.view(-1), dim=0)
    if sum_masks == 0:
        return torch.tensor(0.0, device=x.device)
    return -torch.sum(x * mask.view(-1), dim=0) / torch.sum(mask.view(-1), dim=0)


# ---------------------------------------------------------------------------------------------

B, S, V = 2, 5, 11
TEMPS = [1.0, 2.0]


def close(a, b, rtol=1e-5, atol=1e-7):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(23)
    student = 2.0 * torch.randn(B, S, V, generator=g)
    teacher = 2.0 * torch.randn(B, S, V, generator=g)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, :2] = False  # a prompt
    mask[1, 3:] = False  # padding
    labels = torch.where(mask, torch.zeros(B, S, dtype=torch.long), torch.full((B, S), -100))
    return student, teacher, mask, labels


def no_temp(ref, T, **kw):
    """A temperature-less reference fed logits / T and scaled by T² (kdbench's convention)."""
    return lambda s, t, labels: ref(s / T, t / T, labels, **kw) * T**2


def teacher_entropy(teacher, mask, T):
    """Mean over valid tokens of H(softmax(teacher / T)), × T²."""
    log_pt = F.log_softmax(teacher[mask] / T, dim=-1)
    return -(log_pt.exp() * log_pt).sum(-1).mean() * T**2


def grads(fn, student, teacher, *args):
    s = student.clone().requires_grad_(True)
    fn(s, teacher, *args).backward()
    return s.grad


# ---- values against the references -----------------------------------------------------------


@pytest.mark.parametrize("T", TEMPS)
def test_forward_kl_ce_form_is_torchtune_and_distillm(batch, T):
    s, t, mask, labels = batch
    ours = forward_kl_ce_form(s, t, mask, temperature=T)
    close(ours, no_temp(torchtune_forward_kl_loss, T)(s, t, labels))
    close(ours, no_temp(distillm_forward_kl, T)(s, t, labels))


@pytest.mark.parametrize("T", TEMPS)
def test_forward_kl_is_ce_form_minus_teacher_entropy(batch, T):
    s, t, mask, labels = batch
    ours = forward_kl(s, t, mask, temperature=T)
    close(ours, no_temp(torchtune_forward_kl_loss, T)(s, t, labels) - teacher_entropy(t, mask, T))
    close(ours, trl_generalized_jsd_loss(s, t, labels, beta=0.0, temperature=T) * T**2)


@pytest.mark.parametrize("T", TEMPS)
def test_reverse_kl_is_distillm_and_trl_beta1(batch, T):
    s, t, mask, labels = batch
    ours = reverse_kl(s, t, mask, temperature=T)
    close(ours, no_temp(distillm_reverse_kl, T)(s, t, labels))
    close(ours, trl_generalized_jsd_loss(s, t, labels, beta=1.0, temperature=T) * T**2)


@pytest.mark.parametrize("T", TEMPS)
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_generalized_jsd_is_trl(batch, beta, T):
    s, t, mask, labels = batch
    ref = trl_generalized_jsd_loss(s, t, labels, beta=beta, temperature=T) * T**2
    close(generalized_jsd(s, t, mask, beta=beta, temperature=T), ref)
    # labels=None: TRL's batchmean divides the (B, S, V) sum by B; kdbench by the B·S tokens
    ref_all = trl_generalized_jsd_loss(s, t, None, beta=beta, temperature=T) * T**2 / S
    close(generalized_jsd(s, t, None, beta=beta, temperature=T), ref_all)


@pytest.mark.parametrize("T", TEMPS)
def test_generalized_jsd_ends_are_forward_and_reverse_kl(batch, T):
    s, t, mask, _ = batch
    close(generalized_jsd(s, t, mask, beta=0.0, temperature=T), forward_kl(s, t, mask, temperature=T))
    close(generalized_jsd(s, t, mask, beta=1.0, temperature=T), reverse_kl(s, t, mask, temperature=T))
    # The general formula is not continuous there (it tends to 0 at both ends); TRL's beta = 0 and 1
    # branches are a convention.  Divided by beta (by 1 - beta) it does tend to the forward (reverse) KL.
    eps = 1e-4  # the approach is O(beta); float32 rounding limits how small beta can go
    near0 = generalized_jsd(s, t, mask, beta=eps, temperature=T)
    near1 = generalized_jsd(s, t, mask, beta=1 - eps, temperature=T)
    assert near0 < 1e-2 * forward_kl(s, t, mask, temperature=T)
    close(near0 / eps, forward_kl(s, t, mask, temperature=T), rtol=2e-2, atol=0)
    close(near1 / eps, reverse_kl(s, t, mask, temperature=T), rtol=2e-2, atol=0)


@pytest.mark.parametrize("T", TEMPS)
def test_total_variation_is_distillm(batch, T):
    s, t, mask, labels = batch
    close(total_variation(s, t, mask, temperature=T), no_temp(distillm_tv_distance, T)(s, t, labels))


@pytest.mark.parametrize("T", TEMPS)
@pytest.mark.parametrize("lam", [0.1, 0.5])
def test_skew_kls_are_distillm(batch, lam, T):
    s, t, mask, labels = batch
    ref_skl = no_temp(distillm_skewed_forward_kl, T, lam=lam)(s, t, labels) - teacher_entropy(t, mask, T)
    close(skew_forward_kl(s, t, mask, lam=lam, temperature=T), ref_skl)
    ref_srkl = no_temp(distillm_skewed_reverse_kl, T, lam=lam)(s, t, labels)
    close(skew_reverse_kl(s, t, mask, lam=lam, temperature=T), ref_srkl)


def test_skew_kl_ends(batch):
    s, t, mask, _ = batch
    close(skew_forward_kl(s, t, mask, lam=0.0), forward_kl(s, t, mask))
    close(skew_reverse_kl(s, t, mask, lam=0.0), reverse_kl(s, t, mask))
    assert skew_forward_kl(s, t, mask, lam=1.0).abs() < 1e-6
    assert skew_reverse_kl(s, t, mask, lam=1.0).abs() < 1e-6


# ---- properties -------------------------------------------------------------------------------

DIVERGENCES = {
    "forward_kl": forward_kl,
    "reverse_kl": reverse_kl,
    "gjsd_0.5": lambda s, t, m, temperature: generalized_jsd(s, t, m, beta=0.5, temperature=temperature),
    "gjsd_0.1": lambda s, t, m, temperature: generalized_jsd(s, t, m, beta=0.1, temperature=temperature),
    "total_variation": total_variation,
    "skew_forward_kl": skew_forward_kl,
    "skew_reverse_kl": skew_reverse_kl,
}


@pytest.mark.parametrize("T", TEMPS)
@pytest.mark.parametrize("name", DIVERGENCES)
def test_nonnegative_and_zero_at_equality(batch, name, T):
    s, t, mask, _ = batch
    fn = DIVERGENCES[name]
    assert fn(s, t, mask, temperature=T) > 0
    assert fn(s, t, None, temperature=T) > 0
    assert fn(t, t, mask, temperature=T).abs() < 1e-6
    # the CE form is not a divergence: it equals the teacher entropy at equality
    close(forward_kl_ce_form(t, t, mask, temperature=T), teacher_entropy(t, mask, T), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", TEMPS)
def test_gradients_match_references(batch, T):
    s, t, mask, labels = batch
    pairs = [
        (lambda x, y: forward_kl(x, y, mask, temperature=T), no_temp(torchtune_forward_kl_loss, T)),
        (lambda x, y: forward_kl_ce_form(x, y, mask, temperature=T), no_temp(distillm_forward_kl, T)),
        (lambda x, y: reverse_kl(x, y, mask, temperature=T), no_temp(distillm_reverse_kl, T)),
        (lambda x, y: total_variation(x, y, mask, temperature=T), no_temp(distillm_tv_distance, T)),
        (
            lambda x, y: generalized_jsd(x, y, mask, beta=0.5, temperature=T),
            lambda x, y, lab: trl_generalized_jsd_loss(x, y, lab, beta=0.5, temperature=T) * T**2,
        ),
        (
            lambda x, y: skew_forward_kl(x, y, mask, lam=0.1, temperature=T),
            no_temp(distillm_skewed_forward_kl, T, lam=0.1),
        ),
        (
            lambda x, y: skew_reverse_kl(x, y, mask, lam=0.1, temperature=T),
            no_temp(distillm_skewed_reverse_kl, T, lam=0.1),
        ),
    ]
    for ours, ref in pairs:
        g_ours = grads(ours, s, t)
        g_ref = grads(ref, s, t, labels)
        close(g_ours, g_ref, rtol=1e-5, atol=1e-7)
        assert g_ours[~mask].abs().max() == 0  # masked tokens get no gradient
        assert g_ours[mask].abs().max() > 0


@pytest.mark.parametrize("name", [*DIVERGENCES, "ce_form"])
def test_bf16_inputs_give_the_fp32_value(batch, name):
    s, t, mask, _ = batch
    fn = DIVERGENCES.get(name, forward_kl_ce_form)
    s16, t16 = s.bfloat16(), t.bfloat16()
    out = fn(s16, t16, mask, temperature=2.0)
    assert out.dtype == torch.float32
    close(out, fn(s16.float(), t16.float(), mask, temperature=2.0), rtol=1e-6, atol=0)
    s16.requires_grad_(True)
    fn(s16, t16, mask, temperature=2.0).backward()
    assert s16.grad.dtype == torch.bfloat16 and torch.isfinite(s16.grad).all()


@pytest.mark.parametrize("name", [*DIVERGENCES, "ce_form"])
def test_fully_masked_batch_is_zero(batch, name):
    s, t, _, _ = batch
    fn = DIVERGENCES.get(name, forward_kl_ce_form)
    x = s.clone().requires_grad_(True)
    out = fn(x, t, torch.zeros(B, S, dtype=torch.bool), temperature=2.0)
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("name", [*DIVERGENCES, "ce_form"])
def test_flat_tokens_and_masking_equal_selection(batch, name):
    s, t, mask, _ = batch
    fn = DIVERGENCES.get(name, forward_kl_ce_form)
    ours = fn(s, t, mask, temperature=2.0)
    close(fn(s.reshape(-1, V), t.reshape(-1, V), mask.reshape(-1), temperature=2.0), ours)
    close(fn(s[mask], t[mask], None, temperature=2.0), ours)  # (N, V) of the valid tokens only
    # what sits at masked positions (even NaN) does not matter
    s_bad = s.masked_fill(~mask[..., None], float("nan"))
    close(fn(s_bad, t, mask, temperature=2.0), ours)


@pytest.mark.parametrize("name", [*DIVERGENCES, "ce_form"])
def test_padded_vocabulary_is_left_out(batch, name):
    """-inf logits in both models (padded vocabulary rows) drop out: the value on the real vocabulary,
    finite gradients."""
    s, t, mask, _ = batch
    fn = DIVERGENCES.get(name, forward_kl_ce_form)
    pad = torch.full((B, S, 3), float("-inf"))
    x = torch.cat([s, pad], dim=-1).requires_grad_(True)
    out = fn(x, torch.cat([t, pad], dim=-1), mask, temperature=2.0)
    close(out, fn(s, t, mask, temperature=2.0))
    out.backward()
    assert torch.isfinite(x.grad).all()
    close(x.grad[..., :V], grads(lambda a, b: fn(a, b, mask, temperature=2.0), s, t))


def test_inf_student_logit_is_dropped_like_distillm(batch):
    s, t, mask, labels = batch
    s = s.clone()
    s[1, 0, 4] = float("-inf")  # the teacher has mass there: DistiLLM drops the entry (no inf)
    close(reverse_kl(s, t, mask), distillm_reverse_kl(s, t, labels))
    close(forward_kl_ce_form(s, t, mask), distillm_forward_kl(s, t, labels))
    close(skew_reverse_kl(s, t, mask), distillm_skewed_reverse_kl(s, t, labels))


def test_bad_arguments(batch):
    s, t, mask, _ = batch
    with pytest.raises(KdbenchError, match="shape"):
        forward_kl(s, t[..., :-1])
    with pytest.raises(KdbenchError, match="mask"):
        forward_kl(s, t, mask[:, :-1])
    with pytest.raises(KdbenchError, match="temperature"):
        reverse_kl(s, t, mask, temperature=0.0)
    with pytest.raises(KdbenchError, match="beta"):
        generalized_jsd(s, t, mask, beta=1.5)
    with pytest.raises(KdbenchError, match="lam"):
        skew_forward_kl(s, t, mask, lam=-0.1)


# ---- the mixture's log (issue 45) -------------------------------------------------------------


def trl_log_mixture(log_a, log_b, w):
    """TRL's form of log(w·a + (1 − w)·b): logsumexp over the stack of the two weighted logs."""
    return torch.logsumexp(torch.stack([log_a + math.log(w), log_b + math.log1p(-w)]), dim=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("w", [0.1, 0.5, 0.9])
def test_log_mixture_is_trls_logsumexp_bit_for_bit_in_value_and_gradient(dtype, w):
    g = torch.Generator().manual_seed(5)
    log_a = (3.0 * torch.randn(16, 257, generator=g, dtype=dtype)).log_softmax(-1)
    log_b = torch.randn(16, 257, generator=g, dtype=dtype).log_softmax(-1)
    log_a[0, :3] = -math.inf  # both -inf at 1 and 2, one at 0 and 3
    log_b[0, 1:4] = -math.inf
    log_a[1, 0], log_b[1, 1] = math.inf, math.nan
    upstream = torch.rand(16, 257, generator=g, dtype=dtype)
    outs, grads = [], []
    for fn in (log_mixture, trl_log_mixture):
        a, b = log_a.clone().requires_grad_(), log_b.clone().requires_grad_()
        out = fn(a, b, w)
        (out * upstream).nansum().backward()
        outs.append(out.detach())
        grads.append((a.grad, b.grad))
    assert torch.equal(outs[0].isnan(), outs[1].isnan()) and outs[0][0, 1] == -math.inf
    assert torch.equal(outs[0].nan_to_num(nan=7.0), outs[1].nan_to_num(nan=7.0))
    for ours, trl in zip(grads[0], grads[1], strict=True):
        assert torch.equal(ours.isnan(), trl.isnan()) and ours.nan_to_num(nan=7.0).abs().sum() > 0
        assert torch.equal(ours.nan_to_num(nan=7.0), trl.nan_to_num(nan=7.0))


def test_log_mixture_allocates_no_buffer_that_the_fit_planners_meter_misses():
    # TRL's stack form allocates, inside logsumexp's kernel, 3 buffers of a chunk's size no dispatch mode sees;
    # the planner's meter (kdbench.fit.tracker) must see every byte the CPU's allocator hands out here
    log_a = torch.randn(64, 1000).log_softmax(-1)
    log_b = torch.randn(64, 1000).log_softmax(-1)
    with LiveBytes() as meter:
        start = meter.live
        meter.reset_peak()
        log_mixture(log_a, log_b, 0.3)
    seen = meter.peak.bytes - start
    before = live_tensor_bytes("cpu")
    allocated = live_tensor_peak(lambda: log_mixture(log_a, log_b, 0.3)) - before
    assert seen == 3 * log_a.nbytes  # the two weighted logs and the result
    assert 0 <= allocated - seen < 64  # a few bytes of scalars the kernels wrap (TRL's form: 2 buffers more)
