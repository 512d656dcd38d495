"""Mobile CIFAR students of the distillation literature, after RepDistiller (CRD, Tian et al. 2020).

``cifar_shufflev1`` (RepDistiller's ``ShuffleV1``), ``cifar_shufflev2`` (``ShuffleV2``)
and ``cifar_mobilenetv2`` (``mobile_half``: MobileNetV2 with expansion 6 and width 0.5),
the students of the CIFAR-100 tables with a teacher of another architecture.  At
3x32x32 they are the reference's networks: the same layers, strides, channels and
parameters.  As the rest of the CIFAR family (:mod:`kdbench.models.cifar`) they take any
input channel count and any image size of at least 8x8, thanks to adaptive average
pooling before the classifier, and list their stage submodules in ``stage_names``.

kdbench taps module outputs (:class:`kdbench.distill.hooks.FeatureTap`); each model's
docstring says which of the reference's ``is_feat=True`` features its stages are.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kdbench.models.cifar import builder_of, init_weights
from kdbench.models.registry import register_model


class ChannelShuffle(nn.Module):
    """Channel shuffle of ShuffleNet: (N, g*k, H, W) -> (N, k, g, H, W), read out as (N, k*g, H, W)."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.groups = groups

    def forward(self, x: Tensor) -> Tensor:
        return x.unflatten(1, (self.groups, -1)).transpose(1, 2).flatten(1, 2)


# --- ShuffleNet v1 -------------------------------------------------------------------------------------------


class ShuffleV1Unit(nn.Module):
    """ShuffleNet v1 unit (Zhang et al. 2018): grouped 1x1, channel shuffle, 3x3 depthwise, grouped 1x1.

    Stride 1: ``relu(branch(x) + x)``.  Stride 2: ``relu(cat(branch(x), avgpool3x3(x)))``, the
    branch giving ``out_planes - in_planes`` channels.  ``first_groups`` groups the first 1x1
    (RepDistiller: 1 for the unit right after the 24-channel stem, ``groups`` elsewhere).
    """

    def __init__(self, in_planes: int, out_planes: int, stride: int, groups: int, first_groups: int) -> None:
        super().__init__()
        branch_planes = out_planes - in_planes if stride == 2 else out_planes
        mid = branch_planes // 4
        self.branch = nn.Sequential(
            nn.Conv2d(in_planes, mid, 1, groups=first_groups, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU(inplace=True),
            ChannelShuffle(first_groups),
            nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid, branch_planes, 1, groups=groups, bias=False),
            nn.BatchNorm2d(branch_planes),
        )
        self.shortcut = nn.AvgPool2d(3, stride=2, padding=1) if stride == 2 else None
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        out = self.branch(x)
        out = out + x if self.shortcut is None else torch.cat([out, self.shortcut(x)], 1)
        return self.relu(out)


def _shuffle_stem(net: nn.Module, in_channels: int) -> int:
    """The ShuffleNets' stem on ``net`` (a 1x1 conv to 24 channels, BN, ReLU, under the reference's names
    ``conv1``, ``bn1``, ``relu``); its width."""
    stem = 24
    net.conv1 = nn.Conv2d(in_channels, stem, 1, bias=False)
    net.bn1 = nn.BatchNorm2d(stem)
    net.relu = nn.ReLU(inplace=True)
    return stem


class ShuffleNetV1(nn.Module):
    """ShuffleNet v1 for CIFAR (RepDistiller's ``ShuffleNetv1.py``): a 1x1 stem of 24 channels at full
    resolution, then three stages of units with ``out_planes`` channels, each opened by a stride-2 unit.

    Features: ``layer1``, ``layer2``, ``layer3`` output the last unit's ReLU, the reference's
    ``is_feat=True`` features f1, f2, f3 ((240, 16, 16), (480, 8, 8), (960, 4, 4) at 3x32x32).  The
    reference's ``preact=True`` variants (the sum or concatenation before that ReLU) are no module's
    output and are not tapped.  Initialisation: PyTorch's defaults, as the reference (it sets none).
    """

    stage_names = ("layer1", "layer2", "layer3")

    def __init__(
        self,
        out_planes: tuple[int, int, int],
        num_blocks: tuple[int, int, int],
        groups: int,
        num_classes: int,
        in_channels: int,
    ) -> None:
        super().__init__()
        in_planes = _shuffle_stem(self, in_channels)
        for i, (planes, n) in enumerate(zip(out_planes, num_blocks)):
            units = []
            for j in range(n):
                first_groups = 1 if i == 0 and j == 0 else groups
                units.append(ShuffleV1Unit(in_planes, planes, 2 if j == 0 else 1, groups, first_groups))
                in_planes = planes
            self.add_module(f"layer{i + 1}", nn.Sequential(*units))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_planes, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(self.avgpool(x).flatten(1))


# --- ShuffleNet v2 -------------------------------------------------------------------------------------------


def _conv_bn(in_planes: int, out_planes: int, kernel: int, stride: int = 1, depthwise: bool = False) -> list:
    """Conv (no bias, 'same' padding) and batch norm, as a list of layers."""
    groups = in_planes if depthwise else 1
    conv = nn.Conv2d(in_planes, out_planes, kernel, stride, kernel // 2, groups=groups, bias=False)
    return [conv, nn.BatchNorm2d(out_planes)]


class ShuffleV2Unit(nn.Module):
    """ShuffleNet v2 basic unit (Ma et al. 2018): split the channels in halves, keep the first, run the
    second through 1x1-BN-ReLU, 3x3 depthwise-BN, 1x1-BN-ReLU, concatenate and shuffle (2 groups)."""

    def __init__(self, planes: int) -> None:
        super().__init__()
        self.keep = planes // 2
        half = planes - self.keep
        self.branch = nn.Sequential(
            *_conv_bn(half, half, 1),
            nn.ReLU(inplace=True),
            *_conv_bn(half, half, 3, depthwise=True),
            *_conv_bn(half, half, 1),
            nn.ReLU(inplace=True),
        )
        self.shuffle = ChannelShuffle(2)

    def forward(self, x: Tensor) -> Tensor:
        out = torch.cat([x[:, : self.keep], self.branch(x[:, self.keep :])], 1)
        return self.shuffle(out)


class ShuffleV2Down(nn.Module):
    """ShuffleNet v2 down-sampling unit: two stride-2 branches of ``out_planes / 2`` channels each, the left
    3x3 depthwise-BN then 1x1-BN-ReLU, the right 1x1-BN-ReLU, 3x3 depthwise-BN, 1x1-BN-ReLU; concatenated
    and shuffled (2 groups)."""

    def __init__(self, in_planes: int, out_planes: int) -> None:
        super().__init__()
        mid = out_planes // 2
        self.left = nn.Sequential(
            *_conv_bn(in_planes, in_planes, 3, 2, depthwise=True),
            *_conv_bn(in_planes, mid, 1),
            nn.ReLU(inplace=True),
        )
        self.right = nn.Sequential(
            *_conv_bn(in_planes, mid, 1),
            nn.ReLU(inplace=True),
            *_conv_bn(mid, mid, 3, 2, depthwise=True),
            *_conv_bn(mid, mid, 1),
            nn.ReLU(inplace=True),
        )
        self.shuffle = ChannelShuffle(2)

    def forward(self, x: Tensor) -> Tensor:
        return self.shuffle(torch.cat([self.left(x), self.right(x)], 1))


class ShuffleNetV2(nn.Module):
    """ShuffleNet v2 for CIFAR (RepDistiller's ``ShuffleNetv2.py``): a 1x1 stem of 24 channels at full
    resolution, three stages (a down-sampling unit, then ``num_blocks`` basic units) and a 1x1
    conv-BN-ReLU head (``conv2``) before the pooling.

    Features: ``layer1``, ``layer2``, ``layer3`` output the last unit's shuffled concatenation, the
    reference's ``is_feat=True`` features f1, f2, f3 ((116, 16, 16), (232, 8, 8), (464, 4, 4) at 3x32x32
    and net size 1).  The reference's ``preact=True`` variants (unshuffled, the branch before its last
    ReLU) are not tapped.  Its last feature f4, the pooled head output (1024 channels), is not a stage:
    CRD and RKD embed the pooled ``layer3`` by default; name ``conv2`` in ``features.student`` for the
    reference's.  Initialisation: PyTorch's defaults, as the reference (it sets none).
    """

    stage_names = ("layer1", "layer2", "layer3")

    def __init__(
        self,
        out_channels: tuple[int, int, int, int],
        num_blocks: tuple[int, int, int],
        num_classes: int,
        in_channels: int,
    ) -> None:
        super().__init__()
        in_planes = _shuffle_stem(self, in_channels)
        for i, (planes, n) in enumerate(zip(out_channels[:3], num_blocks)):
            units = [ShuffleV2Down(in_planes, planes)] + [ShuffleV2Unit(planes) for _ in range(n)]
            self.add_module(f"layer{i + 1}", nn.Sequential(*units))
            in_planes = planes
        self.conv2 = nn.Sequential(*_conv_bn(in_planes, out_channels[3], 1), nn.ReLU(inplace=True))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(out_channels[3], num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.conv2(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


# --- MobileNetV2 ---------------------------------------------------------------------------------------------


def _conv_bn_relu(in_planes: int, out_planes: int, kernel: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(*_conv_bn(in_planes, out_planes, kernel, stride), nn.ReLU(inplace=True))


class InvertedResidual(nn.Module):
    """MobileNetV2 block (Sandler et al. 2018): 1x1 expansion by ``expand`` (kept at ``expand = 1``, as
    RepDistiller does), 3x3 depthwise with the stride, linear 1x1 projection (BN, no ReLU); a residual
    connection when the stride is 1 and the widths agree."""

    def __init__(self, in_planes: int, out_planes: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = in_planes * expand
        self.residual = stride == 1 and in_planes == out_planes
        self.conv = nn.Sequential(
            *_conv_bn(in_planes, hidden, 1),
            nn.ReLU(inplace=True),
            *_conv_bn(hidden, hidden, 3, stride, depthwise=True),
            nn.ReLU(inplace=True),
            *_conv_bn(hidden, out_planes, 1),
        )

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv(x) if self.residual else self.conv(x)


# (expansion, channels, blocks, stride) of the seven block groups; ``T`` is the expansion of all but the first.
_MOBILENETV2_SETTING = ((1, 16, 1, 1), ("T", 24, 2, 1), ("T", 32, 3, 2), ("T", 64, 4, 2), ("T", 96, 3, 1),
                        ("T", 160, 3, 2), ("T", 320, 1, 1))  # fmt: skip


class MobileNetV2(nn.Module):
    """MobileNetV2 for CIFAR (RepDistiller's ``mobilenetv2.py``, after Route Constrained Optimization): a
    stride-2 3x3 stem, seven groups of inverted residual blocks (``blocks.0`` ... ``blocks.6``) of
    expansion ``expansion`` and widths scaled by ``width_mult``, and a 1x1 conv-BN-ReLU head (``conv2``) of
    1280 channels (``1280 * width_mult`` when that is wider).

    Features: ``blocks.1``, ``blocks.2``, ``blocks.4`` and ``blocks.6`` output their last block (its
    linear projection, plus the residual where there is one), exactly the reference's ``is_feat=True``
    features f1 ... f4 ((12, 16, 16), (16, 8, 8), (48, 4, 4), (160, 2, 2) for ``mobile_half`` at
    3x32x32; the reference ignores ``preact``: no ReLU follows these outputs).  Its f0 (the stem,
    ``conv1``) is no stage, as the stems of kdbench's ResNets are not; its last feature f5, the pooled head
    output (1280 channels), neither: CRD and RKD embed the pooled ``blocks.6`` by default; name ``conv2``
    in ``features.student`` for the reference's.  Initialisation as the reference: Kaiming-normal
    (fan-out) convolutions, unit batch norms, a N(0, 0.01) classifier with zero bias.
    """

    stage_names = ("blocks.1", "blocks.2", "blocks.4", "blocks.6")

    def __init__(self, expansion: int, width_mult: float, num_classes: int, in_channels: int) -> None:
        super().__init__()
        in_planes = int(32 * width_mult)
        self.conv1 = _conv_bn_relu(in_channels, in_planes, 3, 2)
        self.blocks = nn.ModuleList()
        for t, c, n, s in _MOBILENETV2_SETTING:
            t = expansion if t == "T" else t
            out_planes = int(c * width_mult)
            group = []
            for j in range(n):
                group.append(InvertedResidual(in_planes, out_planes, s if j == 0 else 1, t))
                in_planes = out_planes
            self.blocks.append(nn.Sequential(*group))
        last = int(1280 * width_mult) if width_mult > 1.0 else 1280
        self.conv2 = _conv_bn_relu(in_planes, last, 1)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(last, num_classes)
        init_weights(self)
        nn.init.normal_(self.classifier.weight, 0, 0.01)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv1(x)
        for group in self.blocks:
            x = group(x)
        x = self.conv2(x)
        return self.classifier(self.avgpool(x).flatten(1))


_MODELS: dict[str, tuple] = {
    "cifar_shufflev1": (ShuffleNetV1, (240, 480, 960), (4, 8, 4), 3),
    "cifar_shufflev2": (ShuffleNetV2, (116, 232, 464, 1024), (3, 7, 3)),
    "cifar_mobilenetv2": (MobileNetV2, 6, 0.5),
}

for _name, (_cls, *_args) in _MODELS.items():
    register_model(_name, "cifar")(builder_of(_name, _cls, *_args))
