"""The checks of flag values the parsers share: each an argparse type whose mistake is a one-line
:class:`~kdbench.core.errors.KdbenchError` naming the flag."""

from __future__ import annotations

import os
from pathlib import Path

from kdbench.core.errors import KdbenchError


def number(kind: type, flag: str, low: float | None = None, high: float | None = None, above: bool = False):
    """An argparse type: a ``kind`` number within [low, high] (strictly above ``low`` with ``above``)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise KdbenchError(f"{flag}: expected a{'n integer' if kind is int else ' number'}, got {text!r}") from None
        if value != value or value in (float("inf"), float("-inf")):  # nan and inf compare as no bound would
            raise KdbenchError(f"{flag}: expected a finite number, got {text!r}")
        if (low is not None and (value <= low if above else value < low)) or (high is not None and value > high):
            bounds = f"> {low:g}" if above and high is None else f">= {low:g}" if high is None else f"{low:g}..{high:g}"
            raise KdbenchError(f"{flag}: must be {bounds}, got {text}")
        return value

    return parse


def out_file(text: str) -> Path:
    """An --out FILE: not an existing folder (its own folders are created when written, so they must be makeable)."""
    path = Path(text)
    if path.is_dir():
        raise KdbenchError(f"--out {text}: is a folder; give a file name, e.g. {path / 'compare.md'}")
    can_make("--out", path.parent, text)
    return path


def can_make(flag: str, folder: Path, text: str | None = None) -> None:
    """Refuse, as a one-line mistake naming ``flag``, a folder that cannot be made or written: a file on its path,
    or a nearest existing folder this process may not write (a read-only mount).  Checked when the command line
    is parsed, before anything runs; where the system refuses more than this sees (/proc), the folder's making
    says so in one line too (:func:`kdbench.store.files.make_folder`)."""
    text = str(folder) if text is None else text
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise KdbenchError(f"{flag} {text}: cannot make the folder: {existing} is a file; give another folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise KdbenchError(
            f"{flag} {text}: cannot write in {existing} (permission denied); give a folder you can write"
        )


def add_allow_unjudged(parser, what: str) -> None:
    """``--allow-unjudged``: exit 0, not :data:`~kdbench.core.errors.EXIT_NOT_JUDGED`, when the gate judged nothing."""
    from kdbench.core.errors import EXIT_NOT_JUDGED

    parser.add_argument(
        "--allow-unjudged",
        action="store_true",
        help=f"exit 0 when {what} judged nothing (every row contended, thin or one repeat a side); by default such "
        f"a gate exits {EXIT_NOT_JUDGED} (could not judge), so CI does not pass on nothing",
    )
