"""The operators of a cell's step, counted in the fit planner's fake run: what the step-time model prices.

:class:`CensusMode` is a ``TorchDispatchMode`` entered beside the planner's meter (:class:`~kdbench.fit.tracker.
LiveBytes`) in the same fake run, so that one run gives the peak and the census.  While :attr:`CensusMode.on` (the
planner turns it on for the last fake step: a step with the optimizer's state, as every timed one is) it records,
per aten operator call:

* **FLOPs**, from ``torch.utils.flop_counter``'s registered formulas and the ones kdbench adds to them
  (:func:`kdbench.measure.flops.formulas`: in-place matmuls, fused attention counted as executed, torch's fused
  linear cross-entropy): the same formulas a row's ``flops`` column is counted with, so a census's total is the
  row's count for the same step (2 per multiply-add; everything but matmuls, convolutions and attention is 0);
* **bytes read** (its tensor inputs) and **written** (its tensor outputs): each tensor's ``numel x element
  size``, but at most its storage's bytes (an expanded bias reads its own few bytes, not the broadcast's);
* its **output dtype** and the **phase** it ran in (the planner's phase clock);
* its **class** (:data:`CLASSES`): matmul/conv, attention, softmax-and-reductions, elementwise-and-casts,
  optimizer, copies, collectives.  Views and metadata (``view``, ``t``, ``expand``, ``detach``, ``empty``, size
  queries) are recorded as :data:`VIEWS`, with no bytes and no launch: no kernel runs for them.

Identical records (operator, class, phase, dtype) are aggregated with a count, the operator's launches.  A grouped
convolution's records carry the suffix :data:`GROUPED` (``aten.convolution(grouped)``): the model prices them apart.
Each record also keeps its calls' **shapes** where asked (``shapes=True``): per distinct call
(:func:`kdbench.measure.replay.signature`: the operator with its arguments' shapes, strides and dtypes), how many
times it ran, so that the machine the step runs on can time each call at its shapes
(:func:`kdbench.measure.replay.time_signatures`; :mod:`kdbench.fit.steptime`).

What the census cannot see: work that is not an aten operator of the fake run (DDP's reducer, which cannot run on
fake tensors: the planner adds its all-reduce of the gradients as a record, :func:`all_reduce_record`), a
kernel's internal passes (a fused kernel's reads of its own intermediates), and operators a compiled step would
fuse (the fake run is eager).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kdbench.measure.replay import signature

MATMUL, ATTENTION, REDUCTION, ELEMENTWISE, OPTIMIZER, COPIES, COLLECTIVES = (
    "matmul/conv",
    "attention",
    "softmax and reductions",
    "elementwise and casts",
    "optimizer",
    "copies",
    "collectives",
)
CLASSES = (MATMUL, ATTENTION, REDUCTION, ELEMENTWISE, OPTIMIZER, COPIES, COLLECTIVES)
VIEWS = "views and metadata"  # recorded, but no bytes and no launch

# A new storage at least this large is mapped anew by glibc's malloc on every allocation, and its pages fault on
# first touch: mallopt(3), M_MMAP_THRESHOLD: the threshold adjusts upward to the size of a freed mmapped chunk, "up
# to a maximum of DEFAULT_MMAP_THRESHOLD_MAX: ... 4*1024*1024*sizeof(long) on 64-bit systems" (32 MiB); smaller
# chunks are reused from the heap once a step has freed them.
FRESH_BYTES = 32 * 2**20

# Collective operators by what they do (the step-time model prices each by its ring formula).
ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all_reduce", "all_gather", "reduce_scatter"
_NO_KERNEL = ("prim", "profiler")  # queries (prim.device) and the profiler's record_function marks
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")

# Operators no kernel runs for (allocations, aliases, queries); views are found by their schema (OpOverload.is_view).
_METADATA = frozenset(
    {
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view", "detach", "alias",
        "lift_fresh", "lift_fresh_copy", "set_", "resize_", "size", "sym_size", "stride", "sym_stride", "numel",
        "sym_numel", "dim", "storage_offset", "sym_storage_offset", "is_contiguous", "sym_is_contiguous",
        "is_strides_like_format", "is_non_overlapping_and_dense", "_local_scalar_dense", "is_same_size",
        "wait_tensor", "_has_compatible_shallow_copy_type", "record_stream", "_to_copy_meta", "_nested_tensor_size",
    }
)  # fmt: skip
# Softmaxes, norms, losses, reductions, pools and sorts: each reads its input whole and writes less (or as much).
_REDUCTION_NAMES = frozenset(
    {
        "sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "logsumexp", "var", "std", "var_mean",
        "std_mean", "prod", "cumsum", "cumprod", "topk", "sort", "all", "any", "norm", "linalg_vector_norm",
        "kl_div", "mse_loss", "mse_loss_backward", "l1_loss", "smooth_l1_loss", "huber_loss", "count_nonzero",
        "binary_cross_entropy", "binary_cross_entropy_with_logits", "aminmax", "median", "mode", "kthvalue",
    }
)  # fmt: skip
_REDUCTION_PARTS = ("softmax", "_norm", "norm_", "nll_loss", "cross_entropy", "pool", "batch_norm", "layer_norm")
# Data movement without arithmetic (a cast, copy_ or _to_copy to another dtype, is an elementwise op: it converts).
_COPY_NAMES = frozenset(
    {
        "clone", "cat", "stack", "index_select", "gather", "scatter", "scatter_add", "scatter_add_", "scatter_",
        "scatter_reduce", "index", "index_put", "index_put_", "_index_put_impl_", "embedding",
        "embedding_dense_backward", "fill", "fill_", "zero_", "zeros", "zeros_like", "ones", "ones_like", "full",
        "full_like", "new_zeros", "new_ones", "new_full", "constant_pad_nd", "repeat", "expand_copy",
        "slice_backward", "select_backward", "narrow_copy", "roll", "flip", "_unsafe_index", "index_add",
        "index_add_", "masked_scatter", "masked_select", "index_copy", "index_copy_", "unfold_backward",
        "slice_scatter", "select_scatter", "as_strided_scatter", "diagonal_backward", "_unsafe_index_put",
        "clone_", "contiguous", "permute_copy", "transpose_copy", "view_copy", "t_copy", "unsqueeze_copy",
    }
)  # fmt: skip
_CASTS = frozenset({"_to_copy", "copy_", "copy", "to", "_copy_from", "_copy_from_and_resize"})
_WRITE_ONLY = frozenset(
    {"copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "bernoulli_", "exponential_", "_copy_from"}
)  # the tensor they write into is not read


@dataclass(frozen=True)
class Record:
    """Operator calls of one kind: ``launches`` calls of ``op`` in ``phase`` writing ``dtype``, with their total
    FLOPs and bytes read and written."""

    op: str  # the aten operator's name ("aten.mm")
    cls: str  # CLASSES, or VIEWS
    phase: str
    dtype: str  # the first output's dtype ("float32"); "" where it wrote none
    flops: int = 0
    read: int = 0
    written: int = 0
    launches: int = 0
    fresh: int = 0  # of ``written``: bytes in new storages of at least FRESH_BYTES (pages the OS maps on first touch)
    # (signature, calls) of the calls that can be replayed (kdbench.measure.replay); their calls sum to at most
    # ``launches`` (a call that cannot be written down, or one the decode's extrapolation adds, has none)
    shapes: tuple[tuple[str, int], ...] = ()

    @property
    def bytes(self) -> int:
        return self.read + self.written


@dataclass(frozen=True)
class Census:
    """A step's operator census: its :class:`Record`\\s and the ranks its collectives span."""

    records: tuple[Record, ...] = ()
    world_size: int = 1

    @property
    def flops(self) -> int:
        return sum(r.flops for r in self.records)

    def summary(self) -> dict[str, dict[str, dict[str, int]]]:
        """Per phase and class (views left out): FLOPs, bytes (read + written) and launches."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for r in self.records:
            if r.cls == VIEWS:
                continue
            cell = out.setdefault(r.phase, {}).setdefault(r.cls, {"flops": 0, "bytes": 0, "launches": 0})
            cell["flops"] += r.flops
            cell["bytes"] += r.bytes
            cell["launches"] += r.launches
        return out

    def signatures(self) -> tuple[str, ...]:
        """Every distinct call the census wrote down (:attr:`Record.shapes`), in the order first seen."""
        return tuple(dict.fromkeys(sig for r in self.records for sig, _ in r.shapes))

    @classmethod
    def from_json(cls, fields: dict) -> Census:
        """A census from :func:`dataclasses.asdict`'s form (the planner's process of its own hands it back so)."""
        records = (
            Record(**{**r, "shapes": tuple((str(sig), int(n)) for sig, n in r.get("shapes", ()))})
            for r in fields.get("records", ())
        )
        return cls(tuple(records), int(fields.get("world_size", 1)))


def flop_formulas() -> dict:
    """The FLOP formulas a row's count uses (``FlopCounterMode``'s registry with kdbench's own added, each taking
    the operator's arguments as the counter passes them), keyed by operator packet."""
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    from kdbench.measure.flops import formulas

    custom = formulas()
    return {
        **flop_registry,
        **{k: v if getattr(v, "_get_raw", False) else shape_wrapper(v) for k, v in custom.items()},
    }


GROUPED = "(grouped)"  # the suffix of a grouped convolution's records: the model prices it apart (steptime)


def grouped(func, args: tuple, kwargs: dict) -> bool:
    """A convolution (or its backward) in more than one group: a depthwise convolution runs far below a dense one
    on a CPU (``kdbench.measure.probe_classes``' ``conv_grouped``)."""
    if func._overloadpacket.__name__ not in ("convolution", "convolution_backward"):
        return False
    for i, a in enumerate(func._schema.arguments):
        if a.name == "groups":
            value = kwargs.get("groups", args[i] if i < len(args) else 1)
            return isinstance(value, int) and value > 1
    return False


def collective_kind(op: str) -> str | None:
    """:data:`ALL_REDUCE`, :data:`ALL_GATHER` or :data:`REDUCE_SCATTER` for a collective operator's name, else
    None (a broadcast, a barrier: priced as an all-gather's one hop, see :mod:`kdbench.fit.steptime`)."""
    name = op.rsplit(".", 1)[-1].replace("_", "")
    if "allreduce" in name:
        return ALL_REDUCE
    if "allgather" in name:
        return ALL_GATHER
    if "reducescatter" in name:
        return REDUCE_SCATTER
    return None


def op_class(
    func: torch._ops.OpOverload,
    phase: str,
    out_dtype: torch.dtype | None,
    in_dtype: torch.dtype | None,
    counted: bool,
) -> str:
    """The class of one call of ``func`` (:data:`CLASSES` or :data:`VIEWS`); ``counted``: it has a FLOP formula."""
    name = func._overloadpacket.__name__
    if (out_dtype is None and not func._schema.is_mutable) or func.namespace in _NO_KERNEL:
        return VIEWS  # nothing written: a query (prim.device, promote_types), a profiler's record_function
    if func.namespace in _COLLECTIVE_NAMESPACES:
        return COLLECTIVES if collective_kind(name) or "broadcast" in name else VIEWS
    if name in _METADATA or getattr(func, "is_view", False):
        return VIEWS
    if "attention" in name or name.startswith(("_flash_attention", "_efficient_attention")):
        return ATTENTION
    if counted:
        return MATMUL
    if name.startswith(("_foreach_", "_fused_")) or phase == "optimizer":
        return OPTIMIZER
    if name in _REDUCTION_NAMES or any(part in name for part in _REDUCTION_PARTS):
        return REDUCTION
    if name in _CASTS:
        return ELEMENTWISE if out_dtype is not None and in_dtype is not None and out_dtype != in_dtype else COPIES
    if name in _COPY_NAMES:
        return COPIES
    return ELEMENTWISE


def tensor_bytes(t: torch.Tensor) -> int:
    """What an operator reads or writes of ``t``: numel x element size, but at most its storage's bytes."""
    local = getattr(t, "_local_tensor", None)  # a DTensor: its local shard
    if isinstance(local, torch.Tensor):
        t = local
    n = t.numel() * t.element_size()
    try:
        return min(n, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # no storage (a nested or sparse tensor)
        return n


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    local = getattr(t, "_local_tensor", None)
    try:
        return (local if isinstance(local, torch.Tensor) else t).untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def fresh_bytes(inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> int:
    """The bytes of the storages among ``outputs`` that the operator allocated (none of its inputs holds them) and
    that are at least :data:`FRESH_BYTES`: a CPU's allocator maps them anew, and the first write of each page
    faults (``kdbench.fit.steptime``'s first-touch term)."""
    held = {id(s) for s in map(_storage, inputs) if s is not None}
    seen: set[int] = set()
    total = 0
    for t in outputs:
        st = _storage(t)
        if st is None or id(st) in held or id(st) in seen:
            continue
        seen.add(id(st))
        if st.nbytes() >= FRESH_BYTES:
            total += st.nbytes()
    return total


def _moved(func, args: tuple, inputs: list, outputs: list, cls: str) -> tuple[list, list]:
    """The tensors an operator reads and those it writes: its inputs and outputs, but copy_'s or fill_'s
    destination is not read, and a c10d collective's output buffers (``_allgather_base_(output_tensor, ...)``,
    ``..._coalesced_(outputs, ...)``: arguments, not results) are written, not read."""
    name = func._overloadpacket.__name__
    if name in _WRITE_ONLY and args and isinstance(args[0], torch.Tensor):
        return [t for t in inputs if t is not args[0]], outputs
    if cls == COLLECTIVES:
        names = [a.name for a in func._schema.arguments]
        buffers = _tensors([a for a, n in zip(args, names) if n.startswith("output")])
        if buffers:
            ids = {id(t) for t in buffers}
            return [t for t in inputs if id(t) not in ids], buffers
    return inputs, outputs


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class CensusMode(TorchDispatchMode):
    """Counts the operators the code inside it runs while :attr:`on` (module docstring); ``phase`` says which
    phase the step is in (the planner's tracker knows)."""

    def __init__(self, phase: Callable[[], str], world_size: int = 1, shapes: bool = True) -> None:
        super().__init__()
        self.phase = phase
        self.world_size = world_size
        self.shapes = shapes  # write each call's signature down (Record.shapes)
        self.on = False
        self._formulas = flop_formulas()
        self._views: dict[Any, bool] = {}  # operator -> whether every call of it is a view (count's fast path)
        # (op, class, phase, dtype) -> [flops, read, written, launches, fresh]
        self._tally: dict[tuple[str, str, str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
        # (op, class, phase, dtype) -> {signature: calls}
        self._shapes: dict[tuple[str, str, str, str], dict[str, int]] = defaultdict(dict)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(getattr(t, "__name__", "") == "DTensor" for t in types):
            return NotImplemented  # a DTensor's op runs again as ops on its local shards, which are counted
        out = func(*args, **kwargs)
        if self.on:
            self.count(func, args, kwargs, out)
        return out

    def count(self, func, args: tuple, kwargs: dict, out) -> None:
        """Record one call of ``func`` on ``args`` that returned ``out``."""
        packet = func._overloadpacket
        view = self._views.get(func)
        if view is None:  # a view or a metadata query whatever its arguments (op_class's rules): decided once
            name = packet.__name__
            view = self._views[func] = (
                func.namespace not in _COLLECTIVE_NAMESPACES
                and (name in _METADATA or getattr(func, "is_view", False))
                and packet not in self._formulas
            )
        if view:  # its record, with nothing to count: half a step's calls, without the walk over their arguments
            first = out if isinstance(out, torch.Tensor) else next(iter(_tensors(out)), None)
            dtype = str(first.dtype).removeprefix("torch.") if first is not None else ""
            self._tally[(f"{func.namespace}.{packet.__name__}", VIEWS, self.phase(), dtype)]
            return
        formula = self._formulas.get(packet)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        phase = self.phase()
        out_dtype = outputs[0].dtype if outputs else None
        in_dtype = inputs[-1].dtype if inputs else None  # copy_(dst, src): the source's
        cls = op_class(func, phase, out_dtype, in_dtype, formula is not None)
        key = (
            f"{func.namespace}.{packet.__name__}{GROUPED if grouped(func, args, kwargs) else ''}",
            cls,
            phase,
            str(out_dtype).removeprefix("torch.") if outputs else "",
        )
        tally = self._tally[key]
        tally[0] += flops
        if cls != VIEWS:
            read, written = _moved(func, args, inputs, outputs, cls)
            tally[1] += sum(tensor_bytes(t) for t in read)
            tally[2] += sum(tensor_bytes(t) for t in written)
            tally[3] += 1
            tally[4] += fresh_bytes(inputs, outputs)
            sig = signature(func, args, kwargs) if self.shapes and cls != COLLECTIVES else None
            if sig is not None:
                shapes = self._shapes[key]
                shapes[sig] = shapes.get(sig, 0) + 1

    def add(self, records: Iterable[Record]) -> None:
        """Records of work the fake run cannot run (DDP's all-reduce), added to the census."""
        for r in records:
            tally = self._tally[(r.op, r.cls, r.phase, r.dtype)]
            for i, v in enumerate((r.flops, r.read, r.written, r.launches, r.fresh)):
                tally[i] += v

    def census(self) -> Census:
        records = (
            Record(*key, *values, shapes=tuple(self._shapes.get(key, {}).items()))
            for key, values in self._tally.items()
        )
        return Census(tuple(records), self.world_size)


def all_reduce_record(nbytes: int, dtype: torch.dtype, buckets: int, phase: str = "backward") -> Record:
    """DDP's all-reduce of ``nbytes`` of gradients in ``buckets`` buckets, in the backward it overlaps (the
    reducer cannot run on fake tensors: the planner adds this record)."""
    return Record(
        "c10d.allreduce_", COLLECTIVES, phase, str(dtype).removeprefix("torch."), 0, nbytes, nbytes, max(1, buckets)
    )
