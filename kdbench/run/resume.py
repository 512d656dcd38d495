"""A continued run keeps the options it was started with (issue 45: a run started with ``--repeat 3``, interrupted
and resumed with the printed command, said "2 of 2 jobs already stored, 0 to go" and left a 1-repeat run).

Every ``kdbench run`` records its options in the run folder as it starts (atomically: in the manifest of a folder
it makes, and in its own invocation record): the effective value of each :data:`SETTINGS` entry, and which of them
were given on the command line.  A run that continues a folder (``--resume``, or ``--run-id`` of one that exists)
resolves its options against the newest record (:func:`resolve`):

* an option given on the command line then is used again when not given now: ``kdbench run SUITE --resume`` keeps
  the run's ``--repeat 3``, ``--threads 1``, ``--device cpu``, ``--no-fit-check`` (or ``--fit-check auto``), ...;
* an option that changes the plan or what its rows mean (``--repeat``, ``--device``, ``--threads``, ``--profile``,
  ``--fit-check`` / ``--no-fit-check``: ``Setting.plan``), given now (or changed in the suite file) with another
  value than the run was started with, is refused in one line naming it and both values; except a larger
  ``--repeat``, which only adds repeats (the documented way to measure more: ``resuming a run with a larger N
  measures only the new repeats``) and says so;
* the options that do not change the plan may differ, the value given now wins: ``--cell-timeout`` and
  ``--allow-imports`` (kept from the record when not given), and those that are the invocation's own (not
  recorded; the printed resume command carries them): ``--shard`` (which share of the same plan), ``--inline``,
  ``--no-report``, ``--report-dir``, ``--judge-contended``, ``--allow-unjudged``.

A folder written before the records held options has only each invocation's ``repeats``: its largest is taken as
the run's, from an unknown source (compared, never silently replaced by the suite's).
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kdbench.config import with_overrides
from kdbench.config.schema import Suite
from kdbench.core.errors import KdbenchError
from kdbench.store.results import RunFolder, newest_run

logger = logging.getLogger(__name__)

OPTIONS = "options"  # the record's key: {setting key: effective value}
GIVEN = "given"  # the record's key: the setting keys given on the command line


@dataclass(frozen=True)
class Setting:
    key: str  # the suite's top-level field (device: the run's --device), and its name in the records
    flag: str
    plan: bool  # changes the plan or what its rows mean: a continued run may not change it

    def words(self, value: Any) -> list[str]:
        """The command-line words that give ``value`` (none for a flag's default)."""
        if self.key == "fit_check":  # false: --no-fit-check (as it always was); true and auto: --fit-check VALUE
            return ["--no-fit-check"] if value is False else [self.flag, _yaml(value)]
        if isinstance(value, bool):
            return [self.flag] if value else []
        return [self.flag, f"{value:g}" if isinstance(value, float) else str(value)]

    def said(self, value: Any) -> str:
        return " ".join(self.words(value)) or f"without {self.flag}"


SETTINGS = (
    Setting("repeat", "--repeat", True),
    Setting("device", "--device", True),
    Setting("threads", "--threads", True),
    Setting("profile", "--profile", True),
    Setting("fit_check", "--fit-check", True),
    Setting("cell_timeout_s", "--cell-timeout", False),
    Setting("allow_imports", "--allow-imports", False),
)
BY_KEY = {s.key: s for s in SETTINGS}


def effective(suite: Suite, device: str | None) -> dict[str, Any]:
    """The value of each setting a run of ``suite`` (overrides applied) with ``--device device`` runs with."""
    import torch

    from kdbench.run.plan import planned_backend

    return {
        "repeat": suite.repeat,
        "device": planned_backend(suite, device),
        "threads": suite.threads or torch.get_num_threads(),
        "profile": suite.profile,
        "fit_check": suite.fit_check,
        "cell_timeout_s": suite.cell_timeout_s,
        "allow_imports": suite.allow_imports,
    }


def continued_folder(out_dir: Path, suite_name: str, run_id: str | None, resume: bool) -> RunFolder | None:
    """The run folder a run continues: ``--run-id``'s when it holds a run, else with ``--resume`` the newest run
    of the suite in ``out_dir``; None for a new run.  (The engine's own choice, :func:`kdbench.run.engine._open`.)"""
    if run_id:
        folder = RunFolder(Path(out_dir) / run_id)  # another suite's run: open_run refuses it, naming both
        return folder if folder.manifest().get("suite") == suite_name else None
    return newest_run(Path(out_dir), suite_name) if resume else None


def stored_options(folder: RunFolder) -> tuple[dict[str, Any], set[str]] | None:
    """(the effective values, the keys given on the command line) the run was last started with: its newest
    invocation record that holds them, else its manifest's; for a folder from before, the most repeats any
    invocation planned (given: unknown, so none); None when nothing says."""
    records = folder.invocations()
    for record in reversed(records):
        if isinstance(record.get(OPTIONS), dict):
            return dict(record[OPTIONS]), set(record.get(GIVEN) or ())
    manifest = folder.manifest()
    if isinstance(manifest.get(OPTIONS), dict):
        return dict(manifest[OPTIONS]), set(manifest.get(GIVEN) or ())
    repeats = [r["repeats"] for r in records if isinstance(r.get("repeats"), int)]
    return ({"repeat": max(repeats)}, set()) if repeats else None


@dataclass(frozen=True)
class Resolved:
    """A run's options, resolved against the folder it continues."""

    suite: Suite  # with the command-line options applied
    device: str | None  # --device
    given: dict[str, Any]  # setting key -> command-line value: given now, or kept from the record
    record: dict[str, Any]  # what the run folder records: {OPTIONS: effective values, GIVEN: keys}
    folder: RunFolder | None = None  # the folder it continues

    def words(self) -> list[str]:
        """The command-line words of its settings (for the printed resume command)."""
        return [w for s in SETTINGS if s.key in self.given for w in s.words(self.given[s.key])]


def apply(suite: Suite, given: dict[str, Any]) -> Suite:
    """``suite`` with the given settings (all but device) as overrides; an error names the flag."""
    return with_overrides(suite, {k: (BY_KEY[k].flag, v) for k, v in given.items() if k != "device"})


def resolve(suite: Suite, given: dict[str, Any], out_dir: Path, run_id: str | None, resume: bool) -> Resolved:
    """The options a run of ``suite`` runs with, ``given`` (setting key -> value given on the command line, None
    when not) resolved against the run it continues (see the module docstring); KdbenchError when it would change
    the continued run's plan."""
    given = {k: v for k, v in given.items() if v is not None}
    folder = continued_folder(out_dir, suite.name, run_id, resume)
    stored = stored_options(folder) if folder is not None else None
    if stored is not None:
        values, was_given = stored
        kept = {k: values[k] for k in was_given if k in values and k in BY_KEY and k not in given}
        if kept:
            said = " ".join(w for s in SETTINGS if s.key in kept for w in s.words(kept[s.key])) or "its defaults"
            logger.info("continuing run %s with the options it was started with: %s", folder.run_id, said)
        given = {**given, **kept}
    applied = apply(suite, given)
    now = effective(applied, given.get("device"))
    if stored is not None:
        _check(folder, suite, stored[0], now, given)
    record = {OPTIONS: now, GIVEN: sorted(given, key=list(BY_KEY).index)}
    return Resolved(applied, given.get("device"), given, record, folder)


def _check(folder: RunFolder, suite: Suite, was: dict[str, Any], now: dict[str, Any], given: dict[str, Any]) -> None:
    for s in SETTINGS:
        if s.key not in was or was[s.key] == now[s.key]:
            continue
        old, new = was[s.key], now[s.key]
        where = f"run {folder.run_id} in {folder.path.parent}"
        if not s.plan:
            logger.info(
                "%s: %s (the run was started with %s: it does not change the plan)", where, s.said(new), s.said(old)
            )
            continue
        if s.key == "repeat" and new > old:
            logger.info(
                "%s was started with %s; %s adds repeats %d-%d of every cell",
                where,
                s.said(old),
                s.said(new),
                old + 1,
                new,
            )
            continue
        if s.key in given:
            now_said = s.said(new)
        elif s.key == "threads" and suite.threads is None:
            now_said = f"{s.flag} not given: {new}, torch's default here"
        elif s.key == "device":
            now_said = f"{s.flag} not given: the suite's `backend: {suite.backend}`, {new} here"
        else:
            now_said = f"{s.flag} not given: the suite's `{s.key}: {_yaml(new)}`"
        raise KdbenchError(
            f"{now_said}: {where} was started with {s.said(old)}, and a continued run keeps its plan; continue it "
            f"with {s.said(old)}, or start a new run (without --resume, or another --run-id)"
        )


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else str(value)


def resume_command(args, run_id: str) -> str:
    """The command that continues run ``run_id`` as ``kdbench run``'s parsed ``args`` started it: its folder by id,
    every option it runs with (``args.resolved``: given, or kept from the record), and the invocation's own."""
    resolved: Resolved = args.resolved
    words = ["kdbench", "run", str(args.suite), "--out", str(args.out), "--resume", "--run-id", run_id]
    words += resolved.words() + ([f"--shard={args.shard[0]}/{args.shard[1]}"] if args.shard else [])
    words += ["--inline"] * args.inline + ["--no-report"] * args.no_report
    words += ["--report-dir", str(args.report_dir)] if str(args.report_dir) != "reports" else []
    words += ["--judge-contended"] * args.judge_contended + ["--allow-unjudged"] * args.allow_unjudged
    return shlex.join(words)
