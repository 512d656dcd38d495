"""Tests of the model zoo (kdbench.models)."""

import sys

import pytest
import torch
from torch import nn

from kdbench.core.errors import KdbenchError
from kdbench.models import (
    available_models,
    build_model,
    check_model_name,
    count_params,
    register_model,
)

CIFAR_MODELS = [
    "resnet8", "resnet14", "resnet20", "resnet32", "resnet44", "resnet56", "resnet110",
    "resnet8x4", "resnet32x4", "wrn_16_1", "wrn_16_2", "wrn_40_1", "wrn_40_2",
    "cifar_vgg8", "cifar_vgg13",
]  # fmt: skip

# Millions of parameters with 100 classes, CRD paper (Tian et al. 2020).
PUBLISHED_PARAMS_M = {
    "resnet20": 0.28, "resnet56": 0.86, "resnet110": 1.74, "resnet8x4": 1.23,
    "resnet32x4": 7.43, "wrn_16_2": 0.70, "wrn_40_1": 0.57, "wrn_40_2": 2.26,
    "cifar_vgg13": 9.46, "cifar_vgg8": 3.96,
}  # fmt: skip


def _message(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("name", CIFAR_MODELS)
def test_cifar_model_output_and_params(name):
    model = build_model(name, num_classes=100, in_shape=(3, 32, 32))
    out = model(torch.randn(2, 3, 32, 32))
    assert isinstance(out, torch.Tensor)
    assert out.shape == (2, 100)
    if name in PUBLISHED_PARAMS_M:
        assert count_params(model) == pytest.approx(PUBLISHED_PARAMS_M[name] * 1e6, rel=0.03)
    for stage in model.stage_names:
        assert isinstance(model.get_submodule(stage), nn.Module)


@pytest.mark.parametrize("name", ["resnet20", "wrn_16_1", "cifar_vgg8"])
def test_cifar_model_on_grayscale_28px(name):
    model = build_model(name, num_classes=10, in_shape=(1, 28, 28))
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_cifar_model_on_smallest_image():
    model = build_model("cifar_vgg13", num_classes=10, in_shape=(3, 8, 8))
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 10)


def test_cifar_model_rejects_tiny_or_flat_input():
    for shape in [(3, 4, 4), (784,)]:
        with pytest.raises(KdbenchError) as excinfo:
            build_model("resnet20", num_classes=10, in_shape=shape)
        assert "data.shape" in _message(excinfo)


def test_linear_seed_model():
    model = build_model("linear", num_classes=10, in_shape=(1, 28, 28))
    assert count_params(model) == 784 * 10 + 10 == 7850
    assert model(torch.randn(4, 1, 28, 28)).shape == (4, 10)
    assert available_models()["linear"] == "toy"


def test_torchvision_resnet18():
    model = build_model("resnet18", num_classes=10, in_shape=(3, 64, 64))
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 10)


@pytest.mark.parametrize("name", ["mobilenet_v3_large", "googlenet"])
def test_torchvision_model_returns_tensor_in_train_mode(name):
    model = build_model(name, num_classes=10, in_shape=(3, 64, 64)).train()
    out = model(torch.randn(2, 3, 64, 64))
    assert type(out) is torch.Tensor
    assert out.shape == (2, 10)


def test_torchvision_model_needs_rgb_images():
    with pytest.raises(KdbenchError) as excinfo:
        build_model("resnet18", num_classes=10, in_shape=(1, 28, 28))
    message = _message(excinfo)
    assert "3-channel" in message and "[3, H, W]" in message


def test_available_models():
    models = available_models()
    assert list(models) == sorted(models)
    for name in ["resnet50", "mobilenet_v3_large", "vit_b_16", "vgg13"]:
        assert models[name] == "torchvision"
    for name in CIFAR_MODELS:
        assert models[name] == "cifar"
    assert "fasterrcnn_resnet50_fpn" not in models
    assert "deeplabv3_resnet50" not in models
    assert "r3d_18" not in models
    assert set(models.values()) == {"cifar", "torchvision", "toy"}


def test_unknown_model_suggests_nearest_names():
    with pytest.raises(KdbenchError) as excinfo:
        check_model_name("resnt20")
    message = _message(excinfo)
    assert "unknown model 'resnt20'" in message
    assert "did you mean resnet20" in message
    assert "kdbench list models" in message
    with pytest.raises(KdbenchError):
        build_model("resnt20", num_classes=10, in_shape=(3, 32, 32))


def test_known_names_pass_check():
    for name in ["resnet20", "linear", "resnet18", "vit_b_16"]:
        check_model_name(name)


def test_register_model_rejects_duplicates_and_unknown_families():
    with pytest.raises(ValueError):
        register_model("resnet20", "cifar")(lambda num_classes, in_shape: nn.Identity())
    with pytest.raises(ValueError):
        register_model("brand_new", "mystery")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module ``kdb_user_models`` on sys.path with a few model callables."""
    (tmp_path / "kdb_user_models.py").write_text(
        "from torch import nn\n"
        "def make(num_classes):\n"
        "    return nn.Linear(4, num_classes)\n"
        "class Net(nn.Sequential):\n"
        "    def __init__(self, in_shape, **kwargs):\n"
        "        super().__init__(nn.Flatten(), nn.Linear(in_shape[0], kwargs['num_classes']))\n"
        "def not_a_model():\n"
        "    return 'oops'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "kdb_user_models"
    sys.modules.pop("kdb_user_models", None)


def test_import_refused_without_allow_imports(user_module):
    with pytest.raises(KdbenchError) as excinfo:
        build_model(f"{user_module}:make", num_classes=3, in_shape=(4,))
    message = _message(excinfo)
    assert "allow_imports: true" in message and "--allow-imports" in message
    assert user_module not in sys.modules


def test_check_does_not_import_user_code(tmp_path, monkeypatch):
    # a package whose import would fail: the check finds its module without running the package's __init__
    (tmp_path / "kdb_loud").mkdir()
    (tmp_path / "kdb_loud" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (tmp_path / "kdb_loud" / "models.py").write_text("def make():\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    check_model_name("kdb_loud.models:make", allow_imports=True)
    assert "kdb_loud" not in sys.modules and "kdb_loud.models" not in sys.modules
    with pytest.raises(KdbenchError, match="no module named 'kdb_loud.nothing'"):  # issue 30: missing is one line
        check_model_name("kdb_loud.nothing:make", allow_imports=True)
    assert "kdb_loud" not in sys.modules
    with pytest.raises(KdbenchError):
        check_model_name("kdb_no_such_module:", allow_imports=True)


def test_import_builds_user_models(user_module):
    model = build_model(f"{user_module}:make", num_classes=3, in_shape=(4,), allow_imports=True)
    assert isinstance(model, nn.Linear) and model.out_features == 3
    model = build_model(f"{user_module}:Net", num_classes=5, in_shape=(6,), allow_imports=True)
    assert model(torch.randn(2, 6)).shape == (2, 5)


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("kdb_no_such_module:make", "no module named 'kdb_no_such_module'"),
        ("kdb_user_models:missing", "has no attribute 'missing'"),
        ("kdb_user_models:not_a_model", "returned str, not a torch.nn.Module"),
    ],
)
def test_import_errors_are_clear(user_module, name, fragment):
    with pytest.raises(KdbenchError) as excinfo:
        build_model(name, num_classes=3, in_shape=(4,), allow_imports=True)
    message = _message(excinfo)
    assert name in message and fragment in message


@pytest.mark.parametrize("name", ["resnet20", "cifar_vgg8", "resnet18", "linear"])
def test_construction_is_deterministic_under_seed(name):
    states = []
    for _ in range(2):
        torch.manual_seed(0)
        states.append(build_model(name, num_classes=10, in_shape=(3, 32, 32)).state_dict())
    assert states[0].keys() == states[1].keys()
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key


@pytest.mark.parametrize(
    "name,shape,fragment",
    [
        ("alexnet", (3, 32, 32), "at least 63x63"),
        ("inception_v3", (3, 64, 64), "at least 75x75"),
        ("maxvit_t", (3, 64, 64), "multiples of 224"),
        ("vit_b_16", (3, 40, 40), "patch size 16"),
        ("resnet18", (1, 64, 64), "3-channel"),
        ("resnet20", (3, 4, 4), "at least 8x8"),
    ],
)
def test_input_shapes_a_model_cannot_take_are_refused_before_building(name, shape, fragment):
    from kdbench.models import check_model_input

    with pytest.raises(KdbenchError, match=fragment):
        check_model_input(name, shape)


def test_vit_takes_its_image_size_from_the_data():
    torch.manual_seed(0)
    model = build_model("vit_b_32", 10, (3, 64, 64))
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 10)


def test_a_model_in_a_namespace_package_is_found_without_running_user_code(tmp_path, monkeypatch):
    """Folders without __init__.py (namespace packages, as tests/support is): each level is found through its
    parent's search path; looking a missing one up names it, and no module of the user's is imported."""
    from kdbench.models.registry import missing_module

    (tmp_path / "kdb_ns" / "inner").mkdir(parents=True)
    (tmp_path / "kdb_ns" / "inner" / "zoo.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("kdb_ns")]:
        monkeypatch.delitem(sys.modules, name)
    assert missing_module("kdb_ns.inner.zoo") is None
    assert missing_module("kdb_ns.inner.gone") == "kdb_ns.inner.gone"
    assert missing_module("kdb_ns.other.zoo") == "kdb_ns.other"
    assert "kdb_ns.inner.zoo" not in sys.modules
