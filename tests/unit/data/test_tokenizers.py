"""kdbench.data.tokenizers: byte-exact BPE tokenizers trained here, and the byte tokenizer."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from kdbench.core.errors import KdbenchError
from kdbench.data.tokenizers import ByteTokenizer, byte_chars, digest, load_bpe, train_bpe


@pytest.fixture(scope="module")
def texts() -> list[bytes]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / name).read_bytes() for name in ("textwrap.py", "shlex.py", "fnmatch.py", "colorsys.py")]


@pytest.fixture(scope="module")
def bpe(texts):
    return train_bpe(texts, 400)


def test_byte_alphabet_is_256_distinct_non_space_characters():
    chars = byte_chars()
    assert len(set(chars)) == 256
    assert not any(c.isspace() for c in chars)
    assert chars[ord("a")] == "a" and chars[ord(" ")] == "\u0120" and chars[ord("\n")] == "\u010a"


def test_bpe_round_trips_any_bytes_and_compresses_text(bpe, texts):
    assert bpe.vocab_size == 400
    odd = bytes(range(256)) + "naïve – ü".encode() + b"\xff\xfe\x00" + "é".encode()[:1]  # a cut character
    for data in (texts[0][:3000], odd, b"", b" "):
        assert bpe.decode(bpe.encode(data)) == data
    ids = bpe.encode(texts[0])
    assert len(ids) < 0.75 * len(texts[0])  # merges learnt on this very text
    assert sum(bpe.token_bytes()[i] for i in ids) == len(texts[0])
    assert max(bpe.token_bytes()) > 3
    assert bpe.encode_batch([texts[1][:500], b"x"]) == [bpe.encode(texts[1][:500]), bpe.encode(b"x")]


def test_training_is_deterministic_and_saved_files_load_the_same(bpe, texts, tmp_path):
    again = train_bpe(texts, 400)
    assert digest(again) == digest(bpe)
    path = bpe.save(tmp_path / "tok.json")
    loaded = load_bpe(path)
    assert loaded.encode(texts[2]) == bpe.encode(texts[2]) and digest(loaded) == digest(bpe)
    assert digest(ByteTokenizer()) != digest(bpe)


def test_bad_tokenizer_files_and_sizes_are_refused_with_the_reason(tmp_path):
    with pytest.raises(KdbenchError, match="does not exist"):
        load_bpe(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(KdbenchError, match="not a tokenizers JSON"):
        load_bpe(tmp_path / "bad.json")
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).save(str(tmp_path / "other.json"))
    with pytest.raises(KdbenchError, match="not byte-level"):
        load_bpe(tmp_path / "other.json")
    with pytest.raises(KdbenchError, match="vocab_size"):
        train_bpe([b"abc"], 256)
    assert json.loads((tmp_path / "other.json").read_text())["model"]["type"] == "BPE"


def test_byte_tokenizer():
    tok = ByteTokenizer()
    assert tok.encode(b"\x00ab") == [0, 97, 98] and tok.decode([0, 97, 98]) == b"\x00ab" and tok.vocab_size == 256
