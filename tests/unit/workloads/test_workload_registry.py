"""The family is decided once (kdbench.workloads.registry.workload_of), and the settings only some families take are
refused for the others from one table (FAMILY_SETTINGS), each family declaring what it takes (Workload.takes)."""

from __future__ import annotations

import pytest

from kdbench.config.plan import deep_merge
from kdbench.config.schema import CellConfig
from kdbench.workloads import FAMILY_SETTINGS, check_cell, refusals, workload_of
from kdbench.workloads.encoder import ENCODER
from kdbench.workloads.lm.workload import LM
from kdbench.workloads.registry import WORKLOADS
from kdbench.workloads.vision import VISION

CELLS = {  # one valid cell of each family
    "vision": {"pair": {"teacher": "resnet8", "student": "resnet8"}, "data": {"shape": [3, 16, 16]}},
    "lm": {
        "pair": {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
        "method": "forward_kl",
        "data": {"kind": "tokens", "seq_len": 16},
    },
    "encoder": {
        "pair": {"teacher": "tiny-bert-teacher", "student": "tiny-bert-student"},
        "method": "minilm",
        "data": {"kind": "tokens", "seq_len": 16},
    },
}
SETTING = {  # a cell that sets each family-specific setting away from its default
    "parallel": {"parallel": "fsdp", "world_size": 2},
    "world_size": {"world_size": 2},
    "teacher.weights": {"teacher": {"weights": "bf16"}, "teacher_precision": "bf16"},
    "teacher.mode": {"teacher": {"mode": "topk_cache"}},
    "on_policy": {"on_policy": {"lmbda": 0.5, "new_tokens": 4}},
    "loss_impl": {"loss_impl": "chunked"},
    "chunk_size": {"chunk_size": 64},
    "inference.decode_tokens": {"inference": {"decode_tokens": 8}},
    "inference.speculative": {"inference": {"speculative": {"draft_tokens": [2]}}},
    "data.prompt_fraction": {"data": {"prompt_fraction": 0.5}},
    "data.vocab_policy": {"data": {"vocab_policy": "slice"}},
    "data.tokenizers": {"data": {"tokenizers": {"teacher": "bytes", "student": "bpe:512"}}},
    "overrides": {"overrides": {"student": {"num_hidden_layers": 1}}},
    "inference.runtime": {"inference": {"runtime": "compile"}},
    "graphs": {"graphs": True},
    "generation": {"generation": {"cache": "static"}},
    "pad_to": {"pad_to": 8},
}


def cell(family: str, setting: str | None = None) -> CellConfig:
    raw = CELLS[family]
    return CellConfig.model_validate(deep_merge(raw, SETTING[setting]) if setting else raw)


def test_every_setting_of_the_table_is_tested_and_every_taken_setting_is_in_it():
    assert set(SETTING) == set(FAMILY_SETTINGS)
    for workload in WORKLOADS:
        assert workload.takes <= set(FAMILY_SETTINGS), workload.family


@pytest.mark.parametrize("family", list(CELLS))
def test_the_family_is_decided_once(family):
    assert workload_of(cell(family)) is {"vision": VISION, "lm": LM, "encoder": ENCODER}[family]
    assert refusals(workload_of(cell(family)), cell(family)) == []


@pytest.mark.parametrize("setting", list(SETTING))
@pytest.mark.parametrize("family", list(CELLS))
def test_a_setting_another_family_takes_is_refused_with_its_path(family, setting):
    config = cell(family, setting)
    workload = workload_of(config)
    found = refusals(workload, config)
    entry = FAMILY_SETTINGS[setting]
    if setting in workload.takes or not entry.is_set(config):  # taken, or a token-data key on image data (unused)
        assert found == []
        return
    messages = dict(found)  # the setting, and any other setting the cell needed for it (fsdp: world_size 2)
    assert set(messages) <= {FAMILY_SETTINGS[k].path for k in SETTING[setting] if k in FAMILY_SETTINGS} | {entry.path}
    message = messages[entry.path]  # it names the setting and the fix
    assert setting.split(".")[-1] in message and any(fix in message for fix in ("remove", "take", "set "))
    assert (entry.path, message) in check_cell(config, allow_imports=False)  # the plan reports it


def test_image_data_keys_of_token_data_are_not_refused_on_images():
    config = cell("vision", "data.prompt_fraction")  # image data: the key does not apply (left out of the id)
    assert config.data.kind == "synthetic" and refusals(VISION, config) == []
