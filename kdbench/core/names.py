"""kdbench's vocabulary: the names every layer shares, each defined once.

Statuses, measurements, the phases of a distillation step, precisions, memory
formats and the ignore index of token labels.  Torch-free, so the store and the report use them as
the measuring code does.  The enums are ``StrEnum``: a member *is* its string, so rows, parquet files and
comparisons with plain strings keep working.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Status(StrEnum):
    """How a measurement ended."""

    OK = "ok"
    FAILED = "failed"  # raised, non-finite loss, or the worker died
    OOM = "oom"  # the device ran out of memory
    TIMEOUT = "timeout"  # outlived the job's time-out and was stopped
    SKIPPED = "skipped"  # cannot run here (e.g. more ranks than the allocation has)


FAILURES = frozenset({Status.FAILED, Status.OOM, Status.TIMEOUT})  # statuses that make `run` exit with 1


class Measurement(StrEnum):
    """What a row measured."""

    DISTILL_STEP = "distill_step"
    STUDENT_INFERENCE = "student_inference"
    TEACHER_INFERENCE = "teacher_inference"
    # Language-model serving (LM pairs): the prompt's forward that fills the KV cache, and greedy decoding
    # of a fixed number of new tokens from it.
    STUDENT_PREFILL = "student_prefill"
    STUDENT_DECODE = "student_decode"
    TEACHER_PREFILL = "teacher_prefill"
    TEACHER_DECODE = "teacher_decode"
    # The teacher decoding with the student as its draft (speculative decoding, inference.speculative): one row
    # per draft length and temperature, at batch size 1.
    SPECULATIVE_DECODE = "speculative_decode"
    QUALITY = "quality"  # accuracy after training on real data (times nothing)


INFERENCE = (Measurement.STUDENT_INFERENCE, Measurement.TEACHER_INFERENCE)
LM_SERVING = (
    Measurement.STUDENT_PREFILL,
    Measurement.STUDENT_DECODE,
    Measurement.TEACHER_PREFILL,
    Measurement.TEACHER_DECODE,
)
SPECULATIVE = (Measurement.SPECULATIVE_DECODE,)  # both models serving together (neither a student's nor a teacher's)
SERVING = (*INFERENCE, *LM_SERVING, *SPECULATIVE)  # every measurement of serving (no training)
TIMED = (Measurement.DISTILL_STEP, *SERVING)  # every measurement that times something


def role_of(measurement: str) -> str:
    """``student`` or ``teacher`` for a serving measurement (``student_decode`` -> ``student``); ``speculative`` for
    speculative_decode, which serves both models (neither a student's row nor a teacher's)."""
    return str(measurement).split("_", 1)[0]


def counterpart(measurement: str) -> str:
    """The teacher's measurement a student's is compared with (``student_decode`` -> ``teacher_decode``)."""
    return "teacher_" + str(measurement).split("_", 1)[1]


# What tells a cell's speculative_decode rows apart (one per draft length and temperature): the columns that, with
# (run, cell, measurement, batch size, repeat), key a row (null on every other row).
VARIANT_COLUMNS = ("draft_tokens", "spec_temperature")


class Speculative(str):
    """A planned speculative_decode measurement at one draft length (γ) and temperature: the string
    ``speculative_decode`` (what its row's ``measurement`` holds; equal to :attr:`Measurement.SPECULATIVE_DECODE`)
    carrying which variant it is, which the row's :data:`VARIANT_COLUMNS` hold."""

    draft_tokens: int
    temperature: float

    def __new__(cls, draft_tokens: int, temperature: float) -> Speculative:
        self = super().__new__(cls, Measurement.SPECULATIVE_DECODE.value)
        self.draft_tokens, self.temperature = int(draft_tokens), float(temperature)
        return self

    def __reduce__(self):  # pickles with its variant (str's would call __new__ with the string)
        return Speculative, (self.draft_tokens, self.temperature)

    def __repr__(self) -> str:
        return f"Speculative(draft_tokens={self.draft_tokens}, temperature={self.temperature:g})"


def variant_columns(measurement: str) -> dict[str, int | float]:
    """The :data:`VARIANT_COLUMNS` of a planned measurement (empty for all but :class:`Speculative`)."""
    if isinstance(measurement, Speculative):
        return {"draft_tokens": measurement.draft_tokens, "spec_temperature": measurement.temperature}
    return {}


def planned_row(measurement: str, batch_size: int) -> dict:
    """A planned measurement as the keys of its row: measurement (a plain string), batch size and its variant."""
    return {"measurement": Measurement(str(measurement)), "batch_size": batch_size, **variant_columns(measurement)}


QUALITY_ROLES = ("teacher", "scratch", "distilled")  # what a quality row's model was trained as, in report order


@dataclass(frozen=True)
class Phase:
    name: str
    label: str  # legend label in the report
    doc: str  # what the phase covers (the schema documents its column with it)

    @property
    def column(self) -> str:
        return f"phase_{self.name}_ms"


# The phases of a distillation step, in the order the step runs them.
PHASES: tuple[Phase, ...] = (
    Phase("teacher_forward", "teacher forward", "teacher forward of the step (≈0 with a cached teacher)"),
    Phase("student_forward", "student forward", "student forward (with its adapters)"),
    Phase("loss", "loss", "loss computation"),
    Phase("backward", "backward (with zero_grad)", "zero_grad + backward"),
    Phase("optimizer", "optimizer step", "optimizer step (with GradScaler step and update)"),
)
# On-policy LM steps (``on_policy``) begin with one more phase: the student generates the batch's completions.
GENERATE = Phase(
    "generate",
    "generation (on-policy)",
    "on-policy LM steps: the student sampling the batch's completions with its KV cache, before the teacher forward",
)
# Cross-tokenizer LM steps (``data.tokenizers``) begin with one more phase: the batch's text tokenized by each
# model's tokenizer and the two sides' positions aligned (ULD's pairing).
ALIGN = Phase(
    "align",
    "tokenize + align (cross-tokenizer)",
    "cross-tokenizer LM steps: the batch's text tokenized by each model's own tokenizer and the two sides' positions "
    "aligned, before the teacher forward",
)
# Offline-teacher LM steps (``teacher.mode: offline``) begin with one more phase: the wait for the next batch and its
# stored top-k, which a background thread reads ahead.
TEACHER_READ = Phase(
    "teacher_read",
    "teacher read wait (offline)",
    "offline-teacher LM steps: the wait for the next batch and its stored top-k (read, decoded and copied to the "
    "device by a background thread; ≈0 when the read hides behind the previous step), before the teacher forward",
)
LEAD_PHASES = (GENERATE, ALIGN, TEACHER_READ)  # the phases a step may begin with, before PHASES (one at most)
REMAINDER_COLUMN = "phase_remainder_ms"  # step time minus the sum of its phases

# How torch's autograd runs in a timed call (the grad_mode column): the step trains (the student's forward and
# backward, the teacher under no_grad); every serving call runs under torch.inference_mode().
AUTOGRAD = "autograd"
INFERENCE_MODE = "inference_mode"

# A token label that no loss counts (prompt and padding positions, a sequence's last position): the value
# torch's cross_entropy, transformers and Liger-Kernel take as their ignore_index default.
IGNORE_INDEX = -100

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")  # fp32 is IEEE fp32 on every vendor; tf32 only when asked
MEMORY_FORMATS = ("contiguous", "channels_last")

# What a row's notes about its predicted peak begin with (the report picks them out by it); the tolerance they
# are judged by is kdbench.core.limits.FIT_TOLERANCE.
FIT_NOTE = "fit: "
# What a row's note about a busy machine begins with (kdbench.core.limits.CONTENDED_FREE_SHARE says when).
CONTENDED_NOTE = "contended: "
