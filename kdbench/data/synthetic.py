"""Input batches: synthetic, deterministic, the same shapes every iteration, placed at the
cell's byte alignment (kdbench.hw.layout.place_aligned)."""

from __future__ import annotations

import torch

from kdbench.config.schema import CellConfig
from kdbench.hw.layout import memory_format_of, place_aligned


def synthetic_batch(
    config: CellConfig, batch_size: int, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch of standard-normal inputs and uniform labels, generated on the CPU from
    `seed` (identical on every backend) and moved to `device` in the cell's memory format."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((batch_size, *config.data.shape), generator=g)
    y = torch.randint(0, config.data.num_classes, (batch_size,), generator=g)
    x = x.to(device)
    if x.dim() == 4:
        x = x.contiguous(memory_format=memory_format_of(config.memory_format))
    return place_aligned(x, config.alignment), place_aligned(y.to(device), config.alignment)
