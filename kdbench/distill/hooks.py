"""Feature capture: forward hooks on module paths, and default paths for any model.

Feature methods (FitNet, attention transfer) compare intermediate outputs of the
teacher and the student.  ``FeatureTap`` hooks the modules named by dotted paths
(``layer2``, ``features.6``) and keeps their outputs of the latest forward pass.

Every captured output is brought to one canonical, channel-first form:

* ``map``: ``(N, C, H, W)`` — convolutional stages (torchvision's Swin, whose
  stages are ``(N, H, W, C)``, is permuted);
* ``seq``: ``(N, C, L)`` — transformer tokens ``(N, L, D)``;
* ``vec``: ``(N, C)``.

Default paths (``default_feature_paths``), when a suite names none:

* a model with ``stage_names`` (kdbench's CIFAR zoo): those stages;
* torchvision ResNet/ResNeXt/Wide-ResNet: ``layer1..layer4``;
* a ViT: four encoder blocks evenly spaced, ending with the last;
* torchvision's Swin: its four stages ``features.1, 3, 5, 7``;
* anything else: the *stage ends* found by one dry forward pass — for each
  spatial resolution the model passes through, the last module (at most two
  levels deep) whose output still has that resolution, i.e. the output just
  before each down-sampling.  This covers MobileNet, EfficientNet, ShuffleNet,
  VGG, DenseNet, RegNet, ConvNeXt, MNASNet, Swin, MaxViT and users' own CNNs.

A teacher and a student with different numbers of stages are paired on their
last ``k`` stages (``k`` the smaller count): deep ends meet deep ends.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kdbench.core.errors import KdbenchError, did_you_mean

MAX_DEFAULT_STAGES = 4


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def channels_last_stages(model: nn.Module) -> bool:
    """torchvision's Swin keeps its stage outputs as (N, H, W, C)."""
    return type(model).__name__ == "SwinTransformer"


def canonical(t: torch.Tensor, nhwc: bool = False) -> torch.Tensor:
    """A captured output in channel-first form: (N, C, H, W), (N, C, L) or (N, C)."""
    if t.dim() == 4:
        return t.permute(0, 3, 1, 2) if nhwc else t
    if t.dim() == 3:
        return t.transpose(1, 2)  # tokens (N, L, D) -> (N, D, L)
    if t.dim() == 2:
        return t
    return t.flatten(1)


def _module(model: nn.Module, path: str, role: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        names = [n for n, _ in model.named_modules() if n][:12]
        raise KdbenchError(
            f"features.{role}: the {role} has no module '{path}'; give dotted module paths such as "
            f"{', '.join(names[:6])}, ..."
        ) from None


class FeatureTap:
    """Forward hooks that keep the latest outputs of the modules at ``paths``, in order."""

    def __init__(self, model: nn.Module, paths: list[str], role: str = "model"):
        self.paths = list(paths)
        self.nhwc = channels_last_stages(model)
        self._out: list[torch.Tensor | None] = [None] * len(self.paths)
        self._handles = []
        for i, path in enumerate(self.paths):
            self._handles.append(_module(model, path, role).register_forward_hook(self._hook(i)))

    def _hook(self, i: int):
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            self._out[i] = _first_tensor(output)

        return hook

    def take(self) -> list[torch.Tensor]:
        """The captured outputs of the latest forward pass, canonical, and forget them."""
        out = self._out
        self._out = [None] * len(self.paths)
        missing = [p for p, t in zip(self.paths, out) if t is None]
        if missing:
            raise RuntimeError(f"feature modules {missing} produced no tensor in the forward pass")
        return [canonical(t, self.nhwc) for t in out]  # type: ignore[arg-type]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _spaced(items: list[str], k: int) -> list[str]:
    """k items evenly spaced, ending with the last one."""
    if len(items) <= k:
        return list(items)
    n = len(items)
    return [items[round((i + 1) * n / k) - 1] for i in range(k)]


_HEAD_NAMES = ("classifier", "head", "heads", "fc")
_HEAD_POOLS = (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)


def stage_ends(model: nn.Module, example: torch.Tensor) -> list[str]:
    """Paths of the last module at each spatial resolution (see the module docstring).

    Only modules at most two levels deep count, and only until the head begins
    (the first adaptive pooling, or a child named classifier/head/fc).
    """
    nhwc = channels_last_stages(model)
    order: list[tuple[str, torch.Tensor]] = []  # the tensors stay referenced, so their ids stay unique
    state = {"head": False}
    handles = []

    def recorder(name: str, module: nn.Module):
        def hook(_m: nn.Module, _inputs: Any, output: Any) -> None:
            if state["head"] or name.split(".")[0] in _HEAD_NAMES:
                return
            if isinstance(module, _HEAD_POOLS):
                state["head"] = True
                return
            t = _first_tensor(output)
            if t is not None and t.dim() == 4:
                order.append((name, t))

        return hook

    for name, module in model.named_modules():
        if name and name.count(".") <= 1:
            handles.append(module.register_forward_hook(recorder(name, module)))
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(example)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    spatial_of = {name: (tuple(t.shape[1:3]) if nhwc else tuple(t.shape[2:])) for name, t in order}
    last_at: dict[tuple[int, ...], str] = {}
    owner: dict[int, str] = {}
    for name, t in order:
        spatial = spatial_of[name]
        if id(t) in owner:  # a container handing on its last child's output
            inner = [n for n in spatial_of if n.startswith(name + ".")]
            if not all(spatial_of[n] == spatial for n in inner):
                continue  # it spans resolutions (a whole trunk): keep the child
            last_at = {
                k: v for k, v in last_at.items() if not v.startswith(name + ".")
            }  # the block, not its last layer
        owner[id(t)] = name
        last_at.pop(spatial, None)
        last_at[spatial] = name  # re-inserted: the order follows each resolution's last appearance
    return list(last_at.values())


def default_feature_paths(model: nn.Module, example: torch.Tensor) -> list[str]:
    """The stage outputs feature methods use by default (at most four, the deepest)."""
    names = dict(model.named_children())
    if getattr(model, "stage_names", None):
        paths = list(model.stage_names)
    elif all(f"layer{i}" in names for i in range(1, 5)):
        paths = [f"layer{i}" for i in range(1, 5)]
    elif channels_last_stages(model):  # Swin: patch merging between the odd-numbered stages
        paths = [f"features.{i}" for i in range(1, len(model.features), 2)]
    elif type(model).__name__ == "VisionTransformer":
        blocks = [n for n, _ in model.encoder.layers.named_children()]
        paths = [f"encoder.layers.{b}" for b in _spaced(blocks, MAX_DEFAULT_STAGES)]
    else:
        paths = stage_ends(model, example)
    if not paths:
        raise KdbenchError(
            f"{type(model).__name__} has no spatial stages to capture features from; "
            "name the modules with features.teacher / features.student"
        )
    return paths[-MAX_DEFAULT_STAGES:]


def check_feature_count(teacher: list[str] | None, student: list[str] | None) -> None:
    """Explicit teacher and student feature lists are compared pairwise: the same length."""
    if teacher and student and len(teacher) != len(student):
        raise KdbenchError(
            f"teacher lists {len(teacher)} modules and student {len(student)}; "
            "they are compared pairwise, so give both the same number"
        )


def pair_paths(teacher: list[str], student: list[str], explicit: bool) -> tuple[list[str], list[str]]:
    """Pair the two lists; defaults meet on their last k stages, explicit lists must match in length."""
    if explicit:
        try:
            check_feature_count(teacher, student)
        except KdbenchError as exc:
            raise KdbenchError(f"features: {exc}") from None
    if len(teacher) == len(student):
        return teacher, student
    k = min(len(teacher), len(student))
    return teacher[-k:], student[-k:]


@dataclass(frozen=True)
class FeaturePaths:
    teacher: list[str]
    student: list[str]


def layer_pairs(
    teacher_layers: list[str], student_layers: list[str], teacher: list[str], student: list[str], most: int
) -> FeaturePaths:
    """The layers a feature method pairs on a stack of layers (a decoder's or an encoder's): the given paths
    (``teacher`` / ``student``) where the suite names them, else at most ``most`` of each model's layers, evenly
    spaced and ending with the last."""
    t, s = teacher or teacher_layers, student or student_layers
    if not (teacher and student):
        k = min(len(t), len(s), most)
        t, s = (teacher or _spaced(t, k)), (student or _spaced(s, k))
    t, s = pair_paths(t, s, explicit=bool(teacher) and bool(student))
    return FeaturePaths(teacher=t, student=s)


def resolve_paths(
    teacher: nn.Module,
    student: nn.Module,
    example: torch.Tensor,
    teacher_paths: list[str] | None,
    student_paths: list[str] | None,
) -> FeaturePaths:
    """The paired feature paths of a cell: the suite's, or each model's defaults."""
    t = teacher_paths or default_feature_paths(teacher, example)
    s = student_paths or default_feature_paths(student, example)
    t, s = pair_paths(t, s, explicit=bool(teacher_paths) and bool(student_paths))
    return FeaturePaths(teacher=t, student=s)


@functools.lru_cache(maxsize=64)
def _module_names(name: str, num_classes: int, shape: tuple[int, ...], allow_imports: bool) -> frozenset[str] | None:
    """Module paths of a model, built on the meta device (no memory, no init); None if that fails."""
    from kdbench.models import build_model

    try:
        with torch.device("meta"):
            model = build_model(name, num_classes, shape, allow_imports=allow_imports)
    except Exception:  # the run itself will report what is wrong with the model
        return None
    return frozenset(n for n, _ in model.named_modules() if n)


def check_feature_paths(
    role: str,
    model_name: str,
    paths: list[str] | None,
    num_classes: int,
    shape: tuple[int, ...],
    allow_imports: bool = False,
) -> None:
    """KdbenchError, before anything runs, for a feature path the model does not have."""
    if not paths:
        return
    names = _module_names(model_name, num_classes, shape, allow_imports)
    if names is None:
        return
    for path in paths:
        if path not in names:
            hint = did_you_mean(path, sorted(names))
            raise KdbenchError(
                f"{model_name} has no module '{path}'; {hint}give dotted module paths as named_modules() lists them"
            )
