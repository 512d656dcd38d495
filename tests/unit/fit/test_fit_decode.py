"""The fit planner's on-policy generation: a few decode steps run on fake tensors, the rest extrapolated
(kdbench.fit.decode), give the full loop's peak, live bytes and operator census to the byte, and a loop whose
steps do not grow linearly is run in full."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kdbench.config.schema import CellConfig
from kdbench.fit.census import CensusMode
from kdbench.fit.decode import DECODE_STEPS, short_decode
from kdbench.fit.planner import predict
from kdbench.fit.tracker import LiveBytes
from kdbench.models import generation
from kdbench.models.lm import make_lm

pytestmark = pytest.mark.usefixtures("one_thread")
NEW_TOKENS = 24


def _generate(decode_steps: int | None, cache: str) -> tuple[int, int, dict, str]:
    """tiny-llama-student samples NEW_TOKENS tokens after a (2, 24) prompt on fake tensors: the meter's peak and
    the live bytes after, the census, and what short_decode says."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    tracker = LiveBytes()
    census = CensusMode(lambda: tracker.phase)
    census.on = True
    with FakeTensorMode(allow_non_fake_inputs=True), tracker, census:
        lm = make_lm("tiny-llama-student", {}, False).eval()
        tracker.phase = "generate"
        prompt = torch.zeros(2, 24, dtype=torch.long)
        generator = torch.Generator().manual_seed(0)
        with short_decode(tracker, census, decode_steps) as done, torch.no_grad():
            ids = generation.sample(
                lm, prompt, NEW_TOKENS, 1.0, generator, None, SimpleNamespace(cache=cache, compile=False), {}
            )
        assert ids.shape == (2, 24 + NEW_TOKENS)
        del ids
        return tracker.peak.bytes, tracker.live, census.census().summary(), done.note


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_short_decode_gives_the_full_loops_peak_and_census_to_the_byte(cache):
    short_peak, short_live, short_census, note = _generate(DECODE_STEPS, cache)
    full_peak, full_live, full_census, full_note = _generate(None, cache)
    assert short_peak == full_peak and short_live == full_live
    assert short_census == full_census
    said = f"on-policy generation extrapolated: {DECODE_STEPS} of {NEW_TOKENS - 1} decode steps run (1 generations)"
    assert note.startswith(said)
    assert full_note == ""


def test_steps_that_do_not_grow_linearly_are_all_run():
    class Quadratic:
        """A model whose t-th decode step keeps t² bytes: no line through three steps."""

        def __init__(self):
            self.kept = []

        def advance(self, token):
            self.kept.append(torch.empty(len(self.kept) ** 2 + 1, dtype=torch.uint8))
            return torch.zeros(1, 4)

    tracker = LiveBytes()
    census = CensusMode(lambda: tracker.phase)
    model = Quadratic()
    with tracker, census, short_decode(tracker, census) as done:
        tokens = generation.decode(model.advance, torch.zeros(1, 1, dtype=torch.long), 20, lambda x: x[:, :1].long())
    assert len(tokens) == 21 and len(model.kept) == 20
    assert done.ran == done.steps == 20 and "did not grow linearly" in done.note


def test_an_on_policy_prediction_says_it_was_extrapolated_and_matches_the_full_one():
    config = CellConfig.model_validate(
        {
            "pair": {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
            "method": "jsd",
            "batch_size": 2,
            "data": {"kind": "tokens", "seq_len": 64},
            "on_policy": {"new_tokens": 24},
        }
    )
    short, full = predict(config, "cuda"), predict(config, "cuda", decode_steps=None)
    assert short.peak_bytes == full.peak_bytes and short.breakdown == full.breakdown
    assert short.census.summary() == full.census.summary()
    said = "on-policy generation extrapolated: 8 of 46 decode steps run (2 generations)"  # one a fake step
    assert any(n.startswith(said) for n in short.notes)
