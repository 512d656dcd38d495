"""An operator call at its exact shapes, written down and timed again on real tensors: what the step-time model prices
a step's operators with on the machine it runs on.

The fit planner's fake run sees every aten operator a cell's step calls, with its arguments' shapes, strides and
dtypes (:class:`kdbench.fit.census.CensusMode`).  :func:`signature` writes one call down as a JSON string (a tensor
as its shape, strides and dtype; scalars, lists, dtypes and the device as they are); :func:`time_signatures` builds
each signature's arguments on a device (random values; integer and boolean tensors zero, so that every index is
valid) and times the operator's calls back to back, :func:`kdbench.measure.timing.timed_loop` on the backend's
clock: its median, in seconds per call.  This is torch's own "operator-level benchmark"
(``torch.distributed._tools.runtime_estimator.RuntimeEstimator``, ``estimate_mode_type="operator-level-benchmark"``):
a fake run's operators timed one by one on the device at hand, which a roofline cannot replace on a CPU, where
oneDNN's and the BLAS's rates depend on the shape (a 16-channel 32 x 32 convolution at a third of a 64-channel
16 x 16 one's; a depthwise 5 x 5 with a 1 x 1 output at 1/25 of the depthwise rate).

What a timed call holds that the step's call does not: the bare dispatch from Python (the probe's ``launch_op``,
which the model takes off again) and, for an output of 32 MiB or more, the first touch of its new pages (which the
step's call pays too).  What it lacks: the step's caches (a call timed alone finds its inputs in cache, as the
step's do when the previous operator wrote them).  Not replayed (:data:`NOT_REPLAYED`): collectives (they would wait
for ranks that are not there), queries and the profiler's marks, and a call whose arguments cannot be rebuilt (its
tensors overlap where it writes; it raises): those keep the roofline's price.  Operators of other namespaces are
replayed: torch's own composite kernels (``torch_nn._linear_cross_entropy_batch_chunked``, whose chunks run inside
it, unseen by the census) are timed whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import torch

from kdbench.hw.backends import Backend, math_mode
from kdbench.measure.timing import timed_loop

# How long each signature is timed: a cold call, a warm one, then at least MIN_CALLS calls and MIN_TIME_S of them, at
# most MAX_CALLS, all within BUDGET_S (a slow call is timed fewer times: timed_loop's budget)
MIN_CALLS, MAX_CALLS, MIN_TIME_S, BUDGET_S = 3, 50, 0.005, 0.25
_TENSOR, _VALUE, _DEVICE = "t", "v", "device"
_VALUES = {
    str(v): v
    for v in (
        *(getattr(torch, n) for n in ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8")),
        *(getattr(torch, n) for n in ("uint8", "bool", "complex64", "strided", "sparse_coo")),
        *(getattr(torch, n) for n in ("contiguous_format", "channels_last", "preserve_format", "channels_last_3d")),
    )
}
# Operator namespaces never replayed: collectives (they wait for ranks that are not there), queries and marks
NOT_REPLAYED = frozenset(
    {"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "_dtensor", "prim", "profiler"}
)
# The process's timed signatures, by device and thread count: a worker's cells of one pair share most of them
_TIMED: dict[tuple[str, int, bool, str], float | None] = {}


def _encode(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {_TENSOR: [list(value.shape), list(value.stride()), str(value.dtype).removeprefix("torch.")]}
    if isinstance(value, torch.device):
        return {_DEVICE: True}
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return {_VALUE: str(value)}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {"kw": {k: _encode(v) for k, v in value.items()}}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    raise TypeError(f"an argument of type {type(value).__name__}")


def signature(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> str | None:
    """One call of ``func`` written down (module docstring), or None where it cannot be replayed (a collective, a
    profiler's mark or a query, an argument that is neither a tensor nor a plain value)."""
    if func.namespace in NOT_REPLAYED:
        return None
    try:
        return json.dumps([str(func), _encode(list(args)), _encode(dict(kwargs))["kw"]], separators=(",", ":"))
    except (TypeError, ValueError):
        return None


def _decode(value: Any, device: torch.device) -> Any:
    if isinstance(value, list):
        return [_decode(v, device) for v in value]
    if not isinstance(value, dict):
        return value
    if _TENSOR in value:
        shape, stride, dtype = value[_TENSOR]
        t = torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device=device)
        if t.is_floating_point() or t.is_complex():
            t.normal_()
        else:
            t.zero_()
        return t
    if _DEVICE in value:
        return device
    return _VALUES[value[_VALUE]]


def _operator(name: str) -> torch._ops.OpOverload:
    namespace, packet, overload = name.split(".", 2) if name.count(".") >= 2 else (*name.split("."), "default")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


def call_of(sig: str, device: torch.device) -> Callable[[], Any]:
    """A call of the operator ``sig`` writes down, on new arguments on ``device`` (module docstring)."""
    name, args, kwargs = json.loads(sig)
    func = _operator(name)
    args, kwargs = _decode(args, device), {k: _decode(v, device) for k, v in kwargs.items()}
    return lambda: func(*args, **kwargs)


def time_signatures(sigs: Iterable[str], backend: Backend, tf32: bool = False) -> dict[str, float]:
    """Seconds per call of each signature in ``sigs`` on ``backend``'s device, float32 matmuls in TF32 where
    ``tf32`` (module docstring); a signature that cannot be replayed is left out.  Timed once per process, device,
    thread count and math mode."""
    device = backend.device
    threads = torch.get_num_threads()
    out: dict[str, float] = {}
    with math_mode(tf32):
        for sig in dict.fromkeys(sigs):
            key = (str(device), threads, tf32, sig)
            if key not in _TIMED:
                _TIMED[key] = _time_one(sig, backend)
            if _TIMED[key] is not None:
                out[sig] = _TIMED[key]
    return out


def _time_one(sig: str, backend: Backend) -> float | None:
    try:
        with torch.no_grad():
            call = call_of(sig, backend.device)
            raw = timed_loop(
                call,
                backend.clock(),
                warmup=1,
                min_iters=MIN_CALLS,
                min_time_s=MIN_TIME_S,
                max_iters=MAX_CALLS,
                budget_s=BUDGET_S,
            )
    except Exception:  # arguments it cannot be called on (overlapping outputs, an index out of range): not priced
        return None
    samples = sorted(raw.samples_ms)
    return samples[len(samples) // 2] / 1e3
