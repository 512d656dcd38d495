"""No host-device synchronisation inside the timed step, for any method (issue 11, W7, W8).

On the CPU nothing synchronises, so kdbench.measure.syncs counts the calls that would on a GPU
(values read back, data-dependent output sizes); on a GPU, torch's sync debug mode does."""

from types import SimpleNamespace

import pytest
import torch

from kdbench.data.synthetic import synthetic_batch
from kdbench.distill.losses import METHODS
from kdbench.distill.step import Distiller, DistillStep, make_optimizer
from kdbench.hw.backends import Backend, resolve
from kdbench.measure.syncs import optimizer_host_tensors, sync_calls
from kdbench.models import build_model
from kdbench.workloads.vision import VISION
from tests.support.helpers import make_config

CPU = resolve("cpu")


def test_the_counter_sees_what_would_sync():
    x = torch.randn(16)
    assert sync_calls(lambda: x[x > 0], CPU) == ["aten.index with a boolean mask"]
    assert sync_calls(lambda: x.sum().item(), CPU) == ["aten._local_scalar_dense"]
    assert sync_calls(lambda: float(x.max()), CPU) == ["aten._local_scalar_dense"]
    assert sync_calls(lambda: torch.nonzero(x), CPU) == ["aten.nonzero"]
    assert sync_calls(lambda: (x * 2).exp().sum(), CPU) == []
    step = torch.tensor(3.0)
    assert sync_calls(lambda: step.item(), CPU, exempt=[step]) == []  # a host tensor on a GPU too


def _old_dkd_split(z, targets):  # the boolean-mask indexing DKD used before
    mask = torch.nn.functional.one_hot(targets, z.shape[1]).bool()
    return z[~mask].view(z.shape[0], -1)


def test_the_old_dkd_would_have_synced_and_the_new_one_gives_the_same_logits():
    from kdbench.distill.losses.dkd import _target_split

    z, y = torch.randn(4, 6), torch.tensor([0, 5, 2, 2])
    old = sync_calls(lambda: _old_dkd_split(z, y), CPU)  # one_hot checks the labels' range on the host too
    assert "aten.index with a boolean mask" in old and "aten._local_scalar_dense" in old
    assert sync_calls(lambda: _target_split(z, y, 1.0), CPU) == []
    _, _, log_others = _target_split(z, y, 1.0)
    torch.testing.assert_close(log_others, torch.log_softmax(_old_dkd_split(z, y), dim=-1))


METHOD_NAMES = [*sorted(n for n, m in METHODS.items() if m.cls.domain == "image"), "kd+at"]


@pytest.mark.parametrize("mode", ["live", "cached"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_no_step_of_any_method_synchronises(method, precision, mode):
    config = make_config(
        pair={"teacher": "resnet8", "student": "resnet8"},
        method=method,
        precision=precision,
        teacher={"mode": mode},
        dkd={"warmup": 1},
    )
    torch.manual_seed(0)
    teacher, student = build_model("resnet8", 10, (3, 16, 16)), build_model("resnet8", 10, (3, 16, 16))
    x, y = synthetic_batch(config, config.batch_size, CPU.device, 0)
    step = DistillStep(teacher, student, x, y, config, CPU, VISION)
    step()
    step()  # warm: the optimizer's state exists
    calls = sync_calls(step, CPU, exempt=optimizer_host_tensors(step.distiller.optimizer))
    assert calls == [], f"{method} {precision} {mode}: {calls}"


def test_fp16_with_a_grad_scaler_gets_a_fused_optimizer_on_gpus_and_says_so(monkeypatch):
    params = [torch.nn.Parameter(torch.randn(3))]
    config = make_config(optimizer={"name": "adamw", "lr": 1e-3})
    fake = SimpleNamespace(trainee=SimpleNamespace(parameters=lambda: params), scaler=object())
    gpu = Backend("cuda", torch.device("cuda", 0))
    optimizer, note = Distiller._optimizer(fake, config, gpu)
    assert optimizer.defaults["fused"] is True and "no host-device sync" in note
    fake.scaler = None  # bf16/fp32: no scaler, nothing to avoid, the default implementation
    optimizer, note = Distiller._optimizer(fake, config, gpu)
    assert not optimizer.defaults.get("fused") and note == ""

    def unfused(params, cfg, fused=False):
        if fused:
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")
        return make_optimizer(params, cfg)

    fake.scaler = object()
    monkeypatch.setattr("kdbench.distill.step.make_optimizer", unfused)
    optimizer, note = Distiller._optimizer(fake, config, gpu)
    assert not optimizer.defaults.get("fused") and "syncs host and device every step" in note


LM_CASES = [
    # liger is left out: liger-kernel's chunked loss reads a value back itself (0.8.5: once a step), its own; the
    # test after these counts it
    *({"loss_impl": impl} for impl in ("dense", "chunked", "fused_linear", "torch_linear")),
    {"method": "jsd+hidden_mse", "loss_impl": "fused_linear"},
    {"teacher": {"mode": "topk_cache", "k": 8}},
    {"teacher": {"mode": "cached"}, "loss_impl": "chunked"},
    {"method": "jsd", "on_policy": {"lmbda": 0.5, "new_tokens": 3}},
]


@pytest.mark.parametrize("case", LM_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_no_lm_step_synchronises(case, monkeypatch):
    """kdbench's own LM step code never syncs.  transformers' causal-mask builder reads the position ids back once
    per forward to detect packed sequences (masking_utils.find_packed_sequence_indices): the model's own, left out
    here by pretending it found none, and said in docs/lm.md."""
    import transformers.masking_utils as masking

    from kdbench.models import ModelCache
    from kdbench.workloads.lm.workload import LM
    from tests.unit.workloads.test_lm_workload import lm_config

    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    config = lm_config(chunk_size=8, **({"method": "forward_kl"} | case))
    teacher, student = LM.build_pair(config, CPU, ModelCache())
    x, y = LM.batch(config, config.batch_size, CPU.device, 0, (teacher, student))
    step = DistillStep(teacher, student, x, y, config, CPU, LM)
    step()
    step()  # warm: the optimizer's state exists, the valid rows are found
    calls = sync_calls(step, CPU, exempt=optimizer_host_tensors(step.distiller.optimizer))
    assert calls == [], f"{case}: {calls}"


def test_a_liger_step_syncs_once_in_liger_and_its_row_says_so(monkeypatch):
    """L9: liger-kernel's chunked distillation backward tests ``torch.ne(grad_output, torch.tensor(1.0))`` on the
    host (0.8.5): one sync per step, outside kdbench's code; the row's notes say it, the other impls' do not."""
    import transformers.masking_utils as masking

    from kdbench.models import ModelCache
    from kdbench.workloads.lm.workload import LM
    from tests.unit.workloads.test_lm_workload import lm_config

    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    notes = {}
    for impl in ("liger", "fused_linear"):
        config = lm_config(chunk_size=8, loss_impl=impl)
        teacher, student = LM.build_pair(config, CPU, ModelCache())
        x, y = LM.batch(config, config.batch_size, CPU.device, 0, (teacher, student))
        step = DistillStep(teacher, student, x, y, config, CPU, LM)
        step()
        step()
        calls = sync_calls(step, CPU, exempt=optimizer_host_tensors(step.distiller.optimizer))
        assert calls == (["aten._local_scalar_dense"] if impl == "liger" else []), f"{impl}: {calls}"
        notes[impl] = LM.step_columns(step, config, x)[1]
    said = [n for n in notes["liger"] if "liger syncs host and device once per step" in n]
    assert len(said) == 1 and "torch.ne(grad_output" in said[0]
    assert not any("sync" in n for n in notes["fused_linear"])
