"""The student's optimizer (``optimizer:``), a cell's and the quality recipe's alike."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kdbench.config.base import Strict


class OptimizerConfig(Strict):
    # the student's optimizer
    name: Literal["adamw", "adam", "sgd"] = "adamw"
    # learning rate
    lr: float = Field(1e-4, gt=0, le=10)
    # weight decay (null: the optimizer's own default)
    weight_decay: float | None = Field(None, ge=0, le=1)
    # SGD's momentum (ignored by adam and adamw)
    momentum: float = Field(0.9, ge=0, lt=1)
    impl: Literal["default", "foreach", "fused"] = "default"  # torch's implementation of the update
