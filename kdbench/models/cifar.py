"""CIFAR models of the distillation literature, after RepDistiller (CRD, Tian et al. 2020).

ResNets (``resnet8`` ... ``resnet110``, ``resnet8x4``, ``resnet32x4``), the
bottleneck ResNet-50 for CIFAR (``cifar_resnet50``, RepDistiller's ``ResNet50``),
Wide ResNets (``wrn_16_1`` ... ``wrn_40_2``) and VGG with batch norm
(``cifar_vgg8``, ``cifar_vgg11``, ``cifar_vgg13``, ``cifar_vgg16``,
``cifar_vgg19``).  Unlike RepDistiller they take any input channel count and any
image size of at least 8x8, thanks to adaptive average pooling before the
classifier.  Each model lists its stage submodules in ``stage_names`` so that
features can be hooked with ``model.get_submodule(name)``.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from kdbench.models.registry import register_model


def init_weights(model: nn.Module) -> None:
    """Kaiming-normal convolutions, unit batch norms, zero biases (as RepDistiller)."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.zeros_(m.bias)


class BasicBlock(nn.Module):
    """Post-activation residual block of two 3x3 convolutions (He et al. 2016)."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class CifarResNet(nn.Module):
    """CIFAR ResNet of depth ``6n + 2``: a 3x3 stem of ``widths[0]`` channels, then
    three stages of ``n`` basic blocks with ``widths[1:]`` channels."""

    stage_names = ("layer1", "layer2", "layer3")

    def __init__(self, depth: int, widths: tuple[int, int, int, int], num_classes: int, in_channels: int) -> None:
        super().__init__()
        assert (depth - 2) % 6 == 0, "CIFAR ResNet depth must be 6n + 2"
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._make_stage(widths[0], widths[1], n, 1)
        self.layer2 = self._make_stage(widths[1], widths[2], n, 2)
        self.layer3 = self._make_stage(widths[2], widths[3], n, 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[3], num_classes)
        init_weights(self)

    @staticmethod
    def _make_stage(in_planes: int, planes: int, blocks: int, stride: int) -> nn.Sequential:
        layers = [BasicBlock(in_planes, planes, stride)]
        layers += [BasicBlock(planes, planes) for _ in range(blocks - 1)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(self.avgpool(x).flatten(1))


class Bottleneck(nn.Module):
    """Post-activation bottleneck block: 1x1 reduce, 3x3 (strided), 1x1 expand by ``expansion``."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out_planes = planes * self.expansion
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_planes, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_planes != out_planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, out_planes, 1, stride, bias=False), nn.BatchNorm2d(out_planes)
            )

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class CifarBottleneckResNet(nn.Module):
    """ImageNet-style ResNet of bottleneck blocks for CIFAR (RepDistiller's ``resnetv2.py``): a 3x3 stride-1
    stem of 64 channels and no max pooling, then four stages of ``blocks`` bottlenecks on 64, 128, 256 and 512
    planes (times 4 out), the last three with stride 2."""

    stage_names = ("layer1", "layer2", "layer3", "layer4")

    def __init__(self, blocks: tuple[int, int, int, int], num_classes: int, in_channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        in_planes = 64
        for i, (planes, n) in enumerate(zip((64, 128, 256, 512), blocks)):
            self.add_module(f"layer{i + 1}", self._make_stage(in_planes, planes, n, 1 if i == 0 else 2))
            in_planes = planes * Bottleneck.expansion
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_planes, num_classes)
        init_weights(self)

    @staticmethod
    def _make_stage(in_planes: int, planes: int, blocks: int, stride: int) -> nn.Sequential:
        out_planes = planes * Bottleneck.expansion
        layers = [Bottleneck(in_planes, planes, stride)]
        layers += [Bottleneck(out_planes, planes) for _ in range(blocks - 1)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        for name in self.stage_names:
            x = self.get_submodule(name)(x)
        return self.fc(self.avgpool(x).flatten(1))


class WideBlock(nn.Module):
    """Pre-activation Wide ResNet block (Zagoruyko & Komodakis 2016), no dropout."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = None
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Conv2d(in_planes, planes, 1, stride, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        pre = self.relu(self.bn1(x))
        identity = x if self.shortcut is None else self.shortcut(pre)
        out = self.conv1(pre)
        out = self.conv2(self.relu(self.bn2(out)))
        return out + identity


class WideResNet(nn.Module):
    """WRN-``depth``-``widen``: depth ``6n + 4``, stages of 16k, 32k and 64k channels."""

    stage_names = ("layer1", "layer2", "layer3")

    def __init__(self, depth: int, widen: int, num_classes: int, in_channels: int) -> None:
        super().__init__()
        assert (depth - 4) % 6 == 0, "Wide ResNet depth must be 6n + 4"
        n = (depth - 4) // 6
        widths = (16, 16 * widen, 32 * widen, 64 * widen)
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
        self.layer1 = self._make_stage(widths[0], widths[1], n, 1)
        self.layer2 = self._make_stage(widths[1], widths[2], n, 2)
        self.layer3 = self._make_stage(widths[2], widths[3], n, 2)
        self.bn1 = nn.BatchNorm2d(widths[3])
        self.relu = nn.ReLU(inplace=True)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[3], num_classes)
        init_weights(self)

    @staticmethod
    def _make_stage(in_planes: int, planes: int, blocks: int, stride: int) -> nn.Sequential:
        layers = [WideBlock(in_planes, planes, stride)]
        layers += [WideBlock(planes, planes, 1) for _ in range(blocks - 1)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.layer3(self.layer2(self.layer1(self.conv1(x))))
        x = self.relu(self.bn1(x))
        return self.fc(self.avgpool(x).flatten(1))


class CifarVGG(nn.Module):
    """VGG with batch norm for CIFAR: five stages of 3x3 convolutions, max pooling
    after the first three, global average pooling and one linear classifier."""

    stage_names = ("layer1", "layer2", "layer3", "layer4", "layer5")

    def __init__(self, stages: tuple[tuple[int, ...], ...], num_classes: int, in_channels: int) -> None:
        super().__init__()
        widths = [in_channels] + [stage[-1] for stage in stages]
        for i, stage in enumerate(stages):
            self.add_module(f"layer{i + 1}", self._make_stage(widths[i], stage))
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2, 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.classifier = nn.Linear(widths[-1], num_classes)
        init_weights(self)
        nn.init.normal_(self.classifier.weight, 0, 0.01)

    @staticmethod
    def _make_stage(in_channels: int, widths: tuple[int, ...]) -> nn.Sequential:
        """Conv-BN-ReLU per width; the stage ends at the last BN (ReLU applied in forward)."""
        layers: list[nn.Module] = []
        for width in widths:
            conv = nn.Conv2d(in_channels, width, 3, padding=1)
            layers += [conv, nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
            in_channels = width
        return nn.Sequential(*layers[:-1])

    def forward(self, x: Tensor) -> Tensor:
        for i, name in enumerate(self.stage_names):
            x = self.relu(self.get_submodule(name)(x))
            if i < 3:
                x = self.pool(x)
        return self.classifier(self.avgpool(x).flatten(1))


_VGG8 = ((64,), (128,), (256,), (512,), (512,))
_VGG11 = ((64,), (128,), (256, 256), (512, 512), (512, 512))
_VGG13 = ((64, 64), (128, 128), (256, 256), (512, 512), (512, 512))
_VGG16 = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512))
_VGG19 = ((64, 64), (128, 128), (256,) * 4, (512,) * 4, (512,) * 4)
_RESNET = (16, 16, 32, 64)
_RESNET_X4 = (32, 64, 128, 256)

_MODELS: dict[str, tuple] = {
    **{f"resnet{d}": (CifarResNet, d, _RESNET) for d in (8, 14, 20, 32, 44, 56, 110)},
    "resnet8x4": (CifarResNet, 8, _RESNET_X4),
    "resnet32x4": (CifarResNet, 32, _RESNET_X4),
    "cifar_resnet50": (CifarBottleneckResNet, (3, 4, 6, 3)),
    **{f"wrn_{d}_{k}": (WideResNet, d, k) for d, k in ((16, 1), (16, 2), (40, 1), (40, 2))},
    "cifar_vgg8": (CifarVGG, _VGG8),
    "cifar_vgg11": (CifarVGG, _VGG11),
    "cifar_vgg13": (CifarVGG, _VGG13),
    "cifar_vgg16": (CifarVGG, _VGG16),
    "cifar_vgg19": (CifarVGG, _VGG19),
}


def builder_of(name: str, cls: type[nn.Module], *args) -> Callable[..., nn.Module]:
    """Registry builder for ``cls(*args, num_classes, in_channels)`` (shapes: registry.check_model_input)."""

    def build(num_classes: int, in_shape: tuple[int, ...]) -> nn.Module:
        return cls(*args, num_classes=num_classes, in_channels=in_shape[0])

    return build


for _name, (_cls, *_args) in _MODELS.items():
    register_model(_name, "cifar")(builder_of(_name, _cls, *_args))
