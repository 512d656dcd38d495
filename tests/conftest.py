import os
import tempfile

import pytest

# The dtype-speed cache (kdbench.hw.speed) of this test session: never the user's own, shared by the
# session's subprocesses (they inherit the environment).
os.environ["KDBENCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="kdbench-test-cache-")


from kdbench.hw.backends import resolve


@pytest.fixture
def cpu():
    return resolve("cpu")
