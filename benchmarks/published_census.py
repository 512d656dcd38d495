"""One fake run of a published row's operation, seen two ways: torch's plain roofline and kdbench's census.

A row's operation (:mod:`published_ops`) is built and run under ``FakeTensorMode``: shapes and dtypes, no memory and
no arithmetic, so a (16,384 x 131,072) float32 logits tensor costs nothing on a CPU.  It runs once untimed (the
first call creates the ``.grad`` a timed call then accumulates into, as ``triton.testing.do_bench``'s repeats do)
and once recorded, by two dispatch modes at once:

* :class:`RooflineMode`, torch's plain operator-level view (``torch.utils._runtime_estimation``, which
  ``torch.distributed._tools.runtime_estimator``'s "operator-level-cost-model" calls): per aten operator call,
  FLOPs from ``torch.utils.flop_counter``'s registry, bytes = every tensor input and output (torch's
  ``get_num_bytes``: a broadcast dimension counts once).  :func:`roofline_ms` prices it as ``sum over calls of
  max(FLOPs / datasheet peak, bytes / datasheet bandwidth)``.  Where torch's own estimator is weaker than its
  formula, the formula is kept and the weakness left out, so that the baseline is no straw man: calls that run no
  kernel are skipped (views by their schema as well as torch's ``_VIEW_OPS``, which misses ``slice``; allocations,
  ``empty_like`` among them; ``prim`` queries), while creations that write memory (``zeros_like``, which torch's
  ``_CREATE_OPS`` skips) count; and the compute term is FLOPs / peak (torch's ``flops_to_ns`` halves the FLOPs,
  "converts FLOPs to MACs", over 75 % of the peak: a compute term 1.5x smaller).
* kdbench's :class:`~kdbench.fit.census.CensusMode`, what :func:`kdbench.fit.steptime.predict_step_time` prices.

A Triton kernel of Liger's cannot run on fake tensors: its Python wrapper is transcribed (:mod:`published_liger`)
and the kernel itself recorded by :func:`kernel` as one operator that reads and writes the tensors its source
loads and stores, once per pass it makes over them.  The phase (:func:`set_phase`) is "forward" until the timed call
turns to its backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils._runtime_estimation import _FLOAT_TYPES, _VIEW_OPS, get_num_bytes
from torch.utils.flop_counter import flop_registry

from kdbench.core.devices import Card
from kdbench.fit.census import ELEMENTWISE, Census, CensusMode, Record, tensor_bytes

__all__ = ["Fake", "Op", "RooflineMode", "kernel", "roofline_ms", "run_fake", "set_phase"]

PRECISION_OF = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Allocations: no kernel, no byte moved (torch's own list misses them: an empty_like would count its input twice)
_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


@dataclass(frozen=True)
class Op:
    """One operator call as torch's roofline sees it: its FLOPs, bytes read and written, and output dtype."""

    name: str
    flops: int
    bytes: int
    dtype: torch.dtype | None


@dataclass(frozen=True)
class Fake:
    """What one recorded call of a row's operation ran: its calls (torch's view) and kdbench's census of them."""

    ops: tuple[Op, ...]
    census: Census

    @property
    def flops(self) -> int:
        return sum(op.flops for op in self.ops)

    @property
    def bytes(self) -> int:
        return sum(op.bytes for op in self.ops)


class RooflineMode(TorchDispatchMode):
    """Records every aten call as torch's roofline estimator counts it (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if func.namespace != "aten" or packet in _VIEW_OPS or func.is_view or packet.__name__ in _ALLOCATIONS:
            return out  # no kernel runs
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        nbytes = sum(get_num_bytes(t) for t in inputs) + sum(get_num_bytes(t) for t in outputs)
        dtypes = {t.dtype for t in outputs if t.dtype in _FLOAT_TYPES}
        flops = int(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0
        self.ops.append(Op(f"{func.namespace}.{packet.__name__}", flops, nbytes, next(iter(dtypes), None)))
        return out


_STATE: dict = {"phase": "forward", "roofline": None, "census": None}


def set_phase(phase: str) -> None:
    """The phase the operation's ops run in from now on ("forward", "backward"): the census's phase."""
    _STATE["phase"] = phase


def kernel(name: str, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    """A Triton kernel of Liger's, recorded as one operator (module docstring): ``reads`` and ``writes`` list each
    tensor once per pass the kernel's source loads or stores it.  No FLOPs, as torch counts none for elementwise
    work.  kdbench's class: elementwise, a streaming pass over each tensor listed (a row's reduction to its loss stays
    in registers), where torch's softmax kernels, in the softmax-and-reductions class, read a row more often than
    the census counts."""
    read, written = sum(tensor_bytes(t) for t in reads), sum(tensor_bytes(t) for t in writes)
    dtype = writes[0].dtype if writes else None
    roofline, census = _STATE["roofline"], _STATE["census"]
    if roofline is not None:
        roofline.ops.append(Op(f"liger.{name}", 0, read + written, dtype))
    if census is not None:
        dname = str(dtype).removeprefix("torch.") if dtype is not None else ""
        census.add([Record(f"liger.{name}", ELEMENTWISE, _STATE["phase"], dname, 0, read, written, 1)])


def run_fake(build: Callable[[], Callable[[], None]]) -> Fake:
    """``build()`` makes the operation's tensors and returns its timed call; the call runs once untimed, then once
    recorded (module docstring), all on fake tensors."""
    with FakeTensorMode():
        set_phase("forward")
        step = build()
        step()
        roofline = RooflineMode()
        census = CensusMode(lambda: _STATE["phase"])
        census.on = True
        _STATE.update(roofline=roofline, census=census)
        set_phase("forward")
        try:
            with census, roofline:
                step()
        finally:
            _STATE.update(roofline=None, census=None)
            set_phase("forward")
    return Fake(tuple(roofline.ops), census.census())


def op_ms(op: Op, card: Card) -> float:
    """One call's plain roofline on ``card``'s datasheet: max(FLOPs / peak, bytes / bandwidth), in ms.  The peak is
    the dtype's dense figure (float32: the non-tensor-core fp32, torch's default for a float32 matmul)."""
    memory = op.bytes / (card.memory_bandwidth * 1e9)
    compute = 0.0
    if op.flops:
        peak = card.peaks.get(PRECISION_OF.get(op.dtype, "fp32")) or card.peaks["fp32"]
        compute = op.flops / (peak * 1e12)
    return max(memory, compute) * 1e3


def roofline_ms(ops: Sequence[Op], card: Card) -> float:
    """torch's plain roofline of the calls ``ops`` on ``card``: each call's :func:`op_ms`, summed."""
    return sum(op_ms(op, card) for op in ops)
