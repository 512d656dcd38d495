"""FLOPs of a callable, counted by torch, and the attention kernels it ran.

:func:`count` runs a callable once under ``torch.utils.flop_counter.FlopCounterMode``, which counts
only matmul-like, convolution and attention ops (2 FLOPs per multiply-add; bias adds, activations,
norms and optimizer updates count 0), forward and backward as they actually execute, and notes
which kernel each ``scaled_dot_product_attention`` call ran, from the aten op it dispatched to
(:data:`ATTENTION_OPS`; a call that reaches none of them ran the math kernel, torch's composite of
matmuls and a softmax).  No extra pass: the kernel is read in the counted call.

Attention is counted as the kernel executes it (the convention MFU rests on, docs/profiling.md):

* the fused kernels (flash, cuDNN, mem-efficient, and the CPU's flash kernel) skip the key blocks a
  causal mask hides, so a causal call (``is_causal=True``) counts its unmasked (query, key) pairs,
  S(S+1)/2 per head for S queries over S keys; torch's own formulas count the whole S×S square
  (they ignore ``is_causal``) and count the CPU's flash kernel not at all;
* the math kernel computes every score of the square and masks it afterwards: its matmuls are
  counted whole, as torch counts them;
* a call with an explicit mask (or none) counts the whole square on every kernel.

The fused kernels compute the diagonal blocks whole, so they execute a little more than counted:
about tile/S of the attention's FLOPs (3 % at 4,096 tokens with 128-row tiles).

Matmuls torch's counter does not see are counted too (:func:`_unseen_formulas`): the in-place ``addmm_`` and
``baddbmm_`` (a fused loss accumulates its head's weight gradient with them: without them ``fused_linear``'s
step counted one head matmul fewer than dense's for the same work), and torch's fused linear cross-entropy
(``F.linear_cross_entropy``'s chunked op, one custom op to the dispatcher, whose matmuls run inside it).

A grouped convolution's backward is counted as executed (:func:`conv_backward_flops`): torch's formula counts its
weight gradient as if every input channel met every output channel, ``groups`` times the work (576x for a
depthwise 5 x 5 convolution of MobileNetV3's, whose backward it counted at 580 times its forward).
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode, addmm_flop, baddbmm_flop, conv_flop_count, flop_registry

FLASH, CUDNN, MEM_EFFICIENT, MATH = "flash", "cudnn", "mem_efficient", "math"

# aten op -> the kernel it is (torch.nn.attention.SDPBackend's names); the CPU's fused kernel is flash's
ATTENTION_OPS = {
    "_scaled_dot_product_flash_attention": FLASH,
    "_scaled_dot_product_flash_attention_for_cpu": FLASH,
    "_scaled_dot_product_cudnn_attention": CUDNN,
    "_scaled_dot_product_efficient_attention": MEM_EFFICIENT,
}
BACKWARD_SUFFIX = "_backward"


@dataclass
class Counted:
    """What :func:`count` saw: the FLOPs, and the ``scaled_dot_product_attention`` calls per kernel."""

    flops: int
    attention: Counter = field(default_factory=Counter)


def causal_pairs(queries: int, keys: int) -> int:
    """The (query, key) pairs a causal mask leaves, as torch's ``is_causal`` aligns it (top left: query i
    sees keys 0..i): S(S+1)/2 when both are S."""
    if queries <= keys:
        return queries * (queries + 1) // 2
    return keys * (keys + 1) // 2 + (queries - keys) * keys


def attention_flops(query: tuple, key: tuple, value: tuple, causal: bool, backward: bool = False) -> int:
    """FLOPs of a fused kernel's attention forward (QKᵀ and PV) or backward (QKᵀ again, dP, dV, dQ, dK) on
    (B, H, S, D) shapes, the key and value's heads possibly fewer (GQA: each serves H / H_kv query heads):
    2 per multiply-add over the pairs the kernel computes (only the unmasked ones when ``causal``)."""
    b, h, s_q, d_q = query
    s_k, d_v = key[-2], value[-1]
    pairs = causal_pairs(s_q, s_k) if causal else s_q * s_k
    per_pair = (3 * d_q + 2 * d_v) if backward else (d_q + d_v)
    return 2 * b * h * pairs * per_pair


def _shape(x: Any) -> tuple:
    return tuple(getattr(x, "shape", x))


class _Attention(TorchFunctionMode):
    """Notes each ``scaled_dot_product_attention`` call's kernel: the fused op counted inside it, else math."""

    def __init__(self, calls: Counter) -> None:
        super().__init__()
        self.calls = calls
        self.open: list[str | None] = []

    def ran(self, kernel: str) -> None:
        if self.open and self.open[-1] is None:
            self.open[-1] = kernel
        elif not self.open:  # a fused op called directly, outside any scaled_dot_product_attention
            self.calls[kernel] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") != "scaled_dot_product_attention":
            return func(*args, **(kwargs or {}))
        self.open.append(None)
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.calls[self.open.pop() or MATH] += 1


def _formula(op, kernel: str, backward: bool, seen: _Attention):
    """The FLOP formula of one fused attention op, counting a causal call as executed (module docstring).
    It takes the op's arguments as the flop counter passes them (tensors, or their shapes on a torch that
    wraps custom formulas), bound to the op's schema by name."""
    arguments = op.default._schema.arguments
    names = [a.name for a in arguments]
    defaults = {a.name: a.default_value for a in arguments if a.has_default_value()}
    first = 1 if backward else 0  # a backward op's grad_out comes before query, key, value
    torchs = flop_registry.get(op)  # torch's own formula (None for the CPU's kernel)

    def formula(*args, out_val=None, out_shape=None, **kwargs) -> int:
        bound = dict(zip(names, args))
        causal = bool(kwargs.get("is_causal", bound.get("is_causal", defaults.get("is_causal", False))))
        query, key, value = (_shape(a) for a in args[first : first + 3])
        if not backward:
            seen.ran(kernel)
        if len(query) != 4:  # a nested (jagged) call: torch's own count (kdbench makes none)
            return torchs(*args, out_val=out_val, **kwargs) if torchs is not None else 0
        return attention_flops(query, key, value, causal, backward)

    formula._get_raw = True  # torch >= 2.4 passes the tensors themselves; older ones their shapes (both read)
    return formula


def _attention_formulas(seen: _Attention) -> dict:
    mapping = {}
    for name, kernel in ATTENTION_OPS.items():
        for backward in (False, True):
            op = getattr(torch.ops.aten, name + (BACKWARD_SUFFIX if backward else ""), None)
            if op is not None:  # an op this torch has
                mapping[op] = _formula(op, kernel, backward, seen)
    return mapping


def linear_cross_entropy_flops(*args, out_val=None, **kwargs) -> int:
    """FLOPs of torch's chunked linear cross-entropy op (``torch_nn::_linear_cross_entropy_batch_chunked``): the
    logits of its input's rows (N×H by the C×H weight, 2·N·C·H) and, in the same forward, the gradients it is asked
    for (its input's and its weight's: 2·N·C·H each; the bias's is a sum, 0 as torch counts bias adds)."""
    names = ("input", "linear_weight")
    bound = {**dict(zip(names, args)), **kwargs}
    x, w = _shape(bound["input"]), _shape(bound["linear_weight"])
    grads = sum(bool(kwargs.get(k, args[i] if len(args) > i else False)) for i, k in _LCE_GRADS)
    rows = math.prod(x[:-1])
    return 2 * rows * w[0] * x[-1] * (1 + grads)


linear_cross_entropy_flops._get_raw = True
_LCE_GRADS = ((12, "compute_input_grad"), (13, "compute_linear_weight_grad"))  # their places in the op's schema


def _in_place(formula):
    """A raw formula (tensors in) of an in-place matmul from torch's formula of its out-of-place op (shapes in)."""

    def counted(self, a, b, *args, out_val=None, **kwargs) -> int:
        return formula(_shape(self), _shape(a), _shape(b))

    counted._get_raw = True
    return counted


def conv_backward_flops(
    grad_out_shape,
    x_shape,
    w_shape,
    bias,
    stride,
    padding,
    dilation,
    transposed,
    output_padding,
    groups,
    output_mask,
    out_shape,
    **kwargs,
) -> int:
    """FLOPs of ``aten.convolution_backward`` (shapes in): torch's count of the input's gradient, and of the weight's
    divided by ``groups``.  Torch's formula (``torch.utils.flop_counter.conv_backward_flop``) counts the weight's
    gradient as the convolution of the input (channels as the batch) with the output's gradient, which multiplies
    every input channel with every output channel; a grouped convolution's weight gradient meets only the
    ``C_in / groups`` channels of its group, as its forward does.  For any groups the backward of a stride-1
    convolution is then twice its forward, as it executes (``tests/unit/measure/test_flops.py``)."""

    def t(shape) -> list:
        return [shape[1], shape[0], *shape[2:]]

    data = conv_flop_count(grad_out_shape, w_shape, out_shape[0], not transposed) if output_mask[0] else 0
    weight = 0
    if output_mask[1]:
        grad_w = t(out_shape[1])
        weight = (
            conv_flop_count(t(grad_out_shape), t(x_shape), grad_w)
            if transposed
            else conv_flop_count(t(x_shape), t(grad_out_shape), grad_w)
        )
    return int(data) + int(weight) // max(1, int(groups))


def _unseen_formulas() -> dict:
    """Formulas of the matmuls torch's counter leaves out (module docstring): in-place addmm_ / baddbmm_ as their
    out-of-place ops, torch's fused linear cross-entropy where this torch has it."""
    mapping = {
        torch.ops.aten.addmm_: _in_place(addmm_flop),
        torch.ops.aten.baddbmm_: _in_place(baddbmm_flop),
        torch.ops.aten.convolution_backward: conv_backward_flops,
    }
    with contextlib.suppress(ImportError):  # the module that registers the op (torch >= 2.13)
        importlib.import_module("torch.nn.modules.linear_cross_entropy")
    chunked = getattr(getattr(torch.ops, "torch_nn", None), "_linear_cross_entropy_batch_chunked", None)
    if chunked is not None:
        mapping[chunked] = linear_cross_entropy_flops
    return mapping


def formulas(seen: _Attention | None = None) -> dict:
    """The formulas kdbench adds to torch's flop counter (the unseen matmuls, attention as executed), keyed by
    operator; ``seen`` notes the attention calls' kernels.  The fit's census (:mod:`kdbench.fit.census`) counts
    with them too, so that its FLOPs are a row's."""
    return {**_unseen_formulas(), **_attention_formulas(seen if seen is not None else _Attention(Counter()))}


def count(fn: Callable[[], Any]) -> Counted:
    """Run ``fn`` once: its FLOPs (2 per multiply-add; attention as executed) and its attention calls per kernel."""
    calls: Counter = Counter()
    seen = _Attention(calls)
    with FlopCounterMode(display=False, custom_mapping=formulas(seen)) as counter, seen:
        fn()
    return Counted(int(counter.get_total_flops()), calls)


def count_flops(fn: Callable[[], Any]) -> int:
    """Run ``fn`` once and return its FLOPs (:func:`count`)."""
    return count(fn).flops


def kernel_label(calls: Counter) -> str | None:
    """``flash``; ``flash+math`` when one model's calls ran several (most calls first); None: no call."""
    kinds = [k for k, n in sorted(calls.items(), key=lambda kv: (-kv[1], kv[0])) if n > 0]
    return "+".join(kinds) or None


def pair_label(teacher: Counter | None, student: Counter) -> str | None:
    """The ``attention_kernel`` column of a step: one label when the teacher's and the student's calls ran the
    same kernels (or the teacher ran none here: cached), ``teacher X, student Y`` when they differ."""
    t, s = kernel_label(teacher or Counter()), kernel_label(student)
    if t is None or s is None or t == s:
        return s or t
    return f"teacher {t}, student {s}"
