"""The one factory of the suites the tests run: :func:`tiny_suite`.

A test that runs a suite states only what its test is about; the rest comes from one base fragment, :data:`BASE`
(optimum-benchmark composes its test configs the same way from ``_base_.yaml`` fragments): a one-thread CPU suite
of one linear -> linear cell on 1x4x4 inputs, timed for three iterations, its student served at batch size 1.  That
is the cheapest cell the engine runs end to end, so a test that needs more says so (a resnet, a longer timed window,
the teacher's inference off) and a reader sees it beside the assertions that depend on it.  A fragment of settings
several tests share (:data:`RESNET8`, :data:`TINY_LM`) is a plain mapping to spread into ``defaults``, or to lay the
test's own settings on with :func:`merged` (``defaults=merged(TINY_LM, {"inference": {"batch_sizes": []}})``).

The overrides are deep-merged over the base: a nested mapping merges key by key (``defaults={"timing":
{"min_time_s": 0.3}}`` keeps the base's warmup and min_iters), anything else replaces.  ``pair`` and ``data``
replace as a whole, as :func:`kdbench.config.plan.deep_merge` treats a pair: a teacher goes with its student, and
a data section's keys belong to its kind (token data has no image shape to inherit).  ``overrides`` replaces too: a
model's overrides belong to its model, so a test that names another student (or the untrimmed pair, ``{}``) does not
inherit the fragment's trimmed layers for it.
"""

from __future__ import annotations

import copy
from typing import Any

BASE: dict[str, Any] = {
    "name": "tiny",
    "backend": "cpu",
    "threads": 1,
    "defaults": {
        "pair": {"teacher": "linear", "student": "linear"},
        "batch_size": 4,
        "data": {"kind": "synthetic", "shape": [1, 4, 4], "num_classes": 4},
        "timing": {"warmup": 0, "min_iters": 3, "min_time_s": 0.0},
        "inference": {"batch_sizes": [1]},
    },
}

# resnet8 -> resnet8 on 3x16x16 images of 10 classes: the smallest pair with convolutions, batch norm and a residual
# (what tests/support/helpers.make_config builds)
RESNET8: dict[str, Any] = {
    "pair": {"teacher": "resnet8", "student": "resnet8"},
    "data": {"kind": "synthetic", "shape": [3, 16, 16], "num_classes": 10},
}

# tiny-llama-teacher -> tiny-llama-student trimmed to 2 and 1 decoder layers, distilled by forward KL on 2 x 16
# random tokens, two timed steps: the cheapest LM cell (token data, a vocabulary-wide loss, a KV cache to decode from
# when the base's batch size 1 is served).  The decode length is left at the schema's: a test that decodes says how
# many tokens.
TINY_LM: dict[str, Any] = {
    "pair": {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
    "overrides": {"teacher": {"num_hidden_layers": 2}, "student": {"num_hidden_layers": 1}},
    "method": "forward_kl",
    "batch_size": 2,
    "data": {"kind": "tokens", "seq_len": 16},
    "timing": {"min_iters": 2},
}

WHOLE = frozenset({"pair", "overrides", "data"})  # keys whose mapping replaces the base's instead of merging into it


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` laid on ``base`` (neither changed): nested mappings merge key by key, except :data:`WHOLE`'s and
    anything that is not a mapping on both sides, which replace."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key not in WHOLE:
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def tiny_suite(**overrides: Any) -> dict[str, Any]:
    """A suite as a mapping: :data:`BASE` with ``overrides`` (top-level suite keys: ``name``, ``defaults``,
    ``matrix``, ``quality``, ...) deep-merged over it; :func:`tests.support.helpers.write_suite` writes it for
    ``kdbench run``."""
    return merged(BASE, overrides)
