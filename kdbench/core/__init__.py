"""kdbench.core."""
