"""The step-time model (issue 43): the fit planner's operator census (kdbench.fit.census), taken in the same fake run as
the peak, and its pricing (kdbench.fit.steptime): FLOPs equal to the rows' counter, bytes and classes of known
operators by hand, the model's arithmetic on hand-made censuses and rates, and the step rows' two columns."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kdbench.config.schema import CellConfig
from kdbench.core.devices import find_card
from kdbench.core.errors import KdbenchError
from kdbench.core.names import FIT_NOTE, PHASES
from kdbench.core.schema import Row
from kdbench.distill.step import DistillStep
from kdbench.fit import census as C
from kdbench.fit.census import Census, CensusMode, Record
from kdbench.fit.columns import step_time_columns
from kdbench.fit.planner import CPU, Prediction, predict
from kdbench.fit.steptime import (
    COMPUTE,
    LAUNCH,
    MEMORY,
    Rates,
    predict_step_time,
    rates_for,
    rates_from_probe,
    rates_from_row,
)
from kdbench.measure.flops import count
from kdbench.models.cache import ModelCache
from kdbench.workloads.registry import workload_of
from tests.support.helpers import make_config

pytestmark = pytest.mark.usefixtures("one_thread")

ONE = {c: (1.0, 1.0) for c in C.CLASSES}


def _lm() -> CellConfig:
    return CellConfig.model_validate(
        {
            "pair": {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
            "overrides": {"teacher": {"num_hidden_layers": 2}, "student": {"num_hidden_layers": 1}},
            "method": "forward_kl",
            "batch_size": 2,
            "data": {"kind": "tokens", "seq_len": 64},
        }
    )


def _counted_flops(config: CellConfig) -> int:
    """What a row's ``flops`` counts: one real step after two (kdbench.measure.step.step_flops)."""
    workload = workload_of(config)
    pair = workload.step_pair(config, CPU, ModelCache(), None)
    x, y = workload.batch(config, config.batch_size, CPU.device, config.seed, pair)
    step = DistillStep(*pair, x, y, config, CPU, workload)
    try:
        step()
        step()
        return count(step).flops
    finally:
        step.close()


# ---------------------------------------------------------------------------------------------------- the census


@pytest.mark.parametrize("config", [make_config(), _lm()], ids=["vision", "lm"])
def test_the_census_counts_the_flops_the_rows_count_by_phase(config):
    prediction = predict(config, "cpu")
    assert prediction.ok and prediction.census is not None
    census = prediction.census
    assert census.flops == _counted_flops(config) > 0
    summary = census.summary()
    assert {p.name for p in PHASES} <= set(summary)  # every phase of the step, in the order it ran
    assert list(summary)[: len(PHASES)] == [p.name for p in PHASES]
    assert summary["optimizer"][C.OPTIMIZER]["launches"] > 0  # AdamW's per-parameter updates
    assert summary["backward"][C.MATMUL]["flops"] > summary["student_forward"][C.MATMUL]["flops"]
    assert all(r.launches == 0 and r.bytes == 0 for r in census.records if r.cls == C.VIEWS)


def test_an_mm_reads_its_inputs_and_writes_its_output_by_hand():
    mode = CensusMode(lambda: "loss")
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    bias = torch.randn(4)
    with mode:
        torch.mm(a, b)
        mode.on = True
        torch.mm(a, b)
        torch.mm(a, b)
        a.t()  # a view: no bytes, no launch
        bias.expand(1000, 4) + 1  # the expanded bias reads its own 16 bytes
        mode.on = False
        torch.mm(a, b)
    records = {(r.op, r.cls): r for r in mode.census().records}
    mm = records[("aten.mm", C.MATMUL)]
    assert (mm.launches, mm.flops) == (2, 2 * 2 * 8 * 16 * 4)
    assert (mm.read, mm.written, mm.phase, mm.dtype) == (2 * 4 * (8 * 16 + 16 * 4), 2 * 4 * 8 * 4, "loss", "float32")
    assert records[("aten.t", C.VIEWS)].launches == 0 and records[("aten.t", C.VIEWS)].bytes == 0
    add = records[("aten.add", C.ELEMENTWISE)]
    assert (add.read, add.written, add.launches) == (16, 1000 * 4 * 4, 1)
    assert sum(r.fresh for r in records.values()) == 0  # nothing of 32 MiB


def test_a_new_storage_of_32_mib_is_fresh_and_an_in_place_write_is_not():
    mode = CensusMode(lambda: "loss")
    x = torch.empty(C.FRESH_BYTES // 4)
    with mode:
        mode.on = True
        y = x * 2  # a new 32 MiB storage
        y.add_(1)  # written in place: its pages are mapped already
    records = {r.op: r for r in mode.census().records}
    assert records["aten.mul"].fresh == C.FRESH_BYTES == records["aten.mul"].written
    assert records["aten.add_"].fresh == 0 and records["aten.add_"].read == records["aten.add_"].written


@pytest.mark.parametrize(
    ("op", "phase", "dtypes", "counted", "cls"),
    [
        (torch.ops.aten.mm.default, "loss", (torch.float32, torch.float32), True, C.MATMUL),
        (torch.ops.aten.convolution_backward.default, "backward", (torch.float32,) * 2, True, C.MATMUL),
        (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, "loss", (torch.float32,) * 2, True,
         C.ATTENTION),
        (torch.ops.aten._softmax.default, "loss", (torch.float32,) * 2, False, C.REDUCTION),
        (torch.ops.aten.native_layer_norm.default, "loss", (torch.float32,) * 2, False, C.REDUCTION),
        (torch.ops.aten.nll_loss_forward.default, "loss", (torch.float32,) * 2, False, C.REDUCTION),
        (torch.ops.aten.sum.dim_IntList, "loss", (torch.float32,) * 2, False, C.REDUCTION),
        (torch.ops.aten.add.Tensor, "loss", (torch.float32,) * 2, False, C.ELEMENTWISE),
        (torch.ops.aten._to_copy.default, "loss", (torch.bfloat16, torch.float32), False, C.ELEMENTWISE),  # a cast
        (torch.ops.aten._to_copy.default, "loss", (torch.float32, torch.float32), False, C.COPIES),
        (torch.ops.aten.cat.default, "loss", (torch.float32,) * 2, False, C.COPIES),
        (torch.ops.aten.add_.Tensor, "optimizer", (torch.float32,) * 2, False, C.OPTIMIZER),
        (torch.ops.aten._foreach_add_.List, "backward", (None, torch.float32), False, C.OPTIMIZER),
        (torch.ops.aten.view.default, "loss", (torch.float32,) * 2, False, C.VIEWS),
        (torch.ops.prim.device.default, "loss", (None, torch.float32), False, C.VIEWS),
    ],
)  # fmt: skip
def test_known_operators_fall_in_their_class(op, phase, dtypes, counted, cls):
    assert C.op_class(op, phase, *dtypes, counted) == cls


def test_collectives_are_named_by_what_they_do():
    assert C.collective_kind("c10d.allreduce_") == C.ALL_REDUCE
    assert C.collective_kind("_c10d_functional.all_gather_into_tensor") == C.ALL_GATHER
    assert C.collective_kind("c10d._reduce_scatter_base_") == C.REDUCE_SCATTER
    assert C.op_class(torch.ops.c10d.allreduce_.default, "backward", torch.float32, torch.float32, False) == (
        C.COLLECTIVES
    )


def test_a_collectives_output_buffers_are_written_and_a_copys_destination_is_not_read():
    out, shard = torch.empty(8), torch.empty(4)
    gather = torch.ops.c10d._allgather_base_.default  # (output_tensor, input_tensor, group, ...): no alias marks
    assert C._moved(gather, (out, shard, None), [out, shard], [out], C.COLLECTIVES) == ([shard], [out])
    scatter = torch.ops.c10d._reduce_scatter_base_.default
    assert C._moved(scatter, (shard, out, None), [shard, out], [shard], C.COLLECTIVES) == ([out], [shard])
    reduce = torch.ops._c10d_functional.all_reduce.default  # functional: reads its input, returns a new tensor
    assert C._moved(reduce, (out, "sum", "0"), [out], [shard], C.COLLECTIVES) == ([out], [shard])
    copy = torch.ops.aten.copy_.default
    assert C._moved(copy, (out, shard), [out, shard], [out], C.COPIES) == ([shard], [out])


def test_a_census_survives_the_planners_json_round_trip():
    census = Census((Record("aten.mm", C.MATMUL, "loss", "float32", 10, 20, 30, 2, 0),), world_size=4)
    fields = json.loads(json.dumps(dataclasses.asdict(Prediction(1, census=census))))
    assert Census.from_json(fields["census"]) == census


# ---------------------------------------------------------------------------------------------------- the model


def _rates(**over) -> Rates:
    base = dict(name="hand", peaks={"float32": 100.0, "bfloat16": 400.0}, bandwidth=1000.0, fractions=ONE,
                launch_us=5.0, interconnect=450.0)  # fmt: skip
    return Rates(**(base | over))


def test_a_compute_bound_matmul_is_its_flops_over_the_peak_times_its_fraction():
    census = Census((Record("aten.mm", C.MATMUL, "loss", "bfloat16", flops=2 * 10**12, read=10**6, launches=1),))
    t = predict_step_time(census, _rates(fractions=ONE | {C.MATMUL: (0.5, 1.0)}))
    assert t.ms == pytest.approx(2e12 / (400e12 * 0.5) * 1e3 + 0.005)  # 10 ms + one launch
    assert t.phases == {"loss": pytest.approx(t.ms)} and t.classes == {C.MATMUL: pytest.approx(t.ms)}
    assert t.bound[COMPUTE] == pytest.approx(10 / t.ms) and t.bound[LAUNCH] == pytest.approx(0.005 / t.ms)


def test_a_memory_bound_operator_is_its_bytes_over_the_bandwidth_times_its_fraction():
    census = Census((Record("aten.mul", C.ELEMENTWISE, "loss", "float32", read=2 * 10**9, written=10**9, launches=2),))
    t = predict_step_time(census, _rates(fractions=ONE | {C.ELEMENTWISE: (1.0, 0.75)}))
    assert t.ms == pytest.approx(3e9 / (1000e9 * 0.75) * 1e3 + 0.010)  # 4 ms + two launches
    assert t.bound[MEMORY] == pytest.approx(4 / t.ms)


def test_a_launch_bound_step_is_its_launches_times_the_floor():
    census = Census((Record("aten.add", C.ELEMENTWISE, "optimizer", "float32", read=8, written=4, launches=1000),))
    t = predict_step_time(census, _rates())
    assert t.ms == pytest.approx(1000 * 5e-3 + 12 / 1e12 * 1e3)
    assert t.bound[LAUNCH] > 0.999


def test_fresh_pages_cost_their_first_touch_where_the_rates_price_it():
    record = Record("aten.mul", C.ELEMENTWISE, "loss", "float32", read=10**9, written=10**9, launches=1, fresh=10**9)
    cpu = predict_step_time(Census((record,)), _rates(first_touch=2.5))
    gpu = predict_step_time(Census((record,)), _rates())
    assert cpu.ms - gpu.ms == pytest.approx(1e9 / 2.5e9 * 1e3)


@pytest.mark.parametrize(
    ("op", "factor"),
    [("c10d.allreduce_", 2 * 7 / 8), ("c10d._allgather_base_", 7 / 8), ("c10d._reduce_scatter_base_", 7 / 8)],
)
def test_collectives_take_the_ring_formulas_over_the_interconnect(op, factor):
    # an all-gather's size is what it gathers (written), the others' what they reduce (read)
    size = 9 * 10**8
    read, written = (size // 8, size) if "allgather" in op else (size, size // 8 if "scatter" in op else size)
    census = Census((Record(op, C.COLLECTIVES, "backward", "float32", read=read, written=written, launches=1),), 8)
    t = predict_step_time(census, _rates(fractions=ONE | {C.COLLECTIVES: (1.0, 0.8)}))
    assert t.ms == pytest.approx(factor * size / (450e9 * 0.8) * 1e3 + 0.005)
    assert predict_step_time(dataclasses.replace(census, world_size=1), _rates()).ms == pytest.approx(0.005)


def test_phases_are_summed_in_the_order_the_step_ran_them():
    records = (
        Record("aten.mm", C.MATMUL, "teacher_forward", "float32", flops=10**11, launches=1),
        Record("aten.mm", C.MATMUL, "backward", "float32", flops=2 * 10**11, launches=1),
        Record("aten.add_", C.OPTIMIZER, "optimizer", "float32", read=10**9, written=10**9, launches=1),
    )
    t = predict_step_time(Census(records), _rates(launch_us=0.0))
    assert list(t.phases) == ["teacher_forward", "backward", "optimizer"]
    assert [round(v, 6) for v in t.phases.values()] == [1.0, 2.0, 2.0] and t.ms == pytest.approx(5.0)
    assert sum(t.bound.values()) == pytest.approx(1.0)


def test_a_table_device_is_priced_from_its_datasheet_and_its_vendors_fractions():
    h100 = find_card("H100")
    rates = rates_for(h100, "bf16")
    assert rates.peaks == {"float32": 67.0, "bfloat16": 989.4, "float16": 989.4}
    assert rates_for(h100, "tf32").peaks["float32"] == 494.7  # a tf32 cell's float32 matmuls run as TF32
    assert rates.bandwidth == 3350.0 and rates.interconnect == 450.0  # NVLink's 900 GB/s, one direction
    assert rates.fractions[C.MATMUL] == (0.70, 0.85) and "SemiAnalysis" in rates.sources["fractions"]
    assert rates_for(find_card("MI300X"), "bf16").fractions[C.MATMUL][0] == 0.45
    with pytest.raises(KdbenchError, match="T4 has no tf32 figure in the device table; use one of fp32, fp16"):
        rates_for(find_card("T4"), "tf32")


def test_the_machines_rates_come_from_its_probe_or_its_rows_ceilings():
    probe = {"matmul_fp32": 0.16, "matmul_bf16": 0.37, "copy": 28.0, "probe_id": "probe-x"}
    rates = rates_from_probe(probe, "bf16")
    assert rates.peaks == {"float32": 0.16, "bfloat16": 0.37} and rates.bandwidth == 28.0
    assert rates.name == "probe probe-x" and rates.first_touch and rates.launch_us > 0
    assert rates_from_probe({"matmul_fp32": 0.16, "probe_id": "p"}, "fp32") is None  # no copy: no memory term
    row = Row(ceiling_tflops=0.37, teacher_ceiling_tflops=0.16, ceiling_gbps=28.0, ceiling_probe_id="probe-x")
    assert rates_from_row(row, "bf16", "fp32").peaks == {"float32": 0.16, "bfloat16": 0.37}
    assert rates_from_row(Row(), "fp32") is None


# ---------------------------------------------------------------------------------------------------- the rows


def test_a_row_with_probe_ceilings_gets_the_step_time_and_its_ratio():
    config = make_config()
    prediction = predict(config, "cpu")
    row = Row(status="ok", ceiling_tflops=0.2, ceiling_gbps=20.0, ceiling_probe_id="probe-x")
    expected = predict_step_time(prediction, rates_from_row(row, "fp32")).ms
    row["median_ms"] = expected * 1.2
    columns, notes = step_time_columns(prediction, row, config, "cpu")
    assert columns["predicted_step_ms"] == pytest.approx(expected) and expected > 0
    assert columns["predicted_step_ratio"] == pytest.approx(1.2) and notes == []
    row["median_ms"] = expected * 3
    columns, [note] = step_time_columns(prediction, row, config, "cpu")
    assert note.startswith(FIT_NOTE) and "3.000x the predicted" in note and "outside the tolerance 0.67-1.50" in note
    # the run's probe, handed down, is preferred to the row's columns (which a worker's row has not yet)
    ceiling = {"matmul_fp32": 0.4, "copy": 40.0, "probe_id": "probe-y"}
    columns, _ = step_time_columns(prediction, Row(status="ok", median_ms=1.0), config, "cpu", ceiling)
    assert columns["predicted_step_ms"] < expected


def test_a_row_without_rates_keeps_null_step_columns_and_says_why():
    config = make_config()
    columns, notes = step_time_columns(predict(config, "cpu"), Row(status="ok", median_ms=5.0), config, "cpu")
    assert dict(columns) == {}
    assert notes == [
        f"{FIT_NOTE}step time not predicted: no probe of this device (run `kdbench probe`) and a CPU has no "
        "datasheet entry"
    ]
    # an unpredictable cell: no step time, and no second note (its peak's says why)
    assert step_time_columns(Prediction(None, error="x"), Row(status="ok"), config, "cpu") == (Row(), [])


def test_a_ddp_cells_census_holds_the_all_reduce_its_reducer_runs():
    config = make_config(world_size=2)
    census = predict(config, "cpu").census
    [reduce] = [r for r in census.records if r.cls == C.COLLECTIVES]
    trainable = sum(
        p.numel() * 4 for p in workload_of(config).step_pair(config, CPU, ModelCache(), None)[1].parameters()
    )
    assert (reduce.op, reduce.phase, reduce.read, census.world_size) == ("c10d.allreduce_", "backward", trainable, 2)
    assert predict(make_config(), "cpu").census.world_size == 1


# ------------------------------------------------------------------------------------- the probe's class rates

CLASSES_PROBE = {
    "matmul_fp32": 0.2, "matmul_bf16": 0.4, "copy": 30.0, "probe_id": "probe-c",
    "exp_fp32": 2.0, "exp_bf16": 4.0, "elementwise_fp32": 20.0, "attention_fp32": 0.05, "conv_fp32": 0.1,
    "conv_grouped_fp32": 0.004, "conv_bf16": 0.3, "launch_op": 1.0, "launch_conv": 5.0, "launch_conv_backward": 13.0,
}  # fmt: skip


def test_a_probe_with_class_rows_gives_the_rates_each_class_is_priced_with():
    rates = rates_from_probe(CLASSES_PROBE, "fp32")
    assert rates.exp == {"float32": 2.0, "bfloat16": 4.0} and rates.elementwise == {"float32": 20.0}
    assert rates.class_peaks == {
        "attention": {"float32": 0.05},
        "conv": {"float32": 0.1, "bfloat16": 0.3},
        "conv_grouped": {"float32": 0.004},
    }
    assert rates.floors == {"op": 1.0, "conv": 5.0, "conv_backward": 13.0} and "classes" in rates.sources
    bare = rates_from_probe({k: CLASSES_PROBE[k] for k in ("matmul_fp32", "copy", "probe_id")}, "fp32")
    assert bare.exp == {} and bare.class_peaks == {} and bare.floors == {}  # an older probe: priced as before


def test_an_exp_costs_its_elements_at_the_probes_exp_rate_where_that_is_slower_than_its_bytes():
    n = 10**9  # float32 elements: 8 GB read and written
    exp = Record("aten.exp", C.ELEMENTWISE, "loss", "float32", read=4 * n, written=4 * n, launches=1)
    add = dataclasses.replace(exp, op="aten.add")
    rates = rates_from_probe(CLASSES_PROBE, "fp32")
    assert predict_step_time(Census((exp,)), rates).ms == pytest.approx(n / 2e9 * 1e3 + rates.launch_us / 1e3)
    assert predict_step_time(Census((add,)), rates).ms == pytest.approx(8e9 / 20e9 * 1e3 + rates.launch_us / 1e3)
    lse = Record("aten.logsumexp", C.REDUCTION, "loss", "float32", read=4 * n, written=4 * 1000, launches=1)
    assert predict_step_time(Census((lse,)), rates).ms == pytest.approx(n / 2e9 * 1e3 + rates.launch_us / 1e3)
    # bf16: its own rate, its own element size
    half = Record("aten._softmax", C.REDUCTION, "loss", "bfloat16", read=2 * n, written=2 * n, launches=1)
    assert predict_step_time(Census((half,)), rates).ms == pytest.approx(n / 4e9 * 1e3 + rates.launch_us / 1e3)


def test_convolutions_take_their_class_rate_and_floor_and_attention_its_own():
    rates = rates_from_probe(CLASSES_PROBE, "fp32")
    flops = 10**9
    dense = Record("aten.convolution", C.MATMUL, "student_forward", "float32", flops=flops, launches=1)
    grouped = dataclasses.replace(dense, op="aten.convolution" + C.GROUPED)
    back = dataclasses.replace(dense, op="aten.convolution_backward", launches=2)
    attention = Record("aten._scaled_dot_product_flash_attention_for_cpu", C.ATTENTION, "loss", "float32",
                       flops=flops, launches=1)  # fmt: skip
    mm = Record("aten.mm", C.MATMUL, "loss", "float32", flops=flops, launches=1)
    floor = rates.launch_us
    ms = {r.op: predict_step_time(Census((r,)), rates).ms for r in (dense, grouped, back, attention, mm)}
    assert ms["aten.convolution"] == pytest.approx(1e9 / 0.1e12 * 1e3 + (floor + 5.0 - 1.0) / 1e3)
    assert ms["aten.convolution(grouped)"] == pytest.approx(1e9 / 0.004e12 * 1e3 + (floor + 4.0) / 1e3)
    assert ms["aten.convolution_backward"] == pytest.approx(1e9 / 0.1e12 * 1e3 + 2 * (floor + 12.0) / 1e3)
    assert ms["aten._scaled_dot_product_flash_attention_for_cpu"] == pytest.approx(20.0 + floor / 1e3)
    assert ms["aten.mm"] == pytest.approx(5.0 + floor / 1e3)  # the matmul's ceiling, as before
    # a dtype the class was not probed in falls back to the matmul's ceiling of that dtype
    half = dataclasses.replace(grouped, dtype="bfloat16")
    assert predict_step_time(Census((half,)), rates).ms == pytest.approx(1e9 / 0.4e12 * 1e3 + (floor + 4.0) / 1e3)


def test_a_convolutions_backward_takes_the_probes_backward_rate_where_it_has_one():
    probe = {**CLASSES_PROBE, "conv_backward_fp32": 0.05, "conv_grouped_backward_fp32": 0.0005}
    rates = rates_from_probe(probe, "fp32")
    assert rates.class_peaks["conv_backward"] == {"float32": 0.05}
    assert rates.class_peaks["conv_grouped_backward"] == {"float32": 0.0005}
    flops, floor = 10**9, rates.launch_us
    back = Record("aten.convolution_backward", C.MATMUL, "backward", "float32", flops=flops, launches=1)
    grouped = dataclasses.replace(back, op="aten.convolution_backward" + C.GROUPED)
    forward = dataclasses.replace(back, op="aten.convolution", phase="student_forward")
    ms = {r.op: predict_step_time(Census((r,)), rates).ms for r in (back, grouped, forward)}
    assert ms["aten.convolution_backward"] == pytest.approx(1e9 / 0.05e12 * 1e3 + (floor + 12.0) / 1e3)
    assert ms["aten.convolution_backward(grouped)"] == pytest.approx(1e9 / 0.0005e12 * 1e3 + (floor + 12.0) / 1e3)
    assert ms["aten.convolution"] == pytest.approx(1e9 / 0.1e12 * 1e3 + (floor + 4.0) / 1e3)  # its forward's, still
    # a backward in a dtype the probe has no backward rate for: the forward's of that dtype (bf16's conv 0.3)
    half = dataclasses.replace(back, dtype="bfloat16")
    assert predict_step_time(Census((half,)), rates).ms == pytest.approx(1e9 / 0.3e12 * 1e3 + (floor + 12.0) / 1e3)


def test_the_census_names_a_grouped_convolution_apart(one_thread):
    x = torch.randn(2, 8, 6, 6, requires_grad=True)
    dense, depthwise = torch.randn(8, 8, 3, 3, requires_grad=True), torch.randn(8, 1, 3, 3, requires_grad=True)
    mode = CensusMode(lambda: "student_forward")
    with mode:
        mode.on = True
        out = torch.nn.functional.conv2d(x, dense, None, 1, 1) + torch.nn.functional.conv2d(
            x, depthwise, None, 1, 1, 1, 8
        )
        out.sum().backward()
    ops = {r.op: r for r in mode.census().records if "convolution" in r.op}
    assert set(ops) == {"aten.convolution", "aten.convolution(grouped)", "aten.convolution_backward",
                        "aten.convolution_backward(grouped)"}  # fmt: skip
    assert ops["aten.convolution"].flops == 8 * ops["aten.convolution(grouped)"].flops  # 8 groups: 1/8 the work
    assert ops["aten.convolution_backward(grouped)"].flops == 2 * ops["aten.convolution(grouped)"].flops
