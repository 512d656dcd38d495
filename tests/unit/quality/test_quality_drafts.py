"""The text quality protocol's students as drafts of their seed's trained teacher (quality.speculative): α measured
and predicted, tokens per verify, measured and predicted speed-ups per draft length, in the rows and the tables."""

import math

import pandas as pd
import pytest
import torch
from pydantic import ValidationError

from kdbench.config.quality import DraftsConfig, QualityConfig
from kdbench.core.speculation import predicted_speedup
from kdbench.hw.backends import choose_autocast, resolve
from kdbench.models.generation import sampled_generate
from kdbench.models.lm import CausalLM, make_lm
from kdbench.quality.drafts import DRAFT_ROW_KEYS, measure_draft, predicted_alpha, prompt_windows
from kdbench.quality.protocol import planned_rows, quality_jobs, run_quality
from kdbench.report.summaries import markdown_drafts, summarize_drafts
from tests.support.helpers import as_read, log_lines
from tests.unit.quality.test_quality_text import SMALL, TEACHER, _job

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CPU = resolve("cpu")
SPEC = DraftsConfig(draft_tokens=[1, 3], temperature=1.0, prompts=2, prompt_tokens=8, new_tokens=10, repeats=1)
DRAFTS = SMALL.model_copy(update={"epochs": 1, "speculative": SPEC})
LISTS = (
    "draft_gammas",
    "draft_alpha",
    "draft_accepted_per_verify",
    "draft_tokens_per_verify",
    "draft_speedup",
    "draft_speedup_predicted",
)


# --- configuration ---------------------------------------------------------------------------


def test_the_speculative_block_is_checked():
    on = QualityConfig(dataset="python-stdlib", speculative=True).speculative
    assert on == DraftsConfig() and on.draft_tokens == [2, 4, 8] and on.temperature == 1.0
    assert QualityConfig(dataset="python-stdlib", speculative=False).speculative is None
    assert QualityConfig(dataset="python-stdlib").speculative is None  # off unless asked for
    text = {"dataset": "python-stdlib", "seq_len": 32}
    for bad, message in (
        ({"dataset": "digits", "speculative": True}, "quality.speculative measures LM students as drafts on text"),
        ({**text, "speculative": {"draft_tokens": [0, 2]}}, "1 to 64; got 0"),
        ({**text, "speculative": {"draft_tokens": [2, 2]}}, "lists a length twice"),
        ({**text, "speculative": {"draft_tokens": []}}, "at least 1 item"),
        ({**text, "speculative": {"prompt_tokens": 33}}, "longer than the held-out windows"),
        ({**text, "speculative": {"temperature": -1}}, "greater than or equal to 0"),
        ({**text, "speculative": {"prompts": 0}}, "greater than or equal to 1"),
        ({**text, "speculative": {"draft_token": [2]}}, "Extra inputs"),
    ):
        with pytest.raises(ValidationError, match=message):
            QualityConfig(**bad)


def test_the_positions_are_checked_before_anything_runs():
    from kdbench.core.errors import KdbenchError
    from kdbench.quality.protocol import check_quality

    far = DRAFTS.model_copy(update={"speculative": SPEC.model_copy(update={"new_tokens": 4096})})
    with pytest.raises(KdbenchError, match=r"prompt_tokens \+ new_tokens = 4104 is beyond the teacher"):
        check_quality(far, [_job("forward_kl")])


def test_the_model_identity_and_the_job_id_leave_the_speculative_block_out_when_off():
    from kdbench.run.jobs import QualityJob, quality_dict

    assert "speculative" not in quality_dict(SMALL)  # the job ids of earlier runs are kept
    assert quality_dict(DRAFTS)["speculative"]["draft_tokens"] == [1, 3]
    # another job (a resume measures it), whose models are kept where the same block without it keeps them
    without, drafts = (
        QualityJob(SMALL, (_job("kd"),)),
        QualityJob(DRAFTS.model_copy(update={"epochs": 2}), (_job("kd"),)),
    )
    assert drafts.job_id != without.job_id and drafts.models_id == without.models_id == without.job_id
    assert drafts.checkpoints("/r").name == without.job_id


# --- the measurement -------------------------------------------------------------------------


def _lm(overrides, seed):
    torch.manual_seed(seed)
    return CausalLM(make_lm("tiny-llama-teacher", {**overrides, "vocab_size": 256}, False)).eval()


def test_a_draft_identical_to_the_teacher_is_always_accepted():
    teacher = _lm(TEACHER, 0)
    x = torch.randint(0, 256, (6, 16), generator=torch.Generator().manual_seed(0))
    choice = choose_autocast(CPU, "fp32")
    for temperature in (0.0, 1.0):
        spec = SPEC.model_copy(update={"temperature": temperature, "prompts": 3, "repeats": 2})
        out = measure_draft(teacher, teacher, x, spec, choice, CPU, seed=0, vocab=256)
        assert out["draft_alpha"] == [1.0, 1.0] and out["draft_alpha_predicted"] == 1.0
        # every proposal accepted: γ per verify step and the teacher's own token; 10 tokens at γ 3 take rounds of
        # 3 + 1, 3 + 1 and 2 (the last γ cut to the 2 left): 8 accepted in 3 verify steps
        assert out["draft_accepted_per_verify"][0] == 1.0 and math.isclose(out["draft_accepted_per_verify"][1], 8 / 3)
        assert out["draft_tokens_per_verify"][0] == 2.0 and math.isclose(out["draft_tokens_per_verify"][1], 10 / 3)
        assert out["draft_cost_ratio"] > 0
        for gamma, predicted in zip([1, 3], out["draft_speedup_predicted"]):
            assert math.isclose(predicted, (gamma + 1) / (gamma * out["draft_cost_ratio"] + 1))


def test_the_predicted_alpha_is_one_minus_the_mean_tv():
    teacher, student = _lm(TEACHER, 0), _lm({**TEACHER, "hidden_size": 16, "num_attention_heads": 1}, 1)
    x = torch.randint(0, 256, (5, 16), generator=torch.Generator().manual_seed(1))
    choice = choose_autocast(CPU, "fp32")
    with torch.no_grad():
        p = torch.softmax(teacher.logits(teacher(x)) / 2.0, -1)
        q = torch.softmax(student.logits(student(x)) / 2.0, -1)
    expected = 1 - float(0.5 * (p - q).abs().sum(-1).mean())
    alpha, positions = predicted_alpha(teacher, student, x, 2.0, choice, CPU)
    assert positions == 80 and math.isclose(alpha, expected, rel_tol=1e-5) and 0 < alpha < 1
    alpha, positions = predicted_alpha(teacher, student, x, 2.0, choice, CPU, tokens=40)  # the first 40 positions
    assert positions == 32  # whole windows: 2 of 16
    agree = float((p.argmax(-1) == q.argmax(-1)).float().mean())
    assert math.isclose(predicted_alpha(teacher, student, x, 0.0, choice, CPU)[0], agree)
    assert prompt_windows(10, 4) == [0, 3, 6, 9] and prompt_windows(10, 1) == [0]


def test_the_teacher_alone_baseline_samples_as_seeded():
    lm = _lm(TEACHER, 0).lm
    prompt = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        a = sampled_generate(lm, prompt, 8, 1.0, torch.Generator().manual_seed(3), 256)
        b = sampled_generate(lm, prompt, 8, 1.0, torch.Generator().manual_seed(3), 256)
        greedy = sampled_generate(lm, prompt, 8, 0.0, None, 256)
        # the first token: drawn from softmax(logits / T) of the prompt's last position
        logits = lm(input_ids=prompt).logits[0, -1, :256].float()
        first = torch.multinomial(torch.softmax(logits, -1).unsqueeze(0), 1, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (1, 11) and torch.equal(a[:, :3], prompt)
    assert int(a[0, 3]) == int(first) and int(greedy[0, 3]) == int(logits.argmax())


# --- the protocol ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_rows():
    jobs = quality_jobs([_job("forward_kl")])
    with log_lines() as log:
        rows = run_quality(DRAFTS, jobs, CPU)
    return rows, log, jobs


def test_every_student_row_has_its_draft_figures(draft_rows):
    rows, log, jobs = draft_rows
    assert [(r["seed"], r["quality_role"]) for r in rows] == [
        (s, role) for s in (0, 1) for role in ("teacher", "scratch", "distilled")
    ]
    assert all(list(r) == list(p) for r, p in zip(rows, planned_rows(DRAFTS, jobs)))
    for r in rows:
        assert r["status"] == "ok", r["error"]
        if r["quality_role"] == "teacher":  # no draft of itself
            assert all(r[k] is None for k in DRAFT_ROW_KEYS)
            continue
        assert r["draft_gammas"] == [1, 3] and all(len(r[k]) == 2 for k in LISTS)
        c = r["draft_cost_ratio"]
        assert c > 0 and 0 <= r["draft_alpha_predicted"] <= 1
        for i, gamma in enumerate(r["draft_gammas"]):
            alpha, accepted, per_verify = (r[k][i] for k in LISTS[1:4])
            assert 0 <= alpha <= 1 and 0 <= accepted <= gamma and 1 <= per_verify <= gamma + 1
            assert accepted <= per_verify <= accepted + 1
            assert r["draft_speedup"][i] > 0
            formula = (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1)) if alpha < 1 else None
            assert r["draft_speedup_predicted"][i] == predicted_speedup(alpha, gamma, c)
            assert formula is None or math.isclose(r["draft_speedup_predicted"][i], formula)
        assert "2 prompt(s): the first 8 bytes of held-out windows [0, " in r["draft_protocol"]
        assert "10 new tokens each, sampled at temperature 1" in r["draft_protocol"]
        assert f"generators seeded {100 * r['seed']} + r" in r["draft_protocol"]
        assert r["notes"] is None or "draft figures not measured" not in r["notes"]
    assert len([line for line in log if "as a draft: alpha" in line]) == 4


def test_the_draft_table_shows_each_student_per_draft_length(draft_rows, tmp_path):
    import html
    import re
    from datetime import UTC, datetime

    from kdbench.report import render_report

    rows, _, _ = draft_rows
    stamped = [dict(r, run_id="r1", cell_id="quality-x", timestamp=datetime(2026, 12, 1, tzinfo=UTC)) for r in rows]
    df = as_read(stamped)
    summary = summarize_drafts(df)
    assert [(r["quality_role"], r["method"], r["gamma"], r["n"]) for r in summary.to_dict("records")] == [
        ("scratch", None, 1, 2),
        ("distilled", "forward_kl", 1, 2),
        ("scratch", None, 3, 2),
        ("distilled", "forward_kl", 3, 2),
    ]
    scratch = [r for r in rows if r["quality_role"] == "scratch"]
    alphas = [r["draft_alpha"][1] for r in scratch]
    first = summary.iloc[2]
    assert math.isclose(first["alpha_mean"], sum(alphas) / 2)
    assert math.isclose(first["alpha_std"], pd.Series(alphas).std())
    assert math.isclose(first["alpha_predicted_mean"], sum(r["draft_alpha_predicted"] for r in scratch) / 2)
    for gamma in (1, 3):  # the best per draft length (all of them where they tie)
        at = summary[summary["gamma"] == gamma]
        for figure in ("alpha", "speedup"):
            assert list(at[f"best_{figure}"]) == list(at[f"{figure}_mean"] == at[f"{figure}_mean"].max())
    table = markdown_drafts(summary)
    assert table.splitlines()[0].startswith("| teacher | student | model | method | γ | perplexity | α | α predicted")
    assert "| tiny-llama-teacher | tiny-llama-student | distilled | forward_kl | 3 | " in table
    assert table.count("**") == 2 * int(summary["best_alpha"].sum() + summary["best_speedup"].sum())  # in bold
    page = render_report(df, tmp_path).read_text(encoding="utf-8")
    cells = [
        [html.unescape(re.sub(r"<[^>]+>", "", td)).strip() for td in re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)]
        for tr in re.findall(r'<tr class="draft-row">(.*?)</tr>', page, re.S)
    ]
    assert len(cells) == 4 and cells[2][2:5] == ["scratch", "—", "3"]
    assert cells[2][6] == f"{first['alpha_mean']:.3f} ± {first['alpha_std']:.3f}"
    assert "The students as drafts" in page


def test_the_printed_quality_summary_has_the_draft_table(draft_rows, tmp_path):
    from datetime import UTC, datetime

    from kdbench import api
    from kdbench.core.schema import rows_to_table

    rows, _, _ = draft_rows
    stamped = [dict(r, run_id="r1", cell_id="quality-x", timestamp=datetime(2026, 12, 1, tzinfo=UTC)) for r in rows]
    import pyarrow.parquet as pq

    pq.write_table(rows_to_table(stamped), tmp_path / "q.parquet")
    printed = api.quality_table([tmp_path / "q.parquet"])
    assert "| tokenizer | bits/byte | perplexity (per token) |" in printed
    assert "The students as drafts of their seed's teacher in speculative decoding" in printed
    assert "| α predicted (1 − TV) | accepted / verify | tokens / verify | c | speed-up (x) |" in printed


def test_a_resume_rebuilds_each_student_from_its_checkpoint_and_measures_it_again(tmp_path):
    one = DRAFTS.model_copy(update={"seeds": 1})
    jobs = quality_jobs([_job("forward_kl")])
    first = run_quality(one, jobs, CPU, checkpoints=tmp_path)
    assert len(list(tmp_path.glob("*.pt"))) == 3  # the teacher, the scratch and the distilled student
    with log_lines() as log:
        again = run_quality(one, jobs, CPU, checkpoints=tmp_path)
    assert not any("training" in line and "epochs x" in line for line in log)  # nothing trained again
    assert len([line for line in log if "taken from its checkpoint" in line]) == 3
    for a, b in zip(first, again):
        assert b["notes"].startswith("reused: trained by an earlier invocation of this run")
        if a["quality_role"] == "teacher":
            assert b["draft_alpha"] is None and "draft figures" not in b["notes"]
            continue
        assert "its draft figures (draft_*) are this invocation's, measured now" in b["notes"]
        # the same weights, prompts and generator seed: the same tokens, so the same counts (the times are new)
        for key in ("draft_gammas", "draft_alpha", "draft_accepted_per_verify", "draft_tokens_per_verify"):
            assert b[key] == a[key], key
        assert b["draft_alpha_predicted"] == a["draft_alpha_predicted"] and b["perplexity"] == a["perplexity"]
        assert b["draft_speedup_predicted"] == [
            predicted_speedup(alpha, g, b["draft_cost_ratio"]) for alpha, g in zip(b["draft_alpha"], b["draft_gammas"])
        ]
    # other speculative settings measure the same kept models again: the models' identity leaves them out
    other = one.model_copy(update={"speculative": SPEC.model_copy(update={"draft_tokens": [2]})})
    rows = run_quality(other, jobs, CPU, checkpoints=tmp_path)
    assert [r["draft_gammas"] for r in rows] == [None, [2], [2]]
    assert all(r["notes"].startswith("reused:") for r in rows)
