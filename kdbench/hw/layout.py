"""Memory layout controls: buffer alignment, classifier padding, memory format."""

from __future__ import annotations

import torch
from torch import nn

from kdbench.core import names
from kdbench.core.errors import KdbenchError

ALIGNMENTS = (64, 32, 16, 8, 4, 2)  # usual byte alignments swept by a suite
MAX_ALIGNMENT = 4096


def realised_alignment(ptr: int) -> int:
    """The largest power of two (at most 4096) dividing ``ptr``."""
    return MAX_ALIGNMENT if ptr == 0 else min(ptr & -ptr, MAX_ALIGNMENT)


def place_aligned(t: torch.Tensor, alignment: int) -> torch.Tensor:
    """A copy of ``t`` (same strides) whose data pointer is aligned to exactly ``alignment`` bytes.

    From 64 bytes up the address is a multiple of ``alignment``; below 64 it is an
    odd multiple of it (so not 64-aligned).  Alignments finer than the element size
    are impossible and give the finest one the dtype allows.
    """
    power_of_two = isinstance(alignment, int) and alignment > 0 and not alignment & (alignment - 1)
    if not power_of_two or alignment > MAX_ALIGNMENT:
        raise ValueError(f"alignment must be a power of two in 1..{MAX_ALIGNMENT}: {alignment!r}")
    itemsize = t.element_size()
    a = max(alignment, itemsize)
    # Dense strides in t's own dimension order (t's strides when t is already dense).
    stride = torch.empty_like(t, device="meta").stride()
    buf = torch.empty(t.numel() + 2 * a // itemsize, dtype=t.dtype, device=t.device)
    base = buf.data_ptr()
    target = -(-base // a) * a  # first multiple of a at or after base
    if a < 64 and target % (2 * a) == 0:
        target += a
    out = buf.as_strided(t.shape, stride, (target - base) // itemsize)
    return out.copy_(t.detach())


def _classifier(model: nn.Module, num_classes: int) -> str | None:
    """Name of the last Linear with ``num_classes`` outputs, else of the last such Conv2d.

    The model itself is never a candidate: it cannot be replaced in place.
    """
    linear = conv = None
    for name, m in list(model.named_modules())[1:]:
        if isinstance(m, nn.Linear) and m.out_features == num_classes:
            linear = name
        elif isinstance(m, nn.Conv2d) and m.out_channels == num_classes:
            conv = name
    return linear if linear is not None else conv


def padded_width(num_classes: int, pad_to: int) -> int:
    """num_classes rounded up to a multiple of pad_to."""
    return -(-num_classes // pad_to) * pad_to


def pad_classifier(model: nn.Module, num_classes: int, pad_to: int) -> int:
    """Widen the classifier in place to a multiple of ``pad_to``; return the new width.

    Extra output rows get zero weight and bias; slice them off with :func:`unpad`.
    """
    if pad_to < 1:
        raise ValueError(f"pad_to must be >= 1, got {pad_to}")
    width = padded_width(num_classes, pad_to)
    if width == num_classes:
        return num_classes
    name = _classifier(model, num_classes)
    if name is None:
        raise KdbenchError(
            f"cannot pad the classifier of {type(model).__name__}: "
            f"no final Linear or Conv2d with {num_classes} outputs; use pad_to: 1"
        )
    old = model.get_submodule(name)
    has_bias = old.bias is not None
    kw = dict(device=old.weight.device, dtype=old.weight.dtype)
    if isinstance(old, nn.Linear):
        new = nn.Linear(old.in_features, width, bias=has_bias, **kw)
    else:
        new = nn.Conv2d(
            old.in_channels,
            width,
            old.kernel_size,
            old.stride,
            old.padding,
            old.dilation,
            old.groups,
            has_bias,
            old.padding_mode,
            **kw,
        )
    new.train(old.training)
    with torch.no_grad():
        new.weight.zero_()
        new.weight[:num_classes].copy_(old.weight)
        if has_bias:
            new.bias.zero_()
            new.bias[:num_classes].copy_(old.bias)
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, new)
    return width


def unpad(logits: torch.Tensor, num_classes: int) -> torch.Tensor:
    """The first ``num_classes`` logits: drops the padded columns from loss and accuracy."""
    return logits[..., :num_classes]


MEMORY_FORMATS: dict[str, torch.memory_format] = dict(
    zip(names.MEMORY_FORMATS, (torch.contiguous_format, torch.channels_last), strict=True)
)


def memory_format_of(name: str) -> torch.memory_format:
    """The torch memory format a suite's ``memory_format`` names."""
    if name not in MEMORY_FORMATS:
        raise ValueError(f"memory_format must be one of {sorted(MEMORY_FORMATS)}, got {name!r}")
    return MEMORY_FORMATS[name]


def place_model(model: nn.Module, device: torch.device, memory_format: str, image: bool) -> nn.Module:
    """``model`` on ``device``; its 4-D weights in ``memory_format`` when the data are images."""
    fmt = memory_format_of(memory_format) if image else torch.contiguous_format
    tensors = (*model.parameters(), *model.buffers())
    if all(t.device == device and (t.dim() != 4 or t.is_contiguous(memory_format=fmt)) for t in tensors):
        return model  # already so (a fit's fake model: a fake tensor moved onto itself cannot be swapped)
    return model.to(device=device, memory_format=fmt)


def verify_memory_format(model: nn.Module, x: torch.Tensor, memory_format: str) -> bool:
    """True when ``x`` and every 4-D parameter of ``model`` are contiguous in ``memory_format``."""
    fmt = memory_format_of(memory_format)
    return all(t.is_contiguous(memory_format=fmt) for t in [x, *model.parameters()] if t.dim() == 4)
