"""What a run says while it goes and after: one progress line per finished job (its main figures, the count done,
the time left), and where the run's wall time went (:class:`WallSplit`)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from kdbench.core.names import Measurement, Status
from kdbench.core.schema import Row
from kdbench.run.jobs import Job

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobTiming:
    job_id: str
    label: str
    wall_s: float  # from handing the job to a worker until its part was stored
    worker_s: float  # inside the worker, running the job


class WallSplit:
    """Where the run's wall time went, from the moment the interpreter imported kdbench (``kdbench.STARTED``;
    not the OS process's creation, which a shell that execs python after other commands would move
    back): the workers' categories (:mod:`kdbench.measure.walltime`), their process starts, the
    environment capture, writing, the report and the budget checks, and what is left, which makes it add
    up.  Warming up and measuring are the share that measures; the cold calls (compiles, autotuning,
    first-use set-up) and everything else are the harness's or the levers'."""

    MEASURES = ("warm-up", "measuring")

    def __init__(self) -> None:
        import kdbench

        self.start = time.time()
        self.before = max(0.0, self.start - kdbench.STARTED)  # imports, suite loading and the plan
        self.seconds: dict[str, float] = {"start-up, imports and plan": self.before}
        self.total: float | None = None

    def add(self, category: str, seconds: float) -> None:
        self.seconds[category] = self.seconds.get(category, 0.0) + max(0.0, seconds)

    def job(self, wall_s: float, worker_s: float, split: dict[str, float], writing_s: float) -> None:
        from kdbench.run.workers import PROCESS_START

        split = dict(split)
        started = split.pop(PROCESS_START, 0.0)
        for category, seconds in split.items():
            self.add(category, seconds)
        self.add(PROCESS_START, started)
        self.add("worker, other", worker_s - sum(split.values()))
        self.add("writing", writing_s)
        self.add("engine and pipe", wall_s - worker_s - started - writing_s)

    def finish(self) -> dict[str, float]:
        total = self.before + time.time() - self.start
        self.add("engine and pipe", total - sum(self.seconds.values()))  # set-up before the first job, close
        self.total = total
        return {k: round(v, 3) for k, v in self.seconds.items() if v > 0.0005} | {"total": round(total, 3)}

    @classmethod
    def line(cls, split: dict[str, float]) -> str:
        total = split["total"]
        parts = sorted(((k, v) for k, v in split.items() if k != "total"), key=lambda kv: -kv[1])
        shown = ", ".join(f"{k} {v:.1f} s ({v / total:.0%})" for k, v in parts)
        measuring = sum(split.get(k, 0.0) for k in cls.MEASURES) / total if total else 0.0
        return f"wall time {total:.1f} s: {shown}; warming up or measuring: {measuring:.0%}"


def _fmt_s(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _ms(x: float) -> str:
    """A time as a progress line writes it: 3 significant digits, thousands separated, never in powers of ten
    (``6,390``, not ``6.39e+03``; ``0.0123``), as the report's tables (:func:`kdbench.report.format.format_ms`, not
    imported: the report package brings matplotlib into the run's process)."""
    x = float(f"{float(x):.3g}")
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    return f"{x:,.{max(0, 2 - math.floor(math.log10(abs(x))))}f}"


def summary_line(rows: list[Row]) -> str:
    """The main figures of a finished job, for its progress line."""
    bad = [r for r in rows if r["status"] != Status.OK]
    if bad and len({(r["status"], r.get("error")) for r in bad}) == 1 and len(bad) == len(rows):
        return f"{str(bad[0]['status']).upper()}: {bad[0].get('error') or ''}"  # its whole first line (error_text)
    quality = [r for r in rows if r["measurement"] == Measurement.QUALITY]
    if quality:
        reused = sum("reused: trained by an earlier invocation" in (r.get("notes") or "") for r in quality)
        kept = f", {reused} of them from the models an earlier invocation kept" if reused else ""
        return f"{len(quality)} quality rows{kept}" + (f", {len(bad)} FAILED" if bad else "")
    from kdbench.store.derived import speedups

    speedup = speedups(rows)
    parts = []
    for row in rows:
        m = row["measurement"]
        if row["status"] != Status.OK:
            parts.append(f"{m}@{row['batch_size']} {str(row['status']).upper()}: {row.get('error') or ''}")
        elif m == Measurement.DISTILL_STEP:
            noisy = " NOISY" if row["noisy"] else ""
            if row.get("contended"):  # measured on a busy machine (kdbench.hw.contention)
                share = row.get("host_busy_share")
                noisy += " CONTENDED" + (f" (host_busy_share {share:.2f})" if share is not None else "")
            rate = (
                f"{row['tokens_per_s']:,.0f} tokens/s"
                if row.get("tokens_per_s") is not None
                else f"{row['throughput']:,.0f} samples/s"
            )
            parts.append(f"step {_ms(row['median_ms'])} ms ±{row['rel_iqr']:.0%}{noisy} ({rate})")
        elif m == Measurement.SPECULATIVE_DECODE:  # the teacher with the student as its draft
            teacher = [r for r in rows if r["measurement"] == Measurement.TEACHER_DECODE and r["batch_size"] == 1]
            ok = teacher and teacher[0]["status"] == Status.OK and row["median_ms"]
            x = f", {teacher[0]['median_ms'] / row['median_ms']:.1f}x teacher decode" if ok else ""
            alpha = "" if row.get("spec_alpha") is None else f" α {row['spec_alpha']:.2f}"
            what = f"speculative γ{row.get('draft_tokens')} T{row.get('spec_temperature') or 0:g}"
            parts.append(f"{what}{alpha} {_ms(row['median_ms'])} ms{x}")
        elif (str(m), row["batch_size"]) in speedup:
            bs, x = row["batch_size"], speedup[(str(m), row["batch_size"])]
            what = "student" if m == Measurement.STUDENT_INFERENCE else str(m).replace("_", " ")
            rate = f", {row['tokens_per_s']:,.0f} tokens/s" if row.get("tokens_per_s") is not None else ""
            parts.append(f"{what}@{bs} {_ms(row['median_ms'])} ms{rate} ({x:.1f}x teacher)")
    return "; ".join(parts)


class Progress:
    """One line per finished job: its figures, the count done, the time elapsed and an estimate of what is left.

    The estimate leaves out what a job paid once, not per cell (a worker's start and imports, building
    a model the cache then keeps): the first cell's start-up would otherwise multiply into every later one."""

    def __init__(self, total: int):
        self.total, self.seen, self.started, self.once = total, 0, time.monotonic(), 0.0

    def done(self, job: Job, rows: list[Row], once_s: float = 0.0) -> None:
        self.seen += 1
        self.once += once_s
        head = f"[{self.seen}/{self.total}] {job.progress_label}"
        if not rows:
            logger.info("%s: measured with the other nodes; the node that ran global rank 0 stores its rows", head)
            return
        elapsed = time.monotonic() - self.started
        left = max(0.0, elapsed - self.once) / self.seen * (self.total - self.seen)
        logger.info("%s: %s  | %s elapsed, ~%s left", head, summary_line(rows), _fmt_s(elapsed), _fmt_s(left))
