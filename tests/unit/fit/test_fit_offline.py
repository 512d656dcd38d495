"""`kdbench fit --tokens N --epochs E`'s offline-teacher block (kdbench.fit.offline): the store's bytes are the
encoding's arithmetic, the pay-back is the build over a saving epoch, an offline twin frees the teacher's weights,
and a step that is not faster never pays back."""

import json
import math

import pytest

from kdbench.cli import main
from kdbench.config.schema import CellConfig
from kdbench.fit.cost import Budget, DeviceTime
from kdbench.fit.offline import OfflineDecision, disk_bytes, offline_twins, payback_epochs, token_id_bytes
from kdbench.models import ModelCache
from kdbench.store.teacher_logits import Encoding
from kdbench.workloads.lm.offline import PREFETCH
from kdbench.workloads.lm.workload import LM
from tests.support.helpers import write_suite
from tests.support.suites import TINY_LM, merged, tiny_suite
from tests.unit.workloads.test_lm_workload import CPU


@pytest.mark.parametrize(
    "encoding, per_token",
    [
        (Encoding(128, "fp16", "int16"), 128 * 2 + 128 * 2 + 4),  # kdbench's default at a vocabulary <= 65,536
        (Encoding(32, "int8", "int16"), 32 * 1 + 8 + 32 * 2 + 4),  # int8: a float32 offset and scale a token
        (Encoding(64, "bf16", "packed17", "zstd:3"), 64 * 2 + math.ceil(17 * 64 / 8) + 4),  # Megatron's layout
        (Encoding(8, "fp16", "int32"), 8 * 2 + 8 * 4 + 4),
    ],
)
def test_the_stores_disk_bytes_are_the_encodings_arithmetic_times_the_tokens(encoding, per_token):
    assert encoding.bytes_per_token == per_token
    assert disk_bytes(encoding, 10**9) == 10**9 * per_token
    # the token ids beside: whole sequences of seq_len + 1 int32 ids (100 tokens at 16 a sequence: 7 sequences)
    assert token_id_bytes(100, 16) == 7 * 17 * 4


def test_pay_back_is_the_build_over_one_epochs_saving_and_never_where_nothing_is_saved():
    assert payback_epochs(1000.0, 2.0, 10) == 50.0
    assert payback_epochs(1000.0, 0.0, 10) is None
    assert payback_epochs(1000.0, -0.5, 10) is None


def _time(device: str, ms: float, amount: int, price: float | None = 2.0) -> DeviceTime:
    budget = Budget("tokens", amount, "--tokens")
    return DeviceTime(device, ms=ms, per_step=32, budget=budget, steps=math.ceil(amount / 32), price=price)


def test_an_offline_step_that_is_not_faster_never_pays_back_and_prints_no_negative_saving():
    n, epochs = 3_200_000, 2.0
    decision = OfflineDecision(
        n, epochs, Encoding(16, "fp16", "int16"), _time("H100 80GB", 1.0, int(n * epochs)),
        _time("H100 80GB", 1.25, int(n * epochs)), 50 * 2**20, 52 * 2**20, 0.4, 16,
    )  # fmt: skip
    assert decision.saving_ms == pytest.approx(-0.25) and decision.payback_epochs is None
    text = decision.text()
    assert "the offline step is not faster, never pays back" in text
    assert "-0.25" not in text and "saves" not in text
    assert "no teacher memory freed: the offline step holds 2.00 MiB more" in text
    record = decision.record()
    assert record["payback_epochs"] is None and record["memory_freed_bytes"] == -2 * 2**20
    # the build: N x the teacher's forward a token; the totals: E x N tokens of steps, the offline twin's plus it
    build_h = n * 0.4 / 32 / 3.6e6
    assert record["build_hours"] == pytest.approx(build_h)
    steps = n * epochs / 32
    assert record["live_device_hours"] == pytest.approx(steps * 1.0 / 3.6e6)
    assert record["offline_device_hours"] == pytest.approx(steps * 1.25 / 3.6e6 + build_h)
    assert record["offline_cost"] == pytest.approx(2.0 * (steps * 1.25 / 3.6e6 + build_h))


def test_a_cell_the_offline_step_refuses_says_why_and_a_chunked_one_is_compared_at_dense():
    cell = CellConfig.model_validate(merged(TINY_LM, {"method": "forward_kl+hidden_mse"}))
    assert offline_twins(cell) == (
        "teacher.mode offline stores the teacher's top-k next tokens, not its features: remove hidden_mse"
    )
    live, offline, note = offline_twins(CellConfig.model_validate(merged(TINY_LM, {"loss_impl": "chunked"})))
    assert (live.teacher.mode, offline.teacher.mode, live.loss_impl, offline.loss_impl) == (
        "live",
        "offline",
        "dense",
        "dense",
    )
    assert note == "both twins at loss_impl dense (the cell's: chunked)"


def test_fit_prints_and_writes_the_offline_teacher_block(tmp_path, capsys):
    """The tiny Llama pair at 2 x 16 tokens, live, --tokens 1M --epochs 3 on an H100: two fake runs (the cell, its
    offline twin).  Every figure checked against the others by hand."""
    defaults = merged(TINY_LM, {"inference": {"batch_sizes": []}})
    suite = write_suite(tmp_path / "s.yaml", **tiny_suite(name="offline-fit", defaults=defaults))
    out = tmp_path / "fit.json"
    argv = ["fit", str(suite), "--gpu", "H100", "--tokens", "1M", "--epochs", "3", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["budget"] == {"kind": "tokens", "amount": 10**6, "epochs": 3}
    cell = data["cells"][0]
    block, step = cell["offline_teacher"], cell["step_time"][0]
    assert block["encoding_source"] == "kdbench's default offline encoding, teacher: {mode: offline}"
    d = block["devices"][0]
    assert d["device"] == "H100 80GB" and d["encoding_label"] == "k128 fp16 int16 none"
    # disk: N x (128 fp16 values + 128 int16 ids + the rest's float32)
    assert d["disk_bytes"] == 10**6 * (128 * 2 + 128 * 2 + 4) == 516 * 10**6
    assert "store 1M tokens x 516 B = 516 MB on disk before compression" in text
    # build: N x the live step's predicted teacher_forward a token (the cell as given is the live twin)
    assert d["teacher_forward_ms"] == pytest.approx(step["phases_ms"]["teacher_forward"])
    assert d["tokens_per_step"] == 32 and d["steps_per_epoch"] == math.ceil(10**6 / 32)
    assert d["build_hours"] == pytest.approx(10**6 * d["teacher_forward_ms"] / 32 / 3.6e6)
    # the saving: the live step's prediction minus the offline twin's, each from its own fake run
    assert d["live_step_ms"] == pytest.approx(step["step_ms"])
    # (this tiny step is launch-bound on an H100: the offline twin's sparse loss costs launches of its own, so the
    # saving is less than the teacher's forward)
    assert 0 < d["offline_step_ms"] < d["live_step_ms"]
    saving = d["live_step_ms"] - d["offline_step_ms"]
    assert d["saving_ms_per_step"] == pytest.approx(saving)
    # pay-back by hand: build hours over one epoch's saving in hours
    by_hand = d["build_hours"] / (saving * d["steps_per_epoch"] / 3.6e6)
    assert d["payback_epochs"] == pytest.approx(by_hand)
    assert f"pays back after {by_hand:,.3g} epochs" in text
    # 3 epochs: ceil(3N / 32) steps of each twin at $3.90, the offline twin's with the build
    steps = math.ceil(3 * 10**6 / 32)
    assert d["live_device_hours"] == pytest.approx(steps * d["live_step_ms"] / 3.6e6)
    assert d["offline_device_hours"] == pytest.approx(steps * d["offline_step_ms"] / 3.6e6 + d["build_hours"])
    assert d["live_cost"] == pytest.approx(3.90 * d["live_device_hours"])
    # memory: both twins peak in the optimizer step, where the live twin holds the teacher's weights and its outputs
    # (2 x 16 x 256 fp32 hidden states: 32 KiB) and the offline twin its PREFETCH + 1 batches of decoded top-k
    # instead (fp16 values, int32 ids, a float32 rest: 72.4 KiB): the freed memory is the teacher's weights within
    # the read buffers (0.5 % of the 13.5 MiB teacher)
    config = CellConfig.model_validate(defaults)
    teacher = LM.build_pair(config, CPU, ModelCache())[0]
    weights = sum(p.numel() * p.element_size() for p in teacher.parameters())
    buffers = (PREFETCH + 1) * (2 * 16 * 128 * (2 + 4) + 2 * 16 * 4)
    assert d["memory_freed_bytes"] == d["live_peak_bytes"] - d["offline_peak_bytes"]
    assert abs(d["memory_freed_bytes"] - weights) <= buffers
    assert "teacher memory freed 13.50 MiB" in text
