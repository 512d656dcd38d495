"""The workload interface, and the choice of a cell's workload by its pair's family."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kdbench.names import Measurement
from kdbench.schema import Row

Problems = list[tuple[tuple[str, ...], str]]


class Workload:
    """What one family of pairs does differently; every method takes the resolved cell config."""

    family = ""

    def check(self, config: Any, allow_imports: bool) -> Problems:
        """What cannot run in the cell, as (setting path, message), found without building anything heavy."""
        raise NotImplementedError

    def planned(self, config: Any) -> list[tuple[Measurement, int]]:
        """(measurement, batch size) of every row the cell produces, the step first."""
        raise NotImplementedError

    def build_pair(self, config: Any, backend: Any, cache: Any) -> tuple[nn.Module, nn.Module]:
        """Fresh copies of the teacher and the student, on the device, as the step and serving use them."""
        raise NotImplementedError

    def batch(self, config: Any, batch_size: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One fixed, seeded batch: the models' input and the targets of the loss."""
        raise NotImplementedError

    def feature_paths(self, teacher: nn.Module, student: nn.Module, example: torch.Tensor, config: Any) -> Any:
        """The paired module paths feature methods tap (:class:`kdbench.distill.hooks.FeaturePaths`)."""
        raise NotImplementedError

    def loss(self, config: Any, shapes: Any, teacher: nn.Module, student: nn.Module, backend: Any) -> nn.Module:
        """The cell's whole loss: ``loss(LossInputs) -> scalar``; the model outputs it gets are the models'
        forwards' (logits for classifiers, final hidden states for LMs)."""
        raise NotImplementedError

    def compact_teacher(self, distiller: Any, outputs: Any, targets: torch.Tensor) -> tuple[Any, Row]:
        """The teacher's outputs of the fixed batch in the workload's compact form (``teacher.mode`` other than live
        and cached), and the columns that describe it."""
        raise NotImplementedError(f"teacher.mode {distiller.config.teacher.mode} is not for {self.family} pairs")

    def step_columns(self, step: Any, config: Any, x: torch.Tensor) -> tuple[Row, tuple[str, ...]]:
        """The step row's columns only this family has, and notes."""
        raise NotImplementedError

    def measure(
        self,
        measurement: Measurement,
        batch_size: int,
        teacher: nn.Module,
        student: nn.Module,
        config: Any,
        backend: Any,
    ) -> Row:
        """One serving measurement's row (the step is measured by the cell, the same for every family)."""
        raise NotImplementedError

    def skip_reason(self, config: Any, backend: Any) -> str | None:
        """Why the cell cannot run in this environment (a package or an API it needs is missing), with the fix;
        None: it can.  The cell's rows are then stored as skipped, saying so."""
        return None

    def tokens(self, measurement: Measurement, batch_size: int, config: Any) -> int | None:
        """Tokens one timed call processes (None: not a token workload)."""
        return None


def is_lm_model(name: str) -> bool:
    """A registered language model's name, or a local transformers ``config.json``."""
    from kdbench.models.lm import LM_CONFIGS

    return name in LM_CONFIGS or name.endswith(".json")


def workload_of(config: Any) -> Workload:
    """The cell's workload: language models when the pair is LMs or the data is tokens, else image classifiers
    (the checks report a pair that mixes the two)."""
    if config.data.kind == "tokens" or is_lm_model(config.pair.teacher) or is_lm_model(config.pair.student):
        from kdbench.workloads.lm import LM

        return LM
    from kdbench.workloads.vision import VISION

    return VISION
