"""A token divergence added as a user's module adds it, with no kdbench file edited: Amari's alpha-divergence,
registered with ``register_divergence`` (its value alone) and trained on by a method (a TokenTerm subclass with
``@register_method``).  Every loss implementation that supports a value-only divergence (dense, chunked and
fused_linear, the last two by autograd on each chunk) equals dense and the reference; liger and torch_linear are
refused with a reason, at plan time too; and a tiny LM cell with the method plans, checks and steps.

The registrations are undone after each test (``user_divergence``).  The cell needs the suite schema, which is
built from the method registry when :mod:`kdbench.config.schema` is first imported: it runs in a fresh
interpreter that imports this module and registers before anything imports the schema, the order a user's module
must keep (the divergences module's docstring says so).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from pydantic import Field

from kdbench.core.errors import KdbenchError
from kdbench.distill.lm.divergences import DIVERGENCES, Divergence, Param, TokenLoss, register_divergence
from kdbench.distill.lm.divergences import unregister_divergence as forget_divergence
from kdbench.distill.lm.impls import LOSS_IMPLS, lm_loss, unsupported
from kdbench.distill.lm.impls.memory import logits_memory
from kdbench.distill.lm.terms import TokenParams, TokenTerm
from kdbench.distill.lm.token_losses import Dists
from kdbench.distill.losses import METHODS, register_method
from tests.support.paths import ROOT
from tests.unit.distill.test_lm_impls import assert_matches, make_inputs, reference, run

NAME = "alpha_divergence"


# --------------------------------------------------------------------------------------------- the user's module


def alpha_divergence(
    student: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor | None = None,
    order: float = 0.5,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Amari's alpha-divergence of order a in (0, 1), (1 − Σ_v p_T^a p_S^(1−a)) / (a (1 − a)) per token (a = 1/2:
    four times the squared Hellinger distance), × T², mean over the valid tokens: token_losses' conventions,
    through its Dists (entries with an infinite logit left out)."""
    d = Dists(student, teacher, mask, temperature)
    mixed = (order * d.log_pt + (1.0 - order) * d.log_ps).exp()
    if d.drop is not None:
        mixed = torch.where(d.drop, 0.0, mixed)
    per_token = (d.n_tokens - mixed.sum()) / (order * (1.0 - order))
    return per_token / max(d.n_tokens, 1) * d.scale


class AlphaDivergenceParams(TokenParams):
    """The alpha-divergence per token: alpha * T² * D_order + (1 − alpha) * CE."""

    # the divergence's order a (1/2: 4 × squared Hellinger)
    order: float = Field(0.5, ge=0.05, le=0.95)


class AlphaDivergence(TokenTerm):
    divergence = NAME


def register() -> None:
    """What the user's module does at import: the divergence (its value only), then the method."""
    register_divergence(Divergence(NAME, alpha_divergence, params={"order": Param(0.5, 0.05, 0.95)}))
    register_method(NAME, AlphaDivergenceParams, doc="user: Amari's alpha-divergence per token")(AlphaDivergence)


def unregister() -> None:
    METHODS.pop(NAME, None)
    if NAME in DIVERGENCES:
        forget_divergence(NAME)


# --------------------------------------------------------------------------------------------- the tests


@pytest.fixture
def user_divergence():
    register()
    yield
    unregister()


def test_it_registers_and_is_undone():
    register()
    try:
        assert DIVERGENCES[NAME].value is alpha_divergence and METHODS[NAME].cls is AlphaDivergence
        with pytest.raises(ValueError, match="already registered"):
            register_divergence(Divergence(NAME, alpha_divergence))
    finally:
        unregister()
    assert NAME not in DIVERGENCES and NAME not in METHODS
    with pytest.raises(KdbenchError, match="unknown divergence"):
        TokenLoss(NAME)


def test_the_value_is_the_alpha_divergence(user_divergence):
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(2, 7, 11, generator=g), torch.randn(2, 7, 11, generator=g)
    mask = torch.rand(2, 7, generator=g) > 0.3
    p_t, p_s = (torch.softmax(x[mask].double() / 2.0, -1) for x in (t, s))
    a = 0.3
    want = ((1 - (p_t**a * p_s ** (1 - a)).sum(-1)) / (a * (1 - a))).mean() * 4.0
    close = {"rtol": 1e-5, "atol": 1e-6}  # float32 against float64
    torch.testing.assert_close(alpha_divergence(s, t, mask, order=a, temperature=2.0).double(), want, **close)
    hellinger = 0.5 * ((p_t.sqrt() - p_s.sqrt()) ** 2).sum(-1).mean() * 4.0
    torch.testing.assert_close(alpha_divergence(s, t, mask, temperature=2.0).double(), 4 * hellinger, **close)
    assert alpha_divergence(s, s, mask).abs() < 1e-6


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("temperature", [1.0, 2.0], ids=["T1", "T2"])
def test_every_impl_that_supports_it_equals_dense_and_the_reference(user_divergence, temperature, bias):
    inputs = make_inputs(bias)
    supporting = [impl for impl in LOSS_IMPLS if unsupported(impl, TokenLoss(NAME)) is None]
    assert supporting == ["dense", "natural", "chunked", "fused_linear"]
    for ce_weight in (0.7, 0.0):
        loss = TokenLoss(NAME, temperature=temperature, kd_weight=1.3, ce_weight=ce_weight, order=0.3)
        want = run("dense", loss, inputs)
        assert_matches(want, reference(loss, inputs), what=f"dense {loss}")
        for impl in supporting[1:]:
            for chunk_size in (8, 64):  # several chunks and a ragged last one; one chunk for everything
                assert_matches(run(impl, loss, inputs, chunk_size), want, what=f"{impl} {chunk_size} {loss}")


def test_the_impls_that_do_not_support_it_say_why(user_divergence):
    loss = TokenLoss(NAME, order=0.3)
    for impl in ("liger", "torch_linear"):
        reason = unsupported(impl, loss)
        assert reason is not None and reason.startswith(impl) and NAME in reason and "fused_linear" in reason
        with pytest.raises(KdbenchError, match=impl):
            lm_loss(impl, *make_inputs(), loss)
    assert "alpha_divergence at order=0.3" in unsupported("liger", loss)
    with pytest.raises(KdbenchError, match="order must lie in"):
        TokenLoss(NAME, order=1.5)
    with pytest.raises(KdbenchError, match="takes order, not beta"):
        TokenLoss(NAME, beta=0.5)


def test_its_logits_memory_is_not_counted_rather_than_guessed(user_divergence):
    loss = TokenLoss(NAME, ce_weight=0.5)
    for impl in ("dense", "chunked", "fused_linear"):
        memory = logits_memory(impl, 4096, 32000, 4, 1024, loss)
        assert memory["bytes"] is None and "alpha_divergence's float32 work not counted" in memory["text"]
    assert logits_memory("chunked", 4096, 32000, 4, 1024, TokenLoss("forward_kl"))["bytes"] > 0


CELL = """
import json, sys
assert "kdbench.config.schema" not in sys.modules  # the order: register before the schema is built
import tests.unit.distill.test_lm_divergences as user
assert "kdbench.config.schema" not in sys.modules
user.register()

import torch
from kdbench.workloads import check_cell
from kdbench.config.schema import CellConfig
from kdbench.distill.step import DistillStep
from kdbench.hw.backends import resolve
from kdbench.models import ModelCache
from kdbench.workloads.lm.workload import LM

cpu = resolve("cpu")
out = {"problems": {}, "losses": {}, "grads": {}}
for impl in ("dense", "natural", "chunked", "fused_linear", "liger", "torch_linear"):
    config = CellConfig.model_validate({
        "pair": {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
        "overrides": {"teacher": {"num_hidden_layers": 1}, "student": {"num_hidden_layers": 1}},
        "method": user.NAME, user.NAME: {"temperature": 2.0, "alpha": 0.7, "order": 0.3},
        "batch_size": 2, "data": {"kind": "tokens", "seq_len": 16},
        "loss_impl": impl, "chunk_size": 8,
    })
    assert getattr(config, user.NAME).order == 0.3
    out["problems"][impl] = [[list(key), why] for key, why in check_cell(config, False)]
    if out["problems"][impl]:
        continue
    teacher, student = LM.build_pair(config, cpu, ModelCache())
    x, y = LM.batch(config, config.batch_size, cpu.device, 0, (teacher, student))
    step = DistillStep(teacher, student, x, y, config, cpu, LM)
    step()
    out["losses"][impl] = float(step.last_loss)
    grads = [p.grad.flatten() for p in step.distiller.trainee.parameters() if p.grad is not None]
    out["grads"][impl] = torch.cat(grads).tolist()
print(json.dumps(out))
"""


def test_a_tiny_lm_cell_with_it_checks_and_steps_under_every_impl_that_supports_it():
    proc = subprocess.run([sys.executable, "-c", CELL], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    problems = out["problems"]
    assert problems["dense"] == problems["natural"] == problems["chunked"] == problems["fused_linear"] == []
    for impl in ("liger", "torch_linear"):
        [[key, why]] = problems[impl]
        assert key == ["loss_impl"] and why.startswith(f"{impl} cannot compute alpha_divergence")
    dense = torch.tensor(out["grads"]["dense"])
    assert torch.isfinite(dense).all() and dense.abs().max() > 0
    for impl in ("natural", "chunked", "fused_linear"):
        assert out["losses"][impl] == pytest.approx(out["losses"]["dense"], rel=1e-5)
        grads = torch.tensor(out["grads"][impl])
        assert ((grads - dense).abs().max() / dense.abs().max()).item() <= 1e-5, impl
