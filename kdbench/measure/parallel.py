"""One rank's part in a data-parallel measurement: what the ranks must agree on.

DDP needs every rank to make the same collective calls, so the ranks agree on one
iteration count before timing, time each iteration locally, then gather the samples:
each iteration counts at its slowest rank.  The student (with its adapters) is
wrapped in DistributedDataParallel; the teacher stays a plain frozen module.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kdbench.config.schema import CellConfig
from kdbench.hw.backends import Backend
from kdbench.measure.timing import RawTiming, timed_loop


def fully_shard_api():
    """``fully_shard`` (FSDP2) where this torch has it: ``torch.distributed.fsdp`` from 2.6, the composable
    ``torch.distributed._composable.fsdp`` before; None without either."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError:
            return None
    return fully_shard


def shard(root: nn.Module, model: nn.Module, config: CellConfig, backend: Backend, group: Any = None) -> nn.Module:
    """``root`` sharded with FSDP2 over the ranks: each decoder layer of ``model`` (its ``decoder_layers()``)
    its own unit, then ``root`` for the rest (embeddings, final norm, LM head, adapters), which FSDP2 keeps
    gathered for the loss, which applies the LM head outside the forward (``distill.lm.loss.LMLoss``)."""
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard = fully_shard_api()
    if fully_shard is None:
        raise RuntimeError(f"torch {torch.__version__} has no FSDP2 fully_shard")
    mesh = init_device_mesh(backend.device_type, (dist.get_world_size(group),))
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": config.fsdp.reshard_after_forward}
    if config.fsdp.cpu_offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["offload_policy"] = CPUOffloadPolicy()
    for path in model.decoder_layers():
        fully_shard(model.get_submodule(path), **kwargs)
    fully_shard(root, **kwargs)
    model.set_fsdp_root(root)  # the LM loss gathers the root's LM head through it (CausalLM.fsdp_root)
    return root


@dataclass(frozen=True)
class DataParallel:
    """This process's rank in ``group`` (None: the default process group)."""

    group: Any = None

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def root(self) -> bool:
        return self.rank == 0

    def wrapper(self, config: CellConfig, backend: Backend) -> Callable[[nn.Module], nn.Module]:
        """Wraps what trains (the student and its adapters) in DDP with the cell's options, or shards it with
        FSDP2 (``parallel: fsdp``)."""

        def wrap(trainee: nn.Module) -> nn.Module:
            if config.parallel == "fsdp":
                return shard(trainee, trainee.student, config, backend, self.group)
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
        """FSDP2 cells shard the frozen teacher too (every forward all-gathers its layers); DDP leaves it whole."""
        if config.parallel != "fsdp":
            return None
        return lambda teacher: shard(teacher, teacher, config, backend, self.group)

    def timed(self, fn: Callable[[], Any], config: CellConfig, backend: Backend, on_window=None) -> RawTiming:
        """The timed loop with one iteration count on every rank: the cold call, the warm-up and one
        probe call tell each rank how many iterations its `min_time_s` needs; all take the largest."""
        t = config.timing
        clock = backend.clock()
        probe = timed_loop(fn, clock, warmup=t.warmup, min_iters=1, min_time_s=0.0, max_iters=1)
        wanted = max(t.min_iters, math.ceil(t.min_time_s * 1e3 / max(probe.samples_ms[0], 1e-6)))
        agreed = torch.tensor([min(wanted, t.max_iters), probe.first_ms], dtype=torch.float64, device=backend.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        n, first_ms = int(agreed[0].item()), float(agreed[1].item())
        raw = timed_loop(fn, clock, warmup=0, min_iters=n, min_time_s=0.0, max_iters=n, on_window=on_window)
        # The probe call and this loop's own first call were warm: they count as warm-up.
        warmup_ms = [*probe.warmup_ms, *probe.samples_ms, raw.first_ms]
        return replace(raw, first_ms=first_ms, warmup_ms=warmup_ms, host_ms=probe.host_ms)

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
