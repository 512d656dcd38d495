"""How long each shipped suite takes, read from the one file that records it (``suites/times.toml``): the figure,
how it was obtained (measured, rounded, an upper bound, extrapolated, or not measured), the machine, the date and
where it was first recorded.  ``kdbench list suites`` prints it and :mod:`kdbench.docgen` writes it into
docs/suites.md."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from kdbench.core.errors import KdbenchError

TIMES_FILE = "times.toml"  # in the suites folder
HOW = ("measured", "about", "under", "extrapolated", "not measured")
_KEYS = {"cpu_s", "how", "date", "machine", "source", "note", "gpu"}


@dataclass(frozen=True)
class SuiteTime:
    """One suite's recorded wall time on a CPU (``cpu_s`` None: not measured) and its GPU estimate."""

    cpu_s: float | None
    how: str
    machine: str
    date: str = ""
    source: str = ""
    note: str = ""
    gpu: str = ""
    own_machine: bool = False  # the entry names its machine (else: the file's default machine)

    def cpu_text(self) -> str:
        """The CPU time as a reader reads it: ``1 min 51 s``, ``about 20 min``, ``under 1 min 18 s``, ``about 2 h
        (extrapolated)``, ``not measured``."""
        if self.cpu_s is None:
            return "not measured"
        figure = duration(self.cpu_s, rounded=self.how in ("about", "extrapolated"))
        return {
            "measured": figure,
            "about": f"about {figure}",
            "under": f"under {figure}",
            "extrapolated": f"about {figure} (extrapolated)",
        }[self.how]

    def cpu_line(self) -> str:
        """The CPU time with its date, note and, where it is not the file's default, machine, on one line (what
        ``list suites`` prints)."""
        parts = [self.cpu_text()]
        if self.date:
            parts.append(self.date)
        if self.note:
            parts.append(self.note)
        if self.own_machine and self.cpu_s is not None:
            parts.append(f"on a {self.machine}")
        return "; ".join(parts)


def default_machine(times: dict[str, SuiteTime]) -> str:
    """The machine the figures of ``times`` were taken on unless an entry names its own ("" if none says)."""
    return next((t.machine for t in times.values() if not t.own_machine and t.machine), "")


def duration(seconds: float, rounded: bool = False) -> str:
    """``75 s``, ``1 min 51 s``, ``20 min``, ``2 h``; ``rounded``: to the largest unit alone past a minute."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        minutes, rest = divmod(s, 60)
        return f"{minutes} min" if rounded or not rest else f"{minutes} min {rest} s"
    hours, minutes = divmod(round(s / 60), 60)  # past an hour, to the minute
    return f"{hours} h" if rounded or not minutes else f"{hours} h {minutes} min"


def suite_times(folder: Path) -> dict[str, SuiteTime]:
    """Every entry of ``folder``/times.toml, by suite file name; a KdbenchError naming the file and the entry
    for a missing file or a malformed entry."""
    path = Path(folder) / TIMES_FILE
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KdbenchError(f"{path}: missing; it records how long each shipped suite takes") from None
    except tomllib.TOMLDecodeError as exc:
        raise KdbenchError(f"{path}: not valid TOML ({exc})") from None
    machine = data.pop("machine", "")
    times = {}
    for name, entry in data.items():
        where = f"{path} [{name!r}]"
        if not isinstance(entry, dict):
            raise KdbenchError(f"{where}: must be a table of cpu_s, how, date, source, note, gpu")
        unknown = sorted(set(entry) - _KEYS)
        if unknown:
            raise KdbenchError(f"{where}: unknown key {unknown[0]!r}; the keys are {', '.join(sorted(_KEYS))}")
        how = entry.get("how", "measured")
        if how not in HOW:
            raise KdbenchError(f"{where}: how = {how!r}; use one of {', '.join(HOW)}")
        cpu_s = entry.get("cpu_s")
        if (cpu_s is None) != (how == "not measured"):
            raise KdbenchError(f"{where}: give cpu_s with how = {how!r}, and leave it out with 'not measured'")
        if cpu_s is not None and (isinstance(cpu_s, bool) or not isinstance(cpu_s, int | float) or cpu_s <= 0):
            raise KdbenchError(f"{where}: cpu_s = {cpu_s!r}; give the seconds, a number > 0")
        fields = {k: str(entry[k]) for k in ("date", "source", "note", "gpu") if k in entry}
        own = "machine" in entry
        times[name] = SuiteTime(cpu_s, how, str(entry.get("machine", machine)), **fields, own_machine=own)
    return times
