"""The one factory of the result rows the tests build: :func:`result_row`.

A test's rows are built as :class:`kdbench.schema.Row`, as kdbench's own rows are, so every key is a stored column
of :data:`kdbench.schema.COLUMNS` and every value of its column's type: test data that drifts from the schema
fails where it is written.  A file whose rows share settings of its own passes them as overrides, through a small
partial of its own.  A test that needs a row the schema refuses (a derived column stored, as schema version 1
did) spreads a result row into a plain dict on purpose.
"""

from __future__ import annotations

from typing import Any

from kdbench.schema import Row

IDENTITY = {"run_id": "r", "cell_id": "c", "measurement": "distill_step", "status": "ok", "batch_size": 8}


def result_row(**columns: Any) -> Row:
    """An ok ``distill_step`` row of cell ``c`` in run ``r`` at batch size 8, with ``columns`` set over it; its
    ``cell_label`` is its cell id unless given."""
    row = Row(IDENTITY, **columns)
    row.setdefault("cell_label", row["cell_id"])
    return row
