"""A measurement that raises becomes a row: its status and a one-line error; one that cannot be taken here
(:class:`SkipMeasurement`) a skipped row with the reason."""

from __future__ import annotations

import re

import torch

from kdbench.core.names import Status
from kdbench.core.schema import Row
from kdbench.core.sizes import to_bytes
from kdbench.core.worker_state import current
from kdbench.measure.rows import failure_rows

# Errors after which the process's CUDA/HIP context is unusable: every later call fails with them.
_FATAL_TEXT = (
    "CUDA error",
    "HIP error",
    "hipError",
    "cudaError",
    "device-side assert",
    "illegal memory access",
    "CUBLAS_STATUS_EXECUTION_FAILED",
    "CUBLAS_STATUS_INTERNAL_ERROR",
    "HIPBLAS_STATUS_EXECUTION_FAILED",
    "HIPBLAS_STATUS_INTERNAL_ERROR",
    "CUDNN_STATUS_EXECUTION_FAILED",
    "CUDNN_STATUS_INTERNAL_ERROR",
    "CUDNN_STATUS_MAPPING_ERROR",
    "unspecified launch failure",
    "miopenStatusInternalError",
    "miopenStatusUnknownError",
)


# Allocation failures that are not torch.OutOfMemoryError: the host's allocator (a RuntimeError "DefaultCPUAllocator:
# can't allocate memory: you tried to allocate N bytes"), MPS, HIP runtimes that report it as an error code.
_OOM_TEXT = (
    "can't allocate memory",
    "Cannot allocate memory",
    "out of memory",
    "hipErrorOutOfMemory",
    "cudaErrorMemoryAllocation",
)


class SkipMeasurement(Exception):
    """A measurement this backend or model cannot take (a lever a CPU lacks, prefill of a model without a KV
    cache): its row is stored as skipped, with this reason."""


def device_fatal(exc: BaseException) -> bool:
    """An error that leaves the device context poisoned (torch >= 2.8 raises AcceleratorError for them)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _FATAL_TEXT)


def note_device_lost(exc: BaseException) -> None:
    """Remember that this worker's device context is lost (the first error that did it): the worker must end
    after this job."""
    state = current()
    if state.device_lost is None:
        state.device_lost = error_text(exc)


def device_lost() -> str | None:
    """The error that poisoned this worker's device context, if one did."""
    return current().device_lost


def not_run_after_device_lost() -> str:
    """The error of a measurement not run because an earlier one of its job poisoned the device context: run
    there, it would fail with a sticky error that names some later kernel, not the cause."""
    return (
        f"not run: an earlier measurement of this job lost the device context ({device_lost()}); the worker "
        "restarts for the next job"
    )


def is_oom(exc: BaseException) -> bool:
    """An allocation the device or the host could not satisfy: torch's OutOfMemoryError, Python's MemoryError, or
    an allocator's RuntimeError (the CPU's "DefaultCPUAllocator: can't allocate memory", MPS, HIP error codes)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _OOM_TEXT)


def asked_bytes(exc: BaseException) -> int | None:
    """The bytes the failed allocation asked for, as its message states them ("you tried to allocate N bytes",
    "Tried to allocate 1.50 GiB"); None when it does not say."""
    text = str(exc)
    exact = re.search(r"tried to allocate (\d+) bytes", text, re.IGNORECASE)
    if exact:
        return int(exact.group(1))
    sized = re.search(r"tried to allocate ([\d.]+) ?(B|KiB|MiB|GiB|TiB|KB|MB|GB)\b", text, re.IGNORECASE)
    if sized:
        return to_bytes(sized.group(1), sized.group(2))
    return None


def status_of(exc: BaseException) -> Status:
    return Status.OOM if is_oom(exc) else Status.FAILED


def error_text(exc: BaseException) -> str:
    """`Type: first line of the message`, at most 2000 characters; an allocation failure ends with the bytes it
    asked for, and of which memory (the host's allocator or the device's)."""
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0] if text else ''}"
    if is_oom(exc):
        asked = asked_bytes(exc)
        where = "the host" if "CPUAllocator" in str(exc) or isinstance(exc, MemoryError) else "the device"
        size = f"{asked} bytes ({asked / 2**30:.2f} GiB)" if asked is not None else "bytes the error does not state"
        tail = f" [out of memory: asked {size} of {where}]"
        return line[: 2000 - len(tail)] + tail
    return line[:2000]


def failure_row(measurement: str, batch_size: int, exc: BaseException) -> Row:
    """The row of a measurement that raised ``exc``."""
    return failure_rows([{"measurement": measurement, "batch_size": batch_size}], status_of(exc), error_text(exc))[0]
