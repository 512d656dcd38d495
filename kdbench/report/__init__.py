"""The HTML report of benchmark results: a page of charts and tables."""

from kdbench.report.html import render_report

__all__ = ["render_report"]
