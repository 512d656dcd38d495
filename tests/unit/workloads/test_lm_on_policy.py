"""On-policy LM distillation (GKD): the student's completions, the generation phase, the checks."""

from __future__ import annotations

import pytest
import torch

from kdbench.config.plan import Cell, cell_id_of, config_dict
from kdbench.data.tokens import prompt_length
from kdbench.distill.step import DistillStep
from kdbench.models import ModelCache
from kdbench.models.generation import sample
from kdbench.run.cell import measure_cell
from kdbench.workloads import check_cell
from kdbench.workloads.lm.workload import LM
from tests.unit.workloads.test_lm_workload import CPU, lm_config

ON = {"lmbda": 0.5, "new_tokens": 5}


def test_the_student_completes_each_prompt_and_the_labels_are_its_completion():
    config = lm_config(method="jsd", on_policy=ON)
    teacher, student = LM.build_pair(config, CPU, ModelCache())
    x, y = LM.batch(config, 2, CPU.device, 0, (teacher, student))
    step = DistillStep(teacher, student, x, y, config, CPU, LM)
    ids, labels = step.distiller.on_policy(x, y)
    p = prompt_length(config)
    assert p == 4 and ids.shape == (2, p + 5) and torch.equal(ids[:, :p], x[:, :p])
    assert (labels[:, : p - 1] == -100).all() and (labels[:, -1] == -100).all()
    assert torch.equal(labels[:, p - 1 : -1], ids[:, p:])
    again, _ = step.distiller.on_policy(x, y)
    assert not torch.equal(again[:, p:], ids[:, p:])  # the generator advances: a new sample every step
    assert step.distiller.student.training  # back in train mode after sampling in eval
    step.close()


def test_sampling_at_a_tiny_temperature_is_greedy():
    config = lm_config()
    _, student = LM.build_pair(config, CPU, ModelCache())
    lm = student.lm.eval()
    prompt = torch.randint(0, 4096, (2, 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = sample(lm, prompt, 3, 1e-4, torch.Generator().manual_seed(0))
        ids = prompt
        for _ in range(3):  # no cache: the whole sequence each time, the argmax
            ids = torch.cat([ids, lm(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(got, ids)


def test_an_on_policy_cell_reports_its_generation_phase_and_trains_on_prompt_plus_completion():
    config = lm_config(method="jsd", on_policy=ON, inference={"batch_sizes": []})
    row = measure_cell(Cell(0, cell_id_of(config), config), CPU, ModelCache())[0]
    assert row["status"] == "ok", row.get("error")
    assert row["phase_generate_ms"] > 0 and row["tokens"] == 2 * (4 + 5)
    # the accuracy ledger, on the last generated batch (its completion tokens counted)
    assert row["loss_rel_err"] < 1e-5 and row["grad_rel_err"] < 1e-4
    assert row["loss_objective"] == "jsd(beta=0.5, T=1) over 4096 entries"  # jsd's alpha is 1 (GKD): no CE
    phases = [row[c] for c in row if c.startswith("phase_") and c.endswith("_ms") and c != "phase_remainder_ms"]
    assert sum(phases) + row["phase_remainder_ms"] == pytest.approx(row["median_ms"], rel=0.25)
    from kdbench.run.jobs import config_columns

    columns = config_columns(config, "cpu")
    assert columns["on_policy_lambda"] == 0.5 and columns["on_policy_new_tokens"] == 5
    off = lm_config(method="jsd", inference={"batch_sizes": []})
    assert measure_cell(Cell(0, cell_id_of(off), off), CPU, ModelCache())[0].get("phase_generate_ms") is None


def test_on_policy_is_part_of_the_identity_and_label():
    on, off = lm_config(method="jsd", on_policy=ON), lm_config(method="jsd")
    assert "on_policy" not in config_dict(off) and config_dict(on)["on_policy"]["lmbda"] == 0.5
    assert cell_id_of(on) != cell_id_of(off)
    assert "on-policy5" in Cell(0, cell_id_of(on), on).short_label


@pytest.mark.parametrize(
    "over, key, text",
    [
        ({"teacher": {"mode": "cached"}}, "teacher.mode", "teacher.mode live"),
        ({"method": "hidden_mse"}, "method", "use e.g. method jsd"),
        ({"on_policy": {"new_tokens": 2046}}, "on_policy.new_tokens", "= 2050 is beyond the"),
    ],
)
def test_on_policy_refusals(over, key, text):
    config = lm_config(**({"method": "jsd", "on_policy": ON} | over))
    problems = check_cell(config, False)
    assert problems and ".".join(problems[0][0]) == key and text in problems[0][1]
