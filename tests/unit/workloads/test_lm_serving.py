"""LM serving holds its models as a deployment does (GPU review 4, M1): a bf16 cell's prefill, decode and speculative
rows are served from bf16-held weights, K and V follow, and the decode floor counts what is held."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kdbench.core.names import Measurement
from kdbench.hw.backends import choose_autocast, resolve
from kdbench.measure.decode_floor import kv_bytes_per_position, weight_bytes_read
from kdbench.models import ModelCache
from kdbench.workloads.lm.workload import LM
from kdbench.workloads.placement import hold_for_serving
from tests.unit.workloads.test_lm_workload import lm_config

CPU = resolve("cpu")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_16_bit_cell_holds_the_served_model_in_its_dtype_once():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    model.register_buffer("freqs", torch.ones(2))
    model[0].weight.grad = torch.ones(4, 4)
    assert hold_for_serving(model, choose_autocast(CPU, "fp32")) == "fp32"  # no autocast: held as built
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert hold_for_serving(model, choose_autocast(CPU, "bf16")) == "bf16"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model[0].weight.grad is None
    assert model.freqs.dtype == torch.float32  # buffers stay as built (transformers keeps rotary's in float32)
    weight = model[0].weight
    assert hold_for_serving(model, choose_autocast(CPU, "bf16")) == "bf16" and model[0].weight is weight  # once


@pytest.mark.parametrize("measurement", [Measurement.STUDENT_DECODE, Measurement.TEACHER_PREFILL])
def test_bf16_serving_rows_are_served_from_bf16_held_models(measurement):
    config = lm_config(precision="bf16", teacher_precision="bf16")
    pair = LM.build_pair(config, CPU, ModelCache())
    role = 0 if measurement == Measurement.TEACHER_PREFILL else 1
    lm = pair[role].lm
    held_fp32 = weight_bytes_read(lm)
    assert {p.dtype for p in lm.parameters()} == {torch.float32}  # the step's masters
    row = LM.serve(measurement, 1, pair, config, CPU, None)
    assert row["status"] == "ok" and row["served_weights"] == "bf16"
    assert {p.dtype for p in lm.parameters()} == {torch.bfloat16}
    if measurement == Measurement.STUDENT_DECODE:
        # the floor counts the bf16-held weights (half the fp32 bytes) and a bf16 K and V cache
        prompt, new = config.data.seq_len, config.inference.decode_tokens
        kv = kv_bytes_per_position(lm.config, 2)
        assert row["decode_bytes_per_token"] == pytest.approx(held_fp32 / 2 + kv * (prompt + (new - 1) / 2))


def test_an_fp32_cell_serves_the_model_as_built():
    config = lm_config()
    pair = LM.build_pair(config, CPU, ModelCache())
    row = LM.serve(Measurement.STUDENT_DECODE, 1, pair, config, CPU, None)
    assert row["served_weights"] == "fp32" and {p.dtype for p in pair[1].lm.parameters()} == {torch.float32}


def test_k_and_v_are_cached_in_the_serving_dtype_only_when_the_model_is_held_in_it():
    from kdbench.models.generation import GreedyServing

    config = lm_config(precision="bf16")
    choice = choose_autocast(CPU, "bf16")
    ids = torch.randint(0, 100, (1, 8))

    def cached_dtypes(lm) -> set:
        gen = GreedyServing(lm, ids, 2)
        with torch.inference_mode(), choice.context("cpu"):
            gen.start()
        cache = gen.model.cache
        layer = cache.layers[0] if hasattr(cache, "layers") else None  # transformers 5; 4.x indexes its layers
        keys, values = (layer.keys, layer.values) if layer is not None else cache[0]
        return {keys.dtype, values.dtype}

    student = LM.build_pair(config, CPU, ModelCache())[1].lm.eval()
    assert torch.float32 in cached_dtypes(student)  # held in fp32: rotary keeps K in fp32 under bf16 autocast
    hold_for_serving(student, choice)
    assert cached_dtypes(student) == {torch.bfloat16}


def test_a_greedy_difference_at_a_near_tie_is_rounding_not_a_mismatch():
    """GPU review 4, M3: two bf16 paths that round differently may pick either token of a near-tie."""
    from kdbench.workloads.lm.serving import token_check

    want = torch.tensor([[5, 6, 7, 8]])
    got = torch.tensor([[5, 6, 9, 10]])
    assert (
        token_check(want, want, None, None, torch.bfloat16)[0] == "ok: the same 4 greedy tokens as the dynamic cache's"
    )
    check, note = token_check(got, want, 2, 5.1e-4, torch.bfloat16)  # the review's measured gap, below bf16's 2^-7
    assert check.startswith("ok to a near-tie: the same greedy tokens as the dynamic cache's up to token 2 of 4")
    assert "5.1e-04" in check and note == ""
    check, note = token_check(got, want, 2, 5.1e-4, torch.float32)  # in fp32 the same gap is no tie
    assert check == (
        "MISMATCH: 2 of the 4 greedy tokens differ from the dynamic cache's (from token 2, where its top-2 logits "
        "differ by 5.1e-04 of the top one)"
    )
    assert note.startswith("generation: MISMATCH")
    assert token_check(got, want, 2, 0.02, torch.bfloat16)[0].startswith("MISMATCH: 2 of the 4")


def test_the_gap_is_read_where_the_tokens_first_differ():
    from kdbench.models.generation import GreedyServing
    from kdbench.workloads.lm.serving import first_difference_gap

    lm = LM.build_pair(lm_config(), CPU, ModelCache())[1].lm.eval()
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    reference = GreedyServing(lm, ids, 4)
    with torch.inference_mode():
        reference.start()
        reference.decode()
        want = reference.generated()
        got = want.clone()
        got[1, 3:] = (want[1, 3:] + 1) % 100
        column, gap = first_difference_gap(lm, ids, got, want)
        assert first_difference_gap(lm, ids, want, want) == (None, None)
        top = lm(input_ids=torch.cat([ids, want[:, :3]], dim=1)[1:]).logits[0, -1].float().topk(2).values
    assert column == 3 and gap == pytest.approx(float((top[0] - top[1]) / top[0].abs()))


def test_a_positioned_decode_makes_each_steps_position_on_the_device(monkeypatch):
    """GPU review 4, M9: transformers 4.x's static path is given each step's cache_position; made by torch.tensor
    from a host list it was a blocking host-to-device copy per token; made by arange on the device it is not."""
    import functools
    import inspect

    from kdbench.models.generation import GREEDY, Cached, decode

    lm = LM.build_pair(lm_config(), CPU, ModelCache())[1].lm.eval()
    seen = []
    real_forward = lm.forward

    @functools.wraps(real_forward)  # its signature: the keywords Cached looks for
    def forward(*args, cache_position=None, **kwargs):
        seen.append(cache_position.tolist())
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(lm, "forward", forward)

    # no position made from a host list (torch.tensor([...], device=...)): arange on the device instead
    assert "torch.tensor(" not in inspect.getsource(Cached)
    model = Cached(lm, positions=True, length=0)
    ids = torch.randint(0, 100, (1, 5))
    with torch.inference_mode():
        first = GREEDY(model.feed(ids, last=True)[:, -1])
        decode(model.advance, first, 3, GREEDY)
    assert seen == [[0, 1, 2, 3, 4], [5], [6], [7]]
