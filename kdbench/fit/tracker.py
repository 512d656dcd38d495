"""Live tensor bytes of one device, op by op, with where each byte came from: the planner's meter.

:class:`LiveBytes` is a ``TorchDispatchMode`` that sees every tensor an operator returns, keeps each distinct
storage it has not seen (by a weak reference: a storage counts from its first appearance until it is freed),
and keeps the running total and its peak.  Under ``FakeTensorMode`` nothing is allocated: a fake storage has
the bytes a real one would.  Tensors that exist before the step (parameters, buffers, the batch, a teacher's
cached outputs) are counted with :meth:`LiveBytes.track`.

Why not ``torch.distributed._tools.mem_tracker.MemTracker``: it installs a gradient hook on every parameter
of every module it sees run, which raises on a frozen teacher's parameters (torch 2.14: "cannot register a hook
on a tensor that doesn't require gradient"), and it walks every module's statistics after every operator.
The attribution here is by the step's phases instead (the peak's phase and, at the peak, the bytes of
parameters, gradients, optimizer state, activations, temporaries and inputs), which is what a distillation
step's peak is explained by.

A kernel's workspace that is not a tensor of the fake run (a GPU sort's CUB buffers, which the CPU's kernel has
not) is counted through :attr:`LiveBytes.workspace`: a temporary held beside the operator's outputs, then freed.
"""

from __future__ import annotations

import itertools
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# What a byte is, at the peak (the breakdown's keys, in the order they are shown).
PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS, TEMPORARIES, INPUTS = (
    "parameters",
    "gradients",
    "optimizer state",
    "activations",
    "temporaries",
    "inputs",
)
KINDS = (PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS, TEMPORARIES, INPUTS)
SEGMENT = "/"  # between a phase and its segment in a trajectory's key (LiveBytes.segment)


def phase_of(key: str) -> str:
    """The phase of a trajectory's key (a phase, or a segment of one: ``generate/decode 2``)."""
    return key.split(SEGMENT)[0]


# Phases whose new tensors are activations while they live (the rest, backward and the optimizer step, make
# temporaries, but for the gradients and the optimizer state they are told of).
FORWARD_PHASES = frozenset({"setup", "cache build", "generate", "align", "teacher_forward", "student_forward", "loss"})


@dataclass
class _Storage:
    serial: int
    nbytes: int
    phase: str
    born: int = 0  # the meter's moment it was counted at (phase peaks only)
    died: int | None = None  # the moment it was freed at; None while it lives


@dataclass
class Peak:
    """The peak of live bytes and what they were at that moment."""

    bytes: int = 0
    phase: str = ""
    live: list[tuple[int, int, str]] = field(default_factory=list)  # (serial, bytes, phase made in) at the peak
    moment: int = -1  # the meter's moment it was reached at (LiveBytes._moment)
    snapped: int = 0  # the bytes live when ``live`` was taken


class LiveBytes(TorchDispatchMode):
    """Live bytes of the tensors the code inside it makes (and of those :meth:`track` is given)."""

    def __init__(self, snapshot_step: float = 0.002, phases: bool = False) -> None:
        super().__init__()
        self.phase = "setup"
        self.live = 0
        self.peak = Peak()
        self._serials = itertools.count()
        self._seen: dict[int, tuple[weakref.ref, _Storage]] = {}  # id(storage) -> (ref, record)
        self._marked: dict[int, str] = {}  # serial -> PARAMETERS / GRADIENTS / OPTIMIZER / INPUTS
        self._snapshot_step = snapshot_step  # a new peak is recorded in full when it beats the last by this share
        # (operator, args, kwargs) -> the bytes its kernel on the target device allocates beside its outputs and
        # frees before returning (kdbench.fit.gpu_target: a GPU's sort); None: none
        self.workspace: Callable[[Any, tuple, dict], int] | None = None
        # (operator, args) -> a value the operator is answered with, or None: it runs (the planner's HostBranches:
        # a host branch no fake tensor can take); asked before each operator
        self.answer: Callable[[Any, tuple], Any] | None = None
        # Where asked (phases=True: kdbench.fit.depth's runs), every storage's life (its record, the moments it was
        # counted and freed at, a moment a count of births and deaths), so that what was live at the peak and at
        # each phase's own peak (phase -> (bytes, moment)) is known exactly after the run (:meth:`breakdown`)
        self.phase_peaks: dict[str, tuple[int, int]] | None = {} if phases else None
        self._moment = 0
        self._history: list[_Storage] = []
        self.resized = False  # a storage resized in place (FSDP2): the lives do not say its bytes at a moment
        # Where phase peaks are kept, each phase's births in order (phase -> [(what made it, bytes), live after it,
        # moment]): the trajectory kdbench.fit.depth lines up between fake runs of different depths.
        self.trajectory: dict[str, list[tuple[tuple[str, int], int, int]]] | None = {} if phases else None
        # A phase that passes through a stack more than once (an on-policy generation: its prefill, then each decode
        # step) is cut into segments, each one pass: the trajectory's key is the phase and the segment
        # (``generate/decode 2``; SEGMENT between them), reset to the phase alone as the phase changes.
        self.segment = ""
        self._op = "track"  # what is making storages now: the operator being dispatched, or a track()

    # ------------------------------------------------------------------ counting

    def _storage(self, t: torch.Tensor) -> torch.UntypedStorage | None:
        local = getattr(t, "_local_tensor", None)  # a DTensor (FSDP2's shards): its local shard holds the bytes
        if isinstance(local, torch.Tensor):
            t = local
        if t.device.type == "meta" or not hasattr(t, "untyped_storage"):
            return None
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (a sparse or nested view)
            return None

    def _count(self, t: torch.Tensor, kind: str | None = None) -> _Storage | None:
        st = self._storage(t)
        if st is None:
            return None
        return self._count_storage(st, kind)

    def _count_storage(self, st: torch.UntypedStorage, kind: str | None = None) -> _Storage:
        key = id(st)
        seen = self._seen.get(key)
        if seen is not None and seen[0]() is st:
            record = seen[1]
            size = st.nbytes()
            if size != record.nbytes:  # resized in place (resize_, FSDP2's unsharded parameters)
                self.live += size - record.nbytes
                record.nbytes = size
                self.resized = True
        else:
            record = _Storage(next(self._serials), st.nbytes(), self.phase)
            self._seen[key] = (weakref.ref(st, lambda _, key=key, record=record: self._freed(key, record)), record)
            self.live += record.nbytes
            self._moment += 1
            record.born = self._moment
            if self.phase_peaks is not None:  # kept only here: a record outliving its storage is an object a sweep's
                self._history.append(record)  # garbage collector walks (bench_sweep_overhead's growth)
            if self.trajectory is not None:
                key = self.phase + self.segment
                self.trajectory.setdefault(key, []).append(((self._op, record.nbytes), self.live, self._moment))
        if kind is not None:
            self._marked[record.serial] = kind
        if self.live > self.peak.bytes:
            self._new_peak()
        if self.phase_peaks is not None:
            top = self.phase_peaks.get(self.phase)
            if top is None or self.live > top[0]:
                self.phase_peaks[self.phase] = (self.live, self._moment)
        return record

    def _freed(self, key: int, record: _Storage) -> None:
        seen = self._seen.get(key)
        if seen is not None and seen[1] is record:
            del self._seen[key]
        self.live -= record.nbytes
        self._moment += 1
        record.died = self._moment

    def _new_peak(self) -> None:
        # a new snapshot once the peak is snapshot_step above the last one's (not above the last peak's: a peak that
        # rises by many small steps would keep a snapshot from far below it)
        full = self.live > self.peak.snapped * (1 + self._snapshot_step) or self.phase != self.peak.phase
        self.peak.bytes, self.peak.phase, self.peak.moment = self.live, self.phase, self._moment
        if full:
            self.peak.live = [(r.serial, r.nbytes, r.phase) for _, r in self._seen.values()]
            self.peak.snapped = self.live

    def reset_peak(self) -> None:
        """Start the peak again from what is live now."""
        self.peak = Peak()
        self._new_peak()

    def start_phases(self) -> None:
        """Start the phase peaks again from what is live now (where they are kept)."""
        if self.phase_peaks is not None:
            self.phase_peaks = {self.phase: (self.live, self._moment)}
            self.trajectory = {}

    def __enter__(self) -> LiveBytes:
        # FSDP2 frees and re-allocates its unsharded parameters by resizing their storages in place
        saved = self._resize = torch.UntypedStorage.resize_

        def resize_(st: torch.UntypedStorage, size: int) -> None:
            saved(st, size)
            self._count_storage(st)

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(getattr(t, "__name__", "") == "DTensor" for t in types):
            return NotImplemented  # a DTensor's op runs again as ops on its local shards, which are counted
        if self.answer is not None:
            got = self.answer(func, args)
            if got is not None:
                return got
        out = func(*args, **(kwargs or {}))
        self._op = func.__name__
        if isinstance(out, torch.Tensor):  # most operators: one tensor, without pytree's walk (a cost per operator)
            self._count(out)
        else:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._count(t)
        extra = self.workspace(func, args, kwargs or {}) if self.workspace is not None else 0
        if extra:
            self._op = "workspace"
            self._transient(extra)
        self._op = "track"
        return out

    def _transient(self, nbytes: int) -> None:
        """A kernel's workspace of ``nbytes``: live (a temporary) while the operator's outputs are, then freed.
        Made under the fake mode below this one: no memory."""
        workspace = torch.empty(nbytes, dtype=torch.uint8)
        self._count(workspace, TEMPORARIES)
        del workspace

    # ------------------------------------------------------------------ what is what

    def track(self, tensors: Iterable[torch.Tensor | None], kind: str) -> None:
        """Count tensors made before (or outside) the mode, and say what they are."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._count(t, kind)

    def mark(self, tensors: Iterable[torch.Tensor | None], kind: str) -> None:
        """Say what tensors already counted are (a parameter's gradient, an optimizer's state)."""
        self.track(tensors, kind)

    def phase_breakdown(self, phase: str) -> dict[str, int]:
        """The bytes at ``phase``'s own peak by kind (:data:`KINDS`, as :meth:`breakdown` says what a byte is), from
        every storage's life: exact (phase peaks kept)."""
        if self.phase_peaks is None:
            raise ValueError("phase peaks are not kept: LiveBytes(phases=True)")
        return self._breakdown_at(self.phase_peaks[phase][1])

    def breakdown_at(self, moment: int) -> dict[str, int]:
        """The bytes live at ``moment`` (a trajectory's) by kind, as :meth:`breakdown` says what a byte is."""
        return self._breakdown_at(moment)

    def _breakdown_at(self, moment: int) -> dict[str, int]:
        out: Counter[str] = Counter({k: 0 for k in KINDS})
        for r in self._history:
            if r.born <= moment and (r.died is None or r.died > moment):
                out[self._marked.get(r.serial) or (ACTIVATIONS if r.phase in FORWARD_PHASES else TEMPORARIES)] += (
                    r.nbytes
                )
        return dict(out)

    def breakdown(self) -> dict[str, int]:
        """The bytes at the peak by kind (:data:`KINDS`): parameters, gradients and optimizer state as marked,
        the rest activations when made in a forward phase, temporaries when made in backward or the update: exact
        from the storages' lives where they are kept (phases=True, but a storage resized in place: FSDP2's), else
        from the last snapshot within ``snapshot_step`` of the peak."""
        if self.phase_peaks is not None and not self.resized and self.peak.moment >= 0:
            return self._breakdown_at(self.peak.moment)
        out: Counter[str] = Counter({k: 0 for k in KINDS})
        for serial, nbytes, phase in self.peak.live:
            kind = self._marked.get(serial) or (ACTIVATIONS if phase in FORWARD_PHASES else TEMPORARIES)
            out[kind] += nbytes
        return dict(out)
