import pytest

from kdbench.config.schema import CellConfig
from kdbench.hw.backends import resolve


@pytest.fixture
def cpu():
    return resolve("cpu")


def make_config(**overrides) -> CellConfig:
    """A small valid cell: resnet8 -> resnet8 on 3x16x16 inputs, quick timing."""
    raw = {
        "pair": {"teacher": "resnet8", "student": "resnet8"},
        "batch_size": 4,
        "data": {"kind": "synthetic", "shape": [3, 16, 16], "num_classes": 10},
        "timing": {"warmup": 1, "min_iters": 3, "min_time_s": 0.0},
        "inference": {"batch_sizes": [1, 4]},
    }
    raw.update(overrides)
    return CellConfig.model_validate(raw)
