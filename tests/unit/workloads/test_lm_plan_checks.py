"""LM and encoder bad input answered at plan time (issue 30): every model is built on the meta device during the
check, so transformers' own refusals, shapes a model cannot take, feature paths, LM heads, vocabulary policies and
generation are one problem at the key to change, before anything runs."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from kdbench.config.schema import CellConfig
from kdbench.core.errors import KdbenchError
from kdbench.models import meta
from kdbench.workloads import check_cell

PAIR = {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"}
ENCODERS = {"teacher": "tiny-bert-teacher", "student": "tiny-bert-student"}


@pytest.fixture
def fresh_meta_cache():
    """Tests that change how models build start and end with no model built on meta kept."""
    meta.clear_cache()
    yield
    meta.clear_cache()


def config(**over) -> CellConfig:
    base = {"pair": PAIR, "method": "forward_kl", "batch_size": 2, "data": {"kind": "tokens", "seq_len": 32}}
    base.update(over)
    return CellConfig.model_validate(base)


def first_problem(cfg: CellConfig, allow_imports: bool = False) -> tuple[str, str]:
    problems = check_cell(cfg, allow_imports)
    assert problems, cfg
    where, message = problems[0]
    return ".".join(where), message


@pytest.mark.parametrize(
    "role, overrides, text",
    [
        # transformers' own validation: ValueError, TypeError, KeyError from the config or the model's constructor
        ("student", {"num_attention_heads": 5}, "not a multiple of the number of attention heads"),
        ("teacher", {"num_attention_heads": 3}, "num_key_value_heads 2 does not divide num_attention_heads 3"),
        ("student", {"num_attention_heads": 2.5}, "expected int, got float"),
        ("student", {"num_hidden_layers": [2]}, "expected int, got list"),
        ("student", {"tie_word_embeddings": "yes"}, "expected bool, got str"),
        ("student", {"hidden_act": "swishh"}, "did you mean 'swish'"),
        ("student", {"rope_scaling": {"rope_type": "yarn"}}, "'factor'"),
        ("student", {"hidden_size": 130}, "even rotary dimension"),
        # shapes transformers accepts and a forward cannot take, or a model of nothing
        ("teacher", {"num_key_value_heads": 3}, "use one of 1, 2, 4 key/value heads"),
        ("student", {"num_attention_heads": 0}, "num_attention_heads 0 must be at least 1"),
        ("student", {"intermediate_size": 0}, "intermediate_size 0 must be at least 1"),
        ("student", {"num_hidden_layers": -1}, "num_hidden_layers -1 must be 0 or more"),
        ("student", {"num_key_value_heads": 0}, "num_key_value_heads 0 must be at least 1"),
        ("student", {"num_experts": 0}, "LlamaConfig has no field 'num_experts'"),
        ("student", {"vocab_size": 1}, "vocab_size 1 must be at least 2"),
        ("teacher", {"pad_token_id": 5000}, "outside the vocabulary's 4096 entries"),
        # numbers YAML read as text
        ("student", {"hidden_size": "128"}, "write 128 without quotes"),
        ("student", {"rms_norm_eps": "1e-5"}, "write 1.0e-5"),
    ],
)
def test_an_override_the_model_cannot_take_is_refused_at_that_override(role, overrides, text):
    key, message = first_problem(config(overrides={role: overrides}))
    assert key == f"overrides.{role}.{next(iter(overrides))}", message
    assert text in message and "\n" not in message


@pytest.mark.parametrize("error", [ValueError, TypeError, AttributeError, AssertionError, RuntimeError])
def test_any_exception_of_the_meta_build_is_one_problem_at_the_override_that_causes_it(
    monkeypatch, fresh_meta_cache, error
):
    """Not a list of known fields: whatever transformers raises while the config or the model is built is caught,
    and the override is found by building without each one in turn."""
    from kdbench.models import lm as lm_module

    real = lm_module.build_lm

    def build_lm(config, *args, **kwargs):
        if getattr(config, "intermediate_size", None) == 340:
            raise error("an internal check of this transformers version failed")
        return real(config, *args, **kwargs)

    monkeypatch.setattr(lm_module, "build_lm", build_lm)
    over = {"student": {"num_hidden_layers": 1, "intermediate_size": 340}}
    key, message = first_problem(config(overrides=over))
    assert key == "overrides.student.intermediate_size"
    assert f"{error.__name__}: an internal check of this transformers version failed" in message


def test_a_config_json_transformers_refuses_names_the_file_and_its_field(tmp_path):
    fields = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 128, "intermediate_size": 344}
    fields.update(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    typed = tmp_path / "typed.json"
    typed.write_text(json.dumps({**fields, "num_attention_heads": "2"}))
    key, message = first_problem(config(pair={"teacher": "tiny-llama-teacher", "student": str(typed)}))
    assert key == "pair.student"
    assert (
        f"model config {typed}: field 'num_attention_heads'" in message
        and "write 2 without quotes in the file" in message
    )
    act = tmp_path / "act.json"  # refused by the model's constructor, not the config's: the field found all the same
    act.write_text(json.dumps({**fields, "hidden_act": "swishy"}))
    key, message = first_problem(config(pair={"teacher": "tiny-llama-teacher", "student": str(act)}))
    assert key == "pair.student" and f"model config {act}: field 'hidden_act'" in message and "'swish'" in message
    shape = tmp_path / "shape.json"
    shape.write_text(json.dumps({**fields, "hidden_size": 130, "num_attention_heads": 4}))
    key, message = first_problem(config(pair={"teacher": "tiny-llama-teacher", "student": str(shape)}))
    assert key == "pair.student" and f"model config {shape}: field 'hidden_size'" in message
    kv = tmp_path / "kv.json"
    kv.write_text(json.dumps({**fields, "num_attention_heads": 4, "num_key_value_heads": 3}))
    key, message = first_problem(config(pair={"teacher": "tiny-llama-teacher", "student": str(kv)}))
    assert key == "pair.student" and "num_key_value_heads 3 does not divide num_attention_heads 4" in message


@pytest.mark.parametrize(
    "overrides, key, text",
    [
        ({"num_attention_heads": 5}, "num_attention_heads", "not a multiple of num_attention_heads"),
        ({"hidden_act": "gelu_x"}, "hidden_act", "did you mean 'gelu'"),
        ({"hidden_size": "64"}, "hidden_size", "write 64 without quotes"),
        ({"vocab_size": 0}, "vocab_size", "vocab_size 0 must be at least 1"),
        ({"type_vocab_size": 0}, "type_vocab_size", "type_vocab_size 0 must be at least 1"),
        ({"num_hidden_layers": "two"}, "num_hidden_layers", "expected int, got str"),
    ],
)
def test_an_encoder_override_the_model_cannot_take_is_refused_at_that_override(overrides, key, text):
    key_, message = first_problem(config(pair=ENCODERS, method="hidden_mse", overrides={"student": overrides}))
    assert key_ == f"overrides.student.{key}" and text in message


def test_feature_paths_are_checked_against_the_meta_models():
    key, message = first_problem(config(method="hidden_mse", features={"teacher": ["model.layers.9"]}))
    assert key == "features.teacher"
    assert "tiny-llama-teacher has no module 'model.layers.9'" in message and "'lm.model.layers.3'" in message
    key, message = first_problem(config(pair=ENCODERS, method="hidden_mse", features={"student": ["x.y"]}))
    assert key == "features.student" and "tiny-bert-student has no module 'x.y'" in message
    given = {"teacher": ["lm.model.layers.1", "lm.model.layers.3"], "student": ["lm.model.layers.1"]}
    key, message = first_problem(config(method="hidden_mse", features=given))
    assert key == "features" and "give both the same number" in message
    fine = {
        "teacher": ["lm.model.layers.1", "lm.model.layers.3"],
        "student": ["lm.model.layers.0", "lm.model.layers.1"],
    }
    assert check_cell(config(method="hidden_mse", features=fine), False) == []
    assert check_cell(config(method="forward_kl+hidden_mse", features=fine), False) == []
    key, message = first_problem(config(method="forward_kl", features=fine))  # given, so never ignored
    assert key == "features" and "method forward_kl pairs none: remove features" in message


def test_a_module_callable_is_found_without_importing_it(tmp_path, monkeypatch):
    from kdbench.models.registry import check_model_name

    package = tmp_path / "userpkg"
    package.mkdir()
    (package / "__init__.py").write_text("raise SystemExit('imported')\n")
    (package / "models.py").write_text("def tiny():\n    raise SystemExit('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_model_name("userpkg.models:tiny", allow_imports=True)  # found, not imported
    with pytest.raises(KdbenchError, match="no module named 'userpkg.nope'"):
        check_model_name("userpkg.nope:tiny", allow_imports=True)
    with pytest.raises(KdbenchError, match="allow_imports.*; and no module named 'nopkg_at_all'"):
        check_model_name("nopkg_at_all.models:tiny", allow_imports=False)
    assert "userpkg" not in sys.modules
    key, message = first_problem(config(pair={"teacher": "tiny-llama-teacher", "student": "nopkg_x:f"}), True)
    assert key == "pair.student" and "no module named 'nopkg_x'" in message


def test_a_callable_without_an_lm_head_or_logits_is_refused():
    cell = config(pair={"teacher": "tiny-llama-teacher", "student": "tests.support.lm_models:body_only"})
    key, message = first_problem(cell, True)
    assert key == "pair.student" and "has no LM head and its forward returns BaseModelOutputWithPast" in message


def test_a_callable_that_returns_logits_takes_the_dense_loss_only_and_cannot_generate():
    pair = {"teacher": "tiny-llama-teacher", "student": "tests.support.lm_models:IdsToLogits"}
    assert check_cell(config(pair=pair, loss_impl="dense"), True) == []
    key, message = first_problem(config(pair=pair, loss_impl="chunked"), True)
    assert key == "loss_impl" and "use loss_impl: dense" in message
    key, message = first_problem(config(pair=pair, loss_impl="dense", on_policy={}), True)
    assert key == "on_policy" and "no transformers causal LM" in message


def test_the_vocabulary_policy_the_user_set_is_honoured_or_refused():
    from kdbench.models.generation import sample
    from kdbench.workloads.lm.checks import shared_vocab

    key, message = first_problem(config(overrides={"student": {"vocab_size": 4000}}))
    assert key == "data.vocab_policy" and "set data.vocab_policy: slice" in message
    sliced = config(overrides={"student": {"vocab_size": 4000}}, data={"kind": "tokens", "vocab_policy": "slice"})
    assert check_cell(sliced, False) == [] and shared_vocab(sliced) == 4000
    # a module:callable's vocabulary is read off its meta model (its head's rows, or its logits' width)
    for student in ("tests.support.lm_models:tiny_hf_student", "tests.support.lm_models:IdsToLogits"):
        pair = {"teacher": "tiny-llama-teacher", "student": student}
        cell = config(pair=pair, loss_impl="dense", overrides={"teacher": {"vocab_size": 4000}})
        key, message = first_problem(cell, True)
        assert key == "data.vocab_policy" and "4000 entries and the student's 4096" in message, message
    # a run never slices what the plan was not asked to (a module:callable's vocabulary is known only there)
    with pytest.raises(KdbenchError, match="set data.vocab_policy: slice"):
        shared_vocab(config(overrides={"student": {"vocab_size": 4000}}))

    class Wide(torch.nn.Module):  # a student whose head is wider than the shared vocabulary
        def forward(self, input_ids, past_key_values=None, use_cache=True):
            logits = torch.zeros(input_ids.shape[0], input_ids.shape[1], 50)
            logits[..., 40:] = 100.0  # beyond the shared 10 entries: never to be sampled
            return type("Out", (), {"logits": logits, "past_key_values": ()})()

    gen = torch.Generator().manual_seed(0)
    ids = sample(Wide(), torch.zeros(2, 3, dtype=torch.long), 6, 1.0, gen, vocab=10)
    assert ids.shape == (2, 9) and int(ids[:, 3:].max()) < 10


def test_a_cell_whose_prompt_masks_every_token_is_refused():
    key, message = first_problem(config(data={"kind": "tokens", "seq_len": 32, "prompt_fraction": 0.97}))
    assert key == "data.prompt_fraction" and "the loss would have no token; lower it to at most 0.9375" in message
    assert check_cell(config(data={"kind": "tokens", "seq_len": 32, "prompt_fraction": 0.9}), False) == []


def test_each_model_is_built_on_meta_once_per_plan(monkeypatch, fresh_meta_cache):
    from kdbench.models import lm as lm_module

    built = []
    real = lm_module.build_lm
    monkeypatch.setattr(lm_module, "build_lm", lambda *a, **k: built.append(k.get("device")) or real(*a, **k))
    for precision in ("fp32", "bf16"):
        for seq_len in (16, 32):
            assert check_cell(config(precision=precision, data={"kind": "tokens", "seq_len": seq_len}), False) == []
    assert built == ["meta", "meta"]  # the teacher and the student, once each, on meta


def test_a_callable_is_built_on_meta_with_the_hub_offline(monkeypatch):
    """User code that downloads its model is not let download at plan time: its checks are left to the run."""
    from huggingface_hub import constants, is_offline_mode

    seen = []
    real = constants.HF_HUB_OFFLINE

    def offline_then_fail(*args, **kwargs):
        seen.append(is_offline_mode())
        raise OSError("offline")

    from kdbench.models import lm as lm_module

    monkeypatch.setattr(lm_module.transformers_module().AutoModelForCausalLM, "from_pretrained", offline_then_fail)
    facts = meta.lm_facts("tests.support.lm_models:from_the_hub", {}, True)
    assert seen == [True] and not facts.known and real == constants.HF_HUB_OFFLINE
    assert (
        check_cell(
            config(pair={"teacher": "tiny-llama-teacher", "student": "tests.support.lm_models:from_the_hub"}), True
        )
        == []
    )
