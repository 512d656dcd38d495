"""The one error type a user can cause.

Anything raised as :class:`KdbenchError` is the user's to fix (a bad suite, an
unknown model, a backend this machine lacks).  The CLI prints its message on one
line, without a traceback, and exits with code 2.  Every other exception is a bug
or a failure inside a measurement.
"""

import difflib
from collections.abc import Iterable

EXIT_NOT_JUDGED = 75
"""The exit code of a gate that could not judge: `compare` with no measurement judged, `run` with budgets of
which none was judged, a pytest session whose kdbench benchmarks were measured on a busy machine (every row
contended, thin or one repeat a side), unless ``--allow-unjudged``.  Not 0, so a CI gate does not go green on
nothing; not 1 (nothing regressed) nor 2 (no mistake); 75 is sysexits.h's EX_TEMPFAIL, "try again later", and is
free in pytest's own codes (0-5), which the plugin's sessions share."""


class KdbenchError(Exception):
    """A mistake the user can fix; the message says what to change."""

    exit_code = 2


def did_you_mean(
    word: str, choices: Iterable[str], n: int = 3, cutoff: float = 0.6, quote: bool = False, join: str = ""
) -> str:
    """'did you mean a, b? ' for the choices close to `word` (each quoted with `quote`, prefixed
    with `join`), else ''."""
    close = difflib.get_close_matches(word, list(choices), n=n, cutoff=cutoff)
    if not close:
        return ""
    names = [f"'{join}{c}'" if quote else f"{join}{c}" for c in close]
    return f"did you mean {', '.join(names)}? "
