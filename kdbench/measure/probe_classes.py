"""The probe's per-class rates: what the step-time model prices an operator class with beyond the dense matmul and the
copy (:mod:`kdbench.measure.probe`).

A CPU runs several of a distillation step's operator classes far from its large-matmul and large-copy ceilings, and
no datasheet says how far: a vectorised ``exp`` (every softmax, log-softmax, logsumexp and their backwards) is
compute-bound at about a third of the copy's bandwidth; the fused attention kernel reaches about a third of the
matmul's rate; a depthwise convolution a small share of a dense one's; a bf16 elementwise kernel converts each
element to fp32 and back.  :func:`measure_classes` measures one representative operator of each, per dtype, as a
probe row (``kind``, ``dtype``, ``value`` in its ``unit``), timed as the matmul and the copy are (the fast end of
the timed calls):

* ``exp``: ``torch.exp`` into a preallocated output, elements per second (``Gelem/s``);
* ``elementwise``: ``torch.add`` of two tensors into a third, bytes read and written per second (``GB/s``);
* ``attention``: causal ``scaled_dot_product_attention``, forward, FLOPs as :mod:`kdbench.measure.flops` counts
  them (the causal pairs), ``TFLOP/s``;
* ``conv`` and ``conv_grouped``: a 3 x 3 convolution, dense and depthwise (groups = channels), forward,
  ``TFLOP/s``;
* ``conv_backward`` and ``conv_grouped_backward``: the same convolutions' backward (``aten.convolution_backward``:
  the input's and the weight's gradients, FLOPs as :mod:`kdbench.measure.flops` counts them, twice the forward's),
  ``TFLOP/s``: a CPU's backward kernels are not its forward's (on kdbench's CI machine type, idle, oneDNN's fp32
  depthwise backward ran at 34 GFLOP/s against 53 forward, and a bf16 16-channel 32 x 32 one at 121 against 308);
* ``launch``: the time of one call of a tiny operator (``op``: an add of two 1-element tensors; ``conv`` and
  ``conv_backward``: a 1 x 1 convolution of one 8-channel pixel and its backward), microseconds (``us``): what a
  call costs beyond its arithmetic and bytes.

Each is measured at a fixed, stated shape (:data:`SHAPES`): a rate, not a fit to any step.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from kdbench.hw.backends import DTYPES, Backend
from kdbench.measure.flops import count_flops
from kdbench.measure.probe import CPU_MIN_TIME_S, GPU_MIN_TIME_S, times_ms

# The shapes each class is measured at (a CPU's; a GPU's are 8x larger where it says (n) so its kernels fill it)
SHAPES = {
    "exp": "16 Mi elements (64 MiB in fp32)",
    "elementwise": "16 Mi elements, a + b -> c",
    "attention": "batch 2, 8 heads, 512 tokens, head 64, causal",
    "conv": "batch 32, 64 -> 64 channels, 16 x 16, 3 x 3, padding 1",
    "conv_grouped": "batch 32, 96 channels in 96 groups, 16 x 16, 3 x 3, padding 1",
    "conv_backward": "conv's, its input's and weight's gradients",
    "conv_grouped_backward": "conv_grouped's, its input's and weight's gradients",
    "launch": "1 element (op); batch 1, 8 channels, 1 x 1 (conv, conv_backward)",
}
UNITS = {
    "exp": "Gelem/s",
    "elementwise": "GB/s",
    "attention": "TFLOP/s",
    "conv": "TFLOP/s",
    "conv_grouped": "TFLOP/s",
    "conv_backward": "TFLOP/s",
    "conv_grouped_backward": "TFLOP/s",
    "launch": "us",
}


def _row(kind: str, dtype: str) -> dict[str, Any]:
    return {
        "kind": kind,
        "dtype": dtype,
        "size": None,
        "value": None,
        "unit": UNITS[kind],
        "median_ms": None,
        "p05_ms": None,
        "error": None,
    }


def _rate(
    kind: str,
    dtype: str,
    build: Callable[[torch.dtype, torch.device], tuple[Callable[[], Any], float, int]],
    backend: Backend,
    times: Callable[[Callable[[], Any]], tuple[float, float]],
) -> dict[str, Any]:
    """One row: ``build`` gives (the call, its work in the unit's numerator, a size); value = work / fast time."""
    row = _row(kind, dtype)
    try:
        fn, work, size = build(DTYPES[dtype], backend.device)
        median, fast = times(fn)
        per_s = work / (fast / 1e3)
        scale = {"Gelem/s": 1e9, "GB/s": 1e9, "TFLOP/s": 1e12}[UNITS[kind]]
        row.update(size=size, median_ms=median, p05_ms=fast, value=per_s / scale)
    except (RuntimeError, TypeError, NotImplementedError, ValueError) as exc:
        row["error"] = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return row


def _exp(dtype, device, n):
    x = torch.randn(n, device=device).to(dtype)
    out = torch.empty_like(x)
    return (lambda: torch.exp(x, out=out)), float(n), n


def _add(dtype, device, n):
    a = torch.randn(n, device=device).to(dtype)
    b, out = torch.randn_like(a), torch.empty_like(a)
    return (lambda: torch.add(a, b, out=out)), float(3 * n * a.element_size()), n


def _attention(dtype, device, scale):
    q, k, v = (torch.randn(2, 8, 512 * scale, 64, device=device).to(dtype) for _ in range(3))

    def fn():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    return fn, float(count_flops(fn)), q.numel()


def _conv(dtype, device, groups: int, channels: int, scale, backward: bool = False):
    x = torch.randn(32 * scale, channels, 16, 16, device=device).to(dtype)
    w = torch.randn(channels, channels // groups, 3, 3, device=device).to(dtype)

    def fn():
        return torch.nn.functional.conv2d(x, w, None, 1, 1, 1, groups)

    if backward:  # the gradients of the input and the weight, as a step's backward asks for them (no bias)
        grad, mask = torch.randn_like(fn()), [True, True, False]

        def fn():
            conv = torch.ops.aten.convolution_backward
            return conv(grad, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], groups, mask)

    return fn, float(count_flops(fn)), x.numel()


def measure_classes(
    backend: Backend,
    dtypes: tuple[str, ...] = ("fp32", "bf16"),
    elements: int | None = None,
    times: Callable[[Callable[[], Any]], tuple[float, float]] | None = None,
) -> list[dict[str, Any]]:
    """The class rows of a probe (module docstring) for each of ``dtypes`` the device computes in (``fp32``,
    ``bf16``, ``fp16``; tf32 is the matmul's mode, not a class's), then the launch floors.  ``elements``: the
    exp's and the add's size (default 16 Mi; a GPU's 8x); ``times(fn)``: (median, fast) milliseconds of ``fn``'s
    timed calls (:func:`kdbench.measure.probe.times_ms` by default).  A class the device cannot run in a dtype
    gives value None and its error: no failure ends the probe."""
    gpu = backend.device_type != "cpu"
    scale = 8 if gpu else 1
    n = elements or 16 * 2**20 * scale
    if times is None:
        min_time = (GPU_MIN_TIME_S if gpu else CPU_MIN_TIME_S) / 2

        def times(fn):
            return times_ms(fn, backend, min_time)

    rows = []
    for d in (d for d in dtypes if d in ("fp32", "bf16", "fp16")):
        rows.append(_rate("exp", d, lambda t, dev: _exp(t, dev, n), backend, times))
        rows.append(_rate("elementwise", d, lambda t, dev: _add(t, dev, n), backend, times))
        rows.append(_rate("attention", d, lambda t, dev: _attention(t, dev, scale), backend, times))
        rows.append(_rate("conv", d, lambda t, dev: _conv(t, dev, 1, 64, scale), backend, times))
        rows.append(_rate("conv_grouped", d, lambda t, dev: _conv(t, dev, 96, 96, scale), backend, times))
        for kind, groups, channels in (("conv_backward", 1, 64), ("conv_grouped_backward", 96, 96)):
            build = partial(_conv, groups=groups, channels=channels, scale=scale, backward=True)
            rows.append(_rate(kind, d, build, backend, times))
    rows += _launch_floors(backend, times)
    return rows


def _launch_floors(backend: Backend, times) -> list[dict[str, Any]]:
    """Microseconds per call of a tiny add, a tiny convolution and its backward (``dtype`` names which)."""
    device = backend.device
    one = torch.ones(1, device=device)
    x = torch.randn(1, 8, 1, 1, device=device, requires_grad=True)
    w = torch.randn(8, 8, 1, 1, device=device, requires_grad=True)
    y = torch.nn.functional.conv2d(x, w)
    grad = torch.ones_like(y)
    mask = [True, True, False]

    def conv_backward():
        return torch.ops.aten.convolution_backward(grad, x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, mask)

    calls = {
        "op": lambda: torch.add(one, one),
        "conv": lambda: torch.nn.functional.conv2d(x.detach(), w.detach()),
        "conv_backward": conv_backward,
    }
    rows = []
    for name, fn in calls.items():
        row = _row("launch", name)
        try:
            median, fast = times(fn)
            row.update(size=1, median_ms=median, p05_ms=fast, value=fast * 1e3)
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            row["error"] = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        rows.append(row)
    return rows
