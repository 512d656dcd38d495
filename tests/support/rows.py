"""The one factory of the result rows the tests build: :func:`result_row`.

A test's rows are built as :class:`kdbench.core.schema.Row`, as kdbench's own rows are, so every key is a stored column
of :data:`kdbench.core.schema.COLUMNS` and every value of its column's type: test data that drifts from the schema
fails where it is written.  A file whose rows share settings of its own passes them as overrides, through a small
partial of its own.  A test that needs a row the schema refuses (a derived column stored, as schema version 1
did) spreads a result row into a plain dict on purpose.
"""

from __future__ import annotations

from typing import Any

from kdbench.core.schema import Row

IDENTITY = {"run_id": "r", "cell_id": "c", "measurement": "distill_step", "status": "ok", "batch_size": 8}


def result_row(**columns: Any) -> Row:
    """An ok ``distill_step`` row of cell ``c`` in run ``r`` at batch size 8, with ``columns`` set over it; its
    ``cell_label`` is its cell id unless given."""
    row = Row(IDENTITY, **columns)
    row.setdefault("cell_label", row["cell_id"])
    return row


def timing(median_ms: float, batch_size: int, n: int, iqr: float, p05: float, p95: float) -> dict[str, Any]:
    """The statistics columns of a timed row around ``median_ms``: ``n`` samples, the IQR and the 5th and 95th
    percentiles as multiples of the median, three samples at the median, not noisy, and the throughput of
    ``batch_size`` samples a call."""
    return {
        "n": n,
        "median_ms": median_ms,
        "iqr_ms": median_ms * iqr,
        "p05_ms": median_ms * p05,
        "p95_ms": median_ms * p95,
        "samples_ms": [median_ms] * 3,
        "noisy": False,
        "throughput": batch_size / median_ms * 1000,
    }
