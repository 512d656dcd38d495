"""Derived columns, computed at read time from stored rows (kdbench.store.derived), against hand values."""

import json
from functools import partial

import numpy as np
import pandas as pd
import pytest

from kdbench.store.derived import derive, payback_steps, speedups, twin_key
from tests.support.helpers import as_read
from tests.support.rows import result_row

_row = partial(result_row, median_ms=10.0, precision="fp32")


def _config(**over):
    config = {"pair": {"teacher": "t", "student": "s"}, "world_size": 1, "teacher": {"mode": "live"}, "seed": 0}
    config.update(over)
    return json.dumps(config, sort_keys=True)


def test_speedup_pairs_student_and_teacher_of_the_same_run_cell_and_batch():
    rows = [
        _row(cell_id="a", measurement="student_inference", batch_size=1, median_ms=2.0),
        _row(cell_id="a", measurement="teacher_inference", batch_size=1, median_ms=7.0),
        _row(cell_id="a", measurement="student_inference", batch_size=4, median_ms=3.0),
        _row(cell_id="a", measurement="teacher_inference", batch_size=4, median_ms=9.0, status="failed"),
        _row(cell_id="b", measurement="student_inference", batch_size=1, median_ms=5.0),  # its teacher: another cell's
        _row(run_id="other", cell_id="a", measurement="teacher_inference", batch_size=4, median_ms=99.0),
    ]
    df = as_read(rows)
    got = df["speedup_vs_teacher"].tolist()
    assert got[0] == pytest.approx(3.5) and all(np.isnan(got[1:]))
    assert speedups(rows[:4]) == {("student_inference", 1): pytest.approx(3.5)}


def test_scaling_efficiency_pairs_cells_that_differ_only_in_world_size():
    def step(ws, tp, run="r", **cfg):
        return _row(
            run_id=run,
            cell_id=f"{run}-{ws}-{tp}",
            world_size=ws,
            throughput=tp,
            config_json=_config(world_size=ws, **cfg),
        )

    rows = [
        step(2, 150.0),
        step(1, 100.0),
        step(4, 320.0),
        step(2, 90.0, seed=1),
        step(1, 50.0, lr=1),
        step(2, 100.0, run="other"),
    ]
    got = as_read(rows)["scaling_efficiency"].tolist()
    assert got[0] == pytest.approx(0.75) and got[2] == pytest.approx(0.8)
    assert all(np.isnan([got[1], got[3], got[4], got[5]]))  # no twin at world_size 1 in the same run


def test_scaling_twin_ignores_ddp_options_a_single_device_cell_does_not_have():
    single = json.loads(_config(world_size=1))  # a world_size 1 cell's config has no ddp options
    double = {**single, "world_size": 2, "ddp": {"bucket_cap_mb": 10.0, "static_graph": True}}
    rows = [
        _row(cell_id="one", world_size=1, throughput=100.0, config_json=json.dumps(single)),
        _row(cell_id="two", world_size=2, throughput=180.0, config_json=json.dumps(double)),
    ]
    assert as_read(rows)["scaling_efficiency"].tolist()[1] == pytest.approx(0.9)


def test_an_fsdp_cell_scales_against_the_same_single_device_cell_as_its_ddp_twin():
    single = json.loads(_config(world_size=1))
    ddp = {**single, "world_size": 2, "ddp": {"bucket_cap_mb": 10.0}}
    fsdp = {**single, "world_size": 2, "parallel": "fsdp", "fsdp": {"reshard_after_forward": True}}
    rows = [
        _row(cell_id="one", world_size=1, throughput=100.0, config_json=json.dumps(single)),
        _row(cell_id="ddp", world_size=2, throughput=180.0, config_json=json.dumps(ddp)),
        _row(cell_id="fsdp", world_size=2, throughput=120.0, config_json=json.dumps(fsdp)),
    ]
    assert as_read(rows)["scaling_efficiency"].tolist()[1:] == [pytest.approx(0.9), pytest.approx(0.6)]


def test_utilisation_against_datasheet_and_measured_ceiling():
    rows = [
        _row(median_ms=10.0, flops=1e12, device_name="NVIDIA H100 80GB HBM3", precision="bf16", ceiling_tflops=500.0),
        _row(cell_id="cpu", median_ms=20.0, flops=2e9, device_name="Intel(R) Xeon(R) Processor"),
        _row(cell_id="failed", status="failed", median_ms=None, flops=1e9, device_name="NVIDIA H100 80GB HBM3"),
    ]
    h100, cpu, failed = as_read(rows).to_dict("records")
    assert h100["achieved_tflops"] == pytest.approx(100.0)
    assert h100["datasheet_device"] == "H100 SXM" and h100["datasheet_peak_tflops"] == pytest.approx(989.4)
    assert h100["mfu"] == pytest.approx(100.0 / 989.4)
    assert h100["ceiling_utilization"] == pytest.approx(0.2)
    assert cpu["achieved_tflops"] == pytest.approx(0.1)  # no datasheet entry, no probe: nothing invented
    assert pd.isna(cpu["datasheet_device"]) and np.isnan(cpu["mfu"]) and np.isnan(cpu["ceiling_utilization"])
    assert np.isnan(failed["achieved_tflops"])


def test_teacher_cache_payback_against_the_live_twin_of_the_same_run():
    rows = [
        _row(cell_id="live", median_ms=10.0, teacher_mode="live", config_json=_config()),
        _row(
            cell_id="cached",
            median_ms=7.5,
            teacher_mode="cached",
            teacher_cache_ms=101.0,
            config_json=_config(teacher={"mode": "cached"}),
        ),
        _row(
            cell_id="slower",
            median_ms=12.0,
            teacher_mode="cached",
            teacher_cache_ms=5.0,
            config_json=_config(teacher={"mode": "cached"}, seed=1),
        ),
        _row(cell_id="live1", median_ms=11.0, teacher_mode="live", config_json=_config(seed=1)),
    ]
    df = as_read(rows).set_index("cell_id")
    assert df.loc["cached", "teacher_cache_saving_ms"] == pytest.approx(2.5)
    assert df.loc["cached", "teacher_cache_payback_steps"] == 41  # ceil(101 / 2.5)
    assert df.loc["slower", "teacher_cache_saving_ms"] == pytest.approx(-1.0)
    assert np.isnan(df.loc["slower", "teacher_cache_payback_steps"])  # caching is slower: never pays back
    assert np.isnan(df.loc["live", "teacher_cache_saving_ms"])


@pytest.mark.parametrize(
    "one_off, saving, steps",
    [(101.0, 2.5, 41), (100.0, 2.5, 40), (1.1, 0.1, 11), (5.0, 0.0, None), (5.0, -1.0, None), (None, 1.0, None)],
)
def test_payback_steps(one_off, saving, steps):
    assert payback_steps(one_off, saving) == steps


def test_twin_key_drops_only_the_compared_settings():
    a = _config(teacher={"mode": "live"})
    b = _config(teacher={"mode": "cached"})
    assert twin_key(a, (("teacher", "mode"),)) == twin_key(b, (("teacher", "mode"),))
    assert twin_key(a, (("world_size",),)) != twin_key(b, (("world_size",),))
    assert twin_key("not json", (("world_size",),)) is None and twin_key(None, ()) is None


def test_derive_on_an_empty_frame_adds_the_columns():
    df = derive(pd.DataFrame({"status": pd.Series(dtype=object)}))
    assert {"speedup_vs_teacher", "mfu", "teacher_cache_payback_steps"} <= set(df.columns) and df.empty


def test_a_step_that_mixes_precisions_is_measured_against_both_peaks():
    # H200: fp32 67, bf16 989.4 TFLOP/s.  40 % of the step's FLOPs are the fp32 teacher's forward.
    mixed = _row(
        cell_id="mixed",
        median_ms=10.0,
        flops=1e12,
        teacher_forward_flops=4e11,
        precision="bf16",
        teacher_precision="fp32",
        device_name="NVIDIA H200",
        ceiling_tflops=800.0,
        teacher_ceiling_tflops=55.0,
    )
    cached = mixed | {"cell_id": "cached", "teacher_forward_flops": None}  # no teacher forward in the step
    inference = mixed | {"cell_id": "inf", "measurement": "teacher_inference"}  # one precision
    rows = as_read([mixed, cached, inference]).set_index("cell_id")
    effective = 1e12 / (4e11 / 67.0 + 6e11 / 989.4)  # ≈ 152 TFLOP/s, far below the bf16 peak
    assert rows.loc["mixed", "datasheet_peak_tflops"] == pytest.approx(effective)
    assert rows.loc["mixed", "mfu"] == pytest.approx(100.0 / effective)
    assert rows.loc["mixed", "ceiling_utilization"] == pytest.approx(100.0 / (1e12 / (4e11 / 55.0 + 6e11 / 800.0)))
    assert rows.loc["cached", "datasheet_peak_tflops"] == pytest.approx(989.4)
    assert rows.loc["inf", "datasheet_peak_tflops"] == pytest.approx(989.4)
    assert rows.loc["inf", "ceiling_utilization"] == pytest.approx(100.0 / 800.0)


def test_a_partitioned_gpu_is_measured_against_its_share_of_the_chip():
    row = _row(median_ms=10.0, flops=1e11, device_name="AMD Instinct MI300X", precision="bf16", device_compute_units=38)
    got = as_read([row]).iloc[0]
    assert got["datasheet_device"] == "MI300X (38 of 304 CUs)"
    assert got["mfu"] == pytest.approx(10.0 / (1307.4 * 38 / 304))


def test_a_data_parallel_offline_cell_is_paid_back_against_its_fsdp_sharded_live_twin():
    def step(cell, ms, mode, ws=2, parallel="ddp", run="r", **cfg):
        config = {"world_size": ws, "teacher": {"mode": mode}, **cfg}
        if ws > 1:  # as the plan stores it: DDP's options on a DDP cell, FSDP's on an FSDP one
            config.update({"ddp": {"bucket_cap_mb": 25}} if parallel == "ddp" else {"parallel": "fsdp", "fsdp": {}})
        extra = {"teacher_store_build_s": 4.0, "teacher_store_tokens": 1000} if mode == "offline" else {}
        return _row(
            run_id=run,
            cell_id=cell,
            median_ms=ms,
            teacher_mode=mode,
            world_size=ws,
            parallel=parallel if ws > 1 else None,
            tokens=100,
            config_json=_config(**config),
            **extra,
        )

    rows = [
        step("offline2", 6.0, "offline"),
        step("fsdp2", 10.0, "live", parallel="fsdp"),
        step("ddp2", 8.0, "live"),
        step("offline1", 5.0, "offline", ws=1),
        step("live1", 7.0, "live", ws=1),
        step("alone", 6.0, "offline", run="other"),  # its run has a DDP live twin only
        step("ddp-other", 9.0, "live", run="other"),
    ]
    df = as_read(rows).set_index("cell_id")
    two = df.loc["offline2"]
    assert two["offline_twin"] == "live fsdp" and two["teacher_cache_saving_ms"] == pytest.approx(4.0)
    assert two["offline_saving_ms_per_token"] == pytest.approx(4.0 / 200)  # a step trains both ranks' 100 tokens
    assert two["offline_payback_epochs"] == pytest.approx(4.0 / 1000 * 1e3 / 0.02)  # build ms per token / saving's
    assert df.loc["offline1", "offline_twin"] == "live" and df.loc["offline1", "teacher_cache_saving_ms"] == 2.0
    assert df.loc["offline1", "offline_saving_ms_per_token"] == pytest.approx(2.0 / 100)
    assert df.loc["alone", "offline_twin"] == "live ddp" and df.loc["alone", "teacher_cache_saving_ms"] == 3.0
    assert df.loc[["fsdp2", "ddp2", "live1"], "offline_twin"].isna().all()
