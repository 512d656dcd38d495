"""kdbench.models.lm: causal LMs with random weights, counted on the meta device."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kdbench.core.errors import KdbenchError
from kdbench.core.install import extra_hint
from kdbench.models.hub import hf_config_path, hub_cache
from kdbench.models.lm import LM_CONFIGS, build_lm, lm_config, lm_config_from_file, lm_parameter_count

# transformers is in the test extra: these tests run everywhere the tests do (a missing one fails, never skips)

# The counts the model cards and hub pages publish (tied embeddings counted once).
PUBLISHED = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
}


def _llama_layer_params(c: dict) -> int:
    """One Llama decoder layer: q, k, v, o projections, the gated MLP and two RMSNorms."""
    h, heads, kv, inter = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
    head_dim = h // heads
    return 2 * h * heads * head_dim + 2 * h * kv * head_dim + 3 * h * inter + 2 * h


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_registry_names():
    assert set(PUBLISHED) | {"tiny-llama-teacher", "tiny-llama-student"} == set(LM_CONFIGS)
    for entry in LM_CONFIGS.values():
        assert entry["config_class"] in {"LlamaConfig", "Qwen2Config", "GPT2Config"}
    teacher, student = LM_CONFIGS["tiny-llama-teacher"]["config"], LM_CONFIGS["tiny-llama-student"]["config"]
    assert teacher["vocab_size"] == student["vocab_size"] == 4096


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_equal_published(name):
    assert lm_parameter_count(name) == PUBLISHED[name]


def test_meta_build_allocates_nothing():
    model = build_lm("llama-3.1-8b", device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert not model.training


@pytest.mark.parametrize("name", ["tiny-llama-teacher", "tiny-llama-student"])
def test_tiny_forward_on_cpu(name):
    torch.manual_seed(0)
    model = build_lm(name)
    assert not model.training
    assert model.config._attn_implementation == "sdpa"
    vocab = LM_CONFIGS[name]["config"]["vocab_size"]
    ids = torch.randint(0, vocab, (2, 16))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (2, 16, vocab)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_dtype_applies():
    model = build_lm("tiny-llama-student", device="meta", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_layer_override_removes_exactly_two_layers():
    numbers = LM_CONFIGS["tiny-llama-teacher"]["config"]
    assert numbers["num_hidden_layers"] == 4
    full = lm_parameter_count("tiny-llama-teacher")
    two = lm_parameter_count("tiny-llama-teacher", {"num_hidden_layers": 2})
    assert full - two == 2 * _llama_layer_params(numbers)
    assert lm_config("tiny-llama-teacher", {"num_hidden_layers": 2}).num_hidden_layers == 2

    # Large shapes too, on the meta device: the count is linear in the layers.
    layers = LM_CONFIGS["qwen2.5-0.5b"]["config"]["num_hidden_layers"]
    counts = [lm_parameter_count("qwen2.5-0.5b", {"num_hidden_layers": n}) for n in (2, 3)]
    assert PUBLISHED["qwen2.5-0.5b"] - counts[0] == (layers - 2) * (counts[1] - counts[0])
    # GPT-2's alias for n_layer.
    gpt2_layer = (lm_parameter_count("gpt2") - lm_parameter_count("gpt2", {"num_hidden_layers": 2})) // 10
    assert gpt2_layer == 12 * 768 * 768 + 13 * 768


def test_unknown_name_is_one_line_error():
    with pytest.raises(KdbenchError) as error:
        lm_config("llama-3.2-1bb")
    message = _one_line(error)
    assert "llama-3.2-1b" in message and "did you mean" in message


def test_unknown_field_is_one_line_error():
    with pytest.raises(KdbenchError) as error:
        lm_config("llama-3.2-1b", {"num_hidden_layer": 2})
    message = _one_line(error)
    assert "'num_hidden_layer'" in message and "'num_hidden_layers'" in message
    with pytest.raises(KdbenchError) as error:
        build_lm("gpt2", {"n_layers": 2}, device="meta")
    assert "'n_layer'" in _one_line(error)


def test_config_file_round_trip(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", **LM_CONFIGS["tiny-llama-teacher"]["config"]}))
    config = lm_config_from_file(path)
    assert type(config).__name__ == "LlamaConfig"
    assert lm_parameter_count(path) == lm_parameter_count("tiny-llama-teacher")
    assert lm_parameter_count(config) == lm_parameter_count("tiny-llama-teacher")
    assert lm_parameter_count(str(path), {"num_hidden_layers": 2}) == lm_parameter_count(
        "tiny-llama-teacher", {"num_hidden_layers": 2}
    )


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ({"model_type": "lama", "hidden_size": 8}, "'lama'"),
        ({"model_type": "vit"}, "'vit'"),
        ({"hidden_size": 8}, "model_type"),
        ("not json", "not JSON"),
    ],
)
def test_bad_config_file_is_one_line_error(tmp_path, content, needle):
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(KdbenchError) as error:
        lm_config_from_file(path)
    assert needle in _one_line(error)


def test_import_does_not_import_transformers():
    code = "import sys, kdbench.models.lm; assert 'transformers' not in sys.modules, 'imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(KdbenchError) as error:
        lm_config("gpt2")
    assert extra_hint("lm") in _one_line(error) and "[lm]'" in _one_line(error)


# --------------------------------------------------------------------------- hf:ORG/NAME from the local cache


def fake_hub(home: Path, repo: str, config: dict) -> Path:
    """The local Hugging Face cache's layout of one model, as `hf download` leaves it under HF_HOME."""
    folder = home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0123abcd")
    (snapshot / "config.json").write_text(json.dumps(config))
    return snapshot / "config.json"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """HF_HOME at a fake cache holding kdbench-test/tiny-llama (tiny-llama-student's numbers); no connection allowed."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))

    def no_network(*args, **kwargs):
        raise AssertionError("kdbench connected to the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    numbers = {**LM_CONFIGS["tiny-llama-student"]["config"], "model_type": "llama"}
    return fake_hub(tmp_path, "kdbench-test/tiny-llama", numbers)


def test_an_hf_name_is_built_from_the_local_cache(hub, tmp_path, monkeypatch, capsys):
    from kdbench.cli import main

    name = "hf:kdbench-test/tiny-llama"
    assert hf_config_path(name) == hub
    assert lm_parameter_count(name) == lm_parameter_count("tiny-llama-student") == 1_411_712
    model = build_lm(name, {"num_hidden_layers": 1})  # random weights, an override applied
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 1
    suite = tmp_path / "hf.yaml"
    suite.write_text(
        "name: hf\ndefaults:\n  pair: {teacher: tiny-llama-teacher, student: 'hf:kdbench-test/tiny-llama'}\n"
        "  method: forward_kl\n  data: {kind: tokens, seq_len: 32}\n"
    )
    assert main(["run", str(suite), "--dry-run"]) == 0
    assert "tiny-llama-teacher->hf:kdbench-test/tiny-llama forward_kl" in capsys.readouterr().out
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))  # not in this cache: one line, the key, the way in
    assert main(["run", str(suite), "--dry-run"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (
        f"kdbench: error: {suite}:3: defaults.pair.student: hf:kdbench-test/tiny-llama: config.json is not in the "
        f"local Hugging Face cache ({tmp_path / 'elsewhere' / 'hub'}; HF_HOME or HF_HUB_CACHE set it) and kdbench "
        "never downloads: on a machine with network run `hf download kdbench-test/tiny-llama config.json` (or "
        "`huggingface-cli download kdbench-test/tiny-llama config.json`), then copy its "
        f"models--kdbench-test--tiny-llama folder into {tmp_path / 'elsewhere' / 'hub'}"
    )


def test_an_hf_bert_is_an_encoder(hub, tmp_path, capsys):
    from kdbench.cli import main
    from kdbench.config.schema import CellConfig
    from kdbench.models.encoders import ENCODER_CONFIGS, encoder_parameter_count
    from kdbench.workloads import workload_of

    fake_hub(tmp_path, "kdbench-test/tiny-bert", {**ENCODER_CONFIGS["tiny-bert-student"], "model_type": "bert"})
    name = "hf:kdbench-test/tiny-bert"
    assert encoder_parameter_count(name) == encoder_parameter_count("tiny-bert-student") == 268_224
    pair = {"teacher": "tiny-bert-teacher", "student": name}
    config = CellConfig.model_validate({"pair": pair, "data": {"kind": "tokens", "seq_len": 16}, "method": "minilm"})
    assert workload_of(config).family == "encoder"
    suite = tmp_path / "bert.yaml"
    suite.write_text(
        f"name: bert\ndefaults:\n  pair: {{teacher: tiny-bert-teacher, student: '{name}'}}\n  method: minilm\n"
        "  data: {kind: tokens, seq_len: 16}\n  batch_size: 2\n"
    )
    assert main(["run", str(suite), "--dry-run"]) == 0
    assert f"tiny-bert-teacher->{name} minilm" in capsys.readouterr().out


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"HF_HUB_CACHE": "/c/hub2", "HF_HOME": "/h"}, "/c/hub2"),
        ({"HF_HOME": "/h"}, "/h/hub"),
        ({"XDG_CACHE_HOME": "/x"}, "/x/huggingface/hub"),
    ],
)
def test_the_cache_is_found_as_huggingface_hub_finds_it(env, expected, monkeypatch):
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert hub_cache() == Path(expected)
