"""The offline teacher store: its encodings round-trip, its bytes per token are the format's arithmetic on disk,
and its faults (another key, a truncated or corrupted shard, a full disk, a killed build) end in one line with what
was written intact."""

from __future__ import annotations

import errno
import json

import numpy as np
import pytest

from kdbench.core.errors import KdbenchError
from kdbench.store.logit_store import MANIFEST, LogitStore, drop_pages, store_key
from kdbench.store.teacher_logits import Encoding, decode, encode, parse_compression, resolve_indices

VOCAB, SEQ, K = 5000, 8, 6


def _topk(n: int, k: int = K, vocab: int = VOCAB, seed: int = 0):
    """Descending log-probs of a random distribution's top-k, their ids and the rest's log-mass."""
    g = np.random.default_rng(seed)
    logits = g.normal(size=(n, vocab)) * 3
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    idx = np.argsort(-logp, axis=-1)[:, :k]
    top = np.take_along_axis(logp, idx, -1).astype(np.float32)
    rest = np.log1p(-np.exp(top.astype(np.float64)).sum(-1)).astype(np.float32)
    return top, idx, rest


def _key(enc: Encoding, teacher: str = "t1") -> dict:
    return store_key(teacher, "bytes-abc", VOCAB, SEQ, 1.0, enc)


def _build(path, enc: Encoding, shards: int = 3, seqs: int = 2, write=None, teacher: str = "t1"):
    store = LogitStore.open(path, _key(enc, teacher), enc, create=True, write=write)
    for i in range(shards):
        if store.finished(i):
            continue
        tokens = np.arange(seqs * (SEQ + 1)).reshape(seqs, SEQ + 1) + i
        store.write_shard(i, tokens, *_topk(seqs * SEQ, seed=i))
    return store


ENCODINGS = [
    Encoding(K, "fp16", "int32"),
    Encoding(K, "bf16", "int16"),
    Encoding(K, "int8", "packed17"),
    Encoding(K, "fp16", "int16", "zstd:3"),
    Encoding(K, "fp16", "int16", top_p=0.5),
]


@pytest.mark.parametrize("enc", ENCODINGS, ids=lambda e: e.label)
def test_each_encoding_round_trips_within_its_dtype(enc):
    logp, idx, rest = _topk(40, vocab=50)
    got_logp, got_idx, got_rest = decode(enc, encode(enc, logp, idx, rest), 40)
    if enc.values == "bf16":
        import torch

        got_logp = torch.from_numpy(got_logp.copy()).view(torch.bfloat16).float().numpy()
    tol = {"fp16": 1e-3, "bf16": 8e-3, "int8": 1.0 / 254}[enc.values]
    if enc.top_p is None:
        np.testing.assert_array_equal(got_rest, rest)
        np.testing.assert_array_equal(got_idx, idx)
        span = logp[:, :1] - logp[:, -1:] if enc.values == "int8" else np.abs(logp)
        assert np.all(np.abs(got_logp.astype(np.float32) - logp) <= tol * span + 1e-6)
    else:  # the slots after the cut: -inf, repeating the last kept id
        cut = ~np.isfinite(got_logp)
        assert cut.any() and not cut[:, 0].any()
        kept = (~cut).sum(-1)
        mass = np.exp(logp.astype(np.float64)).cumsum(-1)
        assert np.all((np.take_along_axis(mass, (kept - 1)[:, None], -1)[:, 0] >= 0.5) | (kept == K))
        assert np.all((kept == 1) | (np.take_along_axis(mass, (kept - 2).clip(0)[:, None], -1)[:, 0] < 0.5))
        kept_mass = np.where(cut, 0, np.exp(logp.astype(np.float64))).sum(-1)
        np.testing.assert_allclose(np.exp(got_rest.astype(np.float64)), 1 - kept_mass, atol=1e-6)
        last = np.take_along_axis(idx, (kept - 1)[:, None], -1)
        np.testing.assert_array_equal(got_idx, np.where(cut, last, idx))


def test_packed17_holds_every_id_below_2_to_the_17():
    enc = Encoding(3, "fp16", "packed17")
    ids = np.array([[0, 1, (1 << 17) - 1], [65535, 65536, 99999]])
    logp = np.full((2, 3), -1.0, dtype=np.float32)
    _, got, _ = decode(enc, encode(enc, logp, ids, np.zeros(2, np.float32)), 2)
    np.testing.assert_array_equal(got, ids)
    assert enc.index_bytes == 7  # ceil(3 × 17 / 8)


def test_int16_reads_unsigned_up_to_65536_and_auto_picks_by_vocabulary():
    enc = Encoding(2, "fp16", "int16")
    ids = np.array([[40000, 65535]])
    _, got, _ = decode(enc, encode(enc, np.full((1, 2), -1.0, np.float32), ids, np.zeros(1, np.float32)), 1)
    np.testing.assert_array_equal(got, ids)
    assert resolve_indices("auto", 65536) == "int16" and resolve_indices("auto", 65537) == "int32"
    with pytest.raises(KdbenchError, match="int16 holds ids below 65536.*70000"):
        resolve_indices("int16", 70000)
    with pytest.raises(ValueError, match="zstd:<level>"):
        parse_compression("zstd:0")


@pytest.mark.parametrize("enc", ENCODINGS[:3] + ENCODINGS[4:], ids=lambda e: e.label)
def test_bytes_per_token_on_disk_are_the_formats_arithmetic(tmp_path, enc):
    store = _build(tmp_path / "s", enc)
    on_disk = sum(f.stat().st_size for f in store.shard_files())
    want = K * enc.value_bytes + (8 if enc.values == "int8" else 0) + enc.index_bytes + 4
    assert on_disk / store.tokens == want == enc.bytes_per_token
    assert store.tokens == 3 * 2 * SEQ


def test_a_compressed_store_is_smaller_on_disk_and_reads_back_the_same(tmp_path):
    plain = _build(tmp_path / "a", Encoding(K, "fp16", "int16"), seqs=30)
    packed = _build(tmp_path / "b", Encoding(K, "fp16", "int16", "zstd:9"), seqs=30)
    assert packed.disk_bytes < plain.disk_bytes
    for a, b in zip(plain.read(1, 1, 1), packed.read(1, 1, 1)):
        np.testing.assert_array_equal(a, b)


def test_reads_take_any_sequences_of_a_shard(tmp_path):
    enc = Encoding(K, "int8", "packed17")
    store = _build(tmp_path / "s", enc, seqs=3)
    tokens, logp, idx, rest = store.read(2, 1, 2)
    whole = decode(enc, encode(enc, *_topk(3 * SEQ, seed=2)), 3 * SEQ, SEQ, 2 * SEQ)
    np.testing.assert_array_equal(logp, whole[0])
    np.testing.assert_array_equal(rest, whole[2])
    np.testing.assert_array_equal(idx, whole[1])
    np.testing.assert_array_equal(tokens[0], np.arange(SEQ + 1) + (SEQ + 1) + 2)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (dict(teacher="t2"), "teacher 't1' (this cell's: 't2')"),
        (dict(k=K + 1), "k 6 (this cell's: 7)"),
        (dict(temperature=2.0), "temperature 1.0 (this cell's: 2.0)"),
        (dict(tokenizer="bpe-x"), "tokenizer 'bytes-abc'"),
    ],
)
def test_a_store_built_with_another_key_is_refused_in_one_line_naming_it(tmp_path, change, named):
    enc = Encoding(K, "fp16", "int16")
    _build(tmp_path / "s", enc)
    key = {**_key(enc), **change}
    with pytest.raises(KdbenchError) as info:
        LogitStore.open(tmp_path / "s", key, enc)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_a_truncated_or_corrupted_shard_is_refused_naming_it(tmp_path):
    enc = Encoding(K, "fp16", "int16")
    _build(tmp_path / "s", enc)
    shard = tmp_path / "s" / "shard-00001.bin"
    data = shard.read_bytes()
    shard.write_bytes(data[:-5])
    with pytest.raises(KdbenchError, match=r"shard shard-00001\.bin is \d+ bytes, the manifest says \d+ \(truncated"):
        LogitStore.open(tmp_path / "s", _key(enc), enc).read(1, 0, 1)
    shard.write_bytes(data[:10] + bytes([data[10] ^ 0xFF]) + data[11:])
    with pytest.raises(KdbenchError, match=r"shard shard-00001\.bin fails its sha256 checksum"):
        LogitStore.open(tmp_path / "s", _key(enc), enc).read(1, 0, 1)
    LogitStore.open(tmp_path / "s", _key(enc), enc).read(0, 0, 1)  # the others still read


def test_a_killed_build_resumes_without_rewriting_its_finished_shards(tmp_path):
    enc = Encoding(K, "fp16", "int16")
    _build(tmp_path / "s", enc, shards=2)  # "killed" after two of three
    (tmp_path / "s" / ".shard-00002.bin.half.tmp").write_bytes(b"partial")  # a write the kill cut short
    before = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in (tmp_path / "s").glob("*-0000[01].bin")}
    store = _build(tmp_path / "s", enc, shards=3)
    after = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in (tmp_path / "s").glob("*-0000[01].bin")}
    assert after == before and len(before) == 4
    assert sorted(store.shards) == [0, 1, 2] and store.read(2, 0, 1)[0].shape == (1, SEQ + 1)


def test_a_full_disk_stops_the_build_in_one_line_with_the_finished_shards_intact(tmp_path):
    enc = Encoding(K, "fp16", "int16")
    calls = []

    def write(path, data):
        calls.append(path)
        if len(calls) > 4:  # two shards (tokens + top-k each) fit; the third does not
            raise OSError(errno.ENOSPC, "No space left on device")
        path.write_bytes(data)

    with pytest.raises(KdbenchError) as info:
        _build(tmp_path / "s", enc, write=write)
    msg = str(info.value)
    assert "writing shard-00002.bin failed (no space left on device)" in msg and "2 finished" in msg
    assert "\n" not in msg
    manifest = json.loads((tmp_path / "s" / MANIFEST).read_text())
    assert [s["index"] for s in manifest["shards"]] == [0, 1]
    assert not [p for p in (tmp_path / "s").iterdir() if p.name.startswith(".")]  # no temporary left
    store = LogitStore.open(tmp_path / "s", _key(enc), enc)
    store.verify(0), store.verify(1)
    assert not store.finished(2)


def test_drop_pages_asks_the_os_where_it_can(tmp_path):
    store = _build(tmp_path / "s", Encoding(K, "fp16", "int16"))
    import os

    assert drop_pages(store.shard_files()) == hasattr(os, "posix_fadvise")
