"""Runs on disk: a run is a folder of parquet parts, one part per finished job.

    results/                         --out (default)
      <run id>/                      one run: read it with pandas, pyarrow.dataset or duckdb as one dataset
        _run.json                    the run's suite, file, start time and versions (ignored by parquet readers)
        _invocations/<id>.json       one file per `kdbench run` into the folder (each shard, each resume): the
                                     jobs it planned and finished, its budgets and wall-time split
        part-<job id>.parquet        the rows of one cell (or of the quality job), written once, atomically
      probes/  traces/               `kdbench probe` files and profiler traces: not results

Nothing is ever rewritten: a finished job's part appears whole (temporary name, then
rename) and stays as it is, so the cost of storing a job does not grow with the run,
a reader never sees half a part, a killed run loses at most the jobs in flight, and
resuming is listing the parts.  Shards of one sweep given the same run id write into
one folder (their parts never share a name).  Each invocation writes its own record
(never another's), so concurrent shards cannot lose each other's entries; together
the records say which jobs the run planned, and so whether it is complete
(:meth:`RunFolder.state`).

:func:`read_results` reads any mix of run folders, folders of runs, part files and the
single-file runs of schema version 1, and adds the derived columns
(:mod:`kdbench.store.derived`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa

from kdbench.core.errors import KdbenchError
from kdbench.core.schema import SCHEMA, SCHEMA_VERSION, rows_to_table
from kdbench.store.files import make_folder, write_parquet, write_text

logger = logging.getLogger(__name__)

MANIFEST = "_run.json"  # "_" and "." names are skipped by pyarrow datasets (and by kdbench's readers)
INVOCATIONS_DIR = "_invocations"  # one JSON record per `kdbench run` into the folder
PART_PREFIX, PART_SUFFIX = "part-", ".parquet"
PROBES_DIR = "probes"  # `kdbench probe` files, under a results folder
TRACES_DIR = "traces"  # profiler traces, under a results folder
RUN_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,199}"


def new_run_id(suite_name: str, now: datetime | None = None) -> str:
    """`<suite>-<UTC time>-<random>`: sortable, and unique even for two runs started together."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", suite_name).strip("-.")[:60] or "suite"
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")
    return f"{slug}-{stamp}-{uuid.uuid4().hex[:8]}"


def check_run_id(run_id: str) -> str:
    """A run id usable as a folder name beside probes/ and traces/; KdbenchError otherwise."""
    if not re.fullmatch(RUN_ID_PATTERN, run_id) or run_id in (PROBES_DIR, TRACES_DIR):
        raise KdbenchError(
            f"--run-id {run_id!r}: use letters, digits, '_', '.' and '-' (not starting with '.', '_' or '-'), "
            f"and not '{PROBES_DIR}' or '{TRACES_DIR}'"
        )
    return run_id


_JOB_ID = re.compile(r"(?P<cell>.+?)(?:-r(?P<repeat>[0-9]+))?")


def job_id(cell_id: str, repeat: int = 1) -> str:
    """A cell job's id: the cell's id, and ``-r<k>`` for repeats after the first (so raising ``repeat``
    and resuming runs only the new ones)."""
    return cell_id if repeat == 1 else f"{cell_id}-r{repeat}"


def parse_job_id(job: str) -> tuple[str, int]:
    """(cell_id, repeat) of a cell job's id (the quality job's id reads as itself, repeat 1)."""
    m = _JOB_ID.fullmatch(job)
    return (m["cell"], int(m["repeat"] or 1)) if m else (job, 1)


@dataclass(frozen=True)
class RunState:
    """What a run folder planned and what it holds: whether it is complete.

    ``planned`` is the union of the jobs every invocation planned (None for a run stored before
    kdbench kept invocation records, or a bare parquet file: completeness unknown).  ``stored`` holds the jobs
    whose part reads whole, as :func:`read_results` reads it: a part that cannot be read (cut short, scrambled) is
    no stored job, so compare and report count its job as missing, as a resumed run measures it again, and
    ``unreadable`` names each such part ('path: why')."""

    run_id: str
    planned: frozenset[str] | None
    stored: frozenset[str]
    invocations: int = 0
    unfinished: int = 0  # invocations that never wrote their end: still running, or killed
    unreadable: tuple[str, ...] = ()  # the parts that could not be read, each 'path: why' (their jobs not stored)

    @property
    def known(self) -> bool:
        return self.planned is not None

    @property
    def missing(self) -> frozenset[str]:
        """Planned jobs with no stored part."""
        return frozenset() if self.planned is None else self.planned - self.stored

    @property
    def complete(self) -> bool | None:
        return None if self.planned is None else not self.missing

    def missing_repeats(self, cell_id: str) -> list[int]:
        """The planned repeats of ``cell_id`` this run has not stored."""
        return sorted(r for c, r in map(parse_job_id, self.missing) if c == cell_id)

    def describe(self) -> str:
        bad = (
            f"; {len(self.unreadable)} part(s) could not be read, their jobs not counted as stored: "
            + "; ".join(self.unreadable)
            if self.unreadable
            else ""
        )
        if self.planned is None:
            return (
                "completeness unknown (no invocation records: a run stored by an older kdbench, or a bare file)" + bad
            )
        if not self.missing:
            return f"complete: {len(self.planned)} of {len(self.planned)} planned jobs stored{bad}"
        how = f"; {self.unfinished} invocation(s) did not finish (killed, or still running)" if self.unfinished else ""
        stored = len(self.planned) - len(self.missing)
        return f"INCOMPLETE: {stored} of {len(self.planned)} planned jobs stored{bad}{how}"


@dataclass(frozen=True)
class Invocation:
    """This invocation's record in a run folder: written when it starts, rewritten (only by it) when it ends."""

    path: Path
    record: dict[str, Any]

    def finish(self, **fields: Any) -> None:
        """Add the end of the invocation (finished jobs, wall-time split, how it ended) to its record."""
        self.record.update(fields, finished=datetime.now(UTC).isoformat())
        write_text(json.dumps(self.record, indent=2) + "\n", self.path)


@dataclass(frozen=True)
class RunFolder:
    """One run's folder of parts."""

    path: Path

    @property
    def run_id(self) -> str:
        return self.path.name

    def manifest(self) -> dict[str, Any]:
        try:
            return json.loads((self.path / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    def start_invocation(self, planned: list[str], share: list[str], **fields: Any) -> Invocation:
        """Write this invocation's record: every job of the whole plan (``planned``, the same for every
        shard), the jobs it is to run (``share``), and ``fields`` (shard, repeats, budgets, commit ...)."""
        now = datetime.now(UTC)
        name = f"{now:%Y%m%dT%H%M%S%fZ}-{os.getpid()}-{uuid.uuid4().hex[:6]}.json"
        record = {"started": now.isoformat(), "planned": list(planned), "share": list(share), **fields}
        path = self.path / INVOCATIONS_DIR / name
        write_text(json.dumps(record, indent=2) + "\n", path)
        return Invocation(path, record)

    def invocations(self) -> list[dict[str, Any]]:
        """Every invocation's record, oldest first."""
        records = []
        for path in sorted((self.path / INVOCATIONS_DIR).glob("*.json")):
            try:
                records.append(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError):
                continue  # a record being replaced, or not ours
        return records

    def state(self) -> RunState:
        """Planned against stored jobs (see :class:`RunState`)."""
        records = self.invocations()
        planned = frozenset(j for r in records for j in r.get("planned", [])) if records else None
        unfinished = sum("finished" not in r for r in records)
        stored, unreadable = set(), []
        for path in self.parts():
            why = unreadable_part(path)
            if why is None:
                stored.add(path.name[len(PART_PREFIX) : -len(PART_SUFFIX)])
            else:
                unreadable.append(f"{path}: {why}")
        return RunState(self.run_id, planned, frozenset(stored), len(records), unfinished, tuple(unreadable))

    def wall_times(self) -> list[dict[str, float]]:
        """The wall-time split of each invocation that finished (and those an older kdbench kept in the manifest)."""
        old = list(self.manifest().get("wall_time") or [])
        return old + [r["wall_time"] for r in self.invocations() if r.get("wall_time")]

    def budgets(self) -> list[dict[str, Any]]:
        """The budgets the run was measured against (the suite's ``budgets:``, as JSON): the newest
        invocation's, else what an older kdbench kept in the manifest."""
        for record in reversed(self.invocations()):
            if "budgets" in record:
                return list(record["budgets"] or [])
        return list(self.manifest().get("budgets") or [])

    def part_path(self, job_id: str) -> Path:
        return self.path / f"{PART_PREFIX}{job_id}{PART_SUFFIX}"

    def parts(self) -> list[Path]:
        return sorted(p for p in self.path.glob(f"{PART_PREFIX}*{PART_SUFFIX}") if p.is_file())

    def stored_job_ids(self, readable: bool = False) -> set[str]:
        """The jobs whose part is stored: resuming measures the others.  With ``readable`` (a run that resumes)
        only the parts that read whole count: a corrupted part (cut short by a full disk, scrambled) is named in a
        warning and its job runs again, its new part replacing it (reading every part costs a resumed run's start
        a few milliseconds a part)."""
        ids = set()
        for path in self.parts():
            if readable:
                why = unreadable_part(path)
                if why is not None:
                    logger.warning("%s: not a readable parquet file (%s); its job runs again", path, why)
                    continue
            ids.add(path.name[len(PART_PREFIX) : -len(PART_SUFFIX)])
        return ids

    def write_part(self, job_id: str, rows: list[dict[str, Any]]) -> Path:
        """Store a finished job's rows as its part (atomically; never rewritten)."""
        return write_parquet(rows_to_table(rows), self.part_path(job_id))


def open_run(
    out_dir: Path, suite_name: str, suite_file: str, run_id: str | None = None, options: dict | None = None
) -> RunFolder:
    """The run folder ``out_dir/run_id`` (a new id when None), created with its manifest if new (holding
    ``options``, the run's options as it starts: :mod:`kdbench.run.resume`).

    An existing folder continues (shards of one sweep share a run id); it must hold a
    run of the same suite.  The manifest is written once, when the folder is made; what each
    invocation planned, its budgets and its wall time go into its own record
    (:meth:`RunFolder.start_invocation`).
    """
    folder = RunFolder(Path(out_dir) / (check_run_id(run_id) if run_id else new_run_id(suite_name)))
    if folder.path.exists() and not folder.path.is_dir():
        raise KdbenchError(f"{folder.path} is a file; give another --run-id or --out")
    if (folder.path / MANIFEST).exists():
        other = folder.manifest().get("suite")
        if other != suite_name:
            raise KdbenchError(
                f"{folder.path} holds a run of suite '{other}', not '{suite_name}'; give another --run-id"
            )
        return folder
    import kdbench

    make_folder(Path(out_dir), "--out")  # one line, not a traceback, where it cannot be made (/proc/...)
    make_folder(folder.path, "--out")
    manifest = {
        "run_id": folder.run_id,
        "suite": suite_name,
        "suite_file": suite_file,
        "created": datetime.now(UTC).isoformat(),
        "schema_version": SCHEMA_VERSION,
        "kdbench_version": kdbench.__version__,
        **(options or {}),
    }
    write_text(json.dumps(manifest, indent=2) + "\n", folder.path / MANIFEST)
    return folder


def newest_run(out_dir: Path, suite_name: str) -> RunFolder | None:
    """The most recently started run of this suite in ``out_dir`` (for --resume), or None."""
    runs = []
    for path in Path(out_dir).glob(f"*/{MANIFEST}"):
        folder = RunFolder(path.parent)
        manifest = folder.manifest()
        if manifest.get("suite") == suite_name:
            runs.append((str(manifest.get("created", "")), folder.run_id, folder))
    return max(runs, key=lambda r: r[:2])[2] if runs else None


# --------------------------------------------------------------------------- reading


def _hidden(parts: Iterable[str]) -> bool:
    return any(p.startswith((".", "_")) or p == PROBES_DIR for p in parts)


def result_files(paths: Iterable[str | Path]) -> list[Path]:
    """Parquet files, or folders searched recursively for them (skipping probes/ and hidden or
    ``_`` names, as pyarrow datasets do), as a sorted list."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(q for q in p.rglob("*.parquet") if not _hidden(q.relative_to(p).parts)))
        elif p.is_file():
            files.append(p)
        else:
            raise KdbenchError(
                f"{p}: no such file or folder; give run folders, parquet files or folders that hold them"
            )
    return files


def run_folders(files: Iterable[Path]) -> list[RunFolder]:
    """The run folders (with a manifest) the result files lie in."""
    folders = {RunFolder(Path(f).parent) for f in files}
    return sorted((f for f in folders if (f.path / MANIFEST).is_file()), key=lambda f: str(f.path))


def run_budgets(files: Iterable[Path]) -> dict[str, list[dict[str, Any]]]:
    """Per run id: the budgets stored with the run folder each result file lies in."""
    found: dict[str, list[dict[str, Any]]] = {}
    for folder in run_folders(files):
        budgets = folder.budgets()
        if budgets:
            found[str(folder.manifest().get("run_id") or folder.run_id)] = budgets
    return found


def run_states(paths: Iterable[str | Path]) -> dict[str, RunState]:
    """Per run id: the state (planned against stored) of every run folder among ``paths``' result files."""
    files = result_files(list(paths))
    return {str(f.manifest().get("run_id") or f.run_id): f.state() for f in run_folders(files)}


UNREADABLE = "unreadable_parts"  # read_results' DataFrame.attrs key: the parts it skipped, each 'path: why'
_WARNED: set[tuple[str, str]] = set()  # the unreadable files this process has warned of
# The files this process has read whole, each with its (size, mtime) then: a run's state after its rows were read
# (compare, report) does not read them again; a file changed since (a resumed run's new part) is read again
_READ_WHOLE: dict[str, tuple[int, int]] = {}


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def _table(files: list[Path]) -> pa.Table:
    import pyarrow.dataset as ds  # here, not at the top: it imports pandas, which a run's writer and the fit need not

    stamps = {}
    for f in files:  # before reading: a file replaced while it is read is not taken for the one read
        try:
            stamps[str(f)] = _stamp(Path(f))
        except OSError:
            pass
    table = ds.dataset([str(f) for f in files], schema=SCHEMA, format="parquet").to_table()
    _READ_WHOLE.update(stamps)
    return table


def unreadable_part(path: Path) -> str | None:
    """Why the result file ``path`` cannot be read as :func:`read_results` reads it (None: it reads whole): one
    check for a run's state (compare, report), a resumed run and the readers, so they agree on what is stored."""
    try:
        if _READ_WHOLE.get(str(path)) == _stamp(path):
            return None
        _table([path])
    except (pa.ArrowException, OSError) as exc:
        return _why(exc)
    return None


def _why(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


def read_table(files: list[Path], skipped: list[str] | None = None) -> pa.Table:
    """The rows of ``files`` in SCHEMA (columns a file lacks are null), as one table.

    A file that cannot be read (a part cut short by a full disk, a corrupted copy) is skipped with a warning naming
    it, and listed in ``skipped`` ('path: why'), so one bad part does not hide a whole folder of good ones; when no
    file can be read, or the readable ones cannot be read together, it is a one-line error naming the file."""
    try:
        return _table(files)
    except (pa.ArrowException, OSError) as exc:
        together = exc
    good, bad = [], []
    for f in files:  # each alone: which ones are not readable parquet files of ours
        try:
            _table([f])
            good.append(f)
        except (pa.ArrowException, OSError) as exc:
            bad.append((f, _why(exc)))
    if not good:
        f, why = bad[0] if bad else (files[0], _why(together))
        raise KdbenchError(f"{f}: not a readable parquet file ({why}); remove it or pass other files")
    if not bad:
        raise KdbenchError(f"the result files cannot be read together ({' '.join(str(together).split())[:300]})")
    for f, why in bad:
        if (str(f), why) not in _WARNED:  # a report reads its folders twice (rows, budgets): one warning
            _WARNED.add((str(f), why))
            logger.warning(
                "%s: not a readable parquet file (%s); left out, the other %d file(s) read", f, why, len(good)
            )
        if skipped is not None:
            skipped.append(f"{f}: {why}")
    return _table(good)


def read_results(paths: Iterable[str | Path]):
    """Result files, run folders or folders of runs as one pandas DataFrame, derived columns included; the parts
    that could not be read, and were left out, are listed in its ``attrs[UNREADABLE]``."""
    from kdbench.store.derived import derive

    paths = list(paths)
    files = result_files(paths)
    if not files:
        raise KdbenchError(f"no .parquet result files in {', '.join(map(str, paths))}; run `kdbench run SUITE` first")
    skipped: list[str] = []
    df = derive(read_table(files, skipped).to_pandas())
    df.attrs[UNREADABLE] = skipped
    return df
