"""The text protocol's BPE student distilled by ULD aligned both ways (issue 45 item 4): by position (the authors')
and by bytes, two distillations per seed with their own rows, the pairs of the windows by the text read, and the
bits-per-byte table naming each."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from kdbench.quality.own_tokens import paired_share, window_alignment
from kdbench.quality.protocol import planned_rows, quality_jobs, run_quality
from kdbench.quality.text import TextRun
from kdbench.report.summaries import markdown_table, summarize_quality
from tests.unit.quality.test_quality_text import CPU, SMALL, _own_job

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _aligned_job(alignment: str):
    job = _own_job()
    return job.model_copy(update={"uld": job.uld.model_copy(update={"alignment": alignment})})


def test_the_windows_pair_each_student_position_with_the_teachers_of_the_same_bytes_read():
    run = TextRun(SMALL, CPU, False)
    tokenizer, data, _ = run.own_tokenized("bpe:300")
    text = run.byte_data()
    x, y, x_t, y_t = data.x_train[:6], data.y_train[:6], text.x_train[:6], text.y_train[:6]
    align = run.aligned("bytes", "bpe:300", x, y, x_t, y_t)
    assert run.aligned("position", "bpe:300", x, y, x_t, y_t) is None  # the loss pairs by position itself
    assert len(align) == int((y != -100).sum())  # a byte teacher has a position at every BPE boundary
    s_w, t_w = x.shape[1], x_t.shape[1]
    lagging = 0
    for s, t in zip(align.student.tolist(), align.teacher.tolist()):
        b, i, j = s // s_w, s % s_w, t % t_w
        assert t // t_w == b
        assert tokenizer.decode(x[b, : i + 1].tolist()) == bytes(x_t[b, : j + 1].tolist())  # the same text read
        lagging += j != i
    assert lagging > len(align) // 2  # by position, most would have read other text
    lengths = run.byte_lengths("bpe:300")
    assert paired_share("bytes", lengths, x, y, x_t, y_t) == 1.0 == paired_share("position", lengths, x, y, x_t, y_t)
    assert window_alignment("position", lengths, x, y, x_t, y_t) is None


def test_the_two_alignments_are_two_distillations_with_their_own_rows():
    jobs = quality_jobs([_aligned_job("position"), _aligned_job("bytes"), _aligned_job("bytes")])
    assert [j.uld.alignment for j in jobs] == ["position", "bytes"]
    rows = planned_rows(SMALL.model_copy(update={"seeds": 1}), jobs)
    assert [(r["quality_role"], r["tokenizer"], r["uld_alignment"]) for r in rows] == [
        ("teacher", "bytes", None),
        ("scratch", "bpe:300", None),
        ("distilled", "bpe:300", "position"),
        ("distilled", "bpe:300", "bytes"),
    ]


@pytest.mark.slow
def test_both_alignments_train_and_the_table_names_each():
    cfg = SMALL.model_copy(update={"epochs": 1})
    jobs = quality_jobs([_aligned_job("position"), _aligned_job("bytes")])
    rows = run_quality(cfg, jobs, CPU)
    assert all(r["status"] == "ok" for r in rows), [r["error"] for r in rows]
    distilled = [r for r in rows if r["quality_role"] == "distilled"]
    assert [(r["seed"], r["uld_alignment"]) for r in distilled] == [
        (0, "position"),
        (0, "bytes"),
        (1, "position"),
        (1, "bytes"),
    ]
    for r in distilled:
        assert r["uld_matched"] == 1.0 and math.isfinite(r["bits_per_byte"])
    for seed in (0, 1):  # another pairing, another student
        position, by_bytes = (r for r in distilled if r["seed"] == seed)
        assert position["perplexity_by_epoch"] != by_bytes["perplexity_by_epoch"]
    summary = summarize_quality(pd.DataFrame(rows))
    assert list(summary["method"].fillna("–")) == ["–", "–", "uld (bytes)", "uld (position)"]
    table = markdown_table(summary)
    for alignment in ("position", "bytes"):
        bits = [r["bits_per_byte"] for r in distilled if r["uld_alignment"] == alignment]
        mean, std = sum(bits) / 2, float(torch.tensor(bits).std())
        assert f"| distilled | uld ({alignment}) | bpe:300 | {mean:.3f} ± {std:.3f} |" in table
