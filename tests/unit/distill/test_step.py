"""The distillation step is the one DESIGN.md specifies: a frozen teacher, a training student."""

import torch

from kdbench.data.synthetic import synthetic_batch
from kdbench.distill.step import DistillStep
from kdbench.models import build_model
from kdbench.workloads.vision import VISION
from tests.support.helpers import make_config, make_step


def _models(config):
    torch.manual_seed(0)
    shape = tuple(config.data.shape)
    teacher = build_model(config.pair.teacher, config.data.num_classes, shape)
    student = build_model(config.pair.student, config.data.num_classes, shape)
    return teacher, student


def test_teacher_weights_and_bn_statistics_never_change():
    step = make_step(make_config())
    before = {k: v.clone() for k, v in step.distiller.teacher.state_dict().items()}
    assert any("running_mean" in k for k in before)  # the teacher has batch norm
    s_before = {k: v.clone() for k, v in step.distiller.student.state_dict().items()}
    for _ in range(3):
        step()
    after = step.distiller.teacher.state_dict()
    for k, v in before.items():
        assert torch.equal(v, after[k]), k
    assert not step.distiller.teacher.training
    assert all(p.grad is None and not p.requires_grad for p in step.distiller.teacher.parameters())
    # ... while the student trains: weights and its batch-norm statistics move.
    s_after = step.distiller.student.state_dict()
    changed = [k for k in s_before if not torch.equal(s_before[k], s_after[k])]
    assert any("running_mean" in k for k in changed)
    assert any(k.endswith("weight") for k in changed)
    assert step.distiller.student.training


def test_optimizer_holds_only_student_parameters():
    step = make_step(make_config())
    opt_params = {id(p) for g in step.distiller.optimizer.param_groups for p in g["params"]}
    assert opt_params == {id(p) for p in step.distiller.student.parameters()}
    assert isinstance(step.distiller.optimizer, torch.optim.AdamW)


def test_gradients_are_zeroed_every_step():
    # With a negligible learning rate the weights stay put, so each step's gradient is the same;
    # accumulated gradients would double on the second step.
    config = make_config(optimizer={"name": "sgd", "lr": 1e-12, "momentum": 0.0})
    step = make_step(config)
    step()
    g1 = [p.grad.clone() for p in step.distiller.student.parameters()]
    step()
    g2 = [p.grad.clone() for p in step.distiller.student.parameters()]
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_loss_value_is_the_kd_loss_of_the_batch():
    from kdbench.distill.losses.kd import kd_loss

    config = make_config(kd={"temperature": 3.0, "alpha": 0.6})
    step = make_step(config)
    with torch.no_grad():
        step.distiller.student.train()
        expected = kd_loss(step.distiller.student(step.x), step.distiller.teacher(step.x), step.y, 3.0, 0.6)
    step()
    torch.testing.assert_close(step.last_loss, expected)
    assert step.last_loss.dtype == torch.float32


def test_bf16_student_under_autocast_loss_in_fp32():
    step = make_step(make_config(precision="bf16"))
    step()
    assert step.distiller.student_ac.applied and step.distiller.student_ac.dtype == torch.bfloat16
    assert not step.distiller.teacher_ac.applied  # teacher_precision defaults to fp32
    assert step.distiller.scaler is None  # bf16 needs no loss scaling
    assert step.last_loss.dtype == torch.float32 and torch.isfinite(step.last_loss)


def test_fp16_student_uses_a_grad_scaler():
    step = make_step(make_config(precision="fp16", teacher_precision="bf16"))
    for _ in range(2):
        step()
    assert step.distiller.student_ac.applied and step.distiller.student_ac.dtype == torch.float16
    assert step.distiller.teacher_ac.applied and step.distiller.teacher_ac.dtype == torch.bfloat16
    assert isinstance(step.distiller.scaler, torch.amp.GradScaler)
    assert step.distiller.scaler.get_scale() > 0
    assert torch.isfinite(step.last_loss)


class _Recorded(torch.nn.Module):
    """A teacher that logs its forwards (and the fp32 math mode it ran in) and returns one output buffer it
    keeps, as a CUDA-graph replay does."""

    def __init__(self, model, log):
        super().__init__()
        self.model, self.log = model, log
        self.buffer = None

    def forward(self, x):
        from kdbench.hw.backends import math_flags

        self.log.append(("teacher", math_flags()["tf32_cudnn"]))
        out = self.model(x)
        if self.buffer is None:
            self.buffer = torch.empty_like(out)
        return self.buffer.copy_(out)


def _graph_tree_step(monkeypatch, compile_mode, marker=True):
    import kdbench.distill.step as step_module
    from tests.support.helpers import simulated_gpu

    log = []
    monkeypatch.setattr(torch, "compile", lambda model, mode=None: model)  # the graph-tree logic, not inductor
    if marker:
        monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: log.append("mark step"))
    else:
        monkeypatch.setattr(step_module, "step_marker", lambda: None)  # a torch without the API
    config = make_config(compile=compile_mode, compile_teacher=True, pair={"teacher": "resnet8", "student": "resnet8"})
    teacher, student = _models(config)
    teacher = _Recorded(teacher, log)
    gpu = simulated_gpu("cuda")
    x, y = synthetic_batch(config, config.batch_size, gpu.device, 0)
    return DistillStep(teacher, student, x, y, config, gpu, VISION), log, teacher


def test_a_compiled_teacher_under_cuda_graphs_marks_each_step_one_iteration(monkeypatch):
    # G3: the student's compiled call starts a new CUDA-graph-tree iteration and overwrites the compiled
    # teacher's still-live logits, unless the step's start is marked
    step, log, _ = _graph_tree_step(monkeypatch, "reduce-overhead")
    log.clear()
    step()
    step()
    assert [e if isinstance(e, str) else e[0] for e in log] == ["mark step", "teacher"] * 2
    plain, log, _ = _graph_tree_step(monkeypatch, "default")  # no CUDA graphs: nothing to mark
    log.clear()
    plain()
    assert "mark step" not in log


def test_without_the_marker_api_the_compiled_teachers_outputs_are_copied(monkeypatch):
    step, _, teacher = _graph_tree_step(monkeypatch, "max-autotune", marker=False)
    out = step.distiller.teacher_outputs(step.x)
    assert out.logits.data_ptr() != teacher.buffer.data_ptr()  # a graph replay cannot overwrite it
    torch.testing.assert_close(out.logits, teacher.buffer)


def test_the_cached_teacher_runs_in_the_steps_fp32_math_mode(monkeypatch, cpu):
    # G5: the cache's forward ran before the step's math mode was set, so under torch's default (cuDNN TF32
    # on) an NVIDIA "fp32" cached teacher ran TF32 and its cache time was too small
    from kdbench.hw import backends

    config = make_config(teacher={"mode": "cached"})
    teacher, student = _models(config)
    log = []
    teacher = _Recorded(teacher, log)
    x, y = synthetic_batch(config, config.batch_size, cpu.device, 0)
    with backends.math_mode(True):  # an inherited TF32 default
        step = DistillStep(teacher, student, x, y, config, cpu, VISION)
    assert log == [("teacher", False)]  # IEEE fp32, as the fp32 cell measures
    assert step.cache_ms > 0 and step.cache.logits.data_ptr() != teacher.buffer.data_ptr()
