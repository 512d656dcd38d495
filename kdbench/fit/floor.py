"""A floor under a cell's step peak per device, counted without a fake run: what ``kdbench run --dry-run`` can say
of every cell in an instant.

The fit planner's fake run (:mod:`kdbench.fit.planner`) counts every tensor of the step, but takes seconds for a
small pair and minutes for an 8B one, too slow to run on every cell of a plan before anything runs.  This floor
counts only what the step cannot do without, at the cell's batch: the batch itself (an LM's input ids and labels,
int64; an image pair's float32 images) and the student's output over it: an LM's logits (batch x seq_len x
vocabulary, in the student's precision) where its loss takes them whole (``dense``, ``natural``), else its last
hidden states (batch x seq_len x hidden: the chunked losses take those).  Parameters, gradients, optimizer state,
activations and the teacher are left out: the true peak is above it, often far above; a floor over the device's
memory is a cell that cannot run (batch 65,536 x 1,000 tokens: terabytes of logits).  ``kdbench fit`` gives the
full count.  Torch-free: model configs are read, not built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kdbench.config.schema import CellConfig

WHOLE_LOGITS = ("dense", "natural")  # loss implementations that hold the student's logits whole


@dataclass(frozen=True)
class Floor:
    """At least ``bytes`` on one device during the step, and what they are, in words."""

    bytes: int
    what: str


def _element_bytes(precision: str) -> int:
    return 2 if precision in ("bf16", "fp16") else 4


def step_floor(config: CellConfig) -> Floor | None:
    """The floor of ``config``'s step peak per device (module docstring); None where it cannot be counted without
    building the models (a ``module:callable`` LM)."""
    from kdbench.workloads.registry import workload_of

    b = config.batch_size
    if "loss_impl" not in workload_of(config).takes:  # no logits to count: the batch alone
        if config.data.kind == "synthetic":  # data.shape is a synthetic sample's
            per = math.prod(config.data.shape)
            return Floor(b * per * 4, f"the batch, {b:,} x {' x '.join(map(str, config.data.shape))} float32 images")
        seq = config.data.seq_len
        return Floor(2 * b * seq * 8, f"the batch, {b:,} x {seq:,} token ids")
    from kdbench.models.lm import model_config

    try:
        student = model_config(config.pair.student, config.overrides.student)
    except Exception:  # not a registered LM or config: counted once built (kdbench fit)
        student = None
    if student is None:
        return None
    seq, size = config.data.seq_len, _element_bytes(config.precision)
    ids = 2 * b * seq * 8
    if config.loss_impl in WHOLE_LOGITS:
        vocab = int(student.vocab_size)
        out, what = b * seq * vocab * size, f"the student's logits, {b:,} x {seq:,} x {vocab:,} {config.precision}"
    else:
        hidden = int(student.hidden_size)
        out = b * seq * hidden * size
        what = f"the student's last hidden states, {b:,} x {seq:,} x {hidden:,} {config.precision}"
    return Floor(ids + out, f"{what}, and the batch's ids")


def floor_words(config: CellConfig, device_type: str, here: bool) -> str:
    """What ``kdbench run --dry-run`` adds to a cell's line: ``; step at least ... per rank (what: a floor ...)``,
    and where the cell's backend is this machine's (``here``), ``IMPOSSIBLE here`` when the floor is over what this
    machine's device has (:func:`device_memory`)."""
    from kdbench.core.sizes import gib

    floor = step_floor(config)
    if floor is None:
        return "; step peak: not counted before the models are built (kdbench fit counts it)"
    line = f"; step at least {gib(floor.bytes)} per rank ({floor.what}: a floor, no fake run; kdbench fit counts all)"
    memory = device_memory(device_type) if here else None
    if memory is not None and floor.bytes > memory[0]:
        line += f": IMPOSSIBLE here, over this machine's {memory[1]} of {gib(memory[0])}; lower batch_size"
    return line


def device_memory(device_type: str) -> tuple[int, str] | None:
    """What one rank's step may reach on this machine: the host's available memory on the CPU (psutil), the GPU's
    total on a GPU (None where torch sees none)."""
    if device_type == "cpu":
        import psutil

        return int(psutil.virtual_memory().available), "available memory"
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory), "GPU memory"
