"""Tests of the clocks and the timed loop, on fake time (no real timing thresholds)."""

from __future__ import annotations

import time

import pytest
import torch

from kdbench.hw.clock import EventClock, HostClock
from kdbench.measure import timing
from kdbench.measure.timing import RawTiming, timed_loop


class FakeTime:
    """A fake time line in integer milliseconds, advanced only by the scripted fn."""

    def __init__(self, durations_ms):
        self.now_ms = 0
        self.durations = list(durations_ms)
        self.calls = 0
        self.log: list[tuple[str, int]] = []  # (event, call count at that moment)

    def fn(self):
        self.now_ms += self.durations[self.calls]
        self.calls += 1
        self.log.append(("call", self.calls))

    def perf_counter(self) -> float:
        return self.now_ms / 1000.0


class FakeClock:
    name = "fake"

    def __init__(self, t: FakeTime):
        self.t = t
        self.syncs = 0

    def stamp(self):
        self.t.log.append(("stamp", self.t.calls))
        return self.t.now_ms

    def elapsed_ms(self, a, b):
        return float(b - a)

    def sync(self):
        self.syncs += 1
        self.t.log.append(("sync", self.t.calls))


def scripted(warmup, n_timed=100):
    """first call 50 ms, `warmup` calls of 7 ms each, then timed calls of 10, 11, 12, ... ms"""
    return [50] + [7] * warmup + [10 + i for i in range(n_timed)]


def test_cold_call_warmup_and_min_iters():
    warmup, min_iters = 3, 5
    t = FakeTime([50, 7, 7, 7] + [10 + i for i in range(50)])
    clock = FakeClock(t)
    r = timed_loop(t.fn, clock, warmup=warmup, min_iters=min_iters, min_time_s=0, max_iters=100)
    assert isinstance(r, RawTiming)
    assert r.clock == "fake"
    assert r.first_ms == 50.0
    assert r.samples_ms == [10.0, 11.0, 12.0, 13.0, 14.0]
    assert 50.0 not in r.samples_ms
    assert 7.0 not in r.samples_ms  # warm-up calls are untimed
    assert t.calls == 1 + warmup + min_iters
    assert clock.syncs == 4  # before and after the cold call, before and after the window


def test_call_order_stamps_and_syncs():
    t = FakeTime(scripted(2))
    clock = FakeClock(t)
    timed_loop(t.fn, clock, warmup=2, min_iters=3, min_time_s=0, max_iters=10)
    assert t.log == [
        # cold call, from an idle device (its host time is a one-off cost), stamped on both sides, then a
        # sync before reading it
        ("sync", 0), ("stamp", 0), ("call", 1), ("stamp", 1), ("sync", 1),
        # exactly `warmup` calls, stamped (kept apart from the samples), then a sync
        ("stamp", 1), ("call", 2), ("stamp", 2),
        ("stamp", 2), ("call", 3), ("stamp", 3), ("sync", 3),
        # timed calls, each stamped, with no sync in between
        ("stamp", 3), ("call", 4), ("stamp", 4),
        ("stamp", 4), ("call", 5), ("stamp", 5),
        ("stamp", 5), ("call", 6), ("stamp", 6),
        ("sync", 6),
    ]  # fmt: skip


@pytest.mark.parametrize("warmup", [0, 1, 4])
def test_warmup_count(warmup):
    t = FakeTime(scripted(warmup))
    clock = FakeClock(t)
    r = timed_loop(t.fn, clock, warmup=warmup, min_iters=2, min_time_s=0, max_iters=10)
    assert t.calls == 1 + warmup + 2
    # the calls between the cold call's closing stamp and the first timed stamp
    log = t.log
    cold_sync, warm_sync = [i for i, e in enumerate(log) if e[0] == "sync"][1:3]  # the first: before the cold call
    between = [e for e in log[cold_sync:warm_sync] if e[0] == "call"]
    assert len(between) == warmup
    assert r.warmup_ms == [7.0] * warmup
    assert r.first_ms == 50.0
    assert r.samples_ms == [10.0, 11.0]


@pytest.mark.parametrize("min_iters", [1, 2, 9])
def test_min_time_zero_gives_exactly_min_iters(min_iters):
    t = FakeTime(scripted(1))
    r = timed_loop(t.fn, FakeClock(t), warmup=1, min_iters=min_iters, min_time_s=0, max_iters=1000)
    assert r.samples_ms == [float(10 + i) for i in range(min_iters)]


def test_max_iters_caps_samples():
    t = FakeTime(scripted(1))
    r = timed_loop(t.fn, FakeClock(t), warmup=1, min_iters=20, min_time_s=0, max_iters=4)
    assert r.samples_ms == [10.0, 11.0, 12.0, 13.0]
    assert t.calls == 1 + 1 + 4


def test_max_iters_caps_min_time(monkeypatch):
    t = FakeTime(scripted(0))
    monkeypatch.setattr(timing.time, "perf_counter", t.perf_counter)
    r = timed_loop(t.fn, FakeClock(t), warmup=0, min_iters=1, min_time_s=3600, max_iters=6)
    assert r.samples_ms == [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]


def test_min_time_keeps_going_past_min_iters(monkeypatch):
    # timed calls of 10 ms each; 0.095 s of fake time needs 10 of them (9 give 90 ms)
    t = FakeTime([50, 7, 7] + [10] * 100)
    monkeypatch.setattr(timing.time, "perf_counter", t.perf_counter)
    r = timed_loop(t.fn, FakeClock(t), warmup=2, min_iters=3, min_time_s=0.095, max_iters=1000)
    assert len(r.samples_ms) == 10
    assert r.samples_ms == [10.0] * 10
    assert sum(r.samples_ms) >= 95
    assert t.calls == 1 + 2 + 10


def test_min_time_counts_from_after_warmup(monkeypatch):
    # a long cold call and warm-up must not count towards min_time_s
    t = FakeTime([5000, 5000, 5000] + [10 + i for i in range(100)])
    monkeypatch.setattr(timing.time, "perf_counter", t.perf_counter)
    r = timed_loop(t.fn, FakeClock(t), warmup=2, min_iters=1, min_time_s=0.05, max_iters=1000)
    # 10 + 11 + 12 = 33 < 50; + 13 = 46 < 50; + 14 = 60 >= 50
    assert r.samples_ms == [10.0, 11.0, 12.0, 13.0, 14.0]
    assert r.first_ms == 5000.0


def test_min_iters_dominates_short_min_time(monkeypatch):
    t = FakeTime(scripted(1))
    monkeypatch.setattr(timing.time, "perf_counter", t.perf_counter)
    r = timed_loop(t.fn, FakeClock(t), warmup=1, min_iters=7, min_time_s=0.001, max_iters=1000)
    assert len(r.samples_ms) == 7


def test_time_module_is_the_stdlib_one():
    # the monkeypatch target used above is the real module kdbench.measure.timing calls
    assert timing.time is time


# --------------------------------------------------------------------------- HostClock


def test_host_clock():
    clock = HostClock()
    assert clock.name == "perf_counter_ns"
    a = clock.stamp()
    time.sleep(0.01)
    b = clock.stamp()
    assert isinstance(a, int) and isinstance(b, int)
    assert clock.elapsed_ms(a, b) >= 10.0
    assert clock.elapsed_ms(0, 2_500_000) == 2.5
    clock.sync()  # a no-op, must not raise


def test_host_clock_in_timed_loop():
    calls = []
    r = timed_loop(lambda: calls.append(1), HostClock(), warmup=2, min_iters=4, min_time_s=0, max_iters=10)
    assert r.clock == "perf_counter_ns"
    assert len(calls) == 1 + 2 + 4
    assert len(r.samples_ms) == 4
    assert all(s >= 0 for s in r.samples_ms)
    assert r.first_ms >= 0


# --------------------------------------------------------------------------- EventClock


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda.Event and torch.cuda.synchronize on a fake device time line."""
    state = {"now_ms": 0.0, "log": [], "sync_devices": []}

    class FakeEvent:
        created = 0

        def __init__(self, enable_timing=False, **kwargs):
            assert enable_timing is True
            FakeEvent.created += 1
            self.id = FakeEvent.created
            self.t = None

        def record(self, stream=None):
            self.t = state["now_ms"]
            state["log"].append(("record", self.id))

        def query(self):  # the fake device finishes all but the newest ``lag`` events recorded
            state["log"].append(("query", self.id))
            return self.id <= FakeEvent.created - state.get("lag", 0)

        def elapsed_time(self, other):
            assert self.t is not None and other.t is not None
            state["log"].append(("elapsed", self.id, other.id))
            return other.t - self.t

    def synchronize(device=None):
        state["sync_devices"].append(device)
        state["log"].append(("sync",))

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    return state


@pytest.mark.parametrize("lag", [0, 4])
def test_adaptive_stopping_reads_finished_events_without_a_sync(fake_cuda, lag):
    # G9: the interval check synchronized, so the next sample started on an idle device and sync gaps went
    # into window_ms; now it reads the events the device has finished (here all but the newest `lag`)
    fake_cuda["lag"] = lag

    def fn():
        fake_cuda["now_ms"] += 2.0
        fake_cuda["log"].append(("call",))

    r = timed_loop(
        fn, EventClock(torch.device("cuda", 0)), warmup=1, min_iters=8, min_time_s=0, max_iters=100, target_rel_ci=0.5
    )
    log = fake_cuda["log"]
    calls = [i for i, e in enumerate(log) if e == ("call",)]
    timed = calls[2:]
    assert not [i for i, e in enumerate(log) if e == ("sync",) and timed[0] < i < timed[-1]]
    last_sync = max(i for i, e in enumerate(log) if e == ("sync",))
    assert any(e[0] == "query" for e in log[timed[0] : last_sync])  # the check asked the device, never waited
    # constant calls: the first check whose finished calls reach min_iters stops the loop
    assert len(r.samples_ms) == (8 if lag == 0 else 12)


def test_event_clock_timed_loop(fake_cuda):
    durations = [40.0, 5.0, 5.0] + [1.5, 2.25, 3.0, 4.75]
    it = iter(durations)

    def fn():
        fake_cuda["now_ms"] += next(it)
        fake_cuda["log"].append(("call",))

    device = torch.device("cuda", 0)
    clock = EventClock(device)
    assert clock.name == "device_event"
    r = timed_loop(fn, clock, warmup=2, min_iters=4, min_time_s=0, max_iters=10)

    assert r.clock == "device_event"
    assert r.first_ms == 40.0
    assert r.samples_ms == [1.5, 2.25, 3.0, 4.75]

    log = fake_cuda["log"]
    syncs = [i for i, e in enumerate(log) if e == ("sync",)]
    # one sync before and one after the cold call (its host time is a one-off cost), one after each warm-up
    # call (each starts on an idle device, so the host's time to issue it is its own), one after the timed loop
    assert len(syncs) == 5
    assert fake_cuda["sync_devices"] == [device] * 5
    syncs = syncs[1:]  # the first comes before any call

    calls = [i for i, e in enumerate(log) if e == ("call",)]
    assert len(calls) == 1 + 2 + 4
    cold, warm, timed = calls[0], calls[1:3], calls[3:]
    assert cold < syncs[0] < warm[0] < syncs[1] < warm[1] < syncs[2] < timed[0]
    assert timed[-1] < syncs[3]
    # no sync between the iterations of the timed loop
    assert not [s for s in syncs if timed[0] < s < timed[-1]]

    assert r.warmup_ms == [5.0, 5.0]
    assert len(r.host_ms) == 2 and all(h >= 0 for h in r.host_ms)
    elapsed = [i for i, e in enumerate(log) if e[0] == "elapsed"]
    assert len(elapsed) == 1 + 2 + 4
    # every event is read only after a sync that follows its recording:
    # the cold call's pair after the first sync, the timed pairs after the last one
    assert syncs[0] < elapsed[0] < warm[0]
    assert all(i > syncs[3] for i in elapsed[1:])
    timed_records = [i for i, e in enumerate(log) if e[0] == "record" and i > syncs[2]]
    assert len(timed_records) == 2 * 4
    assert max(timed_records) < syncs[3] < min(elapsed[1:])


def test_event_clock_reads_after_recording(fake_cuda):
    clock = EventClock(torch.device("cuda", 1))
    a = clock.stamp()
    fake_cuda["now_ms"] += 12.5
    b = clock.stamp()
    clock.sync()
    assert fake_cuda["sync_devices"] == [torch.device("cuda", 1)]
    assert clock.elapsed_ms(a, b) == 12.5
    assert isinstance(clock.elapsed_ms(a, b), float)


def test_time_to_steady_counts_until_the_first_call_near_the_median():
    from kdbench.measure.timing import RawTiming

    # cold 500, warm-up 80 and 30, then timed 20..24 (median 22): 21 is within 10 %, 30 is not.
    r = RawTiming(500.0, [20.0, 22.0, 24.0, 21.0, 23.0], "fake", warmup_ms=[80.0, 30.0])
    assert r.time_to_steady() == (500.0 + 80.0 + 30.0 + 20.0, 4)
    assert RawTiming(5.0, [5.0, 6.0], "fake").time_to_steady() == (5.0, 1)  # no cold cost
    assert RawTiming(5.0, [], "fake").time_to_steady() is None


def test_timed_window_brackets_the_timed_calls():
    t = FakeTime(scripted(1))
    r = timed_loop(t.fn, FakeClock(t), warmup=1, min_iters=2, min_time_s=0, max_iters=10)
    assert r.window_s is not None and r.window_s[0] <= r.window_s[1]


def test_launch_bound_when_issuing_a_call_costs_the_host_what_the_device_needs():
    from kdbench.measure.timing import RawTiming

    samples = [1.0, 1.0, 1.1]
    assert RawTiming(5.0, samples, "device_event", host_ms=[0.95, 0.97]).launch_bound(1.0) is True
    assert RawTiming(5.0, samples, "device_event", host_ms=[0.2, 0.3]).launch_bound(1.0) is False
    assert RawTiming(5.0, samples, "perf_counter_ns").launch_bound(1.0) is None  # host time is all there is


def test_host_clocks_add_no_syncs_or_host_stamps_to_the_warm_up():
    t = FakeTime(scripted(1))
    r = timed_loop(t.fn, FakeClock(t), warmup=3, min_iters=2, min_time_s=0, max_iters=10)
    assert r.host_ms == [] and len(r.warmup_ms) == 3


def test_window_throughput_counts_the_gaps_the_median_leaves_out():
    from kdbench.measure.rows import timing_columns
    from kdbench.measure.timing import RawTiming

    # four 10 ms iterations in a 50 ms window: 10 ms of gaps between them
    raw = RawTiming(30.0, [10.0] * 4, "perf_counter_ns", window_s=(100.0, 100.05))
    cols = timing_columns(raw, world_size=2, batch_size=8)
    assert cols["throughput"] == pytest.approx(2 * 8 / 0.010)
    assert cols["window_ms"] == pytest.approx(50.0)
    assert cols["window_throughput"] == pytest.approx(2 * 8 * 4 / 0.050)
    assert cols["host_ms"] is None and cols["launch_bound"] is None
    assert timing_columns(RawTiming(30.0, [10.0], "perf_counter_ns"), 1, 8)["window_throughput"] is None


# --------------------------------------------------------------------------- adaptive stopping, time budget


def test_a_tight_median_stops_at_min_iters_and_min_time(monkeypatch):
    """Constant 10 ms calls: the median's interval has width 0 as soon as it can be bounded."""
    t = FakeTime([50, 7] + [10] * 1000)
    monkeypatch.setattr(timing.time, "perf_counter", t.perf_counter)
    r = timed_loop(
        t.fn, FakeClock(t), warmup=1, min_iters=8, min_time_s=0.05, max_iters=1000, target_rel_ci=0.02, max_time_s=5.0
    )
    assert len(r.samples_ms) == 8  # min_iters (80 ms) also covers min_time_s: stops there, not earlier


def test_a_wide_median_extends_until_the_interval_is_narrow_enough(monkeypatch):
    """Alternating 10/14 ms calls: the median's 95 % interval spans both values (40 % wide) until the
    order statistics bounding it both fall on one value; that needs far more than min_iters."""
    rng = __import__("random").Random(3)
    stream = [rng.choice([10, 10, 10, 14]) for _ in range(5000)]
    t = FakeTime([50, 7] + stream)
    monkeypatch.setattr(timing.time, "perf_counter", t.perf_counter)
    r = timed_loop(
        t.fn, FakeClock(t), warmup=1, min_iters=8, min_time_s=0.0, max_iters=5000, target_rel_ci=0.02, max_time_s=3600
    )
    n = len(r.samples_ms)
    assert 8 < n < 5000
    assert timing.relative_ci(r.samples_ms) <= 0.02
    assert timing.relative_ci(r.samples_ms[: n - max(4, n // 9) - 1]) > 0.02  # the previous check was too wide


def test_max_time_s_caps_a_median_that_never_settles(monkeypatch):
    """Calls alternating 10 and 30 ms: the interval stays wide; the loop stops at max_time_s."""
    t = FakeTime([50, 7] + [10, 30] * 1000)
    monkeypatch.setattr(timing.time, "perf_counter", t.perf_counter)
    r = timed_loop(
        t.fn, FakeClock(t), warmup=1, min_iters=4, min_time_s=0.0, max_iters=10_000, target_rel_ci=0.001, max_time_s=1.0
    )
    assert 1000 <= sum(r.samples_ms) < 1100 and len(r.samples_ms) < 60


def test_without_a_target_the_interval_is_never_read():
    t = FakeTime(scripted(1))
    clock = FakeClock(t)
    timed_loop(t.fn, clock, warmup=1, min_iters=30, min_time_s=0, max_iters=1000)
    assert clock.syncs == 4  # around the cold call, before and after the window: no check syncs


def test_a_compile_in_the_cold_call_does_not_shrink_the_later_calls(monkeypatch):
    """N4: a 40 s cold call (a compile) in a 60 s budget, then 50 ms calls: the warm calls say what later
    calls cost, so the measurement gets its warm-up and min_iters timed calls, not thin."""
    t = FakeTime([40_000] + [50] * 200)
    monkeypatch.setattr(timing.time, "perf_counter", t.perf_counter)
    r = timed_loop(t.fn, FakeClock(t), warmup=3, min_iters=20, min_time_s=1.0, max_iters=1000, budget_s=60.0)
    assert len(r.warmup_ms) == 3 and len(r.samples_ms) == 20
    assert not r.thin and r.note is None
    assert r.cold_s == pytest.approx(40.0) and r.cold_excess_ms(50.0) == pytest.approx(40_000 - 50)


def test_the_budget_bounds_the_whole_measurement_and_a_shrunk_one_is_thin(monkeypatch):
    """N5: min_time_s and the interval target stop at the budget, and calls that do not fit shrink the
    counts: 1 s calls, a 10 s budget, min_iters 20."""
    t = FakeTime([2000] + [1000] * 200)
    monkeypatch.setattr(timing.time, "perf_counter", t.perf_counter)
    r = timed_loop(
        t.fn,
        FakeClock(t),
        warmup=3,
        min_iters=20,
        min_time_s=30.0,
        max_iters=1000,
        target_rel_ci=0.001,
        max_time_s=60.0,
        budget_s=10.0,
    )
    assert t.now_ms <= 10_000  # cold 2 s + 1 warm-up (3 + 20 calls do not fit) + 7 timed calls
    assert (len(r.warmup_ms), len(r.samples_ms)) == (1, 7)
    assert r.thin and "warm-up 3 -> 1" in r.note and "timed calls 20 -> 7: thin" in r.note
    assert "the cold call took 2 s" in r.note


def test_a_cold_call_over_the_budget_still_gets_one_warm_sample(monkeypatch):
    t = FakeTime([400_000, 7, 7] + [10] * 10)  # a cold call of 400 s against a 60 s budget
    monkeypatch.setattr(timing.time, "perf_counter", t.perf_counter)
    r = timed_loop(t.fn, FakeClock(t), warmup=2, min_iters=20, min_time_s=1.0, max_iters=100, budget_s=60.0)
    assert r.warmup_ms == [7.0] and r.samples_ms == [7.0] and t.calls == 3
    assert r.thin and r.first_ms == 400_000.0
    assert "timed calls 20 -> 1: thin" in r.note


def test_without_a_budget_nothing_is_thin(monkeypatch):
    t = FakeTime([400_000] + [10] * 30)
    monkeypatch.setattr(timing.time, "perf_counter", t.perf_counter)
    r = timed_loop(t.fn, FakeClock(t), warmup=2, min_iters=20, min_time_s=0.0, max_iters=100)
    assert len(r.samples_ms) == 20 and not r.thin and r.note is None


def test_progress_is_told_at_most_every_few_seconds(monkeypatch):
    t = FakeTime([3000] + [3000] * 4 + [3000] * 10)  # 3 s calls
    monkeypatch.setattr(timing.time, "perf_counter", t.perf_counter)
    told = []
    timed_loop(
        t.fn, FakeClock(t), warmup=4, min_iters=10, min_time_s=0, max_iters=10, progress=lambda *a: told.append(a)
    )
    assert 3 <= len(told) <= 5  # 45 s of calls, a line at most every 10 s
    assert told[0][0] == "warm-up" and told[-1][0] == "timed" and told[-1][3] == pytest.approx(3.0)


def test_median_ci_against_the_exact_binomial_interval():
    from scipy import stats

    from kdbench.core.stats.samples import median_ci

    for n in (6, 10, 25, 100, 999):
        low, high = median_ci(list(range(n)))  # a sample's value is its 0-based rank
        exact = int(stats.binom.ppf(0.025, n, 0.5)) - 1  # the exact lower order statistic, 0-based
        assert abs(low - max(exact, 0)) <= 1 and high == n - 1 - low
    assert median_ci([1.0] * 5) == (float("-inf"), float("inf"))


def test_the_wall_time_split_adds_up(monkeypatch):
    from kdbench.run import progress
    from kdbench.run.workers import PROCESS_START

    now = [1000.0]
    monkeypatch.setattr(progress.time, "time", lambda: now[0])
    monkeypatch.setattr("kdbench.STARTED", 990.0)  # kdbench imported 10 s before the run
    wall = progress.WallSplit()
    now[0] += 30.0
    wall.job(20.0, 17.0, {"warm-up": 4.0, "measuring": 10.0, "FLOP counting": 1.0, PROCESS_START: 2.5}, 0.5)
    split = wall.finish()
    assert split["total"] == 40.0
    assert sum(v for k, v in split.items() if k != "total") == pytest.approx(40.0)
    assert split["worker, other"] == 2.0  # 17 s in the worker, 15 s of it in categories
    assert split[PROCESS_START] == 2.5 and split["writing"] == 0.5
    assert split["engine and pipe"] == pytest.approx(20.0 - 17.0 - 2.5 - 0.5 + 10.0)  # the job's rest + outside jobs
    line = progress.WallSplit.line(split)
    assert line.startswith("wall time 40.0 s: start-up, imports and plan 10.0 s (25%)")
    assert line.endswith("warming up or measuring: 35%")


def test_the_time_left_leaves_out_the_first_cells_start_up(monkeypatch, caplog):
    from kdbench.run import progress as progress_module

    now = [0.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    progress = progress_module.Progress(4)
    job = type("J", (), {"progress_label": "cell"})()
    row = [{"status": "ok", "measurement": "quality"}]
    now[0] = 10.0  # the first cell: 8 s of worker start and model building, 2 s of measuring
    with caplog.at_level("INFO", logger="kdbench"):
        progress.done(job, row, once_s=8.0)
    assert "10s elapsed, ~6s left" in caplog.text  # 3 cells x 2 s, not 3 x 10 s
