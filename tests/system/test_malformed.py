"""The malformed-suite corpus: every user mistake ends in one line naming the file, exit code 2,
no traceback, and nothing written.  Each file's first line says what its message must contain."""

import subprocess
import sys
from pathlib import Path

import pytest

from kdbench.cli import main
from tests.support.paths import TESTS

CORPUS = TESTS / "malformed"
FILES = sorted(CORPUS.glob("*.yaml"))


def _expected(path: Path) -> str:
    first = path.read_bytes().splitlines()[0].decode("ascii")
    assert first.startswith("# expect: ")
    return first[len("# expect: ") :]


def test_corpus_is_large_enough():
    assert len(FILES) >= 25


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_malformed_suite(path, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(CORPUS.parent.parent)  # the corpus names its config.json files from the repository's root
    out = tmp_path / "results"
    out.mkdir()
    (out / "earlier.parquet").write_bytes(b"an earlier run's results")
    rc = main(["run", str(path), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"kdbench: error: {path}"), err
    assert _expected(path) in lines[0], err
    # no results lost, none started
    assert [p.name for p in out.iterdir()] == ["earlier.parquet"]
    assert (out / "earlier.parquet").read_bytes() == b"an earlier run's results"


@pytest.mark.parametrize("stem", ["unknown_model", "yaml_syntax", "billion_laughs"])
def test_no_traceback_from_the_real_command(stem):
    path = CORPUS / f"{stem}.yaml"
    r = subprocess.run(
        [sys.executable, "-m", "kdbench", "run", str(path), "--dry-run"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_missing_file_and_folder(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.yaml")]) == 2
    assert main(["run", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "no such suite file" in err[0] and "is a folder" in err[1]


def test_bad_command_line_values_are_one_line_errors(capsys):
    suite = str(CORPUS.parent.parent / "suites" / "cpu.yaml")
    assert main(["run", suite, "--threads", "0"]) == 2
    assert main(["run", suite, "--cell-timeout", "-1"]) == 2
    assert main(["run", suite, "--shard", "0/3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert ["--threads" in err[0], "--cell-timeout" in err[1], "--shard" in err[2]] == [True, True, True]
    assert all(line.startswith("kdbench: error: ") for line in err)


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "SUITE", "--out", "FILE"],
        ["run", "SUITE", "--dry-run", "--out", "FILE"],
        ["run", "SUITE", "--report-dir", "FILE"],
        ["report", "RESULTS", "--out", "FILE"],
        ["probe", "--out", "FILE"],
    ],
)
def test_an_output_folder_that_is_a_file_is_one_line(argv, tmp_path, capsys):
    """`--out results.parquet` (a file where a folder goes) is refused before anything runs (issue 30: it was a
    NotADirectoryError traceback once the run folder was made)."""
    taken = tmp_path / "results.parquet"
    taken.write_bytes(b"an earlier file")
    flag = argv[argv.index("FILE") - 1]
    suite = str(CORPUS.parent.parent / "suites" / "cpu.yaml")
    argv = [{"FILE": str(taken), "SUITE": suite, "RESULTS": str(tmp_path)}.get(a, a) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"kdbench: error: {flag} {taken}: is a file, and {flag} names a folder; give a folder, e.g. {tmp_path}"
    ]
    assert taken.read_bytes() == b"an earlier file"


@pytest.mark.parametrize(
    ("topic", "expected"),
    [
        ("suits", "list suits: no such topic; did you mean suites? give one of models, methods, suites, loss_impls"),
        ("loss", "list loss: no such topic; give one of models, methods, suites, loss_impls"),
        ("model", "list model: no such topic; did you mean models? give one of"),
    ],
)
def test_an_unknown_list_topic_is_one_line(topic, expected, capsys):
    assert main(["list", topic]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kdbench: error: {expected}"), err


def test_list_suites_without_a_suites_folder_is_one_line(tmp_path, monkeypatch, capsys):
    """kdbench installed without its repository has no suites/ beside it: one line, not a traceback."""
    from kdbench import api

    monkeypatch.setattr(api, "SUITES_DIR", tmp_path / "suites")
    assert main(["list", "suites"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"kdbench: error: {tmp_path / 'suites'}: no suites folder; the shipped suites are in a clone of kdbench's "
        "repository (suites/)"
    ]


@pytest.mark.parametrize("command", [["run", "SUITE"], ["compare", "SUITE", "SUITE"]])
def test_judge_contended_takes_no_value(command, capsys):
    # issue 32's flag: --judge-contended is a switch; a value given to it is a one-line mistake naming it
    suite = str(CORPUS.parent.parent / "suites" / "cpu.yaml")
    argv = [suite if a == "SUITE" else a for a in command]
    assert main([*argv, "--judge-contended=yes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kdbench: error: ") and "--judge-contended" in err[0], err


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "--max-loss-err: must be > 0, got 0"),
        ("-0.1", "--max-loss-err: must be > 0, got -0.1"),
        ("nan", "--max-loss-err: expected a finite number, got 'nan'"),
        ("1e-2x", "--max-loss-err: expected a number, got '1e-2x'"),
    ],
)
def test_the_ledger_bound_is_a_positive_number(value, message, capsys):
    # issue 34's compare option: the accuracy ledger's bound on loss_rel_err and grad_rel_err
    suite = str(CORPUS.parent.parent / "suites" / "cpu.yaml")
    assert main(["compare", suite, suite, "--max-loss-err", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kdbench: error: {message}"], err


def test_gate_loss_err_takes_no_value(capsys):
    suite = str(CORPUS.parent.parent / "suites" / "cpu.yaml")
    assert main(["compare", suite, suite, "--gate-loss-err=yes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kdbench: error: ") and "--gate-loss-err" in err[0], err


@pytest.mark.parametrize("command", [["run", "SUITE"], ["compare", "SUITE", "SUITE"]])
def test_allow_unjudged_takes_no_value(command, capsys):
    # issue 45's flag: --allow-unjudged is a switch; a value given to it is a one-line mistake naming it
    suite = str(CORPUS.parent.parent / "suites" / "cpu.yaml")
    argv = [suite if a == "SUITE" else a for a in command]
    assert main([*argv, "--allow-unjudged=yes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kdbench: error: ") and "--allow-unjudged" in err[0], err
