"""Where each model of a language-model or encoder cell is built, and what that takes of the host's memory per rank.

One list decides both (:func:`step_builds`, :func:`serving_builds`): the workloads build what it says
(:func:`fresh_model`), and :func:`footprint` counts the host bytes of every copy it implies from the models'
parameter counts (built on ``meta``: nothing allocated), so the plan's figure and the run agree by construction.

How a model is built.  A small one (at most :data:`kdbench.models.cache.MAX_KEPT_BYTES` in float32) comes from the
worker's model cache: a float32 master kept on the host, copied per cell, cast (a teacher held in
``teacher.weights``) and moved to the device.  A larger one is built afresh, directly where it is used and in the
dtype it is held in (the frozen teacher in ``teacher.weights``, the student in float32: it trains float32 master
weights), its random draws made on the host one tensor at a time (:mod:`kdbench.models.seeded`): the same weights
as the cached path, and no whole copy on the host when the cell runs on a GPU.

FSDP2 cells.  Each rank needs its shards only.  Rank 0 builds the frozen teacher whole on the host, in its dtype; the
other ranks build it on ``meta``.  Once ``fully_shard`` has sharded it (:func:`kdbench.measure.parallel.shard`
tells the model, :meth:`kdbench.models.lm.CausalLM.set_fsdp_root`), the other ranks allocate their shards and every
parameter travels from rank 0, whole, one at a time, each rank keeping its shard (:func:`receive_from_rank0`): every
rank holds the weights a single-device build has.  The student is built on every rank's device whole and sharded
(it is the smaller model; DDP builds it the same way).  After the step rank 0 builds whole copies for serving.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kdbench.hw.backends import DTYPES

EVERY, ROOT, OTHERS = "every rank", "rank 0", "the other ranks"
STEP, SERVING, ALWAYS = "step", "serving", "always"  # when a copy is held (ALWAYS: for as long as the worker lives)
ROLES = ("teacher", "student")
GiB = 2**30


@dataclass(frozen=True)
class ModelBuild:
    """How one model of a cell is built: on the cell's ``device``, on the ``host`` (the CPU) or on ``meta`` (nothing
    allocated; it receives its weights later), in ``dtype`` (``fp32``, ``bf16``, ``fp16``); ``sharded``: FSDP2 shards
    it after it is built."""

    role: str
    where: str
    dtype: str
    sharded: bool = False


def step_builds(config: Any, root: bool = True) -> tuple[ModelBuild, ModelBuild]:
    """The models the distillation step trains with, on rank 0 (``root``) or another rank."""
    weights = config.teacher.weights
    if config.parallel == "fsdp" and config.world_size > 1:
        return (
            ModelBuild("teacher", "host" if root else "meta", weights, sharded=True),
            ModelBuild("student", "device", "fp32", sharded=True),
        )
    return ModelBuild("teacher", "device", weights), ModelBuild("student", "device", "fp32")


def serving_builds(config: Any) -> tuple[ModelBuild, ModelBuild] | None:
    """The whole copies rank 0 builds for serving after a step that sharded the pair (None: serving measures the
    step's pair)."""
    if config.parallel == "fsdp" and config.world_size > 1:
        return ModelBuild("teacher", "device", config.teacher.weights), ModelBuild("student", "device", "fp32")
    return None


# --------------------------------------------------------------------------- counting


@dataclass(frozen=True)
class HostCopy:
    """One copy of (a part of) a model on the host: what it is, its bytes, which ranks hold it and when;
    ``transient``: held only while one model is built or received, one such at a time."""

    what: str
    nbytes: int
    ranks: str = EVERY
    phase: str = STEP
    transient: bool = False

    def held_by(self, root: bool) -> bool:
        return self.ranks == EVERY or (self.ranks == ROOT) == root


@dataclass(frozen=True)
class HostFootprint:
    """What a cell's models take of the host, per rank: every copy a rank holds (parameters × bytes per dtype; not
    activations, gradients or optimizer state: a count of the models' copies, not a prediction of the step's peak).
    ``unknown``: why it cannot be counted before the run (a ``module:callable`` model); ``fix``: what lowers it."""

    copies: tuple[HostCopy, ...] = ()
    unknown: str = ""
    fix: str = ""

    def rank_bytes(self, root: bool = True) -> int | None:
        """The most a rank (rank 0, or any other) holds at once: the copies of its step, or of its serving, with
        what it keeps throughout, and the largest of the transient ones (they come one at a time)."""
        if self.unknown:
            return None
        phases = {c.phase for c in self.copies} - {ALWAYS} or {STEP}
        held = [c for c in self.copies if c.held_by(root)]

        def at(phase: str) -> int:
            now = [c for c in held if c.phase in (phase, ALWAYS)]
            return sum(c.nbytes for c in now if not c.transient) + max(
                (c.nbytes for c in now if c.transient), default=0
            )

        return max(at(phase) for phase in phases)

    def node_bytes(self, ranks: int) -> int | None:
        """What ``ranks`` ranks on one node hold together, rank 0 among them."""
        root = self.rank_bytes(True)
        return None if root is None else root + (ranks - 1) * self.rank_bytes(False)

    def summary(self, world_size: int) -> str:
        """One line: the figure per rank (rank 0 apart when it differs)."""
        if self.unknown:
            return f"host: not counted ({self.unknown})"
        root, other = self.rank_bytes(True), self.rank_bytes(False)
        if world_size == 1 or root == other:
            return f"host {gib(root)} per rank"
        return f"host {gib(root)} on rank 0, {gib(other)} on each other rank"

    def details(self) -> str:
        """Every copy, as the plan counts it."""
        return "; ".join(f"{c.what} {gib(c.nbytes)} ({c.ranks}{_when(c)})" for c in self.copies)


def _when(c: HostCopy) -> str:
    when = {STEP: "", SERVING: ", after the step", ALWAYS: ", kept"}[c.phase]
    return when + (", one at a time" if c.transient else "")


def gib(nbytes: int | None) -> str:
    """``nbytes`` in GiB (in MiB below 1 GiB, KiB below 1 MiB: a small model's figure is not 0.0)."""
    if nbytes is None:
        return "?"
    unit = next(u for u in ((GiB, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B")) if nbytes >= u[0] or u[0] == 1)
    return f"{nbytes / unit[0]:.1f} {unit[1]}"


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype in ("fp32", "tf32") else 2


def model_copies(
    label: str,
    params: int,
    largest: int,
    build: ModelBuild,
    kept: bool,
    device_type: str,
    ranks: str,
    phase: str,
    master: bool = True,
) -> list[HostCopy]:
    """The host copies of building one model whole as ``build`` says (``kept``: through the model cache, whose
    master is counted with ``master``)."""
    on_host = build.where == "host" or (build.where == "device" and device_type == "cpu")
    if build.where == "meta":
        return []
    if kept:
        moved = "" if on_host else ", moved to the device"
        copy = HostCopy(f"{label} fp32 copy of the cached master{moved}", params * 4, ranks, phase, not on_host)
        if not master:
            return [copy]
        return [HostCopy(f"{label} fp32 master in the worker's model cache", params * 4, ranks, ALWAYS), copy]
    size = dtype_bytes(build.dtype)
    if on_host:
        out = [HostCopy(f"{label} {build.dtype} whole, built on the host", params * size, ranks, phase)]
        if size < 4:
            drawn = f"{label}'s largest tensor drawn in fp32 as it is built"
            out.append(HostCopy(drawn, largest * 4, ranks, phase, transient=True))
        return out
    drawn = f"{label} built on the device: its largest tensor drawn on the host in fp32"
    return [HostCopy(drawn, largest * 4, ranks, phase, transient=True)]


def footprint(
    config: Any, device_type: str, counts: dict[str, tuple[int, int]], kept: dict[str, bool]
) -> HostFootprint:
    """The host copies of a cell whose models have ``counts`` (role -> parameters, largest tensor's elements) and go
    through the model cache where ``kept`` says, on ``device_type`` (``cpu`` or a GPU's)."""
    n = config.world_size
    fsdp = config.parallel == "fsdp" and n > 1
    copies: list[HostCopy] = []
    for build in step_builds(config, root=True):  # the other ranks build the same, but the teacher on meta
        params, largest = counts[build.role]
        label = f"{build.role} {getattr(config.pair, build.role)}"
        ranks = ROOT if fsdp and build.where == "host" else EVERY
        copies += model_copies(label, params, largest, build, kept[build.role], device_type, ranks, STEP)
        if not build.sharded:
            continue
        size = dtype_bytes(build.dtype)
        if device_type == "cpu" or (config.fsdp.cpu_offload and device_type != "cpu"):
            where = "on the host" if device_type == "cpu" else "offloaded to the host"
            copies.append(HostCopy(f"{label} {build.dtype} shard (1/{n}) {where}", params * size // n))
        if build.where == "host" and device_type == "cpu":  # the ranks that built it on meta receive it
            received = f"{label}'s largest tensor received whole from rank 0"
            copies.append(HostCopy(received, largest * size, OTHERS, transient=True))
    serving = serving_builds(config)
    for build in serving or ():
        params, largest = counts[build.role]
        label = f"{build.role} {getattr(config.pair, build.role)} for serving"
        copies += model_copies(label, params, largest, build, kept[build.role], device_type, ROOT, SERVING, False)
    return HostFootprint(tuple(copies), fix=_fix(config))


def _fix(config: Any) -> str:
    ways = []
    if config.teacher.weights == "fp32":
        ways.append("teacher.weights: bf16 (with teacher_precision: bf16) halves the teacher's copies")
    if config.world_size > 1 and config.parallel != "fsdp":
        ways.append("parallel: fsdp leaves whole copies to rank 0 alone")
    if config.world_size > 1:
        ways.append("fewer ranks per node (launcher.nnodes)")
    ways.append("or free host memory / run it on a machine with more")
    return "; ".join(ways)


# --------------------------------------------------------------------------- building


def counted(facts: Any, name: str) -> tuple[int, int]:
    """(parameters, elements of the largest parameter) of a model the plan built on ``meta``
    (:class:`kdbench.models.meta.ModelFacts`)."""
    if facts.params is None:
        raise ValueError(f"{name} could not be built on meta")
    return facts.params, facts.largest


def pair_footprint(config: Any, device_type: str, count) -> HostFootprint:
    """:func:`footprint` of a language-model or encoder pair, ``count(role)`` giving each model's counts (None: user
    code, not counted before the run)."""
    from kdbench.models.cache import MAX_KEPT_BYTES

    counts = {}
    for role in ROLES:
        name = getattr(config.pair, role)
        try:
            counts[role] = count(role)
        except Exception as exc:  # a model the plan's checks let through but meta cannot build: the run says why
            return HostFootprint(unknown=f"the {role} {name} could not be built on meta ({type(exc).__name__})")
        if counts[role] is None:
            return HostFootprint(unknown=f"the {role} {name} is user code: its size is known once it is built")
    kept = {role: params * 4 <= MAX_KEPT_BYTES for role, (params, _) in counts.items()}
    return footprint(config, device_type, counts, kept)


def fresh_model(
    config: Any, build: ModelBuild, device: torch.device, cache: Any, key: tuple, nbytes: int | None, kept, direct, wrap
) -> nn.Module:
    """A fresh model as ``build`` says, wrapped by ``wrap``, in place: from the cache (``kept()`` builds the float32
    CPU master it keeps; the copy is cast and moved) when it is small or of unknown size (``nbytes``: its float32
    bytes; None for user code, which the cache sizes once built), else built directly where it is used in its dtype
    (``direct(device, dtype)``, seeded here as the cache seeds ``kept``)."""
    where = {"host": torch.device("cpu"), "meta": torch.device("meta")}.get(build.where, device)
    if build.where != "meta" and (nbytes is None or cache.keeps(nbytes)):
        model = wrap(cache.get_built(key, config.seed, kept))
    else:
        torch.manual_seed(config.seed)
        model = wrap(direct(where, DTYPES[build.dtype]))
    if build.role == "teacher":
        cast_teacher_weights(model, config)
    if build.where == "meta" or all(t.device == where for t in (*model.parameters(), *model.buffers())):
        return model  # already there (a fit's fake build: moving a fake tensor onto its own device cannot swap it)
    return model.to(where)


def cast_teacher_weights(teacher: nn.Module, config: Any) -> nn.Module:
    """``teacher`` (frozen) with its parameters cast to ``teacher.weights``, in place; its buffers (rotary
    frequencies, ...) stay as built, as transformers keeps them in float32 when it loads a model in bf16."""
    if config.teacher.weights != "fp32":
        dtype = DTYPES[config.teacher.weights]
        for p in teacher.parameters():
            p.data = p.data.to(dtype)
    return teacher


def hold_for_serving(lm: nn.Module, choice: Any) -> str | None:
    """Hold ``lm`` as a deployment holds it for serving: under a 16-bit autocast (a bf16 or fp16 cell) its
    floating-point parameters are cast to that dtype, in place, once (after the step: serving comes last in a cell),
    and their gradients let go; its buffers (rotary frequencies, ...) stay as built, as transformers keeps them in
    float32 when it loads a model in bf16.  Held in float32, every call under ``inference_mode`` would read each
    weight in float32 and write and read a 16-bit copy (autocast's weight-cast cache does not apply there), and K
    would be cached in float32 (rotary's cos/sin follow the hidden states' dtype).  The dtype the parameters are
    held in when it returns (kdbench's name: ``bf16``, ``fp16``, ``fp32``; None for a model without parameters)."""
    if choice is not None and choice.applied and choice.dtype in (torch.bfloat16, torch.float16):
        for p in lm.parameters():
            if p.is_floating_point() and p.dtype != choice.dtype:
                p.grad = None
                p.data = p.data.to(choice.dtype)
    held = {p.dtype for p in lm.parameters() if p.is_floating_point()}
    names = {v: k for k, v in DTYPES.items() if k != "tf32"}
    return "+".join(sorted(names.get(d, str(d).removeprefix("torch.")) for d in held)) or None


def receive_from_rank0(
    root: nn.Module, whole: dict[str, torch.Tensor] | None, group: Any, device: torch.device, offload: bool = False
) -> None:
    """Fill the FSDP2 shards of ``root`` with rank 0's weights, on every rank of ``group``: ``whole`` is rank 0's
    model as built, before sharding (name -> tensor), None on the ranks that built it on ``meta`` (they allocate
    their shards here, ``to_empty``: on the host under ``offload``, FSDP2's CPUOffloadPolicy, the buffers on
    ``device`` as FSDP2 places them).  Each parameter travels whole from rank 0, one at a time, and each rank keeps
    its shard (placed as the parameter's DTensor placements say); the buffers, not sharded, are broadcast."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    if whole is None:
        root.to_empty(device=torch.device("cpu") if offload else device)
        for module in root.modules() if offload else ():
            for key, buffer in module._buffers.items():  # torch's table of the module's own buffers
                if buffer is not None:
                    module._buffers[key] = buffer.to(device)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    # torch >= 2.7 scatters from rank 0 unless told the tensor is already the same everywhere (it is: broadcast)
    local = {"src_data_rank": None} if "src_data_rank" in inspect.signature(distribute_tensor).parameters else {}
    with torch.no_grad():
        for name, param in root.named_parameters():
            full = (
                whole[name].to(device)
                if whole is not None
                else torch.empty(param.shape, dtype=param.dtype, device=device)
            )
            dist.broadcast(full, src=src, group=group)
            if hasattr(param, "device_mesh"):
                shard = distribute_tensor(full, param.device_mesh, param.placements, **local)
                param.to_local().copy_(shard.to_local())
            else:
                param.copy_(full)
            del full
        for buffer in root.buffers():
            dist.broadcast(buffer, src=src, group=group)
