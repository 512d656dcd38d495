"""What a fit's fake run (:mod:`kdbench.fit`) knows of the values of its integer tensors.

Under ``FakeTensorMode`` a tensor has a shape and a dtype but no values, so an operator whose output shape
depends on values (``nonzero``: the tokens a loss counts) cannot run.  The few tensors whose values decide a
shape (the labels) are made for real by the planner, which hands their values along with the fake tensor
(:func:`with_values`); the code that reads them (:func:`kdbench.distill.lm.impls.chunks.valid_rows`) asks
:func:`known_values` first.  Outside a fit nothing carries values and nothing here changes.  Torch-free.
"""

from __future__ import annotations

from typing import Any

_VALUES = "_kdbench_fit_values"


def with_values(fake: Any, real: Any) -> Any:
    """``fake``, carrying ``real``: the values a fake tensor stands for (same shape)."""
    setattr(fake, _VALUES, real)
    return fake


def known_values(tensor: Any) -> Any | None:
    """The real values a fake tensor stands for; None for any other tensor."""
    return getattr(tensor, _VALUES, None)


def carry(fake: Any, make: Any) -> Any:
    """``fake``, carrying the values ``make()`` computes for real (outside the fake mode)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return with_values(fake, make())


def on_values(fake: Any, fn: Any) -> Any:
    """``fn`` of the real values ``fake`` carries, computed for real (outside the fake mode) and returned as a
    fake tensor of ``fake``'s mode that carries its own values."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        real = fn(known_values(fake))
    return with_values(fake.fake_mode.from_tensor(real), real)
