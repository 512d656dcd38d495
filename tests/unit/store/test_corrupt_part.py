"""One corrupted parquet part (issue 45, item 5): `kdbench report` renders the rest of the folder and names the
part, on the page and in a warning; read_results leaves it out and lists it; a folder of nothing but bad parts is
still a one-line error."""

from __future__ import annotations

import pytest

from kdbench.cli import main
from kdbench.core.errors import KdbenchError
from kdbench.store import read_results
from kdbench.store.results import UNREADABLE, job_id, open_run
from tests.support.rows import result_row


def _folder(tmp_path):
    folder = open_run(tmp_path / "res", "s", "s.yaml", "run")
    for cell in ("cell-a", "cell-b", "cell-c"):
        row = result_row(run_id="run", suite="s", cell_id=cell, cell_label=f"label-{cell}", measurement="distill_step")
        folder.write_part(job_id(cell, 1), [row])
    return folder


def _cut_short(path):
    """A part cut short, as a full disk or a killed copy leaves it: its footer is gone."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _scrambled(path):
    """A part whose middle bytes were overwritten (its footer intact)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[8:middle] = bytes(len(data[8:middle]))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("corrupt", [_cut_short, _scrambled])
def test_a_report_renders_the_rest_and_names_the_bad_part(corrupt, tmp_path, capsys):
    folder = _folder(tmp_path)
    bad = folder.part_path(job_id("cell-b", 1))
    corrupt(bad)
    assert main(["report", str(folder.path), "--out", str(tmp_path / "rep")]) == 0
    out, err = capsys.readouterr()
    warned = [line for line in err.splitlines() if "not a readable parquet file" in line]
    assert len(warned) == 1 and warned[0].startswith(f"{bad}: ") and "left out, the other 2 file(s) read" in err, err
    assert "report ->" in out
    df = read_results([folder.path])
    assert sorted(df["cell_id"]) == ["cell-a", "cell-c"]
    [listed] = df.attrs[UNREADABLE]
    assert listed.startswith(f"{bad}: ")
    page = (tmp_path / "rep" / "index.html").read_text()
    assert "1 result file could\n  not be read and is left out of this report" in page
    assert f"<code>{bad}: " in page and "2 cells" in page


def test_nothing_readable_is_still_a_one_line_error(tmp_path, capsys):
    folder = _folder(tmp_path)
    for part in folder.parts():
        _cut_short(part)
    with pytest.raises(KdbenchError, match=r"\.parquet: not a readable parquet file"):
        read_results([folder.path])
    assert main(["report", str(folder.path), "--out", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a readable parquet file" in err[0]
