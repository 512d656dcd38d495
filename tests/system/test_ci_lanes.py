"""The test lanes CI runs (.ci/tests): the unit tests and the benchmarks as two pytest runs, each printing its
slowest durations, and any non-zero exit code of either failing the script, 5 (no tests collected) included."""

import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.support.paths import ROOT

LANES = ROOT / ".ci" / "tests"


def _lanes(tmp_path: Path, *args: str, unit: int = 0, benchmarks: int = 0) -> tuple[int, list[str]]:
    """Run .ci/tests with a stand-in python that logs its arguments and exits ``unit`` or ``benchmarks``."""
    log = tmp_path / "calls"
    python = tmp_path / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {log}\n'
        f'case " $* " in *" benchmarks "*) exit {benchmarks} ;; *) exit {unit} ;; esac\n'
    )
    python.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "KDBENCH_PYTHON": str(python)}
    code = subprocess.run(["bash", str(LANES), *args], env=env, capture_output=True, timeout=60).returncode
    return code, log.read_text().splitlines() if log.exists() else []


def test_both_lanes_run_as_their_own_pytest_with_durations(tmp_path):
    code, calls = _lanes(tmp_path)
    assert code == 0
    assert [c.split()[:3] for c in calls] == [["-m", "pytest", "tests"], ["-m", "pytest", "benchmarks"]]
    assert all("--durations=25" in c.split() for c in calls)
    assert "--benchmark-compare" in calls[1] and "--benchmark-storage=file://benchmarks/baseline" in calls[1]
    assert "--benchmark" not in calls[0]  # the unit lane leaves the committed baseline alone


@pytest.mark.parametrize(("unit", "benchmarks", "want"), [(5, 0, 5), (0, 5, 5), (1, 0, 1), (0, 1, 1), (2, 5, 2)])
def test_any_nonzero_exit_of_either_lane_fails_and_both_lanes_run(tmp_path, unit, benchmarks, want):
    code, calls = _lanes(tmp_path, unit=unit, benchmarks=benchmarks)
    assert code == want and len(calls) == 2


def test_one_lane_takes_pytest_arguments(tmp_path):
    code, calls = _lanes(tmp_path, "unit", "-m", "not slow", unit=5)
    assert code == 5 and calls == ["-m pytest tests -n 2 --dist worksteal --durations=25 -m not slow"]
    assert _lanes(tmp_path, "everything")[0] == 2


def test_plain_pytest_is_the_unit_lane_and_slow_is_a_registered_marker():
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert options["testpaths"] == ["tests"]
    assert any(m.startswith("slow:") for m in options["markers"]) and "--strict-markers" in options["addopts"]
    assert "bash .ci/tests" in (ROOT / ".ci" / "run").read_text()
