"""RKD and DIST: each loss against the reference implementation written out again, and in the step.

The references below follow mdistiller's ``RKD.py`` (``_pdist``, ``rkd_loss``) and the DIST
authors' ``dist_kd.py`` (hunto/image_classification_sota) line by line, boolean indexing and
all; they are not the module's code.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from kdbench.distill.losses import METHODS, DistillLoss, LossInputs
from kdbench.distill.losses.dist import dist_parts
from kdbench.distill.losses.rkd import rkd_parts
from kdbench.hw.backends import resolve
from tests.support.helpers import make_config, make_step

CPU = resolve("cpu")

try:
    from kdbench.measure.syncs import optimizer_host_tensors, sync_calls
except ImportError:  # pragma: no cover - the counter is part of kdbench; kept optional for this file
    sync_calls = None


pytestmark = pytest.mark.usefixtures("seeded")  # tests/conftest.py


# --- references -------------------------------------------------------------------


def _ref_pdist(e, squared, eps):  # mdistiller's _pdist
    e_square = e.pow(2).sum(dim=1)
    prod = e @ e.t()
    res = (e_square.unsqueeze(1) + e_square.unsqueeze(0) - 2 * prod).clamp(min=eps)
    if not squared:
        res = res.sqrt()
    res = res.clone()
    res[range(len(e)), range(len(e))] = 0
    return res


def _ref_rkd(f_s, f_t, squared=False, eps=1e-12, distance_weight=25.0, angle_weight=50.0):  # mdistiller's rkd_loss
    stu = f_s.view(f_s.shape[0], -1)
    tea = f_t.view(f_t.shape[0], -1)
    with torch.no_grad():
        t_d = _ref_pdist(tea, squared, eps)
        t_d = t_d / t_d[t_d > 0].mean()
    d = _ref_pdist(stu, squared, eps)
    d = d / d[d > 0].mean()
    loss_d = F.smooth_l1_loss(d, t_d)
    with torch.no_grad():
        td = tea.unsqueeze(0) - tea.unsqueeze(1)
        norm_td = F.normalize(td, p=2, dim=2)
        t_angle = torch.bmm(norm_td, norm_td.transpose(1, 2)).view(-1)
    sd = stu.unsqueeze(0) - stu.unsqueeze(1)
    norm_sd = F.normalize(sd, p=2, dim=2)
    s_angle = torch.bmm(norm_sd, norm_sd.transpose(1, 2)).view(-1)
    loss_a = F.smooth_l1_loss(s_angle, t_angle)
    return distance_weight * loss_d + angle_weight * loss_a, loss_d, loss_a


def _ref_cos(a, b, eps=1e-8):
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1) + eps)


def _ref_pearson(a, b, eps=1e-8):
    return _ref_cos(a - a.mean(1).unsqueeze(1), b - b.mean(1).unsqueeze(1), eps)


def _ref_dist(z_s, z_t, beta=1.0, gamma=1.0, tau=1.0):  # the authors' DIST.forward
    y_s = (z_s / tau).softmax(dim=1)
    y_t = (z_t / tau).softmax(dim=1)
    inter = tau**2 * (1 - _ref_pearson(y_s, y_t).mean())
    intra = tau**2 * (1 - _ref_pearson(y_s.transpose(0, 1), y_t.transpose(0, 1)).mean())
    return beta * inter + gamma * intra, inter, intra


def _hand_rkd_distance(s, t):
    """L_D written out with plain loops: Euclidean distances, mean over i != j, Huber(beta=1) mean."""
    n = len(s)

    def dists(e):
        d = [[math.dist(e[i], e[j]) if i != j else 0.0 for j in range(n)] for i in range(n)]
        mean = sum(d[i][j] for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
        return [[v / mean for v in row] for row in d]

    ds, dt = dists(s), dists(t)
    huber = [
        abs(a - b) - 0.5 if abs(a - b) >= 1 else 0.5 * (a - b) ** 2 for ra, rb in zip(ds, dt) for a, b in zip(ra, rb)
    ]
    return sum(huber) / len(huber)


# --- RKD ------------------------------------------------------------------------


def test_rkd_defaults_are_mdistillers():
    p = METHODS["rkd"].params()
    assert (p.distance_weight, p.angle_weight, p.squared, p.eps) == (25.0, 50.0, False, 1e-12)
    assert METHODS["rkd"].cls.needs_features and METHODS["rkd"].cls.ce_weight == 1.0


@pytest.mark.parametrize("squared", [False, True])
def test_rkd_matches_mdistillers_rkd_loss(squared):
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(6, 5, generator=g), torch.randn(6, 9, generator=g) * 3
    want, want_d, want_a = _ref_rkd(s, t, squared=squared)
    loss_d, loss_a = rkd_parts(s, t, squared=squared)
    torch.testing.assert_close(loss_d, want_d, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(loss_a, want_a, rtol=1e-5, atol=1e-7)
    config = make_config(method="rkd", rkd={"squared": squared})
    term = DistillLoss(config).terms[0]
    logits = torch.zeros(6, 10)
    got = term(LossInputs(logits, logits, torch.zeros(6, dtype=torch.long), [s], [t]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_rkd_distance_term_matches_a_hand_computation():
    g = torch.Generator().manual_seed(3)
    s, t = torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g) * 2
    loss_d, _ = rkd_parts(s, t)
    assert loss_d.item() == pytest.approx(_hand_rkd_distance(s.tolist(), t.tolist()), rel=1e-5)


def test_rkd_uses_the_pooled_last_stage_and_its_gradients_match_the_reference():
    g = torch.Generator().manual_seed(1)
    early = [torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 3, 8, 8, generator=g)]  # ignored
    fs = torch.randn(4, 8, 2, 2, generator=g, requires_grad=True)
    ft = torch.randn(4, 16, 2, 2, generator=g)
    term = DistillLoss(make_config(method="rkd")).terms[0]
    logits = torch.zeros(4, 10)
    got = term(LossInputs(logits, logits, torch.zeros(4, dtype=torch.long), [early[0], fs], [early[1], ft]))
    ref_in = fs.detach().clone().requires_grad_(True)
    want, _, _ = _ref_rkd(ref_in.mean(dim=(2, 3)), ft.mean(dim=(2, 3)))  # mdistiller's pooled_feat
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    got.backward()
    want.backward()
    torch.testing.assert_close(fs.grad, ref_in.grad, rtol=1e-4, atol=1e-7)


def test_rkd_pools_tokens_over_their_length():
    g = torch.Generator().manual_seed(2)
    fs, ft = torch.randn(5, 6, 7, generator=g), torch.randn(5, 4, generator=g)
    term = DistillLoss(make_config(method="rkd")).terms[0]
    logits = torch.zeros(5, 10)
    got = term(LossInputs(logits, logits, torch.zeros(5, dtype=torch.long), [fs], [ft]))
    torch.testing.assert_close(got, _ref_rkd(fs.mean(dim=2), ft)[0], rtol=1e-5, atol=1e-7)


def test_rkd_of_identical_or_scaled_embeddings_is_zero():
    e = torch.randn(6, 10)
    loss_d, loss_a = rkd_parts(e, e.clone())
    assert loss_d.item() == pytest.approx(0.0, abs=1e-10) and loss_a.item() == pytest.approx(0.0, abs=1e-10)
    loss_d, loss_a = rkd_parts(e * 5 + 1, e)  # distances normalised by their mean, angles scale-free
    assert loss_d.item() == pytest.approx(0.0, abs=1e-9) and loss_a.item() == pytest.approx(0.0, abs=1e-9)
    assert sum(rkd_parts(e, torch.randn(6, 10))).item() > 1e-3


# --- DIST -----------------------------------------------------------------------


def test_dist_defaults_are_the_authors_recipe():
    p = METHODS["dist"].params()
    assert (p.beta, p.gamma, p.tau) == (2.0, 2.0, 1.0)
    assert not METHODS["dist"].cls.needs_features and METHODS["dist"].cls.ce_weight == 1.0


@pytest.mark.parametrize("tau", [1.0, 4.0])
def test_dist_matches_the_authors_dist(tau):
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(8, 10, generator=g) * 2, torch.randn(8, 10, generator=g) * 4
    y = torch.randint(0, 10, (8,), generator=g)
    _, want_inter, want_intra = _ref_dist(s, t, 1.0, 1.0, tau)
    inter, intra = dist_parts(s, t, tau)
    torch.testing.assert_close(inter, want_inter, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(intra, want_intra, rtol=1e-5, atol=1e-7)
    # the cell's loss: CE + beta * inter + gamma * intra, defaults beta = gamma = 2
    loss = DistillLoss(make_config(method="dist", dist={"tau": tau}))(LossInputs(s, t, y))
    want_total = F.cross_entropy(s, y) + _ref_dist(s, t, 2.0, 2.0, tau)[0]
    torch.testing.assert_close(loss, want_total, rtol=1e-5, atol=1e-7)


def test_dist_of_identical_logits_is_zero_and_is_shift_invariant():
    # Fixed logits: a class whose probabilities barely vary across the batch has a Pearson correlation that
    # fp32 rounding (and the authors' 1e-8 in its denominator) moves by up to ~2e-4 over random draws.
    z = torch.randn(8, 10, generator=torch.Generator().manual_seed(0)) * 3
    inter, intra = dist_parts(z, z.clone(), 1.0)
    assert inter.item() == pytest.approx(0.0, abs=1e-5) and intra.item() == pytest.approx(0.0, abs=1e-5)
    inter, intra = dist_parts(z + 7.0, z, 1.0)  # softmax ignores a shift of every logit
    assert inter.item() == pytest.approx(0.0, abs=1e-3) and intra.item() == pytest.approx(0.0, abs=1e-3)
    assert sum(dist_parts(z, -z, 1.0)).item() > 0.5


def test_dist_in_half_precision_is_computed_in_fp32():
    g = torch.Generator().manual_seed(4)
    s, t = torch.randn(4, 10, generator=g), torch.randn(4, 10, generator=g)
    inter, intra = dist_parts(s.bfloat16(), t.bfloat16(), 1.0)
    assert inter.dtype == intra.dtype == torch.float32
    want = _ref_dist(s.bfloat16().float(), t.bfloat16().float())
    torch.testing.assert_close(inter, want[1], rtol=1e-5, atol=1e-7)


def test_kd_plus_dist_adds_the_terms_with_kds_ce_weight():
    g = torch.Generator().manual_seed(5)
    s, t = torch.randn(4, 10, generator=g), torch.randn(4, 10, generator=g)
    y = torch.tensor([0, 3, 9, 2])
    config = make_config(method="kd+dist", weights={"dist": 0.5})
    got = DistillLoss(config)(LossInputs(s, t, y))
    kl = F.kl_div(F.log_softmax(s / 4, 1), F.softmax(t / 4, 1), reduction="batchmean") * 16
    want = 0.1 * F.cross_entropy(s, y) + 0.9 * kl + 0.5 * _ref_dist(s, t, 2.0, 2.0, 1.0)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


# --- in the step ------------------------------------------------------------------


STEP_METHODS = ["rkd", "dist", "kd+dist", "rkd+dist"]


@pytest.mark.parametrize("mode", ["live", "cached"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("method", STEP_METHODS)
def test_each_method_steps_without_host_device_syncs(method, precision, mode):
    step = make_step(make_config(method=method, precision=precision, teacher={"mode": mode}))
    step()
    step()  # warm: the optimizer's state exists
    assert torch.isfinite(step.last_loss) and step.last_loss.dtype == torch.float32
    assert step.distiller.nonfinite_steps == 0
    assert all(p.grad is None for p in step.distiller.teacher.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in step.distiller.student.parameters())
    if sync_calls is None:
        pytest.skip("kdbench.measure.syncs is not importable: the sync check did not run")
    calls = sync_calls(step, CPU, exempt=optimizer_host_tensors(step.distiller.optimizer))
    assert calls == [], f"{method} {precision} {mode}: {calls}"


@pytest.mark.parametrize("method", ["rkd", "dist"])
def test_cached_and_live_teachers_give_the_same_loss(method):
    live = make_step(make_config(method=method, precision="fp32", teacher={"mode": "live"}))
    cached = make_step(make_config(method=method, precision="fp32", teacher={"mode": "cached"}))
    for _ in range(2):
        live()
        cached()
        torch.testing.assert_close(live.last_loss, cached.last_loss)


def test_the_reference_rkd_would_sync_and_the_module_does_not():
    if sync_calls is None:
        pytest.skip("kdbench.measure.syncs is not importable")
    s, t = torch.randn(4, 8), torch.randn(4, 8)
    assert "aten.index with a boolean mask" in sync_calls(lambda: _ref_rkd(s, t), CPU)
    assert sync_calls(lambda: rkd_parts(s, t), CPU) == []
    assert sync_calls(lambda: dist_parts(s, t, 4.0), CPU) == []
