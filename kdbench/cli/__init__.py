"""Command line: run, report, compare, export, fit, probe, env, list.  It parses (:mod:`.parser`) and prints
(:mod:`.commands`); :mod:`kdbench.api` does the work.

User mistakes (KdbenchError, bad command-line values included) print one line,
`kdbench: error: ...`, and exit 2.  `run` exits 0 when every runnable cell succeeded and every budget
held, 1 when a cell failed or a budget was missed, 130 when interrupted; `compare` exits 1 on a
significant regression.  A gate that judged nothing (compare, or the budgets: every row contended, thin or one
repeat a side) exits :data:`~kdbench.core.errors.EXIT_NOT_JUDGED` unless ``--allow-unjudged``.  Progress goes
through `logging` (logger ``kdbench``): INFO lines to stdout, warnings to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from kdbench.cli.commands import (
    cmd_compare,
    cmd_env,
    cmd_export,
    cmd_fit,
    cmd_list,
    cmd_probe,
    cmd_report,
    cmd_run,
)
from kdbench.cli.parser import build_parser
from kdbench.core.errors import KdbenchError

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run,
    "report": cmd_report,
    "compare": cmd_compare,
    "export": cmd_export,
    "env": cmd_env,
    "fit": cmd_fit,
    "probe": cmd_probe,
    "list": cmd_list,
}


class _Console(logging.Handler):
    """kdbench's log lines as a user sees them: the message alone, INFO to stdout, warnings to stderr
    (the streams looked up when written, so a caller's redirection applies)."""

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        stream.write(self.format(record) + "\n")
        stream.flush()


def configure_logging(level: int = logging.INFO) -> None:
    logger = logging.getLogger("kdbench")
    logger.handlers[:] = [_Console()]
    logger.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except KdbenchError as exc:
        print(f"kdbench: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("kdbench: interrupted", file=sys.stderr)
        return 130
