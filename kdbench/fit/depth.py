"""A deep LM pair's prediction from fake runs of a few layers: the planner's answer for a Llama-8B cell in about
two thirds of the time, the same to the byte.

A fake run's cost is one Python dispatch per operator, and a decoder stack runs the same operators in every layer
(about 0.05 s a layer on the 2-core CI machine type, against 0.2 s for the rest: the embeddings, the head, the loss,
the batch): Llama-3.1-8B into Llama-3.2-1B's 48 layers are most of its 2.7 s.  Where a stack's layers are alike,
every figure of a fake run but one is linear in the two stacks' depths: the census's every record (FLOPs, bytes,
launches) and written-down call, and the bytes live at any birth of a storage that does not move as the stacks
deepen (the layers' parameters, gradients, optimizer state, saved activations are so many bytes a layer).  The one
that is not is a phase's peak: the largest of several such moments, one of which may overtake another as the stacks
deepen (Qwen2.5-0.5B's backward peaks at its end, every gradient held, up to a few layers, and at its start, every
activation held, at 24).  So each phase is cut into windows that line up between depths (:func:`windows`: what
every run does before the stack and two layers more, then two layers, then what every run does last), whose peaks
are each linear, and between which the layers only repeat the neck's last, shifted by what a layer leaves: the
phase's peak is the largest of its windows' at any depth.

:func:`by_depth` runs the cell with its teacher and student cut to (2, 2), (3, 2) and (2, 3) layers (a config
override of ``num_hidden_layers``: the same models otherwise), which give each figure's constant and its two
slopes, and once more at (4, 4), where every figure must equal the line's exactly, or the cell is run with every
layer (its notes say why).

An on-policy generation passes through the student's stack once for the prompt and once a decode step: the meter
cuts its phase into segments, each one pass (:attr:`kdbench.fit.tracker.LiveBytes.segment`, set by
:func:`kdbench.fit.decode.short_decode`), each windowed on its own, and a phase's peak is the largest of its
segments'.  The (4, 4) run must also hold each phase's peak in one of its windows.

:func:`depths` says which cells: a language-model pair on one device (DDP's gradient buckets and FSDP2's shards are
counted from the whole model), both models built from transformers configs of alike layers (the workload's
``layer_stacks``: :func:`kdbench.models.lm.uniform_layers`, an architecture of alike layers whose every per-layer
list in the config holds one value: Qwen2's and Mistral's sliding-window layers are listed there), and at least
:data:`MIN_LAYERS` layers in all, below which the four runs cost what the full one does.  ``KDBENCH_FIT_DEPTH=0``
runs every layer of every cell.  The reference, every layer run, is ``predict(..., depth=False)``; the tests hold
the two equal.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

from kdbench.config.schema import CellConfig
from kdbench.fit.tracker import phase_of
from kdbench.models.config_checks import OTHER_NAMES

ENV = "KDBENCH_FIT_DEPTH"
# Below this many layers in the pair every layer is run: the four runs' fixed part (about 0.2 s each on the CI
# machine type) and their 22 layers cost about what a 30-layer pair's one run does.
MIN_LAYERS = 30
BASE = ((2, 2), (3, 2), (2, 3))  # (teacher layers, student layers) of the runs the line is drawn through
CHECK = (4, 4)  # the run the line must meet exactly
_KEYS = ("flops", "read", "written", "launches", "fresh")
# a config's depth under any of its names (the config checks' aliases: GPT-2's n_layer, ...), replaced by a cut
LAYER_FIELDS = ("num_hidden_layers", *(k for k, v in OTHER_NAMES.items() if v == "num_hidden_layers"))


def depths(config: CellConfig) -> tuple[int, int] | None:
    """The teacher's and the student's layer counts where ``config``'s prediction can be extrapolated in depth
    (module docstring), else None."""
    if os.environ.get(ENV, "").strip() == "0" or config.world_size != 1:
        return None
    from kdbench.workloads.registry import workload_of

    layers = workload_of(config).layer_stacks(config)
    return layers if layers is not None and sum(layers) >= MIN_LAYERS else None


def at_depth(config: CellConfig, teacher: int, student: int) -> CellConfig:
    """``config`` with its teacher cut to ``teacher`` layers and its student to ``student`` (the overrides'
    ``num_hidden_layers``; an override of it under another name replaced)."""
    overrides = {}
    for role, layers in (("teacher", teacher), ("student", student)):
        own = {k: v for k, v in getattr(config.overrides, role).items() if k not in LAYER_FIELDS}
        overrides[role] = {**own, "num_hidden_layers": layers}
    return config.model_copy(update={"overrides": config.overrides.model_copy(update=overrides)})


def by_depth(
    predict: Any,
    config: CellConfig,
    device_type: str,
    allow_imports: bool,
    layers: tuple[int, int],
    decode_steps: int | None,
    shapes: bool,
) -> Any:
    """``config``'s :class:`~kdbench.fit.planner.Prediction` at ``layers`` (teacher, student), extrapolated from
    fake runs of a few layers (module docstring) made by ``predict`` (:func:`kdbench.fit.planner.predict`); with
    every layer run where those runs are not linear."""
    from kdbench.workloads.registry import workload_of

    start = time.perf_counter()
    runs = {}
    for lt, ls in (*BASE, CHECK):
        p = predict(
            at_depth(config, lt, ls), device_type, allow_imports, decode_steps, shapes=shapes, depth=False,
            phase_peaks=True,
        )  # fmt: skip
        if not p.ok or not p.phase_peaks:  # unpredictable: the cell's own run says why, at its own size
            return predict(config, device_type, allow_imports, decode_steps, shapes=shapes, depth=False)
        runs[(lt, ls)] = p
    why, where = misses(runs)
    if not why:
        try:
            out = line_at(runs, where, *layers)
        except ValueError as exc:
            why = str(exc)
    if why:
        full = predict(config, device_type, allow_imports, decode_steps, shapes=shapes, depth=False)
        few = f"{BASE[0][0]}-{CHECK[0]}"
        return replace(full, notes=(*full.notes, f"every layer run: its runs of {few} layers were not linear ({why})"))
    host = workload_of(config).host_footprint(config, device_type)
    low, high = BASE[0][0], BASE[1][0]
    note = (
        f"extrapolated in depth to {layers[0]} + {layers[1]} layers from fake runs of {low}-{high} layers"
        f" (met exactly at {CHECK[0]} + {CHECK[1]})"
    )
    return replace(
        out,
        host_bytes=None if host.unknown else host.rank_bytes(True),
        host=host.summary(config.world_size),
        seconds=time.perf_counter() - start,
        notes=(*out.notes, note),
    )


def windows(runs: dict) -> dict[str, dict[str, dict[tuple[int, int], tuple[int, int]]]] | str:
    """Where each phase's peak can fall, lined up between the runs: phase -> window -> run -> (first, end) of its
    births (the meters' trajectories); or why the runs do not line up.  A phase whose births do not grow with depth
    is one window, ``all``.  A phase that runs one stack (ℓ births a layer, the same in every run) is three: its
    ``head`` (what every run does before the stack, up to two layers before the runs part), its ``neck`` (the next
    two layers) and its ``tail`` (what every run does last, two layers and more).  The layers between neck and tail
    are the neck's last layer again, each shifted by what a layer leaves behind: their peaks rise or fall steadily
    from one end to the other, so the phase's peak is in one of the three windows, at any depth."""
    order = list(runs)
    tracks = {at: runs[at].meter.trajectory for at in order}
    phases = list(tracks[CHECK])
    if any(list(t) != phases for t in tracks.values()):
        return "their phases differ"
    out: dict[str, dict[str, dict[tuple[int, int], tuple[int, int]]]] = {}
    for phase in phases:
        seqs = {at: [ident for ident, _, _ in tracks[at][phase]] for at in order}  # (operator, bytes) of each birth
        n = {at: len(s) for at, s in seqs.items()}
        (t0, s0), (t1, _), (_, s1) = BASE
        per_t, per_s = n[BASE[1]] - n[BASE[0]], n[BASE[2]] - n[BASE[0]]
        grown = n[BASE[0]] + per_t * (CHECK[0] - t0) // (t1 - t0) + per_s * (CHECK[1] - s0) // (s1 - s0)
        if n[CHECK] != grown:
            return f"the {phase} phase's births are not linear in depth"
        if per_t and per_s:
            return f"the {phase} phase runs both stacks"
        if not per_t and not per_s:  # the same operators at every depth; their bytes may grow (lines, checked)
            if any([op for op, _ in s] != [op for op, _ in seqs[CHECK]] for s in seqs.values()):
                return f"the {phase} phase differs between depths"
            out[phase] = {"all": {at: (0, n[at]) for at in order}}
            continue
        layer = per_t or per_s
        head = _common(list(seqs.values())) - 2 * layer
        tail = _common([s[::-1] for s in seqs.values()])
        if head < 0 or tail < 2 * layer:
            return f"the {phase} phase's layers do not line up"
        out[phase] = {
            "head": {at: (0, head) for at in order},
            "neck": {at: (head, head + 2 * layer) for at in order},
            "tail": {at: (n[at] - tail, n[at]) for at in order},
        }
    return out


def _common(seqs: list[list]) -> int:
    """The length of the longest prefix ``seqs`` share."""
    first, n = seqs[0], min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != first[i] for s in seqs[1:]):
            return i
    return n


def figures(p: Any, where: dict | None = None, at: tuple[int, int] | None = None) -> dict[tuple, int]:
    """Every figure of a prediction that grows with depth, by a key: the peak of each phase's window (``where``,
    :func:`windows`, for the run ``at``) and its bytes by kind at that moment, each census record's counts and each
    of its calls' count, the logits' and the collectives' bytes."""
    out: dict[tuple, int] = {("comm",): p.comm_bytes}
    if p.logits_bytes is not None:
        out[("logits",)] = p.logits_bytes
    for phase, spans in (where or {}).items():
        births = p.meter.trajectory[phase]
        for name, per_run in spans.items():
            first, end = per_run[at]
            if end <= first:
                continue
            top = max(range(first, end), key=lambda i: (births[i][1], -i))  # the first of the largest
            out[("window", phase, name)] = births[top][1]
            kinds = p.meter.breakdown_at(births[top][2])
            out.update({("kind", phase, name, k): v for k, v in kinds.items()})
    for r in p.census.records if p.census is not None else ():
        key = (r.op, r.cls, r.phase, r.dtype)
        out.update({("record", *key, f): getattr(r, f) for f in _KEYS})
        out.update({("call", *key, sig): n for sig, n in r.shapes})
    return out


def _line(runs: dict, where: dict, teacher: int, student: int) -> dict[tuple, int]:
    base, deeper_t, deeper_s = (figures(runs[at], where, at) for at in BASE)
    keys = dict.fromkeys([*base, *deeper_t, *deeper_s])
    t = (teacher - BASE[0][0]) // (BASE[1][0] - BASE[0][0])  # layers beyond the first run's, a layer a step
    s = (student - BASE[0][1]) // (BASE[2][1] - BASE[0][1])
    return {
        k: base.get(k, 0) + (deeper_t.get(k, 0) - base.get(k, 0)) * t + (deeper_s.get(k, 0) - base.get(k, 0)) * s
        for k in keys
    }


def _shape(p: Any) -> tuple:
    """What must not change with depth: whether the loss counts logits, the census's ranks, the notes."""
    ranks = p.census.world_size if p.census is not None else None
    return (p.logits_bytes is None, ranks, p.notes)


def misses(runs: dict) -> tuple[str, dict]:
    """Why the runs at :data:`BASE` do not draw a line the run at :data:`CHECK` meets exactly ("" where they do),
    and the phases' windows (:func:`windows`)."""
    if len({_shape(p) for p in runs.values()}) > 1:
        return "their logits, ranks or notes differ", {}
    if any(p.comm_bytes for p in runs.values()):
        return "collectives", {}
    where = windows(runs)
    if isinstance(where, str):
        return where, {}
    check = runs[CHECK]
    for phase, (top, _) in check.phase_peaks.items():  # each phase's peak in one of its windows, at least here
        tops = [
            check.meter.trajectory[key][i][1]
            for key, spans in where.items()
            if phase_of(key) == phase
            for first, end in (per_run[CHECK] for per_run in spans.values())
            for i in range(first, end)
        ]
        if tops and max(tops) != top:
            return f"the {phase} phase's peak ({top:,}) is in none of its windows ({max(tops):,})", {}
    got, line = figures(check, where, CHECK), _line(runs, where, *CHECK)
    for key in dict.fromkeys([*got, *line]):
        if got.get(key, 0) != line.get(key, 0):
            what = " ".join(map(str, key))
            return (
                f"{what}: {got.get(key, 0):,} at {CHECK[0]} + {CHECK[1]} layers, {line.get(key, 0):,} on the line",
                {},
            )
    return "", where


def line_at(runs: dict, where: dict, teacher: int, student: int) -> Any:
    """The prediction at ``teacher`` and ``student`` layers on the line through the runs at :data:`BASE`: each
    phase's peak the largest of its windows', the step's the largest of the phases' (the first, as the meter
    takes it)."""
    from kdbench.fit.census import Census, Record

    if min(teacher, student) < BASE[0][0]:
        raise ValueError(f"depths {teacher}, {student}: the line is drawn from {BASE[0][0]} layers a stack")
    values = _line(runs, where, teacher, student)
    if any(v < 0 for v in values.values()):  # a figure that shrinks with depth: the line does not hold there
        raise ValueError("a figure is negative on the line")
    model = runs[CHECK]
    phases: dict[str, tuple[int, dict[str, int]]] = {}
    for key, spans in where.items():  # a phase, or a segment of one (LiveBytes.segment): in time order
        tops = [name for name in spans if ("window", key, name) in values]
        if not tops:
            continue
        name = max(tops, key=lambda w: values[("window", key, w)])  # the first of the largest, in time order
        kinds = {k[3]: v for k, v in values.items() if k[0] == "kind" and k[1:3] == (key, name)}
        phase = phase_of(key)
        if phase not in phases or values[("window", key, name)] > phases[phase][0]:
            phases[phase] = (values[("window", key, name)], kinds)
    peak_phase = max(phases, key=lambda ph: phases[ph][0])
    calls: dict[tuple, list[tuple[str, int]]] = {}
    for k, n in values.items():
        if k[0] == "call" and n > 0:
            calls.setdefault(k[1:5], []).append((k[5], n))
    seen = [{(r.op, r.cls, r.phase, r.dtype) for r in runs[at].census.records} for at in BASE]
    records = []
    every = (r for at in (CHECK, *BASE) for r in runs[at].census.records)
    for key in dict.fromkeys((r.op, r.cls, r.phase, r.dtype) for r in every):
        counts = [values.get(("record", *key, f), 0) for f in _KEYS]
        if any(counts) or key in calls or all(key in s for s in seen):  # a record of views counts nothing
            records.append(Record(*key, *counts, shapes=tuple(calls.get(key, ()))))
    return replace(
        model,
        peak_bytes=phases[peak_phase][0],
        phase=peak_phase,
        breakdown=dict(phases[peak_phase][1]),
        logits_bytes=values.get(("logits",)),
        comm_bytes=values[("comm",)],
        census=Census(tuple(records), model.census.world_size),
        phase_peaks=phases,
        meter=None,
    )
