"""LM cells through the one engine: the token batch, the LM loss (every token method, hidden_mse, vocab slicing),
the step and serving rows of measure_cell, the FLOP cross-check, and the plan-time refusals."""

from __future__ import annotations

import math

import pytest
import torch

from kdbench.config.plan import Cell, cell_id_of, config_dict
from kdbench.config.schema import CellConfig
from kdbench.data.tokens import token_batch
from kdbench.distill.lm import token_losses
from kdbench.distill.losses import METHODS
from kdbench.hw.backends import resolve
from kdbench.measure.flops import count_flops
from kdbench.models import ModelCache
from kdbench.models.lm import CausalLM, analytic_forward_flops
from kdbench.run.cell import measure_cell
from kdbench.workloads import check_cell, planned_measurements, workload_of
from kdbench.workloads.lm.workload import LM
from kdbench.workloads.vision import VISION
from tests.support.helpers import write_suite
from tests.support.paths import ROOT
from tests.support.suites import TINY_LM, merged, tiny_suite

CPU = resolve("cpu")
PAIR = {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"}
SMALL = {"teacher": {"num_hidden_layers": 2}, "student": {"num_hidden_layers": 1}}
TOKEN_METHODS = [n for n, m in METHODS.items() if getattr(m.cls, "divergence", "")]


def lm_config(**over) -> CellConfig:
    base = {
        "pair": PAIR,
        "overrides": SMALL,
        "method": "forward_kl",
        "batch_size": 2,
        "data": {"kind": "tokens", "seq_len": 16},
        "timing": {"warmup": 0, "min_iters": 2, "min_time_s": 0.0},
        "inference": {"batch_sizes": [1], "decode_tokens": 3},
    }
    base.update(over)
    return CellConfig.model_validate(base)


@pytest.fixture(scope="module")
def pair():
    config = lm_config()
    return LM.build_pair(config, CPU, ModelCache())


def test_the_workload_is_chosen_by_the_pair():
    assert workload_of(lm_config()) is LM
    assert workload_of(CellConfig.model_validate({"pair": {"teacher": "resnet20", "student": "resnet8"}})) is VISION
    assert [str(m) for m, _ in planned_measurements(lm_config())] == [
        "distill_step",
        "student_prefill",
        "student_decode",
        "teacher_prefill",
        "teacher_decode",
    ]


def test_image_cells_keep_their_ids_and_token_settings_stay_out_of_them():
    image = CellConfig.model_validate({"pair": {"teacher": "resnet20", "student": "resnet8"}})
    dumped = config_dict(image)
    assert "seq_len" not in dumped["data"] and "overrides" not in dumped and "loss_impl" not in dumped
    lm = config_dict(lm_config(loss_impl="chunked", chunk_size=8))
    assert "shape" not in lm["data"] and "num_classes" not in lm["data"]
    assert lm["loss_impl"] == "chunked" and lm["chunk_size"] == 8 and lm["data"]["seq_len"] == 16
    assert cell_id_of(lm_config(loss_impl="dense")) != cell_id_of(lm_config(loss_impl="fused_linear"))


def test_the_token_batch_is_next_tokens_with_the_prompt_masked():
    ids, labels = token_batch(3, 10, 50, 0.3, seed=7, device="cpu", config=lm_config())
    again, _ = token_batch(3, 10, 50, 0.3, seed=7, device="cpu", config=lm_config())
    assert torch.equal(ids, again) and ids.max() < 50 and ids.dtype == torch.int64
    assert (labels[:, :3] == -100).all() and (labels[:, -1] == -100).all()
    assert torch.equal(labels[:, 3:-1], ids[:, 4:])


def _step_inputs(pair, config):
    teacher, student = pair
    x, y = LM.batch(config, config.batch_size, CPU.device, 0, (teacher, student))
    with torch.no_grad():
        ht = teacher(x)
    hs = student(x)
    return teacher, student, x, y, hs, ht


@pytest.mark.parametrize("method", TOKEN_METHODS)
def test_the_lm_loss_is_ce_plus_the_divergence_on_the_heads_logits(pair, method):
    config = lm_config(method=method, **{method: {"temperature": 2.0, "alpha": 0.7}})
    teacher, student, _x, y, hs, ht = _step_inputs(pair, config)
    loss = LM.loss(config, None, teacher, student, CPU)
    from kdbench.distill.losses import LossInputs

    got = loss(LossInputs(hs, ht, y))
    s_logits, t_logits = student.head(hs), teacher.head(ht)
    mask = y != -100
    fn = {
        "forward_kl": token_losses.forward_kl,
        "reverse_kl": token_losses.reverse_kl,
        "jsd": lambda s, t, m, temperature: token_losses.generalized_jsd(s, t, m, beta=0.5, temperature=temperature),
        "tvd": token_losses.total_variation,
        "skew_fkl": lambda s, t, m, temperature: token_losses.skew_forward_kl(
            s, t, m, lam=0.1, temperature=temperature
        ),
        "skew_rkl": lambda s, t, m, temperature: token_losses.skew_reverse_kl(
            s, t, m, lam=0.1, temperature=temperature
        ),
    }[method]
    ce = torch.nn.functional.cross_entropy(s_logits.reshape(-1, s_logits.shape[-1]), y.reshape(-1), ignore_index=-100)
    want = 0.3 * ce + 0.7 * fn(s_logits, t_logits, mask, temperature=2.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert math.isfinite(got.item()) and got.item() > 0


def test_vocab_slice_cuts_both_heads_to_the_smaller_vocabulary():
    config = lm_config(
        overrides={"teacher": {"num_hidden_layers": 1}, "student": {"num_hidden_layers": 1, "vocab_size": 4000}},
        data={"kind": "tokens", "seq_len": 8, "vocab_policy": "slice"},
    )
    assert check_cell(config, False) == []
    teacher, student = LM.build_pair(config, CPU, ModelCache())
    x, y = LM.batch(config, 2, CPU.device, 0, (teacher, student))
    assert int(x.max()) < 4000
    loss = LM.loss(config, None, teacher, student, CPU)
    assert loss.vocab == 4000 and "sliced to the first 4000" in loss.notes[0]
    from kdbench.distill.losses import LossInputs

    with torch.no_grad():
        got = loss(LossInputs(student(x), teacher(x), y))
    assert math.isfinite(float(got))
    unsliced = lm_config(overrides=config.overrides.model_dump(), data={"kind": "tokens", "seq_len": 8})
    assert [k for k, _ in check_cell(unsliced, False)] == [("data", "vocab_policy")]


@pytest.mark.slow
def test_a_cell_measures_the_step_and_serving_with_tokens_and_logits_memory():
    config = lm_config(method="jsd+hidden_mse", loss_impl="fused_linear", chunk_size=8)
    rows = measure_cell(Cell(0, cell_id_of(config), config), CPU, ModelCache())
    by = {str(r["measurement"]): r for r in rows}
    assert [r["status"] for r in rows] == ["ok"] * 5, [r.get("error") for r in rows]
    step = by["distill_step"]
    assert step["tokens"] == 2 * 16 and step["tokens_per_s"] == pytest.approx(32 / (step["median_ms"] / 1e3))
    assert step["loss_impl"] == "fused_linear" and step["vocab_size"] == 4096 and step["seq_len"] == 16
    # counted over the 2 × (16 − 4 prompt − 1 last) tokens the loss counts, whose rows the heads run on
    from kdbench.distill.lm.impls.memory import logits_memory
    from kdbench.distill.lm.loss import methods_token_loss

    want = logits_memory("fused_linear", 32, 4096, 4, 8, methods_token_loss(config), n_valid=22)
    assert step["logits_memory_bytes"] == want["bytes"] > 0 and step["logits_buffers"] == want["text"]
    assert step["phase_loss_ms"] > 0 and step["adapter_params"] > 0  # the hidden_mse projections train
    assert step["student_features"].startswith("lm.model.layers.")
    assert by["student_decode"]["tokens"] == 3 and by["student_prefill"]["tokens"] == 16
    for name in ("student_prefill", "student_decode", "teacher_prefill", "teacher_decode"):
        assert by[name]["tokens_per_s"] > 0 and by[name]["flops"] > 0
        assert by[name]["grad_mode"] == "inference_mode"  # how the timed calls ran, as a script must to match
    assert step["grad_mode"] == "autograd"
    # the teacher (2 layers, 256 wide) costs more FLOPs per token than the student (1 layer, 128)
    assert by["teacher_prefill"]["flops"] > by["student_prefill"]["flops"]
    # every row says which attention kernel ran: the CPU's flash (gpu-review-3 L8)
    assert [r["attention_kernel"] for r in rows] == ["flash"] * 5


def test_dense_and_fused_cells_measure_the_same_first_loss_and_count_the_same_flops():
    # the same work counted the same way: fused_linear's weight gradient (an in-place addmm_, which torch's counter
    # does not see) counts as dense's autograd matmul does, so their MFU compare
    from kdbench.measure.step import step_flops

    losses, flops, extra = {}, {}, {}
    for impl in ("dense", "chunked", "fused_linear", "torch_linear"):
        config = lm_config(
            loss_impl=impl,
            chunk_size=8,
            inference={"batch_sizes": []},
            timing={"warmup": 0, "min_iters": 1, "max_iters": 1, "min_time_s": 0.0},
        )
        from kdbench.distill.step import DistillStep

        teacher, student = LM.build_pair(config, CPU, ModelCache())
        x, y = LM.batch(config, 2, CPU.device, 0, (teacher, student))
        step = DistillStep(teacher, student, x, y, config, CPU, LM)
        step()
        losses[impl] = float(step.last_loss)
        flops[impl] = step_flops(step)
        extra[impl] = LM.step_columns(step, config, x)[0]["extra_flops"]
        step.close()
    assert losses["chunked"] == pytest.approx(losses["dense"], rel=1e-5)
    assert losses["fused_linear"] == pytest.approx(losses["dense"], rel=1e-5)
    assert flops["dense"]["flops"] > 0 and flops["chunked"] == flops["fused_linear"] == flops["dense"]
    assert extra == {"dense": 0, "chunked": 0, "fused_linear": 0, "torch_linear": extra["torch_linear"]}
    # torch_linear's CE runs the student head on all 2 × 16 tokens, its KL once more on the 2 × 11 valid ones: that
    # extra is counted apart, and what is left is dense's work (a 4,096 vocabulary, a 128-wide student)
    assert extra["torch_linear"] == 2 * 4096 * 128 * 3 * 2 * 16
    assert flops["torch_linear"]["flops"] - extra["torch_linear"] == flops["dense"]["flops"]


def test_counted_forward_flops_match_the_analytic_count(pair):
    # at 128 tokens attention is a tenth of the forward: counted as executed (gpu-review-3 L13), the causal half
    # on the CPU's flash kernel (torch's own counter counts it not at all), the whole square on the math kernel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    teacher, _ = pair
    x = torch.randint(0, 4096, (2, 128))
    with torch.no_grad():
        counted = count_flops(lambda: teacher.head(teacher(x)))
        with sdpa_kernel(SDPBackend.MATH):
            math = count_flops(lambda: teacher.head(teacher(x)))
    assert counted == analytic_forward_flops(teacher, 2, 128)
    assert math == analytic_forward_flops(teacher, 2, 128, fused=False)
    # the difference is the masked half: 2 layers × QKᵀ and PV over 128·127/2 pairs of 2 sequences × 4 heads of 64
    assert math - counted == 2 * (2 * 2 * 4 * (128 * 127 // 2) * (64 + 64))


def test_a_module_that_returns_logits_runs_dense_only():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(30, 8)
            self.out = torch.nn.Linear(8, 30)

        def forward(self, ids):
            return self.out(self.emb(ids))

    wrapped = CausalLM(Tiny())
    assert wrapped.head is None and wrapped(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 30)


@pytest.mark.parametrize(
    "over, key, text",
    [
        ({"method": "kd"}, "method", "image-classifier method"),
        ({"method": "forward_kl+tvd"}, "method", "one token-level divergence"),
        ({"data": {"kind": "tokens", "seq_len": 4096}}, "data.seq_len", "beyond"),
        ({"data": {"kind": "synthetic"}}, "data.kind", "needs token data"),
        ({"graphs": True}, "graphs", "LM pairs do not take it"),
        ({"pad_to": 8}, "pad_to", "vocab_size"),
        ({"inference": {"runtime": "onnxruntime"}}, "inference.runtime", "served eagerly"),
        ({"pair": {"teacher": "tiny-llama-teacher", "student": "resnet8"}}, "pair.student", "image classifier"),
        ({"method": "tvd", "loss_impl": "liger"}, "loss_impl", "liger"),
        ({"method": "reverse_kl", "loss_impl": "torch_linear"}, "loss_impl", "torch_linear"),
        ({"teacher": {"weights": "bf16"}}, "teacher.weights", "set teacher_precision: bf16"),
    ],
)
def test_plan_time_refusals_name_the_key(over, key, text):
    problems = check_cell(lm_config(**over), False)
    assert problems, over
    where, message = problems[0]
    assert ".".join(where) == key and text in message


def test_a_loss_impl_this_environment_lacks_is_a_skipped_cell_with_the_fix(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    missing = {"liger_kernel"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))
    config = lm_config(loss_impl="liger")
    rows = measure_cell(Cell(0, cell_id_of(config), config), CPU, ModelCache())
    assert [r["status"] for r in rows] == ["skipped"] * 5
    assert "liger-kernel, which is not installed: pip install" in rows[0]["error"] and "[liger]'" in rows[0]["error"]


def test_dry_run_and_run_say_which_cells_a_missing_package_skips(monkeypatch, tmp_path, capsys):
    """liger-kernel simulated missing: --dry-run names the liger cell with the install line (it passed silently),
    and the run says so at its start and stores the cell as skipped without a worker."""
    import importlib.util

    from kdbench.cli import main
    from kdbench.core.install import extra_hint
    from kdbench.store import read_results

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a)
    )
    why = f"liger needs liger-kernel, which is not installed: {extra_hint('liger')}"
    suite = tmp_path / "liger.yaml"
    fp32 = merged(LM_SUITE, {"name": "liger"})
    write_suite(suite, **merged(fp32, {"matrix": {"loss_impl": ["dense", "liger"]}}))
    assert main(["run", str(suite), "--dry-run"]) == 0
    assert f"skipped here: cell 2: {why}" in capsys.readouterr().err.splitlines()
    write_suite(suite, **merged(fp32, {"defaults": {"loss_impl": "liger"}}))
    assert main(["run", str(suite), "--out", str(tmp_path / "res"), "--no-report", "--inline"]) == 0
    assert f"skipped here: cell 1: {why}" in capsys.readouterr().err.splitlines()
    df = read_results([tmp_path / "res"])
    assert set(df["status"]) == {"skipped"} and len(df) == 5 and set(df["error"]) == {why}


def test_an_fsdp_cell_this_torch_or_device_cannot_shard_is_skipped_with_the_reason(monkeypatch):
    import sys

    from kdbench.hw.backends import Backend
    from kdbench.measure import parallel

    sharded = lm_config(world_size=2, parallel="fsdp")
    assert parallel.fully_shard_api() is not None and LM.skip_reason(sharded, CPU) is None
    # a torch with neither torch.distributed.fsdp's fully_shard (2.6+) nor the composable one before it
    for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        monkeypatch.setitem(sys.modules, name, None)
    assert parallel.fully_shard_api() is None
    rows = measure_cell(Cell(0, cell_id_of(sharded), sharded), CPU, ModelCache())
    assert {r["status"] for r in rows} == {"skipped"} and "fully_shard" in rows[0]["error"]
    assert "torch >= 2.6" in rows[0]["error"]
    monkeypatch.undo()
    offload = lm_config(world_size=2, parallel="fsdp", fsdp={"cpu_offload": True})
    assert "nothing to offload" in LM.skip_reason(offload, CPU)
    assert LM.skip_reason(offload, Backend("cuda", torch.device("cuda", 0))) is None


@pytest.mark.slow
def test_a_teacher_held_in_bf16_halves_its_memory_and_distils_as_a_bf16_autocast_one():
    from kdbench.workloads.placement import cast_teacher_weights

    rows = {}
    for weights in ("fp32", "bf16"):
        config = lm_config(teacher_precision="bf16", teacher={"weights": weights})
        rows[weights] = measure_cell(Cell(0, cell_id_of(config), config), CPU, ModelCache())
        assert [r["status"] for r in rows[weights]] == ["ok"] * 5
    fp32, bf16 = rows["fp32"][0], rows["bf16"][0]
    from kdbench.run.jobs import config_columns

    assert config_columns(lm_config(teacher={"weights": "bf16"}), "cpu")["teacher_weights"] == "bf16"
    assert fp32["model_state_bytes"] - bf16["model_state_bytes"] == 2 * fp32["teacher_params"]  # 4 -> 2 bytes each
    assert bf16["final_loss"] == pytest.approx(fp32["final_loss"], rel=1e-3)
    assert bf16["tokens_per_s"] > 0 and rows["bf16"][3]["measurement"] == "teacher_prefill"
    held = cast_teacher_weights(
        CausalLM(LM.build_pair(lm_config(), CPU, ModelCache())[0].lm), lm_config(teacher={"weights": "bf16"})
    )
    assert {p.dtype for p in held.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in held.buffers()} == {torch.float32}  # the rotary frequencies stay as built
    assert cell_id_of(lm_config()) == cell_id_of(lm_config(teacher={"weights": "fp32"}))  # the default: ids kept


def test_an_fsdp_cell_on_a_gpu_keeps_its_teacher_on_the_host_until_fully_shard_moves_it():
    from kdbench.hw.backends import Backend

    gpu = Backend("cuda", torch.device("meta"))  # a simulated device: moving to it allocates nothing
    fsdp = lm_config(world_size=2, parallel="fsdp")
    teacher, student = LM.step_pair(fsdp, gpu, ModelCache())
    assert {p.device.type for p in teacher.parameters()} == {"cpu"}
    assert {p.device.type for p in student.parameters()} == {"meta"}
    assert not LM.step_keeps_pair(fsdp) and LM.step_keeps_pair(lm_config(world_size=2))  # serving rebuilds whole

    class OtherRank:  # a DataParallel's rank 1: it receives rank 0's teacher once sharded
        root, group = False, None

    teacher, student = LM.step_pair(fsdp, gpu, ModelCache(max_kept_bytes=0), OtherRank())
    assert {p.device.type for p in teacher.parameters()} == {"meta"}  # nothing of the teacher on its host
    assert {p.device.type for p in student.parameters()} == {"meta"}  # (the simulated device)
    user = lm_config(
        world_size=2, parallel="fsdp", pair={**PAIR, "teacher": "tests.support.lm_models:tiny_hf_student"}, overrides={}
    )
    teacher, _ = LM.step_pair(user, gpu, ModelCache(allow_imports=True), OtherRank())
    assert {p.device.type for p in teacher.parameters()} == {"cpu"}  # user code: built whole, as it builds it
    teacher, student = LM.step_pair(lm_config(world_size=2), gpu, ModelCache())  # DDP: both whole on it
    assert {p.device.type for p in [*teacher.parameters(), *student.parameters()]} == {"meta"}


def test_the_gpu_suites_plan_the_same_cells_on_both_vendors():
    from kdbench.config.load import load_suite
    from kdbench.workloads import expand_checked

    suites = ROOT / "suites"
    cuda, amd = (expand_checked(load_suite(suites / f"llm-{v}.yaml")) for v in ("cuda", "amd"))
    assert [c.cell_id for c in cuda] == [c.cell_id for c in amd] and len(cuda) == 52
    pairs = {(c.config.pair.teacher, c.config.pair.student) for c in cuda}
    assert pairs == {("llama-3.1-8b", "llama-3.2-1b"), ("qwen2.5-7b", "qwen2.5-0.5b")}
    assert {c.config.loss_impl for c in cuda} == {
        "dense",
        "natural",
        "chunked",
        "fused_linear",
        "liger",
        "torch_linear",
    }
    assert {c.config.data.seq_len for c in cuda} == {1024, 4096} and {c.config.precision for c in cuda} == {"bf16"}
    assert sum(c.config.teacher.mode == "topk_cache" for c in cuda) == 4
    assert sum(c.config.on_policy is not None for c in cuda) == 4
    fsdp = expand_checked(load_suite(suites / "llm-fsdp.yaml"))
    assert [(c.config.world_size, c.config.parallel) for c in fsdp][2:4] == [(2, "ddp"), (2, "fsdp")]
    assert {c.config.teacher.weights for c in fsdp} == {"fp32", "bf16"}


def test_a_cached_teacher_keeps_its_hidden_states_and_the_step_equals_the_live_one():
    from kdbench.distill.step import DistillStep

    losses = {}
    for mode in ("live", "cached"):
        config = lm_config(teacher={"mode": mode}, loss_impl="fused_linear", chunk_size=8)
        teacher, student = LM.build_pair(config, CPU, ModelCache())
        x, y = LM.batch(config, 2, CPU.device, 0, (teacher, student))
        step = DistillStep(teacher, student, x, y, config, CPU, LM)
        if mode == "cached":
            assert step.cache.logits.shape == (2, 16, 256) and step.cache_ms > 0  # (B, S, teacher hidden)
        step()
        losses[mode] = step.last_loss.item()
        step.close()
    assert losses["cached"] == pytest.approx(losses["live"], rel=1e-6)


@pytest.mark.slow
def test_module_callable_lms_run_through_the_cell():
    hf = lm_config(
        pair={"teacher": "tiny-llama-teacher", "student": "tests.support.lm_models:tiny_hf_student"},
        overrides={"teacher": {"num_hidden_layers": 1}},
        loss_impl="fused_linear",
        chunk_size=8,
    )
    assert check_cell(hf, allow_imports=True) == []
    assert "allow_imports" in check_cell(hf, allow_imports=False)[0][1]
    rows = measure_cell(Cell(0, cell_id_of(hf), hf), CPU, ModelCache(allow_imports=True))
    assert [r["status"] for r in rows] == ["ok"] * 5, [r.get("error") for r in rows]
    plain = lm_config(
        pair={"teacher": "tiny-llama-teacher", "student": "tests.support.lm_models:IdsToLogits"},
        overrides={"teacher": {"num_hidden_layers": 1}},
    )
    rows = measure_cell(Cell(0, cell_id_of(plain), plain), CPU, ModelCache(allow_imports=True))
    status = {str(r["measurement"]): r["status"] for r in rows}
    assert status["distill_step"] == "ok" and status["student_prefill"] == status["student_decode"] == "skipped"
    assert status["teacher_decode"] == "ok"
    assert "KV cache" in next(r["error"] for r in rows if r["measurement"] == "student_decode")


def test_hidden_mse_is_the_mean_squared_error_of_the_projected_layers_over_the_valid_tokens():
    from kdbench.distill.hooks import FeaturePaths
    from kdbench.distill.losses import LossInputs
    from kdbench.distill.losses.hidden_mse import HiddenMSE, HiddenMSEParams

    torch.manual_seed(0)
    s = [torch.randn(2, 8, 5), torch.randn(2, 8, 5)]  # canonical (N, C, L)
    t = [torch.randn(2, 12, 5), torch.randn(2, 12, 5)]
    term = HiddenMSE(HiddenMSEParams(beta=3.0), FeaturePaths([x.shape for x in t], [x.shape for x in s]))
    targets = torch.tensor([[-100, 1, 2, 3, -100], [-100, -100, 4, 5, 6]])
    projected = term.proj(s)
    got = term(LossInputs(None, None, targets, s, t, {"hidden_mse": projected}))
    valid = targets != -100
    want = torch.zeros(())
    for x, p, w, m in zip(s, projected, t, term.proj.maps):
        torch.testing.assert_close(p, torch.einsum("oc,ncl->nol", m.weight, x))  # a linear map of the channels
        err = (p - w).pow(2).mean(dim=1)  # (N, L)
        want = want + err[valid].mean()
    torch.testing.assert_close(got, 3.0 * want / 2)


def test_a_teacher_served_at_the_students_precision_says_so(pair):
    """L11: serving rows run at the cell's ``precision`` for both models, so that speedup_vs_teacher compares them at
    one precision and an image teacher's row stays the same measurement in every cell (the reuse key); a teacher's
    row whose cell computes the teacher at another ``teacher_precision`` in the step says so."""
    from kdbench.core.names import Measurement
    from tests.support.helpers import make_config

    mixed = lm_config(precision="bf16", teacher_precision="fp32", timing={"warmup": 0, "min_iters": 1, "min_time_s": 0})
    said = "the teacher is served at precision bf16, as the student is"
    for measurement in (Measurement.TEACHER_PREFILL, Measurement.STUDENT_PREFILL):
        row = LM.serve(measurement, 1, pair, mixed, CPU, None)
        assert row["status"] == "ok" and (said in (row["notes"] or "")) == (measurement == Measurement.TEACHER_PREFILL)
    row = LM.serve(Measurement.TEACHER_DECODE, 1, pair, lm_config(timing=mixed.timing.model_dump()), CPU, None)
    assert "served at precision" not in (row["notes"] or "")  # one precision: nothing to say
    image = make_config(precision="bf16", timing={"warmup": 0, "min_iters": 1, "min_time_s": 0.0})
    models = VISION.build_pair(image, CPU, ModelCache())
    row = VISION.serve(Measurement.TEACHER_INFERENCE, 1, models, image, CPU, None)
    assert "the teacher is served at precision bf16" in row["notes"] and "teacher_precision fp32" in row["notes"]


# ---------------------------------------------------------------- host memory (issue 30, review L3)

# lm_config()'s cell as a suite; the host test holds its teacher in bf16, the liger test keeps it in fp32
LM_SUITE = tiny_suite(name="host", defaults=merged(TINY_LM, {"inference": {"decode_tokens": 3}}))
HOST_SUITE = merged(LM_SUITE, {"defaults": {"teacher_precision": "bf16", "teacher": {"weights": "bf16"}}})


def test_a_model_too_large_to_keep_is_built_in_its_dtype_with_the_weights_the_cache_would_give():
    from kdbench.workloads.encoder import ENCODER

    bf16 = lm_config(teacher_precision="bf16", teacher={"weights": "bf16"})
    encoders = lm_config(pair={"teacher": "tiny-bert-teacher", "student": "tiny-bert-student"}, overrides={})
    for workload, config in ((LM, bf16), (ENCODER, encoders)):
        kept, direct = ModelCache(), ModelCache(max_kept_bytes=0)  # 0: every model is "large"
        cached, built = workload.build_pair(config, CPU, kept), workload.build_pair(config, CPU, direct)
        assert kept.builds == 2 and direct.builds == 0  # built directly: no float32 master in the cache
        for a, b in zip(cached, built, strict=True):  # the same seeded weights, in the same dtypes
            sa, sb = a.state_dict(), b.state_dict()
            assert sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype for k in sa)
            assert all(torch.equal(sa[k], sb[k]) for k in sa), [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert {p.dtype for p in built[0].parameters()} == {torch.float32}  # the encoder teacher's default weights
    teacher = LM.build_pair(bf16, CPU, ModelCache(max_kept_bytes=0))[0]
    assert {p.dtype for p in teacher.parameters()} == {torch.bfloat16}  # drawn in fp32, held in bf16 only


def test_a_pair_whose_fp32_master_exceeds_a_simulated_host_runs_within_it_or_is_skipped_with_the_figure(
    monkeypatch, tmp_path, capsys
):
    from kdbench.cli import main
    from kdbench.models import cache as cache_module
    from kdbench.run import plan as plan_module
    from kdbench.run.jobs import config_columns
    from kdbench.store import read_results
    from kdbench.workloads.lm.workload import lm_counts
    from kdbench.workloads.placement import gib

    config = lm_config(teacher_precision="bf16", teacher={"weights": "bf16"})
    (pt, lt), (ps, _) = (
        lm_counts(getattr(config.pair, r), getattr(config.overrides, r)) for r in ("teacher", "student")
    )
    masters = 4 * (pt + ps)  # the float32 masters the model cache kept for as long as the worker lived
    # the simulated host: its models count as large (none is kept), and it has less than the masters alone
    monkeypatch.setattr(cache_module, "MAX_KEPT_BYTES", 0)
    need = 2 * pt + 4 * lt + 4 * ps  # the teacher in bf16 (drawn one fp32 tensor at a time) and the student
    assert LM.host_footprint(config, "cpu").rank_bytes() == need < masters
    monkeypatch.setattr(plan_module, "host_memory", lambda: (need, masters))
    assert plan_module.host_refusal(config, "cpu", 1, need, masters) is None
    rows = measure_cell(Cell(0, cell_id_of(config), config), CPU, ModelCache())
    assert [r["status"] for r in rows] == ["ok"] * 5, [r.get("error") for r in rows]
    assert config_columns(config, "cpu")["host_models_bytes"] == need
    # one byte less: the cell is stored skipped with the figure before anything runs, never swapped or killed
    monkeypatch.setattr(plan_module, "host_memory", lambda: (need - 1, masters))
    suite = write_suite(tmp_path / "host.yaml", **HOST_SUITE)
    assert main(["run", str(suite), "--dry-run"]) == 0  # the dry run says so too
    assert f"host {gib(need)} per rank: more than this machine has available, a run here skips it" in (
        capsys.readouterr().out
    )
    assert main(["run", str(suite), "--out", str(tmp_path / "res"), "--no-report"]) == 0
    df = read_results([tmp_path / "res"])
    assert set(df["status"]) == {"skipped"} and len(df) == 5
    error = df["error"].iloc[0]
    assert f"need {gib(need)} of host memory" in error and f"has {gib(need - 1)} available" in error
    assert "teacher tiny-llama-teacher bf16 whole, built on the host" in error
    assert set(df["host_models_bytes"]) == {need}


def test_an_8_rank_fsdp2_llama_8b_to_1b_cell_plans_its_host_per_rank_under_64_gb():
    from kdbench.workloads.lm.workload import lm_counts

    big = {"teacher": "llama-3.1-8b", "student": "llama-3.2-1b"}
    (pt, lt), (ps, ls) = lm_counts("llama-3.1-8b", {}), lm_counts("llama-3.2-1b", {})
    assert (pt, lt, ps, ls) == (8_030_261_248, 128_256 * 4096, 1_235_814_400, 128_256 * 2048)
    # rank 0 builds the frozen teacher whole on its host in its dtype (the other ranks on meta: they receive rank
    # 0's weights once sharded), then the student on its device; one tensor is drawn in fp32 at a time (in bf16 the
    # teacher's embedding, 2.1 GB, is the largest draw; in fp32 the teacher is drawn in place, the student's is)
    for weights, rank0 in (("fp32", 4 * pt + 4 * ls), ("bf16", 2 * pt + 4 * lt)):
        config = lm_config(
            pair=big, overrides={}, world_size=8, parallel="fsdp", teacher={"weights": weights}, precision="bf16"
        )
        host = LM.host_footprint(config, "cuda")
        assert host.rank_bytes(True) == rank0 < 64e9 and rank0 < 34e9
        assert host.rank_bytes(False) == 4 * ls and host.node_bytes(8) == rank0 + 7 * 4 * ls  # the draw alone
        assert "on each other rank" in host.summary(8)
    # DDP: every rank builds both models on its device, holding one tensor's fp32 draw at a time on the host
    ddp = LM.host_footprint(lm_config(pair=big, overrides={}, world_size=8, precision="bf16"), "cuda")
    assert ddp.rank_bytes(True) == ddp.rank_bytes(False) == 4 * lt  # the teacher's embedding
    # the old build: an fp32 master of each model in the cache, and a deep copy of it per use, on every rank
    assert 8 * (pt + ps) > 64e9


def test_every_lm_step_row_records_the_hosts_peak_beside_the_devices():
    config = lm_config()
    rows = measure_cell(Cell(0, cell_id_of(config), config), CPU, ModelCache())
    assert [r["status"] for r in rows] == ["ok"] * 5
    for row in rows:  # on the CPU the host's peak is the measured peak
        assert row["host_peak_bytes"] == row["peak_memory_bytes"] > 0


def test_a_nodes_host_figure_counts_the_ranks_on_that_node(monkeypatch):
    from kdbench.run.plan import host_refusal, ranks_on_node

    assert ranks_on_node(1, 1) == 1 and ranks_on_node(8, 1) == 8 and ranks_on_node(8, 2) == 4  # kdbench's launcher
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    allocation = object()  # an outer allocation (torchrun, srun): its ranks on this node
    assert ranks_on_node(8, 1, allocation) == 8  # unknown: all of them
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")
    assert ranks_on_node(8, 1, allocation) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert ranks_on_node(8, 1, allocation) == 8  # a cell of 8 ranks in an allocation of 16 per node
    ddp = lm_config(world_size=2)
    host = LM.host_footprint(ddp, "cpu")
    one = host.rank_bytes()
    assert host.node_bytes(2) == 2 * one  # every DDP rank builds both models
    assert host_refusal(ddp, "cpu", 2, 2 * one, 4 * one) is None
    assert "2 ranks on this node" in host_refusal(ddp, "cpu", 2, 2 * one - 1, 4 * one)
