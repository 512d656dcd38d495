"""Workloads: what differs between the kinds of teacher/student pair, behind one interface.

A cell's pair belongs to a family: image classifiers (:mod:`.vision`), causal language
models (:mod:`.lm`) or BERT-shaped encoders (:mod:`.encoder`).  The engine, the workers, the cell measurement
(:mod:`kdbench.measure.cell`), the distillation step (:mod:`kdbench.distill.step`), the store
and the report are the same for both; what differs sits behind :class:`~.base.Workload`:
building the models, the batch, the loss and its inputs (logits, or hidden states and LM-head
weights), the feature taps, the plan-time checks, the planned serving measurements and how
each is measured, and the columns only one family has.  :func:`workload_of` picks a cell's.
"""

from __future__ import annotations

from kdbench.workloads.base import Workload, is_lm_model, workload_of

__all__ = ["Workload", "is_lm_model", "workload_of"]
