"""Data-parallel cells under torchrun (gloo on the CPU), sharding, and failing ranks."""

import math
from pathlib import Path

import pandas as pd
import pytest

from kdbench.cli import main
from kdbench.config import load_suite
from kdbench.config.plan import parse_shard, shard
from kdbench.core.errors import KdbenchError
from kdbench.store import read_results
from kdbench.workloads import expand_checked
from tests.support.helpers import run_folder, write_suite
from tests.support.paths import SUPPORT, TESTS
from tests.support.suites import RESNET8, merged, tiny_suite


def _torchrun_run(suite: Path, out: Path) -> list[str]:
    """`kdbench run` as two ranks of one torchrun allocation on this machine."""
    import sys

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    return [*torchrun, "-m", "kdbench", "run", str(suite), "--out", str(out), "--no-report"]


DDP = tiny_suite(
    name="ddp",
    threads=2,
    allow_imports=True,
    cell_timeout_s=120,
    defaults={
        **RESNET8,
        "batch_size": 8,
        "timing": {"warmup": 1, "min_iters": 4, "min_time_s": 0.2},
        "inference": {"batch_sizes": [2]},
        "ddp": {"bucket_cap_mb": 10, "static_graph": True},
    },
)
LINEAR_DATA = {"kind": "synthetic", "shape": [1, 4, 4], "num_classes": 10}  # DDP's data at the linear pair's shape


def _ddp(**overrides) -> dict:
    """DDP over world sizes 1 and 2, unless ``overrides`` give another matrix (which replaces that one)."""
    return merged(DDP, {"matrix": {"world_size": [1, 2]}, **overrides})


def _linear(student: str = "linear") -> dict:
    """DDP's defaults overridden for a linear teacher and ``student`` on 1x4x4 inputs."""
    return {"pair": {"teacher": "linear", "student": student}, "data": LINEAR_DATA}


@pytest.mark.slow
def test_two_rank_gloo_cell(tmp_path):
    suite = write_suite(tmp_path / "ddp.yaml", **_ddp())
    assert main(["run", str(suite), "--out", str(tmp_path), "--no-report"]) == 0
    df = read_results([tmp_path])
    assert (df["status"] == "ok").all(), df[["status", "error"]]
    steps = df[df.measurement == "distill_step"].set_index("world_size")
    two = steps.loc[2]
    assert two["n"] >= 4 and len(two["samples_ms"]) == two["n"]
    assert two["throughput"] == pytest.approx(2 * 8 / (two["median_ms"] / 1e3))  # both ranks count
    assert two["dist_backend"] == "gloo" and two["ddp_bucket_cap_mb"] == 10 and bool(two["ddp_static_graph"])
    assert two["scaling_efficiency"] == pytest.approx(two["throughput"] / (2 * steps.loc[1]["throughput"]))
    assert math.isnan(steps.loc[1]["scaling_efficiency"])
    assert math.isfinite(two["final_loss"])
    assert pd.isna(steps.loc[1]["dist_backend"])
    inf = df[(df.measurement == "student_inference") & (df.world_size == 2)]
    assert list(inf["status"]) == ["ok"] and inf["speedup_vs_teacher"].notna().all()
    # will it fit (issue 31): both ranks ran the extra step; rank 0's live peak is on the row, beside the prediction
    assert 0.9 <= steps.loc[1]["predicted_peak_ratio"] <= 1.1
    assert two["live_peak_bytes"] > 0
    assert 0.9 <= two["predicted_peak_ratio"] <= 1.1 or "fit: peak not predicted" in two["notes"]


@pytest.mark.slow
def test_fitnet_adapter_trains_under_ddp(tmp_path):
    # The regressor lives in the DDP-wrapped module with the student: its gradients are reduced too.
    fitnet = {"pair": {"teacher": "resnet20", "student": "resnet8"}, "method": "fitnet"}
    suite = write_suite(tmp_path / "ddp.yaml", **_ddp(defaults=fitnet, matrix={"world_size": [2]}))
    assert main(["run", str(suite), "--out", str(tmp_path), "--no-report"]) == 0
    df = read_results([tmp_path])
    assert (df["status"] == "ok").all(), df[["status", "error"]]
    step = df[df.measurement == "distill_step"].iloc[0]
    assert step["adapter_params"] > 0 and step["trainable_params"] == step["student_params"] + step["adapter_params"]
    assert step["student_features"] == "layer1,layer2,layer3" and math.isfinite(step["final_loss"])
    assert step["flops"] > 0 and step["phase_backward_ms"] > 0 and step["peak_memory_bytes"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "student,status,fragment",
    [
        ("faulty_models:killed_rank1", "failed", "torchrun exited"),
        ("faulty_models:raising_rank1", "failed", "injected failure"),
        ("faulty_models:oom_rank1", "oom", "out of memory on rank 1: OutOfMemoryError: CUDA out of memory"),
        ("faulty_models:hang_rank1", "timeout", "time-out of 30 s"),
    ],
)
def test_a_failing_rank_fails_the_cell_within_the_time_out(tmp_path, monkeypatch, student, status, fragment):
    monkeypatch.syspath_prepend(str(SUPPORT))  # passed on to the ranks through PYTHONPATH
    failing = _ddp(cell_timeout_s=30, defaults=_linear(student), matrix={"world_size": [2]})
    suite = write_suite(tmp_path / "bad.yaml", **failing)
    assert main(["run", str(suite), "--out", str(tmp_path), "--no-report"]) == 1
    df = read_results([tmp_path])
    assert (df["status"] == status).all()
    assert fragment in df["error"].iloc[0], df["error"].iloc[0]


def test_shards_partition_the_plan_exactly(tmp_path):
    matrix = {"world_size": [1, 2], "seed": [0, 1, 2, 3, 4], "precision": ["fp32", "bf16"]}
    write_suite(tmp_path / "s.yaml", **_ddp(matrix=matrix))
    cells = expand_checked(load_suite(tmp_path / "s.yaml"))
    assert len(cells) == 20
    for n in (1, 3, 4, 7, 25):
        shares = [shard(cells, i, n) for i in range(1, n + 1)]
        ids = [c.cell_id for share in shares for c in share]
        assert sorted(ids) == sorted(c.cell_id for c in cells)  # every cell once
        assert max(map(len, shares)) - min(map(len, shares)) <= 1  # balanced
    assert [c.index for c in shard(cells, 2, 7)] == [1, 8, 15]
    assert parse_shard("2/4") == (2, 4)
    for bad in ("0/4", "5/4", "2", "a/b"):
        with pytest.raises(KdbenchError, match="--shard"):
            parse_shard(bad)


def test_shard_dry_run(tmp_path, capsys):
    write_suite(tmp_path / "s.yaml", **_ddp())
    assert main(["run", str(tmp_path / "s.yaml"), "--shard", "2/2", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "ws2" in out[0] and out[-1].startswith("1 cells")
    assert main(["run", str(tmp_path / "s.yaml"), "--shard", "3/2"]) == 2


def test_torchrun_flags_standalone_and_rendezvous():
    from kdbench.config.schema import LauncherConfig
    from kdbench.hw.backends import resolve
    from kdbench.run.jobs import CellJob
    from kdbench.run.workers import TorchrunWorker, WorkerSetup

    (cell,) = [c for c in expand_checked(_suite_from(_ddp())) if c.config.world_size == 2]
    setup = WorkerSetup(resolve("cpu"), False, 2)
    standalone = TorchrunWorker(setup).torchrun_args(CellJob(cell))
    assert standalone == ["--standalone", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=0"]
    launcher = LauncherConfig(nnodes=2, rdzv_endpoint="node0:29500", extra_args=["--log-dir", "logs"])
    multi = TorchrunWorker(setup, launcher=launcher).torchrun_args(CellJob(cell))
    assert multi == [
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node0:29500",
        f"--rdzv-id=kdbench-{cell.cell_id}",
        "--nproc-per-node=1",
        "--max-restarts=0",
        "--log-dir",
        "logs",
    ]


def _suite_from(suite: dict):
    import tempfile

    return load_suite(write_suite(Path(tempfile.mkdtemp()) / "s.yaml", **suite))


@pytest.mark.slow
def test_rendezvous_launcher_runs_a_two_rank_cell(tmp_path):
    import socket

    with socket.socket() as s:  # a free local port for the c10d rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = {"rdzv_endpoint": f"127.0.0.1:{port}"}
    write_suite(tmp_path / "s.yaml", **_ddp(launcher=launcher, matrix={"world_size": [2]}))
    assert main(["run", str(tmp_path / "s.yaml"), "--out", str(tmp_path), "--no-report"]) == 0
    df = read_results([tmp_path])
    assert (df["status"] == "ok").all() and set(df["world_size"]) == {2}


def test_detect_allocation_from_torchrun_and_slurm_environments():
    from kdbench.run.allocation import Allocation, detect_allocation

    assert detect_allocation({}) is None
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n0", "TORCHELASTIC_RUN_ID": "x"}
    assert detect_allocation(torchrun) == Allocation(3, 4, 1, "torchrun")
    assert detect_allocation({**torchrun, "WORLD_SIZE": "1", "RANK": "0"}) is None  # one rank: a plain run
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0", "MASTER_ADDR": "n0"}
    assert detect_allocation(slurm) == Allocation(5, 8, 1, "slurm")
    assert detect_allocation({**slurm, "SLURM_NTASKS": "1"}) is None
    assert detect_allocation({k: v for k, v in slurm.items() if k != "SLURM_STEP_ID"}) is None  # sbatch, not srun
    with pytest.raises(KdbenchError, match="MASTER_ADDR"):
        detect_allocation({k: v for k, v in slurm.items() if k != "MASTER_ADDR"})


@pytest.mark.slow
def test_kdbench_started_by_torchrun_runs_the_same_engine(tmp_path):
    # One engine, whoever started the ranks: --profile and the quality block behave as in a plain run.
    import subprocess

    quality = {"dataset": "digits", "epochs": 1, "seeds": 1, "target": 0.5, "max_samples": 400}
    suite = write_suite(tmp_path / "alloc.yaml", **_ddp(matrix={"world_size": [1, 2, 4]}, quality=quality))
    out = tmp_path / "res"
    cmd = [*_torchrun_run(suite, out), "--profile"]
    r = subprocess.run(cmd, cwd=TESTS.parent, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "2 ranks of a torchrun allocation" in r.stdout
    assert r.stdout.count("[4/4]") == 1  # rank 0 alone reports progress
    run = run_folder(out)  # rank 0 alone stores
    df = read_results([run.path])
    steps = df[df.measurement == "distill_step"].set_index("world_size")
    assert steps.loc[1, "status"] == "ok" and steps.loc[2, "status"] == "ok"
    assert steps.loc[4, "status"] == "skipped" and "exceeds this allocation's 2 ranks" in steps.loc[4, "error"]
    assert steps.loc[2, "throughput"] == pytest.approx(2 * 8 / (steps.loc[2, "median_ms"] / 1e3))
    assert steps.loc[2, "scaling_efficiency"] > 0
    # --profile reached every measured cell, the data-parallel one (traced on rank 0) included
    for ws in (1, 2):
        assert Path(steps.loc[ws, "trace_file"]).is_file() and steps.loc[ws, "top_ops"]
    # the data-parallel row has what a single-device row has
    for column in ("telemetry", "time_to_steady_ms", "peak_memory_bytes", "phase_backward_ms", "flops"):
        assert pd.notna(steps.loc[2, column]), column
    quality = df[df.measurement == "quality"]
    assert sorted(quality["quality_role"]) == ["distilled", "scratch", "teacher"]
    assert (quality["status"] == "ok").all() and "quality seed 0: teacher resnet8" in r.stdout


@pytest.mark.slow
def test_a_data_parallel_cell_keeps_its_step_when_inference_fails(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SUPPORT))  # passed on to the ranks through PYTHONPATH
    failing = _ddp(defaults=_linear("faulty_models:raising_in_eval"), matrix={"world_size": [2]})
    write_suite(tmp_path / "s.yaml", **failing)
    assert main(["run", str(tmp_path / "s.yaml"), "--out", str(tmp_path), "--no-report"]) == 1
    rows = read_results([run_folder(tmp_path).path]).set_index("measurement")
    step = rows.loc["distill_step"]
    assert step["status"] == "ok" and step["n"] >= 4 and step["world_size"] == 2
    assert pd.notna(step["time_to_steady_ms"]) and step["telemetry"].startswith("unavailable")
    student = rows.loc["student_inference"]
    assert student["status"] == "failed" and "injected failure in eval" in student["error"]
    assert rows.loc["teacher_inference", "status"] == "ok"


@pytest.mark.slow
def test_shards_given_one_run_id_write_into_one_folder(tmp_path, capsys):
    write_suite(tmp_path / "s.yaml", **_ddp(defaults=_linear(), matrix={"seed": [0, 1, 2, 3]}))
    out = tmp_path / "res"
    for i in (1, 2):  # e.g. two tasks of a Slurm job array, on two machines sharing the folder
        args = ["run", str(tmp_path / "s.yaml"), "--out", str(out), "--run-id", "sweep", "--shard", f"{i}/2"]
        assert main([*args, "--no-report"]) == 0
    run = run_folder(out)
    assert run.run_id == "sweep" and len(run.parts()) == 4
    df = read_results([out])
    assert sorted(df[df.measurement == "distill_step"]["seed"]) == [0, 1, 2, 3] and set(df["run_id"]) == {"sweep"}
    capsys.readouterr()
    assert main(["run", str(tmp_path / "s.yaml"), "--out", str(out), "--run-id", "sweep", "--no-report"]) == 0
    assert "4 of 4 jobs already stored, 0 to go" in capsys.readouterr().out


@pytest.mark.slow
def test_a_data_parallel_cell_that_fails_inside_an_allocation_is_stored_and_resume_goes_on(tmp_path):
    import os
    import subprocess

    # seed 0: a rank raises inside the step's collectives; seed 1: a good cell after it
    failing = _linear("faulty_models:raising_rank1_seed0")
    suite = write_suite(tmp_path / "alloc.yaml", **_ddp(defaults=failing, matrix={"world_size": [2], "seed": [0, 1]}))
    out = tmp_path / "res"
    cmd = _torchrun_run(suite, out)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])}
    first = subprocess.run(cmd, cwd=TESTS.parent, capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode != 0  # the allocation stops: its ranks no longer agree on where they are
    assert "the run stopped after" in first.stderr and "--resume" in first.stderr, first.stderr[-2000:]
    df = read_results([run_folder(out).path])
    assert set(df["seed"]) == {0} and (df["status"] == "failed").all()  # the failed cell is stored
    assert "injected failure" in df["error"].iloc[0] or "Connection" in df["error"].iloc[0], df["error"].iloc[0]
    again = subprocess.run([*cmd, "--resume"], cwd=TESTS.parent, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]  # what it ran succeeded
    df = read_results([run_folder(out).path])
    steps = df[df.measurement == "distill_step"].set_index("seed")
    assert steps.loc[1, "status"] == "ok" and steps.loc[0, "status"] == "failed"


FSDP = tiny_suite(
    name="fsdp",
    cell_timeout_s=300,
    defaults={
        "pair": {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
        "overrides": {"teacher": {"num_hidden_layers": 2}, "student": {"num_hidden_layers": 2}},
        "method": "forward_kl",
        "loss_impl": "fused_linear",
        "chunk_size": 16,
        "batch_size": 2,
        "data": {"kind": "tokens", "seq_len": 16},
        "timing": {"warmup": 1},
        "inference": {"batch_sizes": [1], "decode_tokens": 2},
        "world_size": 2,
    },
    matrix={"parallel": ["ddp", "fsdp"]},
)


@pytest.mark.slow
def test_an_fsdp2_lm_cell_holds_half_the_state_per_rank_and_trains_as_ddp_does(tmp_path):
    suite = write_suite(tmp_path / "fsdp.yaml", **FSDP)
    assert main(["run", str(suite), "--out", str(tmp_path), "--no-report"]) == 0
    df = read_results([tmp_path])
    assert (df["status"] == "ok").all(), df[["measurement", "status", "error"]]
    steps = df[df.measurement == "distill_step"].set_index("parallel")
    ddp, fsdp = steps.loc["ddp"], steps.loc["fsdp"]
    assert fsdp["dist_backend"] == "gloo" and bool(fsdp["fsdp_reshard_after_forward"])
    # no MixedPrecisionPolicy by default: the parameters gathered and the gradients reduced in their own fp32
    assert (fsdp["fsdp_all_gather_dtype"], fsdp["fsdp_teacher_all_gather_dtype"], fsdp["fsdp_reduce_dtype"]) == (
        "fp32",
        "fp32",
        "fp32",
    )
    assert pd.isna(ddp["fsdp_all_gather_dtype"])
    assert pd.isna(fsdp["ddp_bucket_cap_mb"]) and fsdp["tokens_per_s"] > 0 and fsdp["phase_loss_ms"] > 0
    # both models' parameters, the student's gradients and AdamW's moments: sharded over 2 ranks
    assert fsdp["model_state_bytes"] == pytest.approx(ddp["model_state_bytes"] / 2, rel=0.01)
    assert fsdp["optimizer_state_bytes"] == pytest.approx(ddp["optimizer_state_bytes"] / 2, rel=0.01)
    # the same data and updates on both ranks' shards: the same losses after the same steps
    assert fsdp["final_loss"] == pytest.approx(ddp["final_loss"], rel=1e-5)
    serving = df[(df.parallel == "fsdp") & (df.measurement != "distill_step")]
    assert len(serving) == 4 and serving["tokens_per_s"].gt(0).all()  # rank 0 served whole copies
    # the accuracy ledger: rank 0 takes it on its own copy under DDP; an FSDP2 pair's heads are gathered by all
    # ranks together, so it is not taken there, and the row says why
    assert ddp["loss_rel_err"] < 1e-5 and ddp["grad_rel_err"] < 1e-4
    assert pd.isna(fsdp["loss_rel_err"]) and "accuracy ledger not taken: an FSDP2-sharded pair" in fsdp["notes"]


@pytest.mark.slow
def test_an_offline_cell_at_two_ranks_is_paid_back_against_its_fsdp_sharded_live_twin(tmp_path):
    import numpy as np

    np.save(tmp_path / "corpus.npy", np.random.default_rng(0).integers(0, 4096, 1000).astype(np.uint16))
    offline = {"mode": "offline", "k": 8, "store_tokens": 256, "corpus": "corpus.npy"}  # the suite's folder's
    suite = merged(
        FSDP,
        {
            "defaults": {
                "loss_impl": "dense",
                "inference": {"batch_sizes": []},
                # no time budget can cut a loop short (a thin row gets no twin)
                "timing": {"warmup": 1, "min_iters": 3, "min_time_s": 0.0, "cell_budget_s": 86_400},
            },
        },
    )
    suite["matrix"] = {"cases": [{"parallel": "fsdp"}, {"teacher": offline}]}  # the live twin sharded, not DDP
    path = write_suite(tmp_path / "offline.yaml", **suite)
    assert main(["run", str(path), "--out", str(tmp_path / "res"), "--no-report"]) == 0
    df = read_results([tmp_path / "res"])
    assert (df["status"] == "ok").all(), df[["measurement", "status", "error"]]
    steps = df[df.measurement == "distill_step"].set_index("teacher_mode")
    live, off = steps.loc["live"], steps.loc["offline"]
    assert live["parallel"] == "fsdp" and live["fsdp_teacher_all_gather_dtype"] == "fp32"  # its teacher sharded
    assert off["parallel"] == "ddp" and off["world_size"] == 2 and off["dist_backend"] == "gloo"
    assert math.isfinite(off["final_loss"]) and off["teacher_store_tokens"] == 256 and off["teacher_read_ms"] > 0
    assert off["tokens"] == live["tokens"] == 2 * 16  # each rank's batch, the twins' alike
    assert off["offline_twin"] == "live fsdp"
    saving = live["median_ms"] - off["median_ms"]
    assert off["teacher_cache_saving_ms"] == pytest.approx(saving)
    per_token = saving / (2 * off["tokens"])  # a step trains both ranks' batches
    assert off["offline_saving_ms_per_token"] == pytest.approx(per_token)
    build_per_token = off["teacher_store_build_s"] * 1e3 / off["teacher_store_tokens"]
    if saving > 0:
        assert off["offline_payback_epochs"] == pytest.approx(build_per_token / per_token)
    else:
        assert math.isnan(off["offline_payback_epochs"])
    assert len(list((tmp_path / "res").glob("*/teacher-stores/*/manifest.json"))) == 1  # rank 0 built it, once
