"""Bytes as text (kdbench.core.sizes): one unit table for the fit's sizes and the allocators' messages."""

import pytest

from kdbench.core.sizes import GIB, UNITS, gib, read_size, to_bytes


@pytest.mark.parametrize(
    "text, value",
    [("141GB", 141e9), ("80 GiB", 80 * 2**30), ("192e9", 192e9), ("1.5tb", 1.5e12), ("0.4", 0.4), ("-1GB", -1e9)],
)
def test_a_size_reads_to_its_bytes_unrounded_with_its_sign(text, value):
    assert read_size(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["eighty", "80 GX", "1,5TB", "", "GB"])
def test_what_is_not_a_size_reads_as_none(text):
    assert read_size(text) is None


def test_units_are_decimal_or_binary_by_their_name_in_any_case():
    assert to_bytes("1.50", "GiB") == to_bytes(1.5, "gib") == 3 * 2**29
    assert to_bytes(2, "KB") == 2000 and to_bytes(2, "KiB") == 2048 and to_bytes(3, "B") == 3
    assert UNITS["g"] == UNITS["gb"] == 10**9
    with pytest.raises(KeyError):
        to_bytes(1, "GX")


def test_gib_prints_two_decimals():
    assert gib(141 * 10**9) == "131.32 GiB" and gib(GIB) == "1.00 GiB"
