"""Generation backends (``generation: {cache, compile}``) and decode against its bandwidth floor: the static cache
and the compiled decode step produce the dynamic cache's greedy tokens, decode rows carry their one-off cost,
break-even and bytes per token, and the share of the probe's bandwidth is derived from the stamped ceiling."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from kdbench.config.plan import Cell, cell_id_of, config_dict
from kdbench.core.names import Measurement
from kdbench.measure.decode_floor import (
    decode_bytes_per_token,
    kv_bytes_per_position,
    model_decode_bytes_per_token,
    weight_bytes_read,
)
from kdbench.models import ModelCache
from kdbench.models.generation import GreedyServing, sample
from kdbench.models.lm import build_lm
from kdbench.run.cell import measure_cell
from kdbench.run.jobs import config_columns
from kdbench.store.probes import ceiling_columns
from kdbench.workloads import check_cell
from kdbench.workloads.lm.workload import LM
from tests.support.helpers import as_read
from tests.support.rows import result_row
from tests.unit.workloads.test_lm_workload import CPU, lm_config

SHAPES = {
    "llama": ("tiny-llama-student", {"vocab_size": 256, "num_hidden_layers": 2}),
    "gpt2": (
        "gpt2",
        {"n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 0},
    ),
}


def _lm(shape: str):
    torch.manual_seed(0)
    name, over = SHAPES[shape]
    return build_lm(name, over, device="cpu", dtype=torch.float32).eval()


def _greedy(lm, ids, new, generation=None, calls=2):
    """The tokens of ``calls`` decode calls from one prefill: each must start from the same state."""
    gen = GreedyServing(lm, ids, new, generation, "cpu")
    out = []
    with torch.inference_mode():
        gen.start()
        for _ in range(calls):
            gen.decode()
            out.append(gen.generated())
    return out


class G:  # a generation setting as the cell holds it
    def __init__(self, cache="dynamic", compile=False):
        self.cache, self.compile = cache, compile


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_static_cache_decodes_the_dynamic_caches_greedy_tokens_call_after_call(shape):
    lm = _lm(shape)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    dynamic = _greedy(lm, ids, 6)
    static = _greedy(lm, ids, 6, G("static"))
    assert dynamic[0].shape == (2, 7) and torch.equal(dynamic[0], dynamic[1])
    assert torch.equal(static[0], dynamic[0]) and torch.equal(static[1], dynamic[0])


@pytest.mark.slow  # one compile: 10-60 s on the 2-core VM, by its load and inductor's cache
def test_the_compiled_static_decode_decodes_the_same_tokens():
    lm = _lm("llama")
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(4))
    dynamic = _greedy(lm, ids, 4, calls=1)
    compiled = _greedy(lm, ids, 4, G("static", True))
    assert torch.equal(compiled[0], dynamic[0]) and torch.equal(compiled[1], dynamic[0])


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_sampling_with_a_static_cache_draws_what_the_dynamic_cache_draws(shape):
    lm = _lm(shape)
    prompt = torch.randint(0, 256, (2, 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = sample(lm, prompt, 5, 1.0, torch.Generator().manual_seed(7), 200)
        got = [sample(lm, prompt, 5, 1.0, torch.Generator().manual_seed(7), 200, G("static")) for _ in range(2)]
    assert want.shape == (2, 9) and torch.equal(got[0], want) and torch.equal(got[1], want)


def test_the_bytes_per_token_formula_by_hand():
    # 1 MB of weights over a batch of 4, a KV position of 2 × 2 layers × 1 kv head × 64 dims × 2 bytes = 512 bytes,
    # a 10-token prompt and 5 new tokens: the cache holds 10, 11, 12, 13, 14 positions, 12 on average
    assert decode_bytes_per_token(1_000_000, 512, 4, 10, 5) == 250_000 + 512 * 12
    lm = _lm("llama")  # tiny-llama-student: 128 wide, 2 heads, 1 kv head, here 2 layers, 256-entry vocabulary
    assert kv_bytes_per_position(lm.config, 4) == 2 * 2 * 1 * 64 * 4
    params = sum(p.numel() for p in lm.parameters())
    table = 256 * 128  # the input embedding (untied): one row read per sequence, not counted
    assert weight_bytes_read(lm) == 4 * (params - table)
    want = 4 * (params - table) / 3 + 1024 * (8 + 2.5)
    assert model_decode_bytes_per_token(lm, 4, 3, 8, 6) == pytest.approx(want)
    gpt2 = _lm("gpt2")  # tied embeddings: the token table is the LM head, read whole; the position table is not
    wpe = gpt2.transformer.wpe.weight.numel()
    assert weight_bytes_read(gpt2) == 4 * (sum(p.numel() for p in gpt2.parameters()) - wpe)
    assert kv_bytes_per_position(gpt2.config, 2) == 2 * 2 * 2 * 32 * 2


def test_bandwidth_share_is_derived_from_the_stamped_copy_bandwidth():
    stamped = ceiling_columns({"probe_id": "p", "matmul_fp32": 1.5, "copy": 20.0}, "fp32")
    assert stamped == {"ceiling_tflops": 1.5, "ceiling_gbps": 20.0, "ceiling_probe_id": "p"}
    row = result_row(
        measurement="student_decode", median_ms=10.0, tokens_per_s=400.0, decode_bytes_per_token=5e6, **stamped
    )
    df = as_read([row, {**row, "ceiling_gbps": None}])
    assert df["bandwidth_share"][0] == pytest.approx(5e6 * 400 / 20e9)  # 0.1
    assert df["floor_ms_per_token"][0] == pytest.approx(5e6 / 20e9 * 1e3)  # 0.25 ms
    assert pd.isna(df["bandwidth_share"][1])


def test_generation_is_a_lever_out_of_default_cells_ids_and_its_refusals_name_the_key():
    plain = lm_config()
    assert "generation" not in config_dict(plain)
    static = lm_config(generation={"cache": "static"})
    assert config_dict(static)["generation"] == {"cache": "static"}
    assert cell_id_of(static) != cell_id_of(plain) and check_cell(static, False) == []
    (where, why), *_ = check_cell(lm_config(generation={"compile": True}), False)
    assert where == ("generation", "compile") and "set generation.cache: static" in why
    none = lm_config(generation={"cache": "static"}, inference={"batch_sizes": []})
    assert [p[0] for p in check_cell(none, False)] == [("generation",)]


@pytest.mark.parametrize(
    ("generation", "kind"),
    [
        ({"cache": "static"}, "static KV cache"),
        pytest.param({"cache": "static", "compile": True}, "decode compile", marks=pytest.mark.slow),  # a compile
    ],
)
def test_a_backends_decode_row_stores_its_one_off_cost_and_break_even(generation, kind):
    """One cell with the default backend, one with another: the decode row of the second carries its one-off cost
    (the compile, compiled), the tokens check and bytes per token; derive pairs the two for the break-even."""
    over = {
        "inference": {"batch_sizes": [1], "decode_tokens": 3, "teacher": False},
        "timing": {"warmup": 1, "min_iters": 3, "min_time_s": 0.0},
    }
    from kdbench.measure.memory import live_tensor_bytes

    rows = []
    pair = LM.build_pair(lm_config(**over), CPU, ModelCache())  # the generation backend builds no other models
    alive = live_tensor_bytes()
    for pulled in ({}, {"generation": generation}):
        config = lm_config(**over, **pulled)
        r = LM.serve(Measurement.STUDENT_DECODE, 1, pair, config, CPU, None)  # the cell's decode row, as measured
        rows.append({**config_columns(config, "cpu"), **r, "run_id": "r", "cell_id": cell_id_of(config)})
    # nothing the backend made (its static cache, its compiled step) outlives the row: a later measurement of the
    # worker would count it in its live peak (the fit planner's tests did, run after these in one process)
    assert live_tensor_bytes() == alive
    decode = [r for r in rows if r["measurement"] == "student_decode"]
    assert [r["status"] for r in decode] == ["ok", "ok"], [r.get("error") for r in decode]
    plain, compiled = decode
    assert plain["generation"] == "dynamic" and plain.get("one_off_ms") is None
    assert compiled["generation"] == ("static + compile" if "compile" in generation else "static")
    assert compiled["one_off_kind"] == kind and compiled["one_off_ms"] >= 0
    if "compile" in generation:
        assert compiled["one_off_ms"] > 0 and compiled["graph_breaks"] == 0 and compiled["compiled_graphs"] >= 1
    assert compiled["output_check"].startswith("ok: the same 4 greedy tokens")
    # compiled, each step copies K and V x 2 groups over the static cache's 19 positions (attention_path repeated)
    extra = 2 * 2 * 512 * (16 + 3) if "compile" in generation else 0
    assert compiled["decode_bytes_per_token"] == pytest.approx(plain["decode_bytes_per_token"] + extra)
    assert plain["decode_bytes_per_token"] > 0
    df = as_read(rows)
    got = df[df["measurement"].eq("student_decode") & df["one_off_ms"].notna()].iloc[0]
    assert got["lever_baseline_ms"] == pytest.approx(plain["median_ms"])
    assert got["lever_gain_ms"] == pytest.approx(plain["median_ms"] - compiled["median_ms"])
    gain = got["lever_gain_ms"]
    if gain > 0:  # the break-even in calls and in tokens (3 new tokens a call, batch 1; timing decides which)
        assert got["break_even_steps"] >= 0 and got["break_even_tokens"] == got["break_even_steps"] * 3
    else:
        assert pd.isna(got["break_even_steps"]) and pd.isna(got["break_even_tokens"])


def test_an_on_policy_cell_generates_with_a_static_cache():
    over = {"method": "jsd", "on_policy": {"new_tokens": 3}, "inference": {"batch_sizes": []}}
    config = lm_config(**over, generation={"cache": "static"})
    from kdbench.measure.memory import live_tensor_bytes

    assert check_cell(config, False) == []
    alive = live_tensor_bytes()
    (row,) = measure_cell(Cell(0, cell_id_of(config), config), CPU, ModelCache())
    assert row["status"] == "ok", row.get("error")
    assert row["phase_generate_ms"] > 0 and row["tokens"] == 2 * (4 + 3)
    assert live_tensor_bytes() == alive  # the phase's static cache went with the cell (no module-level keeper)


def test_the_levers_table_gives_a_decode_backends_break_even_in_calls_and_tokens():
    from kdbench.report.step_tables import lever_rows
    from tests.support.rows import timing

    base = lm_config()
    compiled = lm_config(generation={"cache": "static", "compile": True})
    common = {"measurement": "student_decode", "batch_size": 2, "tokens": 2 * 16, "run_id": "r"}
    rows = [
        result_row(**common, **timing(100.0, 2, 5, 0.02, 0.97, 1.05), cell_id="plain", cold_excess_ms=50.0,
                   config_json=json.dumps(config_dict(base))),
        result_row(**common, **timing(60.0, 2, 5, 0.02, 0.97, 1.05), cell_id="compiled", one_off_ms=4050.0,
                   one_off_kind="decode compile", config_json=json.dumps(config_dict(compiled))),
    ]  # fmt: skip
    df = as_read(rows)
    got = df[df["cell_id"].eq("compiled")].iloc[0]
    # (4,050 − 50) ms net over a 40 ms gain a call: 100 calls of 32 new tokens
    assert got["break_even_steps"] == 100 and got["break_even_tokens"] == 3200
    (shown,) = lever_rows(df)
    assert shown["kind"] == "decode compile" and shown["break_even"] == "100 (3,200 tokens)"
