"""ULD aligned by bytes (issue 45, item 4): the pairing rule by hand on a text whose byte and BPE spans differ, the
position form it equals when both sides tokenize alike, the text each pair has read on real tokenizers, the loss on
the pairs, the ledger's share of them, and the config key with its identity."""

from __future__ import annotations

import itertools

import pytest
import torch

from kdbench.config.plan import cell_id_of, config_dict
from kdbench.config.schema import CellConfig
from kdbench.data.tokenizers import ByteTokenizer, byte_spans, token_lengths, train_bpe
from kdbench.distill.lm.uld import (
    byte_alignment,
    first_sequences,
    matched_share,
    next_token_offsets,
    uld_alignment,
    uld_loss,
    uld_rows,
)

TEXT = b"def f(x):\n    return x + 1\n" * 40


@pytest.fixture(scope="module")
def bpe():
    pytest.importorskip("tokenizers")
    return train_bpe([TEXT], 300, name="bpe:300")


def _side(ids: list[list[int]], lengths: list[int], prompt: int = 0, width: int | None = None):
    """ids, next-token labels (the first ``prompt`` positions and the padding -100) and byte offsets, (B, width)."""
    width = width or max(map(len, ids))
    x = torch.zeros((len(ids), width), dtype=torch.long)
    y = torch.full((len(ids), width), -100, dtype=torch.long)
    for b, row in enumerate(ids):
        x[b, : len(row)] = torch.tensor(row)
        y[b, : len(row) - 1] = torch.tensor(row[1:])
        y[b, :prompt] = -100
    return x, y, next_token_offsets(x, torch.tensor(lengths))


def test_the_hand_example_pairs_the_positions_that_have_read_the_same_bytes():
    # "abcde": the teacher reads a|b|c|d|e (bytes), the student ab|c|de.  Student position 0 has read "ab" and
    # predicts "c": the teacher's position 1 has read "ab" too.  Student 1 has read "abc": teacher 2.  Student 2
    # (the last token) predicts nothing.  By position the student's 0 and 1 would take the teacher's 0 and 1, which
    # have read "a" and "ab".
    t_labels, t_off = torch.tensor([[98, 99, 100, 101, -100]]), torch.tensor([[1, 2, 3, 4, 5]])
    s_labels, s_off = torch.tensor([[7, 8, -100]]), torch.tensor([[2, 3, 5]])
    a = byte_alignment(s_labels, t_labels, s_off, t_off)
    assert a.student.tolist() == [0, 1] and a.teacher.tolist() == [1, 2] and a.sequence.tolist() == [0, 0]
    assert a.weight.tolist() == [0.5, 0.5] and a.weight.dtype == torch.float64
    assert matched_share(a, s_labels) == 1.0
    p = uld_alignment(s_labels, t_labels)
    assert p.student.tolist() == [0, 1] and p.teacher.tolist() == [0, 1]
    # the other way round (a byte student of a BPE teacher): the student's positions inside a teacher token pair
    # with nothing, and are counted out
    r = byte_alignment(t_labels, s_labels, t_off, s_off)
    assert r.student.tolist() == [1, 2] and r.teacher.tolist() == [0, 1] and r.weight.tolist() == [0.5, 0.5]
    assert matched_share(r, t_labels) == 0.5


def test_two_sequences_with_prompts_padding_and_an_unmatched_one_by_hand():
    # flat rows: the student's (2, 4), the teacher's (2, 5); lengths: id 1 is 2 bytes, every other id 1 byte
    lengths = [1, 2, 1, 1]
    _s_x, s_y, s_off = _side([[1, 2, 1, 3], [0, 3, 1]], lengths, prompt=1)  # offsets [2,3,5,6], [1,2,4,5]
    _t_x, t_y, t_off = _side([[0, 0, 0, 0, 0], [3, 3, 3, 3, 3]], lengths, prompt=2)  # offsets 1..5 each
    assert s_off.tolist() == [[2, 3, 5, 6], [1, 2, 4, 5]] and t_off[0].tolist() == [1, 2, 3, 4, 5]
    # counted: student (0,1) off 3, (0,2) off 5; (1,1) off 2; teacher rows 2, 3 (off 3, 4) and 7, 8 (off 3, 4)
    a = byte_alignment(s_y, t_y, s_off, t_off)
    assert a.student.tolist() == [1] and a.teacher.tolist() == [2] and a.sequence.tolist() == [0]
    assert a.weight.tolist() == [1.0]  # one pair in the one sequence that has one
    assert matched_share(a, s_y) == pytest.approx(1 / 3)


def test_two_identical_tokenizations_give_the_position_form_exactly(bpe):
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(TEXT) - 200, (3,), generator=g).tolist()
    ids = [bpe.encode(TEXT[s : s + 50 + 30 * i]) for i, s in enumerate(starts)]  # of other lengths: padded
    _x, y, off = _side(ids, token_lengths(bpe), prompt=3)
    a, p = byte_alignment(y, y.clone(), off, off.clone()), uld_alignment(y, y.clone())
    for name in ("student", "teacher", "weight", "sequence"):
        assert torch.equal(getattr(a, name), getattr(p, name)), name
    assert matched_share(a, y) == 1.0


def test_on_real_tokenizers_each_pair_has_read_the_same_text_and_a_byte_teacher_pairs_every_student_position(bpe):
    windows = [TEXT[7:120], TEXT[300:380]]
    s_ids = [bpe.encode(w) for w in windows]
    t_ids = [ByteTokenizer().encode(w) for w in windows]
    assert any(len(s) < len(t) for s, t in zip(s_ids, t_ids))  # the BPE merges: its positions run ahead
    s_x, s_y, s_off = _side(s_ids, token_lengths(bpe))
    t_x, t_y, t_off = _side(t_ids, token_lengths(ByteTokenizer()))
    a = byte_alignment(s_y, t_y, s_off, t_off)
    assert matched_share(a, s_y) == 1.0  # every BPE boundary is a byte boundary
    s_w, t_w = s_x.shape[1], t_x.shape[1]
    for s, t in zip(a.student.tolist(), a.teacher.tolist()):
        b = s // s_w
        assert t // t_w == b
        read_s = bpe.decode(s_ids[b][: s % s_w + 1])
        read_t = bytes(t_ids[b][: t % t_w + 1])
        assert read_s == read_t  # the same text read: the tokens they predict start at one byte
    p = uld_alignment(s_y, t_y)
    assert not torch.equal(p.teacher, a.teacher)  # by position the teacher's rows lag behind the text


def test_byte_spans_place_each_token_on_the_text_it_decodes_to(bpe):
    ids = bpe.encode(b"    return x + 1\n")
    spans = byte_spans(bpe, ids)
    assert spans[0][0] == 0 and spans[-1][1] == len(b"    return x + 1\n")
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # contiguous
    text = bpe.decode(ids)
    assert [text[s:e] for s, e in spans] == [bpe.decode([i]) for i in ids]
    assert byte_spans(ByteTokenizer(), list(b"abc")) == [(0, 1), (1, 2), (2, 3)]


def test_uld_loss_on_the_byte_pairs_is_the_weighted_l1_of_those_rows():
    g = torch.Generator().manual_seed(1)
    s_logits = torch.randn(1, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    t_logits = torch.randn(1, 5, 4, generator=g, dtype=torch.float64)
    t_labels, t_off = torch.tensor([[1, 2, 3, 0, -100]]), torch.tensor([[1, 2, 3, 4, 5]])
    s_labels, s_off = torch.tensor([[5, 6, -100]]), torch.tensor([[2, 3, 5]])
    a = byte_alignment(s_labels, t_labels, s_off, t_off)
    got = uld_loss(s_logits, t_logits, s_labels, t_labels, alignment=a)
    want = uld_rows(s_logits[0, [0, 1]], t_logits[0, [1, 2]]).mean()
    torch.testing.assert_close(got, want, rtol=1e-15, atol=1e-15)
    by_position = uld_loss(s_logits, t_logits, s_labels, t_labels)
    assert not torch.isclose(got, by_position)


def test_the_ledger_cut_to_the_first_sequences_weighs_them_as_a_batch_of_their_own():
    g = torch.Generator().manual_seed(2)
    labels = torch.randint(0, 9, (3, 6), generator=g)
    labels[0, :2], labels[2, 4:] = -100, -100
    t_labels = torch.randint(0, 9, (3, 8), generator=g)
    t_labels[1, :5] = -100
    full = uld_alignment(labels, t_labels)
    for k in (1, 2, 3):
        cut, want = first_sequences(full, k), uld_alignment(labels[:k], t_labels[:k])
        for name in ("student", "teacher", "weight", "sequence"):
            assert torch.equal(getattr(cut, name), getattr(want, name)), (k, name)


def _uld_cell(**uld) -> CellConfig:
    return CellConfig.model_validate(
        {
            "pair": {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
            "method": "uld",
            "data": {"kind": "tokens", "seq_len": 32, "tokenizers": {"teacher": "bytes", "student": "bpe:1024"}},
            **({"uld": uld} if uld else {}),
        }
    )


def test_the_alignment_is_a_uld_key_whose_default_keeps_the_cells_ids():
    plain, position, by_bytes = _uld_cell(), _uld_cell(alignment="position"), _uld_cell(alignment="bytes")
    assert plain.uld.alignment == "position"
    assert cell_id_of(plain) == cell_id_of(position) and "alignment" not in config_dict(plain)["uld"]
    assert cell_id_of(by_bytes) != cell_id_of(plain) and config_dict(by_bytes)["uld"]["alignment"] == "bytes"
    with pytest.raises(ValueError, match="'position' or 'bytes'"):
        _uld_cell(alignment="words")
