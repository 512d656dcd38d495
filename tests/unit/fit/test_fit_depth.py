"""A deep LM pair's prediction extrapolated from fake runs of a few layers (kdbench.fit.depth) equals the run of
every layer: the peak, its phase and what it holds, each phase's peak, and the census, record by record."""

from __future__ import annotations

import pytest

from kdbench.config.schema import CellConfig
from kdbench.fit import depth
from kdbench.fit.depth import MIN_LAYERS, at_depth, depths
from kdbench.fit.planner import predict
from kdbench.models.lm import model_config
from kdbench.models.lm import uniform_layers as uniform

pytestmark = pytest.mark.usefixtures("one_thread")
PAIR = {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"}


def lm(teacher_layers: int = 18, student_layers: int = 12, **over) -> CellConfig:
    base = {
        "pair": PAIR,
        "method": "forward_kl",
        "batch_size": 2,
        "data": {"kind": "tokens", "seq_len": 64},
        "overrides": {
            "teacher": {"num_hidden_layers": teacher_layers},
            "student": {"num_hidden_layers": student_layers},
        },
    }
    return CellConfig.model_validate(base | over)


def census(p) -> dict:
    return {
        (r.op, r.cls, r.phase, r.dtype): (r.flops, r.read, r.written, r.launches, r.fresh) for r in p.census.records
    }


def assert_same(extrapolated, full) -> None:
    assert extrapolated.ok and full.ok, (extrapolated.error, full.error)
    assert extrapolated.notes[-1].startswith("extrapolated in depth to"), extrapolated.notes
    got = (extrapolated.peak_bytes, extrapolated.phase, extrapolated.breakdown, extrapolated.logits_bytes)
    assert got == (full.peak_bytes, full.phase, full.breakdown, full.logits_bytes)
    assert {p: b for p, (b, _) in extrapolated.phase_peaks.items()} == {
        p: b for p, (b, _) in full.phase_peaks.items() if p in extrapolated.phase_peaks
    }
    assert census(extrapolated) == census(full)
    assert (extrapolated.host_bytes, extrapolated.host) == (full.host_bytes, full.host)
    assert extrapolated.meter is None


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"loss_impl": "chunked", "chunk_size": 32},
        {"teacher": {"mode": "topk_cache", "k": 16}},
        {"method": "jsd"},
        # the generation's prefill and each decode step a segment of its phase, one pass through the stack each
        {"method": "jsd", "on_policy": {"new_tokens": 16}},
    ],
    ids=["dense", "chunked", "topk-cache", "jsd", "on-policy"],
)
def test_a_deep_pair_extrapolated_in_depth_equals_the_run_of_every_layer(over):
    config = lm(**over)
    assert depths(config) == (18, 12)
    device = "cuda" if not over else "cpu"  # a GPU target's operator choices (foreach, autocast's lists) once
    assert_same(predict(config, device), predict(config, device, depth=False, phase_peaks=True))


def test_the_calls_written_down_are_extrapolated_with_their_counts():
    config = lm()
    extrapolated, full = predict(config, "cpu", shapes=True), predict(config, "cpu", shapes=True, depth=False)
    calls = {(r.op, r.phase): dict(r.shapes) for r in full.census.records if r.shapes}
    assert calls and {(r.op, r.phase): dict(r.shapes) for r in extrapolated.census.records if r.shapes} == calls


def test_a_phase_whose_peak_moves_from_its_start_to_its_end_with_depth_is_predicted_where_it_moves():
    """Short sequences and a chunked loss: the backward's peak is at its start (every activation, no gradient) up
    to a few layers and at its end (every gradient) at 24: the peak of a phase is no line in depth, the peaks of
    its head, neck and tail are."""
    student = {"hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4, "num_key_value_heads": 2}

    def cell(layers: int) -> CellConfig:
        return lm(
            6,
            layers,
            loss_impl="chunked",
            chunk_size=32,
            batch_size=1,
            data={"kind": "tokens", "seq_len": 128},
            overrides={"teacher": {"num_hidden_layers": 6}, "student": {"num_hidden_layers": layers, **student}},
        )

    def at_start(p) -> bool:
        held = p.phase_peaks["backward"][1]
        return held["activations"] > held["gradients"]

    assert at_start(predict(cell(4), "cpu", depth=False, phase_peaks=True))
    full = predict(cell(24), "cpu", depth=False, phase_peaks=True)
    assert not at_start(full)
    assert_same(predict(cell(24), "cpu"), full)


def test_runs_that_are_not_linear_in_depth_fall_back_to_every_layer(monkeypatch):
    config = lm()
    monkeypatch.setattr(depth, "misses", lambda runs: ("the tail does not line up", {}))
    got, full = predict(config, "cpu"), predict(config, "cpu", depth=False)
    assert got.notes[-1] == "every layer run: its runs of 2-4 layers were not linear (the tail does not line up)"
    assert (got.peak_bytes, got.breakdown, census(got)) == (full.peak_bytes, full.breakdown, census(full))


def test_which_cells_are_extrapolated(monkeypatch):
    assert depths(lm()) == (18, 12)
    assert depths(lm(10, 10)) is None and MIN_LAYERS > 10 + 10  # four small runs would cost what one does
    assert depths(lm(world_size=2, parallel="ddp")) is None  # DDP's buckets are counted from the whole model
    assert depths(lm(on_policy={"new_tokens": 8})) == (18, 12)  # each decode step a segment: one pass
    vision = CellConfig.model_validate({"pair": {"teacher": "resnet56", "student": "resnet20"}, "method": "kd"})
    assert depths(vision) is None
    monkeypatch.setenv("KDBENCH_FIT_DEPTH", "0")
    assert depths(lm()) is None


def test_only_a_stack_of_alike_layers_is_uniform():
    assert uniform(model_config("qwen2.5-0.5b", {}))
    assert uniform(model_config("gpt2", {}))
    # sliding-window attention from layer 4 on: the layers differ, listed in layer_types
    mixed = model_config("qwen2.5-0.5b", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 4})
    assert len(set(mixed.layer_types)) == 2 and not uniform(mixed)


def test_a_cut_config_has_the_layers_asked_whatever_the_override_was_called():
    config = lm(pair={"teacher": "gpt2", "student": "tiny-llama-student"}, overrides={"teacher": {"n_layer": 6}})
    cut = at_depth(config, 3, 2)
    assert cut.overrides.teacher == {"num_hidden_layers": 3} and cut.overrides.student == {"num_hidden_layers": 2}
    assert model_config("gpt2", cut.overrides.teacher).num_hidden_layers == 3
