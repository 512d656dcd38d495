"""Storage: the results schema, runs as folders of parquet parts, derived columns, probe files.

Torch-free: the report and any pandas session read results through here.
"""

from kdbench.store.results import read_results
from kdbench.store.schema import COLUMN_NAMES, COLUMNS

__all__ = ["COLUMNS", "COLUMN_NAMES", "read_results"]
