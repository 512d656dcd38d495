"""teacher.corpus: an offline store built over a token file the user names (a .npy, or a raw binary as nanoGPT's
train.bin), memory-mapped; its mistakes refused at plan time in one line; its digest in the store's key; and the
reader's batches split between the ranks of a data-parallel cell."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kdbench.config import load_suite
from kdbench.config.plan import cell_id_of, config_dict
from kdbench.core.errors import KdbenchError
from kdbench.data.token_file import open_tokens, scan_tokens
from kdbench.measure.step import MeasureOptions, measure_distill_step
from kdbench.models import ModelCache
from kdbench.store.logit_store import LogitStore, store_key
from kdbench.store.teacher_logits import Encoding
from kdbench.workloads import check_cell, expand_checked
from kdbench.workloads.lm.offline import Prefetcher
from kdbench.workloads.lm.workload import LM
from tests.support.helpers import write_suite
from tests.unit.workloads.test_lm_workload import CPU, lm_config

VOCAB = 4096  # the tiny Llama pair's


def _ids(n: int, seed: int = 0, high: int = VOCAB) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, high, n)


def _offline(store, corpus, **teacher):
    return lm_config(
        teacher={"mode": "offline", "k": 8, "store_tokens": 300, "store": str(store), "corpus": corpus, **teacher},
        inference={"batch_sizes": []},
        timing={"warmup": 1, "min_iters": 3, "min_time_s": 0.0},
    )


@pytest.fixture(scope="module")
def pair():
    return LM.build_pair(lm_config(), CPU, ModelCache())


def test_a_npy_and_a_bin_corpus_build_a_store_and_train_and_the_same_ids_are_the_same_corpus(tmp_path, pair):
    ids = _ids(400)
    np.save(tmp_path / "c.npy", ids.astype(np.int32))
    ids.astype("<u2").tofile(tmp_path / "train.bin")
    np.save(tmp_path / "rows.npy", ids.astype(np.int64).reshape(20, 20))  # 2-D: its rows joined in order
    npy = _offline(tmp_path / "store", str(tmp_path / "c.npy"))
    assert check_cell(npy, False) == []
    row = measure_distill_step(LM, *pair, npy, CPU, None, MeasureOptions(run_dir=str(tmp_path)))
    assert row["status"] == "ok" and math.isfinite(row["final_loss"])
    assert row["teacher_store_tokens"] == 19 * 16 and row["teacher_store_build_s"] > 0  # ceil(300 / 16) windows
    # the store's token windows are the file's ids, seq_len + 1 at a stride of seq_len
    store = (tmp_path / "store" / "tokens-00000.bin").read_bytes()
    windows = np.frombuffer(store, dtype=np.int32).reshape(-1, 17)
    assert (windows[0] == ids[:17]).all() and (windows[1] == ids[16:33]).all() and windows.shape[0] == 19
    digest = scan_tokens(open_tokens(tmp_path / "c.npy"), 19 * 16 + 1, VOCAB)
    assert f"sha256:{digest} of 305 ids" in (tmp_path / "store" / "manifest.json").read_text()
    # the same ids as a raw uint16 binary, or as 2-D rows: the same corpus, the store reused, nothing rebuilt
    before = (tmp_path / "store" / "shard-00000.bin").stat().st_mtime_ns
    for corpus in ({"path": str(tmp_path / "train.bin"), "dtype": "uint16"}, str(tmp_path / "rows.npy")):
        config = _offline(tmp_path / "store", corpus)
        assert check_cell(config, False) == []
        again = measure_distill_step(LM, *pair, config, CPU, None, MeasureOptions(run_dir=str(tmp_path)))
        assert again["status"] == "ok" and again["teacher_store_build_s"] == pytest.approx(row["teacher_store_build_s"])
    assert (tmp_path / "store" / "shard-00000.bin").stat().st_mtime_ns == before


def test_a_store_built_over_another_corpus_is_refused_naming_it(tmp_path, pair):
    np.save(tmp_path / "a.npy", _ids(400, seed=1))
    np.save(tmp_path / "b.npy", _ids(400, seed=2))
    measure_distill_step(LM, *pair, _offline(tmp_path / "s", str(tmp_path / "a.npy")), CPU, None)
    a, b = (scan_tokens(open_tokens(tmp_path / f"{n}.npy"), 305) for n in "ab")
    with pytest.raises(
        KdbenchError,
        match=rf"built with another corpus: corpus 'sha256:{a} of 305 ids' \(this cell's: 'sha256:{b} of 305 ids'\)",
    ):
        measure_distill_step(LM, *pair, _offline(tmp_path / "s", str(tmp_path / "b.npy")), CPU, None)
    # the stdlib text's store is another corpus too
    stdlib = lm_config(
        teacher={"mode": "offline", "k": 8, "store_tokens": 300, "store": str(tmp_path / "t")},
        inference={"batch_sizes": []},
        timing={"warmup": 1, "min_iters": 3, "min_time_s": 0.0},
    )
    measure_distill_step(LM, *pair, stdlib, CPU, None)
    stdlib_text = r"another tokenizer, corpus: .*; corpus the stdlib text \(this cell's: 'sha256:"
    with pytest.raises(KdbenchError, match=stdlib_text):
        measure_distill_step(LM, *pair, _offline(tmp_path / "t", str(tmp_path / "a.npy")), CPU, None)


def test_a_token_file_is_memory_mapped_and_read_only_in_part(tmp_path):
    np.save(tmp_path / "c.npy", np.arange(100, dtype=np.uint16).reshape(10, 10))
    np.arange(50, dtype="<u4").tofile(tmp_path / "c.bin")
    npy, raw = open_tokens(tmp_path / "c.npy"), open_tokens(tmp_path / "c.bin", "uint32")
    assert isinstance(npy.ids, np.memmap) and isinstance(raw.ids, np.memmap)
    assert (npy.tokens, raw.tokens, raw.dtype) == (100, 50, np.dtype("<u4"))
    assert npy.span(7, 23).tolist() == list(range(7, 23)) and raw.span(48, 60).tolist() == [48, 49]
    assert scan_tokens(npy, 50) == scan_tokens(raw, 50)  # the ids read, not the container


def _problem(config) -> tuple[str, str]:
    problems = check_cell(config, False)
    assert len(problems) == 1, problems
    return ".".join(problems[0][0]), problems[0][1]


def test_every_corpus_mistake_is_one_problem_naming_the_file_and_key(tmp_path):
    def corpus(value, **over):
        teacher = {"mode": "offline", "k": 8, "store_tokens": 64, "corpus": value, **over.pop("teacher", {})}
        return _problem(lm_config(teacher=teacher, **over))

    missing = tmp_path / "nope.npy"
    assert corpus(str(missing)) == ("teacher.corpus", f"token file {missing} does not exist")
    (tmp_path / "empty.bin").write_bytes(b"")
    assert corpus({"path": str(tmp_path / "empty.bin"), "dtype": "uint16"})[1].endswith("is empty (0 bytes)")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    assert (
        "holds 3 bytes, not a whole number of uint16 ids"
        in corpus({"path": str(tmp_path / "odd.bin"), "dtype": "uint16"})[1]
    )
    _ids(200).astype("<u2").tofile(tmp_path / "c.bin")
    assert "give its id type, corpus: {path: ..., dtype: uint16}" in corpus(str(tmp_path / "c.bin"))[1]
    (tmp_path / "bad.npy").write_bytes(b"\x93NUMPY not a header")
    assert f"token file {tmp_path / 'bad.npy'} cannot be read" in corpus(str(tmp_path / "bad.npy"))[1]
    np.save(tmp_path / "f.npy", np.zeros(200, np.float32))
    assert "holds float32 values, not integer token ids" in corpus(str(tmp_path / "f.npy"))[1]
    np.save(tmp_path / "i32.npy", _ids(200).astype(np.int32))
    assert "holds int32 ids, not the uint16 given" in corpus({"path": str(tmp_path / "i32.npy"), "dtype": "uint16"})[1]
    np.save(tmp_path / "cube.npy", np.zeros((2, 2, 50), np.int32))
    assert "is 3-D (2x2x50)" in corpus(str(tmp_path / "cube.npy"))[1]
    big = _ids(200)
    big[150] = 5000
    np.save(tmp_path / "big.npy", big)
    key, why = corpus(str(tmp_path / "big.npy"), teacher={"store_tokens": 160})
    assert key == "teacher.corpus" and "holds id 5000 in its first 161 ids, beyond the pair's vocabulary of 4096" in why
    early = lm_config(teacher={"mode": "offline", "k": 8, "store_tokens": 64, "corpus": str(tmp_path / "big.npy")})
    assert check_cell(early, False) == []  # only the ids the store reads are checked (the first 65)
    negative = _ids(200)
    negative[3] = -1
    np.save(tmp_path / "neg.npy", negative)
    assert "holds a negative id (-1)" in corpus(str(tmp_path / "neg.npy"))[1]
    np.save(tmp_path / "short.npy", _ids(20))
    key, why = corpus(str(tmp_path / "short.npy"))
    assert (
        key == "teacher.corpus"
        and "holds 20 ids, fewer than one batch takes: batch_size 2 windows of seq_len 16 + 1 = 33" in why
    )
    key, why = corpus({"path": str(tmp_path / "c.bin"), "dtype": "uint16"}, teacher={"store_tokens": 1000})
    assert key == "teacher.store_tokens" and "holds 200 ids, fewer than the 1009 its windows" in why
    assert why.endswith("lower store_tokens to at most 192")  # 12 windows of 16 take 193 of the 200
    key, why = corpus({"path": str(tmp_path / "c.bin"), "dtype": "uint16"}, teacher={"store_tokens": 16})
    assert key == "teacher.store_tokens" and "makes 1 window(s) of seq_len 16, fewer than one batch's 2" in why


def test_a_relative_corpus_is_the_suite_files_folders_and_the_identity_keeps_older_cells(tmp_path, monkeypatch):
    folder = tmp_path / "suites"
    folder.mkdir()
    np.save(folder / "c.npy", _ids(400))
    suite = write_suite(
        folder / "s.yaml",
        name="s",
        defaults={
            "pair": {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
            "method": "forward_kl",
            "batch_size": 2,
            "data": {"kind": "tokens", "seq_len": 16},
            "teacher": {"mode": "offline", "k": 8, "store_tokens": 64, "corpus": "c.npy"},
        },
    )
    monkeypatch.chdir(tmp_path)  # another folder than the suite's
    (cell,) = expand_checked(load_suite(suite))
    assert cell.config.teacher.corpus.path == str(folder.resolve() / "c.npy")
    assert config_dict(cell.config)["teacher"]["corpus"] == {"path": str(folder.resolve() / "c.npy"), "dtype": None}
    # the stdlib text (no corpus) keeps the ids of offline cells from before the key; a live cell ignores it
    plain = lm_config(teacher={"mode": "offline", "k": 8})
    assert "corpus" not in config_dict(plain)["teacher"]
    assert cell_id_of(lm_config(teacher={"mode": "live", "corpus": "x.npy"})) == cell_id_of(lm_config())


def test_the_ranks_of_a_data_parallel_cell_read_their_own_batches(tmp_path):
    enc = Encoding(4, "fp16", "int16")
    store = LogitStore.open(tmp_path / "s", store_key("t", "b", 300, 8, 1.0, enc), enc, create=True)
    tokens = np.arange(10 * 9).reshape(10, 9)  # 10 sequences, each its own ids
    top = -np.sort(np.random.default_rng(0).random((80, 4)), axis=-1).astype(np.float32)
    store.write_shard(0, tokens, top, np.zeros((80, 4), np.int64), np.zeros(80, np.float32))
    readers = [Prefetcher(store, 2, 1, torch.device("cpu"), 1.0, 300, rank=r, world_size=2) for r in (0, 1)]
    try:
        seen = [[readers[r].next()[0][:, 0].div(9, rounding_mode="floor").tolist() for _ in range(3)] for r in (0, 1)]
    finally:
        for reader in readers:
            reader.close()
    # step 0: rank 0 sequences 0-1, rank 1 2-3; step 1: 4-5 and 6-7; step 2: 8-9 and (wrapping) 0-1
    assert seen == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]]]
    with pytest.raises(KdbenchError, match=r"holds 10 sequences, fewer than batch_size 6 × world_size 2"):
        Prefetcher(store, 6, 1, torch.device("cpu"), 1.0, 300, rank=0, world_size=2)
