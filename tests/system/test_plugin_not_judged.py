"""The pytest plugin's gate that cannot judge (issue 45, item 1): a session whose kdbench benchmark was measured on
a busy machine (the host meter simulated: others on both cores) exits EXIT_NOT_JUDGED, not 0, and names the test;
--kdbench-allow-unjudged lets it pass; a quiet one passes; a failing one keeps pytest's code 1."""

from __future__ import annotations

import json
import textwrap

import pytest

from kdbench.core.errors import EXIT_NOT_JUDGED
from tests.system.test_pytest_plugin import _pytest

TEST = """
import kdbench.hw.contention as contention

if {busy}:  # others on both cores of two: the measurement reads a busy machine
    contention.HostMeter.result = lambda self: contention.HostLoad(1.0, 2, 2.0, 1)
else:
    contention.HostMeter.result = lambda self: contention.HostLoad(1.0, 2, 0.0, 1)

def test_student(kdbench):
    kdbench.inference({{"pair": {{"teacher": "linear", "student": "linear"}}}}, batch_size=1, rounds=3)
    assert {passes}
"""


@pytest.mark.parametrize(
    ("busy", "passes", "flags", "code"),
    [
        (True, True, [], EXIT_NOT_JUDGED),
        (True, True, ["--kdbench-allow-unjudged"], 0),
        (False, True, [], 0),
        (True, False, [], 1),  # a failed session keeps its own code
    ],
)
def test_a_contended_benchmark_does_not_pass_as_judged(tmp_path, busy, passes, flags, code):
    (tmp_path / "test_user.py").write_text(textwrap.dedent(TEST.format(busy=busy, passes=passes)))
    out = tmp_path / "out.json"
    proc = _pytest(["test_user.py", "--benchmark-json", str(out), *flags], tmp_path)
    assert proc.returncode == code, proc.stdout + proc.stderr
    [bench] = json.loads(out.read_text())["benchmarks"]
    assert bench["extra_info"]["contended"] is busy
    said = "kdbench: 1 benchmark(s) measured on a busy machine (contended)"
    assert (said in proc.stdout) is busy, proc.stdout
    if busy and code == EXIT_NOT_JUDGED:
        assert f"exit {EXIT_NOT_JUDGED}, not judged" in proc.stdout and "test_user.py::test_student" in proc.stdout
