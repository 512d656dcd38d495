"""A measurement that raises becomes a row: its status and a one-line error."""

from __future__ import annotations

from typing import Any

import torch

from kdbench.names import Status


def status_of(exc: BaseException) -> Status:
    return Status.OOM if isinstance(exc, torch.OutOfMemoryError) else Status.FAILED


def error_text(exc: BaseException) -> str:
    """`Type: first line of the message`, at most 2000 characters."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:2000]


def failure_row(measurement: str, batch_size: int, exc: BaseException) -> dict[str, Any]:
    return {"measurement": measurement, "batch_size": batch_size, "status": status_of(exc), "error": error_text(exc)}
