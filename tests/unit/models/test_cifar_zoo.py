"""The CIFAR-100 teachers of the distillation tables (ResNet50, VGG11/16/19 with BN) against the reference code."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kdbench.distill.hooks import default_feature_paths
from kdbench.models import available_models, build_model
from tests.support.reference_match import assert_matches_reference, load_randomised_reference, reference_pair

# --- the reference code ---------------------------------------------------------------------------------------
# HobbitLong/RepDistiller, models/resnetv2.py (Bottleneck, ResNet, ResNet50) and models/vgg.py (VGG, cfg,
# vgg11_bn/vgg16_bn/vgg19_bn) at commit b84f547c5db6a35318d4671d7d5c4de74c822403; mdistiller's CIFAR zoo
# (megvii-research/mdistiller, mdistiller/models/cifar/) carries the same classes.  Trimmed to what builds these
# models and returns their features: no BasicBlock, no get_feat_modules / get_bn_before_relu, no preact features,
# no zero_init_residual, no batch_norm=False path.


class RefBottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_planes, planes, stride=1, is_last=False):
        super().__init__()
        self.is_last = is_last
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, self.expansion * planes, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(self.expansion * planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != self.expansion * planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, self.expansion * planes, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(self.expansion * planes),
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += self.shortcut(x)
        preact = out
        out = F.relu(out)
        if self.is_last:
            return out, preact
        return out


class RefResNet(nn.Module):
    def __init__(self, block, num_blocks, num_classes=10):
        super().__init__()
        self.in_planes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.layer1 = self._make_layer(block, 64, num_blocks[0], stride=1)
        self.layer2 = self._make_layer(block, 128, num_blocks[1], stride=2)
        self.layer3 = self._make_layer(block, 256, num_blocks[2], stride=2)
        self.layer4 = self._make_layer(block, 512, num_blocks[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.linear = nn.Linear(512 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, block, planes, num_blocks, stride):
        strides = [stride] + [1] * (num_blocks - 1)
        layers = []
        for i in range(num_blocks):
            layers.append(block(self.in_planes, planes, strides[i], i == num_blocks - 1))
            self.in_planes = planes * block.expansion
        return nn.Sequential(*layers)

    def forward(self, x, is_feat=False):
        out = F.relu(self.bn1(self.conv1(x)))
        f0 = out
        out, _f1_pre = self.layer1(out)
        f1 = out
        out, _f2_pre = self.layer2(out)
        f2 = out
        out, _f3_pre = self.layer3(out)
        f3 = out
        out, _f4_pre = self.layer4(out)
        f4 = out
        out = self.avgpool(out)
        out = out.view(out.size(0), -1)
        f5 = out
        out = self.linear(out)
        if is_feat:
            return [f0, f1, f2, f3, f4, f5], out
        return out


def RefResNet50(**kwargs):
    return RefResNet(RefBottleneck, [3, 4, 6, 3], **kwargs)


class RefVGG(nn.Module):
    def __init__(self, cfg, batch_norm=False, num_classes=1000):
        super().__init__()
        self.block0 = self._make_layers(cfg[0], batch_norm, 3)
        self.block1 = self._make_layers(cfg[1], batch_norm, cfg[0][-1])
        self.block2 = self._make_layers(cfg[2], batch_norm, cfg[1][-1])
        self.block3 = self._make_layers(cfg[3], batch_norm, cfg[2][-1])
        self.block4 = self._make_layers(cfg[4], batch_norm, cfg[3][-1])
        self.pool0 = nn.MaxPool2d(kernel_size=2, stride=2)
        self.pool1 = nn.MaxPool2d(kernel_size=2, stride=2)
        self.pool2 = nn.MaxPool2d(kernel_size=2, stride=2)
        self.pool3 = nn.MaxPool2d(kernel_size=2, stride=2)
        self.pool4 = nn.AdaptiveAvgPool2d((1, 1))
        self.classifier = nn.Linear(512, num_classes)

    def forward(self, x, is_feat=False):
        h = x.shape[2]
        x = F.relu(self.block0(x))
        f0 = x
        x = self.pool0(x)
        x = self.block1(x)
        x = F.relu(x)
        f1 = x
        x = self.pool1(x)
        x = self.block2(x)
        x = F.relu(x)
        f2 = x
        x = self.pool2(x)
        x = self.block3(x)
        x = F.relu(x)
        f3 = x
        if h == 64:
            x = self.pool3(x)
        x = self.block4(x)
        x = F.relu(x)
        f4 = x
        x = self.pool4(x)
        x = x.view(x.size(0), -1)
        f5 = x
        x = self.classifier(x)
        if is_feat:
            return [f0, f1, f2, f3, f4, f5], x
        return x

    @staticmethod
    def _make_layers(cfg, batch_norm=False, in_channels=3):
        layers = []
        for v in cfg:
            if v == "M":
                layers += [nn.MaxPool2d(kernel_size=2, stride=2)]
            else:
                conv2d = nn.Conv2d(in_channels, v, kernel_size=3, padding=1)
                if batch_norm:
                    layers += [conv2d, nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
                else:
                    layers += [conv2d, nn.ReLU(inplace=True)]
                in_channels = v
        layers = layers[:-1]
        return nn.Sequential(*layers)


ref_cfg = {
    "A": [[64], [128], [256, 256], [512, 512], [512, 512]],
    "B": [[64, 64], [128, 128], [256, 256], [512, 512], [512, 512]],
    "D": [[64, 64], [128, 128], [256, 256, 256], [512, 512, 512], [512, 512, 512]],
    "E": [[64, 64], [128, 128], [256, 256, 256, 256], [512, 512, 512, 512], [512, 512, 512, 512]],
}


def ref_vgg11_bn(**kwargs):
    return RefVGG(ref_cfg["A"], batch_norm=True, **kwargs)


def ref_vgg16_bn(**kwargs):
    return RefVGG(ref_cfg["D"], batch_norm=True, **kwargs)


def ref_vgg19_bn(**kwargs):
    return RefVGG(ref_cfg["E"], batch_norm=True, **kwargs)


# --- kdbench's models against them -------------------------------------------------------------------------------

# name -> (reference builder, which of the reference's is_feat features the stage_names are)
REFERENCES = {
    "cifar_resnet50": (RefResNet50, slice(1, 5)),  # f1..f4 = layer1..layer4
    "cifar_vgg11": (ref_vgg11_bn, slice(0, 5)),  # f0..f4 = block0..block4
    "cifar_vgg16": (ref_vgg16_bn, slice(0, 5)),
    "cifar_vgg19": (ref_vgg19_bn, slice(0, 5)),
}
NEW_MODELS = list(REFERENCES)

# Feature shapes (C, H, W) at 3x32x32, as the reference's forward(is_feat=True) returns them (checked below).
FEATURE_SHAPES = {
    "cifar_resnet50": [(256, 32, 32), (512, 16, 16), (1024, 8, 8), (2048, 4, 4)],
    **{name: [(64, 32, 32), (128, 16, 16), (256, 8, 8), (512, 4, 4), (512, 4, 4)] for name in NEW_MODELS[1:]},
}

# Parameters at 100 classes, counted from the reference code (the CRD paper's tables give no parameter counts).
PARAMS = {
    "cifar_resnet50": 23_705_252,
    "cifar_vgg11": 9_277_284,
    "cifar_vgg16": 14_774_436,
    "cifar_vgg19": 20_086_692,
}


pytestmark = pytest.mark.usefixtures("seeded")  # tests/conftest.py


@pytest.mark.parametrize("name", NEW_MODELS)
def test_matches_the_reference_at_cifar100(name):
    ours, ref = reference_pair(name, REFERENCES)
    assert_matches_reference(ours, ref, PARAMS[name], REFERENCES[name][1], FEATURE_SHAPES[name])
    assert default_feature_paths(ours, torch.randn(2, 3, 32, 32))[-4:] == list(ours.stage_names)[-4:]


@pytest.mark.parametrize("name", NEW_MODELS)
def test_same_layers_in_the_same_order_compute_the_same_function(name):
    """The reference's weights, copied tensor by tensor in order, give the same logits: same layers, same wiring."""
    ours, ref = reference_pair(name, REFERENCES)
    load_randomised_reference(ours, ref)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", NEW_MODELS)
def test_any_channels_and_small_images(name):
    assert available_models()[name] == "cifar"
    model = build_model(name, 10, (1, 28, 28))
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    model = build_model(name, 10, (3, 8, 8))  # the smallest side the family takes
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 10)
