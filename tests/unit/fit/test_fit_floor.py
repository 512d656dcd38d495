"""The dry run's floor under a cell's step peak (kdbench.fit.floor): what the step cannot do without at its
batch, counted without a fake run, below the fit planner's full count; an impossible batch is flagged by
`kdbench run --dry-run` (issue 45: batch 65,536 x 1,000 tokens planned with "host 54.1 MiB per rank")."""

from __future__ import annotations

import pytest

from kdbench.cli import main
from kdbench.config.schema import CellConfig
from kdbench.fit.floor import step_floor
from kdbench.fit.planner import predict
from tests.support.helpers import write_suite
from tests.support.suites import TINY_LM, merged, tiny_suite

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 4096  # tiny-llama-student's
HIDDEN = 128


def lm(**over) -> CellConfig:
    return CellConfig.model_validate(merged({k: v for k, v in TINY_LM.items() if k != "timing"}, over))


def test_the_floor_is_the_logits_or_hidden_states_and_the_ids():
    dense = step_floor(lm(batch_size=65536, data={"seq_len": 1000}))
    assert dense.bytes == 65536 * 1000 * VOCAB * 4 + 2 * 65536 * 1000 * 8
    assert dense.what.startswith("the student's logits, 65,536 x 1,000 x 4,096 fp32")
    chunked = step_floor(lm(batch_size=4, loss_impl="fused_linear", precision="bf16"))
    assert chunked.bytes == 4 * 16 * HIDDEN * 2 + 2 * 4 * 16 * 8 and "last hidden states" in chunked.what
    image = step_floor(
        CellConfig.model_validate(
            {
                "pair": {"teacher": "resnet56", "student": "resnet20"},
                "batch_size": 8,
                "data": {"kind": "synthetic", "shape": [3, 32, 32]},
            }
        )
    )
    assert image.bytes == 8 * 3 * 32 * 32 * 4 and "float32 images" in image.what


@pytest.mark.parametrize("impl", ["dense", "chunked", "fused_linear"])
def test_the_floor_is_below_the_fit_planners_count(impl):
    config = lm(batch_size=2, loss_impl=impl, data={"seq_len": 64})
    assert 0 < step_floor(config).bytes < predict(config, "cpu").peak_bytes


def test_the_dry_run_flags_a_batch_no_machine_here_holds(tmp_path, capsys):
    suite = write_suite(
        tmp_path / "big.yaml",
        **tiny_suite(
            name="big",
            defaults=merged(TINY_LM, {"data": {"kind": "tokens", "seq_len": 1000}}),
            matrix={"batch_size": [2, 65536]},
        ),
    )
    assert main(["run", str(suite), "--dry-run"]) == 0
    small, big = (line for line in capsys.readouterr().out.splitlines() if "seq1000" in line)
    assert "step at least 0.03 GiB per rank (the student's logits, 2 x 1,000 x 4,096 fp32" in small
    assert "IMPOSSIBLE" not in small
    assert "step at least 1000.98 GiB per rank (the student's logits, 65,536 x 1,000 x 4,096 fp32" in big
    assert "a floor, no fake run; kdbench fit counts all): IMPOSSIBLE here, over this machine's available memory" in big
    assert big.endswith("; lower batch_size)")
