"""quality-text's offline-teacher students: each encoding is its own distillation, trained from a store of the
seed's teacher over the training windows, read each step; the store is gone once the student is trained."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pandas as pd
import pytest

from kdbench.config.schema import TeacherConfig
from kdbench.quality.protocol import quality_jobs, run_quality
from tests.unit.quality.test_quality_text import CPU, SMALL, _job

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _offline(values: str):
    job = _job("forward_kl")
    return job.model_copy(update={"teacher": TeacherConfig(mode="offline", k=16, values=values, indices="int16")})


def test_offline_students_train_from_their_store_one_per_encoding(monkeypatch):
    from kdbench.quality.offline import OfflineBatches

    read, encodings = [], []
    batch = OfflineBatches.batch

    def spy(self, indices):
        read.append(len(indices)), encodings.append(self.store.encoding.values)
        return batch(self, indices)

    monkeypatch.setattr(OfflineBatches, "batch", spy)
    jobs = quality_jobs([_job("forward_kl"), _offline("fp16"), _offline("int8"), _offline("int8")])
    assert len(jobs) == 3  # live, fp16, int8: the second int8 is the same distillation
    before = set(Path(tempfile.gettempdir()).glob("kdbench-quality-store-*"))
    rows = run_quality(SMALL.model_copy(update={"seeds": 1}), jobs, CPU)
    distilled = [r for r in rows if r["quality_role"] == "distilled"]
    assert len(distilled) == 3 and all(r["status"] == "ok" for r in distilled), [r["error"] for r in rows]
    bpb = [r["bits_per_byte"] for r in distilled]
    assert all(math.isfinite(b) and 0 < b < 8 for b in bpb)
    assert len(set(bpb)) == 3  # three trainings: the live teacher's, and the two stores'
    assert all(r["notes"] is None or "teacher.mode" not in r["notes"] for r in distilled)
    assert set(Path(tempfile.gettempdir()).glob("kdbench-quality-store-*")) == before  # the stores deleted
    assert set(encodings) == {"fp16", "int8"} and set(read) == {SMALL.batch_size}  # each step read its batch
    assert [r.get("teacher_store_encoding") for r in distilled] == [None, "k16 fp16 int16 none", "k16 int8 int16 none"]
    from kdbench.report.summaries import summarize_quality

    table = summarize_quality(pd.DataFrame(rows))
    methods = table.loc[table["quality_role"] == "distilled", "method"].tolist()
    assert methods == [
        "forward_kl",
        "forward_kl (offline k16 fp16 int16 none)",
        "forward_kl (offline k16 int8 int16 none)",
    ]
