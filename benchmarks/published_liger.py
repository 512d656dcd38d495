"""What Liger-Kernel's benchmark scripts ran, transcribed to run on fake tensors (:mod:`published_census`).

Each function returns the timed call of one row of ``tests/data/published/liger_benchmark_data.csv``: the tensors
its script made (the untimed setup), then what ``triton.testing.do_bench`` timed for the row's mode (:func:`timed`).
Sources: linkedin/Liger-Kernel, ``benchmark/scripts/benchmark_<kernel>.py`` and the ``src/liger_kernel/ops`` wrappers
at the commit that added each row set (``tests/data/published/README.md`` lists them).  The torch and huggingface
providers are the scripts' own torch code, as written; the liger providers are Liger's wrappers, pure torch around
one Triton kernel each, which :func:`~published_census.kernel` records (reads and writes as the kernel's source
loads and stores them).  Three things no fake tensor can do are left out, each a host read of a value:
``.item()`` on a count (its value, the row count, is known), ``torch.equal``/``torch.ne`` of ``grad_output``
with 1.0 (the scripts' ``y.backward()`` passes 1.0, their random gradients are not 1.0: the branch is known), and
``if torch.all(target == ignore_index)`` (no label is ignored: the comparison runs, the branch is not taken).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from published_census import kernel, set_phase

__all__ = [
    "ce_liger",
    "fl_ce_liger",
    "fl_jsd_liger",
    "hf_distill_jsd",
    "jsd_liger",
    "kl_liger",
    "timed",
    "torch_jsd",
    "tvd_liger",
    "tvd_torch",
]


def leaf(*shape: int, dtype: torch.dtype = torch.float32, grad: bool = True) -> torch.Tensor:
    """A tensor made by the script (``torch.randn``/``rand``: its values do not matter here)."""
    return torch.empty(shape, dtype=dtype).requires_grad_(grad)


def labels(n: int, vocab: int) -> torch.Tensor:
    """``torch.randint(V, (n,))``: next-token targets, none of them ignored."""
    return torch.zeros(n, dtype=torch.long)


def timed(fwd, mode: str, *, clear=(), retain: bool = False, random_grad: bool = False):
    """The call ``do_bench`` times for ``mode`` ("forward", "backward", "full"), as the scripts write it: forward is
    ``fwd()``; backward runs ``fwd()`` once untimed and times ``y.backward(retain_graph=True)``; full times
    ``fwd()`` then ``y.backward()``.  ``clear``: the ``grad_to_none`` tensors, whose ``.grad`` is reset before each
    call; ``random_grad``: the newer scripts' ``y.backward(torch.randn_like(y))``."""

    def backward(y):
        set_phase("backward")
        y.backward(torch.randn_like(y) if random_grad else None, retain_graph=retain)

    def reset():
        set_phase("forward")
        for t in clear:
            t.grad = None

    if mode == "forward":

        def step():
            reset()
            fwd()

    elif mode == "backward":
        y = fwd()

        def step():
            reset()
            backward(y)

    elif mode == "full":

        def step():
            reset()
            backward(fwd())

    else:
        raise ValueError(f"unknown mode {mode!r}")
    return step


# ------------------------------------------------------------------------------------------------- torch's own code


def torch_jsd(log_q, log_p, beta: float = 0.5, dtype=torch.float32, newer: bool = False):
    """The scripts' ``TorchJSD``: ``benchmark_jsd.py`` at 6817c2d3 and ``benchmark_fused_linear_jsd.py`` at ff6650bb
    (``nn.KLDivLoss(batchmean, log_target=True)``, ``m = lerp(exp(log_p), exp(log_q), beta)``); ``newer``: the B200
    script at 8ef203a4 (``reduction="none"``, ``lerp(exp(log_q), exp(log_p))``, each KL summed per row, divided by
    the rows, summed)."""
    log_p, log_q = log_p.to(torch.float), log_q.to(torch.float)
    log_p, log_q = log_p.view(-1, log_p.size(-1)), log_q.view(-1, log_q.size(-1))
    if not newer:
        m = torch.lerp(torch.exp(log_p), torch.exp(log_q), beta)
        kl = torch.nn.KLDivLoss(reduction="batchmean", log_target=True)
        loss = beta * kl(torch.log(m), log_p) + (1 - beta) * kl(torch.log(m), log_q)
        return loss.to(dtype)
    kl = torch.nn.KLDivLoss(reduction="none", log_target=True)
    m = torch.lerp(torch.exp(log_q), torch.exp(log_p), beta)
    loss = beta * kl(torch.log(m), log_p).sum(dim=-1) + (1 - beta) * kl(torch.log(m), log_q).sum(dim=-1)
    return (loss / log_q.shape[0]).sum().to(dtype)


def tvd_torch(p, q):
    """``TorchTVDLoss(reduction="batchmean")`` of ``benchmark_tvd.py`` at 5c9cecc8."""
    tvd = torch.abs(p - q) / 2.0
    return torch.sum(tvd) / p.size(0)


def hf_distill_jsd(hs, ws, ht, wt, target, weight_hard=0.5, weight_soft=0.5, beta=0.5, temperature=1.0):
    """``TorchJSDLoss`` of ``benchmark_distill_jsd_loss.py`` at aa2d23dc: ``test/utils.py``'s
    ``HFDistillationLoss.get_batch_loss_metrics`` with ``test_jsd_loss.py``'s ``HFJSDLoss.distillation_loss``
    (whose beta is its default, 0.5)."""
    student = hs.view(-1, hs.shape[1]) @ ws.t()
    with torch.no_grad():
        teacher = ht.view(-1, ht.shape[1]) @ wt.t()
    s, t = student.view(hs.shape[0], -1).float(), teacher.view(ht.shape[0], -1).float()
    torch.all(target == -100)  # if ...: return 0 (no label is ignored)
    hard = torch.nn.CrossEntropyLoss(ignore_index=-100)(s.view(-1, s.shape[-1]), target.view(-1))
    s /= temperature
    t /= temperature
    s_lp, t_lp = F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1)
    log_m = (beta * s_lp.exp() + (1 - beta) * t_lp.exp()).log()
    s_kl = F.kl_div(log_m, s_lp, reduction="batchmean", log_target=True)
    t_kl = F.kl_div(log_m, t_lp, reduction="batchmean", log_target=True)
    return weight_hard * hard + weight_soft * (beta * t_kl + (1 - beta) * s_kl)


# ------------------------------------------------------------------------------------ Liger's wrappers, kernels as ops


class _CrossEntropy(torch.autograd.Function):
    """``LigerCrossEntropyFunction`` (0.2.1, b5672a15): the kernel overwrites the logits with their gradient (two
    passes over each row: the online max and sum, then the gradient), writes each row's loss."""

    @staticmethod
    def forward(ctx, x, target, ignore_index):
        loss_1d = torch.zeros(x.shape[0], dtype=x.dtype)
        (target != ignore_index).sum()  # .item(): n_non_ignore
        kernel("cross_entropy", reads=[x, x, target], writes=[x, loss_1d])
        ctx.save_for_backward(x.detach())
        return torch.sum(loss_1d) / x.shape[0]

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return x, None, None  # grad_output is 1.0: no element_mul


def ce_liger(x, target):
    return _CrossEntropy.apply(x, target, -100)


class _KLDiv(torch.autograd.Function):
    """``LigerKLDivLossFunction`` (0.2.1, a307eac8), batchmean, probabilities as targets: the forward kernel
    writes each row's loss; the backward kernel writes the gradient into the input, then a division by the rows."""

    @staticmethod
    def forward(ctx, y_pred, y_true):
        out = torch.zeros(y_pred.shape[0], dtype=torch.float32)
        kernel("kl_div_forward", reads=[y_pred, y_true], writes=[out])
        ctx.save_for_backward(y_pred, y_true)
        return out.sum() / y_pred.shape[0]

    @staticmethod
    def backward(ctx, grad_output):
        y_pred, y_true = ctx.saved_tensors
        kernel("kl_div_backward", reads=[y_true], writes=[y_pred])
        return y_pred / y_pred.shape[0], None  # grad_output is 1.0: no multiplication


def kl_liger(y_pred, y_true):
    return _KLDiv.apply(y_pred, y_true)


class _JSD(torch.autograd.Function):
    """``LigerJSDFunction``: 0.3.1 (6817c2d3: batchmean, the loss divided by the rows) and 0.8.0 (8ef203a4: the
    label-aware kernel, no label passed, the loss summed).  Its kernel reads both log-probabilities and writes the
    per-entry loss (a (BT, V) float32 buffer, zero-filled first) and the input's gradient, in one pass."""

    @staticmethod
    def forward(ctx, x, y, newer: bool, grad_is_one: bool):
        loss = torch.zeros(x.shape, dtype=torch.float32)
        dx = torch.empty_like(x)
        kernel("jsd", reads=[x, y], writes=[loss, dx])
        loss = torch.sum(loss) if newer else torch.sum(loss) / x.shape[0]
        ctx.save_for_backward(dx)
        ctx.grad_is_one = grad_is_one
        return loss.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        (dx,) = ctx.saved_tensors
        return (dx if ctx.grad_is_one else grad_output * dx), None, None, None


def jsd_liger(x, y, newer: bool = False, grad_is_one: bool = True):
    return _JSD.apply(x, y, newer, grad_is_one)


class _TVD(torch.autograd.Function):
    """``LigerTVDLossFunction`` (0.7.0, 5c9cecc8), batchmean: one kernel reads both distributions and writes each
    row's loss and the scaled gradient."""

    @staticmethod
    def forward(ctx, p, q, grad_is_one: bool):
        out = torch.zeros(p.shape[0], dtype=torch.float32)
        grads = torch.empty_like(p)
        kernel("tvd", reads=[p, q], writes=[out, grads])
        ctx.save_for_backward(grads)
        ctx.grad_is_one = grad_is_one
        return out.sum()

    @staticmethod
    def backward(ctx, grad_output):
        (grads,) = ctx.saved_tensors
        return (grads if ctx.grad_is_one else grads * grad_output), None, None


def tvd_liger(p, q, grad_is_one: bool = True):
    return _TVD.apply(p, q, grad_is_one)


def _chunking(bt: int, v: int, h: int) -> tuple[int, int]:
    """Liger's fused-linear chunk: ``inc_factor = cdiv(V, H)``, ``chunk = next_power_of_2(cdiv(BT, inc_factor))``."""
    inc = -(-v // h)
    chunk = 1 << max(0, (-(-bt // inc) - 1).bit_length())
    return chunk, -(-bt // chunk)


class _FusedLinearCE(torch.autograd.Function):
    """``LigerFusedLinearCrossEntropyFunction`` (0.4.2, 90fb5e4a), reduction mean, no bias: per chunk the logits
    (model dtype), the cross-entropy kernel in place, then ``grad_input`` and an ``addmm`` into ``grad_weight``
    (a zero-filled (V, H) buffer in the weight's dtype), all in the forward."""

    @staticmethod
    def forward(ctx, x, weight, target):
        bt, h = x.shape
        chunk, n = _chunking(bt, weight.shape[0], h)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        grad_input = torch.zeros_like(x)
        loss_1d = torch.zeros(bt, dtype=torch.float32)
        total = (target != -100).sum()
        for i in range(n):
            lo, hi = i * chunk, min((i + 1) * chunk, bt)
            x_chunk = x[lo:hi]
            logits = x_chunk @ weight.t()
            target_chunk, loss_slice = target[lo:hi], loss_1d[lo:hi]
            (target_chunk != -100).sum()  # .item()
            kernel("cross_entropy", reads=[logits, logits, target_chunk], writes=[logits, loss_slice])
            alpha = (hi - lo) / total
            loss_1d[lo:hi] = loss_slice * alpha
            grad_logits = logits * alpha
            grad_input[lo:hi] = grad_logits @ weight
            if grad_weight is not None:
                torch.addmm(grad_weight, logits.t(), x_chunk, out=grad_weight, alpha=(hi - lo) / bt, beta=1.0)
        ctx.save_for_backward(grad_input.detach(), grad_weight.detach() if grad_weight is not None else None)
        return torch.sum(loss_1d)

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight = ctx.saved_tensors
        return grad_input, grad_weight, None  # grad_output is 1.0: no element_mul


def fl_ce_liger(x, weight, target):
    return _FusedLinearCE.apply(x, weight, target)


class _FusedLinearJSD(torch.autograd.Function):
    """``LigerFusedLinearJSDFunction`` (0.3.1, ff6650bb), temperature 1: per chunk both heads, both log-softmaxes
    (model dtype), the JSD kernel (its gradient over the student's log-probabilities, in place; the loss into a
    (BT, V) float32 buffer), the gradient through the log-softmax, ``grad_input`` and an ``addmm`` into
    ``grad_weight``, all in the forward; no teacher gradient."""

    @staticmethod
    def forward(ctx, xs, ws, xt, wt, beta: float, temperature: float):
        bt, h = xs.shape
        chunk, n = _chunking(bt, ws.shape[0], h)
        grad_weight = torch.zeros_like(ws) if ws.requires_grad else None
        grad_input = torch.zeros_like(xs)
        loss_1d = torch.zeros((bt, ws.shape[0]), dtype=torch.float32)
        for i in range(n):
            lo, hi = i * chunk, min((i + 1) * chunk, bt)
            xs_chunk = xs[lo:hi]
            s = (xs_chunk @ ws.t()) / temperature
            t = (xt[lo:hi] @ wt.t()) / temperature
            s_lp = torch.log_softmax(s, dim=-1).contiguous()
            t_lp = torch.log_softmax(t, dim=-1).contiguous()
            loss_slice = loss_1d[lo:hi]
            kernel("jsd", reads=[s_lp, t_lp], writes=[loss_slice, s_lp])
            loss_1d[lo:hi] = loss_slice
            g = (
                s_lp - torch.softmax(s, dim=-1) * s_lp.sum(dim=-1, keepdim=True).broadcast_to(s_lp.shape)
            ) / temperature
            grad_input[lo:hi] = g @ ws
            if grad_weight is not None:
                torch.addmm(grad_weight, g.t(), xs_chunk, out=grad_weight)
        ctx.save_for_backward(grad_input.detach(), grad_weight.detach() if grad_weight is not None else None)
        return torch.sum(loss_1d).to(xs.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight = ctx.saved_tensors
        return grad_input, grad_weight, None, None, None, None  # grad_output is 1.0: no element_mul


def fl_jsd_liger(xs, ws, xt, wt, beta: float = 0.5, temperature: float = 1.0):
    return _FusedLinearJSD.apply(xs, ws, xt, wt, beta, temperature)
