"""The one error type a user can cause.

Anything raised as :class:`KdbenchError` is the user's to fix (a bad suite, an
unknown model, a backend this machine lacks).  The CLI prints its message on one
line, without a traceback, and exits with code 2.  Every other exception is a bug
or a failure inside a measurement.
"""


class KdbenchError(Exception):
    """A mistake the user can fix; the message says what to change."""

    exit_code = 2
