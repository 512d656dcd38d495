"""Distillation losses, in a registry filled by a decorator.

A method is an ``nn.Module`` class registered with :func:`register_method`.  It is
built once per cell from the cell's config and the feature shapes of one dry
forward pass, and called every step with a :class:`LossInputs`; it returns its
*distillation term* (without cross-entropy).  ``method: a+b`` combines terms:

    loss = ce_weight * CE(student, labels) + sum_m weights[m] * term_m

``ce_weight`` is the smallest of the terms' own CE weights: ``1 - alpha`` when
``kd`` is a term (Hinton's form), else 1.  ``weights`` (a suite key) defaults to 1.

Every loss is computed in FP32 with autocast disabled, whatever precision the
forward passes ran in: softmax at temperature T in half precision loses the small
probabilities that distillation transfers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kdbench.errors import KdbenchError, did_you_mean


@dataclass
class LossInputs:
    """What a step hands the loss: logits, labels, features, and the step's index."""

    student_logits: torch.Tensor
    teacher_logits: torch.Tensor
    targets: torch.Tensor
    student_feats: list[torch.Tensor] = field(default_factory=list)  # canonical (hooks.canonical)
    teacher_feats: list[torch.Tensor] = field(default_factory=list)
    adapted: dict[str, torch.Tensor] = field(default_factory=dict)  # a term's adapter output, by method name
    step: int = 0


class Term(nn.Module):
    """One distillation term; subclasses set `needs_features` and implement forward(LossInputs)."""

    needs_features: ClassVar[bool] = False
    ce_weight: float = 1.0

    def adapter(self) -> tuple[int, nn.Module] | None:
        """(feature index, module) applied to the student's feature inside the student's forward.

        The student side owns it (``step.Trainee``): it trains with the student, counts
        in its parameters and, under DDP, has its gradients reduced with the student's.
        """
        return None


@dataclass(frozen=True)
class Method:
    name: str
    cls: type[Term]
    params: str  # the suite key holding its hyper-parameters
    doc: str


METHODS: dict[str, Method] = {}


def register_method(name: str, params: str, doc: str) -> Callable[[type[Term]], type[Term]]:
    """Register a Term class as method `name`; its hyper-parameters live under suite key `params`."""

    def wrap(cls: type[Term]) -> type[Term]:
        METHODS[name] = Method(name, cls, params, doc)
        return cls

    return wrap


def method_parts(name: str) -> list[str]:
    return [p.strip() for p in name.split("+")]


def check_method(name: str) -> list[Method]:
    """The registered methods of `name` (`kd`, `kd+at`, ...); KdbenchError for an unknown or repeated part."""
    parts = method_parts(name)
    if len(set(parts)) != len(parts):
        raise KdbenchError(f"method '{name}' repeats a term; give each at most once (weights sets their size)")
    out = []
    for part in parts:
        if part not in METHODS:
            hint = did_you_mean(part, METHODS, cutoff=0.5)
            raise KdbenchError(
                f"unknown method '{part}'; {hint}(`kdbench list methods` shows all: "
                f"{', '.join(sorted(METHODS))}; combine with '+')"
            )
        out.append(METHODS[part])
    return out


def check_weights(method: str, weights: dict[str, float]) -> None:
    parts = method_parts(method)
    for key, value in weights.items():
        if key not in parts:
            raise KdbenchError(f"weights.{key}: '{key}' is not a term of method '{method}'; use one of {parts}")
        if not math.isfinite(value) or value < 0:
            raise KdbenchError(f"weights.{key}: must be a finite number >= 0, got {value}")


def needs_features(method: str) -> bool:
    return any(m.cls.needs_features for m in check_method(method))


# --- the losses as plain functions (FP32, autocast off) ----------------------------


def _fp32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.float() for t in tensors]


def kd_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * KL(softmax(t/T) || softmax(s/T)), averaged over the batch."""
    s, t = _fp32(student, teacher)
    kl = F.kl_div(
        F.log_softmax(s / temperature, dim=-1),
        F.log_softmax(t / temperature, dim=-1),
        reduction="batchmean",
        log_target=True,
    )
    return temperature * temperature * kl


def kd_loss(
    student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, temperature: float, alpha: float
) -> torch.Tensor:
    """alpha * T^2 * KL(softmax(t/T) || softmax(s/T)) + (1 - alpha) * CE(s, y); KL averaged over the batch."""
    with torch.amp.autocast(device_type=student.device.type, enabled=False):
        return alpha * kd_kl(student, teacher, temperature) + (1.0 - alpha) * F.cross_entropy(student.float(), targets)


def _target_split(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """log p_target, log (1 - p_target) and log-softmax over the non-target classes, all at T, stably."""
    z = logits.float() / temperature
    n, c = z.shape
    total = torch.logsumexp(z, dim=-1)
    target_mask = F.one_hot(targets, c).bool()
    z_target = z.gather(1, targets[:, None]).squeeze(1)
    others = z[~target_mask].view(n, c - 1)
    log_others_sum = torch.logsumexp(others, dim=-1)
    log_p_target = z_target - total
    log_p_rest = log_others_sum - total  # log(1 - p_t) without forming 1 - p_t
    return log_p_target, log_p_rest, others - log_others_sum[:, None]


def dkd_parts(
    student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(TCKD, NCKD) of Zhao et al. 2022, each times T^2 and averaged over the batch.

    TCKD = KL of the binary (target, rest) distributions; NCKD = KL among the
    non-target classes.  KL(p_t || p_s) = TCKD + (1 - p_t^teacher) * NCKD, per sample.
    Computed from log-sum-exps in FP32: no log of a sum of probabilities.
    """
    s_t, s_r, s_o = _target_split(student, targets, temperature)
    t_t, t_r, t_o = _target_split(teacher, targets, temperature)
    tckd = t_t.exp() * (t_t - s_t) + t_r.exp() * (t_r - s_r)
    nckd = (t_o.exp() * (t_o - s_o)).sum(dim=-1)
    scale = temperature * temperature
    return scale * tckd.mean(), scale * nckd.mean()


def attention_map(feature: torch.Tensor, p: float) -> torch.Tensor:
    """mean over channels of |A|^p, per sample, keeping its spatial shape (N, *spatial)."""
    return feature.float().abs().pow(p).mean(dim=1)


def _match_spatial(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Average-pool the larger of two attention maps to the smaller one's size."""
    if a.shape[1:] == b.shape[1:]:
        return a, b
    if a.dim() == b.dim() == 3:  # 2-D maps
        size = (min(a.shape[1], b.shape[1]), min(a.shape[2], b.shape[2]))
        return F.adaptive_avg_pool2d(a[:, None], size)[:, 0], F.adaptive_avg_pool2d(b[:, None], size)[:, 0]
    a, b = a.flatten(1), b.flatten(1)  # a map against tokens: compare as sequences
    n = min(a.shape[1], b.shape[1])
    return F.adaptive_avg_pool1d(a[:, None], n)[:, 0], F.adaptive_avg_pool1d(b[:, None], n)[:, 0]


def at_loss(
    student_feats: list[torch.Tensor],
    teacher_feats: list[torch.Tensor],
    beta: float,
    p: float = 2.0,
    form: str = "code",
) -> torch.Tensor:
    """beta/2 * sum over layers of the distance between normalised attention maps Q.

    Q = normalise(flatten(mean_c |A|^p)).  `code`: mean((Qs - Qt)^2) over batch and
    positions (Zagoruyko's code); `paper`: the L2 norm ||Qs - Qt||_2, averaged over the batch.
    """
    total = student_feats[0].new_zeros((), dtype=torch.float32)
    for fs, ft in zip(student_feats, teacher_feats):
        if fs.dim() == 2 or ft.dim() == 2:
            raise KdbenchError(
                "method at needs spatial features (maps or tokens), got flat vectors; "
                "name other modules with features.teacher / features.student"
            )
        a_s, a_t = _match_spatial(attention_map(fs, p), attention_map(ft, p))
        q_s = F.normalize(a_s.flatten(1), dim=1)
        q_t = F.normalize(a_t.flatten(1), dim=1)
        diff = q_s - q_t
        total = total + (diff.pow(2).mean() if form == "code" else diff.norm(dim=1).mean())
    return beta / 2 * total


# --- FitNet regressors ------------------------------------------------------------


def regressor(student_shape: torch.Size, teacher_shape: torch.Size) -> nn.Module:
    """A module taking the student's canonical hint feature to the teacher's shape.

    Maps: conv-BN-ReLU, with a stride when the student's map is an integer multiple
    of the teacher's, a transposed conv when it is an integer fraction, and adaptive
    pooling (or interpolation) otherwise.  Tokens and vectors: a linear layer on the
    channels (tokens resampled along their length when it differs).  A map against
    tokens or vectors: both are globally pooled and a linear layer maps the channels.
    """
    cs, ct = student_shape[1], teacher_shape[1]
    if len(student_shape) == len(teacher_shape) == 4:
        return _MapRegressor(cs, ct, tuple(student_shape[2:]), tuple(teacher_shape[2:]))
    if len(student_shape) == len(teacher_shape) == 3:
        return _SeqRegressor(cs, ct, teacher_shape[2])
    return _PooledRegressor(cs, ct)


class _MapRegressor(nn.Module):
    def __init__(self, cs: int, ct: int, s_hw: tuple[int, int], t_hw: tuple[int, int]):
        super().__init__()
        self.size = t_hw
        (sh, sw), (th, tw) = s_hw, t_hw
        if (sh, sw) == (th, tw):
            conv: nn.Module = nn.Conv2d(cs, ct, 3, padding=1, bias=False)
        elif sh % th == 0 and sw % tw == 0 and sh // th == sw // tw:
            r = sh // th
            conv = nn.Conv2d(cs, ct, 3, stride=r, padding=1, bias=False)
        elif th % sh == 0 and tw % sw == 0 and th // sh == tw // sw:
            r = th // sh
            conv = nn.ConvTranspose2d(cs, ct, r, stride=r, bias=False)
        else:
            conv = nn.Conv2d(cs, ct, 3, padding=1, bias=False)
        self.body = nn.Sequential(conv, nn.BatchNorm2d(ct), nn.ReLU(inplace=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        if tuple(y.shape[2:]) != self.size:
            larger = y.shape[2] >= self.size[0] and y.shape[3] >= self.size[1]
            y = F.adaptive_avg_pool2d(y, self.size) if larger else F.interpolate(y, size=self.size, mode="bilinear")
        return y


class _SeqRegressor(nn.Module):
    def __init__(self, cs: int, ct: int, length: int):
        super().__init__()
        self.length = length
        self.linear = nn.Linear(cs, ct)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, C, L)
        y = self.linear(x.transpose(1, 2)).transpose(1, 2)
        return y if y.shape[2] == self.length else F.adaptive_avg_pool1d(y, self.length)


class _PooledRegressor(nn.Module):
    def __init__(self, cs: int, ct: int):
        super().__init__()
        self.linear = nn.Linear(cs, ct)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(2).mean(dim=2) if x.dim() > 2 else x)


def pooled(t: torch.Tensor) -> torch.Tensor:
    """(N, C, ...) -> (N, C): the global average a pooled regressor is compared against."""
    return t.flatten(2).mean(dim=2) if t.dim() > 2 else t


# --- the registered methods ---------------------------------------------------------


@register_method("kd", params="kd", doc="Hinton et al. 2015: alpha*T^2*KL(teacher||student) + (1-alpha)*CE")
class KD(Term):
    def __init__(self, config: Any, shapes: Any = None):
        super().__init__()
        self.temperature, self.alpha = config.kd.temperature, config.kd.alpha
        self.ce_weight = 1.0 - self.alpha

    def forward(self, inp: LossInputs) -> torch.Tensor:
        return self.alpha * kd_kl(inp.student_logits, inp.teacher_logits, self.temperature)


@register_method(
    "fitnet",
    params="fitnet",
    doc="Romero et al. 2015 (one stage): beta*MSE(regressor(student hint), teacher hint) + CE",
)
class FitNet(Term):
    needs_features = True

    def __init__(self, config: Any, shapes: Any):
        super().__init__()
        n = len(shapes.teacher)
        index = config.fitnet.hint_layer if config.fitnet.hint_layer is not None else n // 2
        if not -n <= index < n:
            raise KdbenchError(f"fitnet.hint_layer: {index} is outside the {n} paired features; use 0..{n - 1}")
        self.index = index % n
        self.beta = config.fitnet.beta
        self._regressor = [regressor(shapes.student[self.index], shapes.teacher[self.index])]  # owned by the student
        self.pool_target = len(shapes.student[self.index]) != len(shapes.teacher[self.index])

    def adapter(self) -> tuple[int, nn.Module]:
        return self.index, self._regressor[0]

    def forward(self, inp: LossInputs) -> torch.Tensor:
        hint = inp.adapted["fitnet"].float()
        target = inp.teacher_feats[self.index].float()
        if self.pool_target:
            target = pooled(target)
        return self.beta * F.mse_loss(hint, target)


@register_method("at", params="at", doc="Zagoruyko & Komodakis 2017: beta/2*sum_layers d(Q_s, Q_t) + CE")
class AT(Term):
    needs_features = True

    def __init__(self, config: Any, shapes: Any = None):
        super().__init__()
        self.beta, self.p, self.form = config.at.beta, config.at.p, config.at.form

    def forward(self, inp: LossInputs) -> torch.Tensor:
        return at_loss(inp.student_feats, inp.teacher_feats, self.beta, self.p, self.form)


@register_method("dkd", params="dkd", doc="Zhao et al. 2022: min(step/warmup,1)*(alpha*TCKD + beta*NCKD) + CE")
class DKD(Term):
    def __init__(self, config: Any, shapes: Any = None):
        super().__init__()
        c = config.dkd
        self.alpha, self.beta, self.temperature, self.warmup = c.alpha, c.beta, c.temperature, c.warmup

    def forward(self, inp: LossInputs) -> torch.Tensor:
        tckd, nckd = dkd_parts(inp.student_logits, inp.teacher_logits, inp.targets, self.temperature)
        ramp = min((inp.step + 1) / self.warmup, 1.0) if self.warmup else 1.0
        return ramp * (self.alpha * tckd + self.beta * nckd)


class DistillLoss(nn.Module):
    """The cell's whole loss: ce_weight * CE + sum of weighted terms, in FP32 with autocast off."""

    def __init__(self, config: Any, shapes: Any = None):
        super().__init__()
        methods = check_method(config.method)
        check_weights(config.method, config.weights)
        self.names = [m.name for m in methods]
        self.terms = nn.ModuleList(m.cls(config, shapes) for m in methods)
        self.weights = [float(config.weights.get(n, 1.0)) for n in self.names]
        self.ce_weight = min(t.ce_weight for t in self.terms)
        self.needs_features = any(t.needs_features for t in self.terms)

    def forward(self, inp: LossInputs) -> torch.Tensor:
        with torch.amp.autocast(device_type=inp.student_logits.device.type, enabled=False):
            loss = self.ce_weight * F.cross_entropy(inp.student_logits.float(), inp.targets)
            for weight, term in zip(self.weights, self.terms):
                loss = loss + weight * term(inp)
            return loss
