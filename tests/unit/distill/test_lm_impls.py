"""kdbench.distill.lm.impls: every implementation of "LM heads + token loss" equals dense, and dense equals
token_losses' reference functions.

Parity is in float32 at small shapes (37 tokens, a 97-word vocabulary, chunks of 8: several chunks
and a ragged last one), with -100 labels, with and without biases, at T = 1 and 2; the error is
max |x − dense| / max |dense| per tensor (loss, grad of h_s, W_s, b_s).  The memory tests record
every tensor the dispatcher creates in one forward + backward (no timing, no RSS).
"""

from __future__ import annotations

import importlib.util
import warnings

import liger_kernel  # noqa: F401  (in the test extra: liger's tests must run, never skip)
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kdbench.core.errors import KdbenchError
from kdbench.core.install import extra_hint
from kdbench.distill.lm.divergences import DIVERGENCES, TokenLoss
from kdbench.distill.lm.impls import LOSS_IMPLS, lm_loss, unavailable, unsupported
from kdbench.distill.lm.impls.memory import logits_memory
from kdbench.measure.flops import count_flops

N, V, HS, HT, CHUNK = 37, 97, 16, 24, 8
RTOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_inputs(bias=True, dtype=torch.float32, shape=(N,), n=None, vocab=V, seed=0):
    """Student/teacher hidden states and heads, labels with every fifth token -100."""
    g = torch.Generator().manual_seed(seed)
    tokens = shape if n is None else (n,)
    hs = torch.randn(*tokens, HS, generator=g).to(dtype).requires_grad_()
    ws = (torch.randn(vocab, HS, generator=g) * 0.3).requires_grad_()
    bs = (torch.randn(vocab, generator=g) * 0.1).requires_grad_() if bias else None
    ht = torch.randn(*tokens, HT, generator=g).to(dtype)
    wt = torch.randn(vocab, HT, generator=g) * 0.3
    bt = torch.randn(vocab, generator=g) * 0.1 if bias else None
    labels = torch.randint(0, vocab, tokens, generator=g)
    labels.view(-1)[::5] = -100
    return hs, ws, bs, ht, wt, bt, labels


def run(impl, loss, inputs, chunk_size=CHUNK, **kwargs):
    """The loss and the gradients w.r.t. h_s, W_s (and b_s) after one backward."""
    hs, ws, bs, ht, wt, bt, labels = [t.detach().clone() if t is not None else None for t in inputs]
    for t in (hs, ws, bs):
        if t is not None:
            t.requires_grad_()
    out = lm_loss(impl, hs, ws, bs, ht, wt, bt, labels, loss, chunk_size, **kwargs)
    assert out.dtype == torch.float32 and out.dim() == 0
    out.backward()
    return [out.detach()] + [t.grad for t in (hs, ws, bs) if t is not None]


def assert_matches(got, want, rtol=RTOL, what=""):
    names = ["loss", "grad h_s", "grad W_s", "grad b_s"]
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what} {name}: {g.shape}/{g.dtype} vs {w.shape}/{w.dtype}"
        assert torch.isfinite(g).all(), f"{what} {name} not finite"
        err = ((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30)).item()
        assert err <= rtol, f"{what} {name}: relative error {err:.2e} > {rtol}"


def loss_for(divergence, temperature=1.0, ce_weight=0.7, **kw):
    if divergence is None:
        return TokenLoss(None, temperature=temperature, ce_weight=1.0)
    return TokenLoss(divergence, temperature=temperature, kd_weight=1.3, ce_weight=ce_weight, **kw)


PAIRS = [
    (impl, div) for impl in LOSS_IMPLS[1:] for div in (None, *DIVERGENCES) if unsupported(impl, loss_for(div)) is None
]


# --------------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("temperature", [1.0, 2.0], ids=["T1", "T2"])
@pytest.mark.parametrize(("impl", "divergence"), PAIRS)
def test_equals_dense(impl, divergence, temperature, bias):
    inputs = make_inputs(bias)
    for ce_weight in (0.7, 0.0) if divergence else (1.0,):  # CE + D, D alone
        loss = loss_for(divergence, temperature, ce_weight)
        assert_matches(run(impl, loss, inputs), run("dense", loss, inputs), what=f"{impl} {loss}")


def test_the_registry_names_what_the_schema_and_the_report_take():
    import typing

    from kdbench.config.schema import LossImpl
    from kdbench.distill.lm.impls.base import IMPLS
    from kdbench.report.lm import tables as report_lm

    assert LOSS_IMPLS == tuple(IMPLS) == typing.get_args(LossImpl) == report_lm.LOSS_IMPLS
    assert all(IMPLS[name].name == name for name in LOSS_IMPLS)


def test_pairs_cover_what_each_impl_supports():
    by_impl = {impl: {d for i, d in PAIRS if i == impl} for impl in LOSS_IMPLS[1:]}
    assert by_impl["natural"] == by_impl["chunked"] == by_impl["fused_linear"] == {None, *DIVERGENCES}
    assert by_impl["liger"] == {None, "forward_kl", "reverse_kl", "jsd"}
    assert by_impl["torch_linear"] == {None, "forward_kl"}


@pytest.mark.parametrize(
    "loss",
    [
        TokenLoss("jsd", beta=0.0, temperature=2.0, ce_weight=0.5),  # forward KL
        TokenLoss("jsd", beta=1.0, temperature=2.0, ce_weight=0.5),  # reverse KL
        TokenLoss("skew_fkl", lam=0.0, temperature=2.0),  # forward KL
        TokenLoss("skew_rkl", lam=0.0, temperature=2.0),  # reverse KL
        TokenLoss("skew_fkl", lam=1.0),  # identically 0
        TokenLoss("skew_rkl", lam=1.0, ce_weight=0.5),
    ],
    ids=str,
)
def test_the_ends_of_beta_and_lam(loss):
    inputs = make_inputs()
    want = run("dense", loss, inputs)
    for impl in LOSS_IMPLS[1:]:
        if unsupported(impl, loss) is None:
            assert_matches(run(impl, loss, inputs), want, what=impl)
    assert unsupported("liger", TokenLoss("skew_fkl", lam=0.0)) is None
    assert unsupported("torch_linear", TokenLoss("jsd", beta=0.0)) is None


@pytest.mark.parametrize("impl", LOSS_IMPLS[1:])
def test_batched_shapes_and_chunk_sizes(impl):
    inputs = make_inputs(shape=(3, 13))
    loss = loss_for("forward_kl", 2.0)
    want = run("dense", loss, inputs)
    for chunk_size in (1, 5, 64):  # one token a chunk, ragged chunks, one chunk for everything
        assert_matches(run(impl, loss, inputs, chunk_size), want, what=f"{impl} chunk {chunk_size}")


@pytest.mark.parametrize("divergence", list(DIVERGENCES))
def test_infinite_logits_are_left_out_as_dense_does(divergence):
    # -inf biases: student-only, teacher-only and shared -inf logits (token_losses' drop convention)
    hs, ws, bs, ht, wt, bt, labels = make_inputs()
    with torch.no_grad():
        bs[[3, 50]] = float("-inf")
        bt[[3, 7]] = float("-inf")
    labels[(labels == 3) | (labels == 50)] = 11
    inputs = (hs, ws, bs, ht, wt, bt, labels)
    loss = loss_for(divergence, 2.0, 0.5)
    want = run("dense", loss, inputs)
    assert all(torch.isfinite(t).all() for t in want)
    for impl in ("natural", "chunked", "fused_linear"):
        assert_matches(run(impl, loss, inputs), want, what=impl)


@pytest.mark.parametrize("impl", LOSS_IMPLS)
def test_bf16_hidden_states(impl):
    # A sanity bound, not parity: in bf16 the impls round at different places (torch_linear's chunked
    # path computes the logits in float32, liger its divergence in bf16; see impls.py).
    inputs = make_inputs(dtype=torch.bfloat16)
    loss = loss_for("forward_kl", 2.0)
    got = run(impl, loss, inputs)
    assert got[1].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    assert_matches(got, run("dense", loss, inputs), rtol=3e-2, what=impl)


def test_torch_linear_stays_on_the_chunked_path():
    # F.linear_cross_entropy falls back to its reference path (materialising the logits) with a warning
    for dtype in (torch.float32, torch.bfloat16):
        inputs = make_inputs(dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            run("torch_linear", loss_for("forward_kl", 2.0), inputs)


# --------------------------------------------------------------------------------------------- edges


@pytest.mark.parametrize("impl", LOSS_IMPLS)
def test_no_valid_token_gives_zero_loss_and_zero_grads(impl):
    inputs = list(make_inputs(shape=(2, 9)))
    inputs[-1] = torch.full((2, 9), -100)
    for divergence in ("forward_kl", None):
        got = run(impl, loss_for(divergence, 2.0), inputs)
        assert got[0].item() == 0.0
        for grad in got[1:]:
            assert torch.isfinite(grad).all() and not grad.any()


@pytest.mark.parametrize("impl", LOSS_IMPLS)
def test_no_grad_mode_and_the_teacher_stays_constant(impl):
    hs, ws, bs, ht, wt, bt, labels = make_inputs()
    wt.requires_grad_()
    loss = loss_for("forward_kl")
    with torch.no_grad():
        value = lm_loss(impl, hs, ws, bs, ht, wt, bt, labels, loss, CHUNK)
    assert not value.requires_grad
    out = lm_loss(impl, hs, ws, bs, ht, wt, bt, labels, loss, CHUNK)
    torch.testing.assert_close(out.detach(), value)
    out.backward()
    assert wt.grad is None and hs.grad is not None


@pytest.mark.parametrize("impl", ["chunked", "fused_linear"])
def test_second_backward_raises(impl):
    hs, ws, bs, ht, wt, bt, labels = make_inputs()
    out = lm_loss(impl, hs, ws, bs, ht, wt, bt, labels, loss_for("forward_kl"), CHUNK) * 2.0
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        out.backward()


def test_bad_arguments():
    hs, ws, bs, ht, wt, bt, labels = make_inputs()
    loss = loss_for("forward_kl")
    for chunk_size in (0, -1, 1.5, True):
        with pytest.raises(KdbenchError, match="chunk_size"):
            lm_loss("fused_linear", hs, ws, bs, ht, wt, bt, labels, loss, chunk_size)
    with pytest.raises(KdbenchError, match="unknown LM loss implementation"):
        lm_loss("fused", hs, ws, bs, ht, wt, bt, labels, loss)
    with pytest.raises(KdbenchError, match="labels"):
        lm_loss("dense", hs, ws, bs, ht, wt, bt, labels[:-1], loss)
    with pytest.raises(KdbenchError, match="vocabularies differ"):
        lm_loss("dense", hs, ws, bs, ht, wt[:-1], None, labels, loss)
    with pytest.raises(KdbenchError, match="no term"):
        lm_loss("dense", hs, ws, bs, ht, wt, bt, labels, TokenLoss())
    with pytest.raises(KdbenchError, match="liger cannot compute tvd"):
        lm_loss("liger", hs, ws, bs, ht, wt, bt, labels, TokenLoss("tvd"))
    for bad in ({"divergence": "kl"}, {"temperature": 0.0}, {"beta": 1.5}, {"lam": -0.1}, {"ce_weight": -1.0}):
        with pytest.raises(KdbenchError):
            TokenLoss(**bad)


# --------------------------------------------------------------------------------------------- plan-time checks


@pytest.mark.parametrize(
    ("impl", "loss"),
    [("liger", TokenLoss(d)) for d in ("tvd", "skew_fkl", "skew_rkl")]
    + [("torch_linear", TokenLoss(d)) for d in ("reverse_kl", "jsd", "tvd", "skew_fkl", "skew_rkl")],
    ids=lambda x: x if isinstance(x, str) else x.divergence,
)
def test_unsupported_says_why_and_what_instead(impl, loss):
    reason = unsupported(impl, loss)
    assert reason is not None and reason.startswith(impl) and loss.divergence in reason and "fused_linear" in reason


def test_unavailable_by_feature(monkeypatch):
    assert all(unavailable(impl) is None for impl in LOSS_IMPLS)  # this environment has both

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == "liger_kernel" else real_find_spec(name, *a, **k),
    )
    assert unavailable("liger") == f"liger needs liger-kernel, which is not installed: {extra_hint('liger')}"
    hs, ws, bs, ht, wt, bt, labels = make_inputs()
    with pytest.raises(KdbenchError, match="liger-kernel, which is not installed"):
        lm_loss("liger", hs, ws, bs, ht, wt, bt, labels, loss_for("forward_kl"))

    monkeypatch.delattr(F, "linear_cross_entropy")
    reason = unavailable("torch_linear")
    assert torch.__version__ in reason and "linear_cross_entropy" in reason and "install a torch" in reason
    assert unavailable("fused_linear") is None


# --------------------------------------------------------------------------------------------- memory structure


class CreatedTensors(TorchDispatchMode):
    """(numel, dtype) of every tensor each aten op returns, backward included."""

    def __init__(self):
        super().__init__()
        self.created: list[tuple[int, torch.dtype, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.created.append((t.numel(), t.dtype, str(func)))
        return out


def created_by(impl, dtype, divergence="forward_kl"):
    # 64 tokens (51 valid: every fifth is -100) × 997: a (valid tokens, V) tensor, the size of dense's logits, is
    # larger than either head (V × 24) and a chunk (16 × V)
    inputs = make_inputs(dtype=dtype, n=64, vocab=997)
    mode = CreatedTensors()
    with mode:
        run(impl, loss_for(divergence), inputs, chunk_size=16)
    return int((inputs[-1] != -100).sum()) * 997, mode.created


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_and_liger_never_hold_the_logits(dtype):
    size, dense = created_by("dense", dtype)
    assert any(n >= size for n, _, _ in dense)  # the recorder sees the logits where they exist
    assert any(n >= size and "backward" in op for n, _, op in dense)  # ... and backward's ops
    for impl in ("fused_linear", "liger"):
        _, created = created_by(impl, dtype)
        assert max(n for n, _, _ in created) < size, impl
    _, created = created_by("torch_linear", dtype, None)
    assert max(n for n, _, _ in created) < size


def test_chunked_never_holds_float32_logits():
    size, dense = created_by("dense", torch.bfloat16)
    assert any(n >= size and d == torch.float32 for n, d, _ in dense)  # dense upcasts them whole
    for divergence in DIVERGENCES:
        _, created = created_by("chunked", torch.bfloat16, divergence)
        assert any(n >= size and d == torch.bfloat16 for n, d, _ in created)  # the logits, their gradient
        assert not any(n >= size and d == torch.float32 for n, d, _ in created), divergence


def test_every_impl_counts_the_heads_matmuls_it_runs():
    # 2 FLOPs per multiply-add of each head matmul the impl executes, over its rows: the student's logits and its two
    # gradients (w.r.t. h_s and W_s), the teacher's logits; fused_linear's in-place addmm_ and torch_linear's fused
    # op counted as dense's autograd matmuls are. torch_linear's CE runs on every row (masked ones too) and its KD
    # recomputes the student's logits; liger and natural run their heads on every row.
    inputs = make_inputs(bias=False)
    n_valid = int((inputs[-1] != -100).sum())
    loss = loss_for("forward_kl")
    student, teacher = 2 * V * HS, 2 * V * HT  # per row
    want = {
        "dense": n_valid * (3 * student + teacher),
        "natural": N * (3 * student + teacher),
        "chunked": n_valid * (3 * student + teacher),
        "fused_linear": n_valid * (3 * student + teacher),
        "torch_linear": N * 3 * student + n_valid * (3 * student + teacher),
        "liger": N * (3 * student + teacher),
    }
    for impl, flops in want.items():
        assert count_flops(lambda impl=impl: run(impl, loss, inputs)) == flops, impl


def test_logits_memory_estimate():
    loss = TokenLoss("forward_kl", ce_weight=1.0)
    est = {impl: logits_memory(impl, 4096, 32000, 4, 1024, loss) for impl in LOSS_IMPLS}
    assert est["dense"]["buffers"] == 2 + 3 and est["dense"]["bytes"] == 5 * 4096 * 32000 * 4
    assert est["natural"]["buffers"] == 2 + 4  # + F.cross_entropy's own log-softmax
    assert est["chunked"]["buffers"] == 3 and est["fused_linear"]["buffers"] == 0
    assert est["torch_linear"]["buffers"] == 1 and est["liger"]["chunk_rows"] == 1024
    assert est["fused_linear"]["bytes"] < est["chunked"]["bytes"] < est["dense"]["bytes"]
    assert "4096×32000 fp32" in est["dense"]["text"] and est["dense"]["text"].endswith("2500 MiB")
    bf16 = logits_memory("chunked", 4096, 32000, 2, 1024, loss)
    assert "16-bit" in bf16["text"] and bf16["bytes"] < est["chunked"]["bytes"]
    assert logits_memory("liger", 5000, 100, 4, 1024, loss)["chunk_rows"] == 1250  # torch.chunk into 4
    with pytest.raises(KdbenchError):
        logits_memory("dense", 4096, 32000, 4, 0, loss)


def test_logits_memory_counts_the_valid_tokens_where_the_heads_run_on_them_alone():
    loss = TokenLoss("forward_kl", ce_weight=1.0)
    for impl in LOSS_IMPLS:  # a quarter of the tokens are prompt: the heads of all but liger and natural skip them
        masked = logits_memory(impl, 4096, 32000, 4, 1024, loss, n_valid=3072)
        want = logits_memory(impl, 4096 if impl in ("liger", "natural") else 3072, 32000, 4, 1024, loss)
        assert masked == want, impl
    assert "3072×32000" in logits_memory("dense", 4096, 32000, 4, 1024, loss, n_valid=3072)["text"]
    assert "4096×32000" in logits_memory("natural", 4096, 32000, 4, 1024, loss, n_valid=3072)["text"]


# --------------------------------------------------------------------------------------------- dense vs the reference


def reference(loss, inputs):
    """ce_weight · F.cross_entropy + kd_weight · the token_losses function, on the whole logits with a mask: the
    definition dense must equal (its value and the gradients w.r.t. h_s, W_s, b_s)."""
    hs, ws, bs, ht, wt, bt, labels = [t.detach().clone() if t is not None else None for t in inputs]
    for t in (hs, ws, bs):
        if t is not None:
            t.requires_grad_()
    s, t = F.linear(hs, ws, bs), F.linear(ht, wt, bt)
    out = loss.ce_weight * F.cross_entropy(s, labels, ignore_index=-100)
    if loss.divergence is not None:
        fn = DIVERGENCES[loss.divergence].value
        out = out + loss.kd_weight * fn(s, t, labels != -100, temperature=loss.temperature, **loss.kwargs)
    out.backward()
    return [out.detach()] + [t.grad for t in (hs, ws, bs) if t is not None]


@pytest.mark.parametrize("bias", [False, True, "inf"], ids=["nobias", "bias", "inf_bias"])
@pytest.mark.parametrize("divergence", [None, *DIVERGENCES])
def test_dense_equals_the_token_losses_reference(divergence, bias):
    hs, ws, bs, ht, wt, bt, labels = make_inputs(bias=bool(bias))
    if bias == "inf":  # student-only, teacher-only and shared -inf logits
        with torch.no_grad():
            bs[[3, 50]] = float("-inf")
            bt[[3, 7]] = float("-inf")
        labels[(labels == 3) | (labels == 50)] = 11
    inputs = (hs, ws, bs, ht, wt, bt, labels)
    for temperature in (1.0, 2.0):
        for ce_weight in (0.7, 0.0) if divergence else (1.0,):
            loss = loss_for(divergence, temperature, ce_weight)
            want = reference(loss, inputs)
            assert all(torch.isfinite(t).all() for t in want)
            assert_matches(run("dense", loss, inputs), want, what=f"dense {loss}")


# ------------------------------------------------------------------------------- natural vs TRL and torchtune

# natural is the step as TRL's GKD trainer (huggingface/trl f2cd57710ae3, trl/experimental/gkd/gkd_trainer.py,
# GKDTrainer.compute_loss without liger) and torchtune's KD recipe (pytorch/torchtune bd2a0fc7,
# recipes/knowledge_distillation_single_device.py, _loss_step and train) write it.  Their loss functions are the
# transcriptions of tests/unit/distill/test_token_losses.py; the code around them is transcribed here.
from tests.unit.distill.test_token_losses import torchtune_forward_kl_loss, trl_generalized_jsd_loss  # noqa: E402


def trl_compute_loss(student_logits, teacher_logits, input_labels, beta, temperature):
    """GKDTrainer.compute_loss's non-liger branch from the models' logits on: the causal shift (logits at i predict
    the label at i + 1), then generalized_jsd_loss (num_items_in_batch=None: batchmean over the valid tokens)."""
    shifted_student_logits = student_logits[:, :-1, :]
    shifted_teacher_logits = teacher_logits[:, :-1, :]
    shifted_labels = input_labels[:, 1:]
    return trl_generalized_jsd_loss(
        shifted_student_logits, shifted_teacher_logits, shifted_labels, beta=beta, temperature=temperature
    )


def torchtune_loss_step(logits, teacher_logits, labels, kd_ratio):
    """The recipe's _loss_step and its weighting in train(): logits and labels flattened, ForwardKLLoss and the class
    loss (torch.nn.CrossEntropyLoss(ignore_index=-100), its config's loss), (1 - kd_ratio) CE + kd_ratio KD."""
    labels = labels.reshape(-1)
    logits = logits.reshape(-1, logits.size(-1))
    teacher_logits = teacher_logits.reshape(-1, teacher_logits.size(-1))
    kd_loss = torchtune_forward_kl_loss(logits, teacher_logits, labels)
    class_loss = torch.nn.CrossEntropyLoss(ignore_index=-100)(logits, labels)
    return (1 - kd_ratio) * class_loss + kd_ratio * kd_loss


def lm_batch_with_prompt(seed=1):
    """(B, S) hidden states and heads without biases (the registered LMs have none), TRL's input labels (the tokens,
    -100 on the prompt) and kdbench's labels (the next token at each position, -100 on the last and the prompt)."""
    hs, ws, _, ht, wt, _, _ = make_inputs(bias=False, shape=(3, 13), seed=seed)
    ids = torch.randint(0, V, (3, 13), generator=torch.Generator().manual_seed(seed))
    input_labels = ids.clone()
    input_labels[:, :4] = -100  # a prompt of 4 tokens
    input_labels[2, 10:] = -100  # and padding at the end of one sequence
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = input_labels[:, 1:]
    return (hs, ws, None, ht, wt, None, labels), input_labels


def grads_of(fn, inputs):
    hs, ws = (t.detach().clone().requires_grad_() for t in inputs[:2])
    out = fn(hs, ws)
    out.backward()
    return [out.detach(), hs.grad, ws.grad]


@pytest.mark.parametrize("temperature", [1.0, 2.0], ids=["T1", "T2"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_natural_is_trls_gkd_loss(beta, temperature):
    inputs, input_labels = lm_batch_with_prompt()
    ht, wt = inputs[3], inputs[4]
    loss = TokenLoss("jsd", beta=beta, temperature=temperature, kd_weight=1.0, ce_weight=0.0)

    def trl(hs, ws):  # the models' .logits: the heads over every position; TRL does not scale by T²
        return trl_compute_loss(F.linear(hs, ws), F.linear(ht, wt), input_labels, beta, temperature) * temperature**2

    want = grads_of(trl, inputs)
    assert_matches(run("natural", loss, inputs), want, what="natural vs TRL")
    assert_matches(run("dense", loss, inputs), want, what="dense vs TRL")


def test_natural_is_torchtunes_kd_recipe_step():
    inputs, _ = lm_batch_with_prompt(seed=2)
    _, _, _, ht, wt, _, labels = inputs
    kd_ratio = 0.3
    loss = TokenLoss("forward_kl", kd_weight=kd_ratio, ce_weight=1 - kd_ratio)

    def torchtune(hs, ws):
        return torchtune_loss_step(F.linear(hs, ws), F.linear(ht, wt), labels, kd_ratio)

    want = grads_of(torchtune, inputs)
    got = run("natural", loss, inputs)
    # ForwardKLLoss is the cross-entropy form: larger by the teacher's entropy (mean over the valid tokens), the same
    # gradient
    log_pt = F.log_softmax(F.linear(ht, wt)[labels != -100], -1)
    entropy = -(log_pt.exp() * log_pt).sum(-1).mean()
    torch.testing.assert_close(got[0] + kd_ratio * entropy, want[0], rtol=RTOL, atol=0)
    assert_matches(got[1:], want[1:], what="natural vs torchtune")
    assert_matches(run("dense", loss, inputs)[1:], want[1:], what="dense vs torchtune")


def test_natural_runs_the_heads_and_the_float32_work_on_every_position():
    # what dense saves against it: natural's largest float32 buffers span every position, dense's the valid ones
    inputs = make_inputs(bias=False, n=64, vocab=997)  # no bias: dense reads CE from its log-softmax
    n_valid = int((inputs[-1] != -100).sum())
    for impl, rows in (("natural", 64), ("dense", n_valid)):
        mode = CreatedTensors()
        with mode:
            run(impl, loss_for("forward_kl"), inputs, chunk_size=16)
        assert max(n for n, d, _ in mode.created if d == torch.float32) == rows * 997, impl
    # and F.cross_entropy's own log-softmax: one more (N, V) log-softmax than dense makes at T = 1
    counts = {}
    for impl in ("natural", "dense"):
        mode = CreatedTensors()
        with mode:
            run(impl, loss_for("forward_kl"), inputs)
        counts[impl] = sum("_log_softmax.default" in op for _, _, op in mode.created)
    assert counts == {"natural": 3, "dense": 2}
