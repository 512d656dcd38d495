"""kdbench.data."""
