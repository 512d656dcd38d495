"""The results schema as the store uses it: :mod:`kdbench.schema` defines every column once (it sits
beside :mod:`kdbench.names`, so the measuring code builds its rows from it without importing the store);
this module is where the store and its readers find it."""

from kdbench.schema import (
    COLUMN_NAMES,
    COLUMNS,
    CONFIG,
    DERIVED,
    DERIVED_COLUMNS,
    ENVIRONMENT,
    ENVIRONMENT_COLUMNS,
    IDENTITY,
    QUALITY,
    RESULT,
    SCHEMA,
    SCHEMA_VERSION,
    STATISTICS,
    STORED_COLUMNS,
    STORED_SCHEMA,
    Column,
    Row,
    rows_to_table,
    schema_markdown,
)

__all__ = [
    "COLUMNS",
    "COLUMN_NAMES",
    "CONFIG",
    "DERIVED",
    "DERIVED_COLUMNS",
    "ENVIRONMENT",
    "ENVIRONMENT_COLUMNS",
    "IDENTITY",
    "QUALITY",
    "RESULT",
    "SCHEMA",
    "SCHEMA_VERSION",
    "STATISTICS",
    "STORED_COLUMNS",
    "STORED_SCHEMA",
    "Column",
    "Row",
    "rows_to_table",
    "schema_markdown",
]
