"""The system lane: tests that run whole suites, worker processes, torchrun ranks or the command line.  Every test
here is marked ``slow`` (the quick lane, ``pytest -m "not slow"``, leaves them out); CI runs them all."""

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "/tests/system/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.slow)
