"""The accuracy ledger in the report and in ``compare``: how far each LM cell's loss and gradients, computed by its
``loss_impl`` in its precision, lie from float64 (the step rows' ``loss_rel_err`` and ``grad_rel_err``, measured by
:mod:`kdbench.distill.lm.ledger`), and the bound ``compare`` holds a faster cell to.

* :func:`ledger_table`: per source, pair, ``loss_impl``, precision and objective (``loss_objective``), the worst
  errors over the cells that share them (sequence lengths, batch sizes, repeats), and why a cell has none (skipped
  where the precision does not run here; a ledger not taken or failed: its note).
* :func:`beyond_bound`: the NEW run's cells whose ``loss_rel_err`` or ``grad_rel_err`` exceeds ``bound``, each
  with the verdict ``compare`` gave its step (:class:`LedgerFlag`): a faster cell whose error is beyond the bound
  is never called an improvement silently (a note; a gate with ``compare --gate-loss-err``).

Torch-free: it reads DataFrames only.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from kdbench.core.limits import MAX_LOSS_ERR
from kdbench.core.names import Measurement, Status
from kdbench.report.charts import with_keys
from kdbench.report.format import MISSING

ERRORS = ("loss_rel_err", "grad_rel_err")  # what the bound applies to
PARTS = ("grad_rel_err_hidden", "grad_rel_err_head")
LEDGER_KEY = ["source", "pair", "loss_impl", "precision", "loss_objective"]
_NOTE = "accuracy ledger"


def _steps(df: pd.DataFrame) -> pd.DataFrame:
    """The distill_step rows of LM cells (a loss_impl), every ledger column present."""
    if df.empty or "loss_impl" not in df or "measurement" not in df:
        return df.iloc[0:0]
    wanted = [*ERRORS, *PARTS, "loss_objective", "notes", "error"]
    df = df.reindex(columns=list(dict.fromkeys([*df.columns, *wanted])))
    return df[df["measurement"].eq(Measurement.DISTILL_STEP) & df["loss_impl"].notna()]


def _ledger_note(notes) -> str:
    """The ledger's own note of a row (why it was not taken, or failed), "" for none."""
    if not isinstance(notes, str):
        return ""
    return "; ".join(n for n in notes.split("; ") if n.startswith(_NOTE))


def ledger_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per :data:`LEDGER_KEY` (the precision with the teacher's where it differs): ``cells`` (how many
    cells share it), ``measured`` (of those, how many carry the ledger), the worst (largest) ``loss_rel_err``,
    ``grad_rel_err``, ``grad_rel_err_hidden`` and ``grad_rel_err_head`` over them, ``vocab_size`` (the largest),
    ``status`` (ok when one cell was) and ``why`` (a ledger note, or a cell's error where none ran: a bf16 cell
    skipped on a CPU without bf16)."""
    rows = _steps(df)
    columns = [*LEDGER_KEY, "cells", "measured", *ERRORS, *PARTS, "vocab_size", "status", "why"]
    if rows.empty:
        return pd.DataFrame(columns=columns)
    rows = with_keys(rows)
    teacher = rows["teacher_precision"] if "teacher_precision" in rows else rows["precision"]
    differs = teacher.notna() & teacher.ne(rows["precision"])
    rows["precision"] = rows["precision"].where(~differs, rows["precision"] + " (teacher " + teacher + ")")
    rows["loss_objective"] = rows["loss_objective"].fillna(MISSING)
    out = []
    for key, group in rows.groupby(LEDGER_KEY, sort=False, dropna=False):
        ok = group[group["status"].eq(Status.OK)]
        errors = {c: pd.to_numeric(ok[c], errors="coerce").max() for c in (*ERRORS, *PARTS)}
        notes = [n for n in map(_ledger_note, ok["notes"]) if n]
        if ok.empty:
            last = group.iloc[-1]
            notes = [f"{last['status']}: {last['error']}" if isinstance(last["error"], str) else str(last["status"])]
        out.append(
            {
                **dict(zip(LEDGER_KEY, key)),
                "cells": group["cell_id"].nunique(),
                "measured": ok.loc[pd.to_numeric(ok["loss_rel_err"], errors="coerce").notna(), "cell_id"].nunique(),
                **errors,
                "vocab_size": pd.to_numeric(group["vocab_size"], errors="coerce").max(),
                "status": Status.OK if not ok.empty else group["status"].iloc[-1],
                "why": "; ".join(dict.fromkeys(notes)),
            }
        )
    return pd.DataFrame(out, columns=columns)


def format_err(x) -> str:
    """A relative error to 2 significant digits in scientific notation (``3.1e-07``)."""
    return MISSING if pd.isna(x) else f"{float(x):.1e}"


def ledger_rows(table: pd.DataFrame, bound: float = MAX_LOSS_ERR) -> list[dict]:
    """The report's ledger table, formatted; ``beyond``: an error above ``bound``."""
    out = []
    for r in table.to_dict("records"):
        worst = max((r[c] for c in ERRORS if pd.notna(r[c])), default=None)
        out.append(
            {
                **{k: str(r[k]) for k in LEDGER_KEY},
                "cells": int(r["cells"]),
                "measured": int(r["measured"]),
                **{c: format_err(r[c]) for c in (*ERRORS, *PARTS)},
                "vocab_size": MISSING if pd.isna(r["vocab_size"]) else f"{int(r['vocab_size']):,}",
                "ok": r["status"] == Status.OK,
                "beyond": worst is not None and worst > bound,
                "why": r["why"],
            }
        )
    return out


# --------------------------------------------------------------------------------------------------- compare


@dataclass(frozen=True)
class LedgerFlag:
    """A NEW cell whose ledger error exceeds the bound, and the verdict its step got."""

    cell_id: str
    label: str
    verdict: str  # the step's verdict ("improved", "unchanged", ...; "" where it has none)
    errors: tuple[tuple[str, float], ...]  # each error column beyond the bound, with its value

    @property
    def improved(self) -> bool:
        return self.verdict == "improved"

    def text(self) -> str:
        errors = ", ".join(f"{name} {value:.1e}" for name, value in self.errors)
        called = f" (its step: {self.verdict})" if self.verdict else ""
        return f"{self.label}{called}: {errors}"


def beyond_bound(new: pd.DataFrame, verdicts: dict[str, tuple[str, str]], bound: float) -> list[LedgerFlag]:
    """The cells of ``new`` (its ok LM step rows, repeats taken at their worst) whose ``loss_rel_err`` or
    ``grad_rel_err`` exceeds ``bound``; ``verdicts``: cell_id -> (label, verdict) of its distill_step change."""
    rows = _steps(new)
    rows = rows[rows["status"].eq(Status.OK)]
    flags = []
    for cell_id, group in rows.groupby("cell_id", sort=False):
        worst = {c: pd.to_numeric(group[c], errors="coerce").max() for c in ERRORS}
        over = tuple((c, float(v)) for c, v in worst.items() if pd.notna(v) and v > bound)
        if over:
            label, verdict = verdicts.get(str(cell_id), (str(cell_id)[:12], ""))
            flags.append(LedgerFlag(str(cell_id), label, verdict, over))
    return flags


def ledger_note(flags: list[LedgerFlag], bound: float, gated: bool) -> str:
    """compare's note on the cells beyond the bound ("" for none): which, their errors, the bound, and whether
    a faster one fails the gate."""
    if not flags:
        return ""
    improved = sum(f.improved for f in flags)
    what = (
        f"{improved} of them faster (improved), which "
        + ("fails the gate (--gate-loss-err)" if gated else "is no improvement of the same loss")
        if improved
        else "none of them called improved"
    )
    cells = "; ".join(f.text() for f in flags)
    return (
        f"accuracy ledger: {len(flags)} NEW cell(s) compute their loss beyond the bound (loss_rel_err or "
        f"grad_rel_err against float64 > {bound:g}, --max-loss-err), {what}: {cells}"
    )
