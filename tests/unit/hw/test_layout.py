import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models import resnet18, squeezenet1_0

from kdbench.core.errors import KdbenchError
from kdbench.hw.layout import (
    ALIGNMENTS,
    pad_classifier,
    place_aligned,
    realised_alignment,
    unpad,
    verify_memory_format,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8]


def _sample(dtype):
    if dtype.is_floating_point:
        return torch.randn(3, 5, 7).to(dtype)
    return torch.randint(0, 200, (3, 5, 7), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alignment", [*ALIGNMENTS, 128, 256])
def test_place_aligned(alignment, dtype):
    t = _sample(dtype)
    out = place_aligned(t, alignment)
    assert torch.equal(out, t)
    assert (out.shape, out.dtype, out.stride()) == (t.shape, t.dtype, t.stride())
    assert out.data_ptr() != t.data_ptr()
    ptr = out.data_ptr()
    a = max(alignment, t.element_size())
    if alignment >= 64:
        assert ptr % alignment == 0
        assert realised_alignment(ptr) >= alignment
    else:
        assert ptr % 64 != 0
        assert ptr % (2 * a) == a
        assert realised_alignment(ptr) == a


def test_alignment_finer_than_itemsize_uses_itemsize():
    out = place_aligned(torch.arange(10), 4)  # int64
    assert realised_alignment(out.data_ptr()) == 8
    assert torch.equal(out, torch.arange(10))


@pytest.mark.parametrize("alignment", [64, 4])
def test_place_aligned_keeps_channels_last(alignment):
    t = torch.randn(2, 3, 5, 7).half().contiguous(memory_format=torch.channels_last)
    out = place_aligned(t, alignment)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert not out.is_contiguous()
    assert out.stride() == t.stride()
    assert torch.equal(out, t)
    if alignment < 64:
        assert realised_alignment(out.data_ptr()) == alignment
    else:
        assert out.data_ptr() % 64 == 0


@pytest.mark.parametrize("alignment", [48, 0, 8192, -4])
def test_place_aligned_rejects_bad_alignment(alignment):
    with pytest.raises(ValueError):
        place_aligned(torch.zeros(4), alignment)


def test_realised_alignment():
    assert realised_alignment(64) == 64
    assert realised_alignment(96) == 32
    assert realised_alignment(4100) == 4
    assert realised_alignment(0) == 4096
    assert realised_alignment(1 << 20) == 4096


def _linear_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 10))


def test_pad_linear_classifier():
    model = _linear_model()
    ref = _linear_model()
    old = model[1]
    assert pad_classifier(model, 10, 8) == 16
    new = model[1]
    assert new is not old and isinstance(new, nn.Linear)
    assert (new.in_features, new.out_features) == (12, 16)
    assert torch.equal(new.weight[:10], old.weight) and torch.equal(new.bias[:10], old.bias)
    assert torch.count_nonzero(new.weight[10:]) == 0 and torch.count_nonzero(new.bias[10:]) == 0
    x = torch.randn(4, 3, 2, 2)
    out = model(x)
    assert out.shape == (4, 16)
    # A 16-wide GEMM need not round like a 10-wide one (BLAS picks kernels by shape and CPU): equal to float eps.
    torch.testing.assert_close(unpad(out, 10), ref(x), rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(out[..., 10:]) == 0


def test_pad_resnet18():
    model = resnet18(weights=None, num_classes=10)
    assert pad_classifier(model, 10, 16) == 16
    assert model.fc.out_features == 16


def test_pad_squeezenet_conv_classifier():
    model = squeezenet1_0(weights=None, num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = model(x)
    assert pad_classifier(model, 10, 8) == 16
    final = [m for m in model.modules() if isinstance(m, nn.Conv2d)][-1]
    assert final.out_channels == 16
    with torch.no_grad():
        out = model(x)
    assert out.shape == (2, 16)
    torch.testing.assert_close(unpad(out, 10), ref)
    assert torch.count_nonzero(out[:, 10:]) == 0


@pytest.mark.parametrize("num_classes, pad_to", [(10, 1), (16, 8), (10, 10)])
def test_pad_noop_leaves_module(num_classes, pad_to):
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, num_classes))
    head = model[1]
    assert pad_classifier(model, num_classes, pad_to) == num_classes
    assert model[1] is head


@pytest.mark.parametrize("model", [nn.Sequential(nn.Linear(12, 7), nn.ReLU()), nn.Linear(12, 10)])
def test_pad_without_classifier_raises(model):
    with pytest.raises(KdbenchError) as info:
        pad_classifier(model, 10, 8)
    message = str(info.value)
    assert "\n" not in message
    assert type(model).__name__ in message and "pad_to: 1" in message


def test_pad_to_must_be_positive():
    with pytest.raises(ValueError):
        pad_classifier(_linear_model(), 10, 0)


def test_unpad():
    logits = torch.arange(2 * 3 * 16, dtype=torch.float32).reshape(2, 3, 16)
    out = unpad(logits, 10)
    assert out.shape == (2, 3, 10)
    assert torch.equal(out, logits[:, :, :10])


def test_padded_rows_get_no_gradient():
    model = _linear_model()
    pad_classifier(model, 10, 8)
    x, y = torch.randn(8, 12), torch.randint(0, 10, (8,))
    F.cross_entropy(unpad(model(x), 10), y).backward()
    head = model[1]
    assert torch.count_nonzero(head.weight.grad[10:]) == 0
    assert torch.count_nonzero(head.bias.grad[10:]) == 0
    assert torch.count_nonzero(head.weight.grad[:10]) > 0


def _conv_net():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.Flatten())


def test_verify_memory_format():
    cl = torch.channels_last
    model = _conv_net().to(memory_format=cl)
    x = torch.randn(2, 3, 9, 9).contiguous(memory_format=cl)
    assert verify_memory_format(model, x, "channels_last")
    assert not verify_memory_format(model, x, "contiguous")
    plain = _conv_net()
    x = torch.randn(2, 3, 9, 9)
    assert verify_memory_format(plain, x, "contiguous")
    assert not verify_memory_format(plain, x, "channels_last")
    with pytest.raises(ValueError):
        verify_memory_format(plain, x, "nhwc")
