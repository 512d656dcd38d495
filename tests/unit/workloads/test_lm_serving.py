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
