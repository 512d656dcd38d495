"""Token-level divergences between the student's and the teacher's next-token distributions: one record
per divergence, in one registry, under the name of the method that trains on it (``forward_kl``,
``reverse_kl``, ``jsd``, ``tvd``, ``skew_fkl``, ``skew_rkl``); and :class:`TokenLoss`, what a loss
implementation (:mod:`kdbench.distill.lm.impls`) computes.

A :class:`Divergence` holds everything kdbench computes the divergence with, wherever it is computed:

* ``value`` (the one field a divergence must give): the divergence of student and teacher logits with a
  mask of the valid tokens, under :mod:`~kdbench.distill.lm.token_losses`' conventions (float32,
  p = softmax(logits / T), × T², the mean over the valid tokens, infinite logits left out); called as
  ``value(student, teacher, mask, temperature=T, **params)``.  The built-ins are token_losses' functions.
* ``terms``: its entries over a :class:`~kdbench.distill.lm.token_losses.Dists` (``value`` is their
  reduction), which lets ``dense`` skip the drop masks where no logit can be infinite.
* ``chunk_grad``: a chunk's value and its gradient by hand (:func:`chunk_grad` says what it returns), for
  ``chunked`` and ``fused_linear``, which then hold fewer float32 buffers than autograd on the chunk.
* ``dense_fp32`` / ``chunk_fp32``: the float32 logits-sized buffers ``dense`` holds at its peak and the
  chunk-sized ones of ``chunk_grad``, counted (:mod:`kdbench.distill.lm.impls.memory`).
* ``liger_beta``: the beta of Liger-Kernel's generalised JSD that computes it at these parameters (None:
  none does).  Beta 0 is the forward KL, which is also what ``torch_linear`` can compute.
* ``params``: its parameters (``beta``, ``lam``), each a :class:`Param` with its default and range; the
  method's parameter model gives the values (fields of the same name).
* ``special``: the divergence it *is* at some parameters (jsd at beta 0: the forward KL), computed as
  that one (its ``chunk_grad`` and counts).

A user's divergence.  A module that calls ``register_divergence(Divergence("name", value))`` and registers
a method whose term is a :class:`~kdbench.distill.lm.terms.TokenTerm` subclass with ``divergence =
"name"`` runs on LM pairs with no kdbench file edited.  With ``value`` alone it runs under ``dense``
(``value`` on the valid rows), ``chunked`` and ``fused_linear`` (autograd through ``value`` on each chunk:
the same value and gradient, more float32 buffers per chunk than a hand-written ``chunk_grad``); ``liger``
takes it only with a ``liger_beta``, ``torch_linear`` only where that beta is 0 (the forward KL); the cell
is refused at plan time otherwise.  Without counts its ``logits_memory_bytes`` is left empty.  The suite
schema is built from the method registry when :mod:`kdbench.config.schema` is first imported: import the
module that registers the method before anything that imports it (``kdbench.config``, ``kdbench.api``,
``kdbench.cli``); :mod:`kdbench.distill.lm.divergences`, :mod:`kdbench.distill.lm.terms` and
:mod:`kdbench.distill.losses.registry` do not import it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kdbench.core.errors import KdbenchError
from kdbench.core.registry import Registry
from kdbench.distill.lm import token_losses
from kdbench.distill.lm.token_losses import log_mixture

__all__ = [
    "DIVERGENCES",
    "Divergence",
    "Param",
    "TokenLoss",
    "get_divergence",
    "liger_beta",
    "register_divergence",
    "resolved",
    "unregister_divergence",
]


@dataclass(frozen=True)
class Param:
    """A divergence's parameter: its default (what a loss that does not set it uses) and its range."""

    default: float
    low: float = 0.0
    high: float = 1.0


ChunkGrad = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Divergence:
    """One token-level divergence and every form kdbench computes it in (the module docstring says each)."""

    name: str
    value: Callable[..., torch.Tensor]
    terms: Callable[..., torch.Tensor] | None = None
    chunk_grad: ChunkGrad | None = None
    dense_fp32: float | None = None
    chunk_fp32: float | None = None
    liger_beta: Callable[[Mapping[str, float]], float | None] | None = None
    params: Mapping[str, Param] = field(default_factory=dict)
    special: Callable[[Mapping[str, float]], str | None] | None = None

    def describe(self, params: Mapping[str, float]) -> str:
        """Its name, with its parameters' values where it has any (``skew_fkl at lam=0.1``)."""
        if not self.params:
            return self.name
        return f"{self.name} at " + ", ".join(f"{k}={params[k]}" for k in self.params)


DIVERGENCES: Registry[Divergence] = Registry("divergence", tail=", or None for CE only")


def register_divergence(div: Divergence) -> Divergence:
    """Add ``div`` to :data:`DIVERGENCES` under its name (a name may be registered once)."""
    return DIVERGENCES.register(div.name, div)


def unregister_divergence(name: str) -> None:
    """Remove divergence ``name`` (a test's registration, undone)."""
    DIVERGENCES.unregister(name)


def get_divergence(name: str) -> Divergence:
    """The registered divergence ``name``; a KdbenchError naming the registered ones otherwise."""
    return DIVERGENCES.find(name)


# ------------------------------------------------------------------------------------------------ what to compute


@dataclass(frozen=True, init=False)
class TokenLoss:
    """What to compute: ``ce_weight · CE + kd_weight · D``, D the registered divergence ``divergence`` (None:
    CE only) at ``temperature`` with its parameters (``TokenLoss("jsd", beta=0.2)``; a parameter left out
    takes its :class:`Param` default)."""

    divergence: str | None
    temperature: float
    kd_weight: float
    ce_weight: float
    params: tuple[tuple[str, float], ...]  # the divergence's parameters, each with its value, in its order

    def __init__(
        self,
        divergence: str | None = None,
        temperature: float = 1.0,
        kd_weight: float = 1.0,
        ce_weight: float = 0.0,
        **params: float,
    ) -> None:
        declared = get_divergence(divergence).params if divergence is not None else {}
        if not (temperature > 0 and math.isfinite(temperature)):
            raise KdbenchError(f"temperature must be a positive number, got {temperature}")
        for key in params:
            if key not in declared:
                takes = ", ".join(declared) or "no parameter"
                raise KdbenchError(f"{divergence or 'CE alone'} takes {takes}, not {key}")
        values = []
        for key, param in declared.items():
            value = params.get(key, param.default)
            if not param.low <= value <= param.high:
                raise KdbenchError(f"{key} must lie in [{param.low:g}, {param.high:g}], got {value}")
            values.append((key, float(value)))
        for name, value in (("kd_weight", kd_weight), ("ce_weight", ce_weight)):
            if not (math.isfinite(value) and value >= 0):
                raise KdbenchError(f"{name} must be a finite number >= 0, got {value}")
        for name, value in (
            ("divergence", divergence),
            ("temperature", temperature),
            ("kd_weight", kd_weight),
            ("ce_weight", ce_weight),
            ("params", tuple(values)),
        ):
            object.__setattr__(self, name, value)

    @property
    def kwargs(self) -> dict[str, float]:
        """The divergence's parameters as keyword arguments of its functions."""
        return dict(self.params)

    @property
    def has_kd(self) -> bool:
        return self.divergence is not None and self.kd_weight != 0

    @property
    def has_ce(self) -> bool:
        return self.ce_weight != 0


def resolved(loss: TokenLoss) -> tuple[Divergence, dict[str, float]]:
    """The divergence ``loss`` computes and its parameters, its ``special`` case followed (jsd at beta 0: the
    forward KL, whose hand-written gradient and counts apply)."""
    div, params = get_divergence(loss.divergence), loss.kwargs
    other = div.special(params) if div.special is not None else None
    return (get_divergence(other), {}) if other is not None else (div, params)


def liger_beta(loss: TokenLoss) -> float | None:
    """The beta of liger's generalised JSD that computes ``loss.divergence``, None if none does.

    Liger's ``distillation_loss_fn`` (jsd_loss.py) mixes m = beta·p_T + (1 − beta)·p_S and is
    ``beta·KL(p_T‖m) + (1 − beta)·KL(p_S‖m)``, forward KL at beta = 0 and reverse KL at 1, special-
    cased: TRL's (and kdbench's) convention.  The skew KLs at lam = 0 are those KLs too.
    """
    div = get_divergence(loss.divergence)
    return div.liger_beta(loss.kwargs) if div.liger_beta is not None else None


# ------------------------------------------------------------------------------------------------ the built-ins
#
# A chunk_grad takes a chunk's float32 (C, V) log p_s, log p_t, p_s and p_t (the entries where either logit is
# infinite: 0 in all four) and the divergence's parameters, and returns (Σ D over the chunk, a) with
# a = ∂(Σ D)/∂log p_s + p_s·∂(Σ D)/∂p_s on the kept entries; the driver
# (:func:`kdbench.distill.lm.impls.chunks.chunk_value_grad`) turns a into the gradient w.r.t. the logits.  It may
# overwrite its inputs but p_s (read after it returns).


def _forward_kl_grad(ls, lt, ps, pt):  # L = p_t (log p_t − log p_s); a = −p_t
    a = torch.sub(lt, ls).mul_(pt)
    total = a.sum()
    torch.neg(pt, out=a)
    return total, a


def _reverse_kl_grad(ls, lt, ps, pt):  # L = p_s (log p_s − log p_t); a = p_s (1 + log p_s − log p_t)
    a = torch.sub(ls, lt).mul_(ps)
    total = a.sum()
    a.add_(ps)
    return total, a


def _total_variation_grad(ls, lt, ps, pt):  # L = ½|p_t − p_s|; a = −½ p_s sign(p_t − p_s)
    a = torch.sub(pt, ps)
    total = 0.5 * a.abs().sum()
    a.sign_().mul_(ps).mul_(-0.5)
    return total, a


def _jsd_grad(ls, lt, ps, pt, beta):
    # 0 < beta < 1 (its ends are the KLs, see `special`): m = w p_t + (1 − w) p_s;
    # L = w p_t log(p_t/m) + (1 − w) p_s log(p_s/m); a = (1 − w) p_s log(p_s/m): the terms through m sum to
    # −(1 − w) p_s, cancelling ∂L/∂log p_s's own
    w = beta
    lm = log_mixture(lt, ls, w)
    a = torch.sub(lt, lm).mul_(pt)
    total = w * a.sum()
    torch.sub(ls, lm, out=a).mul_(ps)
    total = total + (1.0 - w) * a.sum()
    a.mul_(1.0 - w)
    return total, a


def _skew_forward_kl_grad(ls, lt, ps, pt, lam):
    # m = w p_t + (1 − w) p_s; L = p_t (log p_t − log m); a = −(1 − w) p_t p_s / m
    w = lam
    lm = log_mixture(lt, ls, w)
    a = torch.sub(lt, lm).mul_(pt)
    total = a.sum()
    torch.sub(ls, lm, out=a).exp_().mul_(pt).mul_(-(1.0 - w))
    return total, a


def _skew_reverse_kl_grad(ls, lt, ps, pt, lam):
    # m = w p_s + (1 − w) p_t; L = p_s (log p_s − log m); a = p_s (1 + log p_s/m − w p_s/m)
    w = lam
    lm = log_mixture(ls, lt, w)
    a = torch.sub(ls, lm)
    ratio = a.exp()
    a.mul_(ps)
    total = a.sum()
    a.add_(ps).sub_(ratio.mul_(ps), alpha=w)
    del ratio
    return total, a


def _at_zero(beta: float) -> Callable[[Mapping[str, Any]], float | None]:
    """A skew KL's liger beta: the KL it is at lam = 0, none otherwise."""
    return lambda p: beta if p["lam"] == 0.0 else None


# Counts: float32 (rows, V) buffers at the peak of one forward + backward, taken with a dispatch mode that
# tracks every storage created (every token valid, float32 and bf16 logits), rounded to 1/4 (a bool mask is 1/4
# of a float32 buffer).  dense_fp32: dense's float32 work beside its two float32 logits, heads without a bias,
# T = 1, no CE (the rest: the dense impl's own :func:`~kdbench.distill.lm.impls.dense.work`); chunk_fp32:
# chunk_grad's working set with the chunk's logits (the chunk impls add CE's).
for _div in (
    Divergence(
        "forward_kl",
        token_losses.forward_kl,
        token_losses.forward_kl_terms,
        _forward_kl_grad,
        dense_fp32=3,
        chunk_fp32=6,
        liger_beta=lambda p: 0.0,
    ),
    Divergence(
        "reverse_kl",
        token_losses.reverse_kl,
        token_losses.reverse_kl_terms,
        _reverse_kl_grad,
        dense_fp32=3,
        chunk_fp32=6,
        liger_beta=lambda p: 1.0,
    ),
    Divergence(
        "jsd",
        token_losses.generalized_jsd,
        token_losses.generalized_jsd_terms,
        _jsd_grad,
        dense_fp32=9,
        chunk_fp32=8,
        liger_beta=lambda p: p["beta"],
        params={"beta": Param(0.5)},  # 0: forward KL, 1: reverse KL (TRL >= 0.16)
        special=lambda p: {0.0: "forward_kl", 1.0: "reverse_kl"}.get(p["beta"]),
    ),
    Divergence(
        "tvd",
        token_losses.total_variation,
        token_losses.total_variation_terms,
        _total_variation_grad,
        dense_fp32=5,
        chunk_fp32=7,
    ),
    Divergence(
        "skew_fkl",
        token_losses.skew_forward_kl,
        token_losses.skew_forward_kl_terms,
        _skew_forward_kl_grad,
        dense_fp32=4,
        chunk_fp32=8,
        liger_beta=_at_zero(0.0),
        params={"lam": Param(0.1)},  # the mixture's share of the first distribution (DistiLLM)
    ),
    Divergence(
        "skew_rkl",
        token_losses.skew_reverse_kl,
        token_losses.skew_reverse_kl_terms,
        _skew_reverse_kl_grad,
        dense_fp32=6,
        chunk_fp32=8,
        liger_beta=_at_zero(1.0),
        params={"lam": Param(0.1)},
    ),
):
    register_divergence(_div)
del _div
