"""The mobile CIFAR-100 students of the distillation tables (ShuffleV1, ShuffleV2, MobileNetV2) against the
reference code, and a distillation step from a teacher of another architecture."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kdbench.distill.hooks import FeatureTap, default_feature_paths
from kdbench.models import available_models, build_model
from tests.support.reference_match import assert_matches_reference, load_randomised_reference, reference_pair

# --- the reference code ---------------------------------------------------------------------------------------
# HobbitLong/RepDistiller at commit b84f547c5db6a35318d4671d7d5c4de74c822403:
#   models/ShuffleNetv1.py (ShuffleBlock, Bottleneck, ShuffleNet, ShuffleV1),
#   models/ShuffleNetv2.py (ShuffleBlock, SplitBlock, BasicBlock, DownBlock, ShuffleNetV2, configs[1], ShuffleV2),
#   models/mobilenetv2.py (conv_bn, conv_1x1_bn, InvertedResidual, MobileNetV2, mobilenetv2_T_w, mobile_half);
# https://github.com/HobbitLong/RepDistiller/tree/b84f547c5db6a35318d4671d7d5c4de74c822403/models
# mdistiller's CIFAR zoo (megvii-research/mdistiller, mdistiller/models/cifar/) carries the same classes.
# Trimmed to what builds these three models and returns their features: one ShuffleBlock for both ShuffleNets
# (v2's only adds the default groups=2), no get_feat_modules / get_bn_before_relu, ShuffleNetV2's configs
# reduced to net size 1, MobileNetV2's print and remove_avg dropped; the rest as written, Python 3 super().


class RefShuffleBlock(nn.Module):
    def __init__(self, groups=2):
        super().__init__()
        self.groups = groups

    def forward(self, x):
        """Channel shuffle: [N,C,H,W] -> [N,g,C/g,H,W] -> [N,C/g,g,H,w] -> [N,C,H,W]"""
        N, C, H, W = x.size()
        g = self.groups
        return x.view(N, g, C // g, H, W).permute(0, 2, 1, 3, 4).reshape(N, C, H, W)


class RefBottleneckV1(nn.Module):
    def __init__(self, in_planes, out_planes, stride, groups, is_last=False):
        super().__init__()
        self.is_last = is_last
        self.stride = stride

        mid_planes = int(out_planes / 4)
        g = 1 if in_planes == 24 else groups
        self.conv1 = nn.Conv2d(in_planes, mid_planes, kernel_size=1, groups=g, bias=False)
        self.bn1 = nn.BatchNorm2d(mid_planes)
        self.shuffle1 = RefShuffleBlock(groups=g)
        self.conv2 = nn.Conv2d(
            mid_planes, mid_planes, kernel_size=3, stride=stride, padding=1, groups=mid_planes, bias=False
        )
        self.bn2 = nn.BatchNorm2d(mid_planes)
        self.conv3 = nn.Conv2d(mid_planes, out_planes, kernel_size=1, groups=groups, bias=False)
        self.bn3 = nn.BatchNorm2d(out_planes)

        self.shortcut = nn.Sequential()
        if stride == 2:
            self.shortcut = nn.Sequential(nn.AvgPool2d(3, stride=2, padding=1))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.shuffle1(out)
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        res = self.shortcut(x)
        preact = torch.cat([out, res], 1) if self.stride == 2 else out + res
        out = F.relu(preact)
        if self.is_last:
            return out, preact
        else:
            return out


class RefShuffleNet(nn.Module):
    def __init__(self, cfg, num_classes=10):
        super().__init__()
        out_planes = cfg["out_planes"]
        num_blocks = cfg["num_blocks"]
        groups = cfg["groups"]

        self.conv1 = nn.Conv2d(3, 24, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(24)
        self.in_planes = 24
        self.layer1 = self._make_layer(out_planes[0], num_blocks[0], groups)
        self.layer2 = self._make_layer(out_planes[1], num_blocks[1], groups)
        self.layer3 = self._make_layer(out_planes[2], num_blocks[2], groups)
        self.linear = nn.Linear(out_planes[2], num_classes)

    def _make_layer(self, out_planes, num_blocks, groups):
        layers = []
        for i in range(num_blocks):
            stride = 2 if i == 0 else 1
            cat_planes = self.in_planes if i == 0 else 0
            layers.append(
                RefBottleneckV1(
                    self.in_planes,
                    out_planes - cat_planes,
                    stride=stride,
                    groups=groups,
                    is_last=(i == num_blocks - 1),
                )
            )
            self.in_planes = out_planes
        return nn.Sequential(*layers)

    def forward(self, x, is_feat=False, preact=False):
        out = F.relu(self.bn1(self.conv1(x)))
        f0 = out
        out, f1_pre = self.layer1(out)
        f1 = out
        out, f2_pre = self.layer2(out)
        f2 = out
        out, f3_pre = self.layer3(out)
        f3 = out
        out = F.avg_pool2d(out, 4)
        out = out.view(out.size(0), -1)
        f4 = out
        out = self.linear(out)

        if is_feat:
            if preact:
                return [f0, f1_pre, f2_pre, f3_pre, f4], out
            else:
                return [f0, f1, f2, f3, f4], out
        else:
            return out


def RefShuffleV1(**kwargs):
    cfg = {"out_planes": [240, 480, 960], "num_blocks": [4, 8, 4], "groups": 3}
    return RefShuffleNet(cfg, **kwargs)


class RefSplitBlock(nn.Module):
    def __init__(self, ratio):
        super().__init__()
        self.ratio = ratio

    def forward(self, x):
        c = int(x.size(1) * self.ratio)
        return x[:, :c, :, :], x[:, c:, :, :]


class RefBasicBlockV2(nn.Module):
    def __init__(self, in_channels, split_ratio=0.5, is_last=False):
        super().__init__()
        self.is_last = is_last
        self.split = RefSplitBlock(split_ratio)
        in_channels = int(in_channels * split_ratio)
        self.conv1 = nn.Conv2d(in_channels, in_channels, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.conv2 = nn.Conv2d(
            in_channels, in_channels, kernel_size=3, stride=1, padding=1, groups=in_channels, bias=False
        )
        self.bn2 = nn.BatchNorm2d(in_channels)
        self.conv3 = nn.Conv2d(in_channels, in_channels, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(in_channels)
        self.shuffle = RefShuffleBlock()

    def forward(self, x):
        x1, x2 = self.split(x)
        out = F.relu(self.bn1(self.conv1(x2)))
        out = self.bn2(self.conv2(out))
        preact = self.bn3(self.conv3(out))
        out = F.relu(preact)
        preact = torch.cat([x1, preact], 1)
        out = torch.cat([x1, out], 1)
        out = self.shuffle(out)
        if self.is_last:
            return out, preact
        else:
            return out


class RefDownBlock(nn.Module):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        mid_channels = out_channels // 2
        # left
        self.conv1 = nn.Conv2d(
            in_channels, in_channels, kernel_size=3, stride=2, padding=1, groups=in_channels, bias=False
        )
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.conv2 = nn.Conv2d(in_channels, mid_channels, kernel_size=1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid_channels)
        # right
        self.conv3 = nn.Conv2d(in_channels, mid_channels, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(mid_channels)
        self.conv4 = nn.Conv2d(
            mid_channels, mid_channels, kernel_size=3, stride=2, padding=1, groups=mid_channels, bias=False
        )
        self.bn4 = nn.BatchNorm2d(mid_channels)
        self.conv5 = nn.Conv2d(mid_channels, mid_channels, kernel_size=1, bias=False)
        self.bn5 = nn.BatchNorm2d(mid_channels)

        self.shuffle = RefShuffleBlock()

    def forward(self, x):
        # left
        out1 = self.bn1(self.conv1(x))
        out1 = F.relu(self.bn2(self.conv2(out1)))
        # right
        out2 = F.relu(self.bn3(self.conv3(x)))
        out2 = self.bn4(self.conv4(out2))
        out2 = F.relu(self.bn5(self.conv5(out2)))
        # concat
        out = torch.cat([out1, out2], 1)
        out = self.shuffle(out)
        return out


ref_configs = {1: {"out_channels": (116, 232, 464, 1024), "num_blocks": (3, 7, 3)}}


class RefShuffleNetV2(nn.Module):
    def __init__(self, net_size, num_classes=10):
        super().__init__()
        out_channels = ref_configs[net_size]["out_channels"]
        num_blocks = ref_configs[net_size]["num_blocks"]

        self.conv1 = nn.Conv2d(3, 24, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(24)
        self.in_channels = 24
        self.layer1 = self._make_layer(out_channels[0], num_blocks[0])
        self.layer2 = self._make_layer(out_channels[1], num_blocks[1])
        self.layer3 = self._make_layer(out_channels[2], num_blocks[2])
        self.conv2 = nn.Conv2d(out_channels[2], out_channels[3], kernel_size=1, stride=1, padding=0, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels[3])
        self.linear = nn.Linear(out_channels[3], num_classes)

    def _make_layer(self, out_channels, num_blocks):
        layers = [RefDownBlock(self.in_channels, out_channels)]
        for i in range(num_blocks):
            layers.append(RefBasicBlockV2(out_channels, is_last=(i == num_blocks - 1)))
            self.in_channels = out_channels
        return nn.Sequential(*layers)

    def forward(self, x, is_feat=False, preact=False):
        out = F.relu(self.bn1(self.conv1(x)))
        f0 = out
        out, f1_pre = self.layer1(out)
        f1 = out
        out, f2_pre = self.layer2(out)
        f2 = out
        out, f3_pre = self.layer3(out)
        f3 = out
        out = F.relu(self.bn2(self.conv2(out)))
        out = F.avg_pool2d(out, 4)
        out = out.view(out.size(0), -1)
        f4 = out
        out = self.linear(out)
        if is_feat:
            if preact:
                return [f0, f1_pre, f2_pre, f3_pre, f4], out
            else:
                return [f0, f1, f2, f3, f4], out
        else:
            return out


def RefShuffleV2(**kwargs):
    return RefShuffleNetV2(net_size=1, **kwargs)


def ref_conv_bn(inp, oup, stride):
    return nn.Sequential(nn.Conv2d(inp, oup, 3, stride, 1, bias=False), nn.BatchNorm2d(oup), nn.ReLU(inplace=True))


def ref_conv_1x1_bn(inp, oup):
    return nn.Sequential(nn.Conv2d(inp, oup, 1, 1, 0, bias=False), nn.BatchNorm2d(oup), nn.ReLU(inplace=True))


class RefInvertedResidual(nn.Module):
    def __init__(self, inp, oup, stride, expand_ratio):
        super().__init__()
        self.blockname = None

        self.stride = stride
        assert stride in [1, 2]

        self.use_res_connect = self.stride == 1 and inp == oup

        self.conv = nn.Sequential(
            # pw
            nn.Conv2d(inp, inp * expand_ratio, 1, 1, 0, bias=False),
            nn.BatchNorm2d(inp * expand_ratio),
            nn.ReLU(inplace=True),
            # dw
            nn.Conv2d(inp * expand_ratio, inp * expand_ratio, 3, stride, 1, groups=inp * expand_ratio, bias=False),
            nn.BatchNorm2d(inp * expand_ratio),
            nn.ReLU(inplace=True),
            # pw-linear
            nn.Conv2d(inp * expand_ratio, oup, 1, 1, 0, bias=False),
            nn.BatchNorm2d(oup),
        )
        self.names = ["0", "1", "2", "3", "4", "5", "6", "7"]

    def forward(self, x):
        t = x
        if self.use_res_connect:
            return t + self.conv(x)
        else:
            return self.conv(x)


class RefMobileNetV2(nn.Module):
    """mobilenetV2"""

    def __init__(self, T, feature_dim, input_size=32, width_mult=1.0):
        super().__init__()

        # setting of inverted residual blocks
        self.interverted_residual_setting = [
            # t, c, n, s
            [1, 16, 1, 1],
            [T, 24, 2, 1],
            [T, 32, 3, 2],
            [T, 64, 4, 2],
            [T, 96, 3, 1],
            [T, 160, 3, 2],
            [T, 320, 1, 1],
        ]

        # building first layer
        assert input_size % 32 == 0
        input_channel = int(32 * width_mult)
        self.conv1 = ref_conv_bn(3, input_channel, 2)

        # building inverted residual blocks
        self.blocks = nn.ModuleList([])
        for t, c, n, s in self.interverted_residual_setting:
            output_channel = int(c * width_mult)
            layers = []
            strides = [s] + [1] * (n - 1)
            for stride in strides:
                layers.append(RefInvertedResidual(input_channel, output_channel, stride, t))
                input_channel = output_channel
            self.blocks.append(nn.Sequential(*layers))

        self.last_channel = int(1280 * width_mult) if width_mult > 1.0 else 1280
        self.conv2 = ref_conv_1x1_bn(input_channel, self.last_channel)

        # building classifier
        self.classifier = nn.Sequential(
            # nn.Dropout(0.5),
            nn.Linear(self.last_channel, feature_dim),
        )

        H = input_size // (32 // 2)
        self.avgpool = nn.AvgPool2d(H, ceil_mode=True)

        self._initialize_weights()

    def forward(self, x, is_feat=False, preact=False):
        out = self.conv1(x)
        f0 = out

        out = self.blocks[0](out)
        out = self.blocks[1](out)
        f1 = out
        out = self.blocks[2](out)
        f2 = out
        out = self.blocks[3](out)
        out = self.blocks[4](out)
        f3 = out
        out = self.blocks[5](out)
        out = self.blocks[6](out)
        f4 = out

        out = self.conv2(out)

        out = self.avgpool(out)
        out = out.view(out.size(0), -1)
        f5 = out
        out = self.classifier(out)

        if is_feat:
            return [f0, f1, f2, f3, f4, f5], out
        else:
            return out

    def _initialize_weights(self):
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                n = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
                m.weight.data.normal_(0, math.sqrt(2.0 / n))
                if m.bias is not None:
                    m.bias.data.zero_()
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.data.fill_(1)
                m.bias.data.zero_()
            elif isinstance(m, nn.Linear):
                n = m.weight.size(1)
                m.weight.data.normal_(0, 0.01)
                m.bias.data.zero_()


def ref_mobilenetv2_T_w(T, W, feature_dim=100):
    return RefMobileNetV2(T=T, feature_dim=feature_dim, width_mult=W)


def ref_mobile_half(num_classes):
    return ref_mobilenetv2_T_w(6, 0.5, num_classes)


# --- kdbench's models against them -------------------------------------------------------------------------------

# name -> (reference builder, which of the reference's is_feat features the stage_names are)
REFERENCES = {
    "cifar_shufflev1": (RefShuffleV1, slice(1, 4)),  # f1..f3 = layer1..layer3 (f4 is the pooled vector)
    "cifar_shufflev2": (RefShuffleV2, slice(1, 4)),  # f1..f3 = layer1..layer3 (f4: the pooled conv2 head)
    "cifar_mobilenetv2": (ref_mobile_half, slice(1, 5)),  # f1..f4 = blocks.1/2/4/6
}
NEW_MODELS = list(REFERENCES)

# Feature shapes (C, H, W) at 3x32x32, as the reference's forward(is_feat=True) returns them (checked below).
FEATURE_SHAPES = {
    "cifar_shufflev1": [(240, 16, 16), (480, 8, 8), (960, 4, 4)],
    "cifar_shufflev2": [(116, 16, 16), (232, 8, 8), (464, 4, 4)],
    "cifar_mobilenetv2": [(12, 16, 16), (16, 8, 8), (48, 4, 4), (160, 2, 2)],
}

# Parameters at 100 classes, counted from the reference code (the CRD paper's tables: 0.95 M, 1.35 M, 0.81 M).
PARAMS = {
    "cifar_shufflev1": 949_258,
    "cifar_shufflev2": 1_355_528,
    "cifar_mobilenetv2": 812_836,
}


pytestmark = pytest.mark.usefixtures("one_thread", "seeded")  # tests/conftest.py


@pytest.mark.parametrize("name", NEW_MODELS)
def test_matches_the_reference_at_cifar100(name):
    ours, ref = reference_pair(name, REFERENCES)
    assert_matches_reference(ours, ref, PARAMS[name], REFERENCES[name][1], FEATURE_SHAPES[name])
    assert default_feature_paths(ours, torch.randn(2, 3, 32, 32)) == list(ours.stage_names)


@pytest.mark.parametrize("name", NEW_MODELS)
def test_same_layers_in_the_same_order_compute_the_same_function(name):
    """The reference's weights, copied tensor by tensor in order, give the same logits and the same stage
    features: same layers, same wiring, same channel order after each shuffle."""
    ours, ref = reference_pair(name, REFERENCES)
    load_randomised_reference(ours, ref)
    x = torch.randn(2, 3, 32, 32)
    tap = FeatureTap(ours, list(ours.stage_names))
    with torch.no_grad():
        out = ours(x)
        ref_feats, ref_out = ref(x, is_feat=True)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    for mine, theirs in zip(tap.take(), ref_feats[REFERENCES[name][1]]):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", NEW_MODELS)
def test_any_channels_and_image_sizes(name):
    assert available_models()[name] == "cifar"
    assert build_model(name, 100, (3, 32, 32))(torch.randn(2, 3, 32, 32)).shape == (2, 100)
    for classes, shape in [(10, (1, 28, 28)), (100, (3, 64, 64)), (10, (3, 8, 8))]:
        model = build_model(name, classes, shape).eval()
        with torch.no_grad():
            assert model(torch.randn(2, *shape)).shape == (2, classes), shape


# Every method with a teacher of another architecture: tests/unit/models/test_cifar_tables.py (the tables' pairs).
