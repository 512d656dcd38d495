"""A suite's fake runs on helper processes (kdbench.fit.ahead): the same predictions and the same report as in one
process, how many helpers, and a helper that fails costs only time."""

from __future__ import annotations

import re

import pytest

from kdbench.config.schema import CellConfig
from kdbench.core.errors import KdbenchError
from kdbench.fit import ahead
from kdbench.fit.cells import fit_cells
from kdbench.fit.devices import find_device

PAIR = {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"}


def lm(**over) -> CellConfig:
    base = {"pair": PAIR, "method": "forward_kl", "batch_size": 2, "data": {"kind": "tokens", "seq_len": 16}}
    return CellConfig.model_validate(base | over)


@pytest.mark.slow
def test_helpers_give_the_report_one_process_gives(monkeypatch):
    cells = [lm(), lm(batch_size=4), lm(loss_impl="chunked", chunk_size=8), lm(compile="default")]
    devices = [find_device("H100", live=False)]
    said: list[str] = []
    serial = fit_cells(cells, devices, "cuda")
    monkeypatch.setenv(ahead.ENV, "2")
    helped = fit_cells(cells, devices, "cuda", progress=said.append)
    assert said[0] == "fit: 3 cells' fake runs started on 2 helper processes, taken in order"  # compile: a twin's
    assert sum(", on a helper (" in line for line in said) == 3
    assert helped.runs == serial.runs == 3

    def text(report):  # all but the seconds (each fake run's, the summary's)
        return [re.sub(r"fake run [0-9.]+ s", "fake run _ s", line) for line in report.lines[:-1]]

    assert text(helped) == text(serial)
    for a, b in zip(serial.cells, helped.cells):
        pa, pb = a.verdict.prediction, b.verdict.prediction
        assert (pa.peak_bytes, pa.phase, pa.breakdown) == (pb.peak_bytes, pb.phase, pb.breakdown)
        assert pa.census.records == pb.census.records


def test_how_many_helpers(monkeypatch):
    monkeypatch.delenv(ahead.ENV, raising=False)
    monkeypatch.setattr(ahead, "cores", lambda: 2)
    assert [ahead.processes_for(n) for n in (1, 2, 3, 52)] == [0, 0, 2, 2]
    monkeypatch.setattr(ahead, "cores", lambda: 16)
    assert ahead.processes_for(52) == ahead.MOST == 4 and ahead.processes_for(3) == 3
    monkeypatch.setattr(ahead, "cores", lambda: 1)
    assert ahead.processes_for(52) == 0
    monkeypatch.setenv(ahead.ENV, "1")
    assert ahead.processes_for(52) == 0
    monkeypatch.setenv(ahead.ENV, "3")
    assert ahead.processes_for(52) == 3 and ahead.processes_for(2) == 2
    for bad in ("0", "two", "-1", "1.5"):
        monkeypatch.setenv(ahead.ENV, bad)
        with pytest.raises(KdbenchError, match=f"KDBENCH_FIT_PROCESSES='{bad}': give a whole number of processes"):
            ahead.processes_for(52)


def test_a_stand_in_predict_is_never_sent_to_helpers(monkeypatch):
    monkeypatch.setenv(ahead.ENV, "2")
    assert ahead.start(lambda *a: None, set(), [lm(), lm(batch_size=4), lm(batch_size=8)], "cuda", False, None) is None


class _Failed:
    def get(self):
        raise RuntimeError("the helper died")


def test_a_helper_that_fails_leaves_the_fake_run_to_this_process():
    helpers = ahead.Ahead.__new__(ahead.Ahead)
    helpers._pending = {"k": _Failed()}
    assert helpers.take("k") is None and helpers.take("never submitted") is None
