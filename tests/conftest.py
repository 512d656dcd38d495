import pytest

from kdbench.hw.backends import resolve


@pytest.fixture
def cpu():
    return resolve("cpu")
