"""Data parallelism in one process: the FSDP2 sharding a cell asks for (its mesh, its units' options, its mixed
precision), a real FSDP2 step on a world of one, the ranks' agreed timing, and the plan's FSDP2 refusals.

The fakes keep torch's real names: ``DeviceMesh.from_group`` / ``init_device_mesh``
(``torch.distributed.device_mesh``), ``fully_shard(module, *, mesh, reshard_after_forward, mp_policy,
offload_policy)`` and ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` (``torch.distributed.fsdp``), and
``torch.distributed.all_reduce``.  What needs several ranks runs under torchrun in ``tests/system/test_ddp.py``.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from torch.distributed import fsdp

from kdbench.config.plan import cell_id_of, config_dict
from kdbench.measure import parallel
from kdbench.measure.parallel import DataParallel
from kdbench.models import ModelCache
from kdbench.workloads import check_cell
from kdbench.workloads.lm.workload import LM
from tests.unit.workloads.test_lm_workload import CPU, lm_config

FSDP = {"world_size": 2, "parallel": "fsdp"}


@pytest.fixture(scope="module")
def built():
    """A tiny LM pair (teacher with 2 decoder layers, student with 1), built once; each test shards copies."""
    return LM.build_pair(lm_config(), CPU, ModelCache())


def _copies(built):
    import copy

    return copy.deepcopy(built[0]), copy.deepcopy(built[1])


class _Trainee(torch.nn.Module):
    """What the step wraps: the student (and adapters) as one module."""

    def __init__(self, student):
        super().__init__()
        self.student = student


@pytest.fixture
def recorded(monkeypatch):
    """FSDP2 recorded, not run: every ``fully_shard`` call's module and keyword arguments, every mesh made (by which
    API, over which group), the real MixedPrecisionPolicy and CPUOffloadPolicy classes."""
    from torch.distributed import device_mesh

    calls: dict[str, list] = {"shard": [], "mesh": []}

    def fully_shard(module, **kwargs):
        calls["shard"].append((module, kwargs))
        return module

    def from_group(group, device_type, mesh=None, *, mesh_dim_names=None):
        calls["mesh"].append(("from_group", group, device_type))
        return f"mesh over {group}"

    def init_device_mesh(device_type, mesh_shape, **kwargs):
        calls["mesh"].append(("init_device_mesh", device_type, tuple(mesh_shape)))
        return "mesh over the world"

    fake = types.SimpleNamespace(
        fully_shard=fully_shard, MixedPrecisionPolicy=fsdp.MixedPrecisionPolicy, CPUOffloadPolicy=fsdp.CPUOffloadPolicy
    )
    monkeypatch.setattr(parallel, "fsdp_module", lambda: fake, raising=False)
    monkeypatch.setattr(parallel, "fully_shard_api", lambda: fully_shard)
    monkeypatch.setattr(device_mesh.DeviceMesh, "from_group", staticmethod(from_group), raising=False)
    monkeypatch.setattr(device_mesh, "init_device_mesh", init_device_mesh)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2 if group is not None else 8)
    return calls


def _shard_cell(config, built, group="the cell's group"):
    """Shard a copy of the pair as a cell does: the teacher first (the Distiller freezes and wraps it), then the
    trainee; (teacher, trainee, its DataParallel)."""
    teacher, student = _copies(built)
    dp = DataParallel(group)
    teacher = dp.teacher_wrapper(config, CPU)(teacher)
    trainee = dp.wrapper(config, CPU)(_Trainee(student))
    return teacher, trainee, dp


def _units(calls, model):
    """The kwargs of every fully_shard call on ``model``'s modules: {'layers': [...], 'root': kwargs}."""
    mine = {id(m) for m in model.modules()}
    found = [(m, kw) for m, kw in calls["shard"] if id(m) in mine]
    return {"layers": [kw for m, kw in found[:-1]], "root": found[-1][1], "root_module": found[-1][0]}


def test_an_fsdp_cell_builds_one_mesh_over_its_own_group(recorded, built):
    # L1: in an allocation of 8 ranks a 2-rank cell runs on its subgroup; init_device_mesh over the world makes
    # every rank of the world enter a group split, while the others wait in a barrier: a hang
    _shard_cell(lm_config(**FSDP), built, group="the cell's group")
    assert recorded["mesh"] == [("from_group", "the cell's group", "cpu")]  # once, for teacher and student
    assert {kw["mesh"] for _, kw in recorded["shard"]} == {"mesh over the cell's group"}
    assert len(recorded["shard"]) == 2 + 1 + 1 + 1  # the teacher's 2 layers and root, the student's layer and root


def test_a_torch_without_from_group_shards_a_cell_that_is_the_world_and_refuses_a_smaller_one(recorded, monkeypatch):
    from torch.distributed import device_mesh

    monkeypatch.delattr(device_mesh.DeviceMesh, "from_group")
    assert parallel.cell_mesh(None, "cpu") == "mesh over the world"
    assert recorded["mesh"] == [("init_device_mesh", "cpu", (8,))]
    with pytest.raises(RuntimeError, match="no DeviceMesh.from_group: an FSDP2 cell smaller than its allocation"):
        parallel.cell_mesh("a subgroup", "cpu")


@pytest.mark.parametrize("option", [True, False])
def test_the_frozen_teacher_is_resharded_after_its_forward_whatever_the_students_option(recorded, built, option):
    # L6: with fsdp.reshard_after_forward false the teacher's gathered layers were kept after its forward, and with
    # no backward to free them every rank held the whole teacher after step 1
    teacher, trainee, _ = _shard_cell(lm_config(**FSDP, fsdp={"reshard_after_forward": option}), built)
    t, s = _units(recorded, teacher), _units(recorded, trainee)
    assert [kw["reshard_after_forward"] for kw in t["layers"]] == [True, True]
    assert [kw["reshard_after_forward"] for kw in s["layers"]] == [option]


def test_roots_keep_torchs_default_so_each_is_gathered_once_per_step(recorded, built):
    # L7: an explicit reshard_after_forward on a root switched off torch's exception for roots: each root was
    # gathered in its forward, resharded, and gathered again by the loss, which applies the LM head
    teacher, trainee, _ = _shard_cell(lm_config(**FSDP), built)
    for model in (teacher, trainee):
        unit = _units(recorded, model)
        assert unit["root_module"] is model and "reshard_after_forward" not in unit["root"]
    assert teacher.fsdp_root is teacher and trainee.student.fsdp_root is trainee


def test_the_mixed_precision_policy_reaches_every_unit_and_the_row_says_what_was_moved(recorded, built):
    # L7: no MixedPrecisionPolicy was passed: every all-gather and reduce-scatter moved the parameters' own fp32
    config = lm_config(
        **FSDP, precision="bf16", teacher_precision="bf16", fsdp={"param_dtype": "bf16", "reduce_dtype": "fp32"}
    )
    dp = _shard_cell(config, built)[2]
    policies = {kw["mp_policy"] for _, kw in recorded["shard"]}
    assert policies == {fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    assert dp.columns() == {
        "fsdp_all_gather_dtype": "bf16",
        "fsdp_teacher_all_gather_dtype": "bf16",
        "fsdp_reduce_dtype": "fp32",
    }
    recorded["shard"].clear()
    held = lm_config(**FSDP, precision="bf16", teacher_precision="bf16", teacher={"weights": "bf16"})
    teacher, student = _copies(built)
    from kdbench.workloads.placement import cast_teacher_weights

    dp = DataParallel("g")
    dp.teacher_wrapper(held, CPU)(cast_teacher_weights(teacher, held))
    dp.wrapper(held, CPU)(_Trainee(student))
    assert all("mp_policy" not in kw for _, kw in recorded["shard"])  # null: the parameters' own dtypes
    assert dp.columns() == {
        "fsdp_all_gather_dtype": "fp32",
        "fsdp_teacher_all_gather_dtype": "bf16",
        "fsdp_reduce_dtype": "fp32",
    }
    assert DataParallel().columns() == {}  # a DDP cell shards nothing


def test_fsdp2_is_found_where_each_torch_keeps_it(monkeypatch):
    import sys

    assert parallel.fsdp_module().__name__ == "torch.distributed.fsdp"  # 2.6 and later
    monkeypatch.setitem(sys.modules, "torch.distributed.fsdp", None)  # 2.5: only the composable module
    found = parallel.fsdp_module()
    assert found.__name__ == "torch.distributed._composable.fsdp"
    assert found.MixedPrecisionPolicy is not None and parallel.fully_shard_api() is found.fully_shard


@pytest.fixture
def world_of_one():
    """A gloo process group of this process alone: FSDP2 runs for real, its collectives over one rank."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("option", [True, False])
def test_a_real_fsdp2_step_gathers_each_root_once_and_frees_the_teachers_layers(world_of_one, built, option):
    # L6 and L7 on torch's own FSDP2: what the loss finds when the step reaches it.  FSDP2's registered
    # parameters are the sharded DTensors while a unit is resharded, the plain gathered tensors while it is not.
    # Before: with the option true the roots were resharded after their forwards (the loss gathered them again),
    # with it false the teacher's layers stayed gathered.
    from torch.distributed.tensor import DTensor

    from kdbench.distill.step import DistillStep

    config = lm_config(**FSDP, fsdp={"reshard_after_forward": option})
    teacher, student = _copies(built)
    x, y = LM.batch(config, 2, torch.device("cpu"), 0, (teacher, student))
    dp = DataParallel()
    step = DistillStep(
        teacher, student, x, y, config, CPU, LM, dp.wrapper(config, CPU), False, dp.teacher_wrapper(config, CPU)
    )
    loss = step.distiller.loss_fn
    forward, seen = loss.forward, []

    def spy(inp):
        t, s = loss._models
        layer = t.lm.model.layers[0].self_attn.q_proj.weight
        seen.append(
            (
                isinstance(t.lm.lm_head.weight, DTensor),
                isinstance(s.lm.lm_head.weight, DTensor),
                isinstance(layer, DTensor),
            )
        )
        return forward(inp)

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(loss, "forward", spy)
    try:
        step()
        step()
    finally:
        monkeypatch.undo()
    # at the loss: both roots still gathered from their forwards (no second gather), the teacher's layer freed
    assert seen == [(False, False, True)] * 2
    t, s = loss._models
    assert isinstance(t.lm.lm_head.weight, DTensor) and isinstance(s.lm.lm_head.weight, DTensor)  # resharded after
    assert torch.isfinite(step.last_loss)
    assert dp.columns()["fsdp_all_gather_dtype"] == "fp32"


class _FakeClock:
    """A host clock reading a fake time that only the measured call advances."""

    name = "fake"
    host = True

    def __init__(self, now):
        self.now = now

    def stamp(self):
        return self.now[0]

    def elapsed_ms(self, start, end):
        return (end - start) * 1e3

    def sync(self):
        pass

    def ready(self, stamp):
        return True


def test_a_data_parallel_row_keeps_the_cold_start_its_probe_paid(monkeypatch):
    # L4: the probe loop ran the cold call and the warm-up; the returned timing kept the second loop's cold_s (one
    # warm call) and warmup_s (none): cold_excess_ms and a lever's one_off_ms were ~0 on every world_size > 1 row
    from kdbench.measure import timing
    from tests.support.helpers import make_config

    now = [0.0]
    fake_time = types.SimpleNamespace(perf_counter=lambda: now[0])
    monkeypatch.setattr(timing, "time", fake_time)
    monkeypatch.setattr(parallel, "time", fake_time, raising=False)
    reduced = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None, group=None: reduced.append(group))
    calls = [0]

    def step():  # the cold call takes 5 s (communicators, lazy init, first gathers); every later one 0.1 s
        now[0] += 5.0 if calls[0] == 0 else 0.1
        calls[0] += 1

    backend = types.SimpleNamespace(clock=lambda: _FakeClock(now), device=torch.device("cpu"))
    config = make_config(timing={"warmup": 2, "min_iters": 4, "min_time_s": 0.0})
    raw = DataParallel("the cell's group").timed(step, config, backend)
    assert reduced == ["the cell's group"] and calls[0] == 1 + 2 + 1 + 1 + 4  # probe: cold, warm-up, one; then 1 + 4
    assert raw.samples_ms == pytest.approx([100.0] * 4) and raw.first_ms == pytest.approx(5000.0)
    assert len(raw.warmup_ms) == 2 + 1 + 1  # the warm-up, the probe call, the second loop's first call
    assert raw.cold_s == pytest.approx(5.0)
    assert raw.first_calls_ms() == pytest.approx(5000.0 + 4 * 100.0)
    assert raw.cold_excess_ms(100.0) == pytest.approx(4900.0)


# ---------------------------------------------------------------------------- the plan


@pytest.mark.parametrize(
    "over, key, text",
    [
        (
            {"on_policy": {"lmbda": 0.5, "new_tokens": 4}, "method": "jsd"},
            "on_policy",
            "use parallel: ddp (or remove on_policy)",
        ),
        ({"teacher": {"mode": "topk_cache", "k": 8}}, "teacher.mode", "use parallel: ddp (or teacher.mode live)"),
        ({"fsdp": {"param_dtype": "bf16"}}, "fsdp.param_dtype", "set precision: bf16 and teacher_precision: bf16"),
        (
            {"fsdp": {"param_dtype": "bf16"}, "precision": "bf16"},
            "fsdp.param_dtype",
            "set teacher_precision: bf16 (or fsdp.param_dtype: null)",
        ),
        (
            {"fsdp": {"param_dtype": "fp32"}, "teacher": {"weights": "bf16"}, "teacher_precision": "bf16"},
            "fsdp.param_dtype",
            "upcast to fp32: set fsdp.param_dtype: bf16 or null",
        ),
        ({"parallel": "ddp", "fsdp": {"reduce_dtype": "bf16"}}, "fsdp.reduce_dtype", "this cell is not sharded"),
    ],
)
def test_what_fsdp2_cannot_run_is_refused_at_plan_time(over, key, text):
    # L2: on-policy generation and the top-k cache's build apply the models outside their sharded forwards:
    # DTensor's "mixed torch.Tensor and DTensor" a minute into the run
    problems = check_cell(lm_config(**(FSDP | over)), False)
    assert [".".join(k) for k, _ in problems] == [key] and text in problems[0][1], problems


def test_the_mixed_precision_keys_leave_the_cells_that_do_not_set_them_as_they_were():
    plain = lm_config(**FSDP)
    assert check_cell(plain, False) == []
    assert "param_dtype" not in config_dict(plain)["fsdp"] and "reduce_dtype" not in config_dict(plain)["fsdp"]
    torchtune = lm_config(
        **FSDP, precision="bf16", teacher_precision="bf16", fsdp={"param_dtype": "bf16", "reduce_dtype": "fp32"}
    )
    assert check_cell(torchtune, False) == []
    assert cell_id_of(torchtune) != cell_id_of(lm_config(**FSDP, precision="bf16", teacher_precision="bf16"))
    assert cell_id_of(lm_config(**FSDP, fsdp={"param_dtype": None})) == cell_id_of(plain)
