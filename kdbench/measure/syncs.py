"""Counting host-device synchronisations in a callable: the timed step must have none.

On a GPU, torch's own sync debug mode reports every synchronising call (``torch.cuda.
set_sync_debug_mode``).  On the CPU nothing synchronises, so :func:`count_syncs` counts the
calls that *would* make the host wait for a device there: reading a value (``.item()``,
``float(t)``), and operations whose output size depends on the data (``nonzero``,
boolean-mask indexing, ``masked_select``, ``unique``) — seen through a
``TorchDispatchMode``.  Tensors that stay on the host on a GPU too (the optimizer's step
counters) can be exempted.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kdbench.hw.backends import Backend

aten = torch.ops.aten
# Operations that make the host wait for the device: a value read back, or an output whose size the
# host only learns from the data.
SYNCING = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.nonzero_static,
    aten.masked_select,
    aten.is_nonzero,
    aten.equal,
    aten.allclose,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.repeat_interleave,
}
_BOOL_INDEXED = {aten.index, aten.index_put, aten.index_put_}


def _tensors(args: Any) -> Iterable[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _tensors(a)


class _WouldSync(TorchDispatchMode):
    def __init__(self, exempt: set[int]):
        super().__init__()
        self.exempt = exempt
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        tensors = list(_tensors(args))
        if packet in SYNCING and not any(t.data_ptr() in self.exempt for t in tensors[:1]):
            self.calls.append(str(packet))
        elif packet in _BOOL_INDEXED and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in _tensors(args[1:2])
        ):
            self.calls.append(f"{packet} with a boolean mask")
        return func(*args, **(kwargs or {}))


def sync_calls(fn: Callable[[], Any], backend: Backend, exempt: Iterable[torch.Tensor] = ()) -> list[str]:
    """The synchronising calls ``fn()`` makes (see the module docstring), in order."""
    if backend.device_type == "cuda":
        torch.cuda.synchronize(backend.device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    with _WouldSync({t.data_ptr() for t in exempt}) as mode:
        fn()
    return mode.calls


def optimizer_host_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's step counters: host tensors on a GPU too (unless it is fused or capturable)."""
    return [s["step"] for s in optimizer.state.values() if torch.is_tensor(s.get("step"))]
