"""Workloads: what differs between the families of teacher/student pair, behind one interface.

A cell's pair belongs to one family: image classifiers (:mod:`.vision`), causal language models (the wing
:mod:`.lm`, whose decoding is :mod:`kdbench.models.generation`'s) or BERT-shaped encoders (:mod:`.encoder`).
The engine, the workers, the cell orchestrator (:mod:`kdbench.run.cell`), the distillation step
(:mod:`kdbench.distill.step`), the step's measurement (:mod:`kdbench.measure.step`), the store and the report are
the same for all three; what differs sits behind :class:`~.base.Workload`: the models, the batch, the loss and its
inputs (logits, or hidden states and LM-head weights), the feature taps, the plan-time checks and the settings the
family takes, the planned serving measurements and how each is measured, and the config columns only the family
fills; the checks LM and encoder cells share are :mod:`.model_checks`', where each model is built
:mod:`.placement`'s.
:func:`~.registry.workload_of` decides a cell's family, in one place (:mod:`.registry`).
"""

from __future__ import annotations

from kdbench.workloads.base import Workload
from kdbench.workloads.registry import (
    FAMILY_SETTINGS,
    check_cell,
    expand_checked,
    planned_measurements,
    refusals,
    workload_of,
)

__all__ = [
    "FAMILY_SETTINGS",
    "Workload",
    "check_cell",
    "expand_checked",
    "planned_measurements",
    "refusals",
    "workload_of",
]
