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
        """Wraps what trains (the student and its adapters) in DDP with the cell's options."""

        def wrap(trainee: nn.Module) -> nn.Module:
            return DistributedDataParallel(
                trainee,
                device_ids=[backend.device] if backend.device_type == "cuda" else None,
                bucket_cap_mb=config.ddp.bucket_cap_mb,
                gradient_as_bucket_view=config.ddp.gradient_as_bucket_view,
                static_graph=config.ddp.static_graph,
                process_group=self.group,
            )

        return wrap

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
