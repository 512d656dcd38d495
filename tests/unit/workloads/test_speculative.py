"""Speculative decoding (issue 33): the core loop against the teacher's own greedy output on every shipped LM
family, a draft identical to the teacher (α = 1), drafts that share little or nothing with it (α against the
total-variation bound 1 − TV), the sampled output's distribution, and the cell's speculative_decode rows with their
derived speed-ups.  Tiny fp32 models; nothing here depends on the machine's speed."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from kdbench.core.speculation import expected_tokens_per_verify, predicted_speedup
from kdbench.distill.lm.token_losses import tv_per_position
from kdbench.models.generation import greedy_generate, prefill, speculative_generate
from kdbench.models.lm import build_lm
from tests.support.suites import TINY_LM, merged, tiny_suite

VOCAB = 128
# every shipped LM family at a tiny size: (registered name, overrides)
# (Qwen2's and GPT-2's default initializer_range, 0.02, makes a tiny random model repeat one token: 0.1 varies it)
FAMILIES = {
    "llama": (
        "tiny-llama-student",
        {
            **{"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
            **{"num_attention_heads": 4, "num_key_value_heads": 2},
        },
    ),
    "qwen2": (
        "qwen2.5-0.5b",
        {
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "initializer_range": 0.1,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
    "gpt2": (
        "gpt2",
        {
            **{"vocab_size": VOCAB, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512},
            **{"initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2},
        },
    ),
}


def tiny(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    name, overrides = FAMILIES[family]
    return build_lm(name, overrides).eval()


def perturbed(lm: torch.nn.Module, scale: float, seed: int = 1) -> torch.nn.Module:
    """A copy of ``lm`` with noise on every weight: a draft that agrees with it on part of its tokens."""
    draft = copy.deepcopy(lm)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * (p.std() if p.numel() > 1 else 1.0))
    return draft


def prompt_of(length: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_pair(request):
    target = tiny(request.param)
    return request.param, target, perturbed(target, 0.1)


# ---------------------------------------------------------------- greedy: the teacher's own output


@pytest.mark.parametrize("prompt_len", [1, 6])
def test_greedy_speculative_output_is_the_teachers_greedy_output_on_every_family(family_pair, prompt_len):
    family, target, draft = family_pair
    prompt, new = prompt_of(prompt_len), 24
    with torch.inference_mode():
        want = greedy_generate(target, prompt, new)
        accepted = rejected = 0
        for gamma in (1, 2, 4):
            out = speculative_generate(target, draft, prompt, new, gamma)
            assert torch.equal(out.tokens, want), (family, gamma)
            assert out.tokens.shape == (1, prompt_len + new)
            assert out.accepted + out.verifies >= new and out.proposed >= out.accepted + out.rejected
            accepted, rejected = accepted + out.accepted, rejected + out.rejected
            # from caches prefilled once (γ 4: twice in a row): the same tokens and counts, caches back to the prompt
            caches = (prefill(target, prompt), prefill(draft, prompt))
            for _ in range(2 if gamma == 4 else 1):
                again = speculative_generate(target, draft, prompt, new, gamma, caches=caches)
                assert torch.equal(again.tokens, want)
                assert (again.accepted, again.rejected, again.verifies) == (out.accepted, out.rejected, out.verifies)
                assert [int(c.get_seq_length()) for c in caches] == [prompt_len - 1] * 2
        # the perturbed draft agrees on some tokens (and after the longer prompt not on all: both branches ran)
        assert accepted > 0 and (rejected > 0 or prompt_len == 1), family


def test_greedy_speculative_output_is_what_transformers_generate_gives(family_pair):
    family, target, draft = family_pair
    prompt, new = prompt_of(5), 16
    lm = copy.deepcopy(target)
    lm.generation_config.eos_token_id = None  # no early stop: every new token counts
    lm.generation_config.pad_token_id = 0
    with torch.inference_mode():
        hf = lm.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False)
        out = speculative_generate(target, draft, prompt, new, 3)
    assert torch.equal(out.tokens, hf), family


# ---------------------------------------------------------------- a draft identical to the teacher


def rounds_of(new_tokens: int, gamma: int) -> int:
    """Verify steps when every proposal is accepted: each round yields min(γ, what is left) + 1 tokens."""
    made = rounds = 0
    while made < new_tokens:
        made += min(gamma, new_tokens - made) + 1
        rounds += 1
    return rounds


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("gamma", [1, 3, 4])
def test_a_draft_identical_to_the_teacher_has_every_proposal_accepted(temperature, gamma):
    target = tiny("llama")
    draft = copy.deepcopy(target)
    prompt, new = prompt_of(4), 23
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        out = speculative_generate(target, draft, prompt, new, gamma, temperature, g)
    rounds = rounds_of(new, gamma)
    assert out.alpha == 1.0 and out.rejected == 0
    assert out.verifies == rounds and out.accepted == out.proposed
    # the rounds propose γ each, the last what is left (23 = 5 rounds of γ + 1 = 4 + 1 ... and the rest)
    assert out.proposed == sum(min(gamma, new - i * (gamma + 1)) for i in range(rounds))
    assert out.tokens_per_verify == new / rounds
    if new % (gamma + 1) == 0:
        assert out.tokens_per_verify == gamma + 1
    if temperature == 0:
        with torch.inference_mode():
            assert torch.equal(out.tokens, greedy_generate(target, prompt, new))


# ---------------------------------------------------------------- α against its total-variation bound


class _Length:
    """A KV cache that holds nothing but its length (what speculative decoding reads of it and cuts)."""

    def __init__(self) -> None:
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, length: int) -> None:
        self.length = self.length + length if length < 0 else length


class FixedDistribution(torch.nn.Module):
    """A causal LM whose next-token distribution is ``softmax(bias)`` at every position, whatever the context, with
    the interface speculative decoding takes (``input_ids``, ``use_cache``, ``past_key_values``; logits out)."""

    def __init__(self, bias: torch.Tensor) -> None:
        super().__init__()
        self.bias = bias

    def forward(self, input_ids, use_cache=True, past_key_values=None):
        from types import SimpleNamespace

        cache = past_key_values if past_key_values is not None else _Length()
        cache.length += input_ids.shape[1]
        logits = self.bias.expand(input_ids.shape[0], input_ids.shape[1], -1)
        return SimpleNamespace(logits=logits, past_key_values=cache)


def fixed_distribution(bias: torch.Tensor) -> torch.nn.Module:
    return FixedDistribution(bias)


def bias_on(tokens: range, height: float) -> torch.Tensor:
    bias = torch.zeros(VOCAB)
    bias[list(tokens)] = height
    return bias


@pytest.mark.parametrize(
    "target_tokens, draft_tokens, height",
    [
        (range(0, 8), range(8, 16), 12.0),  # disjoint: the draft shares nothing with the teacher (TV ≈ 1)
        (range(0, 16), range(8, 24), 3.0),  # partial overlap
    ],
)
def test_sampled_alpha_is_one_minus_the_total_variation_of_fixed_distributions(target_tokens, draft_tokens, height):
    p_bias, q_bias = bias_on(target_tokens, height), bias_on(draft_tokens, height)
    target, draft = fixed_distribution(p_bias), fixed_distribution(q_bias)
    tv = float(tv_per_position(p_bias, q_bias))
    accepted = judged = 0
    g = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        for seed in range(4):
            out = speculative_generate(target, draft, prompt_of(3, seed), 64, 4, 1.0, g)
            accepted, judged = accepted + out.accepted, judged + out.accepted + out.rejected
    alpha, bound = accepted / judged, 1 - tv
    # each judged proposal is accepted independently with probability 1 - TV: 4 standard errors, and at least 0.02
    tolerance = max(0.02, 4 * math.sqrt(max(bound * (1 - bound), 1e-4) / judged))
    assert abs(alpha - bound) <= tolerance, (alpha, bound, judged)


def test_sampled_alpha_of_two_random_models_is_near_one_minus_their_mean_tv_along_the_output(temperature=0.8):
    target, draft = tiny("llama", seed=0), tiny("llama", seed=5)
    g = torch.Generator().manual_seed(11)
    accepted = judged = 0
    tvs = []
    with torch.inference_mode():
        for seed in range(3):
            prompt = prompt_of(4, seed)
            out = speculative_generate(target, draft, prompt, 96, 4, temperature, g)
            accepted, judged = accepted + out.accepted, judged + out.accepted + out.rejected
            # the TV of the two models' next-token distributions at every position of the generated text
            ids = out.tokens[:, :-1]
            p, q = target(input_ids=ids).logits[0, 3:], draft(input_ids=ids).logits[0, 3:]
            tvs.append(tv_per_position(p, q, temperature))
    bound = 1 - float(torch.cat(tvs).mean())
    alpha = accepted / judged
    assert 0.05 < bound < 0.95  # the models overlap in part: the test can tell the bound from 0 or 1
    assert abs(alpha - bound) <= 0.06 + 4 * math.sqrt(bound * (1 - bound) / judged), (alpha, bound, judged)


def test_sampled_first_tokens_are_distributed_as_the_teachers():
    """Leviathan et al.'s guarantee: whatever the draft, the output is distributed as the teacher's sampling; here
    the first new token's frequencies over 1500 seeded draws against the teacher's probabilities (chi-square)."""
    small = 8
    p_bias = torch.full((VOCAB,), -30.0)
    q_bias = p_bias.clone()
    p_bias[:small] = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.2])
    q_bias[:small] = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 0.0, 0.0, -1.0])
    target, draft = fixed_distribution(p_bias), fixed_distribution(q_bias)
    g = torch.Generator().manual_seed(2024)
    counts = torch.zeros(small)
    draws = 1500
    prompt = prompt_of(1)
    with torch.inference_mode():
        for _ in range(draws):
            out = speculative_generate(target, draft, prompt, 1, 2, 1.0, g)
            counts[int(out.tokens[0, -1])] += 1
    p = torch.softmax(p_bias, -1)[:small]
    chi2 = float(((counts - draws * p) ** 2 / (draws * p)).sum())
    assert counts.sum() == draws
    assert chi2 < 24.3, (chi2, counts.tolist())  # the 0.999 quantile of chi-square with 7 degrees of freedom


# ---------------------------------------------------------------- the formulas


def test_the_formulas_are_leviathans():
    assert expected_tokens_per_verify(1.0, 4) == 5.0
    assert expected_tokens_per_verify(0.0, 4) == 1.0
    assert expected_tokens_per_verify(0.5, 2) == pytest.approx((1 - 0.5**3) / 0.5)
    # Leviathan et al. 2023, Table/Figure 3's regime: α 0.8, γ 4, c 0.05 -> (1 - 0.8^5) / (0.2 * 1.2)
    assert predicted_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / (0.2 * 1.2))


# ---------------------------------------------------------------- the cell's rows


SPEC_SUITE = tiny_suite(
    name="spec",
    defaults=merged(
        TINY_LM,
        {
            "overrides": {
                "teacher": {"num_hidden_layers": 2, "vocab_size": 256},
                "student": {"num_hidden_layers": 1, "vocab_size": 256},
            },
            "inference": {"decode_tokens": 6, "speculative": {"draft_tokens": [1, 3], "temperature": [0, 1]}},
        },
    ),
)


@pytest.mark.slow
def test_a_cell_stores_a_speculative_row_per_draft_length_and_temperature_with_its_speedups(tmp_path):
    from kdbench.cli import main
    from kdbench.store import read_results
    from tests.support.helpers import write_suite

    suite = write_suite(tmp_path / "s.yaml", **SPEC_SUITE)
    assert main(["run", str(suite), "--out", str(tmp_path / "res"), "--no-report", "--inline"]) == 0
    df = read_results([tmp_path / "res"])
    spec = df[df["measurement"].eq("speculative_decode")].sort_values(["draft_tokens", "spec_temperature"])
    assert spec["status"].tolist() == ["ok"] * 4, spec["error"].tolist()
    assert spec[["draft_tokens", "spec_temperature"]].values.tolist() == [[1, 0], [1, 1], [3, 0], [3, 1]]
    assert (spec["batch_size"] == 1).all() and (spec["decode_tokens"] == 6).all() and (spec["tokens"] == 6).all()
    by = df[df["batch_size"].eq(1)].set_index("measurement")
    teacher, student = by.loc["teacher_decode", "median_ms"], by.loc["student_decode", "median_ms"]
    for r in spec.to_dict("records"):
        alpha, gamma = r["spec_alpha"], int(r["draft_tokens"])
        assert 0 <= alpha <= 1 and 1 <= r["spec_tokens_per_verify"] <= gamma + 1
        assert r["spec_accepted_per_verify"] == pytest.approx(r["spec_tokens_per_verify"] - 1, abs=1e-9) or alpha < 1
        assert r["tokens_per_s"] == pytest.approx(6 / (r["median_ms"] / 1e3))
        assert r["spec_speedup"] == pytest.approx(teacher / r["median_ms"])
        assert r["spec_cost_ratio"] == pytest.approx(student / teacher)
        assert r["spec_predicted_speedup"] == pytest.approx(predicted_speedup(alpha, gamma, student / teacher))
        assert r["spec_predicted_tokens_per_verify"] == pytest.approx(expected_tokens_per_verify(alpha, gamma))
        sampled = r["spec_temperature"] > 0
        assert ("sampled verification" in (r["notes"] if isinstance(r["notes"], str) else "")) == sampled
    # the other rows have no speculative figures
    others = df[df["measurement"].ne("speculative_decode")]
    assert others["spec_speedup"].isna().all() and others["draft_tokens"].isna().all()
    # the report's LM section lists the four rows
    assert main(["report", str(tmp_path / "res"), "--out", str(tmp_path / "page")]) == 0
    page = (tmp_path / "page" / "index.html").read_text()
    assert page.count('class="lm-speculative-row') == 4 and "greedy" in page
    assert (tmp_path / "page" / "lm_speculative.png").is_file() and 'src="lm_speculative.png"' in page


def test_the_report_shows_a_speculative_table(tmp_path):
    from kdbench.report.lm.tables import speculative_rows, speculative_table
    from tests.support.helpers import as_read

    rows = [
        {"run_id": "r", "cell_id": "c", "measurement": m, "status": "ok", "batch_size": 1, "median_ms": ms,
         "decode_tokens": 8, "data_kind": "tokens", "loss_impl": "dense", "teacher": "t", "student": "s",
         "precision": "fp32", "seq_len": 16, "tokens_per_s": 8 / (ms / 1e3), **extra}
        for m, ms, extra in [
            ("teacher_decode", 40.0, {}),
            ("student_decode", 10.0, {}),
            ("speculative_decode", 20.0, {"draft_tokens": 4, "spec_temperature": 0.0, "spec_alpha": 0.5,
                                          "spec_tokens_per_verify": 1.6, "spec_accepted_per_verify": 0.6}),
        ]
    ]  # fmt: skip
    table = speculative_table(as_read(rows))
    assert len(table) == 1
    r = table.iloc[0]
    assert r["spec_speedup"] == pytest.approx(2.0) and r["spec_cost_ratio"] == pytest.approx(0.25)
    assert r["spec_predicted_speedup"] == pytest.approx(predicted_speedup(0.5, 4, 0.25))
    shown = speculative_rows(table)[0]
    assert shown["draft_tokens"] == "4" and shown["alpha"] == "0.500" and shown["speedup"].startswith("2.0")


def test_a_draft_with_a_smaller_vocabulary_drafts_over_the_shared_entries():
    """data.vocab_policy slice: both models' logits cut to the shared vocabulary; the output is the teacher's greedy
    output over it, and the cell's row says so."""
    from kdbench.config.schema import CellConfig
    from kdbench.core.names import Speculative
    from kdbench.hw.backends import resolve
    from kdbench.models import ModelCache
    from kdbench.workloads.lm.workload import LM

    target = tiny("llama")
    torch.manual_seed(1)
    draft = build_lm("tiny-llama-student", {"vocab_size": 100, "num_hidden_layers": 1}).eval()
    prompt = prompt_of(5) % 100
    with torch.inference_mode():
        out = speculative_generate(target, draft, prompt, 12, 3, vocab=100)
        assert torch.equal(out.tokens, greedy_generate(target, prompt, 12, vocab=100))
    overrides = {"teacher": {"num_hidden_layers": 1, "vocab_size": 256}, "student": {"vocab_size": 200}}
    data = {"kind": "tokens", "seq_len": 16, "vocab_policy": "slice"}
    config = CellConfig.model_validate({**SPEC_SUITE["defaults"], "overrides": overrides, "data": data})
    pair = LM.build_pair(config, resolve("cpu"), ModelCache())
    row = LM.serve(Speculative(2, 1.0), 1, pair, config, resolve("cpu"), None)
    assert row["status"] == "ok" and row["draft_tokens"] == 2 and row["spec_temperature"] == 1.0
    assert "both models draft and verify over the 200 entries they share" in row["notes"]
    assert 0 <= row["spec_alpha"] <= 1 and row["decode_tokens"] == 6


def test_the_plan_has_a_speculative_row_per_variant_at_batch_size_1_that_pickles_with_it():
    import pickle

    from kdbench.config.plan import cell_id_of, config_dict
    from kdbench.config.schema import CellConfig
    from kdbench.core.names import Measurement, Speculative, planned_row
    from kdbench.workloads import planned_measurements

    config = CellConfig.model_validate(SPEC_SUITE["defaults"])
    spec = [(m, bs) for m, bs in planned_measurements(config) if m == Measurement.SPECULATIVE_DECODE]
    assert [(m.draft_tokens, m.temperature, bs) for m, bs in spec] == [(1, 0, 1), (1, 1, 1), (3, 0, 1), (3, 1, 1)]
    again = pickle.loads(pickle.dumps(spec[3][0]))
    assert isinstance(again, Speculative) and (again.draft_tokens, again.temperature) == (3, 1.0)
    assert planned_row(spec[1][0], 1) == {
        "measurement": "speculative_decode", "batch_size": 1, "draft_tokens": 1, "spec_temperature": 1.0,
    }  # fmt: skip
    assert type(planned_row(spec[1][0], 1)["measurement"]) is Measurement
    # a cell without inference.speculative keeps its id (the key is left out at its default)
    plain = {k: v for k, v in SPEC_SUITE["defaults"].items() if k != "inference"}
    with_none = CellConfig.model_validate({**plain, "inference": {"batch_sizes": [1], "decode_tokens": 6}})
    assert "speculative" not in config_dict(with_none)["inference"] and cell_id_of(with_none) != cell_id_of(config)


def test_sampled_speculation_from_prefilled_caches_is_the_same_as_from_its_own_prefill():
    target, draft = tiny("llama", seed=0), tiny("llama", seed=5)
    prompt = prompt_of(7)
    with torch.inference_mode():
        own = speculative_generate(target, draft, prompt, 20, 3, 1.0, torch.Generator().manual_seed(5))
        caches = (prefill(target, prompt), prefill(draft, prompt))
        for _ in range(2):  # twice: the caches are back at the prompt after each call
            again = speculative_generate(
                target, draft, prompt, 20, 3, 1.0, torch.Generator().manual_seed(5), caches=caches
            )
            assert torch.equal(again.tokens, own.tokens)
            assert (again.accepted, again.rejected, again.verifies) == (own.accepted, own.rejected, own.verifies)
    with pytest.raises(ValueError, match=r"hold 6 and 6 tokens, not the prompt but its last \(4\)"):
        speculative_generate(target, draft, prompt[:, :5], 4, 2, caches=caches)


def test_compare_tells_a_cells_speculative_variants_apart():
    import pandas as pd

    from kdbench.report.compare.compare import variant_labels

    rows = pd.DataFrame(
        {
            "measurement": ["teacher_decode", "speculative_decode", "speculative_decode"],
            "draft_tokens": [None, 4, 4],
            "spec_temperature": [None, 0.0, 1.0],
        }
    )
    assert variant_labels(rows).tolist() == ["teacher_decode", "speculative_decode γ4 T0", "speculative_decode γ4 T1"]


def test_a_budget_checks_each_speculative_variant_apart():
    from kdbench.config.budgets import Budget, check
    from tests.support.helpers import as_read

    rows = [
        {"run_id": "r", "cell_id": "c", "cell_label": "cell", "measurement": "speculative_decode", "status": "ok",
         "batch_size": 1, "median_ms": ms, "draft_tokens": g, "spec_temperature": 0.0, "spec_alpha": a}
        for g, ms, a in [(2, 10.0, 0.5), (4, 20.0, 0.9)]
    ]  # fmt: skip
    budget = Budget.model_validate({"measurement": "speculative_decode", "stat": "spec_alpha", "min": 0.6})
    checks = check(as_read(rows), [budget])
    assert [(c.measurement, c.value, c.outcome) for c in checks] == [
        ("speculative_decode γ2 T0", 0.5, "missed"),
        ("speculative_decode γ4 T0", 0.9, "met"),
    ]


def test_a_speculative_rows_floor_bytes_count_each_verify_and_each_draft_forward():
    """decode_bytes_per_token of a speculative row: the target's bytes per step per verify plus the draft's per draft
    forward, over the new tokens; each model's bytes per step those of its own batch-1 decode over the same span."""
    from kdbench.hw.backends import AutocastChoice
    from kdbench.measure.decode_floor import kv_bytes_per_position, weight_bytes_read
    from kdbench.workloads.lm.speculative import speculative_bytes_per_token

    target = tiny("llama")
    draft = perturbed(target, 0.1)
    prompt, new = prompt_of(5), 9
    with torch.inference_mode():
        run = speculative_generate(target, draft, prompt, new, 3)
    assert run.verifies >= 3 and run.draft_forwards >= run.verifies  # γ = 3 per round, fewer in the last one
    choice = AutocastChoice("fp32", applied=False, dtype=None)
    got = speculative_bytes_per_token(target, draft, choice, prompt.shape[1], run)
    # by hand: each model's weights as read per step (weight_bytes_read: tested in test_generation_backends) + its KV
    per_step = []
    for lm in (target, draft):
        kv = 2 * 2 * 2 * 16 * 4  # layers 2 × K,V × kv_heads 2 × head_dim 64/4 × 4 bytes, per position
        assert kv_bytes_per_position(lm.config, 4) == kv
        per_step.append(weight_bytes_read(lm) + kv * (5 + (new - 1) / 2))
    assert got == pytest.approx((run.verifies * per_step[0] + run.draft_forwards * per_step[1]) / new)
