"""Storage: runs as folders of parquet parts, derived columns, probe files (the columns: :mod:`kdbench.core.schema`).

Torch-free: the report and any pandas session read results through here.
"""

from kdbench.store.results import read_results

__all__ = ["read_results"]
