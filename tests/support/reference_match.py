"""Checks that a kdbench model is the reference code's network: the same parameters, FLOPs, outputs and stage
features (tests/unit/models/test_cifar_zoo.py and tests/unit/models/test_cifar_mobile.py, each with its trimmed
reference code)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from kdbench.distill.hooks import FeatureTap
from kdbench.models import count_params


def flops(model: nn.Module, x: torch.Tensor) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x)
    return counter.get_total_flops()


def assert_matches_reference(
    ours: nn.Module, ref: nn.Module, params: int, features: slice, feature_shapes: Sequence[tuple[int, ...]]
) -> None:
    """Parameters equal (and equal to ``params``), FLOPs within 1 %, logits of shape (2, 100), and the stage
    outputs shaped as the reference's ``is_feat=True`` features ``features``."""
    assert count_params(ours) == count_params(ref) == params
    x = torch.randn(2, 3, 32, 32)
    ratio = flops(ours, x) / flops(ref, x)
    assert ratio == pytest.approx(1.0, rel=0.01), ratio
    tap = FeatureTap(ours, list(ours.stage_names))
    with torch.no_grad():
        out = ours(x)
        ref_feats, ref_out = ref(x, is_feat=True)
    assert out.shape == ref_out.shape == (2, 100)
    ours_shapes = [tuple(t.shape[1:]) for t in tap.take()]
    ref_shapes = [tuple(t.shape[1:]) for t in ref_feats[features]]
    assert ours_shapes == ref_shapes == list(feature_shapes)
    tap.remove()


def load_randomised_reference(ours: nn.Module, ref: nn.Module) -> None:
    """The reference's parameters and batch-norm statistics randomised (not only the init's ones and zeros),
    then copied into ``ours`` tensor by tensor, in order: equal outputs then mean the same layers, wiring and
    channel order."""
    ref_state, our_state = ref.state_dict(), ours.state_dict()
    assert [t.shape for t in ref_state.values()] == [t.shape for t in our_state.values()]
    for param in ref.parameters():
        nn.init.normal_(param, 0, 0.05)
    for name, buf in ref.named_buffers():
        if name.endswith("running_mean"):
            nn.init.normal_(buf, 0, 0.1)
        elif name.endswith("running_var"):
            nn.init.uniform_(buf, 0.5, 1.5)
    ours.load_state_dict(dict(zip(our_state, ref.state_dict().values())))


def reference_pair(name: str, references: dict) -> tuple[nn.Module, nn.Module]:
    """kdbench's ``name`` and its reference (``references[name]``: the builder and its feature slice), both at 100
    classes, in eval mode."""
    from kdbench.models import build_model

    builder, _ = references[name]
    return build_model(name, 100, (3, 32, 32)).eval(), builder(num_classes=100).eval()
