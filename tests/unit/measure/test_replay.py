"""An operator call written down at its shapes and timed again (kdbench.measure.replay), and the step-time model
that prices a census's calls with those times on the machine itself (kdbench.fit.steptime.record_terms)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kdbench.core.schema import Row
from kdbench.fit import census as C
from kdbench.fit import columns
from kdbench.fit.census import Census, CensusMode, Record
from kdbench.fit.planner import CPU, Prediction, predict
from kdbench.fit.steptime import Rates, predict_step_time, rates_from_row, record_terms, with_calls
from kdbench.measure import replay
from kdbench.measure.replay import call_of, signature, time_signatures
from tests.support.helpers import make_config

pytestmark = pytest.mark.usefixtures("one_thread")

ONE = {c: (1.0, 1.0) for c in C.CLASSES}


def _recorded(fn) -> list[tuple[torch._ops.OpOverload, tuple, dict, object]]:
    """Every aten call ``fn`` makes, with its arguments and result."""
    calls = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            calls.append((func, args, kwargs or {}, out))
            return out

    with Spy():
        fn()
    return calls


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def test_a_written_down_call_is_rebuilt_with_its_shapes_strides_dtypes_and_values_it_needs():
    x = torch.randn(2, 3, 8, 8)
    w = torch.randn(4, 3, 3, 3)
    a, b = torch.randn(5, 7), torch.randn(6, 7)
    idx = torch.tensor([0, 2, 1])

    def step():
        torch.nn.functional.conv2d(x, w, None, 2, 1)
        a @ b.t()  # a transposed (strided) operand
        a.to(torch.bfloat16)  # a dtype among the keyword arguments
        torch.zeros(3, 4, dtype=torch.float64)  # a device and a dtype
        torch.nn.functional.embedding(idx, a)  # integer indices: rebuilt as zeros, a valid index

    for func, args, kwargs, out in _recorded(step):
        sig = signature(func, args, kwargs)
        assert sig is not None, func
        name, _, _ = json.loads(sig)
        assert name == str(func)
        again = call_of(sig, torch.device("cpu"))()
        for old, new in zip(_tensors(out), _tensors(again), strict=True):
            assert (old.shape, old.dtype) == (new.shape, new.dtype), func
    (mm_args,) = [a_ for f, a_, _, _ in _recorded(step) if f is torch.ops.aten.mm.default]
    _, (left, right), _ = json.loads(signature(torch.ops.aten.mm.default, mm_args, {}))
    assert left["t"] == [[5, 7], [7, 1], "float32"] and right["t"] == [[7, 6], [1, 7], "float32"]


def test_what_cannot_be_written_down_or_replayed_has_no_signature_or_no_time(monkeypatch):
    assert signature(torch.ops.prim.device.default, (torch.ones(1),), {}) is None  # a query
    assert signature(torch.ops.aten.add.Tensor, (torch.ones(1), object()), {}) is None  # not a plain value
    x = torch.ones(3).expand(4, 3)  # an in-place write into an expanded tensor raises when replayed
    bad = signature(torch.ops.aten.add_.Tensor, (x, torch.ones(4, 3)), {})
    good = signature(torch.ops.aten.add.Tensor, (torch.ones(4, 3), torch.ones(4, 3)), {})
    monkeypatch.setattr(replay, "_TIMED", {})
    times = time_signatures([bad, good, good], CPU)
    assert list(times) == [good] and times[good] > 0


def test_each_signature_is_timed_once_a_process(monkeypatch):
    timed = []
    monkeypatch.setattr(replay, "_TIMED", {})
    monkeypatch.setattr(replay, "_time_one", lambda sig, backend: timed.append(sig) or 0.002)
    sigs = [signature(torch.ops.aten.neg.default, (torch.ones(n),), {}) for n in (2, 3)]
    assert time_signatures(sigs, CPU) == {sigs[0]: 0.002, sigs[1]: 0.002}
    assert time_signatures(sigs[::-1], CPU) == {sigs[1]: 0.002, sigs[0]: 0.002}
    assert timed == sigs  # the second asking timed nothing


def test_the_census_keeps_each_calls_shapes_and_their_counts_sum_to_its_launches():
    assert all(not r.shapes for r in predict(make_config(), "cpu").census.records)  # not asked: none kept
    census = predict(make_config(), "cpu", shapes=True).census
    records = [r for r in census.records if r.cls not in (C.VIEWS, C.COLLECTIVES)]
    assert records and all(sum(n for _, n in r.shapes) == r.launches for r in records)
    convs = [r for r in records if r.op == "aten.convolution"]
    assert convs and all(json.loads(sig)[0] == "aten.convolution.default" for r in convs for sig, _ in r.shapes)
    assert set(census.signatures()) == {sig for r in records for sig, _ in r.shapes}
    fields = json.loads(json.dumps(dataclasses.asdict(Prediction(1, census=census))))
    assert Census.from_json(fields["census"]) == census  # the planner's process hands it back whole


def test_the_same_call_twice_is_one_signature_counted_twice():
    x = torch.randn(4, 4)
    mode = CensusMode(lambda: "loss")
    with mode:
        mode.on = True
        x.exp()
        x.exp()
        torch.randn(2, 4).exp()
    (record,) = [r for r in mode.census().records if r.op == "aten.exp"]
    assert record.launches == 3 and sorted(n for _, n in record.shapes) == [1, 2]


# ---------------------------------------------------------------------------------------------------- the model


def _rates(**over) -> Rates:
    base = dict(name="hand", peaks={"float32": 100.0}, bandwidth=1000.0, fractions=ONE, launch_us=5.0,
                floors={"op": 2.0})  # fmt: skip
    return Rates(**(base | over))


def test_timed_calls_replace_their_share_of_the_roofline_less_the_bare_dispatch():
    record = Record(
        "aten.mm", C.MATMUL, "loss", "float32", flops=4 * 10**12, read=10**6, launches=4,
        shapes=(("sig-a", 1), ("sig-b", 2)),
    )  # fmt: skip  # 4 calls: 3 written down (1 + 2), one not
    rates = with_calls(_rates(), {"sig-a": 0.010, "sig-b": 0.003})
    roof, launch, _ = record_terms(record, rates)
    # timed: 1 x (10 ms - 2 us) + 2 x (3 ms - 2 us); the fourth call: a quarter of the roofline's 40 ms
    assert roof == pytest.approx(1 * (0.010 - 2e-6) + 2 * (0.003 - 2e-6) + 0.040 / 4)
    assert launch == pytest.approx(4 * 5e-6)
    untimed = with_calls(_rates(), {"sig-c": 1.0})  # none of the record's calls timed: the roofline alone
    assert record_terms(record, untimed)[0] == pytest.approx(0.040)
    t = predict_step_time(Census((record,)), rates)
    assert t.ms == pytest.approx((roof + launch) * 1e3)
    assert rates.name == "hand + 2 operators timed here" and "operator-level benchmark" in rates.sources["calls"]
    assert with_calls(_rates(), {}) == _rates()


def test_a_rows_step_time_prices_its_calls_as_timed_on_the_device_it_ran_on(monkeypatch):
    config = make_config()
    prediction = predict(config, "cpu", shapes=True)
    row = Row(status="ok", ceiling_tflops=0.2, ceiling_gbps=20.0, ceiling_probe_id="probe-x")
    asked = []

    def timer(sigs, backend, tf32=False):
        asked.append((backend, tf32))
        return {s: 1e-3 for s in sigs}  # 1 ms a call, whatever the call

    monkeypatch.setattr(columns, "time_signatures", timer)
    rates = rates_from_row(row, "fp32")
    expected = predict_step_time(prediction, with_calls(rates, dict.fromkeys(prediction.census.signatures(), 1e-3)))
    row["median_ms"] = expected.ms * 2
    got, [note] = columns.step_time_columns(prediction, row, config, "cpu", None, CPU)
    assert got["predicted_step_ms"] == pytest.approx(expected.ms) and asked == [(CPU, False)]
    calls = sum(n for r in prediction.census.records for _, n in r.shapes)
    assert expected.ms >= calls * 1.0  # every written-down call at 1 ms
    assert "2.000x the predicted" in note and "operators timed here" in note
    without, _ = columns.step_time_columns(prediction, row, config, "cpu")  # no backend: nothing timed
    assert without["predicted_step_ms"] == pytest.approx(predict_step_time(prediction, rates).ms)
