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


@pytest.fixture(autouse=True)
def fresh_worker_state():
    """Each test runs as a fresh worker (kdbench.worker_state): no wall-time split, telemetry reader, TunableOp
    flag, lost device or FLOP count of an earlier test carries over."""
    from kdbench.worker_state import WorkerState, install

    state = WorkerState()
    previous = install(state)
    yield state
    install(previous)
