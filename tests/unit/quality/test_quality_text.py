"""Quality on real text for LM pairs: the standard library's bytes, split by file, perplexity, the protocol."""

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from pydantic import ValidationError
from torch import nn

from kdbench.config.quality import QualityConfig
from kdbench.config.schema import OnPolicyConfig, TokenizersConfig
from kdbench.core.errors import KdbenchError
from kdbench.data.corpus import stdlib_files, stdlib_root
from kdbench.data.text import load_text, split_files
from kdbench.hw.backends import choose_autocast, resolve
from kdbench.models.lm import CausalLM
from kdbench.quality.protocol import planned_rows, quality_jobs, run_quality
from kdbench.quality.text import TEXT_ROW_KEYS, evaluate_text
from kdbench.quality.train import DeviceData
from kdbench.report.summaries import markdown_table, summarize_quality
from tests.support.helpers import log_lines, make_config
from tests.support.paths import ROOT

pytest.importorskip("transformers")

CPU = resolve("cpu")
TEACHER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
STUDENT = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 1}
SMALL = QualityConfig(
    dataset="python-stdlib",
    epochs=2,
    seeds=2,
    batch_size=16,
    optimizer="adamw",
    lr=3e-3,
    weight_decay=0.0,
    max_bytes=16_000,
    seq_len=32,
    target=0.8,
)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _job(method, student="tiny-llama-student", overrides=None):
    # The cells keep the tiny Llamas' 4096-entry vocabulary: the protocol lays vocab_size 256 over it.
    return make_config(
        method=method,
        pair={"teacher": "tiny-llama-teacher", "student": student},
        overrides=overrides or {"teacher": TEACHER, "student": STUDENT},
        data={"kind": "tokens", "seq_len": 16},
        inference={"batch_sizes": []},
    )


# --- configuration ---------------------------------------------------------------------------


def test_text_keys_are_checked():
    assert QualityConfig(dataset="python-stdlib").text_seq_len == 128
    for bad, message in (
        ({"seq_len": 64}, "quality.seq_len is for text"),
        ({"max_bytes": 1000}, "quality.max_bytes is for text"),
        ({"dataset": "python-stdlib", "root": "/x"}, "quality.root is only for"),
        ({"dataset": "python-stdlib", "max_samples": 100}, "cap the bytes with max_bytes"),
        ({"dataset": "python-stdlib", "max_bytes": 400, "seq_len": 128}, "shorter than one window"),
        ({"dataset": "python-stdlib", "seq_len": 1}, "greater than or equal to 2"),
    ):
        with pytest.raises(ValidationError, match=message):
            QualityConfig(**bad)


# --- the data set ----------------------------------------------------------------------------


def _fake_stdlib(root: Path) -> dict[str, bytes]:
    """A stdlib-shaped folder: the files the corpus keeps (returned) and those it must leave out."""
    kept = {
        "a.py": b"import os\n" * 30,
        "b.py": bytes(range(256)) * 2,
        "pkg/__init__.py": b"# package\n" * 20,
        "pkg/mod.py": "def f():\n    return 'caf\u00e9'\n".encode() * 15,
        "zz.py": b"x = 1\n" * 60,
    }
    left_out = (
        "site-packages/numpy/core.py",
        "test/test_os.py",
        "lib2to3/tests/data.py",
        "idlelib/idle_test/t.py",
        "config-3.11-x86_64-linux-gnu/python-config.py",
        "_sysconfigdata__linux_x86_64-linux-gnu.py",
        "notes.txt",
    )
    for name, data in kept.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    for name in left_out:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"should not be read\n" * 10)
    return kept


def test_corpus_files_split_by_file_and_windows(tmp_path):
    kept = _fake_stdlib(tmp_path)
    files = stdlib_files(tmp_path)
    assert files == sorted(kept)
    cfg = QualityConfig(dataset="python-stdlib", seq_len=16, test_fraction=0.4)
    train, test = split_files(files, cfg.test_fraction, seed=0)
    assert len(test) == 2 and sorted(train + test) == files and not set(train) & set(test)
    assert split_files(files, 0.4, seed=0) == (train, test)  # deterministic
    assert any(split_files(files, 0.4, seed=s) != (train, test) for s in range(1, 5))  # the seed moves files
    d = load_text(cfg, seed=0, root=tmp_path)
    # each split is its files' bytes, joined in the split's order, cut into windows of 17 at a stride of 16
    for x, y, names in ((d.x_train, d.y_train, train), (d.x_test, d.y_test, test)):
        blob = b"".join(kept[n] for n in names)
        n = (len(blob) - 1) // 16
        assert x.shape == y.shape == (n, 16) and x.dtype == torch.int64
        assert bytes(x.flatten().tolist()) == blob[: n * 16]
        assert bytes(y.flatten().tolist()) == blob[1 : n * 16 + 1]  # the next bytes
    c = d.corpus
    assert (c.files, c.train_files, c.test_files) == (5, 3, 2)
    assert c.train_bytes == sum(len(kept[n]) for n in train) and "python-stdlib" in c.describe()


def test_stdlib_corpus_capped_deterministic_and_bytes():
    cfg = QualityConfig(dataset="python-stdlib", seq_len=64, max_bytes=40_000, test_fraction=0.25)
    d = load_text(cfg)
    assert d.num_classes == 256
    assert d.corpus.train_bytes == 30_000 and d.corpus.test_bytes == 10_000  # the cap, shared by test_fraction
    assert d.x_train.shape == ((30_000 - 1) // 64, 64) and d.x_test.shape == ((10_000 - 1) // 64, 64)
    assert int(d.x_train.min()) >= 0 and int(d.x_train.max()) < 256 and int(d.y_test.max()) < 256
    files = stdlib_files()
    assert len(files) > 100 and all(f.endswith(".py") for f in files)
    assert not any(part in ("site-packages", "test", "tests") for f in files for part in f.split("/")[:-1])
    assert d.corpus.files == len(files)
    again = load_text(cfg)
    assert torch.equal(d.x_train, again.x_train) and torch.equal(d.y_test, again.y_test)
    assert again.corpus == d.corpus
    # the held-out windows are the held-out files' bytes, joined in the split's order
    _, test = split_files(files, 0.25, seed=0)
    held_out = b"".join((stdlib_root() / f).read_bytes() for f in test[:200])[:10_000]
    assert bytes(d.x_test.flatten().tolist()) == held_out[: d.x_test.numel()]


# --- perplexity ------------------------------------------------------------------------------


class Unigram(nn.Module):
    """Next-byte logits that ignore the input: log p for a fixed distribution p over the 256 bytes."""

    def __init__(self, p: torch.Tensor):
        super().__init__()
        self.logp = nn.Parameter(p.log(), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logp.expand(*ids.shape, 256)


def test_perplexity_of_a_model_with_known_output():
    d = load_text(QualityConfig(dataset="python-stdlib", seq_len=32, max_bytes=8_000))
    data = DeviceData(d.x_train, d.y_train, d.x_test, d.y_test, 256, torch.contiguous_format)
    choice = choose_autocast(CPU, "fp32")
    uniform = CausalLM(Unigram(torch.full((256,), 1 / 256)))  # a module that returns its logits, wrapped
    accuracy, preds, loss = evaluate_text(uniform, data, choice, CPU)
    assert math.isclose(math.exp(loss), 256, rel_tol=1e-6) and preds.shape == (d.y_test.numel(),)
    # a distribution fitted to the training bytes: the mean held-out -log p, computed here by numpy
    counts = np.bincount(d.y_train.flatten().numpy(), minlength=256) + 1.0
    p = counts / counts.sum()
    accuracy, preds, loss = evaluate_text(CausalLM(Unigram(torch.tensor(p, dtype=torch.float32))), data, choice, CPU)
    y = d.y_test.flatten().numpy()
    assert math.isclose(loss, float(-np.log(p[y]).mean()), rel_tol=1e-5)
    assert math.isclose(accuracy, float((y == p.argmax()).mean()))
    assert 1 < math.exp(loss) < 256


# --- the protocol ----------------------------------------------------------------------------

METHODS = ("forward_kl", "reverse_kl")


@pytest.fixture(scope="module")
def text_rows():
    jobs = quality_jobs([_job(m) for m in METHODS])
    with log_lines() as log:
        rows = run_quality(SMALL, jobs, CPU)
    return rows, log, jobs


def test_rows_are_the_planned_rows_with_finite_perplexities(text_rows):
    rows, log, jobs = text_rows
    planned = planned_rows(SMALL, jobs)
    keys = ("quality_role", "teacher", "student", "method", "seed", "quality_dataset", "seq_len")
    assert [tuple(r[k] for k in keys) for r in rows] == [tuple(r[k] for k in keys) for r in planned]
    assert [(r["seed"], r["quality_role"], r["method"]) for r in rows] == [
        (s, role, m)
        for s in (0, 1)
        for role, m in (("teacher", None), ("scratch", None), ("distilled", "forward_kl"), ("distilled", "reverse_kl"))
    ]
    assert all(list(r) == list(p) for r, p in zip(rows, planned)) and set(TEXT_ROW_KEYS) <= set(rows[0])
    for r in rows:
        assert r["status"] == "ok", r["error"]
        assert math.isfinite(r["perplexity"]) and 1 < r["perplexity"] < 256  # below uniform over the bytes
        assert math.isclose(r["bits_per_byte"], math.log2(r["perplexity"]))
        assert len(r["perplexity_by_epoch"]) == len(r["train_time_by_epoch_s"]) == 2
        assert r["perplexity_by_epoch"][-1] == r["perplexity"] and r["best_perplexity"] == min(r["perplexity_by_epoch"])
        assert r["train_time_by_epoch_s"][-1] == r["train_time_s"] > 0
        assert r["quality_corpus"].startswith("python-stdlib ") and r["quality_train_tokens"] == (12_000 - 1) // 32 * 32
        assert 0 <= r["accuracy"] <= 1
        if r["quality_role"] == "teacher":
            assert r["agreement"] is None and r["time_to_target_s"] is not None  # its own perplexity, reached
        else:
            assert 0 <= r["agreement"] <= 1
    assert (
        len([line for line in log if ": teacher tiny-llama-teacher: " in line and "bits/byte (perplexity" in line]) == 2
    )


def test_the_summary_table_shows_perplexity(text_rows):
    rows, _, _ = text_rows
    summary = summarize_quality(pd.DataFrame(rows))
    assert list(summary["n"]) == [2, 2, 2, 2]
    teacher = summary.iloc[0]
    ppl = [r["perplexity"] for r in rows if r["quality_role"] == "teacher"]
    assert math.isclose(teacher["perplexity_mean"], np.mean(ppl)) and math.isclose(
        teacher["perplexity_std"], np.std(ppl, ddof=1)
    )
    table = markdown_table(summary)
    assert "| tokenizer | bits/byte | perplexity (per token) | next-token top-1 (%) |" in table.splitlines()[0]
    assert "| tiny-llama-teacher | tiny-llama-student | distilled | forward_kl | bytes | " in table


def test_image_and_text_mismatches_are_user_errors():
    from kdbench.quality.protocol import check_quality

    with pytest.raises(KdbenchError, match="is an image pair"):
        check_quality(SMALL, [make_config()])
    with pytest.raises(KdbenchError, match="use dataset: python-stdlib"):
        check_quality(QualityConfig(), [_job("forward_kl")])
    long = SMALL.model_copy(update={"seq_len": 4096})
    with pytest.raises(KdbenchError, match="beyond the teacher tiny-llama-teacher's 2048 positions"):
        check_quality(long, [_job("forward_kl")])


@pytest.mark.slow
def test_a_crashed_text_quality_job_is_stored_as_its_planned_rows(tmp_path, monkeypatch, capsys):
    from kdbench.cli import main
    from kdbench.store import read_results
    from tests.support.helpers import run_folder, write_suite
    from tests.support.suites import TINY_LM, merged, tiny_suite

    monkeypatch.syspath_prepend(str(ROOT))  # tests.*, for the worker process
    crashing = {
        "pair": {"teacher": "tiny-llama-teacher", "student": "tests.support.faulty_models:segfaulting_lm"},
        "overrides": {"teacher": {**TEACHER, "vocab_size": 256}},  # replaces the fragment's: none for the student
        "inference": {"batch_sizes": []},
    }
    qtext = tiny_suite(
        name="qtext",
        allow_imports=True,
        defaults=merged(TINY_LM, crashing),
        matrix={"method": ["forward_kl", "jsd"]},
        quality=SMALL.model_dump(exclude_defaults=True) | {"seeds": 1},
    )
    suite = write_suite(tmp_path / "q.yaml", **qtext)
    out = tmp_path / "res"
    assert main(["run", str(suite), "--out", str(out), "--no-report"]) == 1
    df = read_results([run_folder(out).path])
    assert set(df.loc[df["measurement"] != "quality", "status"]) == {"ok"}  # the timed cells train a step of 2
    q = df[df["measurement"] == "quality"]
    # every planned row: the teacher, the scratch student and both distillations
    assert sorted(zip(q["quality_role"], q["method"].fillna("-"))) == [
        ("distilled", "forward_kl"),
        ("distilled", "jsd"),
        ("scratch", "-"),
        ("teacher", "-"),
    ]
    # the teacher had trained before the worker died (kill -9 or a segfault alike): its row is kept, the rest marked
    teacher, rest = q[q["quality_role"] == "teacher"], q[q["quality_role"] != "teacher"]
    assert list(teacher["status"]) == ["ok"] and 1 < float(teacher["perplexity"].iloc[0]) < 256
    assert set(rest["status"]) == {"failed"} and rest["error"].str.contains("SIGSEGV").all()
    kept = list((run_folder(out).path / "_quality").glob("quality-*/*.pt"))
    assert [p.name.split("-")[1] for p in kept] == ["teacher"]  # its checkpoint, for a resume
    assert set(q["quality_dataset"]) == {"python-stdlib"} and set(q["seq_len"]) == {32}
    assert "quality (python-stdlib, 1 seed)" in capsys.readouterr().err


def test_the_report_shows_perplexity(text_rows, tmp_path):
    import html
    import re
    from datetime import UTC, datetime

    from kdbench.report import render_report
    from tests.support.helpers import as_read

    rows, _, _ = text_rows
    stamped = [dict(r, run_id="r1", cell_id="quality-x", timestamp=datetime(2026, 12, 1, tzinfo=UTC)) for r in rows]
    page = render_report(as_read(stamped), tmp_path).read_text(encoding="utf-8")
    cells = [
        [html.unescape(re.sub(r"<[^>]+>", "", td)).strip() for td in re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)]
        for tr in re.findall(r'<tr class="quality-row">(.*?)</tr>', page, re.S)
    ]
    teacher_ppl = [r["perplexity"] for r in rows if r["quality_role"] == "teacher"]
    teacher_bits = [r["bits_per_byte"] for r in rows if r["quality_role"] == "teacher"]
    assert cells[0][2] == "teacher" and cells[0][4] == "python-stdlib" and cells[0][5] == "bytes"
    assert cells[0][6] == f"{np.mean(teacher_bits):.3f} ± {np.std(teacher_bits, ddof=1):.3f}"
    assert cells[0][7] == f"{np.mean(teacher_ppl):.3f} ± {np.std(teacher_ppl, ddof=1):.3f}"
    assert "<th>tokenizer</th><th>bits/byte</th><th>perplexity (per token)</th>" in page


def test_students_of_one_name_but_other_overrides_are_other_models_in_jobs_rows_and_tables():
    wide = {**STUDENT, "hidden_size": 32, "num_attention_heads": 2}
    cells = [_job("forward_kl", overrides={"teacher": TEACHER, "student": s}) for s in (STUDENT, wide)]
    jobs = quality_jobs([*cells, _job("forward_kl")])  # the third repeats the first: no new job
    assert len(jobs) == 2
    rows = planned_rows(SMALL, jobs)
    scratch = [r for r in rows if r["quality_role"] == "scratch" and r["seed"] == 0]
    assert sorted(json.loads(r["student_overrides"])["hidden_size"] for r in scratch) == [16, 32]
    assert {r["teacher_overrides"] for r in rows} == {json.dumps(TEACHER, sort_keys=True)}
    for r in rows:  # results, so that the summary has figures to average
        wider = r["student_overrides"] is not None and json.loads(r["student_overrides"])["hidden_size"] == 32
        r.update(perplexity=10.0 + wider, bits_per_byte=3.0, accuracy=0.5)
    summary = summarize_quality(pd.DataFrame(rows))
    students = summary[summary.quality_role == "distilled"]
    assert len(students) == 2 and students["perplexity_mean"].tolist() == [10.0, 11.0]
    assert all(s.startswith("tiny-llama-student {") for s in students["student"])  # named with their overrides
    assert summary[summary.quality_role == "teacher"]["teacher"].tolist() == ["tiny-llama-teacher"]  # one shape


def test_a_distilled_row_says_which_step_settings_the_protocol_does_not_apply():
    on_policy = _job("jsd").model_copy(update={"on_policy": OnPolicyConfig(new_tokens=4)})
    rows = planned_rows(SMALL, quality_jobs([on_policy]))
    distilled = [r for r in rows if r["quality_role"] == "distilled"]
    assert distilled and all("on_policy are step settings it does not apply" in r["notes"] for r in distilled)
    assert all(r["notes"] is None for r in rows if r["quality_role"] != "distilled")
    assert all(r["notes"] is None for r in planned_rows(SMALL, quality_jobs([_job("jsd")])))


# --- a student of its own tokenizer: bits per byte across tokenizers --------------------------


def _own_job(method="uld", spec="bpe:300", teacher="bytes"):
    job = _job(method)
    tokenizers = TokenizersConfig(teacher=teacher, student=spec)
    return job.model_copy(update={"data": job.data.model_copy(update={"tokenizers": tokenizers})})


def test_bits_per_byte_of_a_byte_model_is_its_cross_entropy_in_bits_per_predicted_byte():
    from kdbench.quality.text import bits_per_byte

    d = load_text(QualityConfig(dataset="python-stdlib", seq_len=32, max_bytes=8_000))
    data = DeviceData(d.x_train, d.y_train, d.x_test, d.y_test, 256, torch.contiguous_format)
    counts = np.bincount(d.y_train.flatten().numpy(), minlength=256) + 1.0
    p = counts / counts.sum()
    _, _, loss = evaluate_text(
        CausalLM(Unigram(torch.tensor(p, dtype=torch.float32))), data, choose_autocast(CPU, "fp32"), CPU
    )
    y = d.y_test.flatten().numpy()
    hand = float(-np.log2(p[y]).sum()) / y.size  # every byte of a window but its first is predicted, once
    assert math.isclose(loss / math.log(2), hand, rel_tol=1e-5)
    assert math.isclose(bits_per_byte(loss), hand, rel_tol=1e-5)


class UnigramOver(nn.Module):
    """Next-token logits that ignore the input, over a vocabulary of any size."""

    def __init__(self, p: torch.Tensor):
        super().__init__()
        self.logp = nn.Parameter(p.log(), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logp.expand(*ids.shape, self.logp.numel())


def test_a_bpe_models_bits_per_byte_equals_a_hand_count_over_the_same_bytes():
    from kdbench.data.text import bpe_windows
    from kdbench.data.tokenizers import train_bpe

    # four windows of 8 + 1 bytes, a BPE of 300 entries trained on other text of the same kind
    text = b"def f(x):\n    return x + 1\n" * 3
    tok = train_bpe([b"def g(y):\n    return y + 2\n" * 20], 300)
    s = 8
    n = (len(text) - 1) // s
    x = torch.tensor(list(text[: n * s])).view(n, s)
    y = torch.tensor(list(text[1 : n * s + 1])).view(n, s)
    inputs, labels = bpe_windows(x, y, tok)
    assert inputs.shape == labels.shape and inputs.shape[0] == n
    for i in range(n):  # each window: its first byte read as one token, then exactly its S predicted bytes
        counted = labels[i][labels[i] != -100].tolist()
        assert tok.decode(inputs[i, :1].tolist()) == text[i * s : i * s + 1]
        assert tok.decode(counted) == text[i * s + 1 : (i + 1) * s + 1]
        assert inputs[i, 1 : len(counted)].tolist() == counted[:-1]  # the inputs are the labels shifted
    assert int((labels != -100).sum()) < n * s  # fewer tokens than bytes: merges happened
    # a fixed distribution over the 300 tokens: the hand count of bits over every predicted token / the bytes
    p = torch.softmax(torch.linspace(-2, 2, 300, dtype=torch.float64), 0)
    hand_bits = sum(-math.log2(float(p[t])) for i in range(n) for t in tok.encode(bytes(y[i].tolist())))
    hand = hand_bits / (n * s)
    data = DeviceData(inputs, labels, inputs, labels, 300, torch.contiguous_format)
    _, _, loss = evaluate_text(CausalLM(UnigramOver(p.float())), data, choose_autocast(CPU, "fp32"), CPU)
    tokens = int((labels != -100).sum())
    from kdbench.quality.text import bits_per_byte

    assert math.isclose(bits_per_byte(loss, tokens / (n * s)), hand, rel_tol=1e-5)


def test_the_students_bpe_is_trained_on_the_training_split_only(tmp_path, monkeypatch):
    from kdbench.data import text as data_text
    from kdbench.data import tokenizers
    from kdbench.quality import text as text_mod

    kept = _fake_stdlib(tmp_path)
    monkeypatch.setattr(data_text, "stdlib_root", lambda: tmp_path)
    seen = []

    def recording(texts, vocab_size, name=None):
        texts = list(texts)
        seen.extend(texts)
        return tokenizers.train_bpe(texts, vocab_size, name)

    monkeypatch.setattr(data_text, "train_bpe", recording)
    cfg = QualityConfig(dataset="python-stdlib", seq_len=16, test_fraction=0.4, epochs=1, seeds=1)
    run = text_mod.TextRun(cfg, CPU, False)
    tok, data, ratio = run.own_tokenized("bpe:300")
    train, test = split_files(stdlib_files(tmp_path), 0.4, seed=0)
    train_text = b"".join(kept[f] for f in train)
    n = (len(train_text) - 1) // 16
    assert seen == [train_text[: n * 16 + 1]]  # the training windows' bytes, up to the split's boundary
    for f in test:  # no held-out file is in it
        assert kept[f][:40] not in seen[0]
    assert data.num_classes == tok.vocab_size == 300 and 0 < ratio <= 1
    assert run.own_tokenized("bpe:300")[0] is tok  # once per run: one split serves every seed


ONE_EPOCH = SMALL.model_copy(update={"epochs": 1})


@pytest.fixture(scope="module")
def own_rows():
    jobs = quality_jobs([_job("forward_kl"), _own_job()])
    with log_lines() as log:
        rows = run_quality(ONE_EPOCH, jobs, CPU)
    return rows, log, jobs


@pytest.mark.slow
def test_a_student_of_its_own_tokenizer_trains_from_scratch_and_by_uld_in_bits_per_byte(own_rows):
    rows, log, jobs = own_rows
    planned = planned_rows(ONE_EPOCH, jobs)
    assert [(r["seed"], r["quality_role"], r["method"], r["tokenizer"]) for r in planned] == [
        (s, role, m, tok)
        for s in (0, 1)
        for role, m, tok in (
            ("teacher", None, "bytes"),
            ("scratch", None, "bytes"),
            ("scratch", None, "bpe:300"),
            ("distilled", "forward_kl", "bytes"),
            ("distilled", "uld", "bpe:300"),
        )
    ]
    assert [(r["seed"], r["quality_role"], r["method"]) for r in rows] == [
        (r["seed"], r["quality_role"], r["method"]) for r in planned
    ]
    own = [r for r in rows if r["tokenizer"] != "bytes"]
    assert len(own) == 4
    for r in rows:
        assert r["status"] == "ok", r["error"]
        assert math.isfinite(r["bits_per_byte"]) and 0 < r["bits_per_byte"] < 8  # below uniform over the bytes
    for r in own:
        spec, digest = r["tokenizer"].split(" ")
        assert spec == "bpe:300" and len(digest) == 12
        assert r["accuracy"] is None and r["agreement"] is None and "compare bits_per_byte" in r["notes"]
        assert r["notes"].startswith("built with vocab_size 300, its tokenizer's, over the overrides; ")
        assert r["quality_test_tokens"] < (4_000 - 1) // 32 * 32  # fewer tokens than held-out bytes predicted
        # bits per byte = the mean nats per token x tokens / bytes, in bits: not log2 of the per-token perplexity
        ratio = r["quality_test_tokens"] / ((4_000 - 1) // 32 * 32)
        assert math.isclose(r["bits_per_byte"], math.log2(r["perplexity"]) * ratio, rel_tol=1e-9)
    for r in rows:
        if r["tokenizer"] == "bytes":
            assert math.isclose(r["bits_per_byte"], math.log2(r["perplexity"]))
    for seed in (0, 1):  # distilled by uld from the byte teacher: not the scratch student
        scratch, uld = (
            next(r for r in own if r["seed"] == seed and r["quality_role"] == role) for role in ("scratch", "distilled")
        )
        assert uld["method"] == "uld" and uld["bits_per_byte"] != scratch["bits_per_byte"]
        assert uld["perplexity_by_epoch"] != scratch["perplexity_by_epoch"]
    assert len({r["tokenizer"] for r in own}) == 1  # one tokenizer for every seed
    assert any("distilled uld tiny-llama-teacher->tiny-llama-student (bpe:300):" in line for line in log)

    summary = summarize_quality(pd.DataFrame(rows))
    assert list(summary["tokenizer"]) == ["bytes", "bytes", "bpe:300", "bytes", "bpe:300"]
    assert list(summary["n"]) == [2] * 5
    uld = summary[summary["method"] == "uld (position)"].iloc[0]  # the authors' alignment, named
    bits = [r["bits_per_byte"] for r in own if r["method"] == "uld"]
    assert math.isclose(uld["bits_per_byte_mean"], np.mean(bits)) and math.isclose(
        uld["bits_per_byte_std"], np.std(bits, ddof=1)
    )
    table = markdown_table(summary)
    assert table.splitlines()[0].startswith(
        "| teacher | student | model | method | tokenizer | bits/byte | perplexity (per token) | next-token top-1 (%) |"
    )
    bits_text = f"{uld['bits_per_byte_mean']:.3f} ± {uld['bits_per_byte_std']:.3f}"
    assert f"| distilled | uld (position) | bpe:300 | {bits_text} |" in table


def test_a_student_of_its_own_tokenizer_is_no_draft(tmp_path):
    from kdbench.config.schema import SpeculativeConfig
    from kdbench.quality.protocol import Entry
    from kdbench.quality.text import TextRun
    from kdbench.quality.train import Trained

    cfg = SMALL.model_copy(update={"speculative": SpeculativeConfig(draft_tokens=[2])})
    row = Entry(0, "distilled", _own_job()).row(cfg)
    assert row["tokenizer"] == "bpe:300" and "draft_alpha" in row
    student = Trained([(1.0, 0.1), (2.0, 0.2)], torch.zeros(3), model=nn.Linear(1, 1), test_losses=[3.0, 2.0])
    student.tokens_per_byte = 0.5
    teacher = Trained([(1.0, 0.3)], torch.zeros(3), model=nn.Linear(1, 1), test_losses=[1.0])
    out = TextRun(cfg, CPU, False).fill(row, student, teacher)
    assert math.isclose(out["bits_per_byte"], 2.0 * 0.5 / math.log(2))  # nats per token x tokens per byte, in bits
    assert math.isclose(out["perplexity"], math.exp(2.0))  # per token
    assert out["draft_alpha"] is None and student.model is None
    assert "draft figures not measured: speculative decoding verifies the draft's tokens" in out["notes"]
    # time to quality in bits per byte: 1.443 bits at epoch 2 against the teacher's 1.443 + log2(1 / 0.8)
    assert (out["time_to_target_s"], out["epochs_to_target"]) == (2.0, 2)


def test_a_student_of_its_own_tokenizer_is_checked_before_anything_runs():
    from kdbench.quality.protocol import check_quality

    check_quality(SMALL, [_own_job()])
    with pytest.raises(KdbenchError, match="the text protocol's teacher is byte-level"):
        check_quality(SMALL, [_own_job(teacher="bpe:300")])
    with pytest.raises(KdbenchError, match="a student with its own tokenizer .bpe:300. is distilled by uld"):
        check_quality(SMALL, [_own_job("forward_kl")])
    with pytest.raises(KdbenchError, match="trains the student's BPE on its own training split"):
        check_quality(SMALL, [_own_job(spec="tests/tok.json")])
