"""Print what the benchmarks measured at the end of the pytest run (not only under -s)."""

import pytest

_LINES: list[str] = []


@pytest.fixture
def report_line():
    """Call with a line of text to have it printed in the run's closing summary."""
    return _LINES.append


def pytest_terminal_summary(terminalreporter):
    if _LINES:
        terminalreporter.section("kdbench benchmarks")
        for line in _LINES:
            terminalreporter.write_line(line)
