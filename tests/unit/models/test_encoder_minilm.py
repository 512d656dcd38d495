"""Encoder pairs and minilm: the registered BERT shapes' parameter counts, the minilm loss against the MiniLM
paper's formula written out independently (value and gradients, with padding, with MiniLMv2's relation heads for
head counts that differ), a whole encoder cell through measure_cell, and the plan-time refusals.

The reference (``reference_minilm``) follows the paper (Wang et al. 2020, eq. 6-9; MiniLMv2, Wang et al. 2021, eq.
5-8) the way bloomberg/minilmv2.bb (commit 0d78e201) computes it: Q, K, V recomputed from the layer's input hidden
state (``output_hidden_states``) through its projections, each sequence cut to its valid tokens, KL summed over
keys and queries and divided by relation heads × tokens, then averaged over the batch.  The term under test reads
Q, K, V from forward hooks and masks instead of cutting."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kdbench.config.plan import Cell, cell_id_of
from kdbench.config.schema import CellConfig
from kdbench.distill.hooks import FeaturePaths, FeatureTap
from kdbench.distill.losses import LossInputs
from kdbench.distill.losses.minilm import MiniLM, MiniLMParams
from kdbench.hw.backends import resolve
from kdbench.models import ModelCache
from kdbench.models.encoders import (
    Encoder,
    attn_implementation,
    build_encoder,
    encoder_config,
    encoder_parameter_count,
)
from kdbench.run.cell import measure_cell
from kdbench.workloads import check_cell, workload_of
from kdbench.workloads.encoder import ENCODER, qkv_paths

CPU = resolve("cpu")
PAIR = {"teacher": "tiny-bert-teacher", "student": "tiny-bert-student"}
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def enc_config(**over) -> CellConfig:
    base = {
        "pair": PAIR,
        "method": "minilm",
        "batch_size": 2,
        "data": {"kind": "tokens", "seq_len": 16},
        "timing": {"warmup": 0, "min_iters": 2, "max_iters": 2, "min_time_s": 0.0},
        "inference": {"batch_sizes": [1]},
    }
    base.update(over)
    return CellConfig.model_validate(base)


# --------------------------------------------------------------------------- the models


def test_the_registered_encoders_have_the_published_parameter_counts():
    assert encoder_parameter_count("bert-base") == 109_482_240  # BertModel (pooler, no MLM head): 109.48 M
    assert encoder_parameter_count("bert-large") == 335_141_888
    assert encoder_parameter_count("minilm-l12-h384") == 33_360_000  # MiniLM's 33 M (21 M + 12 M embeddings)
    assert round(encoder_parameter_count("minilm-l6-h384") / 1e6) == 23  # the README's 22 M, without the pooler
    c = encoder_config("minilm-l6-h384", {"num_hidden_layers": 3})
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.intermediate_size) == (3, 384, 12, 1536)
    assert attn_implementation("bert-base") == "sdpa"
    assert attn_implementation("bert-base", {"attn_implementation": "eager"}) == "eager"
    assert (
        build_encoder("tiny-bert-student", {"attn_implementation": "eager"}, device="meta").config._attn_implementation
        == "eager"
    )


# --------------------------------------------------------------------------- the loss against the paper


def _pair(student_over=None, seed=0):
    torch.manual_seed(seed)
    teacher = Encoder(build_encoder("tiny-bert-teacher", NO_DROPOUT))
    student = Encoder(build_encoder("tiny-bert-student", {**NO_DROPOUT, **(student_over or {})}))
    with torch.no_grad():  # sharper attention than BERT's 0.02 init gives, so the KLs are far from 0
        for model, scale in ((teacher, 6.0), (student, 4.0)):
            for name, p in model.named_parameters():
                if name.endswith(("query.weight", "key.weight", "value.weight")):
                    p.mul_(scale)
    return teacher.eval(), student.eval()


def reference_minilm(teacher, student, ids, mask, layers, relations, heads):
    """The paper's loss from explicit Q, K, V, one sequence at a time over its valid (leading) tokens."""
    with torch.no_grad():
        ht = teacher.bert(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    hs = student.bert(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states

    def projections(model, hidden, layer):
        layer = layer % len(model.bert.encoder.layer)
        att = model.bert.encoder.layer[layer].attention.self
        x = hidden[layer]  # the layer's input (hidden_states[0] is the embeddings' output)
        return {"q": att.query(x), "k": att.key(x), "v": att.value(x)}

    t, s = projections(teacher, ht, layers[0]), projections(student, hs, layers[1])
    total = torch.zeros(())
    for rel in relations:
        loss = torch.zeros(())
        for b in range(ids.shape[0]):
            n = int(mask[b].sum())
            parts = []
            for proj, h in ((t, heads[0]), (s, heads[1])):
                x, y = proj[rel[0]][b, :n], proj[rel[1]][b, :n]  # (n, W)
                d = x.shape[-1] // h
                scores = torch.einsum("ihd,jhd->hij", x.reshape(n, h, d), y.reshape(n, h, d)) / math.sqrt(d)
                parts.append(scores)
            p_t = torch.softmax(parts[0], dim=-1)
            log_s = torch.log_softmax(parts[1], dim=-1)
            kl = (p_t * (torch.log(p_t) - log_s)).sum()  # Σ_heads Σ_queries KL(p_T ‖ p_S)
            assert torch.allclose(kl, F.kl_div(log_s, p_t, reduction="sum"))
            loss = loss + kl / (heads[0] * n)
        total = total + loss / ids.shape[0]
    return total


def _term_loss(teacher, student, ids, mask, layers, params):
    t_tap = FeatureTap(teacher, qkv_paths(teacher.layers(), layers[0]))
    s_tap = FeatureTap(student, qkv_paths(student.layers(), layers[1]))
    try:
        with torch.no_grad():
            teacher(ids, mask)
        tf = t_tap.take()
        student(ids, mask)
        sf = s_tap.take()
    finally:
        t_tap.remove()
        s_tap.remove()
    term = MiniLM(params, FeaturePaths([f.shape for f in tf], [f.shape for f in sf]))
    if params.relation_heads is None:
        term.set_heads(teacher.heads, student.heads)
    targets = ids.masked_fill(mask == 0, -100)
    return term(LossInputs(None, None, targets, sf, tf)), term


CASES = {
    "v1-last-layers": ({}, dict(), (-1, -1), None),
    "v1-padded": ({}, dict(), (-1, -1), [16, 11, 5]),
    "v1-middle-layer": ({}, dict(teacher_layer=1, student_layer=0), (1, 0), [16, 9, 16]),
    "v2-relation-heads-2-vs-4-heads": (
        {"num_attention_heads": 2},
        dict(relations=["qq", "kk", "vv"], relation_heads=8),
        (-1, -1),
        [16, 12, 3],
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_minilm_equals_the_papers_formula_in_value_and_gradients(case):
    student_over, kwargs, layers, lengths = CASES[case]
    teacher, student = _pair(student_over)
    params = MiniLMParams(**kwargs)
    ids = torch.randint(0, 2048, (3, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 16, dtype=torch.long)
    for b, n in enumerate(lengths or []):
        mask[b, n:] = 0
    got, term = _term_loss(teacher, student, ids, mask, layers, params)
    heads = (params.relation_heads,) * 2 if params.relation_heads else (teacher.heads, student.heads)
    assert term.heads == heads
    want = reference_minilm(teacher, student, ids, mask, layers, params.relations, heads)
    assert want.item() > 0.05  # a real distance, not a near-uniform 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    wrt = [p for n, p in student.named_parameters() if "layer.0" in n or "word_embeddings" in n]
    g_got = torch.autograd.grad(got, wrt, allow_unused=True)
    g_want = torch.autograd.grad(want, wrt, allow_unused=True)
    assert sum(g is not None for g in g_got) > 4
    scale = max(float(g.abs().max()) for g in g_want if g is not None)  # the key bias's is 0 up to rounding
    for a, b in zip(g_got, g_want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * scale)


def test_minilm_is_zero_for_a_student_equal_to_the_teacher_and_padding_changes_nothing_it_should_not():
    teacher, _ = _pair()
    ids = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(2))
    full = torch.ones(2, 16, dtype=torch.long)
    same, _ = _term_loss(teacher, teacher, ids, full, (-1, -1), MiniLMParams(relations=["qk", "vv", "qq"]))
    assert abs(same.item()) < 1e-6
    # padding a sequence's tail changes nothing of its valid part: the loss of [a | pad] equals that of a alone
    _, student = _pair()
    short = full.clone()
    short[:, 10:] = 0
    padded, _ = _term_loss(teacher, student, ids, short, (-1, -1), MiniLMParams())
    alone, _ = _term_loss(teacher, student, ids[:, :10], full[:, :10], (-1, -1), MiniLMParams())
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-7)


def test_a_minilm_step_trains_on_the_loss_of_the_papers_formula_without_syncing():
    from kdbench.distill.step import DistillStep
    from kdbench.measure.syncs import optimizer_host_tensors, sync_calls

    config = enc_config(overrides={"teacher": NO_DROPOUT, "student": NO_DROPOUT}, batch_size=3)
    teacher, student = ENCODER.build_pair(config, CPU, ModelCache())
    x, y = ENCODER.batch(config, 3, CPU.device, 0, (teacher, student))
    assert torch.equal(x, y) and x.dtype == torch.int64 and int(x.max()) < 2048
    want = reference_minilm(teacher, student, x, torch.ones_like(x), (-1, -1), ["qk", "vv"], (4, 4)).item()
    step = DistillStep(teacher, student, x, y, config, CPU, ENCODER)
    step()
    assert step.last_loss.item() == pytest.approx(want, rel=1e-5)
    step()
    calls = sync_calls(step, CPU, exempt=optimizer_host_tensors(step.distiller.optimizer))
    step.close()
    assert calls == []
    # a cached teacher keeps its Q, K, V (copies, channel-first): the same first loss
    cached = enc_config(
        overrides={"teacher": NO_DROPOUT, "student": NO_DROPOUT}, batch_size=3, teacher={"mode": "cached"}
    )
    teacher, student = ENCODER.build_pair(cached, CPU, ModelCache())
    step = DistillStep(teacher, student, x, y, cached, CPU, ENCODER)
    assert [tuple(f.shape) for f in step.cache.feats] == [(3, 128, 16)] * 3 and step.cache_ms > 0
    step()
    assert step.last_loss.item() == pytest.approx(want, rel=1e-5)
    step.close()


# --------------------------------------------------------------------------- the cell


@pytest.mark.slow
def test_an_encoder_cell_measures_the_step_and_serving_and_records_the_attention():
    config = enc_config(overrides={"teacher": {"attn_implementation": "eager"}})
    assert workload_of(config) is ENCODER and check_cell(config, False) == []
    rows = measure_cell(Cell(0, cell_id_of(config), config), CPU, ModelCache())
    by = {str(r["measurement"]): r for r in rows}
    assert list(by) == ["distill_step", "student_inference", "teacher_inference"]
    assert [r["status"] for r in rows] == ["ok"] * 3, [r.get("error") for r in rows]
    step = by["distill_step"]
    assert step["tokens"] == 2 * 16 and step["tokens_per_s"] == pytest.approx(32 / (step["median_ms"] / 1e3))
    assert step["attn_implementation"] == "teacher eager, student sdpa" and step["seq_len"] == 16
    for role, layer in (("student", 1), ("teacher", 3)):  # the last layers' projections, hooked
        want = [f"bert.encoder.layer.{layer}.attention.self.{p}" for p in ("query", "key", "value")]
        assert step[f"{role}_features"].split(",") == want
    assert step["final_loss"] > 0 and step["adapter_params"] == 0 and "relation(s)" in step["notes"]
    assert step["phase_loss_ms"] > 0 and step["flops"] > 0
    assert by["student_inference"]["attn_implementation"] == "sdpa"
    assert by["teacher_inference"]["attn_implementation"] == "eager"
    for name in ("student_inference", "teacher_inference"):
        assert by[name]["tokens"] == 16 and by[name]["tokens_per_s"] > 0 and by[name]["flops"] > 0
    assert by["teacher_inference"]["flops"] > by["student_inference"]["flops"]


def test_hidden_mse_runs_on_encoder_layers_too():
    from kdbench.distill.step import DistillStep

    config = enc_config(method="hidden_mse", inference={"batch_sizes": []})
    assert check_cell(config, False) == []
    teacher, student = ENCODER.build_pair(config, CPU, ModelCache())
    x, y = ENCODER.batch(config, 2, CPU.device, 0, (teacher, student))
    step = DistillStep(teacher, student, x, y, config, CPU, ENCODER)
    step()
    assert step.distiller.paths.teacher == ["bert.encoder.layer.1", "bert.encoder.layer.3"]
    assert step.distiller.adapter_params == 2 * 64 * 128 and math.isfinite(step.last_loss.item())
    step.close()


# --------------------------------------------------------------------------- plan time


@pytest.mark.parametrize(
    "over, key, text",
    [
        ({"pair": {"teacher": "bert-bsae", "student": "tiny-bert-student"}}, "pair.teacher", "did you mean bert-base"),
        (
            {"pair": {"teacher": "tiny-bert-teacher", "student": "tiny-llama-student"}},
            "pair.student",
            "causal language",
        ),
        ({"pair": {"teacher": "tiny-bert-teacher", "student": "resnet8"}}, "pair.student", "image classifier"),
        ({"data": {"kind": "tokens", "seq_len": 1024}}, "data.seq_len", "beyond the teacher"),
        ({"data": {"kind": "synthetic"}}, "data.kind", "needs token data"),
        ({"method": "kd"}, "method", "not for encoder pairs"),
        ({"method": "forward_kl"}, "method", "not for encoder pairs"),
        ({"method": "minilm+hidden_mse"}, "method", "one feature method"),
        ({"overrides": {"student": {"num_attention_heads": 2}}}, "minilm.relation_heads", "one to one"),
        ({"minilm": {"relation_heads": 3}}, "minilm.relation_heads", "does not divide"),
        ({"minilm": {"teacher_layer": 4}}, "minilm.teacher_layer", "outside the teacher's 4 layers"),
        ({"features": {"teacher": ["bert.encoder.layer.1"]}}, "features", "remove features"),
        ({"overrides": {"teacher": {"num_layers": 2}}}, "overrides.teacher.num_layers", "has no field 'num_layers'"),
        (
            {"overrides": {"teacher": {"attn_implementation": "flash"}}},
            "overrides.teacher.attn_implementation",
            "sdpa, eager",
        ),
        ({"loss_impl": "fused_linear"}, "loss_impl", "has none"),
        ({"inference": {"runtime": "onnxruntime"}}, "inference.runtime", "served eagerly"),
        ({"world_size": 2}, "world_size", "one device"),
        ({"teacher": {"mode": "topk_cache"}}, "teacher.mode", "live or cached"),
    ],
)
def test_plan_time_refusals_name_the_key(over, key, text):
    problems = check_cell(enc_config(**over), False)
    assert problems, over
    where, message = problems[0]
    assert ".".join(where) == key and text in message, problems


def test_lm_and_image_pairs_refuse_minilm():
    lm = enc_config(pair={"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"})
    image = CellConfig.model_validate({"pair": {"teacher": "resnet20", "student": "resnet8"}, "method": "minilm"})
    for config in (lm, image):
        where, message = check_cell(config, False)[0]
        assert where == ("method",) and "minilm: an encoder method" in message
