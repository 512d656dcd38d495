"""The shipped-suites block (docs/suites.md): every suite of ``suites/`` with its cells, its own description and
the time recorded for it in ``suites/times.toml`` (how it was obtained, when, where it was first recorded), as
``kdbench list suites`` prints them."""

from __future__ import annotations

from kdbench.docgen.markdown import NONE, code, table


def suites_table() -> str:
    """The table, with the machine the CPU figures were taken on (the file's default; others in their row)."""
    from kdbench.api import shipped_suites
    from kdbench.config.suite_times import default_machine

    suites = shipped_suites()
    usual = default_machine({s.file: s.time for s in suites if s.time})
    rows = []
    for s in suites:
        name = code(f"suites/{s.file}") + (f" ({code(s.name)})" if s.name != s.file.removesuffix(".yaml") else "")
        t = s.time
        if t is None:
            cpu, gpu, source = "no entry in suites/times.toml", NONE, NONE
        else:
            cpu, gpu, source = t.cpu_line(), t.gpu or NONE, t.source or NONE
        rows.append((name, s.count, s.description, cpu, gpu, source))
    lead = (
        f"CPU: the wall time of `kdbench run SUITE --device cpu` on a {usual}, unless the row says otherwise; "
        "*about*: a rounded figure, *under*: an upper bound, *extrapolated*: from a part of the suite. "
        "One GPU: an estimate (no GPU run of the shipped suites has been recorded yet). The figures live in "
        "`suites/times.toml`, each with its source."
    )
    header = ["suite", "cells", "what it is", "2-core CPU", "one GPU (estimate)", "figure first recorded in"]
    return "\n".join([lead, "", *table(header, rows)])
