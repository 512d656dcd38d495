"""CRD (Tian et al. 2020): the loss against a re-implementation of the reference code, the bank update,
and steps on a tiny CIFAR pair."""

import math

import pytest
import torch
from torch import nn

from kdbench.core.errors import KdbenchError
from kdbench.distill.losses import LossInputs
from kdbench.distill.losses.crd import CRD, CRDParams, contrast_idx_for, crd_loss, init_bank, momentum_update
from kdbench.distill.losses.kd import kd_kl
from kdbench.hw.backends import resolve
from tests.support.helpers import make_config, make_step

CPU = resolve("cpu")


pytestmark = pytest.mark.usefixtures("seeded")  # tests/conftest.py


# --- the reference, written out after mdistiller's CRD.py (ContrastMemory, ContrastLoss) -------------


class RefContrastLoss(nn.Module):
    def __init__(self, num_data):
        super().__init__()
        self.num_data = num_data

    def forward(self, x):  # x: (bsz, K+1, 1)
        eps = 1e-7
        bsz = x.shape[0]
        m = x.size(1) - 1
        Pn = 1 / float(self.num_data)
        P_pos = x.select(1, 0)
        log_D1 = torch.div(P_pos, P_pos.add(m * Pn + eps)).log_()
        P_neg = x.narrow(1, 1, m)
        log_D0 = torch.div(P_neg.clone().fill_(m * Pn), P_neg.add(m * Pn + eps)).log_()
        return -(log_D1.sum(0) + log_D0.view(-1, 1).sum(0)) / bsz


def ref_contrast_memory(v1, v2, y, idx, memory_v1, memory_v2, K, T, momentum, Z_v1=-1.0, Z_v2=-1.0):
    """ContrastMemory.forward with given indices; updates the banks in place; returns (out_v1, out_v2, Z_v1, Z_v2)."""
    batchSize = v1.size(0)
    outputSize = memory_v1.size(0)
    inputSize = memory_v1.size(1)
    weight_v1 = torch.index_select(memory_v1, 0, idx.view(-1)).detach().view(batchSize, K + 1, inputSize)
    out_v2 = torch.exp(torch.div(torch.bmm(weight_v1, v2.view(batchSize, inputSize, 1)), T))
    weight_v2 = torch.index_select(memory_v2, 0, idx.view(-1)).detach().view(batchSize, K + 1, inputSize)
    out_v1 = torch.exp(torch.div(torch.bmm(weight_v2, v1.view(batchSize, inputSize, 1)), T))
    if Z_v1 < 0:
        Z_v1 = (out_v1.mean() * outputSize).item()
    if Z_v2 < 0:
        Z_v2 = (out_v2.mean() * outputSize).item()
    out_v1 = torch.div(out_v1, Z_v1).contiguous()
    out_v2 = torch.div(out_v2, Z_v2).contiguous()
    with torch.no_grad():
        l_pos = torch.index_select(memory_v1, 0, y.view(-1))
        l_pos.mul_(momentum)
        l_pos.add_(torch.mul(v1, 1 - momentum))
        updated_v1 = l_pos.div(l_pos.pow(2).sum(1, keepdim=True).pow(0.5))
        memory_v1.index_copy_(0, y, updated_v1)
        ab_pos = torch.index_select(memory_v2, 0, y.view(-1))
        ab_pos.mul_(momentum)
        ab_pos.add_(torch.mul(v2, 1 - momentum))
        updated_v2 = ab_pos.div(ab_pos.pow(2).sum(1, keepdim=True).pow(0.5))
        memory_v2.index_copy_(0, y, updated_v2)
    return out_v1, out_v2, Z_v1, Z_v2


def _unit(x):
    return x / x.pow(2).sum(1, keepdim=True).pow(0.5)


def _fixture(seed=0, b=4, d=8, n_data=32, k=6):
    g = torch.Generator().manual_seed(seed)
    v_s = _unit(torch.randn(b, d, generator=g, dtype=torch.float64))
    v_t = _unit(torch.randn(b, d, generator=g, dtype=torch.float64))
    mem_s = torch.rand(n_data, d, generator=g, dtype=torch.float64) - 0.5
    mem_t = torch.rand(n_data, d, generator=g, dtype=torch.float64) - 0.5
    idx = torch.tensor([3, 0, 17, 9])[:b]
    contrast_idx = torch.cat([idx[:, None], torch.randint(0, n_data, (b, k), generator=g)], dim=1)
    return v_s, v_t, mem_s, mem_t, idx, contrast_idx


@pytest.mark.parametrize("T", [0.07, 0.5])
def test_crd_loss_matches_the_reference_code(T):
    v_s, v_t, mem_s, mem_t, idx, contrast_idx = _fixture()
    n_data, k = mem_s.shape[0], contrast_idx.shape[1] - 1
    unset = torch.tensor(-1.0, dtype=torch.float64)
    loss, z_s, z_t = crd_loss(v_s, v_t, mem_s.clone(), mem_t.clone(), contrast_idx, T, unset, unset)
    out_v1, out_v2, Z_v1, Z_v2 = ref_contrast_memory(
        v_s, v_t, idx, contrast_idx, mem_s.clone(), mem_t.clone(), k, T, 0.5
    )
    want = RefContrastLoss(n_data)(out_v1) + RefContrastLoss(n_data)(out_v2)
    torch.testing.assert_close(loss, want.squeeze(), rtol=1e-5, atol=0)
    assert z_s.item() == pytest.approx(Z_v1, rel=1e-10) and z_t.item() == pytest.approx(Z_v2, rel=1e-10)
    # a set Z is kept: the second batch uses the first batch's constants
    z1, z2 = torch.tensor(Z_v1 * 3, dtype=torch.float64), torch.tensor(Z_v2 / 2, dtype=torch.float64)
    loss2, k1, k2 = crd_loss(v_s, v_t, mem_s, mem_t, contrast_idx, T, z1, z2)
    o1, o2, _, _ = ref_contrast_memory(
        v_s, v_t, idx, contrast_idx, mem_s.clone(), mem_t.clone(), k, T, 0.5, *map(float, (z1, z2))
    )
    torch.testing.assert_close(
        loss2, (RefContrastLoss(n_data)(o1) + RefContrastLoss(n_data)(o2)).squeeze(), rtol=1e-5, atol=0
    )
    assert (k1, k2) == (z1, z2)


def test_crd_loss_gradients_match_the_reference():
    v_s, v_t, mem_s, mem_t, idx, contrast_idx = _fixture(seed=3)
    a_s, a_t = v_s.clone().requires_grad_(), v_t.clone().requires_grad_()
    r_s, r_t = v_s.clone().requires_grad_(), v_t.clone().requires_grad_()
    unset = torch.tensor(-1.0, dtype=torch.float64)
    crd_loss(a_s, a_t, mem_s, mem_t, contrast_idx, 0.07, unset, unset)[0].backward()
    o1, o2, _, _ = ref_contrast_memory(r_s, r_t, idx, contrast_idx, mem_s.clone(), mem_t.clone(), 6, 0.07, 0.5)
    (RefContrastLoss(32)(o1) + RefContrastLoss(32)(o2)).sum().backward()
    torch.testing.assert_close(a_s.grad, r_s.grad, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(a_t.grad, r_t.grad, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("momentum", [0.5, 0.9])
def test_momentum_update_matches_the_reference(momentum):
    v_s, v_t, mem_s, mem_t, idx, contrast_idx = _fixture(seed=1)
    ref_s, ref_t = mem_s.clone(), mem_t.clone()
    ref_contrast_memory(v_s, v_t, idx, contrast_idx, ref_s, ref_t, 6, 0.07, momentum)
    momentum_update(mem_s, v_s, idx, momentum)
    momentum_update(mem_t, v_t, idx, momentum)
    torch.testing.assert_close(mem_s, ref_s, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(mem_t, ref_t, rtol=1e-12, atol=1e-15)
    # by hand for one row: l2norm(m * old + (1 - m) * v); untouched rows stay put
    old = _fixture(seed=1)[2]
    row = momentum * old[3] + (1 - momentum) * v_s[0]
    torch.testing.assert_close(mem_s[3], row / row.norm())
    torch.testing.assert_close(mem_s[1], old[1])


def test_bank_init_and_negative_indices():
    torch.manual_seed(0)
    bank = init_bank(1000, 48)
    stdv = 1.0 / math.sqrt(48 / 3)
    assert bank.shape == (1000, 48) and bank.min() >= -stdv and bank.max() < stdv
    idx = torch.arange(4)
    ci = contrast_idx_for(idx, 128, 64)
    assert ci.shape == (4, 65) and torch.equal(ci[:, 0], idx) and ci.min() >= 0 and ci.max() < 128


def test_term_uses_the_last_feature_pooled_sets_z_once_and_updates_the_banks():
    params = CRDParams(feat_dim=16, nce_k=8, n_data=20)
    shapes = type(
        "Shapes",
        (),
        {
            "student": [torch.Size([2, 4, 4, 4]), torch.Size([2, 6, 2, 2])],
            "teacher": [torch.Size([2, 5, 4, 4]), torch.Size([2, 7, 2, 2])],
        },
    )
    torch.manual_seed(0)
    term = CRD(params, shapes)
    index, heads = term.adapter()
    assert index == 1 and heads.student.linear.in_features == 6 and heads.teacher.linear.in_features == 7
    assert not list(term.parameters())  # the heads train with the student, not in the loss
    assert term.memory_s.shape == term.memory_t.shape == (20, 16)
    fs, ft = torch.randn(3, 6, 2, 2), torch.randn(3, 7, 2, 2)
    before_s, before_t = term.memory_s.clone(), term.memory_t.clone()
    inp = LossInputs(
        torch.zeros(3, 10),
        torch.zeros(3, 10),
        torch.zeros(3, dtype=torch.long),
        [torch.zeros(3, 4, 4, 4), fs],
        [torch.zeros(3, 5, 4, 4), ft],
        {"crd": heads(fs)},
    )
    torch.manual_seed(5)
    got = term(inp)
    # the same with the public function and the same draws
    torch.manual_seed(5)
    ci = contrast_idx_for(torch.arange(3), 20, 8)
    v_s, v_t = heads.student(fs.mean(dim=(2, 3))), heads.teacher(ft.mean(dim=(2, 3)))
    unset = torch.tensor(-1.0)
    want, z_s, z_t = crd_loss(v_s, v_t, before_s, before_t, ci, 0.07, unset, unset)
    torch.testing.assert_close(got, 0.8 * want)
    torch.testing.assert_close(term.z, torch.stack([z_s, z_t]))
    assert torch.equal(term.memory_s[3:], before_s[3:]) and not torch.equal(term.memory_s[:3], before_s[:3])
    assert torch.allclose(term.memory_t[:3].norm(dim=1), torch.ones(3))
    z = term.z.clone()
    term(inp)
    assert torch.equal(term.z, z)  # Z is fixed by the first batch
    big = LossInputs(
        torch.zeros(21, 10),
        torch.zeros(21, 10),
        torch.zeros(21, dtype=torch.long),
        [],
        [torch.zeros(21, 5, 4, 4), torch.randn(21, 7, 2, 2)],
        {"crd": torch.randn(21, 16)},
    )
    with pytest.raises(KdbenchError, match="n_data"):
        term(big)


# --- steps -----------------------------------------------------------------------------------------


def _step(method, precision="fp32", mode="live", **extra):
    config = make_config(
        method=method,
        precision=precision,
        teacher={"mode": mode},
        crd={"nce_k": 64, "n_data": 128, **extra},
    )
    return make_step(config)


@pytest.mark.parametrize("mode", ["live", "cached"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_crd_steps_and_both_heads_train(precision, mode):
    step = _step("crd", precision, mode)
    d = step.distiller
    heads = d.trainee.adapters["crd"]
    term = d.loss_fn.terms[0]
    t_before = [p.clone() for p in heads.teacher.parameters()]
    s_before = [p.clone() for p in heads.student.parameters()]
    bank = term.memory_t.clone()
    for _ in range(3):
        step()
        assert torch.isfinite(step.last_loss) and step.last_loss.dtype == torch.float32
    assert d.nonfinite_steps == 0
    want = sum(p.numel() for p in heads.parameters())
    assert d.adapter_params == want == (64 * 128 + 128) * 2  # resnet8's last stage: 64 channels on each side
    opt = {id(p) for g in d.optimizer.param_groups for p in g["params"]}
    assert {id(p) for p in heads.teacher.parameters()} <= opt
    assert any(not torch.equal(a, b) for a, b in zip(t_before, heads.teacher.parameters()))  # the teacher head trains
    assert any(not torch.equal(a, b) for a, b in zip(s_before, heads.student.parameters()))
    assert all(p.grad is None for p in d.teacher.parameters())
    assert not torch.equal(term.memory_t[:4], bank[:4]) and torch.equal(term.memory_t[4:], bank[4:])
    assert bool((term.z > 0).all())
    if mode == "cached":
        assert step.cache is not None


def test_kd_plus_crd_combines():
    step = _step("kd+crd")
    d = step.distiller
    assert d.loss_fn.names == ["kd", "crd"]
    assert d.adapter_params > 0
    step()
    step()
    assert torch.isfinite(step.last_loss)
    # the combined loss is kd's form plus the crd term, CE counted once at 1 - alpha
    term = d.loss_fn.terms[1]
    kd = d.loss_fn.terms[0]
    s, t, y = torch.randn(4, 10), torch.randn(4, 10), torch.tensor([0, 1, 2, 3])
    fs, ft = torch.randn(4, 64, 4, 4), torch.randn(4, 64, 4, 4)
    heads = d.trainee.adapters["crd"]
    pad = [torch.zeros(1)] * term.index  # only the last paired feature enters CRD
    inp = LossInputs(s, t, y, [*pad, fs], [*pad, ft], {"crd": heads(fs)})
    state = {k: v.clone() for k, v in term.state_dict().items()}
    torch.manual_seed(1)
    got = d.loss_fn(inp)
    term.load_state_dict(state)
    torch.manual_seed(1)
    crd_part = term(inp)
    alpha = 0.9
    ce = torch.nn.functional.cross_entropy(s, y)
    want = (1 - alpha) * ce + alpha * kd_kl(s, t, 4.0) + crd_part
    assert kd.ce_weight == pytest.approx(1 - alpha)
    torch.testing.assert_close(got, want)


def test_data_set_indices_pick_the_bank_rows_and_the_quality_bank_is_sized_to_the_data():
    """In quality training a batch carries its samples' data-set indices: those bank rows (and only those)
    are read as positives and updated; the quality protocol sizes the bank to the training set."""
    from kdbench.quality.train import bank_sized

    params = CRDParams(feat_dim=8, nce_k=4, n_data=30)
    shapes = type("Shapes", (), {"student": [torch.Size([2, 6, 2, 2])], "teacher": [torch.Size([2, 7, 2, 2])]})
    torch.manual_seed(0)
    term = CRD(params, shapes)
    _, heads = term.adapter()
    fs, ft = torch.randn(3, 6, 2, 2), torch.randn(3, 7, 2, 2)
    before = term.memory_s.clone()
    indices = torch.tensor([25, 3, 17])
    inp = LossInputs(
        torch.zeros(3, 10),
        torch.zeros(3, 10),
        torch.zeros(3, dtype=torch.long),
        [fs],
        [ft],
        {"crd": heads(fs)},
        indices=indices,
    )
    term(inp)
    changed = (term.memory_s != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [3, 17, 25]
    cell = make_config(method="kd+crd")
    sized = bank_sized(cell, 1347)
    assert (sized.crd.n_data, sized.crd.nce_k) == (1347, 1346) and sized.kd == cell.kd
    assert bank_sized(make_config(method="kd"), 1347) == make_config(method="kd")
