"""One rank's part in a data-parallel measurement: what the ranks must agree on.

DDP needs every rank to make the same collective calls, so the ranks agree on one
iteration count before timing, time each iteration locally, then gather the samples:
each iteration counts at its slowest rank.  The student (with its adapters) is
wrapped in DistributedDataParallel, the teacher staying a plain frozen module; or, with
``parallel: fsdp``, both are sharded with FSDP2 over one device mesh of the cell's own group.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kdbench.config.schema import CellConfig
from kdbench.core.schema import Row
from kdbench.hw.backends import DTYPES, Backend
from kdbench.measure.timing import RawTiming, timed_loop

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def fsdp_module() -> ModuleType | None:
    """The module of FSDP2 (``fully_shard``, ``MixedPrecisionPolicy``, ``CPUOffloadPolicy``) where this torch has
    it: ``torch.distributed.fsdp`` from 2.6, the composable ``torch.distributed._composable.fsdp`` before; None
    without either."""
    import importlib

    for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, "fully_shard", None) is not None:
            return module
    return None


def fully_shard_api():
    """``fully_shard`` (FSDP2) where this torch has it (:func:`fsdp_module`); None without it."""
    module = fsdp_module()
    return module.fully_shard if module is not None else None


def cell_mesh(group: Any, device_type: str) -> Any:
    """The cell's 1-D device mesh over its own process group (``group``; None: the world).

    ``DeviceMesh.from_group`` wraps the group as it is: no collective.  ``init_device_mesh`` would build a mesh
    over the whole world, whose sub-group creation every rank of the world must enter: in an allocation larger
    than the cell (``torchrun ... -m kdbench run``, ``srun``) the other ranks wait in a barrier, and the cell
    hangs until the group's time-out.  A torch without ``from_group`` can build the world's mesh only."""
    from torch.distributed import device_mesh

    pg = group if group is not None else dist.group.WORLD
    from_group = getattr(device_mesh.DeviceMesh, "from_group", None)
    if from_group is not None:
        return from_group(pg, device_type)
    if dist.get_world_size(group) != dist.get_world_size():
        raise RuntimeError(
            f"torch {torch.__version__} has no DeviceMesh.from_group: an FSDP2 cell smaller than its allocation "
            "cannot build its device mesh; run it in an allocation of its own world_size"
        )
    return device_mesh.init_device_mesh(device_type, (dist.get_world_size(),))


def mixed_precision(config: CellConfig, fsdp: ModuleType) -> Any:
    """FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` from ``fsdp.param_dtype`` / ``fsdp.reduce_dtype``
    (as torchtune and torchtitan pass it); None when both are null (the parameters' own dtypes)."""
    param, reduce = config.fsdp.param_dtype, config.fsdp.reduce_dtype
    if param is None and reduce is None:
        return None
    return fsdp.MixedPrecisionPolicy(
        param_dtype=DTYPES[param] if param else None, reduce_dtype=DTYPES[reduce] if reduce else None
    )


def dtype_names(module: nn.Module) -> str:
    """The dtypes of ``module``'s floating parameters, by name, joined with ``+`` when there are several."""
    found = {p.dtype for p in module.parameters() if p.is_floating_point()}
    return "+".join(sorted(DTYPE_NAMES.get(d, str(d)) for d in found))


def shard(
    root: nn.Module,
    model: nn.Module,
    mesh: Any,
    layers_reshard: bool,
    fsdp: ModuleType,
    mp_policy: Any = None,
    cpu_offload: bool = False,
) -> nn.Module:
    """``root`` sharded with FSDP2 over ``mesh``: each decoder layer of ``model`` (its ``decoder_layers()``) its own
    unit, resharded after its forward when ``layers_reshard``, then ``root`` for the rest (embeddings, final norm,
    LM head, adapters).

    The root gets no ``reshard_after_forward``: torch's default for a root (``None`` from 2.8, before it an
    exception every root had) keeps its parameters gathered after its forward.  The loss applies the LM head
    outside the forward (``distill.lm.loss.LMLoss``) on those gathered parameters, and the student's backward,
    which begins with the head, needs them at once: each root is gathered once per step."""
    common: dict[str, Any] = {"mesh": mesh}
    if mp_policy is not None:
        common["mp_policy"] = mp_policy
    if cpu_offload:
        common["offload_policy"] = fsdp.CPUOffloadPolicy()
    for path in model.decoder_layers():
        fsdp.fully_shard(model.get_submodule(path), reshard_after_forward=layers_reshard, **common)
    fsdp.fully_shard(root, **common)
    model.set_fsdp_root(root)  # the LM loss reshards the teacher's root through it (CausalLM.fsdp_root)
    return root


@dataclass(frozen=True)
class DataParallel:
    """This process's rank in ``group`` (None: the default process group), for one cell: an FSDP2 cell's device
    mesh is made once, at its first model sharded, and shared by teacher and student."""

    group: Any = None
    _cell: dict = field(default_factory=dict, compare=False, repr=False)  # the mesh, what was gathered in which dtype

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def root(self) -> bool:
        return self.rank == 0

    def _shard(self, role: str, root: nn.Module, model: nn.Module, config: CellConfig, backend: Backend) -> nn.Module:
        fsdp = fsdp_module()
        if fsdp is None:
            raise RuntimeError(f"torch {torch.__version__} has no FSDP2 fully_shard")
        if "mesh" not in self._cell:
            self._cell["mesh"] = cell_mesh(self.group, backend.device_type)
        policy = mixed_precision(config, fsdp)
        own = dtype_names(root)
        param, reduce = config.fsdp.param_dtype, config.fsdp.reduce_dtype
        self._cell[f"{role}_all_gather"] = param or own
        if role == "student":
            self._cell["reduce"] = reduce or param or own
        # The frozen teacher has no backward to free its gathered layers: resharded after its forward always;
        # reshard_after_forward is the student's option.
        layers = config.fsdp.reshard_after_forward if role == "student" else True
        return shard(root, model, self._cell["mesh"], layers, fsdp, policy, config.fsdp.cpu_offload)

    def wrapper(self, config: CellConfig, backend: Backend) -> Callable[[nn.Module], nn.Module]:
        """Wraps what trains (the student and its adapters) in DDP with the cell's options, or shards it with
        FSDP2 (``parallel: fsdp``)."""

        def wrap(trainee: nn.Module) -> nn.Module:
            if config.parallel == "fsdp":
                return self._shard("student", trainee, trainee.student, config, backend)
            return DistributedDataParallel(
                trainee,
                device_ids=[backend.device] if backend.device_type == "cuda" else None,
                bucket_cap_mb=config.ddp.bucket_cap_mb,
                gradient_as_bucket_view=config.ddp.gradient_as_bucket_view,
                static_graph=config.ddp.static_graph,
                process_group=self.group,
            )

        return wrap

    def teacher_wrapper(self, config: CellConfig, backend: Backend) -> Callable[[nn.Module], nn.Module] | None:
        """FSDP2 cells shard the frozen teacher too (every forward all-gathers its layers, which are freed after
        it whatever ``fsdp.reshard_after_forward`` says); DDP leaves it whole."""
        if config.parallel != "fsdp":
            return None
        return lambda teacher: self._shard("teacher", teacher, teacher, config, backend)

    def columns(self) -> Row:
        """What an FSDP2 step's collectives moved: the dtype each model's parameters were all-gathered in and the
        dtype of the student's gradient reduce-scatter (nothing for DDP)."""
        if "mesh" not in self._cell:
            return {}
        return {
            "fsdp_all_gather_dtype": self._cell.get("student_all_gather"),
            "fsdp_teacher_all_gather_dtype": self._cell.get("teacher_all_gather"),
            "fsdp_reduce_dtype": self._cell.get("reduce"),
        }

    def timed(self, fn: Callable[[], Any], config: CellConfig, backend: Backend, on_window=None) -> RawTiming:
        """The timed loop with one iteration count on every rank: the cold call, the warm-up and one
        probe call tell each rank how many iterations its `min_time_s` needs; all take the largest.

        The result is the second loop's samples and window with the probe's cold call and warm-up: its
        ``cold_s`` is the probe's cold call, its ``warmup_s`` the host time from the probe's warm-up to the
        second loop's window (the warm-up, the probe call, the agreement, the second loop's own first call),
        so ``cold_excess_ms`` and a lever's ``one_off_ms`` count the cold start (communicators, FSDP2's lazy
        init, the first gathers) as on one device."""
        t = config.timing
        clock = backend.clock()
        probe = timed_loop(fn, clock, warmup=t.warmup, min_iters=1, min_time_s=0.0, max_iters=1)
        wanted = max(t.min_iters, math.ceil(t.min_time_s * 1e3 / max(probe.samples_ms[0], 1e-6)))
        began = time.perf_counter()
        agreed = torch.tensor([min(wanted, t.max_iters), probe.first_ms], dtype=torch.float64, device=backend.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        n, first_ms = int(agreed[0].item()), float(agreed[1].item())
        agreeing_s = time.perf_counter() - began
        raw = timed_loop(fn, clock, warmup=0, min_iters=n, min_time_s=0.0, max_iters=n, on_window=on_window)
        # The probe call and this loop's own first call were warm: they count as warm-up.
        warmup_ms = [*probe.warmup_ms, *probe.samples_ms, raw.first_ms]
        probe_s = probe.window_s[1] - probe.window_s[0] if probe.window_s else sum(probe.samples_ms) / 1e3
        warmup_s = probe.warmup_s + probe_s + agreeing_s + raw.cold_s + raw.warmup_s
        return replace(
            raw, first_ms=first_ms, warmup_ms=warmup_ms, host_ms=probe.host_ms, cold_s=probe.cold_s, warmup_s=warmup_s
        )

    def slowest(self, raw: RawTiming, backend: Backend) -> RawTiming:
        """``raw`` with every call (cold, warm-up, timed) at its slowest rank, gathered from every rank:
        the iterations of a data-parallel step end together."""
        calls = [raw.first_ms, *raw.warmup_ms, *raw.samples_ms]  # the same count on every rank
        mine = torch.tensor(calls, dtype=torch.float64, device=backend.device)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine, group=self.group)
        slowest = torch.stack(everyone).max(dim=0).values.tolist()
        n = len(raw.warmup_ms)
        return replace(raw, first_ms=slowest[0], warmup_ms=slowest[1 : n + 1], samples_ms=slowest[n + 1 :])

    def mean(self, value: float, backend: Backend) -> float:
        total = torch.tensor([value], dtype=torch.float64, device=backend.device)
        dist.all_reduce(total, group=self.group)
        return float(total.item()) / self.world_size

    def barrier(self) -> None:
        dist.barrier(group=self.group)
