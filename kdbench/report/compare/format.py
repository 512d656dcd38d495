"""A :class:`kdbench.report.compare.verdicts.Comparison` written out: text for a terminal, markdown for a pull
request, json and csv for scripts.  Formatting only: the verdicts are decided in compare.py."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pandas as pd

from kdbench.core.errors import EXIT_NOT_JUDGED, KdbenchError
from kdbench.report.compare.verdicts import Change, Comparison, Side, Verdict

FORMATS = ("text", "markdown", "json", "csv")
_QUIET = (Verdict.UNCHANGED, Verdict.UNJUDGED)  # counted, not listed one by one in text


def _ms(x) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"


def _ratio(c: Change) -> str:
    if c.ratio is None:
        return "—"
    interval = f" [{c.ci_low:.3f}, {c.ci_high:.3f}]" if c.ci_low is not None else ""
    return f"{c.ratio:.3f}{interval}" + ("" if c.gated else " (not judged)")


def records(cmp: Comparison) -> list[dict]:
    bad = cmp.policy.bad()
    return [{**asdict(c), "verdict": str(c.verdict), "fails_gate": c.verdict in bad} for c in cmp.changes]


def summary(cmp: Comparison) -> str:
    """'2 regressed, 1 failed, 17 unchanged' in verdict order."""
    return ", ".join(f"{n} {v}" for v in Verdict if (n := cmp.count(v)))


def verdict_line(cmp: Comparison) -> str:
    if cmp.bad:
        return f"verdict: FAIL, {len(cmp.bad)} measurement(s) fail the gate"
    if cmp.rated == 0:
        code = "exit 0 (--allow-unjudged)" if cmp.policy.allow_unjudged else f"exit {EXIT_NOT_JUDGED}, not judged"
        return f"verdict: nothing was judged (see the notes): no regression can be claimed either way; {code}"
    return f"verdict: no significant regression in {cmp.rated} judged measurement(s)"


def header(cmp: Comparison) -> list[str]:
    def side(s: Side) -> str:
        state = ""
        if s.state is not None:
            state = "; INCOMPLETE" if s.incomplete else "; complete" if s.state.complete else ""
        return f"{s.label} (run {', '.join(s.run_ids)}; {', '.join(s.devices) or '?'}; {s.repeats} repeat(s){state})"

    each = f" (each interval at {cmp.each:.4g})" if cmp.rated else ""
    if cmp.looks:
        each = f" over {len(cmp.looks)} look(s), each at its share of it (the notes)"
    return [
        f"BASE {side(cmp.base)}",
        f"NEW  {side(cmp.new)}",
        f"ratio NEW/BASE of the centres (geometric mean of the repeats' medians), with t-intervals between repeats "
        f"whose bounds hold at {cmp.confidence:.0%} for the {cmp.rated} judged measurement(s) together{each}; "
        f"significant when the interval excludes 1 and the ratio is beyond ±{cmp.threshold:.0%}: {summary(cmp)}",
        *(f"note: {n}" for n in cmp.notes()),
    ]


def format_text(cmp: Comparison) -> str:
    lines = header(cmp)
    bad = cmp.policy.bad()
    for verdict in Verdict:
        changes = [c for c in cmp.changes if c.verdict == verdict]
        if not changes or verdict in _QUIET:
            continue
        worst = ", worst first" if verdict == Verdict.REGRESSED else ""
        gate = " (fail the gate)" if verdict in bad else ""
        lines.append(f"\n{str(verdict).upper()} ({len(changes)}){gate}{worst}:")
        for c in changes:
            times = f"{_ms(c.base_median_ms)} -> {_ms(c.new_median_ms)} ms" if c.ratio is not None else ""
            extra = "  ".join(x for x in (times, _ratio(c) if c.ratio is not None else "", c.note) if x)
            lines.append(f"  {c.name}  {extra}".rstrip())
    for verdict in _QUIET:
        if cmp.count(verdict):
            lines.append(f"\n{cmp.count(verdict)} measurement(s) {verdict}")
    lines.append(verdict_line(cmp))
    return "\n".join(lines) + "\n"


def format_markdown(cmp: Comparison) -> str:
    lines = [f"- {h}" for h in header(cmp)] + [f"- {verdict_line(cmp)}"]
    lines += [
        "",
        "| verdict | cell | measurement | batch | base centre (ms) | new centre (ms) | ratio [interval] | repeats "
        "| note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cmp.changes:
        cells = [str(c.verdict), c.cell_label, c.measurement, "" if c.batch_size is None else str(c.batch_size)]
        cells += [_ms(c.base_median_ms), _ms(c.new_median_ms), _ratio(c), f"{c.base_repeats} / {c.new_repeats}"]
        cells.append(c.note)
        lines.append("| " + " | ".join(x.replace("|", "\\|") for x in cells) + " |")
    return "\n".join(lines) + "\n"


def _side_doc(s: Side) -> dict:
    doc = {k: v for k, v in asdict(s).items() if k != "state"}
    state = s.state
    doc["complete"] = None if state is None else state.complete
    doc["missing_jobs"] = [] if state is None else sorted(state.missing)
    doc["unreadable_parts"] = [] if state is None else list(getattr(state, "unreadable", ()))  # each 'path: why'
    return doc


def format_json(cmp: Comparison) -> str:
    doc = {
        "base": _side_doc(cmp.base),
        "new": _side_doc(cmp.new),
        "threshold": cmp.threshold,
        "confidence": cmp.confidence,
        "confidence_each": cmp.each,
        "judged": cmp.rated,
        "policy": asdict(cmp.policy),
        "regressions": cmp.count(Verdict.REGRESSED),
        "failing": len(cmp.bad),
        "exit_code": cmp.exit_code,
        "notes": cmp.notes(),
        "changes": records(cmp),
    }
    return json.dumps(doc, indent=2) + "\n"


def format_csv(cmp: Comparison) -> str:
    columns = [*Change.__dataclass_fields__, "fails_gate"]
    return pd.DataFrame(records(cmp), columns=columns).to_csv(index=False)


def render(cmp: Comparison, fmt: str) -> str:
    formats = {"text": format_text, "markdown": format_markdown, "json": format_json, "csv": format_csv}
    if fmt not in formats:
        raise KdbenchError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    return formats[fmt](cmp)
