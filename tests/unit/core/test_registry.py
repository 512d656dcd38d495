"""The one registry type (kdbench.core.registry) and the four registries built on it: register once, a lookup that
fails with one line naming the close and the known names."""

import pytest

from kdbench.core.errors import KdbenchError
from kdbench.core.registry import Registry


def test_a_name_is_registered_once_and_kept_in_order():
    reg = Registry("widget")
    assert reg.register("b", 2) == 2 and reg.register("a", 1) == 1
    assert list(reg) == ["b", "a"] and reg["a"] == 1 and reg.find("b") == 2
    with pytest.raises(ValueError, match=r"^widget 'a' is already registered$"):
        reg.register("a", 3)
    assert reg["a"] == 1
    reg.unregister("a")
    assert "a" not in reg and reg.register("a", 4) == 4


def test_an_unknown_name_is_one_line_with_the_close_and_the_known_names():
    reg = Registry("widget", tail=", or none")
    for name in ("sprocket", "gear", "spring"):
        reg.register(name, name.upper())
    with pytest.raises(KdbenchError) as err:
        reg.find("sprockt")
    line = "unknown widget 'sprockt': did you mean 'sprocket'? choose one of sprocket, gear, spring, or none"
    assert str(err.value) == line
    assert reg.unknown("zzz") == "unknown widget 'zzz': choose one of sprocket, gear, spring, or none"


def test_a_registry_may_write_its_own_line():
    reg = Registry("thing", unknown=lambda name: f"no thing {name}; see `list things`")
    with pytest.raises(KdbenchError, match=r"^no thing x; see `list things`$"):
        reg.find("x")


def test_the_four_registries_are_one_type_with_their_own_lines():
    from kdbench.distill.lm.divergences import DIVERGENCES, get_divergence
    from kdbench.distill.lm.impls import IMPLS, get_impl
    from kdbench.distill.losses import METHODS, check_method
    from kdbench.models import registry as models

    assert all(isinstance(r, Registry) for r in (DIVERGENCES, IMPLS, METHODS, models._REGISTRY))
    assert [r.kind for r in (DIVERGENCES, IMPLS, METHODS, models._REGISTRY)] == [
        "divergence",
        "loss implementation",
        "method",
        "model",
    ]
    with pytest.raises(KdbenchError) as err:
        get_impl("dens")
    impls = ", ".join(IMPLS)
    assert str(err.value) == f"unknown LM loss implementation 'dens': did you mean 'dense'? choose one of {impls}"
    with pytest.raises(KdbenchError) as err:
        get_divergence("jsdd")
    assert str(err.value) == (
        f"unknown divergence 'jsdd': did you mean 'jsd'? choose one of {', '.join(DIVERGENCES)}, or None for CE only"
    )
    with pytest.raises(KdbenchError) as err:
        check_method("fkl")
    assert str(err.value).startswith("unknown method 'fkl'; did you mean forward_kl? (`kdbench list methods` shows ")
    assert str(err.value).endswith("; combine with '+')") and "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"^loss implementation 'dense' is already registered$"):
        IMPLS.register("dense", IMPLS["dense"])
