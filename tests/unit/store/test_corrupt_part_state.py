"""A corrupted part is no stored job (issue 45, item 5): a run's state (:class:`kdbench.store.results.RunState`, the
completeness compare and report print) counts only the parts that read whole, as read_results and a resumed run do,
says its job is missing and names the part; compare and report print that."""

from __future__ import annotations

import json
import shutil

from kdbench.cli import main
from kdbench.store.results import RunFolder, job_id, open_run
from tests.support.rows import result_row, timing

CELLS = ("cell-a", "cell-b", "cell-c")


def _run(path, run_id: str) -> RunFolder:
    """A finished run of three planned cells, one part each."""
    folder = open_run(path, "s", "s.yaml", run_id)
    jobs = [job_id(c, 1) for c in CELLS]
    record = folder.start_invocation(jobs, jobs, repeats=1)
    for cell in CELLS:
        row = result_row(run_id=run_id, suite="s", cell_id=cell, repeat=1, **timing(10.0, 8, 20, 0.01, 0.99, 1.01))
        folder.write_part(job_id(cell, 1), [row])
    record.finish(jobs=len(jobs))
    return folder


def _garbage(path) -> None:
    """Garbage bytes over the whole part, its size kept."""
    path.write_bytes(b"\x13garbage!" * (path.stat().st_size // 9 + 1))


def test_a_corrupted_part_is_a_missing_job_and_its_run_names_it(tmp_path, capsys):
    folder = _run(tmp_path / "new", "new")
    assert folder.state().complete and folder.state().unreadable == ()
    bad = folder.part_path(job_id("cell-b", 1))
    _garbage(bad)
    state = folder.state()
    assert state.complete is False and state.missing == {job_id("cell-b", 1)}
    assert state.stored == {job_id("cell-a", 1), job_id("cell-c", 1)}
    [named] = state.unreadable
    assert named.startswith(f"{bad}: ")
    said = state.describe()
    assert said.startswith("INCOMPLETE: 2 of 3 planned jobs stored; 1 part(s) could not be read") and named in said
    assert folder.stored_job_ids(readable=True) == set(state.stored)  # a resumed run agrees

    base = _run(tmp_path / "base", "base")
    capsys.readouterr()
    main(["compare", str(base.path), str(folder.path)])
    out = capsys.readouterr().out
    assert "NEW is INCOMPLETE: 2 of 3 planned jobs stored; 1 part(s) could not be read" in out and named in out, out
    assert main(["compare", str(base.path), str(folder.path), "--format", "json"]) in (0, 1, 3)
    doc = json.loads(capsys.readouterr().out)
    assert doc["new"]["complete"] is False and doc["new"]["missing_jobs"] == [job_id("cell-b", 1)]
    assert doc["new"]["unreadable_parts"] == [named] and doc["base"]["unreadable_parts"] == []

    assert main(["report", str(folder.path), "--out", str(tmp_path / "rep")]) == 0
    page = (tmp_path / "rep" / "index.html").read_text()
    assert "INCOMPLETE: 2 of 3 planned jobs stored" in page and f"<code>{bad}: " in page


def test_a_part_replaced_after_it_was_read_is_read_again(tmp_path):
    """The state does not re-read a part the process read whole, unless it changed since (a resumed run's part)."""
    from kdbench.store import read_results

    folder = _run(tmp_path / "new", "new")
    assert len(read_results([folder.path])) == 3 and folder.state().complete
    bad = folder.part_path(job_id("cell-a", 1))
    shutil.copyfile(bad, tmp_path / "whole.parquet")
    _garbage(bad)
    assert folder.state().missing == {job_id("cell-a", 1)}
    shutil.copyfile(tmp_path / "whole.parquet", bad)
    assert folder.state().complete
