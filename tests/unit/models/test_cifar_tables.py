"""suites/cifar100-tables.yaml: every pair of the CIFAR-100 tables is planned, and every method of the tables
runs on the heterogeneous pairs (a smoke subset of the suite, shrunk to a tiny batch and one timed call)."""

from __future__ import annotations

import pytest

from kdbench.config.load import load_suite
from kdbench.config.plan import Cell
from kdbench.hw.backends import resolve
from kdbench.measure.step import MeasureOptions
from kdbench.models import ModelCache
from kdbench.run.cell import measure_cell
from kdbench.workloads import expand_checked
from tests.support.paths import ROOT

SUITE = ROOT / "suites" / "cifar100-tables.yaml"
TABLE_1 = {
    ("wrn_40_2", "wrn_16_2"),
    ("wrn_40_2", "wrn_40_1"),
    ("resnet56", "resnet20"),
    ("resnet110", "resnet20"),
    ("resnet110", "resnet32"),
    ("resnet32x4", "resnet8x4"),
    ("cifar_vgg13", "cifar_vgg8"),
}
TABLE_2 = {  # CRD Table 2: a student of another family
    ("cifar_vgg13", "cifar_mobilenetv2"),
    ("cifar_resnet50", "cifar_mobilenetv2"),
    ("cifar_resnet50", "cifar_vgg8"),
    ("resnet32x4", "cifar_shufflev1"),
    ("resnet32x4", "cifar_shufflev2"),
    ("wrn_40_2", "cifar_shufflev1"),
}
NO_FIT_CHECK = MeasureOptions(fit_check=False)
METHODS = {"kd", "fitnet", "at", "rkd", "crd", "dkd", "reviewkd", "dist"}


@pytest.fixture(scope="module")
def cells():
    return expand_checked(load_suite(SUITE))


def test_the_suite_plans_every_pair_of_the_tables_with_every_method(cells):
    pairs = {(c.config.pair.teacher, c.config.pair.student) for c in cells}
    assert pairs == TABLE_1 | TABLE_2
    assert {c.config.method for c in cells} == METHODS
    assert {c.config.precision for c in cells} == {"fp32", "bf16"} and {c.config.batch_size for c in cells} == {64}
    assert len(cells) == 13 * 8 * 2


def _smoke(cell: Cell) -> Cell:
    c = cell.config
    small = c.model_copy(
        update={
            "batch_size": 8,
            "timing": c.timing.model_copy(update={"warmup": 0, "min_iters": 1, "min_time_s": 0.0}),
            "inference": c.inference.model_copy(update={"batch_sizes": [2], "teacher": False}),
        }
    )
    return Cell(cell.index, cell.cell_id, small)


HETERO_SMOKE = [
    ("resnet32x4", "cifar_shufflev1"),
    ("cifar_vgg13", "cifar_mobilenetv2"),
    ("resnet32x4", "cifar_shufflev2"),
]


@pytest.mark.parametrize("pair", HETERO_SMOKE, ids=lambda p: f"{p[0]}->{p[1]}")
def test_every_method_runs_on_a_heterogeneous_pair(cells, pair):
    cache = ModelCache()
    cpu = resolve("cpu")
    chosen = [
        c for c in cells if (c.config.pair.teacher, c.config.pair.student) == pair and c.config.precision == "fp32"
    ]
    assert {c.config.method for c in chosen} == METHODS
    for cell in chosen:
        rows = measure_cell(_smoke(cell), cpu, cache, NO_FIT_CHECK)  # the methods run: the fit check is tested apart
        statuses = [(r["measurement"], r["status"], r.get("error")) for r in rows]
        assert all(r["status"] == "ok" for r in rows), (cell.config.method, statuses)
        step = rows[0]
        assert step["final_loss"] > 0 and step["flops"] > 0, cell.config.method
        if cell.config.method in ("fitnet", "at", "rkd", "crd", "reviewkd"):
            assert step["student_features"], cell.config.method  # the stage ends were found and paired
