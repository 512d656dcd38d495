"""What a step costs on a device of the table (issue 43, scopes 2 and 4: kdbench.fit.cost and the devices of
kdbench.fit.cells): the budget and price parsers' values and one-line mistakes, the hours and money arithmetic on a
stand-in step time, a device without a peak for the cell's precision, the catalogue's prices with their sources,
one fake run per cell for several devices, and the step rows' other-devices column."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from kdbench.core.devices import CATALOGUE, PRICES, find_card
from kdbench.core.errors import KdbenchError
from kdbench.fit.cells import FakeRuns, fit_cells
from kdbench.fit.census import Census, Record
from kdbench.fit.cost import (
    REPORT_DEVICES,
    SAMPLES,
    STEPS,
    TOKENS,
    device_time,
    other_devices,
    parse_price,
    parse_tokens,
    step_items,
    steps_budget,
)
from kdbench.fit.devices import find_device, sized_device
from kdbench.fit.planner import Prediction
from tests.support.helpers import make_config

GIB = 2**30
LM = {
    "pair": {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
    "method": "forward_kl",
    "batch_size": 2,
    "data": {"kind": "tokens", "seq_len": 128},
}


def lm(**more):
    return make_config(**{**LM, **more})


def fake_step(ms: float):
    """A stand-in for predict_step_time: a StepTime-like answer of ``ms`` split 1:3 between two phases."""

    def predict(prediction, card, precision):
        return SimpleNamespace(
            ms=ms,
            phases={"student_forward": ms / 4, "backward": 3 * ms / 4},
            classes={"matmul/conv": ms},
            bound={"compute": 1.0, "memory": 0.0, "launch": 0.0},
            rates=f"{card.name} (stand-in)",
        )

    return predict


def with_census(nbytes: int = GIB) -> Prediction:
    record = Record(
        "aten.mm", "matmul/conv", "backward", "float32", flops=10**12, read=10**8, written=10**8, launches=1
    )
    return Prediction(nbytes, phase="loss", breakdown={"activations": nbytes}, census=Census((record,)))


# --------------------------------------------------------------------------- the budget and the price, as written


@pytest.mark.parametrize(
    "text, tokens",
    [("10B", 10**10), ("500M", 5 * 10**8), ("1e9", 10**9), ("2.5T", 25 * 10**11), ("100k", 10**5), ("1g", 10**9),
     (" 7 ", 7), ("1000000", 10**6)],
)  # fmt: skip
def test_a_token_budget_reads_as_people_write_it(text, tokens):
    budget = parse_tokens(text)
    assert (budget.kind, budget.amount, budget.given) == (TOKENS, tokens, f"--tokens {text.strip()}")


@pytest.mark.parametrize(
    "text, message",
    [
        ("-1B", "--tokens -1B: must be a positive number of tokens, e.g. 10B"),
        ("0", "--tokens 0: must be a positive number of tokens"),
        ("lots", "--tokens 'lots': not a number of tokens; write e.g. 10B, 500M, 2.5T or 1e9"),
        ("10X", "--tokens '10X': not a number of tokens"),
        ("inf", "--tokens 'inf': not a number of tokens"),
    ],
)
def test_a_bad_token_budget_is_one_line_naming_the_flag(text, message):
    with pytest.raises(KdbenchError) as err:
        parse_tokens(text)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_prices_and_steps_as_written():
    assert parse_price("2.5") == (None, 2.5) and parse_price("H100=3") == ("H100", 3.0)
    assert parse_price("mi300x = 0") == ("mi300x", 0.0)  # an owned device may cost nothing
    for text, message in [
        ("-2", "--price -2: must be a price of 0 or more US dollars per device-hour"),
        ("H100=cheap", "--price H100=cheap: 'cheap' is not a price"),
        ("=2", "--price =2: no device before '='"),
        ("nan", "--price nan: must be a price of 0 or more"),
    ]:
        with pytest.raises(KdbenchError, match=message.replace("(", r"\(")):
            parse_price(text)
    assert steps_budget(1000).kind == STEPS
    with pytest.raises(KdbenchError, match="--steps 0: must be a positive number of steps"):
        steps_budget(0)


# --------------------------------------------------------------------------- what a step processes, hours and cost


def test_an_lm_step_counts_its_tokens_and_an_image_step_its_samples():
    assert step_items(lm()) == (TOKENS, 2 * 128)
    assert step_items(make_config()) == (SAMPLES, 4)


def test_hours_and_cost_of_a_token_budget_are_steps_times_the_step_times_the_ranks_at_the_price():
    h100 = find_card("H100")
    config = lm(world_size=4, parallel="ddp")
    t = device_time(with_census(), config, h100, parse_tokens("1B"), predict_step_time=fake_step(500.0))
    assert t.per_step == 4 * 2 * 128 and t.per_s == 1024 / 0.5
    assert t.steps == math.ceil(10**9 / 1024) == 976_563
    assert t.wall_hours == pytest.approx(976_563 * 0.5 / 3600)
    assert t.device_hours == pytest.approx(4 * t.wall_hours) and t.price == h100.price == 3.90
    assert t.cost == pytest.approx(t.device_hours * 3.90)
    assert t.shares() == {"student_forward": 0.25, "backward": 0.75}
    line = t.text()
    assert line.startswith("500.0 ms a step (student_forward 25%, backward 75%); 2,048 tokens/s; 1B tokens: ")
    assert "976,563 steps, 136 h x 4 devices = 543 device-hours, $2,116 at $3.90/device-hour" in line
    record = t.record()
    assert record["cost"] == pytest.approx(t.cost) and record["budget"] == {"kind": TOKENS, "amount": 10**9}


def test_a_steps_budget_and_a_given_price_and_a_card_without_one():
    config = make_config()
    given = device_time(with_census(), config, find_card("MI300X"), steps_budget(7200), (1.0, "given: --price"),
                        predict_step_time=fake_step(1000.0))  # fmt: skip
    assert (given.steps, given.device_hours, given.cost, given.unit) == (7200, 2.0, 2.0, SAMPLES)
    assert "7,200 steps: 2.00 device-hours, $2.00 at $1.00/device-hour" in given.text()
    nvl = device_time(with_census(), config, find_card("H100 NVL"), steps_budget(10), predict_step_time=fake_step(1))
    assert nvl.price is None and "no price for H100 NVL (give --price H100NVL=USD_PER_HOUR)" in nvl.text()
    assert find_card("H100NVL") is find_card("H100 NVL")  # the hint's name is one --price finds


def test_a_device_without_a_peak_for_the_precision_says_so_instead_of_a_time():
    t = device_time(with_census(), lm(precision="bf16"), find_card("T4"), predict_step_time=fake_step(1.0))
    assert t.ms is None and t.missing == "no bf16 peak in the device table (T4 has fp32, fp16)"
    assert t.text() == "no step time: no bf16 peak in the device table (T4 has fp32, fp16)"
    bare = device_time(Prediction(GIB, phase="loss"), lm(), find_card("H100"), predict_step_time=fake_step(1.0))
    assert bare.ms is None and "no operator census" in bare.missing


def test_every_card_has_a_price_or_says_why_not_with_its_source_and_date():
    assert set(PRICES) == {card.name for card in CATALOGUE}
    for card in CATALOGUE:
        assert card.price_source and "read 2026-12-06" in card.price_source, card.name
        if card.price is None:
            assert card.price_source.startswith("no price: "), card.name
        else:
            assert 0.1 < card.price < 20 and f"${card.price:.2f}" in card.price_source, card.name
    # the cards the issue compares are priced at one provider's list, so that they rank at one kind of price
    assert [find_card(n).price for n in ("H100", "H200", "MI300X")] == [3.90, 4.29, 3.45]
    assert all("Crusoe" in find_card(n).price_source for n in ("H100", "H200", "MI300X", "A100 40GB", "A100 80GB"))


# --------------------------------------------------------------------------- several devices, one fake run


def test_several_devices_share_one_fake_run_per_cell_and_each_gets_its_step(monkeypatch):
    from kdbench.fit import planner

    calls = []

    def predict(config, device_type, allow_imports=False):
        calls.append(config.batch_size)
        return with_census(GIB)

    monkeypatch.setattr(planner, "predict", predict)
    devices = [find_device(n, live=False) for n in ("H100", "MI300X", "T4")]
    lines: list[str] = []
    report = fit_cells([lm(), lm(batch_size=4)], devices, "cuda", talk=lines.append, budget=parse_tokens("1B"))
    # one fake run a cell (no offline twin without epochs), three devices judged and priced on it
    assert calls == [2, 4] and report.runs == 2
    first = report.cells[0]
    assert list(first.verdicts) == ["H100 80GB", "MI300X", "T4"]
    # each device's own runtime over the same fake run: MI300X's hipBLAS workspaces are larger than the H100's
    assert first.verdicts["MI300X"].prediction.peak_bytes > first.verdicts["H100 80GB"].prediction.peak_bytes
    assert [t.device for t in first.times] == ["H100 80GB", "MI300X", "T4"]
    assert all(t.ms and t.ms > 0 and t.steps == math.ceil(10**9 / 256) for t in first.times)
    steps = [line for line in first.lines if "step on" in line]
    assert [line[:25] for line in steps] == [
        "      step on H100 80GB  ", "      step on MI300X     ", "      step on T4         "
    ]  # fmt: skip
    assert any(line.startswith("      H100 80GB: fits (") for line in lines)
    assert any(line.startswith("      1B tokens: cheapest ") and "fastest " in line for line in lines)
    assert not any(line.startswith("      offline teacher") for line in lines)
    assert report.summary().startswith("2 cells: H100 80GB 2 fits; MI300X 2 fits; T4 2 fits; 2 fake runs in ")
    record = report.record()
    assert [d["name"] for d in record["devices"]] == ["H100 80GB", "MI300X", "T4"]
    assert record["devices"][1]["price_per_hour"] == 3.45
    assert record["budget"] == {"kind": TOKENS, "amount": 10**9, "epochs": 1}
    assert [s["device"] for s in record["cells"][0]["step_time"]] == ["H100 80GB", "MI300X", "T4"]
    assert record["cells"][0]["prediction"]["census"] == {"backward": {"matmul/conv": {
        "flops": 10**12, "bytes": 2 * 10**8, "launches": 1}}}  # fmt: skip
    # with epochs, each cell's offline twin too: the stand-in's twins predict the same step, so the offline one
    # saves nothing, and never pays back
    calls.clear()
    lines.clear()
    report = fit_cells([lm()], devices, "cuda", talk=lines.append, budget=parse_tokens("1B"), epochs=2)
    assert calls == [2, 2] and report.runs == 2
    assert any(line.startswith("      offline teacher on MI300X ") and "never pays back" in line for line in lines)
    assert report.record()["budget"]["epochs"] == 2


def test_fake_runs_are_counted_once_per_distinct_cell_and_device_type():
    seen = []
    runs = FakeRuns(lambda config, device_type, allow_imports=False: seen.append(device_type) or with_census())
    for _ in range(3):
        runs(lm(), "cuda")
    runs(lm(), "cpu")
    assert runs.runs == 2 and seen == ["cuda", "cpu"]
    runs(lm(compile="default", compile_teacher=True), "cuda")  # the fake run is eager: the same one
    runs(lm(timing={"min_iters": 7}), "cuda")
    assert runs.runs == 2
    runs(lm(batch_size=4), "cuda")
    assert runs.runs == 3 and seen == ["cuda", "cpu", "cuda"]


@pytest.mark.parametrize(
    "devices, config, budget, message",
    [
        ([], lm(), "1B", "--tokens 1B: prices a step on a GPU of the device table; add --gpu NAME"),
        (["80GB"], lm(), "1B", "--tokens 1B: a device of 80GB is not a GPU of the device table"),
        (["H100"], make_config(), "1B", "counts samples, not tokens (an image pair); give a number of steps, --steps"),
        (["T4"], lm(precision="bf16"), "1B", "--gpu T4: no bf16 peak in the device table (T4 has fp32, fp16), and "
         "cell 1"),
    ],
)  # fmt: skip
def test_a_budget_that_cannot_be_priced_is_one_line_before_any_fake_run(devices, config, budget, message):
    def never(*args, **kwargs):
        raise AssertionError("no fake run for a mistake")

    from kdbench.fit.verdict import Predictor

    targets = [sized_device(d) if d.endswith("GB") else find_device(d, live=False) for d in devices]
    with pytest.raises(KdbenchError) as err:
        fit_cells([config], targets or None, "cuda", budget=parse_tokens(budget), predictor=Predictor("cuda", never))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_device_without_the_precision_beside_one_with_it_says_so_on_its_line():
    from kdbench.fit.verdict import Predictor

    predictor = Predictor("cuda", lambda config, device_type, allow_imports=False: with_census())
    devices = [find_device("H100", live=False), find_device("T4", live=False)]
    report = fit_cells([lm(precision="bf16")], devices, "cuda", predictor=predictor, budget=parse_tokens("1M"))
    t4 = [line for line in report.lines if "step on T4" in line]
    assert t4 == ["      step on T4         no step time: no bf16 peak in the device table (T4 has fp32, fp16)"]
    assert report.cells[0].times[0].cost is not None and report.cells[0].times[1].cost is None


# --------------------------------------------------------------------------- the step rows' other devices


def test_a_step_row_carries_its_step_on_the_report_devices_priced_from_the_same_census():
    assert REPORT_DEVICES == ("H100 80GB", "H200", "MI300X")
    from kdbench.fit.steptime import predict_step_time

    config = lm(precision="bf16")
    prediction = with_census()
    on = json.loads(other_devices(prediction, config))
    assert list(on) == ["H100 80GB", "H200", "MI300X"]
    for name, value in on.items():
        ms = predict_step_time(prediction, find_card(name), "bf16").ms
        assert value == {"ms": ms, "per_s": 256 / (ms / 1e3), "unit": TOKENS}
    assert other_devices(Prediction(None, error="unpredictable"), config) is None
    assert other_devices(Prediction(GIB, phase="loss"), config) is None  # no census
    assert json.loads(other_devices(prediction, config, ("T4", "H100"))) == {"H100 80GB": on["H100 80GB"]}
