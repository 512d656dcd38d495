"""The offline top-k teacher cache: its size, its sparse KL against a dense reference, what it loses, and the
cell that trains from it."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from kdbench.config.plan import Cell, cell_id_of, config_dict
from kdbench.distill.lm.token_losses import forward_kl
from kdbench.distill.lm.topk import build_topk, reconstruction_kl, topk_forward_kl
from kdbench.models import ModelCache
from kdbench.run.cell import measure_cell
from kdbench.workloads import check_cell
from tests.unit.workloads.test_lm_workload import CPU, lm_config


@pytest.fixture(scope="module")
def logits():
    g = torch.Generator().manual_seed(3)
    teacher = torch.randn(2, 6, 40, generator=g) * 3
    student = torch.randn(2, 6, 40, generator=g)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :3] = False
    return teacher, student, mask


def _bucket_reference(teacher, student, mask, k, temperature):
    """The k + 1 bucket forward KL written out: the teacher's top-k entries and their rest, the student's same
    entries and its rest, from full softmaxes (float64)."""
    total, n = 0.0, 0
    for t, s in zip(
        teacher.reshape(-1, teacher.shape[-1])[mask.reshape(-1)], student.reshape(-1, 40)[mask.reshape(-1)]
    ):
        p = torch.softmax(t.double() / temperature, -1)
        q = torch.softmax(s.double() / temperature, -1)
        top = p.topk(k).indices
        p_top = p[top].half().double()  # the cache keeps log p in float16
        p_hat = torch.cat([p_top, (1 - p[top].sum()).reshape(1)])
        q_hat = torch.cat([q[top], (1 - q[top].sum()).reshape(1)])
        total += float((p_hat * (p_hat.log() - q_hat.log())).sum())
        n += 1
    return total / n * temperature**2


@pytest.mark.parametrize("k", [1, 5, 39])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_sparse_kl_equals_the_bucket_kl_written_out(logits, k, temperature):
    teacher, student, mask = logits
    cache = build_topk(teacher, k, temperature)
    got = topk_forward_kl(student, cache, mask)
    assert float(got) == pytest.approx(_bucket_reference(teacher, student, mask, k, temperature), rel=2e-3)


def test_with_every_entry_kept_it_is_the_dense_forward_kl_and_loses_nothing(logits):
    teacher, student, mask = logits
    cache = build_topk(teacher, 40, 2.0)
    s = student.clone().requires_grad_()
    got = topk_forward_kl(s, cache, mask)
    want_s = student.clone().requires_grad_()
    want = forward_kl(want_s, teacher, mask, temperature=2.0)
    assert got.item() == pytest.approx(want.item(), rel=1e-3)  # float16 log-probabilities
    got.backward(), want.backward()
    torch.testing.assert_close(s.grad, want_s.grad, rtol=1e-2, atol=1e-4)
    assert abs(reconstruction_kl(teacher, cache, mask)) < 1e-3


def test_what_the_cache_loses_shrinks_as_k_grows(logits):
    teacher, _, mask = logits
    kls = [reconstruction_kl(teacher, build_topk(teacher, k, 1.0), mask) for k in (1, 4, 16, 32)]
    assert all(a > b for a, b in itertools.pairwise(kls)) and kls[0] > 0.1 and kls[-1] >= 0


def test_at_k_128_of_32000_a_token_costs_under_2_percent_of_the_dense_fp16_logits():
    cache = build_topk(torch.randn(1, 3, 32000), 128, 1.0)
    assert cache.indices.dtype == torch.int16 and cache.logp.dtype == torch.float16
    assert cache.bytes_per_token == 128 * 4 + 4
    assert cache.bytes_per_token / (2 * 32000) < 0.02
    assert build_topk(torch.randn(1, 1, 128256), 128, 1.0).indices.dtype == torch.int32


def test_an_empty_mask_gives_zero(logits):
    teacher, student, _ = logits
    s = student.clone().requires_grad_()
    loss = topk_forward_kl(s, build_topk(teacher, 4, 1.0), torch.zeros(2, 6, dtype=torch.bool))
    loss.backward()
    assert float(loss) == 0.0 and torch.isfinite(s.grad).all()


def test_a_topk_cell_reports_its_cache_and_pays_back_against_the_live_teacher(tmp_path):
    from kdbench.cli import main
    from kdbench.store import read_results
    from tests.support.helpers import write_suite
    from tests.support.suites import TINY_LM, merged, tiny_suite

    topk = tiny_suite(
        name="topk",
        threads=2,
        defaults=merged(TINY_LM, {"inference": {"batch_sizes": []}}),
        matrix={"teacher": [{"mode": "live"}, {"mode": "topk_cache", "k": 16}]},
    )
    suite = write_suite(tmp_path / "s.yaml", **topk)
    assert main(["run", str(suite), "--out", str(tmp_path / "res"), "--no-report", "--inline"]) == 0
    df = read_results([tmp_path / "res"]).set_index("teacher_mode")
    topk = df.loc["topk_cache"]
    assert topk["status"] == "ok" and topk["teacher_cache_bytes_per_token"] == 16 * 4 + 4
    assert 0 < topk["topk_reconstruction_kl"] < 10 and topk["teacher_cache_ms"] > 0
    assert math.isfinite(topk["final_loss"]) and "1 × 32×4096" in topk["logits_buffers"]
    saving = df.loc["live", "median_ms"] - topk["median_ms"]
    assert topk["teacher_cache_saving_ms"] == pytest.approx(saving)


@pytest.mark.parametrize(
    "over, key, text",
    [
        ({"method": "reverse_kl"}, "method", "use method forward_kl"),
        ({"loss_impl": "fused_linear"}, "loss_impl", "use loss_impl dense"),
        ({"teacher": {"mode": "topk_cache", "k": 5000}}, "teacher.k", "exceeds the vocabulary's 4096"),
    ],
)
def test_topk_cache_refusals(over, key, text):
    config = lm_config(**({"teacher": {"mode": "topk_cache"}} | over))
    problems = check_cell(config, False)
    assert problems and ".".join(problems[0][0]) == key and text in problems[0][1]


def test_k_is_part_of_a_topk_cells_identity_only():
    assert "k" not in config_dict(lm_config())["teacher"]
    a, b = (lm_config(teacher={"mode": "topk_cache", "k": k}) for k in (16, 32))
    assert cell_id_of(a) != cell_id_of(b)
    assert cell_id_of(lm_config(teacher={"mode": "live", "k": 16})) == cell_id_of(lm_config())
    image = check_cell(
        lm_config(
            pair={"teacher": "resnet20", "student": "resnet8"},
            data={"kind": "synthetic"},
            method="kd",
            teacher={"mode": "topk_cache"},
            overrides={},  # the LM cell's own settings, which an image pair does not take either
            inference={"batch_sizes": [1]},
        ),
        False,
    )
    assert [".".join(k) for k, _ in image] == ["teacher.mode"]


def test_measure_cell_rows(tmp_path):
    config = lm_config(teacher={"mode": "topk_cache", "k": 8}, inference={"batch_sizes": []})
    rows = measure_cell(Cell(0, cell_id_of(config), config), CPU, ModelCache())
    assert rows[0]["status"] == "ok" and rows[0]["teacher_cache_bytes_per_token"] == 8 * 4 + 4


def test_the_cache_build_time_leaves_out_the_diagnostic_of_what_the_cache_loses(monkeypatch):
    # L5: reconstruction_kl (another float32 pass over the B×S×V logits with host syncs per chunk) ran inside the
    # timed block, so teacher_cache_ms (and the payback) counted a diagnostic no user's cache build pays
    import types

    from kdbench.distill import step as step_module
    from kdbench.distill.lm import topk
    from kdbench.distill.step import DistillStep
    from kdbench.workloads.lm.workload import LM

    now = [0.0]
    monkeypatch.setattr(step_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    real = topk.reconstruction_kl
    order = []

    def slow_kl(logits, cache, mask=None):  # a diagnostic that takes 10 s of the fake clock
        order.append("kl")
        now[0] += 10.0
        return real(logits, cache, mask)

    monkeypatch.setattr(topk, "reconstruction_kl", slow_kl)
    config = lm_config(teacher={"mode": "topk_cache", "k": 16})
    teacher, student = LM.build_pair(config, CPU, ModelCache())
    x, y = LM.batch(config, 2, torch.device("cpu"), 0, (teacher, student))
    step = DistillStep(teacher, student, x, y, config, CPU, LM)
    assert order == ["kl"] and step.cache_ms == 0.0  # the build alone: nothing advanced the fake clock in it
    columns = step.cache_columns
    assert 0 < columns["topk_reconstruction_kl"] < 10 and columns["teacher_cache_bytes_per_token"] == 16 * 4 + 4


def _autograd_reference(student, cache, mask):
    """The sparse KL as autograd writes it (kdbench's before its gradient was written out): a log-softmax, its
    gather, and the rest as a logsumexp over a scatter of -inf."""
    vocab, t = student.shape[-1], cache.temperature
    valid = mask.reshape(-1)
    s = student.double().reshape(-1, vocab)[valid]
    logp = cache.logp.reshape(-1, cache.k).double()[valid]
    idx = cache.indices.reshape(-1, cache.k).long()[valid]
    rest = cache.log_rest.reshape(-1).double()[valid]
    log_q = torch.log_softmax(s / t, dim=-1)
    p = logp.exp()
    total = torch.where(p > 0, p * (logp - log_q.gather(-1, idx)), 0.0).sum()
    if cache.k < vocab:
        log_q_rest = torch.logsumexp(log_q.scatter(-1, idx, -math.inf), dim=-1)
        has = torch.isfinite(rest)
        safe = torch.where(has, rest, 0.0)
        total = total + torch.where(has, safe.exp() * (safe - log_q_rest), 0.0).sum()
    return total / max(s.shape[0], 1) * t**2


@pytest.mark.parametrize("k", [1, 5, 39, 40])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("cut", [False, True])
def test_the_written_out_gradient_is_autograds(logits, k, temperature, cut):
    from kdbench.distill.lm.topk import TopKTeacher

    teacher, student, mask = logits
    cache = build_topk(teacher, k, temperature)
    if cut and k > 1:  # a top-p cut: the last slots empty (-inf), repeating the first kept id
        logp, idx = cache.logp.clone(), cache.indices.clone()
        logp[..., k // 2 :] = -math.inf
        idx[..., k // 2 :] = idx[..., :1]
        cache = TopKTeacher(logp, idx, cache.log_rest, cache.vocab, cache.temperature)
    s = student.clone().requires_grad_()
    got = topk_forward_kl(s, cache, mask)
    got.backward()
    ref_s = student.clone().double().requires_grad_()
    want = _autograd_reference(ref_s, cache, mask)
    want.backward()
    assert float(got) == pytest.approx(float(want), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(s.grad.double(), ref_s.grad, rtol=1e-4, atol=1e-7)
    assert not s.grad[~mask].any()  # the masked tokens get nothing


def test_a_row_whose_kept_entries_hold_all_its_mass_has_no_rest_term():
    from kdbench.distill.lm.topk import TopKTeacher

    student = torch.randn(1, 2, 6, requires_grad=True)
    logp = torch.log(torch.tensor([[[0.5, 0.5], [0.7, 0.2]]]))
    rest = torch.tensor([[-math.inf, math.log(0.1)]])
    cache = TopKTeacher(logp, torch.tensor([[[0, 1], [2, 3]]]), rest, 6, 1.0)
    got = topk_forward_kl(student, cache)
    got.backward()
    ref = student.detach().clone().double().requires_grad_()
    want = _autograd_reference(ref, cache, torch.ones(1, 2, dtype=torch.bool))
    want.backward()
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    torch.testing.assert_close(student.grad.double(), ref.grad, rtol=1e-5, atol=1e-7)
