"""The fit planner (kdbench.fit): a cell's own distillation step run on fake tensors predicts the peak of live tensor
bytes that the real step reaches, measured independently (kdbench.measure.memory.live_tensor_peak: the garbage
collector's tensors plus torch.profiler's allocation events), with the peak's phase and what it holds."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch

from kdbench.config.schema import CellConfig
from kdbench.core.names import GENERATE, PHASES
from kdbench.distill.step import DistillStep
from kdbench.fit import planner
from kdbench.fit.planner import CPU, Prediction, ddp_bucket_bytes, predict, predict_apart
from kdbench.fit.tracker import ACTIVATIONS, GRADIENTS, KINDS, OPTIMIZER, PARAMETERS, LiveBytes
from kdbench.measure.memory import live_tensor_peak
from kdbench.models.cache import ModelCache
from kdbench.workloads.registry import workload_of
from tests.support.paths import SUPPORT, TESTS

pytestmark = pytest.mark.usefixtures("one_thread")
PAIR = {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"}


def lm(**over) -> CellConfig:
    base = {"pair": PAIR, "method": "forward_kl", "batch_size": 2, "data": {"kind": "tokens", "seq_len": 128}}
    return CellConfig.model_validate(base | over)


def measured(config: CellConfig) -> int:
    """The live-tensor peak of one real step after two warm ones (as a timed loop's steps are)."""
    workload = workload_of(config)
    pair = workload.step_pair(config, CPU, ModelCache(), None)
    x, y = workload.batch(config, config.batch_size, CPU.device, config.seed, pair)
    step = DistillStep(*pair, x, y, config, CPU, workload)
    step()
    step()
    try:
        return live_tensor_peak(step)
    finally:
        step.close()


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


@pytest.mark.parametrize(
    ("impl", "precision"),
    [("dense", "fp32"), ("natural", "fp32"), ("chunked", "fp32"), ("fused_linear", "fp32"), ("fused_linear", "bf16")],
)
def test_an_lm_steps_predicted_peak_is_its_measured_live_peak(impl, precision):
    config = lm(loss_impl=impl, chunk_size=64, precision=precision, teacher_precision=precision)
    prediction = predict(config, "cpu")
    assert prediction.ok and prediction.error is None
    real = measured(config)
    assert abs(real / prediction.peak_bytes - 1) < 0.01, (impl, mib(real), mib(prediction.peak_bytes))
    assert prediction.phase in {p.name for p in PHASES}
    assert set(prediction.breakdown) == set(KINDS) and sum(prediction.breakdown.values()) == pytest.approx(
        prediction.peak_bytes, rel=0.005
    )


def test_a_compiled_cells_fake_run_is_its_eager_twins_so_they_share_one():
    # the fake run is eager: compile and compile_teacher change neither the peak nor the census, so the fit's caches
    # key a fake run without them (fake_run_key), and timing settings neither
    from kdbench.fit.planner import fake_run_key

    eager = lm(loss_impl="fused_linear", chunk_size=64)
    compiled = lm(loss_impl="fused_linear", chunk_size=64, compile="default", compile_teacher=True)
    a, b = predict(eager, "cuda"), predict(compiled, "cuda")
    assert a.ok and (a.peak_bytes, a.phase, a.breakdown) == (b.peak_bytes, b.phase, b.breakdown)
    assert a.census.records == b.census.records
    timed = lm(loss_impl="fused_linear", chunk_size=64, timing={"min_iters": 7})
    assert fake_run_key(eager) == fake_run_key(compiled) == fake_run_key(timed)
    assert fake_run_key(eager) != fake_run_key(lm(loss_impl="fused_linear", chunk_size=32))


@pytest.mark.parametrize("impl", ["chunked", "fused_linear"])
def test_a_jsd_chunks_mixture_is_seen_by_the_meter(impl):
    # issue 45: the mixture's log was logsumexp over a (2, chunk, V) stack, whose kernel allocates its max and
    # stack − max where no dispatch mode sees them: measured 2 · chunk · V · 4 bytes (1.05x here) above the plan
    vocab = {"vocab_size": 5003}
    config = lm(method="jsd", loss_impl=impl, chunk_size=100, overrides={"teacher": vocab, "student": vocab})
    prediction = predict(config, "cpu")
    assert prediction.ok, prediction.error
    real = measured(config)
    assert abs(real / prediction.peak_bytes - 1) < 0.01, (impl, mib(real), mib(prediction.peak_bytes))


def test_the_breakdown_counts_parameters_gradients_and_adamw_state_exactly():
    config = lm()
    workload = workload_of(config)
    teacher, student = workload.step_pair(config, CPU, ModelCache(), None)
    t_bytes = sum(p.nbytes for p in teacher.parameters()) + sum(b.nbytes for b in teacher.buffers())
    s_bytes = sum(p.nbytes for p in student.parameters()) + sum(b.nbytes for b in student.buffers())
    s_params = sum(p.nbytes for p in student.parameters())
    b = predict(config, "cpu").breakdown
    assert b[PARAMETERS] == t_bytes + s_bytes
    assert b[GRADIENTS] == s_params  # fp32 gradients of every student parameter, alive at the peak
    # AdamW: two fp32 moments per parameter, and a step counter each
    n_tensors = len(list(student.parameters()))
    assert b[OPTIMIZER] == 2 * s_params + 4 * n_tensors
    assert b[ACTIVATIONS] > 0
    assert predict(config, "cpu").host.startswith("host ")  # the plan's host figure beside it


def test_the_peak_grows_with_the_batch_by_the_activations_alone():
    one, two = predict(lm(batch_size=2), "cpu"), predict(lm(batch_size=4), "cpu")
    assert two.breakdown[PARAMETERS] == one.breakdown[PARAMETERS]
    assert two.breakdown[OPTIMIZER] == one.breakdown[OPTIMIZER]
    assert 1.8 < two.breakdown[ACTIVATIONS] / one.breakdown[ACTIVATIONS] < 2.1


def test_a_vision_pair_is_predicted_within_the_workspaces_its_convolutions_allocate():
    config = CellConfig.model_validate(
        {
            "pair": {"teacher": "resnet20", "student": "resnet8"},
            "batch_size": 16,
            "data": {"kind": "synthetic", "shape": [3, 32, 32], "num_classes": 10},
        }
    )
    prediction = predict(config, "cpu")
    real = measured(config)
    # the CPU's convolutions allocate workspaces that are not tensors of the step: measured a few % above
    assert 0.97 < real / prediction.peak_bytes < 1.10, (mib(real), mib(prediction.peak_bytes))


def test_on_policy_and_topk_cache_cells_are_predicted_through_their_own_phases():
    on_policy = predict(lm(on_policy={"new_tokens": 8}, data={"kind": "tokens", "seq_len": 64}), "cpu")
    assert on_policy.ok, on_policy.error
    cached = lm(teacher={"mode": "topk_cache", "k": 16})
    prediction = predict(cached, "cpu")
    assert prediction.ok, prediction.error
    # kernels' own buffers beyond their outputs, which no tensor of the step holds: 1.03 here since the sparse KL's
    # gradient is written out (1.047 with autograd's, whose scatter allocated inside its kernel).  Whether that ~2 MB
    # buffer is allocated depends on the process: in one fresh-clone CI run (xdist, after other tests in the worker)
    # the measured peak read 0.99992 of the prediction (4,972 bytes under it), alone 1.0315 every time
    assert 0.999 <= measured(cached) / prediction.peak_bytes < 1.06
    assert GENERATE.name != "" and on_policy.phase in {p.name for p in (GENERATE, *PHASES)} | {"cache build"}


def test_a_ddp_rank_holds_one_devices_step_and_its_gradient_buckets():
    one = predict(lm(), "cpu")
    ddp = predict(lm(world_size=2), "cpu")
    student = workload_of(lm()).step_pair(lm(), CPU, ModelCache(), None)[1]
    grads = sum(p.nbytes for p in student.parameters())
    assert ddp.peak_bytes == one.peak_bytes + grads and "buckets" in " ".join(ddp.notes)
    view = predict(lm(world_size=2, ddp={"gradient_as_bucket_view": True}), "cpu")
    assert view.peak_bytes == one.peak_bytes and ddp_bucket_bytes(lm(), student) == 0


def test_an_fsdp2_rank_holds_its_shards_of_both_models():
    one = predict(lm(), "cpu").breakdown
    fsdp = predict(lm(world_size=2, parallel="fsdp"), "cpu")
    assert fsdp.ok, fsdp.error
    # every parameter is cut in two along its first dimension (all of the tiny pair's are even)
    assert fsdp.breakdown[PARAMETERS] == pytest.approx(one[PARAMETERS] / 2, rel=0.01)
    assert fsdp.breakdown[OPTIMIZER] == pytest.approx(one[OPTIMIZER] / 2, rel=0.01)


@pytest.mark.slow
def test_inside_a_process_group_an_fsdp2_cell_is_predicted_in_a_process_of_its_own():
    config = lm(world_size=2, parallel="fsdp")
    apart, here = predict_apart(config, "cpu"), predict(config, "cpu")
    assert apart.peak_bytes == here.peak_bytes and apart.breakdown == here.breakdown and apart.phase == here.phase


@pytest.mark.slow
def test_an_fsdp2_2_rank_cell_under_torchrun_reaches_its_predicted_peak_on_each_rank(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys, torch, torch.distributed as dist\n"
        "from kdbench.config.schema import CellConfig\n"
        "from kdbench.distill.step import DistillStep\n"
        "from kdbench.fit.planner import CPU\n"
        "from kdbench.measure.memory import live_tensor_peak\n"
        "from kdbench.measure.parallel import DataParallel\n"
        "from kdbench.models.cache import ModelCache\n"
        "from kdbench.workloads.registry import workload_of\n"
        "torch.set_num_threads(1)\n"
        "config = CellConfig.model_validate_json(sys.argv[1])\n"
        "dist.init_process_group('gloo')\n"
        "w = workload_of(config); dp = DataParallel()\n"
        "pair = w.step_pair(config, CPU, ModelCache(), dp)\n"
        "x, y = w.batch(config, config.batch_size, CPU.device, config.seed + dp.rank, pair)\n"
        "step = DistillStep(*pair, x, y, config, CPU, w, wrap=dp.wrapper(config, CPU), "
        "wrap_teacher=dp.teacher_wrapper(config, CPU))\n"
        "step(); step()\n"
        "print('peak', dp.rank, live_tensor_peak(step), flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    config = lm(world_size=2, parallel="fsdp", data={"kind": "tokens", "seq_len": 256})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(TESTS.parent), *sys.path])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    proc = subprocess.run([*cmd, config.model_dump_json()], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the two ranks share torchrun's stdout: their lines are looked for anywhere in it, and a miss shows it (under
    # three pytest workers on two cores it once found one line of two, its stdout not shown: the cause is unknown)
    peaks = dict(re.findall(r"peak (\d) (\d+)", proc.stdout))
    assert sorted(peaks) == ["0", "1"], proc.stdout[-2000:]
    predicted = predict(config, "cpu").peak_bytes
    assert all(abs(int(p) / predicted - 1) < 0.01 for p in peaks.values()), (peaks, predicted)


def test_an_operator_without_a_fake_implementation_makes_the_cell_unpredictable_naming_it(monkeypatch):
    monkeypatch.syspath_prepend(str(SUPPORT))
    config = CellConfig.model_validate(
        {
            "pair": {"teacher": "resnet8", "student": "faulty_models:opaque"},
            "batch_size": 4,
            "data": {"kind": "synthetic", "shape": [3, 32, 32], "num_classes": 10},
        }
    )
    prediction = predict(config, "cpu", allow_imports=True)
    assert prediction.peak_bytes is None and not prediction.ok
    assert "kdbench_test::opaque" in prediction.error and "fake" in prediction.error


def test_liger_cells_branch_on_the_host_and_are_predicted_with_that_branch_said(monkeypatch):
    from kdbench.distill.lm.impls import unavailable

    prediction = predict(lm(loss_impl="liger"), "cuda")
    if unavailable("liger"):  # a machine without liger-kernel: not predicted, said why
        assert "not predicted" in prediction.error and "liger" in prediction.error
    else:  # liger-kernel 0.8's backward compares its grad_output with 1.0 on the host (gpu-review-3 L9)
        assert prediction.ok and prediction.peak_bytes > 0
        assert any("host branch(es) on a bool tensor's value taken as False" in n for n in prediction.notes)


def test_a_host_branch_on_a_bool_is_taken_as_false_and_any_other_value_read_is_unpredictable():
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    from kdbench.fit.planner import HostBranches

    with FakeTensorMode(), HostBranches() as branches:
        x = torch.ones(3)
        assert bool(torch.ne(x.sum(), 3.0)) is False and branches.taken == 1
        assert bool(torch.ne(x.sum(), 3.0).any()) is False and branches.taken == 2
        with pytest.raises(DataDependentOutputException):
            x.sum().item()  # a float: it may be a size or a scale, never guessed
        with pytest.raises(DataDependentOutputException):
            int(torch.ne(x, 1.0).sum())  # a count: it may be a size
    assert "2 host branch(es)" in branches.note
    assert HostBranches().note == ""


def test_the_meter_counts_a_storage_once_and_frees_it_when_it_dies():
    from torch._subclasses.fake_tensor import FakeTensorMode

    meter = LiveBytes()
    with FakeTensorMode(), meter:
        a = torch.empty(1000, dtype=torch.float32)
        view = a[:10]
        assert meter.live == 4000
        b = torch.empty(500, dtype=torch.float64)
        assert meter.live == 8000
        del a, b
        assert meter.live == 4000  # the view keeps a's storage
        del view
        assert meter.live == 0 and meter.peak.bytes == 8000


def test_the_meter_says_what_each_phase_held_at_its_own_peak_exactly():
    """Each phase's own peak and its bytes by kind at that moment, from every storage's life; the step's peak's
    breakdown likewise, where a snapshot within 0.2 % of the peak was all it had."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    meter = LiveBytes(snapshot_step=0.5, phases=True)
    with FakeTensorMode(), meter:
        params = torch.empty(1000)  # 4,000 bytes
        meter.track([params], PARAMETERS)
        meter.start_phases()
        meter.phase = "student_forward"
        act = torch.empty(500)  # 2,000: an activation
        tmp = torch.empty(250)  # 1,000
        del tmp
        meter.phase = "backward"
        grad = torch.empty(1000)  # 4,000
        meter.mark([grad], GRADIENTS)
        del act
        big = torch.empty(600)  # 2,400: a temporary, the step's peak (10,400)
        del big, grad
    fwd, bwd = meter.phase_peaks["student_forward"][0], meter.phase_peaks["backward"][0]
    assert (fwd, bwd) == (7000, 10400)
    assert meter.phase_breakdown("student_forward") == {**dict.fromkeys(KINDS, 0), PARAMETERS: 4000, ACTIVATIONS: 3000}
    held = {**dict.fromkeys(KINDS, 0), PARAMETERS: 4000, GRADIENTS: 4000, "temporaries": 2400}
    assert meter.phase_breakdown("backward") == held
    assert meter.peak.bytes == 10400 and meter.breakdown() == held  # the snapshot (50 % steps) had the forward's


def test_a_peak_that_rises_by_small_steps_keeps_a_snapshot_within_the_step_of_it():
    """Without the storages' lives the breakdown is the last snapshot: taken once the peak is ``snapshot_step``
    above the last snapshot (a rule against the previous peak kept 20 of 1,000 bytes here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    meter = LiveBytes(snapshot_step=0.5)
    with FakeTensorMode(), meter:
        kept = [torch.empty(10, dtype=torch.uint8) for _ in range(100)]
    assert meter.peak.bytes == 1000 and len(kept) == 100
    held = sum(meter.breakdown().values())
    assert 1000 / 1.5 <= held <= 1000


def test_a_prediction_is_a_plain_record_for_the_rows_and_the_cli():
    p = Prediction(None, error="x")
    assert not p.ok and p.breakdown == {} and p.notes == ()


def test_an_encoder_pairs_predicted_peak_is_its_measured_live_peak():
    config = CellConfig.model_validate(
        {
            "pair": {"teacher": "tiny-bert-teacher", "student": "tiny-bert-student"},
            "method": "minilm",
            "batch_size": 4,
            "data": {"kind": "tokens", "seq_len": 128},
        }
    )
    prediction = predict(config, "cpu")
    assert prediction.ok, prediction.error
    assert abs(measured(config) / prediction.peak_bytes - 1) < 0.01


def test_a_process_without_transformers_gets_no_transformers_import_from_the_fit_check(monkeypatch):
    """A vision worker never imports transformers for the planner's packed-sequence answer (3.6 s of its start)."""
    from kdbench.models.lm import as_measured_batches

    for name in [n for n in sys.modules if n == "transformers" or n.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)
    with as_measured_batches():
        assert "transformers" not in sys.modules
    assert "transformers" not in sys.modules


def _vision(method: str, **more) -> CellConfig:
    raw = {
        "pair": {"teacher": "resnet8", "student": "resnet8"},
        "method": method,
        "batch_size": 4,
        "data": {"kind": "synthetic", "shape": [3, 16, 16], "num_classes": 10},
    }
    return CellConfig.model_validate(raw | more)


PRIMED_CELLS = {
    "vision kd": _vision("kd"),
    "vision fitnet (an adapter trains)": _vision("fitnet"),
    "vision crd (a memory bank)": _vision("crd"),
    "vision dkd, sgd": _vision("dkd", optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9}),
    "lm dense": lm(),
    "lm fused_linear bf16": lm(loss_impl="fused_linear", chunk_size=64, precision="bf16", teacher_precision="bf16"),
    "lm jsd chunked": lm(method="jsd", loss_impl="chunked", chunk_size=64),
    "lm top-k cached teacher": lm(teacher={"mode": "topk_cache", "k": 8}),
    # the generation run once: its labels buffer, the batch the step keeps as its input, a static cache
    "lm on-policy jsd": lm(method="jsd", on_policy={"new_tokens": 12}, data={"kind": "tokens", "seq_len": 64}),
    "lm on-policy static cache, fused_linear": lm(
        on_policy={"new_tokens": 12}, generation={"cache": "static"}, loss_impl="fused_linear", chunk_size=32,
        data={"kind": "tokens", "seq_len": 64},
    ),
    "encoder minilm": CellConfig.model_validate(
        {"pair": {"teacher": "tiny-bert-teacher", "student": "tiny-bert-student"}, "method": "minilm", "batch_size": 2,
         "data": {"kind": "tokens", "seq_len": 32}}
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(PRIMED_CELLS))
def test_a_primed_fake_run_is_the_two_step_run_at_half_the_operators(name):
    # the first step's leftovers made without running it (zero gradients kept as the previous step's, the optimizer's
    # state from one update of them): the peak, its phase, its breakdown, each phase's own peak and the census are
    # the two-step run's (breakdowns exact: the storages' lives kept, not a snapshot within 0.2 % of the peak)
    config = PRIMED_CELLS[name]
    primed, reference = (
        predict(config, "cuda", phase_peaks=True),
        predict(config, "cuda", prime=False, phase_peaks=True),
    )
    assert primed.ok and reference.ok, (primed.error, reference.error)
    assert (primed.peak_bytes, primed.phase) == (reference.peak_bytes, reference.phase)
    assert primed.breakdown == reference.breakdown
    # each phase's own peak; a phase that makes no storage in the primed step has none (SGD's momentum, updated in
    # place: the reference's is its first step's, which made the buffers)
    assert primed.phase_peaks and primed.phase_peaks == {
        k: v for k, v in reference.phase_peaks.items() if k in primed.phase_peaks
    }
    assert set(reference.phase_peaks) - set(primed.phase_peaks) <= ({"optimizer"} if "sgd" in name else set())
    assert primed.notes == reference.notes
    # the same records (their order is first appearance's, which a first step's one-time calls move)
    assert Counter(primed.census.records) == Counter(reference.census.records)


UNREAD_CELLS = {
    "vision kd (kdbench's CIFAR models' own inits)": _vision("kd"),
    "lm, bf16-held teacher (its fills drawn on the host)": lm(teacher={"weights": "bf16"}),
    "encoder minilm (transformers' inits)": PRIMED_CELLS["encoder minilm"],
}


@pytest.mark.parametrize("name", list(UNREAD_CELLS))
def test_a_build_without_its_initialisers_predicts_what_the_initialised_one_does(name, monkeypatch):
    # the weights' values are none a fake run reads: torch's initialisers and the random fills left undone change
    # no figure (peak, phase, breakdown, each phase's peak, census)
    config = UNREAD_CELLS[name]
    fast = predict(config, "cuda", phase_peaks=True)
    monkeypatch.setattr(planner, "skipped_inits", contextlib.nullcontext)
    monkeypatch.setattr(planner, "undrawn", lambda func, args: None)
    full = predict(config, "cuda", phase_peaks=True)
    assert fast.ok and full.ok, (fast.error, full.error)
    assert (fast.peak_bytes, fast.phase, fast.breakdown) == (full.peak_bytes, full.phase, full.breakdown)
    assert fast.phase_peaks == full.phase_peaks
    assert Counter(fast.census.records) == Counter(full.census.records)


def test_skipped_initialisers_leave_a_tensor_untouched_inside_only():
    from kdbench.models.seeded import skipped_inits, undrawn

    t = torch.zeros(8)
    with skipped_inits():
        assert torch.nn.init.normal_(t) is t and torch.nn.init.kaiming_uniform_(t.view(2, 4)).abs().sum() == 0
    torch.nn.init.normal_(t)
    assert t.abs().sum() > 0  # the real initialiser again
    assert undrawn(torch.ops.aten.normal_.default, (t,)) is t
    assert undrawn(torch.ops.aten.add.Tensor, (t, t)) is None
