"""benchmarks/device/: fetch_wheels.py fetches kdbench's dependencies as wheels where pip reaches a
registry; run_check.py, on a GPU box without network, installs those the box lacks into a private
folder and runs gpu_check.py under a hard timeout. Here the box is this interpreter, made to look
bare with run_check's test hook (KDBENCH_DEVICE_PRETEND_MISSING). Fetching needs the package
registry: without it the fetch test fails, it does not skip."""

from __future__ import annotations

import ast
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.paths import ROOT

DEVICE = ROOT / "benchmarks" / "device"
FETCH = DEVICE / "fetch_wheels.py"
RUNNER = DEVICE / "run_check.py"
VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"
PRETEND = "KDBENCH_DEVICE_PRETEND_MISSING"
CPU_MATH_ONLY = ["--device", "cpu", "--skip", "clocks", "telemetry", "memory", "phases", "probe", "suite"]


def _this_platform() -> str:
    libc, version = platform.libc_ver()
    if sys.platform != "linux" or libc != "glibc":
        pytest.skip("the device scripts fetch manylinux wheels: they need a glibc Linux")
    major, minor = version.split(".")[:2]
    return f"manylinux_{major}_{minor}_{platform.machine()}"


def _run(script: Path, *args, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != PRETEND}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=ROOT,
        check=False,
    )


@pytest.fixture(scope="module")
def common():
    """_device_common and _device_install, imported as run_check.py imports them (its folder on sys.path)."""
    sys.path.insert(0, str(DEVICE))
    try:
        import _device_common
        import _device_install

        yield _device_common, _device_install
    finally:
        sys.path.remove(str(DEVICE))


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    """jinja2 and what it needs (markupsafe), fetched for this interpreter's python and platform."""
    dest = tmp_path_factory.mktemp("wheels")
    done = _run(FETCH, "--python-version", VERSION, "--platform", _this_platform(), "--dest", dest, "--only", "jinja2")
    assert done.returncode == 0, (
        "fetch_wheels.py failed: this test downloads two small wheels from the package registry "
        f"and needs it reachable.\n{done.stdout}\n{done.stderr}"
    )
    return dest


# ---- fetch_wheels.py


def test_fetch_brings_the_wheels_with_their_dependencies_and_a_manifest_and_never_torch(wheels):
    names = sorted(p.name for p in wheels.glob("*.whl"))
    assert [n.split("-")[0].lower() for n in names] == ["jinja2", "markupsafe"], names
    manifest = (wheels / "MANIFEST.txt").read_text()
    assert all(f"  {n}\n" in manifest for n in names)
    assert f"python-version: {VERSION}\n" in manifest
    assert "never fetched: torch torchvision" in manifest
    assert not any(n.lower().startswith(("torch-", "torchvision-")) for n in names)


def test_fetch_refuses_torch_and_an_interpreter_kdbench_does_not_support(tmp_path):
    done = _run(FETCH, "--python-version", VERSION, "--dest", tmp_path, "--only", "torch")
    assert done.returncode != 0 and "never fetched" in done.stdout + done.stderr
    done = _run(FETCH, "--python-version", "3.9", "--dest", tmp_path)
    assert done.returncode != 0 and "kdbench needs Python >=3.11" in done.stderr
    assert not list(tmp_path.glob("*.whl"))


# ---- run_check.py: what the box lacks, and installing it


def test_check_finds_nothing_missing_in_this_environment():
    done = _run(RUNNER, "--check")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "missing: (none)"
    assert "ok       torch" in done.stdout


def test_check_lists_what_the_box_lacks_for_fetch_wheels_only():
    done = _run(RUNNER, "--check", env={PRETEND: "jinja2,pyyaml"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "missing: jinja2 pyyaml"
    assert f"fetch_wheels.py --python-version {VERSION} --platform manylinux_" in done.stdout
    assert "--only jinja2 pyyaml" in done.stdout


FAKE_CHECK = """
import json, sys
import jinja2, markupsafe
print(json.dumps({"jinja2": jinja2.__file__, "markupsafe": markupsafe.__file__, "argv": sys.argv[1:]}))
sys.exit(3)
"""


def test_the_runner_installs_what_the_box_lacks_into_its_target_and_the_check_sees_it_first(wheels, tmp_path):
    script = tmp_path / "fake_check.py"
    script.write_text(FAKE_CHECK)
    target, out = tmp_path / "deps", tmp_path / "out"
    done = _run(
        RUNNER,
        *("--wheels", wheels, "--target", target, "--out", out, "--script", script, "--timeout", 120),
        *("--", "--quick", "--anything"),
        env={PRETEND: "jinja2"},
    )
    assert done.returncode == 3, done.stdout + done.stderr  # the check's own exit code
    seen = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert Path(seen["jinja2"]).is_relative_to(target)  # installed here: the box "lacks" it
    assert not Path(seen["markupsafe"]).is_relative_to(target)  # the box's own satisfies jinja2's need
    assert seen["argv"] == ["--out", str(out), "--quick", "--anything"]
    assert (target / "jinja2").is_dir() and not (target / "markupsafe").exists()
    assert "$ " + sys.executable in done.stdout and "-m pip install --no-index" in done.stdout
    log = (out / "runner.log").read_text()
    assert seen["jinja2"] in log and "exit 3" in log
    summary = json.loads((out / "runner.json").read_text())
    assert summary["exit_code"] == 3 and summary["installer"] == "pip" and summary["missing"] == ["jinja2"]


def test_without_pip_the_wheels_are_unpacked_and_import(common, wheels, tmp_path):
    device_common, install = common
    chosen = device_common.read_wheels(wheels)
    install.prepare_target(tmp_path / "deps")
    install.unzip_install(chosen, tmp_path / "deps")
    probe = "import jinja2, markupsafe._speedups as s; print(jinja2.__file__); print(s.__file__)"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "deps")}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr
    assert all(Path(line).is_relative_to(tmp_path / "deps") for line in done.stdout.split())
    assert list((tmp_path / "deps").glob("jinja2-*.dist-info/METADATA"))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("not the runner's")
    with pytest.raises(install.SetupError):  # a folder it did not make is never emptied
        install.prepare_target(tmp_path / "mine")
    assert (tmp_path / "mine" / "keep.txt").exists()


def test_a_missing_wheel_stops_the_runner_with_the_fetch_command(tmp_path):
    out = tmp_path / "out"
    done = _run(
        RUNNER, "--wheels", tmp_path / "none", "--target", tmp_path / "deps", "--out", out, env={PRETEND: "pyyaml"}
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "missing wheel: pyyaml" in done.stdout and "--only pyyaml" in done.stdout
    assert "missing wheel: pyyaml" in (out / "runner.log").read_text()


LM_CHECK = """
import json, sys
import liger_kernel
print(json.dumps({"liger_kernel": liger_kernel.__file__}))
sys.exit(3)
"""


@pytest.mark.slow
def test_the_lm_stages_packages_are_fetched_without_torch_and_installed_where_the_box_lacks_them(tmp_path):
    """liger-kernel requires torch and triton (the box's own): fetched alone; the runner installs it where the box
    lacks it, and without a wheel runs the check all the same, saying the LM stage goes without it."""
    wheels = tmp_path / "wheels"
    done = _run(
        FETCH, "--python-version", VERSION, "--platform", _this_platform(), "--dest", wheels,
        "--only", "liger-kernel==0.8.5",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert [p.name for p in wheels.glob("*.whl")] == ["liger_kernel-0.8.5-py3-none-any.whl"]
    assert "requires the box's own torch (never fetched): its wheel alone" in done.stdout
    manifest = (wheels / "MANIFEST.txt").read_text()
    assert "fetched without its dependencies (it requires the box's torch): liger-kernel==0.8.5" in manifest
    assert "never fetched: torch torchvision triton" in manifest
    script = tmp_path / "lm_check.py"
    script.write_text(LM_CHECK)
    target = tmp_path / "deps"
    args = ("--target", target, "--script", script, "--timeout", 120)
    done = _run(RUNNER, "--wheels", wheels, *args, "--out", tmp_path / "a", env={PRETEND: "liger-kernel"}, timeout=180)
    assert done.returncode == 3, done.stdout + done.stderr
    seen = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert Path(seen["liger_kernel"]).is_relative_to(target)
    assert "OPTIONAL liger-kernel>=0.6.5: missing (pretended" in done.stdout
    summary = json.loads((tmp_path / "a" / "runner.json").read_text())
    # liger-kernel pretended missing; nvidia-ml-py (the telemetry stage's) as this box has it or not
    assert set(summary["optional_missing"]) - {"nvidia-ml-py"} == {"liger-kernel"} and summary["missing"] == []
    assert summary["installed"] == ["liger_kernel-0.8.5-py3-none-any.whl"]
    # no wheel of it: the check runs all the same, and the runner says what the LM stage goes without
    done = _run(RUNNER, "--wheels", tmp_path / "none", *args, "--out", tmp_path / "b", env={PRETEND: "liger-kernel"})
    assert done.returncode == 3, done.stdout + done.stderr
    assert "gpu_check's LM stage runs without it" in done.stdout and "--only liger-kernel" in done.stdout


# ---- run_check.py: the hard timeout

SLEEPER = """
import os, signal, subprocess, sys, time
out = sys.argv[sys.argv.index("--out") + 1]
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL ends it
helper = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
with open(os.path.join(out, "partial.txt"), "w") as f:
    f.write(str(helper.pid))
print("started", flush=True)
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie awaiting its reaper is gone too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def test_the_runner_kills_the_whole_process_group_at_the_timeout_and_keeps_the_output(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    out = tmp_path / "out"
    start = time.monotonic()
    done = _run(
        RUNNER,
        *("--skip-deps", "--script", script, "--out", out, "--timeout", 3, "--grace", 1),
        timeout=60,
    )
    elapsed = time.monotonic() - start
    assert done.returncode == 124, done.stdout + done.stderr
    assert elapsed < 15
    assert "started" in done.stdout
    helper = int((out / "partial.txt").read_text())
    deadline = time.monotonic() + 5
    while not _gone(helper) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not _gone(helper):
        os.kill(helper, signal.SIGKILL)
        pytest.fail("the check's helper process outlived the runner")
    log = (out / "runner.log").read_text()
    assert "started" in log and "timed out after 3 s" in log and "exit 124" in log
    assert json.loads((out / "runner.json").read_text())["timed_out"] is True


def test_arguments_for_the_check_come_after_the_separator(tmp_path):
    done = _run(RUNNER, "--out", tmp_path / "a", "--", "--out", tmp_path / "b")
    assert done.returncode == 2 and "give --out before --" in done.stderr


# ---- run_check.py: the real gpu_check.py, on the CPU


def test_the_runner_runs_gpu_check_on_the_cpu_with_the_wheels_it_installed(wheels, tmp_path):
    out = tmp_path / "out"
    done = _run(
        RUNNER,
        *("--wheels", wheels, "--target", tmp_path / "deps", "--out", out, "--timeout", 240),
        "--",
        *CPU_MATH_ONLY,
        env={PRETEND: "jinja2"},
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "math:" in done.stdout
    assert "math:" in (out / "runner.log").read_text()
    assert (tmp_path / "deps" / "jinja2").is_dir()
    # the LM stage is there (no GPU here: it says so), and the check says which torch it ran
    assert "no GPU: the LM suite needs one" in done.stdout and "\nsoftware: torch " in done.stdout


# ---- the pieces, and Python 3.9


def test_versions_markers_and_wheel_tags(common):
    c, _ = common
    assert c.satisfies("2.11.0+cu128", ">=2.5,<2.15") and not c.satisfies("2.4.1", ">=2.5,<2.15")
    assert c.satisfies("3.0.rc1", ">=2.6") and not c.satisfies("3.0", ">=2.6,<3")
    assert c.satisfies("1.4.2", "~=1.4") and not c.satisfies("2.0", "~=1.4") and c.satisfies("1.26.4", "==1.26.*")
    env = {"python_version": "3.11", "sys_platform": "linux", "platform_machine": "x86_64"}
    assert c.marker_applies('python_version < "3.12" and sys_platform == "linux"', env)
    assert not c.marker_applies('python_version >= "3.12" or sys_platform == "win32"', env)
    assert not c.marker_applies('extra == "docs"', env)
    assert c.marker_applies("something this parser cannot read ~", env)
    box = {"version": [3, 11, 7], "implementation": "cpython", "abiflags": "", "machine": "x86_64"}
    box["libc"] = ["glibc", "2.28"]

    def fits(name):
        return c.wheel_fits(c.parse_wheel(Path(name)), box)

    assert fits("a-1-py3-none-any.whl") and fits("b-1-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl")
    assert fits("c-1-cp38-abi3-manylinux_2_28_x86_64.whl") and not fits("d-1-cp312-cp312-manylinux2014_x86_64.whl")
    assert not fits("e-1-cp311-cp311-manylinux_2_34_x86_64.whl") and not fits("f-1-cp311-cp311-win_amd64.whl")
    assert not fits("g-1-cp311-cp311-manylinux2014_aarch64.whl")
    assert c.expand_platforms(["manylinux2014_x86_64"])[:2] == ["manylinux_2_17_x86_64", "manylinux_2_16_x86_64"]
    assert "manylinux2014_x86_64" in c.expand_platforms(["manylinux_2_28_x86_64"])
    assert [r.name for r in c.project_dependencies()][:2] == ["torch", "torchvision"]
    assert c._dependency_strings((ROOT / "pyproject.toml").read_text()) == [
        r.text for r in c.project_dependencies()
    ]  # the parser for Pythons without tomllib reads what tomllib reads


def test_the_device_scripts_are_python_3_9_and_each_under_500_lines():
    sys.path.insert(0, str(DEVICE))
    try:
        from _device_box import PROBE
    finally:
        sys.path.remove(str(DEVICE))
    paths = sorted(DEVICE.glob("*.py"))
    assert {"run_check.py", "_device_box.py", "_device_install.py", "_device_child.py"} <= {p.name for p in paths}
    for path in paths:
        text = path.read_text()
        ast.parse(text, filename=str(path), feature_version=(3, 9))
        assert len(text.splitlines()) < 500, path.name  # issue 41: no module over 500 lines
    ast.parse(PROBE, feature_version=(3, 9))
