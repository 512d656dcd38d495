"""How GQA attention reaches SDPA (GPU review 4, M2): the rule kdbench mirrors gives the path transformers takes,
eager and compiling, and the watch over an eager call sees it (tiny Llama, fp32, CPU)."""

from __future__ import annotations

import copy
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from kdbench.models.attention_path import (
    ENABLE_GQA,
    MHA,
    PACKED,
    REPEATED,
    Call,
    Seen,
    gqa_in_sdpa,
    observing,
    path_label,
    sdpa_gqa_path,
    torch_release,
)
from kdbench.models.generation import Cached, GreedyServing, prefill, speculative_generate, static_cache
from kdbench.models.lm import build_lm

sdpa = pytest.importorskip("transformers.integrations.sdpa_attention")
needs_rule = pytest.mark.skipif(not hasattr(sdpa, "pack_gqa"), reason="transformers without pack_gqa (4.x)")
pytestmark = pytest.mark.usefixtures("one_thread")


def _llama(name="tiny-llama-student", **over):
    torch.manual_seed(0)
    config = {"vocab_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, **over}
    return build_lm(name, config, device="cpu", dtype=torch.float32).eval()


def _qkv(q_len, heads=4, kv_heads=2, kv_len=6, dim=16, v_dim=None):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, q_len, dim, generator=g)
    k = torch.randn(1, kv_heads, kv_len, dim, generator=g)
    v = torch.randn(1, kv_heads, kv_len, v_dim or dim, generator=g)
    return q, k, v


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("dims", [(16, 16), (320, 320), (16, 8)])
@pytest.mark.parametrize("masked", [False, True])
def test_the_gqa_rule_is_transformers_use_gqa_in_sdpa_on_this_device(masked, dims, force, monkeypatch):
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1" if force else "0")
    _, k, v = _qkv(1, dim=dims[0], v_dim=dims[1])
    mask = torch.ones(1, 1, 1, 6, dtype=torch.bool) if masked else None
    assert gqa_in_sdpa(masked, dims, "cpu", torch_release(), force) == sdpa.use_gqa_in_sdpa(mask, k, v)
    assert gqa_in_sdpa(masked, dims, "cuda", force=force) == (force or (not masked and dims == (16, 16)))


def test_on_xpu_and_mps_the_rule_follows_the_torch_version_whatever_the_mask():
    assert gqa_in_sdpa(True, (512, 512), "xpu", (2, 8)) and not gqa_in_sdpa(True, (16, 16), "xpu", (2, 7))
    assert gqa_in_sdpa(True, (16, 16), "mps", (2, 13)) and not gqa_in_sdpa(True, (16, 16), "mps", (2, 12))


@needs_rule
@pytest.mark.parametrize("compiling", [False, True])
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_the_path_rule_is_the_one_transformers_takes(masked, q_len, compiling, monkeypatch):
    """transformers' sdpa_attention_forward on a GQA module (2 groups), with is_torchdynamo_compiling as under
    torch.compile: the watched path is the rule's, and the eager watch's facts give it for compiling."""
    monkeypatch.setattr(sdpa, "is_torchdynamo_compiling", lambda: compiling)
    q, k, v = _qkv(q_len)
    mask = torch.ones(1, 1, q_len, 6, dtype=torch.bool) if masked else None
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True)
    with observing() as seen:
        out, _ = sdpa.sdpa_attention_forward(module, q, k, v, mask)
    want = sdpa_gqa_path(2, q_len, gqa_in_sdpa(masked, (16, 16), "cpu", torch_release()), compiling)
    assert seen.paths(2) == Counter({want: 1})
    assert want == (ENABLE_GQA if not masked else PACKED if q_len == 1 and not compiling else REPEATED)
    if masked or q_len == 1:  # every path attends the same (unmasked, several queries: causal on a cropped K)
        reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(out, reference.transpose(1, 2))
    if not compiling:  # the eager facts predict the compiled path
        assert seen.compiled_paths(2, q_len, "cpu") == Counter({sdpa_gqa_path(2, q_len, want == ENABLE_GQA, True): 1})
    assert seen.repeat_bytes() == (2 * 4 * 6 * 16 * 4 if want == REPEATED else 0)  # K and V, 4 heads, 6 positions


def test_one_kv_head_per_query_head_is_mha_and_no_watch_is_unknown(monkeypatch):
    seen = Seen()
    assert seen.paths(1) == seen.compiled_paths(1, 1, "cuda") == Counter({MHA: 1})
    assert seen.paths(2) is None and seen.compiled_paths(2, 1, "cuda") is None  # nothing seen
    monkeypatch.setitem(sys.modules, "transformers.integrations.sdpa_attention", None)  # no sdpa module
    with observing() as seen:
        pass
    assert seen.calls == [] and seen.paths(4) is None
    # transformers 4.x (no pack_gqa, nothing asked: repeat_kv for K and V): the eager path, no compiled one
    old = Seen(compile_branch=False, calls=[Call("", REPEATED)])
    assert old.paths(2) == Counter({REPEATED: 1}) and old.compiled_paths(2, 1, "cuda") is None
    assert path_label(Counter({PACKED: 2, ENABLE_GQA: 6})) == "enable_gqa+packed" and path_label(Counter()) is None


@needs_rule
def test_a_static_decode_step_packs_eagerly_and_repeats_kv_compiled_as_the_rule_says(monkeypatch):
    """A dynamic cache's step: SDPA's GQA; a static cache's step (a mask at one query token): pack_gqa eagerly,
    repeat_kv through torch.compile (counted in a compile with the eager backend: dynamo's tracing, no inductor)."""
    lm = _llama()
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        dynamic = GreedyServing(lm, ids, 3)
        dynamic.start()
        with observing() as seen:
            dynamic.eager_step()
        assert seen.paths(2) == Counter({ENABLE_GQA: 2}) and seen.compiled_paths(2, 1, "cpu") == seen.paths(2)

        static = GreedyServing(lm, ids, 3, SimpleNamespace(cache="static", compile=False))
        static.start()
        with observing() as seen:
            static.eager_step()
        assert seen.paths(2) == Counter({PACKED: 2}) and seen.repeat_bytes() == 0
        assert [c.masked for c in seen.calls] == [True, True]
        assert seen.compiled_paths(2, 1, "cpu") == Counter({REPEATED: 2})
        assert static.model.length == 5  # back to the prompt

    calls: Counter = Counter()
    for name in ("repeat_kv", "pack_gqa"):
        original = getattr(sdpa, name)

        def counted(*args, name=name, original=original, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(sdpa, name, counted)
    torch._dynamo.reset()
    try:
        step = torch.compile(lm.forward, backend="eager", fullgraph=True, dynamic=False)
        with torch.inference_mode():
            cache = static_cache(lm, 2, 8, torch.float32, "cpu")
            model = Cached(lm, cache, step=step, length=0)
            model.feed(ids)
            calls.clear()
            model.advance(ids[:, -1:])
    finally:
        torch._dynamo.reset()
    assert calls["repeat_kv"] == 2 * 2 and calls["pack_gqa"] == 0  # K and V in each of the 2 layers


@needs_rule
def test_a_compiled_steps_repeat_writes_what_the_floor_counts(monkeypatch):
    """The bytes repeat_kv writes in one static step as compiling (is_torchdynamo_compiling True, eagerly) are
    groups × the KV bytes per position × the allocated length per sequence: half the floor's extra term (it also
    counts SDPA's read)."""
    from kdbench.measure.decode_floor import kv_bytes_per_position, kv_groups, repeat_kv_bytes_per_token

    lm = _llama()
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    gen = GreedyServing(lm, ids, 3, SimpleNamespace(cache="static", compile=False))
    with torch.inference_mode():
        gen.start()
        monkeypatch.setattr(sdpa, "is_torchdynamo_compiling", lambda: True)
        with observing() as seen:
            gen.eager_step()
    kv = kv_bytes_per_position(lm.config, 4)
    assert (kv, kv_groups(lm.config)) == (2 * 2 * 2 * 32 * 4, 2)  # 2 layers, 2 kv heads of 32, fp32
    assert seen.paths(2) == Counter({REPEATED: 2})
    assert seen.repeat_bytes() == 2 * (2 * 2 * 4 * 8 * 32 * 4)  # 2 layers of: batch 2, K and V, 4 heads, 8 positions
    # written and read back, per generated token (a step makes 2, one per sequence): 32 KiB
    assert 2 * seen.repeat_bytes() / 2 == repeat_kv_bytes_per_token(kv, 2, 5 + 3) == 32768


def test_a_speculative_verify_repeats_kv_on_the_teacher_only():
    """A draft identical to the teacher (one round of 2 proposals, both accepted, for 3 new tokens): the draft's
    one-token steps use SDPA's GQA, the teacher's verify of 3 tokens on its cache (a mask) repeats K and V over the
    P + 2 positions it attends."""
    target = _llama("tiny-llama-teacher")
    draft = copy.deepcopy(target)
    prompt = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        caches = (prefill(target, prompt), prefill(draft, prompt))
        with observing({"teacher": target, "student": draft}) as seen:
            run = speculative_generate(target, draft, prompt, 3, 2, caches=caches)
    assert (run.verifies, run.accepted) == (1, 2)
    assert seen.paths(2, "teacher") == Counter({REPEATED: 2}) and seen.paths(2, "student") == Counter({ENABLE_GQA: 4})
    head_dim = target.config.hidden_size // 4
    assert seen.repeat_bytes("teacher") == 2 * 2 * 4 * (5 + 2) * head_dim * 4  # layers, K and V, heads, positions
    assert seen.repeat_bytes("student") == 0


def test_the_watch_puts_transformers_back():
    before = {n: getattr(sdpa, n) for n in ("use_gqa_in_sdpa", "pack_gqa", "repeat_kv") if hasattr(sdpa, n)}
    with pytest.raises(RuntimeError), observing():
        assert all(getattr(sdpa, n) is not f for n, f in before.items())
        raise RuntimeError
    assert {n: getattr(sdpa, n) for n in before} == before
