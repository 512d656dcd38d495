"""Random weights drawn on the host, one tensor at a time, for models built elsewhere: the same weights wherever a
model is built.

A model built on the CPU in float32 after ``torch.manual_seed(seed)`` has the weights of the CPU's random stream:
every initialiser (``nn.init.normal_``, ``uniform_``, ... as transformers and torch's layers call them) draws from
the CPU generator, in order.  Built directly on a GPU, the same calls would draw from the GPU's generator (other
weights), and built on the CPU in bfloat16 they draw bf16 numbers (another stream where a tensor's size is not a
multiple of the CPU kernel's vector width).  Inside :func:`host_draws` each such call on a tensor that is not a
float32 CPU tensor draws into a float32 CPU tensor of its shape instead, from the CPU generator, and copies the
result in (cast to the tensor's dtype): the weights are those of the float32 CPU build, cast, while the host holds
one tensor's draw at a time, never the model.  A call with its own ``generator`` is left alone.

Values a model computes rather than draws (rotary frequencies, position ids) are computed where the model is built,
as transformers does.  An initialiser that computes on its draws (``trunc_normal_``) computes in the tensor's dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # the dispatcher's mode: sees every aten call

_aten = torch.ops.aten
# The in-place random fills torch's and transformers' initialisers end in (seen at the dispatcher, below the Python
# wrappers of ``nn.init``).
DRAWS = frozenset(
    (
        _aten.normal_,
        _aten.uniform_,
        _aten.bernoulli_,
        _aten.random_,
        _aten.exponential_,
        _aten.log_normal_,
        _aten.cauchy_,
        _aten.geometric_,
    )
)


def _narrow(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize < 4


def drawn_elsewhere(t: torch.Tensor) -> bool:
    """Whether a fill of ``t`` is drawn on the host in float32: ``t`` is not a float32 CPU tensor (nor on
    ``meta``, where nothing is drawn)."""
    if t.device.type == "meta":
        return False
    return t.device.type != "cpu" or _narrow(t.dtype)


class _HostDraws(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if (
            func.overloadpacket in DRAWS
            and isinstance(target, torch.Tensor)
            and kwargs.get("generator") is None
            and drawn_elsewhere(target)
        ):
            dtype = torch.float32 if _narrow(target.dtype) else target.dtype
            drawn = torch.empty_strided(target.shape, target.stride(), dtype=dtype, device="cpu")
            func(drawn, *args[1:], **kwargs)
            target.copy_(drawn)
            return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_draws(active: bool = True) -> Iterator[None]:
    """Inside: random fills of tensors that are not float32 CPU tensors drawn on the host in float32, one tensor
    at a time (the module docstring); ``active`` False: nothing changes."""
    if not active:
        yield
        return
    with _HostDraws():
        yield


def needs_host_draws(device: str | torch.device | None, dtype: torch.dtype | None) -> bool:
    """Whether a model built on ``device`` (None: the CPU) in ``dtype`` (None: float32) draws elsewhere than a
    float32 CPU build would."""
    where = torch.device(device) if device is not None else torch.device("cpu")
    if where.type == "meta":
        return False
    return where.type != "cpu" or (dtype is not None and _narrow(dtype))


# torch's initialisers (nn.init's functions: what torch's layers and kdbench's models call to fill their weights)
INITS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
    "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)  # fmt: skip


def _untouched(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def skipped_inits() -> Iterator[None]:
    """Inside: torch's initialisers (:data:`INITS` of ``torch.nn.init``) return their tensor untouched, for a build
    whose weights' values nobody reads (the fit planner's fake run: a fake tensor has none).  transformers keeps its
    own references to torch's functions: its fills end in :data:`DRAWS` at the dispatcher, which :func:`undrawn`
    answers."""
    saved = {name: getattr(torch.nn.init, name) for name in INITS if hasattr(torch.nn.init, name)}
    for name in saved:
        setattr(torch.nn.init, name, _untouched)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


def undrawn(func, args: tuple) -> torch.Tensor | None:
    """A random fill (:data:`DRAWS`) answered with its tensor untouched, else None (it runs): the answer a dispatch
    hook gives (:attr:`kdbench.fit.tracker.LiveBytes.answer`) while a build's values are read by nobody."""
    if func.overloadpacket in DRAWS and args and isinstance(args[0], torch.Tensor):
        return args[0]
    return None
