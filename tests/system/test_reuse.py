"""Nothing measured twice: a teacher's inference that an earlier cell of the run measured is reused."""

from __future__ import annotations

from kdbench.cli import main
from kdbench.store import read_results
from kdbench.workloads import vision as vision_module
from tests.support.helpers import run_folder, write_suite
from tests.support.suites import tiny_suite


def test_a_reused_teacher_row_is_not_measured_again(tmp_path, monkeypatch, capsys):
    calls = []
    measure = vision_module.measure_inference

    def counting(model, role, batch_size, config, backend, budget_s):
        calls.append((role, batch_size, config.kd.temperature))
        return measure(model, role, batch_size, config, backend, budget_s)

    monkeypatch.setattr(vision_module, "measure_inference", counting)
    matrix = {"kd.temperature": [2.0, 4.0], "precision": ["fp32", "bf16"]}
    reuse = tiny_suite(name="reuse", defaults={"inference": {"batch_sizes": [1, 2]}}, matrix=matrix)
    suite = write_suite(tmp_path / "s.yaml", **reuse)
    assert main(["run", str(suite), "--out", str(tmp_path / "res"), "--no-report", "--inline"]) == 0
    teacher_calls = sorted((bs, t) for role, bs, t in calls if role == "teacher")
    assert teacher_calls == [(1, 2.0), (1, 2.0), (2, 2.0), (2, 2.0)]  # T=2 cells measure (fp32, bf16); T=4 reuse
    assert len([c for c in calls if c[0] == "student"]) == 8
    df = read_results([run_folder(tmp_path / "res").path])
    teacher = df[df["measurement"].eq("teacher_inference")]
    assert len(teacher) == 8 and teacher["status"].eq("ok").all()
    reused = teacher[teacher["measured_in_cell"].notna()]
    assert len(reused) == 4 and reused["notes"].str.contains("reused: this teacher inference was measured once").all()
    for r in reused.itertuples():
        source = teacher[teacher["cell_id"].eq(r.measured_in_cell) & teacher["batch_size"].eq(r.batch_size)].iloc[0]
        assert source.kd_temperature == 2.0 and r.kd_temperature == 4.0 and source.precision == r.precision
        assert list(r.samples_ms) == list(source.samples_ms) and r.median_ms == source.median_ms
    # The reused teacher still gives the student its speed-up, row by row.
    students = df[df["measurement"].eq("student_inference")]
    assert students["speedup_vs_teacher"].notna().all()


def test_a_reused_teacher_row_says_the_served_precision_of_the_cell_that_reuses_it(tmp_path):
    # L11: the teacher is served at the cell's precision, not at its teacher_precision (the step's); a row whose
    # cell says another teacher_precision says so, also when the row is a copy of another cell's (the reuse key holds
    # precision, not teacher_precision): the copy carries the note of the cell it is stored in, not the measuring one's
    matrix = {"kd.temperature": [2.0, 4.0], "teacher_precision": ["bf16", "fp32"]}
    suite = write_suite(tmp_path / "s.yaml", **tiny_suite(name="reuse", matrix=matrix))
    assert main(["run", str(suite), "--out", str(tmp_path / "res"), "--no-report", "--inline"]) == 0
    df = read_results([run_folder(tmp_path / "res").path])
    teacher = df[df["measurement"].eq("teacher_inference")]
    assert len(teacher) == 4 and teacher["measured_in_cell"].notna().sum() == 3  # measured once, in the first cell
    said = "the teacher is served at precision fp32, as the student is"
    for r in teacher.itertuples():
        notes = r.notes or ""
        assert notes.count("the teacher is served at precision") == (r.teacher_precision == "bf16"), notes
        assert (said in notes and "teacher_precision bf16" in notes) == (r.teacher_precision == "bf16"), notes
