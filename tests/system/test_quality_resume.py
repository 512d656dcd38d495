"""A quality job talks while it trains, keeps each model as it finishes, and a resume does not train it again;
a run is not continued at another thread count."""

import math

import pytest
import torch
from torch import nn

from kdbench.cli import main
from kdbench.quality import progress
from kdbench.quality.checkpoints import CHECKPOINTS_DIR, Checkpoints
from kdbench.quality.text import TextRun
from kdbench.store import read_results
from kdbench.store.results import open_run
from tests.support.helpers import run_folder, write_suite
from tests.support.suites import tiny_suite

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TEACHER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
STUDENT = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 1}
QUALITY = {
    "dataset": "python-stdlib",
    "epochs": 2,
    "seeds": 1,
    "batch_size": 16,
    "optimizer": "adamw",
    "lr": 3e-3,
    "weight_decay": 0.0,
    "max_bytes": 8_000,  # 6,000 train bytes (a quarter held out): 187 windows of 32, 11 steps of 16 an epoch
    "seq_len": 32,
    "target": 0.8,
    # each student as its teacher's draft, measured once trained (or once taken from its checkpoint)
    "speculative": {"draft_tokens": [2], "prompts": 1, "prompt_tokens": 8, "new_tokens": 6, "repeats": 1},
}
STEPS = 11


def _suite(path):
    suite = tiny_suite(
        name="qtalk",
        defaults={
            "pair": {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
            "overrides": {"teacher": {**TEACHER, "vocab_size": 256}, "student": {**STUDENT, "vocab_size": 256}},
            "data": {"kind": "tokens", "seq_len": 16},
            "batch_size": 2,
            "timing": {"min_iters": 2},
            "inference": {"batch_sizes": []},
        },
        matrix={"method": ["forward_kl"]},
        quality=QUALITY,
    )
    return write_suite(path, **suite)


class FakeClock:
    """Ten seconds pass at every reading."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 10.0
        return self.now


def _quality_rows(df):
    """The quality rows' results, comparable across runs (no times, no notes)."""
    keep = ["quality_role", "method", "status", "accuracy", "perplexity", "best_perplexity", "agreement"]
    q = df[df["measurement"] == "quality"].sort_values(["quality_role", "method"], na_position="first")
    rows = q[[*keep, "perplexity_by_epoch", "epochs_to_target"]].to_dict("records")
    return [{k: _plain(v) for k, v in r.items()} for r in rows]


def _plain(value):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return [float(v) for v in value] if hasattr(value, "__len__") and not isinstance(value, str) else value


def test_the_quality_job_talks_keeps_each_model_and_a_resume_does_not_train_it_again(tmp_path, monkeypatch, capsys):
    suite, out = _suite(tmp_path / "q.yaml"), tmp_path / "res"
    monkeypatch.setattr(progress, "clock", FakeClock())
    trained = []  # the models fit() trained, by the progress line's name of them
    real_fit, real_save = TextRun.fit, Checkpoints.save

    def counting_fit(self, *args, **kwargs):
        trained.append(self.talk.what)
        return real_fit(self, *args, **kwargs)

    def save_then_stop(self, *args, **kwargs):  # Ctrl-C right after the first model is stored
        real_save(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(TextRun, "fit", counting_fit)
    monkeypatch.setattr(Checkpoints, "save", save_then_stop)
    argv = ["run", str(suite), "--out", str(out), "--inline", "--no-report"]
    assert main(argv) == 130
    log = capsys.readouterr().out.splitlines()  # the run's output, where its log lines go
    run = run_folder(out)
    assert trained == ["seed 0: teacher tiny-llama-teacher"]
    kept = list((run.path / CHECKPOINTS_DIR).glob("quality-*/seed0-teacher-*.pt"))
    assert len(kept) == 1 and len(run.parts()) == 1  # the teacher's checkpoint; only the cell's part is stored

    # It spoke before reading any data or training any step, then every 30 s of its (fake) clock: every 3rd step.
    talk = [line for line in log if line.startswith(("quality:", "quality ["))]
    assert talk[0].startswith("quality: 3 models to train, 1 seed(s), 2 epochs each on python-stdlib; each kept")
    assert talk[1] == f"quality [1/3] seed 0: teacher tiny-llama-teacher: training 2 epochs x {STEPS} steps"
    steps = [line.split(": ", 2)[2] for line in talk[2:]]
    assert [s.split(", loss")[0] for s in steps] == [
        f"epoch {e}/2, step {s}/{STEPS}" for e, s in [(1, 3), (1, 6), (1, 9), (2, 1), (2, 4), (2, 7), (2, 10)]
    ]
    assert "30s on this model, ~3m10s left of it; 1m00s in the quality job" in steps[0]  # 10 s a reading
    assert all(math.isfinite(float(s.split("loss ")[1].split(";")[0])) for s in steps)
    # the interrupted invocation's wall time: the quality job's training counted to quality, as it went
    assert run.invocations()[-1]["wall_time"]["quality"] > 0

    # Resumed: the teacher comes from its checkpoint, not trained again; its row says so.
    trained.clear()
    monkeypatch.setattr(Checkpoints, "save", real_save)
    assert main([*argv, "--resume"]) == 0
    log = capsys.readouterr().out.splitlines()
    assert trained == [
        "seed 0: scratch tiny-llama-student",
        "seed 0: distilled forward_kl tiny-llama-teacher->tiny-llama-student",
    ]
    assert any("quality [1/3] seed 0: teacher tiny-llama-teacher: taken from its checkpoint" in line for line in log)
    summary = "quality (python-stdlib, 1 seed): 3 quality rows, 1 of them from the models an earlier invocation kept"
    assert any(summary in line for line in log)
    assert "1 of the 3 rows come from models an earlier invocation of the run trained and kept" in "\n".join(log)
    df = read_results([run.path])
    q = df[df["measurement"] == "quality"].set_index("quality_role")
    assert q.loc["teacher", "notes"].startswith("reused: trained by an earlier invocation of this run")
    assert not isinstance(q.loc["scratch", "notes"], str)  # trained in this invocation: nothing to say
    for role in ("scratch", "distilled"):  # measured as drafts of the teacher rebuilt from its checkpoint
        assert list(q.loc[role, "draft_gammas"]) == [2] and 0 <= q.loc[role, "draft_alpha"][0] <= 1
    assert q.loc["teacher", "draft_alpha"] is None
    assert "The students as drafts of their seed's teacher in speculative decoding" in "\n".join(log)
    assert len(list((run.path / CHECKPOINTS_DIR).glob("quality-*/*.pt"))) == 3

    # The rows equal an uninterrupted run's (the same plan's quality job, trained at once, without checkpoints).
    from kdbench import api
    from kdbench.hw.backends import resolve
    from kdbench.quality.protocol import run_quality

    job = api.plan(api.load_suite(suite)).jobs[-1]
    fresh = run_quality(job.quality, list(job.configs), resolve("cpu"))
    from tests.support.helpers import as_read

    assert _quality_rows(df) == _quality_rows(as_read(fresh))


def test_a_checkpoint_trained_with_other_settings_is_not_reused(tmp_path):
    store = Checkpoints(tmp_path)
    path = store.path(0, "teacher", "resnet8")
    model = nn.Linear(2, 2)
    record = {"history": [[1.5, 0.5]], "test_losses": [], "preds": torch.tensor([1, 0])}
    identity = {"format": 1, "threads": 2, "data": "ab" * 32, "cell": {"seed": 0}}
    store.save(path, identity, record, model)
    stored, why = store.load(path, identity)
    assert why is None and stored.record["history"] == [[1.5, 0.5]]
    assert torch.equal(stored.state_dict["weight"], model.weight.detach())
    assert store.load(store.path(1, "teacher", "resnet8"), identity) == (None, None)  # nothing kept for seed 1
    _, why = store.load(path, identity | {"threads": 1, "cell": {"seed": 1}})
    assert f"its checkpoint {path.name}" in why and "(cell: other settings; threads 2, now 1)" in why
    path.write_bytes(b"not a checkpoint")
    assert "is unreadable" in store.load(path, identity)[1]


def test_a_run_is_not_continued_at_another_thread_count(tmp_path, capsys):
    suite, out = _suite(tmp_path / "q.yaml"), tmp_path / "res"
    folder = open_run(out, "qtalk", str(suite), "r1")
    folder.start_invocation(["a"], ["a"], threads=2).finish(stored=["a"])
    folder.start_invocation(["a"], ["a"], threads=3).finish(stored=[])  # stored nothing: does not count
    assert main(["run", str(suite), "--out", str(out), "--run-id", "r1", "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kdbench: error: --threads 1: run r1 in ")
    assert "measured at 2 CPU threads" in err[0] and "continue it with --threads 2" in err[0]
    assert len(folder.invocations()) == 2  # refused before this invocation began


@pytest.mark.slow
def test_a_student_of_its_own_tokenizer_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """Its BPE is trained again, deterministically, on the same training split: the same tokens, so the same data
    digest in the identity, and its checkpoints (scratch and uld) are reused, rows and all."""
    from kdbench.config.quality import QualityConfig
    from kdbench.config.schema import TokenizersConfig
    from kdbench.hw.backends import resolve
    from kdbench.quality.protocol import quality_jobs, run_quality
    from tests.support.helpers import make_config

    cfg = QualityConfig(**{**QUALITY, "epochs": 1})
    data = {"kind": "tokens", "seq_len": 16, "tokenizers": TokenizersConfig(student="bpe:300")}
    job = make_config(
        method="uld",
        pair={"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
        overrides={"teacher": TEACHER, "student": STUDENT},
        data=data,
        inference={"batch_sizes": []},
    )
    jobs, cpu, folder = quality_jobs([job]), resolve("cpu"), tmp_path / "kept"
    first = run_quality(cfg, jobs, cpu, checkpoints=folder)
    assert [(r["quality_role"], r["tokenizer"].split(" ")[0], r["status"]) for r in first] == [
        ("teacher", "bytes", "ok"),
        ("scratch", "bpe:300", "ok"),
        ("distilled", "bpe:300", "ok"),
    ]
    assert len(list(folder.glob("*.pt"))) == 3
    trained = []
    real_fit = TextRun.fit

    def counting_fit(self, *args, **kwargs):
        trained.append(self.talk.what)
        return real_fit(self, *args, **kwargs)

    monkeypatch.setattr(TextRun, "fit", counting_fit)
    again = run_quality(cfg, jobs, cpu, checkpoints=folder)
    assert trained == []  # nothing trained again
    for a, b in zip(first, again):
        assert b["notes"] is not None and "reused: trained by an earlier invocation" in b["notes"]
        for key in ("tokenizer", "bits_per_byte", "perplexity", "perplexity_by_epoch", "quality_test_tokens"):
            assert a[key] == b[key], key
    assert "draft figures not measured: speculative decoding verifies" in again[2]["notes"]
