"""kdbench.core.stats."""
