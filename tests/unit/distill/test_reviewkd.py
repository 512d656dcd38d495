"""ReviewKD (Chen et al. 2021): HCL and the ABF review against the reference code, and the step."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kdbench.core.errors import KdbenchError
from kdbench.distill.hooks import FeaturePaths
from kdbench.distill.losses import METHODS, DistillLoss, LossInputs
from kdbench.distill.losses.kd import kd_kl
from kdbench.distill.losses.reviewkd import ReviewFusion, ReviewKD, ReviewKDParams, hcl_loss
from kdbench.hw.backends import resolve
from kdbench.models import build_model
from kdbench.workloads.vision import VISION
from tests.support.helpers import make_config, make_step

CPU = resolve("cpu")


pytestmark = pytest.mark.usefixtures("seeded")  # tests/conftest.py


# --- the reference code (dvlab-research/ReviewKD CIFAR-100/model/reviewkd.py = mdistiller's ReviewKD.py) -----


def ref_hcl(fstudent, fteacher):
    loss_all = 0.0
    for fs, ft in zip(fstudent, fteacher):
        _n, _c, h, _w = fs.shape
        loss = F.mse_loss(fs, ft, reduction="mean")
        cnt = 1.0
        tot = 1.0
        for l in [4, 2, 1]:  # noqa: E741 (the reference's name)
            if l >= h:
                continue
            tmpfs = F.adaptive_avg_pool2d(fs, (l, l))
            tmpft = F.adaptive_avg_pool2d(ft, (l, l))
            cnt /= 2.0
            loss += F.mse_loss(tmpfs, tmpft, reduction="mean") * cnt
            tot += cnt
        loss = loss / tot
        loss_all = loss_all + loss
    return loss_all


class RefABF(nn.Module):
    def __init__(self, in_channel, mid_channel, out_channel, fuse):
        super().__init__()
        self.conv1 = nn.Sequential(
            nn.Conv2d(in_channel, mid_channel, kernel_size=1, bias=False),
            nn.BatchNorm2d(mid_channel),
        )
        self.conv2 = nn.Sequential(
            nn.Conv2d(mid_channel, out_channel, kernel_size=3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(out_channel),
        )
        if fuse:
            self.att_conv = nn.Sequential(nn.Conv2d(mid_channel * 2, 2, kernel_size=1), nn.Sigmoid())
        else:
            self.att_conv = None

    def forward(self, x, y=None, shape=None, out_shape=None):
        n, _, h, w = x.shape
        x = self.conv1(x)
        if self.att_conv is not None:
            y = F.interpolate(y, (shape, shape), mode="nearest")
            z = torch.cat([x, y], dim=1)
            z = self.att_conv(z)
            x = x * z[:, 0].view(n, 1, h, w) + y * z[:, 1].view(n, 1, h, w)
        if x.shape[-1] != out_shape:
            x = F.interpolate(x, (out_shape, out_shape), mode="nearest")
        y = self.conv2(x)
        return y, x


def ref_review(abfs_shallow_to_deep, feats, shapes, out_shapes):
    """ReviewKD.forward of the references: abfs reversed (deepest first), features reversed, results re-ordered."""
    abfs = abfs_shallow_to_deep[::-1]
    x = feats[::-1]
    shapes, out_shapes = shapes[::-1], out_shapes[::-1]
    results = []
    out_features, res_features = abfs[0](x[0], out_shape=out_shapes[0])
    results.append(out_features)
    for features, abf, shape, out_shape in zip(x[1:], abfs[1:], shapes[1:], out_shapes[1:]):
        out_features, res_features = abf(features, res_features, shape, out_shape)
        results.insert(0, out_features)
    return results


# --- fixed tensors ---------------------------------------------------------------------------------------

S_SHAPES = [torch.Size([4, 8, 16, 16]), torch.Size([4, 16, 8, 8]), torch.Size([4, 24, 4, 4]), torch.Size([4, 32, 2, 2])]
T_SHAPES = [torch.Size([4, 12, 8, 8]), torch.Size([4, 20, 8, 8]), torch.Size([4, 40, 4, 4]), torch.Size([4, 48, 1, 1])]


def _feats(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def _ref_copy(fusion: ReviewFusion, s_shapes, t_shapes, mid):
    ref = [RefABF(s[1], mid, t[1], i < len(s_shapes) - 1) for i, (s, t) in enumerate(zip(s_shapes, t_shapes))]
    for r, ours in zip(ref, fusion.abfs):
        r.load_state_dict(ours.state_dict())  # the same weights, names and all
    return ref


@pytest.mark.parametrize("sizes", [[(16, 16), (8, 8), (4, 4), (2, 2), (1, 1)], [(5, 5), (3, 3)], [(7, 7), (4, 4)]])
def test_hcl_equals_the_reference(sizes):
    g = torch.Generator().manual_seed(3)
    fs = [torch.randn(3, 6, h, w, generator=g) for h, w in sizes]
    ft = [torch.randn(3, 6, h, w, generator=g) for h, w in sizes]
    got = hcl_loss(fs, ft)
    torch.testing.assert_close(got, torch.as_tensor(ref_hcl(fs, ft)), rtol=1e-5, atol=0)
    assert got.dtype == torch.float32
    # 8x8 written out: (mse + mse@4/2 + mse@2/4 + mse@1/8) / (1 + 1/2 + 1/4 + 1/8)
    a, b = fs[0][:, :, :8, :8], ft[0][:, :, :8, :8]
    parts = [F.mse_loss(a, b)] + [
        F.mse_loss(F.adaptive_avg_pool2d(a, s), F.adaptive_avg_pool2d(b, s)) for s in (4, 2, 1)
    ]
    want = (parts[0] + parts[1] / 2 + parts[2] / 4 + parts[3] / 8) / (1 + 1 / 2 + 1 / 4 + 1 / 8)
    torch.testing.assert_close(hcl_loss([a], [b]), want, rtol=1e-5, atol=0)


def test_hcl_of_bf16_features_is_computed_in_fp32():
    fs, ft = _feats(T_SHAPES, 1), _feats(T_SHAPES, 2)
    got = hcl_loss([f.bfloat16() for f in fs], [f.bfloat16() for f in ft])
    want = ref_hcl([f.bfloat16().float() for f in fs], [f.bfloat16().float() for f in ft])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.as_tensor(want), rtol=1e-5, atol=0)


def test_abf_shapes_and_the_deepest_first_fusion_order():
    torch.manual_seed(0)
    fusion = ReviewFusion(S_SHAPES, T_SHAPES, mid_channels=None)
    assert [abf.att_conv is None for abf in fusion.abfs] == [False, False, False, True]  # the deepest: no fusion
    assert all(abf.conv1[0].out_channels == 32 for abf in fusion.abfs)  # min(512, deepest student's channels)
    feats = _feats(S_SHAPES, 0)
    out = fusion(feats)
    assert [o.shape for o in out] == T_SHAPES
    # A residual flows from deep to shallow only: the deepest feature reaches every output,
    # the shallowest only its own.
    for changed, reach in [(3, [0, 1, 2, 3]), (0, [0]), (2, [0, 1, 2])]:
        moved = [f.clone() for f in feats]
        moved[changed] = moved[changed] + 1.0
        fusion.eval()
        base, other = fusion(feats), fusion(moved)
        fusion.train()
        assert [not torch.equal(a, b) for a, b in zip(base, other)] == [i in reach for i in range(4)]


def test_abf_review_equals_the_reference_composition_with_the_same_weights():
    torch.manual_seed(0)
    fusion = ReviewFusion(S_SHAPES, T_SHAPES, mid_channels=None)
    with torch.no_grad():  # BN and attention biases away from their initial values
        for p in fusion.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ref = _ref_copy(fusion, S_SHAPES, T_SHAPES, 32)
    feats = _feats(S_SHAPES, 0)
    got = fusion(feats)
    want = ref_review(ref, feats, [s[2] for s in S_SHAPES], [t[2] for t in T_SHAPES])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# (training epoch, step, ramp): the ramp counts epochs (1-based), whatever the step; no epoch (a timing cell): full.
@pytest.mark.parametrize(
    "epoch,step,ramp", [(1, 0, 0.25), (2, 0, 0.5), (2, 900, 0.5), (4, 3, 1.0), (9, 0, 1.0), (None, 0, 1.0)]
)
def test_the_term_equals_weight_warmup_hcl_of_the_reference_review(epoch, step, ramp):
    params = ReviewKDParams(weight=5.0, mid_channels=16, warmup=4)
    torch.manual_seed(0)
    term = ReviewKD(params, FeaturePaths(teacher=T_SHAPES, student=S_SHAPES))
    index, fusion = term.adapter()
    feats, teacher = _feats(S_SHAPES, 0), _feats(T_SHAPES, 1)
    ref = _ref_copy(fusion, S_SHAPES, T_SHAPES, 16)
    adapted = fusion(feats[index])
    logits = torch.zeros(4, 10)
    y = torch.zeros(4, dtype=torch.long)
    got = term(LossInputs(logits, logits, y, feats, teacher, {"reviewkd": adapted}, step, epoch=epoch))
    want = 5.0 * ramp * ref_hcl(ref_review(ref, feats, [s[2] for s in S_SHAPES], [t[2] for t in T_SHAPES]), teacher)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_defaults_are_the_references():
    p = METHODS["reviewkd"].params()
    assert (p.weight, p.mid_channels, p.warmup) == (1.0, None, 20)
    wide = [torch.Size([2, 600, 4, 4]), torch.Size([2, 1024, 2, 2])]
    term = ReviewKD(p, FeaturePaths(teacher=wide, student=wide))
    assert term.adapter()[1].abfs[0].conv1[0].out_channels == 512  # the references' cap
    assert term.ce_weight == 1.0


def mdistiller_ramp(epoch: int, warmup_epochs: int = 20) -> float:
    """mdistiller/distillers/ReviewKD.py: ``min(kwargs["epoch"] / self.warmup_epochs, 1.0)``, its trainer's epochs
    counted from 1 (``epoch = 1; while epoch < EPOCHS + 1``), CFG.REVIEWKD.WARMUP_EPOCHS = 20."""
    return min(epoch / warmup_epochs, 1.0)


@pytest.mark.slow
def test_the_warmup_counts_epochs_of_a_quality_training(monkeypatch):
    """Quality training (kdbench.quality.train.fit driving Distiller.train_step, as the protocol's distil does): the
    term's share of its weight in each epoch is mdistiller's ramp at that epoch, the same for every step of it."""
    from kdbench.config.quality import QualityConfig
    from kdbench.distill.step import Distiller
    from kdbench.quality.train import DeviceData, fit

    seen: list[tuple[int | None, float]] = []
    forward = ReviewKD.forward

    def watched(self, inp):
        out = forward(self, inp)
        full = self.weight * hcl_loss(inp.adapted["reviewkd"], inp.teacher_feats)
        seen.append((inp.epoch, float(out.detach() / full.detach())))
        return out

    monkeypatch.setattr(ReviewKD, "forward", watched)
    cell = make_config(method="reviewkd", data={"kind": "synthetic", "shape": [3, 8, 8], "num_classes": 4})
    assert cell.reviewkd.warmup == 20  # the default: mdistiller's WARMUP_EPOCHS
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 3, 8, 8, generator=g), torch.randint(0, 4, (12,), generator=g)
    data = DeviceData(x[:8], y[:8], x[8:], y[8:], 4, torch.contiguous_format)
    teacher, student = build_model("resnet8", 4, (3, 8, 8)), build_model("resnet8", 4, (3, 8, 8))
    distiller = Distiller(teacher, student, cell, CPU, data.x_train[:2], VISION)
    cfg = QualityConfig(epochs=25, batch_size=4, lr=0.01)

    def step(xb, yb, indices=None):
        return distiller.train_step(xb, yb, indices=indices)

    try:
        trained = fit(step, distiller.student, distiller.optimizer, data, cfg, CPU, 0, distiller.student_ac)
    finally:
        distiller.close()
    assert len(trained.history) == 25
    assert [e for e, _ in seen] == [e for e in range(1, 26) for _ in range(2)]  # 2 steps per epoch, epochs 1..25
    ramps = dict(seen)
    for epoch in (1, 10, 20, 25):
        assert ramps[epoch] == pytest.approx(mdistiller_ramp(epoch), rel=1e-6), epoch
    assert (ramps[1], ramps[10], ramps[20], ramps[25]) == pytest.approx((0.05, 0.5, 1.0, 1.0), rel=1e-6)
    assert all(r == pytest.approx(ramps[e], rel=1e-6) for e, r in seen)  # one ramp per epoch


def test_a_timing_cell_runs_the_term_at_full_weight(monkeypatch):
    """A fixed batch has no epochs: every call of the timed step, the first included, sees epoch None (full weight)."""
    seen = []
    forward = ReviewKD.forward
    monkeypatch.setattr(ReviewKD, "forward", lambda self, inp: seen.append(inp.epoch) or forward(self, inp))
    step = make_step(make_config(method="reviewkd"))
    for _ in range(3):
        step()
    assert seen == [None, None, None]


def test_training_epoch_reaches_the_loss_inputs_and_ends_with_its_block():
    from kdbench.distill.losses.registry import training_epoch

    logits, y = torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)
    assert LossInputs(logits, logits, y).epoch is None
    with training_epoch(3):
        assert LossInputs(logits, logits, y).epoch == 3
        assert LossInputs(logits, logits, y, epoch=7).epoch == 7  # given explicitly, it wins
        with training_epoch(4):
            assert LossInputs(logits, logits, y).epoch == 4
        assert LossInputs(logits, logits, y).epoch == 3
    assert LossInputs(logits, logits, y).epoch is None


def test_a_warmup_in_steps_is_refused_with_the_unit():
    assert ReviewKDParams(warmup=0).warmup == 0 and ReviewKDParams(warmup=10_000).warmup == 10_000
    with pytest.raises(ValueError, match=r"reviewkd.warmup counts epochs .* not steps: at most 10000 .* got 20000"):
        ReviewKDParams(warmup=20_000)


def test_token_and_vector_features_are_refused_with_the_fix():
    maps = [torch.Size([2, 8, 4, 4]), torch.Size([2, 16, 2, 2])]
    tokens = [torch.Size([2, 8, 16]), torch.Size([2, 16, 4])]
    with pytest.raises(KdbenchError, match="feature maps.*CNN pair.*features.teacher"):
        ReviewKD(ReviewKDParams(), FeaturePaths(teacher=tokens, student=maps))
    with pytest.raises(KdbenchError, match="student's paired feature 1.*features.student"):
        ReviewKD(ReviewKDParams(), FeaturePaths(teacher=maps, student=[maps[0], torch.Size([2, 16])]))


def test_non_square_maps_review_to_the_teachers_shapes():
    s = [torch.Size([2, 4, 6, 10]), torch.Size([2, 8, 3, 5])]
    t = [torch.Size([2, 6, 12, 20]), torch.Size([2, 10, 2, 3])]
    fusion = ReviewFusion(s, t, None)
    assert [o.shape for o in fusion(_feats(s, 0))] == t


# --- the step ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["live", "cached"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("pair", [("resnet14", "resnet8"), ("resnet8", "resnet8")])
def test_reviewkd_steps_on_a_tiny_cifar_pair(pair, precision, mode):
    config = make_config(
        pair={"teacher": pair[0], "student": pair[1]},
        method="reviewkd",
        precision=precision,
        teacher={"mode": mode},
        reviewkd={"warmup": 1},
    )
    step = make_step(config)
    fusion = step.distiller.trainee.adapters["reviewkd"]
    before = [p.clone() for p in fusion.parameters()]
    step()
    step()
    assert torch.isfinite(step.last_loss) and step.last_loss.dtype == torch.float32
    assert step.distiller.nonfinite_steps == 0
    assert step.distiller.adapter_params == sum(p.numel() for p in fusion.parameters()) > 0
    assert all(p.grad is not None for p in fusion.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, fusion.parameters()))  # the ABFs train
    assert all(p.grad is None for p in step.distiller.teacher.parameters())
    opt = {id(p) for g in step.distiller.optimizer.param_groups for p in g["params"]}
    assert {id(p) for p in fusion.parameters()} <= opt


def test_cached_and_live_teachers_give_the_same_loss():
    config = make_config(pair={"teacher": "resnet14", "student": "resnet8"}, method="reviewkd")
    torch.manual_seed(0)
    teacher, student = build_model("resnet14", 10, (3, 16, 16)), build_model("resnet8", 10, (3, 16, 16))
    steps = []
    for mode in ("live", "cached"):
        c = config.model_copy(update={"teacher": config.teacher.model_copy(update={"mode": mode})})
        steps.append(make_step(c, (copy.deepcopy(teacher), copy.deepcopy(student))))
    for _ in range(2):
        for s in steps:
            s()
        torch.testing.assert_close(steps[0].last_loss, steps[1].last_loss)


def test_kd_plus_reviewkd_combines():
    config = make_config(method="kd+reviewkd", reviewkd={"weight": 2.0, "warmup": 0}, weights={"reviewkd": 0.5})
    torch.manual_seed(0)
    loss = DistillLoss(config, FeaturePaths(teacher=T_SHAPES, student=S_SHAPES))
    assert loss.names == ["kd", "reviewkd"] and loss.ce_weight == pytest.approx(0.1)  # 1 - kd.alpha
    fusion = loss.terms[1].adapter()[1]
    feats, teacher = _feats(S_SHAPES, 0), _feats(T_SHAPES, 1)
    g = torch.Generator().manual_seed(5)
    s_logits, t_logits = torch.randn(4, 10, generator=g), torch.randn(4, 10, generator=g)
    y = torch.tensor([0, 3, 9, 2])
    adapted = fusion(feats)
    got = loss(LossInputs(s_logits, t_logits, y, feats, teacher, {"reviewkd": adapted}, 0))
    ref = _ref_copy(fusion, S_SHAPES, T_SHAPES, 32)
    review = ref_hcl(ref_review(ref, feats, [s[2] for s in S_SHAPES], [t[2] for t in T_SHAPES]), teacher)
    want = 0.1 * F.cross_entropy(s_logits, y) + 0.9 * kd_kl(s_logits, t_logits, 4.0) + 0.5 * 2.0 * review
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    step = make_step(make_config(pair={"teacher": "resnet14", "student": "resnet8"}, method="kd+reviewkd"))
    step()
    assert torch.isfinite(step.last_loss) and step.distiller.adapter_params > 0
