"""FLOPs of a callable, counted by torch.

:func:`count_flops` runs a callable once under ``torch.utils.flop_counter.FlopCounterMode``,
which counts only matmul-like and convolution ops (2 FLOPs per multiply-add; bias adds,
activations, norms and optimizer updates count 0), forward and backward as they
actually execute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.flop_counter import FlopCounterMode


def count_flops(fn: Callable[[], Any]) -> int:
    """Run `fn` once and return the FLOPs torch's flop counter attributes to it (2 per multiply-add)."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())
