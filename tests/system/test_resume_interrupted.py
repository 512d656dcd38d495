"""Issue 45, item 5: a run started with `--repeat 3`, interrupted with Ctrl-C and resumed with the command it printed
said "2 of 2 jobs already stored, 0 to go" and left a 1-repeat run.  A real run, interrupted as a terminal does
(SIGINT to the whole foreground group) once its first job is stored, then resumed with the exact printed command:
every cell ends with its three repeats, each stored once."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

import pyarrow.parquet as pq

from tests.support.helpers import foreground_run, kill_group, press_ctrl_c, run_folder, write_suite
from tests.support.paths import ROOT
from tests.support.suites import tiny_suite

# two cells (as the user's), each job half a second of timing at least: the interrupt lands with jobs to go
SUITE = tiny_suite(
    name="resume-repeats",
    defaults={"timing": {"min_time_s": 0.5}, "inference": {"batch_sizes": []}},
    matrix={"seed": [0, 1]},
)


def _parts(out) -> list:
    return sorted(out.glob("*/part-*.parquet"))


def test_a_repeat_3_run_interrupted_and_resumed_with_the_printed_command_has_three_repeats(tmp_path):
    suite, out = write_suite(tmp_path / "s.yaml", **SUITE), tmp_path / "res"
    cmd = [sys.executable, "-m", "kdbench", "run", str(suite), "--out", str(out), "--no-report", "--repeat", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = foreground_run(cmd, env=env)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and not _parts(out):
            time.sleep(0.1)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        _, err = press_ctrl_c(proc)
    finally:
        kill_group(proc)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    stored = len(_parts(out))
    assert 1 <= stored < 6, stored
    printed = err.split("resume with:\n", 1)[1].splitlines()[0].strip()
    words = shlex.split(printed)
    assert words[:2] == ["kdbench", "run"] and "--repeat" in words and words[words.index("--repeat") + 1] == "3"
    again = subprocess.run(
        [sys.executable, "-m", "kdbench", *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )
    assert again.returncode == 0, again.stderr[-2000:]
    said = again.stdout + again.stderr  # the log lines go to stdout
    assert f"{stored} of 6 jobs already stored, {6 - stored} to go" in said, said[-2000:]
    folder = run_folder(out)
    rows = [pq.read_table(p, columns=["cell_id", "repeat", "measurement"]).to_pylist() for p in folder.parts()]
    steps = [r for part in rows for r in part if r["measurement"] == "distill_step"]
    repeats: dict[str, list[int]] = {}
    for r in steps:
        repeats.setdefault(r["cell_id"], []).append(r["repeat"])
    assert len(repeats) == 2 and all(sorted(r) == [1, 2, 3] for r in repeats.values()), repeats
    assert folder.state().complete
