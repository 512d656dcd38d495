"""Quality runs: real data (scikit-learn's digits, images on disk), real training, the summary table."""

import math

import numpy as np
import pandas as pd
import pytest
import torch
from pydantic import ValidationError

from kdbench.config.quality import QualityConfig
from kdbench.core.errors import KdbenchError
from kdbench.data.datasets import load_dataset
from kdbench.distill.losses import dkd as dkd_method
from kdbench.hw.backends import resolve
from kdbench.quality.protocol import ROW_KEYS, planned_rows, quality_jobs, run_quality
from kdbench.report.summaries import markdown_table, summarize_quality
from tests.support.helpers import log_lines, make_config, write_suite
from tests.support.paths import SUPPORT
from tests.support.suites import merged, tiny_suite

CPU = resolve("cpu")
SHAPE = [1, 8, 8]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _job(method, teacher="resnet8", student="resnet8", shape=SHAPE):
    # The cell says 100 classes; the quality run must use the data set's 10.
    return make_config(
        method=method,
        pair={"teacher": teacher, "student": student},
        data={"shape": shape, "num_classes": 100},
        pad_to=8,
        teacher={"mode": "cached"},
    )


# --- configuration ---------------------------------------------------------------------------


def test_config_defaults_and_root_rules():
    cfg = QualityConfig()
    assert (cfg.dataset, cfg.epochs, cfg.seeds, cfg.target, cfg.batch_size, cfg.optimizer) == (
        "digits",
        20,
        3,
        0.95,
        64,
        "sgd",
    )
    opt = cfg.optimizer_config()
    assert (opt.name, opt.lr, opt.weight_decay, opt.momentum) == ("sgd", 0.05, 5e-4, 0.9)
    for dataset in ("imagefolder", "cifar10", "cifar100"):
        with pytest.raises(ValidationError, match=f"quality.root is required for dataset {dataset}"):
            QualityConfig(dataset=dataset)
    with pytest.raises(ValidationError, match="quality.root is only for"):
        QualityConfig(root="/data")
    for bad in ({"target": 0.0}, {"target": 1.5}, {"epochs": 0}, {"seeds": 101}, {"tets_fraction": 0.2}):
        with pytest.raises(ValidationError):
            QualityConfig(**bad)


def test_quality_jobs_one_per_pair_and_method():
    configs = [make_config(method=m, batch_size=b) for m in ("kd", "dkd") for b in (4, 8)]
    jobs = quality_jobs(configs)
    assert [(j.method, j.batch_size) for j in jobs] == [("kd", 4), ("dkd", 4)]


def test_planned_rows_are_the_rows_a_run_produces(two_methods):
    rows, _ = two_methods
    planned = planned_rows(RUN, [_job("kd"), _job("dkd")])
    keys = ("quality_role", "teacher", "student", "method", "seed", "batch_size", "precision", "quality_dataset")
    assert [tuple(r[k] for k in keys) for r in planned] == [tuple(r[k] for k in keys) for r in rows]
    assert all(r["accuracy"] is None and tuple(r) == ROW_KEYS for r in planned)


# --- data -----------------------------------------------------------------------------------


def test_digits_split_sizes_stratified_and_values():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_dataset(QualityConfig(), SHAPE)
    assert d.num_classes == 10
    assert d.x_train.shape == (1347, 1, 8, 8) and d.x_test.shape == (450, 1, 8, 8)
    assert d.x_train.dtype == torch.float32 and d.y_train.dtype == torch.int64
    digits = load_digits()
    per_class = np.bincount(digits.target)
    expected = per_class * 450 / 1797
    assert np.all(np.abs(np.bincount(d.y_test.numpy(), minlength=10) - expected) <= 1)
    assert np.array_equal(np.bincount(d.y_train.numpy()) + np.bincount(d.y_test.numpy()), per_class)
    # The values: pixels / 16, standardised with the train split's mean and std.
    train, test = train_test_split(np.arange(1797), test_size=0.25, stratify=digits.target, random_state=0)
    train, test = np.sort(train), np.sort(test)
    raw = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16
    mean, std = raw[train].mean(), raw[train].std(unbiased=False)
    torch.testing.assert_close(d.x_test, (raw[test] - mean) / std)
    assert torch.equal(d.y_test, torch.from_numpy(digits.target[test]).long())


def test_digits_resized_replicated_standardised_and_deterministic():
    cfg = QualityConfig()
    d = load_dataset(cfg, [3, 16, 12])
    assert d.x_train.shape == (1347, 3, 16, 12) and d.x_test.shape == (450, 3, 16, 12)
    torch.testing.assert_close(d.x_train.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-4, rtol=0)
    torch.testing.assert_close(d.x_train.std(dim=(0, 2, 3), unbiased=False), torch.ones(3), atol=1e-4, rtol=0)
    assert torch.equal(d.x_train[:, 0], d.x_train[:, 2])  # grey replicated
    again = load_dataset(cfg, [3, 16, 12])
    assert all(torch.equal(a, b) for a, b in zip(d[:4], again[:4]))
    # max_samples caps the total, and the split stays stratified
    small = load_dataset(QualityConfig(max_samples=200), SHAPE)
    assert len(small.y_train) + len(small.y_test) == 200 and len(small.y_test) == 50
    assert set(small.y_test.tolist()) == set(range(10))


def test_non_image_shape_is_a_user_error():
    with pytest.raises(KdbenchError, match=r"data.shape must be \[C, H, W\]"):
        load_dataset(QualityConfig(), [64])


def _write_images(folder, classes=("cat", "dog"), per_class=4, mode="RGB"):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in classes:
        (folder / c).mkdir(parents=True)
        for i in range(per_class):
            size = (5 + i, 7)  # different sizes: Resize makes them one
            channels = 3 if mode == "RGB" else 1
            pixels = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
            Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode).save(folder / c / f"{i}.png")


def test_imagefolder_flat_layout_is_split_stratified(tmp_path):
    _write_images(tmp_path)
    d = load_dataset(QualityConfig(dataset="imagefolder", root=str(tmp_path)), [3, 8, 8])
    assert d.num_classes == 2
    assert d.x_train.shape == (6, 3, 8, 8) and d.x_test.shape == (2, 3, 8, 8)
    assert sorted(d.y_test.tolist()) == [0, 1] and sorted(d.y_train.tolist()) == [0, 0, 0, 1, 1, 1]
    torch.testing.assert_close(d.x_train.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-4, rtol=0)


def test_imagefolder_train_val_layout_and_grey(tmp_path):
    _write_images(tmp_path / "train", per_class=3, mode="L")
    _write_images(tmp_path / "val", per_class=1)
    d = load_dataset(QualityConfig(dataset="imagefolder", root=str(tmp_path)), [1, 8, 8])
    assert d.x_train.shape == (6, 1, 8, 8) and d.x_test.shape == (2, 1, 8, 8) and d.num_classes == 2
    assert d.y_test.tolist() == [0, 1]


def test_disk_datasets_explain_a_wrong_root(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(KdbenchError, match="quality.root: .*nowhere is not a folder"):
        load_dataset(QualityConfig(dataset="imagefolder", root=str(missing)), [3, 8, 8])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(KdbenchError, match="quality.root: .*class folder"):
        load_dataset(QualityConfig(dataset="imagefolder", root=str(empty)), [3, 8, 8])
    _write_images(tmp_path / "half" / "train")
    with pytest.raises(KdbenchError, match="quality.root: .*has train/ but no val/"):
        load_dataset(QualityConfig(dataset="imagefolder", root=str(tmp_path / "half")), [3, 8, 8])
    for dataset, folder in (("cifar10", "cifar-10-batches-py"), ("cifar100", "cifar-100-python")):
        with pytest.raises(KdbenchError, match=f"quality.root: no CIFAR.*{folder}") as err:
            load_dataset(QualityConfig(dataset=dataset, root=str(empty)), [3, 8, 8])
        assert "\n" not in str(err.value) and "download" in str(err.value)
    # root set to the extracted folder itself: point at its parent
    (tmp_path / "cifar-10-batches-py").mkdir()
    with pytest.raises(KdbenchError, match="parent folder"):
        load_dataset(QualityConfig(dataset="cifar10", root=str(tmp_path / "cifar-10-batches-py")), [3, 8, 8])


def test_unreadable_image_is_named(tmp_path):
    _write_images(tmp_path)
    (tmp_path / "dog" / "broken.png").write_bytes(b"not a png")
    with pytest.raises(KdbenchError, match="quality.root: cannot read .*broken.png"):
        load_dataset(QualityConfig(dataset="imagefolder", root=str(tmp_path)), [3, 8, 8])


# --- the protocol ---------------------------------------------------------------------------

RUN = QualityConfig(epochs=3, seeds=2)


@pytest.fixture(scope="module")
def two_methods():
    with log_lines() as log:
        rows = run_quality(RUN, [_job("kd"), _job("dkd")], CPU)
    return rows, log


def test_rows_one_per_model_and_seed(two_methods):
    rows, _ = two_methods
    assert len(rows) == 2 * (1 + 1 + 2)
    assert all(tuple(r) == ROW_KEYS for r in rows)
    assert all(r["status"] == "ok" and r["error"] is None for r in rows), [r["error"] for r in rows]
    roles = [(r["seed"], r["quality_role"], r["method"]) for r in rows]
    assert roles == [
        (s, role, m)
        for s in (0, 1)
        for role, m in (("teacher", None), ("scratch", None), ("distilled", "kd"), ("distilled", "dkd"))
    ]
    for r in rows:
        assert r["measurement"] == "quality" and r["quality_dataset"] == "digits"
        assert (r["quality_epochs"], r["quality_target"], r["batch_size"], r["precision"]) == (3, 0.95, 64, "fp32")
        assert r["teacher"] == "resnet8"
        assert r["student"] == (None if r["quality_role"] == "teacher" else "resnet8")


def test_teacher_trains_once_per_seed(two_methods):
    _, log = two_methods
    done = [line for line in log if line.startswith("  quality seed ")]  # a trained model's result line
    teacher_lines = [line for line in done if ": teacher resnet8:" in line]
    assert len(teacher_lines) == 2  # two jobs share it
    assert len([line for line in done if ": scratch resnet8:" in line]) == 2
    assert len([line for line in done if ": distilled " in line]) == 4
    # and each started with its progress line: which model of the plan's 2 x 4, the epochs and steps
    started = [line for line in log if line.startswith("quality [") and line.endswith(" steps")]
    assert started[0] == "quality [1/8] seed 0: teacher resnet8: training 3 epochs x 21 steps"
    assert [line.split("]")[0] for line in started] == [f"quality [{i}/8" for i in range(1, 9)]


def test_accuracies_agreement_and_time_to_target(two_methods):
    rows, _ = two_methods
    for r in rows:
        assert 0 <= r["accuracy"] <= r["best_accuracy"] <= 1
        assert r["train_time_s"] > 0
        if r["time_to_target_s"] is not None:
            assert 0 < r["time_to_target_s"] <= r["train_time_s"]
            assert 1 <= r["epochs_to_target"] <= 3
        else:
            assert r["epochs_to_target"] is None
        if r["quality_role"] == "teacher":
            assert r["agreement"] is None
            assert r["accuracy"] > 0.8  # digits: ~97 % after 3 epochs; chance is 10 %
            assert r["time_to_target_s"] is not None  # its own final accuracy, reached by the last epoch
        else:
            assert 0 <= r["agreement"] <= 1
            assert r["accuracy"] > 0.5
    # seeds differ
    teachers = [r for r in rows if r["quality_role"] == "teacher"]
    assert teachers[0]["train_time_s"] != teachers[1]["train_time_s"]


def test_same_seed_gives_identical_results(two_methods):
    rows, _ = two_methods
    again = run_quality(QualityConfig(epochs=3, seeds=1), [_job("kd")], CPU)
    first = [r for r in rows if r["seed"] == 0 and r["method"] in (None, "kd")]
    assert [r["quality_role"] for r in again] == [r["quality_role"] for r in first]
    for a, b in zip(again, first):
        for key in ("accuracy", "best_accuracy", "agreement", "epochs_to_target"):
            assert a[key] == b[key], (a["quality_role"], key)


def test_a_failing_method_fails_only_its_row(monkeypatch):
    def boom(self, inp):
        raise RuntimeError("dkd exploded\nsecond line")

    monkeypatch.setattr(dkd_method.DKD, "forward", boom)
    cfg = QualityConfig(epochs=1, seeds=1)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    with log_lines() as log:
        rows = run_quality(cfg, [_job("kd"), _job("dkd"), _job("kd", teacher="no_such_model")], CPU)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random state is untouched
    by = {(r["teacher"], r["quality_role"], r["method"]): r for r in rows}
    assert len(rows) == 2 + 2 + 3  # two teachers, a scratch row per pair, three distillations
    failed = by[("resnet8", "distilled", "dkd")]
    assert failed["status"] == "failed" and failed["error"] == "RuntimeError: dkd exploded"
    assert failed["accuracy"] is None
    assert by[("resnet8", "distilled", "kd")]["status"] == "ok"
    assert by[("resnet8", "teacher", None)]["status"] == "ok"
    # a teacher that cannot be built: its row and its distillation fail, its scratch row has no reference
    bad_teacher = by[("no_such_model", "teacher", None)]
    assert bad_teacher["status"] == "failed" and "unknown model 'no_such_model'" in bad_teacher["error"]
    assert by[("no_such_model", "distilled", "kd")]["status"] == "failed"
    assert by[("no_such_model", "distilled", "kd")]["error"].startswith("the teacher failed to train")
    scratch = by[("no_such_model", "scratch", None)]
    assert scratch["status"] == "ok" and scratch["agreement"] is None and scratch["time_to_target_s"] is None
    assert scratch["accuracy"] == by[("resnet8", "scratch", None)]["accuracy"]  # one scratch training
    assert any("FAILED" in line for line in log)


def test_summary_of_real_rows(two_methods):
    rows, _ = two_methods
    summary = summarize_quality(pd.DataFrame(rows))
    assert list(summary["quality_role"]) == ["teacher", "scratch", "distilled", "distilled"]
    assert list(summary["method"].fillna("-")) == ["-", "-", "dkd", "kd"]
    assert list(summary["n"]) == [2, 2, 2, 2]


# --- the summary ------------------------------------------------------------------------------


def _hand_rows():
    def row(role, method, seed, acc, agr, ttt, status="ok", student="s"):
        return {
            "measurement": "quality",
            "status": status,
            "quality_role": role,
            "teacher": "t",
            "student": None if role == "teacher" else student,
            "method": method,
            "seed": seed,
            "accuracy": acc,
            "best_accuracy": acc,
            "agreement": agr,
            "time_to_target_s": ttt,
            "epochs_to_target": None if ttt is None else 2,
            "train_time_s": 10.0,
        }

    rows = [
        row("distilled", "kd", 0, 0.86, 0.90, 4.0),
        row("distilled", "kd", 1, 0.88, 0.92, 5.0),
        row("distilled", "kd", 2, None, None, None, status="failed"),
        row("distilled", "at", 0, 0.85, 0.91, None),
        row("scratch", None, 0, 0.80, 0.85, 1.0),
        row("scratch", None, 1, 0.82, 0.86, None),
        row("scratch", None, 2, 0.85, 0.88, 3.0),
    ]
    rows += [row("teacher", None, s, a, None, 2.0) for s, a in enumerate((0.90, 0.92, 0.94))]
    rows.append({"measurement": "distill_step", "status": "ok", "teacher": "t", "student": "s"})
    return pd.DataFrame(rows)


def test_summarize_quality_against_numpy():
    summary = summarize_quality(_hand_rows())
    assert list(zip(summary["quality_role"], summary["method"].fillna("-"))) == [
        ("teacher", "-"),
        ("scratch", "-"),
        ("distilled", "at"),
        ("distilled", "kd"),
    ]
    t, sc, at, kd = (summary.iloc[i] for i in range(4))
    assert t["n"] == 3 and math.isclose(t["accuracy_mean"], np.mean([0.90, 0.92, 0.94]))
    assert math.isclose(t["accuracy_std"], np.std([0.90, 0.92, 0.94], ddof=1))
    assert math.isnan(t["agreement_mean"]) and t["reached"] == 3
    assert math.isclose(sc["accuracy_std"], np.std([0.80, 0.82, 0.85], ddof=1))
    assert math.isclose(sc["agreement_mean"], np.mean([0.85, 0.86, 0.88]))
    assert (sc["n"], sc["reached"]) == (3, 2)
    assert math.isclose(sc["time_to_target_mean_s"], 2.0) and math.isclose(sc["time_to_target_std_s"], math.sqrt(2))
    assert (kd["n"], kd["failed"], kd["reached"]) == (2, 1, 2)
    assert math.isclose(kd["accuracy_mean"], 0.87) and math.isclose(kd["accuracy_std"], np.std([0.86, 0.88], ddof=1))
    assert at["n"] == 1 and math.isnan(at["accuracy_std"]) and at["reached"] == 0
    assert math.isnan(at["time_to_target_mean_s"])

    table = markdown_table(summary)
    lines = table.strip().splitlines()
    assert len(lines) == 2 + 4
    assert "| t | – | teacher | – | 92.0 ± 2.0 | – | 2.00 ± 0.00 | 3/3 |" in lines
    assert "| t | s | scratch | – | 82.3 ± 2.5 | 86.3 ± 1.5 | 2.00 ± 1.41 | 2/3 |" in lines
    assert "| t | s | distilled | at | 85.0 | 91.0 | – | 0/1 |" in lines  # one seed: no ±
    assert "| t | s | distilled | kd | 87.0 ± 1.4 | 91.0 ± 1.4 | 4.50 ± 0.71 | 2/2 (1 failed) |" in lines


def test_summarize_empty():
    summary = summarize_quality(pd.DataFrame({"measurement": ["distill_step"], "status": ["ok"]}))
    assert summary.empty and "accuracy_mean" in summary.columns


QUALITY_SUITE = tiny_suite(
    name="qsuite",
    defaults={
        "pair": {"teacher": "resnet8", "student": "resnet8"},
        "batch_size": 8,
        "data": {"kind": "synthetic", "shape": [1, 8, 8], "num_classes": 10},
        "timing": {"min_iters": 2},
    },
    matrix={"method": ["kd", "dkd"]},
    quality={"dataset": "digits", "epochs": 1, "seeds": 1, "target": 0.5},
)


@pytest.mark.slow
def test_run_stores_quality_rows_once_and_resume_keeps_them(tmp_path, capsys):
    from kdbench.cli import main
    from kdbench.store import read_results
    from tests.support.helpers import run_folder

    suite = write_suite(tmp_path / "q.yaml", **QUALITY_SUITE)
    out = tmp_path / "res"
    assert main(["run", str(suite), "--out", str(out), "--report-dir", str(tmp_path / "rep")]) == 0
    printed = capsys.readouterr().out
    run = run_folder(out)
    rows = read_results([run.path]).fillna({"method": ""}).to_dict("records")
    quality = [r for r in rows if r["measurement"] == "quality"]
    # one seed: the teacher, the scratch student, and one distilled student per method
    assert sorted((r["quality_role"], r["method"]) for r in quality) == [
        ("distilled", "dkd"),
        ("distilled", "kd"),
        ("scratch", ""),
        ("teacher", ""),
    ]
    assert all(r["status"] == "ok" and 0 <= r["accuracy"] <= 1 for r in quality)
    assert {r["cell_id"] for r in quality} == {quality[0]["cell_id"]} and quality[0]["cell_id"].startswith("quality-")
    assert len(rows) == 2 * 3 + 4  # two cells of three measurements, then the quality rows
    assert len(run.parts()) == 3  # one part per job: two cells and the quality job
    # the quality job ran in the worker: its progress came through, and its table is printed
    assert "quality seed 0: teacher resnet8: top-1" in printed and "| resnet8 | resnet8 | distilled | kd |" in printed
    page = (tmp_path / "rep" / "index.html").read_text()
    assert "Quality" in page and "distilled" in page
    assert main(["run", str(suite), "--out", str(out), "--resume", "--no-report"]) == 0
    assert "3 of 3 jobs already stored, 0 to go" in capsys.readouterr().out
    assert len(read_results([run.path])) == len(rows)


@pytest.mark.slow
def test_a_quality_job_that_crashes_is_stored_failed_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    from kdbench.cli import main
    from kdbench.store import read_results
    from tests.support.helpers import run_folder

    monkeypatch.syspath_prepend(str(SUPPORT))  # faulty_models, for the worker process
    crashing = {"pair": {"teacher": "resnet8", "student": "faulty_models:segfault_in_training"}}
    over = {"allow_imports": True, "defaults": crashing, "matrix": {"method": ["kd"]}}
    suite = write_suite(tmp_path / "q.yaml", **merged(QUALITY_SUITE, over))
    out = tmp_path / "res"
    assert main(["run", str(suite), "--out", str(out), "--report-dir", str(tmp_path / "rep")]) == 1
    captured = capsys.readouterr()
    df = read_results([run_folder(out).path])
    cells = df[df["measurement"] != "quality"]
    assert set(cells["status"]) == {"ok"}  # the timed cell never trains more than a step: it measured fine
    quality = df[df["measurement"] == "quality"].set_index("quality_role")
    assert sorted(quality.index) == ["distilled", "scratch", "teacher"]  # every planned row
    # the teacher had trained before the worker died: its row is kept; the rest are marked
    assert quality.loc["teacher", "status"] == "ok" and 0 < quality.loc["teacher", "accuracy"] <= 1
    rest = quality.drop(index="teacher")
    assert set(rest["status"]) == {"failed"} and rest["error"].str.contains("SIGSEGV").all()
    assert "1 job(s) had failures" in captured.err and "quality (digits, 1 seed)" in captured.err
    assert (tmp_path / "rep" / "index.html").exists()  # the run went on to its report


def test_missing_quality_root_fails_before_anything_runs(tmp_path, capsys):
    from kdbench.cli import main

    missing = {"quality": {"dataset": "imagefolder", "root": str(tmp_path / "nope")}}
    suite = write_suite(tmp_path / "q.yaml", **merged(QUALITY_SUITE, missing))
    assert main(["run", str(suite), "--out", str(tmp_path / "res")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "q.yaml" in err[0] and "quality.root" in err[0] and "does not exist" in err[0]
    assert not (tmp_path / "res").exists()
