"""A cell's predicted peak judged against a device: ``fits``, ``does not fit``, ``fits only with`` the first
changes that make it fit, or unpredictable; and the largest batch size or sequence length that fits, by
bisection over fake runs.

One search decides both: the verdict's batch (the largest batch at which the cell fits as it is, and the largest
with the levers it keeps) comes from :func:`largest`, through a :class:`Sizes` that keeps each search's answer, and
``--max``'s lines print the same answers (:func:`kdbench.fit.cells.fit_cells`), so that "fits only with" and
"largest batch_size" never contradict each other: a cell that fits unchanged at a smaller batch is said to.

Every figure here is a prediction (:func:`kdbench.fit.planner.predict`, through a :class:`Predictor` that keeps
each cell's once, for a GPU with its BLAS workspaces: :func:`kdbench.fit.runtime.with_runtime`); a cell fits when its
predicted peak per rank is at most what the device leaves it (a :data:`Budget`: a fixed figure, or a device's
:func:`kdbench.fit.devices.usable` less the prediction's collective buffers).  Torch is imported by the planner only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from kdbench.config.plan import deep_merge
from kdbench.config.schema import CellConfig
from kdbench.workloads.registry import check_cell, workload_of

FITS, NO_FIT, FITS_WITH, UNPREDICTABLE = "fits", "does not fit", "fits only with", "unpredictable"
CHUNKING = ("chunked", "fused_linear", "liger")  # the loss implementations chunk_size sets the chunks of
FSDP_RANKS = (2, 4, 8)  # the FSDP2 layouts tried for a cell that does not fit
SIZE_KEYS = {"batch_size": ("batch_size",), "seq_len": ("data", "seq_len")}  # what --max takes, and where it sits
BATCH_CAP = 2**16  # the largest batch size the bisection tries
SEQ_CAP = 2**20  # the largest sequence length, where the models' positions say none (the schema's bound)


class Predictor:
    """:func:`kdbench.fit.planner.predict` (or a stand-in), each distinct cell predicted once; with a GPU's
    ``runtime`` (:class:`kdbench.fit.runtime.Runtime`), each prediction gets that GPU's BLAS workspaces as a term of
    its peak and, at ``world_size > 1``, its collective buffers beside it (:func:`kdbench.fit.runtime.with_runtime`)."""

    def __init__(
        self,
        device_type: str = "cuda",
        predict: Callable[..., Any] | None = None,
        allow_imports=False,
        runtime: Any = None,
    ):
        if predict is None:
            from kdbench.fit.planner import predict
        self._predict = predict
        self.device_type = device_type
        self.allow_imports = allow_imports  # the suite's: its module:callable models are built
        self.runtime = runtime  # None: the fake run's tensors alone (the CPU, or no GPU known)
        self._seen: dict[str, Any] = {}
        self.runs = 0  # fake runs made

    def __call__(self, config: CellConfig):
        from kdbench.fit.planner import fake_run_key

        key = fake_run_key(config)
        if key not in self._seen:
            from kdbench.fit.runtime import with_runtime

            self.runs += 1
            self._seen[key] = with_runtime(
                self._predict(config, self.device_type, self.allow_imports), config, self.runtime
            )
        return self._seen[key]


Budget: TypeAlias = int | Callable[[Any], int]  # bytes a peak may reach: fixed, or a device's for a prediction


def budget_of(usable: Budget, prediction) -> int:
    """What ``prediction``'s peak may reach: ``usable`` itself, or ``usable(prediction)`` (a device's usable memory
    less what that prediction holds outside the allocator: its NCCL/RCCL buffers)."""
    return usable(prediction) if callable(usable) else usable


def fits(prediction, usable: Budget) -> bool:
    return prediction.ok and prediction.peak_bytes <= budget_of(usable, prediction)


def changed(config: CellConfig, update: dict[str, Any]) -> CellConfig | None:
    """``config`` with ``update`` laid over it, when the result is a cell kdbench would run (else None)."""
    raw = deep_merge(config.model_dump(mode="json"), update)
    try:
        new = CellConfig.model_validate(raw)
    except ValueError:
        return None
    return None if check_cell(new, True) else new


@dataclass(frozen=True)
class Option:
    """One way a cell fits: the changes made (in order), the cell with them and its prediction."""

    changes: tuple[str, ...]
    config: CellConfig
    prediction: Any


@dataclass(frozen=True)
class Verdict:
    """A cell against a device: ``outcome`` (:data:`FITS`, :data:`NO_FIT`, :data:`FITS_WITH`, :data:`UNPREDICTABLE`),
    its own prediction, and for :data:`FITS_WITH` the changes made and the prediction with them (the option with
    the fewest changes; ``others``: the other way found, said after it); ``as_is``: for a cell that does not fit,
    the largest batch at which it fits unchanged (the search ``--max batch_size`` prints)."""

    outcome: str
    prediction: Any
    changes: tuple[str, ...] = ()
    changed: Any = None  # the prediction with the changes
    config: CellConfig | None = None  # the cell with the changes
    tried: tuple[str, ...] = ()  # the changes tried, in order (for a cell that does not fit)
    others: tuple[Option, ...] = ()  # other ways it fits (fits only with: levers at the cell's batch, or its batch)
    as_is: Largest | None = None  # the largest batch_size that fits unchanged (a cell that does not fit)

    def line(self, usable: Budget) -> str:
        from kdbench.core.sizes import gib

        p = self.prediction
        if self.outcome == UNPREDICTABLE:
            return f"unpredictable: {p.error}"
        if self.outcome == FITS:
            return f"fits ({gib(p.peak_bytes)} of {gib(budget_of(usable, p))} usable)"
        if self.outcome == FITS_WITH:
            c = self.changed
            more = "".join(f"; or with {', '.join(o.changes)} ({gib(o.prediction.peak_bytes)})" for o in self.others)
            return (
                f"fits only with: {', '.join(self.changes)} (predicted {gib(c.peak_bytes)} of "
                f"{gib(budget_of(usable, c))} usable, in {c.phase}){more}"
            )
        tried = f"; no change tried fits ({', '.join(self.tried)})" if self.tried else ""
        return f"does not fit ({gib(p.peak_bytes)} over {gib(budget_of(usable, p))} usable){tried}"


def _changes(config: CellConfig) -> list[Callable[[CellConfig], list[tuple[str, dict[str, Any]]]]]:
    """The changes to try on a cell that does not fit, in order: each a function of the cell as changed so far that
    gives its alternatives (tried one by one; the first that fits wins); those the cell's family does not take are
    left out."""
    takes = workload_of(config).takes
    out: list[Callable[[CellConfig], list[tuple[str, dict[str, Any]]]]] = []
    if "loss_impl" in takes:
        out.append(
            lambda c: (
                [] if c.loss_impl == "fused_linear" else [("loss_impl fused_linear", {"loss_impl": "fused_linear"})]
            )
        )
    if "chunk_size" in takes:

        def smaller_chunks(c: CellConfig) -> list[tuple[str, dict[str, Any]]]:
            n = max(1, c.chunk_size // 4)
            if n == c.chunk_size:
                return []
            if c.loss_impl in CHUNKING:
                return [(f"chunk_size {n}", {"chunk_size": n})]
            # fused_linear was not kept (its chunks hold more than the whole logits of a short batch): with smaller ones
            return [(f"loss_impl fused_linear with chunk_size {n}", {"loss_impl": "fused_linear", "chunk_size": n})]

        out.append(smaller_chunks)
    if "teacher.weights" in takes:
        bf16 = {"teacher": {"weights": "bf16"}, "teacher_precision": "bf16"}
        out.append(
            lambda c: (
                [] if c.teacher.weights != "fp32" else [("teacher.weights bf16 with teacher_precision bf16", bf16)]
            )
        )
    if "parallel" in takes:
        out.append(
            lambda c: [
                (f"parallel fsdp at world_size {n}", {"parallel": "fsdp", "world_size": n})
                for n in FSDP_RANKS
                if not (c.parallel == "fsdp" and c.world_size >= n)
            ]
        )
    return out


def judge(config: CellConfig, usable: Budget, predictor: Predictor, sizes: Sizes | None = None) -> Verdict:
    """``config`` against a device with ``usable`` bytes per rank (a :data:`Budget`).  A cell that does not fit is
    searched two ways, and the way with fewer changes is the verdict's (the other is said after it):

    * as it is, at the largest batch that fits (:func:`largest`, the search ``--max batch_size`` prints: ``sizes``
      keeps it for those lines);
    * with the changes of :func:`_changes` in order, each kept when it brings the cell closer to fitting (its
      predicted peak less what the device leaves it: lower; so they add up): the first combination that fits at
      the cell's batch, else the kept changes at the largest batch that fits with them.

    A change kdbench would refuse for the cell, or that the planner cannot predict (data-parallel cells before it
    predicts them), is skipped."""
    sizes = sizes if sizes is not None else Sizes(usable, predictor)
    own = predictor(config)
    if not own.ok:
        return Verdict(UNPREDICTABLE, own)

    def short(p) -> int:  # how far a prediction is from fitting: its peak less what the device leaves it
        return p.peak_bytes - budget_of(usable, p)

    if fits(own, usable):
        return Verdict(FITS, own)
    as_is = sizes.largest(config, "batch_size")
    smaller = _batch_option(config, (), as_is)  # the cell unchanged at a smaller batch
    current, best, kept, tried = config, own, [], []
    levers: Option | None = None
    for alternatives in _changes(config):
        lowest = None
        for text, update in alternatives(current):
            candidate = changed(current, update)
            if candidate is None:
                continue
            p = predictor(candidate)
            if not p.ok:
                continue
            tried.append(text)
            if fits(p, usable):
                levers = Option((*kept, text), candidate, p)
                break
            if short(p) < short(best) and (lowest is None or short(p) < short(lowest[2])):
                lowest = (text, candidate, p)
        if levers is not None:
            break
        if lowest is not None:
            kept.append(lowest[0])
            current, best = lowest[1], lowest[2]
    if levers is None and kept:  # the kept changes at the largest batch that fits with them
        with_kept = sizes.largest(current, "batch_size")
        tried += [f"batch_size {b}" for b in with_kept.tried if b < current.batch_size]
        levers = _batch_option(current, tuple(kept), with_kept)
    tried += [f"batch_size {b}" for b in as_is.tried if b < config.batch_size]
    found = [o for o in (levers, smaller) if o is not None]
    if smaller is not None and levers is not None and levers.config.batch_size <= smaller.config.batch_size:
        found = [smaller]  # the changes buy no larger batch than the cell has unchanged
    if not found:
        return Verdict(NO_FIT, own, tried=tuple(dict.fromkeys(tried)), as_is=as_is)
    first, *others = sorted(found, key=lambda o: len(o.changes))
    return Verdict(FITS_WITH, own, first.changes, first.prediction, first.config, (), tuple(others), as_is)


def _batch_option(config: CellConfig, kept: tuple[str, ...], found: Largest) -> Option | None:
    """The cell with ``kept`` changes at the largest batch that fits (``found``), when it fits at one."""
    if not found.value or found.error or found.value >= config.batch_size:
        return None
    at = with_size(config, "batch_size", found.value)
    return Option((*kept, f"batch_size {found.value}"), at, found.prediction) if at is not None else None


# --------------------------------------------------------------------------- the largest size that fits


@dataclass(frozen=True)
class Largest:
    """The largest value of ``key`` that fits (0: not even the smallest; None with ``error``: unpredictable)."""

    key: str
    value: int | None
    cap: int
    prediction: Any = None  # at value
    above: Any = None  # at value + 1 (None at the cap)
    error: str | None = None
    runs: int = 0  # fake runs made for it
    notes: tuple[str, ...] = field(default_factory=tuple)
    tried: tuple[int, ...] = ()  # the values predicted, in the order the search tried them

    def text(self) -> str:
        from kdbench.core.sizes import gib

        if self.error:
            return f"unpredictable: {self.error}"
        if self.value == 0:
            return f"none ({self.key} {self._low()} does not fit)"
        at = f"{self.value} ({gib(self.prediction.peak_bytes)})"
        if self.notes:
            return f"{at}: {'; '.join(self.notes)}"
        return at + (" = the cap" if self.value == self.cap else "")

    def _low(self) -> int:
        return 2 if self.key == "seq_len" else 1


def size_cap(config: CellConfig, key: str) -> int:
    """The largest ``key`` tried: :data:`BATCH_CAP` for batch_size; for seq_len the positions the pair's models
    take (the smaller), else :data:`SEQ_CAP`."""
    if key == "batch_size":
        return BATCH_CAP
    from kdbench.models.lm import max_positions, model_config

    caps = []
    for role, name in (("teacher", config.pair.teacher), ("student", config.pair.student)):
        try:
            model = model_config(name, getattr(config.overrides, role))
        except Exception:  # not a registered LM (a module:callable): no positions known
            model = None
        n = max_positions(model) if model is not None else None
        if n:
            caps.append(n)
    return min(caps) if caps else SEQ_CAP


def size_of(config: CellConfig, key: str) -> int:
    node: Any = config
    for part in SIZE_KEYS[key]:
        node = getattr(node, part)
    return int(node)


def with_size(config: CellConfig, key: str, value: int) -> CellConfig | None:
    *parents, leaf = SIZE_KEYS[key]
    update: dict[str, Any] = {leaf: value}
    for p in reversed(parents):
        update = {p: update}
    return changed(config, update)


def largest(config: CellConfig, key: str, usable: Budget, predictor: Predictor) -> Largest:
    """The largest value v of ``key`` (:data:`SIZE_KEYS`) at which ``config`` fits ``usable`` (a :data:`Budget`),
    with v + 1 not fitting (or v the cap): from the cell's own value, doubled until it does not fit (or halved until
    it does), then bisected.  A value kdbench would refuse for the cell (a sequence, with the tokens its serving
    decodes, beyond the models' positions) counts as one that does not fit: the search stays within what the cell
    takes."""
    low_bound = 2 if key == "seq_len" else 1
    cap = size_cap(config, key)
    runs0 = predictor.runs
    cache: dict[int, Any] = {}  # in the order tried
    refused: set[int] = set()

    def at(v: int):
        """The prediction at ``v`` (None: kdbench refuses the cell there)."""
        if v not in cache:
            c = with_size(config, key, v)
            cache[v] = predictor(c) if c is not None else None
            if c is None:
                refused.add(v)
        return cache[v]

    def result(value: int, error: str | None = None) -> Largest:
        above = cache.get(value + 1 if value else low_bound)
        note = (f"{key} {value + 1} is beyond what the cell takes",) if value + 1 in refused else ()
        runs = predictor.runs - runs0
        tried = tuple(v for v in cache if v not in refused)
        return Largest(key, None if error else value, cap, cache.get(value), above, error, runs, note, tried)

    def step(v: int) -> bool | str:
        """Whether the cell fits at ``v`` (a refused value does not), or why it is unpredictable there."""
        q = at(v)
        if q is None:
            return False
        if not q.ok:
            return q.error or "unpredictable"
        return fits(q, usable)

    v = min(max(size_of(config, key), low_bound), cap)
    lo, hi = None, None
    first = step(v)
    if isinstance(first, str):
        return result(v, first)
    if first:
        lo = v
        while hi is None and lo < cap:
            nxt = min(lo * 2, cap)
            ok = step(nxt)
            if isinstance(ok, str):
                return result(nxt, ok)
            lo, hi = (nxt, None) if ok else (lo, nxt)
        if hi is None:
            return result(cap)
    else:
        hi = v
        while lo is None:
            if hi == low_bound:
                return result(0)
            nxt = max(hi // 2, low_bound)
            ok = step(nxt)
            if isinstance(ok, str):
                return result(nxt, ok)
            lo, hi = (nxt, hi) if ok else (None, nxt)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok = step(mid)
        if isinstance(ok, str):
            return result(mid, ok)
        lo, hi = (mid, hi) if ok else (lo, mid)
    return result(lo)


class Sizes:
    """:func:`largest` for one device, each (cell, key) searched once: the verdict's batch search and ``--max``'s
    lines read the same answer."""

    def __init__(self, usable: Budget, predictor: Predictor):
        self.usable, self.predictor = usable, predictor
        self._found: dict[tuple[str, str], Largest] = {}

    def largest(self, config: CellConfig, key: str) -> Largest:
        from kdbench.fit.planner import fake_run_key

        at = (fake_run_key(config), key)
        if at not in self._found:
            self._found[at] = largest(config, key, self.usable, self.predictor)
        return self._found[at]


def impls_to_size(config: CellConfig) -> list[CellConfig]:
    """The cell once per loss implementation its family takes (LM cells: every ``loss_impl`` kdbench would run for
    it, the cell's own first), or the cell alone."""
    if "loss_impl" not in workload_of(config).takes:
        return [config]
    from kdbench.distill.lm.impls import LOSS_IMPLS

    out = [config]
    for impl in LOSS_IMPLS:
        if impl != config.loss_impl:
            c = changed(config, {"loss_impl": impl})
            if c is not None:
                out.append(c)
    return out
