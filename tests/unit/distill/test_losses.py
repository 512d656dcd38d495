"""The KD loss against a hand computation (pure Python floats, no torch)."""

import math

import pytest
import torch

from kdbench.core.errors import KdbenchError
from kdbench.distill.losses import METHODS, check_method
from kdbench.distill.losses.kd import KDParams, kd_loss


def _softmax(z):
    m = max(z)
    e = [math.exp(v - m) for v in z]
    return [v / sum(e) for v in e]


def _hand_kd(s_rows, t_rows, labels, T, alpha):
    kl_sum = 0.0
    ce_sum = 0.0
    for s, t, y in zip(s_rows, t_rows, labels):
        p_t = _softmax([v / T for v in t])
        p_s = _softmax([v / T for v in s])
        kl_sum += sum(pt * (math.log(pt) - math.log(ps)) for pt, ps in zip(p_t, p_s))
        ce_sum += -math.log(_softmax(s)[y])
    n = len(labels)
    return alpha * T * T * (kl_sum / n) + (1 - alpha) * (ce_sum / n)


S = [[1.0, 2.0, 3.0, -1.0], [0.5, -0.5, 2.5, 1.0]]
TT = [[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 4.0, -2.0]]
Y = [2, 1]


@pytest.mark.parametrize("T,alpha", [(2.0, 0.7), (4.0, 0.9), (1.0, 0.0), (3.0, 1.0)])
def test_kd_loss_matches_hand_computation(T, alpha):
    got = kd_loss(torch.tensor(S), torch.tensor(TT), torch.tensor(Y), T, alpha)
    assert got.item() == pytest.approx(_hand_kd(S, TT, Y, T, alpha), rel=1e-5)


def test_kd_uses_batchmean_and_t_squared():
    # alpha = 1: only the soft term; it scales with T^2 and divides by the batch size, not the element count.
    s, t, y = torch.tensor(S), torch.tensor(TT), torch.tensor(Y)
    T = 3.0
    got = kd_loss(s, t, y, T, 1.0).item()
    kl_sum = 0.0
    for srow, trow in zip(S, TT):
        p_t, p_s = _softmax([v / T for v in trow]), _softmax([v / T for v in srow])
        kl_sum += sum(a * (math.log(a) - math.log(b)) for a, b in zip(p_t, p_s))
    assert got == pytest.approx(T * T * kl_sum / 2, rel=1e-5)
    assert got != pytest.approx(T * T * kl_sum / 8, rel=1e-3)  # not the element mean


def test_kd_loss_is_fp32_for_half_inputs():
    s = torch.tensor(S, dtype=torch.bfloat16)
    t = torch.tensor(TT, dtype=torch.float16)
    loss = kd_loss(s, t, torch.tensor(Y), 4.0, 0.9)
    assert loss.dtype == torch.float32
    expected = _hand_kd(s.float().tolist(), t.float().tolist(), Y, 4.0, 0.9)
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_identical_logits_leave_only_ce():
    s = torch.tensor(S)
    loss = kd_loss(s, s.clone(), torch.tensor(Y), 4.0, 0.9).item()
    ce = sum(-math.log(_softmax(row)[y]) for row, y in zip(S, Y)) / 2
    assert loss == pytest.approx(0.1 * ce, rel=1e-5)


def test_registry_and_unknown_method():
    assert "kd" in METHODS and METHODS["kd"].params is KDParams
    with pytest.raises(KdbenchError, match="did you mean kd"):
        check_method("kdd")


def test_each_method_brings_its_own_suite_key_and_defaults():
    # The cell schema is built from the registry: a method's file is all it takes to add one.
    from kdbench.config.schema import CellConfig

    config = CellConfig.model_validate({"pair": {"teacher": "a", "student": "b"}, "kd": {"temperature": 2.0}})
    for name, method in METHODS.items():
        assert CellConfig.model_fields[name].annotation is method.params
    assert (config.kd.temperature, config.kd.alpha) == (2.0, 0.9)
    assert config.dkd == METHODS["dkd"].params() and config.dkd.beta == 8.0


def test_the_cell_schema_has_every_method_whatever_is_imported_first():
    import subprocess
    import sys

    script = (
        "import kdbench.distill.losses.at\n"  # a method module first: the schema must still see them all
        "from kdbench.config.schema import CellConfig\n"
        "from kdbench.distill.losses import METHODS\n"
        "print(sorted(set(METHODS) - set(CellConfig.model_fields)), len(METHODS))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert out[:1] == ["[]"] and int(out[1]) >= 4
