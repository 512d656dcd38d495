"""The install checked at start (a torch / torchvision / transformers set that does not work together: one line with
the fix, exit 2, in env, probe and run) and the missing-extra hint that fits how kdbench was installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kdbench.cli import main
from kdbench.core import install
from kdbench.core.install import Build, Installed, Origin, origin_of, torchvision_for
from tests.support.paths import ROOT

SUITE = ROOT / "suites" / "cpu.yaml"
NMS = "operator torchvision::nms does not exist"

# the case: pip paired a CPU torch 2.13 with a CUDA-linked torchvision 0.28
CPU_TORCH_CUDA_TV = Installed("2.13.0+cpu", Build("cpu"), "0.28.0+cu128", Build.of_tag("0.28.0+cu128"))
CPU_FIX = (
    "pip install --force-reinstall --no-deps 'torchvision==0.28.*' --index-url https://download.pytorch.org/whl/cpu"
)


@pytest.mark.parametrize(
    "torch_version, torchvision", [("2.14.1", "0.29"), ("2.5.0", "0.20"), ("2.0.1+cpu", "0.15"), ("3.0.0", None)]
)
def test_the_pairing_rule(torch_version, torchvision):
    assert torchvision_for(torch_version) == torchvision


@pytest.mark.parametrize(
    "tag, build",
    [
        ("0.28.0+cpu", Build("cpu")),
        ("0.28.0+cu128", Build("cuda", "12.8")),
        ("0.20.1+cu124", Build("cuda", "12.4")),
        ("0.24.0+rocm6.4", Build("rocm", "6.4")),
        ("0.29.1", Build()),  # PyPI's metadata: no tag, build unknown
    ],
)
def test_build_from_the_local_tag(tag, build):
    assert Build.of_tag(tag) == build


@pytest.mark.parametrize(
    "facts, expected",
    [
        (CPU_TORCH_CUDA_TV, "this torchvision is built for CUDA 12.8, torch for the CPU; " + CPU_FIX),
        (
            Installed("2.14.1+cpu", Build("cpu"), "0.28.0+cpu", Build("cpu")),
            "torchvision 0.28 is built for torch 2.13; pip install --force-reinstall --no-deps 'torchvision==0.29.*' "
            "--index-url https://download.pytorch.org/whl/cpu",
        ),
        (
            Installed("2.9.0+rocm6.4", Build("rocm", "6.4"), "0.24.0+cu128", Build("cuda", "12.8")),
            "--index-url https://download.pytorch.org/whl/rocm6.4",
        ),
        (
            Installed("2.14.1", Build("cuda", "13.0"), "0.29.1+cu126", Build("cuda", "12.6")),
            "built for CUDA 12.6, torch for CUDA 13.0; pip install --force-reinstall --no-deps 'torchvision==0.29.*' "
            "--index-url https://download.pytorch.org/whl/cu130",
        ),
        (Installed("2.14.1", Build("cuda", "13.0"), "0.29.1", Build()), None),  # PyPI's pair
        (Installed("2.14.1+cpu", Build("cpu"), "0.29.1+cpu", Build("cpu")), None),
        (Installed("2.14.1", Build("cuda", "12.8"), "0.29.1+cu126", Build("cuda", "12.6")), None),  # one major
    ],
)
def test_mismatch_from_versions_and_builds(facts, expected):
    found = install.mismatch(facts)
    if expected is None:
        assert found is None
    else:
        assert expected in found and "\n" not in found


def test_transformers_that_needs_a_newer_torch():
    facts = Installed("2.5.1", Build("cuda", "12.4"), "0.20.1", Build(), "5.24.0", ">=2.6")
    assert install.mismatch(facts) is None
    assert install.transformers_mismatch(facts) == (
        "transformers 5.24.0 needs torch>=2.6 (its own requirement) and torch 2.5.1 is installed, so it leaves torch "
        "out and its models do not build: install a transformers for this torch, pip install "
        "'transformers>=4.46,<5.24.0', or a torch>=2.6 with its torchvision (https://download.pytorch.org/whl/cu124)"
    )
    assert install.transformers_mismatch(Installed("2.6.0", Build("cpu"), "0.21.0", Build(), "5.24.0", ">=2.6")) is None


def _one_error(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith("kdbench: error: ")
    return lines[0]


COMMANDS = [["env"], ["probe", "--device", "cpu"], ["run", str(SUITE), "--dry-run"], ["run", str(SUITE)]]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[:1] + a[2:]))
def test_a_mismatched_set_is_one_line_with_the_fix(argv, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing written where the test runs
    monkeypatch.setattr(install, "installed", lambda: CPU_TORCH_CUDA_TV)
    assert main(argv) == 2
    line = _one_error(capsys)
    assert "torch 2.13.0+cpu and torchvision 0.28.0+cu128 do not work together" in line and CPU_FIX in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", COMMANDS[:3], ids=lambda a: " ".join(a[:1] + a[2:]))
def test_a_torchvision_that_does_not_load_is_one_line_with_the_fix(argv, monkeypatch, capsys):
    def broken():
        raise RuntimeError(f"{NMS}\n  (20 more lines)")

    facts = Installed("2.14.1+cpu", Build("cpu"), "0.29.1+cpu", Build("cpu"))
    monkeypatch.setattr(install, "installed", lambda: facts)
    monkeypatch.setattr(install, "import_torchvision", broken)
    assert main(argv) == 2
    line = _one_error(capsys)
    assert f"torchvision 0.29.1+cpu does not load beside torch 2.14.1+cpu (RuntimeError: {NMS});" in line
    assert "pip install --force-reinstall --no-deps 'torchvision==0.29.*' --index-url" in line


def test_env_checks_transformers_too(monkeypatch, capsys):
    facts = Installed("2.5.1", Build("cpu"), "0.20.1+cpu", Build("cpu"), "5.24.0", ">=2.6")
    monkeypatch.setattr(install, "installed", lambda: facts)
    monkeypatch.setattr(install, "import_torchvision", lambda: None)  # no ops check either: the set is simulated
    monkeypatch.setattr(install, "import_problem", lambda facts: None)
    assert main(["env"]) == 2
    assert "transformers 5.24.0 needs torch>=2.6" in _one_error(capsys)


def test_a_real_broken_torchvision_import_ends_in_one_line(tmp_path):
    """The issue's case end to end: a torchvision whose import dies registering its operators (a fake package put
    first on the path, the version this torch pairs with) gives `kdbench env` one line, exit 2, no traceback."""
    import torch

    fake = tmp_path / "torchvision"
    fake.mkdir()
    pairs = torchvision_for(torch.__version__)
    (fake / "version.py").write_text(f"__version__ = '{pairs}.0'\n")
    (fake / "__init__.py").write_text(f"raise RuntimeError('{NMS}')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    r = subprocess.run([sys.executable, "-m", "kdbench", "env"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"(RuntimeError: {NMS}); pip install --force-reinstall --no-deps 'torchvision=={pairs}.*'" in r.stderr


# --------------------------------------------------------------------------- the extra hint


class FakeDist:
    """An installed kdbench's metadata: its direct_url.json (None: from an index) and where its files are."""

    def __init__(self, direct_url: str | None, files: Path):
        self.direct_url, self.files = direct_url, files

    def read_text(self, name: str) -> str | None:
        return self.direct_url if name == "direct_url.json" else None

    def locate_file(self, path: str) -> Path:
        return self.files / path


def test_hint_of_an_editable_clone(tmp_path, monkeypatch):
    clone = tmp_path / "my clone"
    (clone / "kdbench").mkdir(parents=True)
    dist = FakeDist(
        f'{{"url": "file://{clone.as_posix().replace(" ", "%20")}", "dir_info": {{"editable": true}}}}', tmp_path
    )
    found = origin_of(dist, clone / "kdbench")
    assert found == Origin("editable", clone.resolve())
    assert found.line("lm") == f"pip install -e '{clone.resolve()}[lm]'"
    monkeypatch.chdir(clone)
    assert found.line("lm") == "pip install -e '.[lm]'"


def test_hint_of_an_index_wheel_and_a_git_install(tmp_path):
    site = tmp_path / "site-packages"
    (site / "kdbench").mkdir(parents=True)
    assert origin_of(FakeDist(None, site), site / "kdbench").line("lm") == "pip install 'kdbench[lm]'"
    vcs = '{"url": "https://github.com/o/kdbench", "vcs_info": {"vcs": "git", "commit_id": "abc123"}}'
    assert origin_of(FakeDist(vcs, site), site / "kdbench").line("onnx") == (
        "pip install 'kdbench[onnx] @ git+https://github.com/o/kdbench@abc123'"
    )


def test_hint_of_a_source_tree_that_is_not_installed(tmp_path):
    tree = tmp_path / "tree"
    (tree / "kdbench").mkdir(parents=True)
    (tree / "pyproject.toml").write_text("")
    line = f"pip install -e '{tree}[liger]' (kdbench runs from the source tree {tree}, not installed)"
    assert origin_of(None, tree / "kdbench").line("liger") == line
    # installed elsewhere (an editable install of another folder), imported from this tree: the tree's
    other = f'{{"url": "file://{tmp_path / "other"}", "dir_info": {{"editable": true}}}}'
    assert origin_of(FakeDist(other, tmp_path), tree / "kdbench").line("liger") == line
