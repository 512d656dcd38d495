"""Helpers the tests import (conftest.py holds fixtures only)."""

import contextlib
import logging
from pathlib import Path

import yaml

from kdbench.config.schema import CellConfig
from kdbench.core.schema import rows_to_table
from kdbench.store.derived import derive
from kdbench.store.results import MANIFEST, RunFolder


def make_config(**overrides) -> CellConfig:
    """A small valid cell: resnet8 -> resnet8 on 3x16x16 inputs, quick timing."""
    raw = {
        "pair": {"teacher": "resnet8", "student": "resnet8"},
        "batch_size": 4,
        "data": {"kind": "synthetic", "shape": [3, 16, 16], "num_classes": 10},
        "timing": {"warmup": 1, "min_iters": 3, "min_time_s": 0.0},
        "inference": {"batch_sizes": [1, 4]},
    }
    raw.update(overrides)
    return CellConfig.model_validate(raw)


def make_step(config: CellConfig, models=None):
    """The cell's DistillStep on the CPU: its pair built from seed 0 (or ``models``), its fixed batch."""
    import torch

    from kdbench.data.synthetic import synthetic_batch
    from kdbench.distill.step import DistillStep
    from kdbench.hw.backends import resolve
    from kdbench.models import build_model

    if models is None:
        torch.manual_seed(0)
        shape = tuple(config.data.shape)
        models = (
            build_model(config.pair.teacher, config.data.num_classes, shape),
            build_model(config.pair.student, config.data.num_classes, shape),
        )
    cpu = resolve("cpu")
    x, y = synthetic_batch(config, config.batch_size, cpu.device, 0)
    from kdbench.workloads import workload_of

    return DistillStep(models[0], models[1], x, y, config, cpu, workload_of(config))


def simulated_gpu(name: str = "cuda"):
    """A GPU backend whose tensors stay on the host: device type cuda, host clock, no-op synchronize (the
    ``name`` is the backend's: cuda or rocm)."""
    import torch

    from kdbench.hw.backends import Backend
    from kdbench.hw.clock import HostClock

    class SimulatedGpu(Backend):
        @property
        def device_type(self) -> str:
            return "cuda"

        def clock(self):
            return HostClock()

        def synchronize(self) -> None:
            pass

    return SimulatedGpu(name, torch.device("cpu"))


def run_folder(out: Path) -> RunFolder:
    """The one run folder a test's `kdbench run --out out` made."""
    runs = [RunFolder(p) for p in Path(out).iterdir() if (p / MANIFEST).is_file()]
    assert len(runs) == 1, runs
    return runs[0]


def foreground_run(cmd: list[str], **kwargs):
    """``cmd`` started as a terminal's foreground job: its own process group (Ctrl-C, SIGINT to the group, reaches it
    and its workers), SIGINT's default action whatever this test runner inherited (a shell starts background jobs
    with it ignored), in the repository's root, text pipes for stdout and stderr."""
    import signal
    import subprocess

    from tests.support.paths import ROOT

    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        **kwargs,
    )


def press_ctrl_c(proc, timeout_s: float = 60) -> tuple[str, str]:
    """What Ctrl-C does to a :func:`foreground_run` job: SIGINT to its whole process group; then its stdout and
    stderr once it has ended (within ``timeout_s``)."""
    import os
    import signal

    os.killpg(proc.pid, signal.SIGINT)
    return proc.communicate(timeout=timeout_s)


def kill_group(proc) -> None:
    """A :func:`foreground_run` job still running (a test that failed before it ended): SIGKILL to its group."""
    import os
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def planned_fit_check(tmp_path: Path, monkeypatch, flags: list[str], suite_line: str = "") -> list:
    """The ``fit_check`` a run's workers would get from ``kdbench run`` of a one-line suite (``suite_line`` added
    to it) with ``flags``: the run stops where it would plan its cells; one value per call."""
    from types import SimpleNamespace

    from kdbench import api
    from kdbench.cli.commands import cmd_run
    from kdbench.cli.parser import build_parser
    from kdbench.hw.backends import resolve
    from kdbench.run.engine import _setup

    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\n{suite_line}defaults:\n  pair: {{teacher: linear, student: linear}}\n")
    seen = []

    class Planned(Exception):
        pass

    def plan(suite, *args, **kwargs):
        seen.append(_setup(suite, resolve("cpu"), 1, SimpleNamespace(path=tmp_path, run_id="r")).options.fit_check)
        raise Planned

    monkeypatch.setattr(api, "plan", plan)
    try:
        cmd_run(build_parser().parse_args(["run", str(path), "--out", str(tmp_path / "res"), *flags]))
    except Planned:
        return seen
    raise AssertionError("the run did not reach its plan")


def write_suite(path: Path, **top) -> Path:
    """A suite file from top-level keys (``yaml.safe_dump``)."""
    path.write_text(yaml.safe_dump(top, sort_keys=False))
    return path


def as_read(rows: list[dict]):
    """Stored rows as :func:`kdbench.store.read_results` returns them: a DataFrame, derived columns computed."""
    return derive(rows_to_table(rows).to_pandas())


@contextlib.contextmanager
def log_lines(logger: str = "kdbench"):
    """The messages kdbench logs inside the block, as a list of strings (INFO and up)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    log = logging.getLogger(logger)
    handler, level = Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


_SPIN = (
    "import subprocess, sys\n"
    "spin = 'import time\\nend = time.time() + {s}\\nwhile time.time() < end: pass'\n"
    "quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    "ps = [subprocess.Popen([sys.executable, '-S', '-c', spin], start_new_session=True, **quiet) for _ in range({n})]\n"
    "print(' '.join(str(p.pid) for p in ps))\n"
)


@contextlib.contextmanager
def background_load(extra: int = 1, seconds: float = 8.0):
    """A bounded load of the test's own: as many CPU-bound processes as the usable cores, and ``extra`` more,
    outside this process's tree (their launcher exits, so they are not its descendants, as another user's would
    not be: kdbench leaves its own tree out of what others used); killed on leaving, and each ends by itself after
    ``seconds`` whatever becomes of the test (their output goes nowhere: the launcher's pipe closes with it)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from kdbench.hw.contention import usable_cores

    n = len(usable_cores()) + extra
    launched = subprocess.run(
        [sys.executable, "-S", "-c", _SPIN.format(s=seconds, n=n)], capture_output=True, text=True, check=True
    )
    pids = [int(pid) for pid in launched.stdout.split()]
    try:
        time.sleep(0.1)  # under way
        yield pids
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
