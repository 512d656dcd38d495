"""A gate that cannot judge must not pass (issue 45, item 1): `compare` of runs whose rows are all contended, and
`run` whose budgets judged nothing, exit EXIT_NOT_JUDGED (not 0, 1 or 2) unless --allow-unjudged; --help and the
exit-code table say so."""

from __future__ import annotations

from kdbench.cli import main
from kdbench.cli.parser import build_parser
from kdbench.config.budgets import BudgetCheck, judged_none
from kdbench.core.errors import EXIT_NOT_JUDGED
from kdbench.hw import contention
from kdbench.hw.contention import HostLoad
from kdbench.store.results import job_id, open_run
from tests.support.helpers import write_suite
from tests.support.paths import ROOT
from tests.support.rows import result_row
from tests.support.suites import tiny_suite


def test_the_code_is_its_own():
    assert EXIT_NOT_JUDGED not in (0, 1, 2, 130) and EXIT_NOT_JUDGED not in range(6)  # pytest's own codes: 0-5


def _rows(run_id: str, contended: bool, slower: float = 1.0, repeats: int = 3) -> list[dict]:
    return [
        result_row(
            run_id=run_id,
            suite="s",
            cell_id=cell,
            cell_label=cell,
            repeat=r + 1,
            measurement="distill_step",
            batch_size=4,
            samples_ms=[10.0 * slower * (1 + 0.01 * r)] * 8,
            median_ms=10.0 * slower * (1 + 0.01 * r),
            contended=contended,
            host_busy_share=0.8 if contended else 0.1,
        )
        for cell in ("cell-a", "cell-b")
        for r in range(repeats)
    ]


def _folder(tmp_path, run_id: str, rows: list[dict]):
    folder = open_run(tmp_path, "s", "s.yaml", run_id)
    for r in rows:
        folder.write_part(job_id(r["cell_id"], r["repeat"]), [r])
    return folder.path


def test_compare_against_a_slower_contended_copy_is_not_judged_unless_allowed(tmp_path, capsys):
    base = _folder(tmp_path, "base", _rows("base", contended=True))
    slower = _folder(tmp_path, "new", _rows("new", contended=True, slower=1.5))
    assert main(["compare", str(base), str(slower)]) == EXIT_NOT_JUDGED
    out = capsys.readouterr().out
    assert (
        f"verdict: nothing was judged (see the notes): no regression can be claimed either way; exit {EXIT_NOT_JUDGED}"
        in out
    )
    assert main(["compare", str(base), str(slower), "--allow-unjudged"]) == 0
    assert "exit 0 (--allow-unjudged)" in capsys.readouterr().out
    # what the gate judges is unchanged: judged, the copy is a regression (exit 1, --allow-unjudged or not)
    assert main(["compare", str(base), str(slower), "--judge-contended", "--allow-unjudged"]) == 1
    capsys.readouterr()
    # quiet rows on both sides are judged: the same copy is a regression, and an equal one passes
    quiet = _folder(tmp_path, "quiet", _rows("quiet", contended=False))
    same = _folder(tmp_path, "same", _rows("same", contended=False))
    assert main(["compare", str(quiet), str(same)]) == 0
    capsys.readouterr()


def test_the_json_record_carries_the_code(tmp_path, capsys):
    import json

    base = _folder(tmp_path, "base", _rows("base", contended=True))
    new = _folder(tmp_path, "new", _rows("new", contended=True, slower=1.5))
    assert main(["compare", str(base), str(new), "--format", "json"]) == EXIT_NOT_JUDGED
    assert json.loads(capsys.readouterr().out)["exit_code"] == EXIT_NOT_JUDGED


def _check(outcome: str) -> BudgetCheck:
    return BudgetCheck("b", "median_ms", "distill_step", "r", "c", "c", 4, 1.0, outcome)


def test_budgets_judged_none_only_when_no_check_judged():
    assert not judged_none([])  # no budgets: nothing to judge, nothing claimed
    assert judged_none([_check("contended"), _check("thin"), _check("skipped")])
    assert not judged_none([_check("contended"), _check("met")])
    assert not judged_none([_check("contended"), _check("missed")])


SUITE = tiny_suite(name="gate", defaults={"inference": {"batch_sizes": [4], "teacher": False}})
BUDGETS = [{"measurement": "distill_step", "stat": "median_ms", "max": 1e-6}]  # a miss, were it judged


def test_run_whose_budgets_all_read_contended_is_not_judged_unless_allowed(tmp_path, capsys, monkeypatch):
    """Every measurement reads a busy machine (the host meter simulated: others on both cores): the budget's one
    check is contended, not a miss, so the run judged nothing and says so in its exit code."""
    monkeypatch.setattr(contention.HostMeter, "result", lambda self: HostLoad(1.0, 2, 2.0, 1))
    suite = write_suite(tmp_path / "s.yaml", **SUITE, budgets=BUDGETS)
    args = ["run", str(suite), "--out", str(tmp_path / "res"), "--inline", "--no-report"]
    assert main(args) == EXIT_NOT_JUDGED
    out, err = capsys.readouterr()
    assert "budgets: 0 of 1 checks met (1 contended)" in out
    assert f"budgets: none of 1 checks was judged (rows contended, thin or skipped): exit {EXIT_NOT_JUDGED}" in err
    assert main([*args, "--allow-unjudged", "--run-id", "again"]) == 0
    assert "budgets: none was judged (--allow-unjudged: exit 0)" in capsys.readouterr().out
    assert main([*args, "--judge-contended", "--run-id", "judged"]) == 1  # judged, it is a miss


def test_help_and_the_exit_code_table_say_it():
    text = build_parser().format_help()
    assert f"{EXIT_NOT_JUDGED} could not judge" in text
    for command in ("compare", "run"):
        sub = build_parser()._subparsers._group_actions[0].choices[command].format_help()
        assert "--allow-unjudged" in sub and str(EXIT_NOT_JUDGED) in sub
    table = (ROOT / "docs" / "cli.md").read_text().split("## Exit codes")[1].split("## Reference")[0]
    assert f"| `{EXIT_NOT_JUDGED}` |" in table and "--allow-unjudged" in table
    assert f"`{EXIT_NOT_JUDGED}`" in (ROOT / "README.md").read_text()
