"""The one error type a user can cause.

Anything raised as :class:`KdbenchError` is the user's to fix (a bad suite, an
unknown model, a backend this machine lacks).  The CLI prints its message on one
line, without a traceback, and exits with code 2.  Every other exception is a bug
or a failure inside a measurement.
"""

import difflib
from collections.abc import Iterable


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
