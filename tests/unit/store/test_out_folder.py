"""An --out that cannot be made (issue 45, item 5): one line naming the flag and the reason, exit 2, for every
command that writes there, whether the command line's check sees it (a file on the path) or only the making does
(/proc refuses a mkdir that the permissions allow); no traceback, nothing run."""

from __future__ import annotations

import pytest

import kdbench.cli.parser as parser
from kdbench.cli import main
from kdbench.core.errors import KdbenchError
from kdbench.store.files import make_folder
from tests.support.helpers import write_suite
from tests.support.suites import tiny_suite


@pytest.fixture
def blocked(tmp_path):
    """A folder path under a regular file: it cannot be made on any OS."""
    (tmp_path / "file").write_text("not a folder")
    return tmp_path / "file" / "sub"


def _one_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kdbench: error: "), err
    assert "Traceback" not in out + err
    return lines[0]


@pytest.mark.parametrize(
    "command",
    [
        ["run", "SUITE", "--out", "BLOCKED"],
        ["run", "SUITE", "--report-dir", "BLOCKED"],
        ["report", "SUITE", "--out", "BLOCKED"],
        ["compare", "SUITE", "SUITE", "--out", "BLOCKED/compare.md"],
        ["export", "SUITE", "--out", "BLOCKED/rows.csv"],
        ["fit", "SUITE", "--gpu", "H100", "--out", "BLOCKED/fit.json"],
    ],
)
def test_a_folder_under_a_file_is_one_line_exit_2(command, blocked, tmp_path, capsys):
    suite = write_suite(tmp_path / "s.yaml", **tiny_suite(name="out"))
    argv = [str(suite) if a == "SUITE" else a.replace("BLOCKED", str(blocked)) for a in command]
    assert main(argv) == 2
    line = _one_line(capsys)
    flag = command[command.index("BLOCKED") - 1] if "BLOCKED" in command else "--out"
    assert f"{flag} {blocked}" in line and f"cannot make the folder: {blocked.parent} is a file" in line, line
    assert not (tmp_path / "out").exists()


def test_a_folder_the_system_refuses_is_one_line_exit_2(blocked, tmp_path, capsys, monkeypatch):
    """What the command line's check cannot see (/proc/kdbench-results: the permissions allow it, the file system
    does not) ends at the folder's making, as one line naming --out and the system's reason."""
    monkeypatch.setattr(parser, "can_make", lambda *args: None)  # the check passes, as it does for /proc as root
    suite = write_suite(tmp_path / "s.yaml", **tiny_suite(name="out"))
    assert main(["run", str(suite), "--out", str(blocked), "--inline", "--no-report"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"kdbench: error: --out {blocked}: cannot make the folder: not a directory; give a"), line


def test_make_folder_names_what_and_why(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(KdbenchError, match=r"^--out .*f/sub: cannot make the folder: not a directory; give a"):
        make_folder(tmp_path / "f" / "sub", "--out")
    assert make_folder(tmp_path / "a" / "b", "--out").is_dir()
