import os
import tempfile

import pytest

# The dtype-speed cache (kdbench.hw.speed) of this test session: never the user's own, shared by the
# session's subprocesses (they inherit the environment).
os.environ["KDBENCH_CACHE_DIR"] = tempfile.mkdtemp(prefix="kdbench-test-cache-")
# A suite's fake runs in this process: the unit lane's xdist workers already hold both cores, and a fit test would
# pay helpers' start (torch's import) for a few tiny fake runs; tests/unit/fit/test_fit_ahead.py turns them on
os.environ["KDBENCH_FIT_PROCESSES"] = "1"


from kdbench.hw.backends import resolve


@pytest.fixture
def cpu():
    return resolve("cpu")


@pytest.fixture(autouse=True)
def fresh_worker_state():
    """Each test runs as a fresh worker (kdbench.core.worker_state): no wall-time split, telemetry reader, TunableOp
    flag, lost device or FLOP count of an earlier test carries over."""
    from kdbench.core.worker_state import WorkerState, install

    state = WorkerState()
    previous = install(state)
    yield state
    install(previous)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests (``pytestmark = pytest.mark.usefixtures("one_thread")``): their
    shapes are tiny, and on a small shared machine two threads spin against a busy core (a step 8-40x slower);
    with one, results are also identical from run to run.  The thread count is restored after the module."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def seeded():
    """Every test of a module (``pytestmark = pytest.mark.usefixtures("seeded")``) draws the same random tensors:
    torch's generator seeded with 0 before each, so no value depends on the test order."""
    import torch

    torch.manual_seed(0)
