"""kdbench.report.compare.compare."""
