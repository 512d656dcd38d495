"""Serving rows say how GQA attention reached SDPA (``attention_path``, GPU review 4, M2), and a decode whose steps
repeat K and V counts the copy in its floor: the tiny pair (GQA, 2 groups each), fp32, on the CPU."""

from __future__ import annotations

import functools

import pytest
import torch

from kdbench.core.names import Measurement, Speculative
from kdbench.measure.decode_floor import (
    decode_bytes_per_token,
    kv_bytes_per_position,
    kv_groups,
    repeat_kv_bytes_per_token,
    weight_bytes_read,
)
from kdbench.models import ModelCache
from kdbench.models.lm import lm_config as hf_config
from kdbench.workloads.lm.workload import LM
from tests.unit.workloads.test_lm_workload import CPU, lm_config

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("transformers.integrations.sdpa_attention")

OVER = {"inference": {"batch_sizes": [1], "decode_tokens": 3, "teacher": False}}


@pytest.fixture(scope="module")
def pair():
    return LM.build_pair(lm_config(**OVER), CPU, ModelCache())


def _row(pair, measurement, **generation):
    config = lm_config(**OVER, **({"generation": generation} if generation else {}))
    row = LM.serve(measurement, 1, pair, config, CPU, None)
    assert row["status"] == "ok", row.get("error")
    return row


def test_the_repeats_bytes_per_token_by_hand():
    """2 × groups × KV bytes per position × positions attended: the review's Llama-3.1-8B in bf16 (groups 4, 128
    KiB per position) at a 4,096-position cache, 4.3 GB per token (34 GB per step at batch 8)."""
    config = hf_config("llama-3.1-8b")
    kv = kv_bytes_per_position(config, 2)
    assert (kv, kv_groups(config)) == (2 * 32 * 8 * 128 * 2, 4) == (131072, 4)
    assert repeat_kv_bytes_per_token(kv, 4, 4096) == 2 * 4 * 131072 * 4096 == 4_294_967_296
    assert repeat_kv_bytes_per_token(kv, 1, 4096) == 0.0  # one group: nothing repeated
    assert kv_groups(hf_config("gpt2")) == 1


def test_a_dynamic_decode_and_a_prefill_use_sdpas_gqa(pair):
    decode = _row(pair, Measurement.STUDENT_DECODE)
    assert decode["attention_path"] == "enable_gqa"
    lm = pair[1].lm
    floor = decode_bytes_per_token(weight_bytes_read(lm), kv_bytes_per_position(lm.config, 4), 1, 16, 3)
    assert decode["decode_bytes_per_token"] == pytest.approx(floor)  # no copy counted
    assert "repeat_kv" not in (decode.get("notes") or "")
    assert _row(pair, Measurement.STUDENT_PREFILL)["attention_path"] == "enable_gqa"


def test_an_eager_static_decode_packs_the_query(pair):
    row = _row(pair, Measurement.STUDENT_DECODE, cache="static")
    assert row["attention_path"] == "packed" and "repeat_kv" not in (row.get("notes") or "")
    lm = pair[1].lm
    floor = decode_bytes_per_token(weight_bytes_read(lm), kv_bytes_per_position(lm.config, 4), 1, 16, 3)
    assert row["decode_bytes_per_token"] == pytest.approx(floor)


def test_a_compiled_static_decode_repeats_kv_and_its_floor_counts_the_copy(pair, monkeypatch):
    """The decode step compiled with dynamo's eager backend (its tracing, no inductor): its steps run repeat_kv
    over the static cache's 16 + 3 positions, which the floor adds: 2 × 2 groups × 512 bytes (one layer, one kv
    head of 64, fp32) × 19 = 38,912 bytes per token."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    plain = _row(pair, Measurement.STUDENT_DECODE)
    row = _row(pair, Measurement.STUDENT_DECODE, cache="static", compile=True)
    assert row["one_off_kind"] == "decode compile" and row["output_check"].startswith("ok: the same 4 greedy tokens")
    assert row["attention_path"] == "repeated"
    assert kv_bytes_per_position(pair[1].lm.config, 4) == 512
    assert row["decode_bytes_per_token"] - plain["decode_bytes_per_token"] == pytest.approx(38912)
    assert (
        "attention_path: each step under torch.compile (its eager pass, which attention_kernel describes, does not) "
        "runs transformers' repeat_kv, which writes K and V x 2 at the 19 positions it attends and SDPA reads them "
        "back: +38,912 bytes per token in decode_bytes_per_token"
    ) in row["notes"]


def test_a_speculative_row_says_the_teachers_verify_repeats_kv(pair):
    """The teacher's verify of 3 tokens on its cache (a causal mask) runs repeat_kv; the draft's one-token steps do
    not.  The copy per token is 2 × (2 groups × 2,048 bytes per position: two layers, two kv heads of 64, fp32) ×
    the positions each verify attends / 3 new tokens."""
    config = lm_config(inference={"batch_sizes": [1], "decode_tokens": 3, "speculative": {"draft_tokens": [2]}})
    row = LM.serve(Speculative(2, 0.0), 1, pair, config, CPU, None)
    assert row["status"] == "ok", row.get("error")
    assert row["attention_path"] == "teacher repeated, student enable_gqa"
    assert kv_bytes_per_position(pair[0].lm.config, 4) == 2048
    note = next(n for n in row["notes"].split("; ") if n.startswith("attention_path"))
    assert note.startswith("attention_path: forwards of several tokens on a cache (the teacher's verify) run")
    extra = float(note.split("+")[1].split(" ")[0].replace(",", ""))
    attended = extra * 3 / 2 / (2 * 2048)  # positions over the call's verifies: 17 to 19 each, at most 3 verifies
    verifies = round(3 / row["spec_tokens_per_verify"])
    assert attended == pytest.approx(round(attended), abs=1e-3) and 17 * verifies <= round(attended) <= 19 * verifies
