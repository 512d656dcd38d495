"""Distillation methods: each loss against a hand computation, feature capture, adapters, caching."""

import copy
import math

import pytest
import torch
from torch import nn

from kdbench.core.errors import KdbenchError
from kdbench.distill.hooks import FeatureTap, canonical, default_feature_paths, pair_paths, stage_ends
from kdbench.distill.losses import METHODS, DistillLoss, LossInputs, check_method, check_weights
from kdbench.distill.losses.at import at_loss, attention_map
from kdbench.distill.losses.dkd import dkd_parts
from kdbench.distill.losses.fitnet import regressor
from kdbench.distill.losses.kd import kd_kl
from kdbench.hw.backends import resolve
from kdbench.models import build_model
from tests.support.helpers import make_config, make_step

CPU = resolve("cpu")


def _softmax(z):
    m = max(z)
    e = [math.exp(v - m) for v in z]
    return [v / sum(e) for v in e]


def _kl(p, q):
    return sum(a * (math.log(a) - math.log(b)) for a, b in zip(p, q))


S = [[1.0, 2.0, 3.0, -1.0], [0.5, -0.5, 2.5, 1.0]]
TT = [[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 4.0, -2.0]]
Y = [2, 1]


# --- DKD ------------------------------------------------------------------------


def _hand_dkd(s_rows, t_rows, labels, T):
    tckd = nckd = 0.0
    for s, t, y in zip(s_rows, t_rows, labels):
        ps, pt = _softmax([v / T for v in s]), _softmax([v / T for v in t])
        tckd += _kl([pt[y], 1 - pt[y]], [ps[y], 1 - ps[y]])
        ps_o = _softmax([v / T for i, v in enumerate(s) if i != y])
        pt_o = _softmax([v / T for i, v in enumerate(t) if i != y])
        nckd += _kl(pt_o, ps_o)
    n = len(labels)
    return T * T * tckd / n, T * T * nckd / n


@pytest.mark.parametrize("T", [1.0, 4.0])
def test_dkd_parts_match_hand_computation(T):
    tckd, nckd = dkd_parts(torch.tensor(S), torch.tensor(TT), torch.tensor(Y), T)
    want_t, want_n = _hand_dkd(S, TT, Y, T)
    assert tckd.item() == pytest.approx(want_t, rel=1e-5)
    assert nckd.item() == pytest.approx(want_n, rel=1e-5)


@pytest.mark.parametrize("row", [0, 1])
def test_kd_equals_tckd_plus_weighted_nckd(row):
    # KL(p_t || p_s) = TCKD + (1 - p_t[target]) * NCKD, per sample (Zhao et al. 2022, eq. 4).
    s, t, y = torch.tensor([S[row]]), torch.tensor([TT[row]]), torch.tensor([Y[row]])
    T = 2.0
    tckd, nckd = dkd_parts(s, t, y, T)
    p_target = torch.softmax(t / T, dim=-1)[0, Y[row]].item()
    assert kd_kl(s, t, T).item() == pytest.approx(tckd.item() + (1 - p_target) * nckd.item(), rel=1e-5)


def test_dkd_is_finite_for_half_precision_logits_with_a_confident_teacher():
    s = torch.tensor([[30.0, -30.0, 0.0, 5.0]], dtype=torch.float16)
    t = torch.tensor([[60.0, -60.0, -60.0, -60.0]], dtype=torch.float16)  # p_target rounds to 1 in fp16
    tckd, nckd = dkd_parts(s, t, torch.tensor([0]), 1.0)
    assert torch.isfinite(tckd) and torch.isfinite(nckd)
    assert tckd.dtype == torch.float32
    # log(1 - p_t) taken as a difference of log-sum-exps keeps the tiny mass: TCKD is not NaN and >= 0.
    assert tckd.item() >= 0


def test_dkd_warmup_ramps_linearly():
    config = make_config(method="dkd", dkd={"warmup": 4})
    loss = DistillLoss(config)
    inp = LossInputs(torch.tensor(S), torch.tensor(TT), torch.tensor(Y))
    ce = torch.nn.functional.cross_entropy(torch.tensor(S), torch.tensor(Y)).item()
    tckd, nckd = dkd_parts(torch.tensor(S), torch.tensor(TT), torch.tensor(Y), 4.0)
    full = (1.0 * tckd + 8.0 * nckd).item()
    for step, ramp in [(0, 0.25), (1, 0.5), (3, 1.0), (10, 1.0)]:
        inp.step = step
        assert loss(inp).item() == pytest.approx(ce + ramp * full, rel=1e-5)


# --- AT -------------------------------------------------------------------------


def _q(feature, p):
    """Normalised attention vector of one sample, by hand: feature is [C][H*W] of floats."""
    c = len(feature)
    a = [sum(abs(feature[k][i]) ** p for k in range(c)) / c for i in range(len(feature[0]))]
    norm = math.sqrt(sum(v * v for v in a))
    return [v / norm for v in a]


def test_attention_map_is_channel_mean_of_abs_power():
    f = torch.tensor([[[[1.0, -2.0], [3.0, 0.0]], [[-1.0, 0.0], [1.0, 2.0]]]])  # 1x2x2x2
    torch.testing.assert_close(attention_map(f, 2.0), torch.tensor([[[1.0, 2.0], [5.0, 2.0]]]))
    torch.testing.assert_close(attention_map(f, 1.0), torch.tensor([[[1.0, 1.0], [2.0, 1.0]]]))


@pytest.mark.parametrize("form", ["code", "paper"])
def test_at_loss_matches_hand_computation(form):
    g = torch.Generator().manual_seed(0)
    fs = [torch.randn(2, 3, 2, 2, generator=g), torch.randn(2, 4, 1, 2, generator=g)]
    ft = [torch.randn(2, 5, 2, 2, generator=g), torch.randn(2, 2, 1, 2, generator=g)]
    total = 0.0
    for a, b in zip(fs, ft):
        per_sample = []
        for n in range(2):
            qs = _q(a[n].flatten(1).tolist(), 2)
            qt = _q(b[n].flatten(1).tolist(), 2)
            diff = [x - y for x, y in zip(qs, qt)]
            per_sample.append(diff)
        if form == "code":
            total += sum(d * d for row in per_sample for d in row) / sum(len(r) for r in per_sample)
        else:
            total += sum(math.sqrt(sum(d * d for d in row)) for row in per_sample) / 2
    got = at_loss(fs, ft, beta=1000.0, p=2.0, form=form).item()
    assert got == pytest.approx(1000.0 / 2 * total, rel=1e-5)


def test_at_pools_the_larger_feature_before_forming_its_attention_map():
    # As RepDistiller and mdistiller compute it: pool the feature, then square and average the channels
    g = torch.Generator().manual_seed(1)
    big = torch.randn(2, 3, 8, 8, generator=g)
    small = torch.randn(2, 5, 4, 4, generator=g)
    pooled = big.reshape(2, 3, 4, 2, 4, 2).mean(dim=(3, 5))  # 2x2 average pooling written out

    def q(f):
        a = (f * f).mean(dim=1).reshape(f.shape[0], -1)
        return a / a.norm(dim=1, keepdim=True)

    want = 1.0 / 2 * (q(pooled) - q(small)).pow(2).mean().item()
    assert at_loss([big], [small], beta=1.0).item() == pytest.approx(want, rel=1e-5)
    assert at_loss([small], [big], beta=1.0).item() == pytest.approx(want, rel=1e-5)
    # pooling the attention map instead (what kdbench did before) gives another value
    old = torch.nn.functional.avg_pool2d(attention_map(big, 2.0)[:, None], 2)[:, 0].flatten(1)
    old = 1.0 / 2 * (old / old.norm(dim=1, keepdim=True) - q(small)).pow(2).mean().item()
    assert abs(old - want) > 1e-3 * want


def test_at_of_identical_features_is_zero_and_refuses_flat_vectors():
    f = torch.randn(2, 3, 4, 4)
    assert at_loss([f], [f.clone() * 3], beta=1000.0).item() == pytest.approx(0.0, abs=1e-9)  # scale-free
    with pytest.raises(KdbenchError, match="spatial"):
        at_loss([torch.randn(2, 8)], [torch.randn(2, 8)], beta=1.0)


# --- FitNet ---------------------------------------------------------------------


def test_fitnet_term_is_beta_times_mse_of_adapted_hint():
    config = make_config(method="fitnet", fitnet={"beta": 100.0, "hint_layer": 0})
    shapes = type("Shapes", (), {"teacher": [torch.Size([2, 2, 1, 1])], "student": [torch.Size([2, 3, 1, 1])]})
    loss = DistillLoss(config, shapes)
    hint = torch.tensor([[[[1.0]], [[2.0]]], [[[0.0]], [[-1.0]]]])
    target = torch.tensor([[[[0.5]], [[2.0]]], [[[1.0]], [[1.0]]]])
    logits = torch.zeros(2, 4)
    inp = LossInputs(logits, logits, torch.tensor([0, 1]), [torch.zeros(2, 3, 1, 1)], [target], {"fitnet": hint})
    mse = ((1 - 0.5) ** 2 + 0 + (0 - 1) ** 2 + (-1 - 1) ** 2) / 4
    assert loss(inp).item() == pytest.approx(math.log(4) + 100.0 * mse, rel=1e-6)  # CE of uniform logits + hint


@pytest.mark.parametrize(
    "s_shape,t_shape,kind",
    [
        ((2, 8, 16, 16), (2, 16, 16, 16), nn.Conv2d),  # same size
        ((2, 8, 16, 16), (2, 16, 8, 8), nn.Conv2d),  # student 2x larger: stride 2
        ((2, 8, 4, 4), (2, 16, 8, 8), nn.ConvTranspose2d),  # student 2x smaller: transposed conv
        ((2, 8, 5, 5), (2, 16, 3, 3), nn.Conv2d),  # no integer ratio: conv + pooling
        ((2, 8, 3, 3), (2, 16, 5, 5), nn.Conv2d),  # no integer ratio, smaller: conv + interpolation
        ((2, 8, 10), (2, 16, 17), nn.Linear),  # tokens of different lengths
        ((2, 8, 4, 4), (2, 16, 17), nn.Linear),  # a map against tokens: pooled
        ((2, 8), (2, 16), nn.Linear),  # vectors
    ],
)
def test_regressor_maps_student_to_teacher_shape(s_shape, t_shape, kind):
    reg = regressor(torch.Size(s_shape), torch.Size(t_shape))
    assert any(isinstance(m, kind) for m in reg.modules())
    out = reg(torch.randn(s_shape))
    want = t_shape if len(s_shape) == len(t_shape) else t_shape[:2]
    assert tuple(out.shape) == tuple(want)
    if kind is not nn.Linear:
        assert any(isinstance(m, nn.BatchNorm2d) for m in reg.modules())  # conv-BN-ReLU


# --- registry, combination, weights ---------------------------------------------


def test_registry_holds_the_literature_methods():
    assert {"kd", "fitnet", "at", "dkd"} <= set(METHODS)
    assert [m.name for m in check_method("kd+at")] == ["kd", "at"]
    with pytest.raises(KdbenchError, match="repeats"):
        check_method("kd+kd")
    with pytest.raises(KdbenchError, match="did you mean at"):
        check_method("kd+att")
    with pytest.raises(KdbenchError, match="weights.at"):
        check_weights("kd", {"at": 1.0})


def test_combination_counts_ce_once_and_weights_each_term():
    g = torch.Generator().manual_seed(2)
    fs, ft = [torch.randn(2, 3, 4, 4, generator=g)], [torch.randn(2, 5, 4, 4, generator=g)]
    s, t, y = torch.tensor(S), torch.tensor(TT), torch.tensor(Y)
    config = make_config(method="kd+at", kd={"temperature": 4.0, "alpha": 0.9}, weights={"at": 0.5})
    loss = DistillLoss(config).forward(LossInputs(s, t, y, fs, ft))
    ce = torch.nn.functional.cross_entropy(s, y)
    want = 0.1 * ce + 0.9 * kd_kl(s, t, 4.0) + 0.5 * at_loss(fs, ft, 1000.0)
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    # at alone keeps the full CE
    alone = DistillLoss(make_config(method="at")).forward(LossInputs(s, t, y, fs, ft))
    assert alone.item() == pytest.approx((ce + at_loss(fs, ft, 1000.0)).item(), rel=1e-6)


# --- feature capture --------------------------------------------------------------


class TinyCNN(nn.Module):
    """A user's own model: two resolutions, plain attribute names."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.c = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(self.pool(self.c(self.b(self.a(x)))).flatten(1))


@pytest.mark.parametrize(
    "name,shape,want",
    [
        ("resnet20", [3, 32, 32], ["layer1", "layer2", "layer3"]),
        ("wrn_16_2", [3, 32, 32], ["layer1", "layer2", "layer3"]),
        ("resnet18", [3, 64, 64], ["layer1", "layer2", "layer3", "layer4"]),
        ("mobilenet_v3_small", [3, 64, 64], ["features.1", "features.3", "features.8", "features.12"]),
        ("efficientnet_b0", [3, 64, 64], ["features.2", "features.3", "features.5", "features.8"]),
        ("shufflenet_v2_x0_5", [3, 64, 64], ["maxpool", "stage2", "stage3", "conv5"]),
        ("swin_t", [3, 64, 64], ["features.1", "features.3", "features.5", "features.7"]),
        ("vit_b_16", [3, 64, 64], [f"encoder.layers.encoder_layer_{i}" for i in (2, 5, 8, 11)]),
    ],
)
def test_default_feature_paths_per_family(name, shape, want):
    torch.manual_seed(0)
    model = build_model(name, 10, tuple(shape))
    assert default_feature_paths(model, torch.randn(2, *shape)) == want


def test_stage_ends_of_a_users_cnn_are_the_last_module_at_each_resolution():
    assert stage_ends(TinyCNN(), torch.randn(2, 3, 8, 8)) == ["a", "c"]


def test_tap_canonicalises_swin_and_vit_outputs():
    assert canonical(torch.zeros(2, 7, 5, 3), nhwc=True).shape == (2, 3, 7, 5)
    assert canonical(torch.zeros(2, 17, 768)).shape == (2, 768, 17)
    model = TinyCNN()
    tap = FeatureTap(model, ["a", "c"])
    model(torch.randn(2, 3, 8, 8))
    feats = tap.take()
    assert [tuple(f.shape) for f in feats] == [(2, 4, 8, 8), (2, 8, 4, 4)]
    with pytest.raises(RuntimeError, match="no tensor"):
        tap.take()  # outputs are forgotten once taken
    with pytest.raises(KdbenchError, match="features.student: the student has no module 'layer9'"):
        FeatureTap(model, ["layer9"], "student")


def test_default_lists_pair_on_their_deepest_stages_explicit_lists_must_match():
    assert pair_paths(["a", "b", "c", "d"], ["x", "y", "z"], explicit=False) == (["b", "c", "d"], ["x", "y", "z"])
    with pytest.raises(KdbenchError, match="same number"):
        pair_paths(["a", "b"], ["x"], explicit=True)


# --- the step with features -------------------------------------------------------


def test_fitnet_gradients_reach_student_and_adapter_only():
    config = make_config(pair={"teacher": "resnet20", "student": "resnet8"}, method="fitnet")
    step = make_step(config)
    before = {k: v.clone() for k, v in step.distiller.teacher.state_dict().items()}
    adapter = step.distiller.trainee.adapters["fitnet"]
    a_before = [p.clone() for p in adapter.parameters()]
    step()
    assert all(p.grad is None for p in step.distiller.teacher.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapter.parameters())
    assert all(p.grad is not None for p in step.distiller.student.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(a_before, adapter.parameters()))  # the adapter trains
    for k, v in step.distiller.teacher.state_dict().items():
        assert torch.equal(v, before[k]), k  # weights and batch-norm statistics
    opt = {id(p) for g in step.distiller.optimizer.param_groups for p in g["params"]}
    assert opt == {id(p) for p in step.distiller.trainee.parameters()}
    assert step.distiller.adapter_params == sum(p.numel() for p in adapter.parameters()) > 0


@pytest.mark.parametrize("method", ["kd", "fitnet", "at", "kd+at", "dkd"])
def test_cached_and_live_teachers_give_the_same_loss(method):
    cell = dict(pair={"teacher": "resnet20", "student": "resnet8"}, method=method)
    live, cached = make_config(**cell, teacher={"mode": "live"}), make_config(**cell, teacher={"mode": "cached"})
    torch.manual_seed(0)
    shape = tuple(live.data.shape)
    teacher = build_model("resnet20", 10, shape)
    student = build_model("resnet8", 10, shape)
    live = make_step(live, (copy.deepcopy(teacher), copy.deepcopy(student)))
    cached = make_step(cached, (copy.deepcopy(teacher), copy.deepcopy(student)))
    for _ in range(3):
        live()
        cached()
        torch.testing.assert_close(live.last_loss, cached.last_loss)
    assert cached.cache_ms is not None and cached.cache_ms > 0 and live.cache_ms is None
    assert cached.cache.logits.data_ptr() % 64 == 0  # cached outputs placed at the cell's alignment


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("method", ["kd", "fitnet", "at", "kd+at", "dkd"])
@pytest.mark.parametrize(
    "pair", [("resnet20", "resnet8"), pytest.param(("resnet18", "mobilenet_v3_small"), marks=pytest.mark.slow)]
)
def test_every_method_steps_on_cifar_and_heterogeneous_pairs(pair, method, precision):
    config = make_config(
        pair={"teacher": pair[0], "student": pair[1]},
        method=method,
        precision=precision,
        data={"shape": [3, 32, 32], "num_classes": 10},
    )
    step = make_step(config)
    step()
    step()
    assert torch.isfinite(step.last_loss) and step.last_loss.dtype == torch.float32
    assert step.distiller.nonfinite_steps == 0
    phases = step.phase_ms(2)
    assert set(phases) == {"teacher_forward", "student_forward", "loss", "backward", "optimizer"}
    assert all(len(v) == 2 and all(x >= 0 for x in v) for v in phases.values())
    if method in ("fitnet", "at", "kd+at"):
        assert len(step.distiller.paths.teacher) == len(step.distiller.paths.student) >= 3


def test_nonfinite_losses_are_counted():
    config = make_config(optimizer={"name": "sgd", "lr": 1e-3, "momentum": 0.0})
    step = make_step(config)
    with torch.no_grad():
        step.distiller.teacher.fc.weight.fill_(float("nan"))  # a broken teacher: NaN logits
    for _ in range(3):
        step()
    assert step.distiller.nonfinite_steps == 3


def test_grad_scaler_skips_are_counted():
    config = make_config(precision="fp16")
    step = make_step(config)
    assert step.distiller.scaler is not None
    weight = step.distiller.student.fc.weight
    weight.register_hook(lambda g: g * float("inf"))  # every step's gradients overflow
    before = weight.detach().clone()
    for _ in range(3):
        step()
    assert step.distiller.scaler_skips == 3 and step.distiller.optimizer_steps == 0
    assert torch.equal(weight.detach(), before)  # skipped updates leave the weights alone
    assert step.distiller.nonfinite_steps == 0  # the loss itself was finite
