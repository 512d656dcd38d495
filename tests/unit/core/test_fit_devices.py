"""The fit planner's devices: sizes as users write them, the device table and its sources, the headroom model."""

import pytest

from kdbench.core.errors import KdbenchError
from kdbench.core.sizes import GB, GIB
from kdbench.fit.devices import DEVICES, find_device, parse_size


@pytest.mark.parametrize(
    "text, nbytes",
    [
        ("141GB", 141_000_000_000),
        ("80GiB", 80 * 2**30),
        ("141 GB", 141_000_000_000),
        ("192e9", 192_000_000_000),
        ("1.5TB", 1_500_000_000_000),
        ("1.5 TiB", 3 * 2**39),
        ("80gib", 85_899_345_920),
        ("512MiB", 2**29),
        ("1024", 1024),
        (" 24 GB ", 24_000_000_000),
        ("0.5GiB", 2**29),
        ("1.5k", 1500),  # the bare letters are decimal
        ("2g", 2_000_000_000),
    ],
)
def test_sizes_parse_to_exact_bytes(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["eighty", "80 GX", "80GB of HBM", "", "GB", "1,5TB", "0x50GB"])
def test_what_is_not_a_size_is_one_line_naming_the_flag(text):
    with pytest.raises(KdbenchError) as err:
        parse_size(text)
    message = str(err.value)
    assert message.startswith(f"--device-memory {text!r}: not a size") and "GB = 10^9" in message
    assert "GiB = 2^30" in message and "\n" not in message


@pytest.mark.parametrize("text", ["0", "0GB", "-80GB", "-1", "0.1", "0.6"])  # 0.6 bytes is not rounded up to 1
def test_zero_and_negative_sizes_are_refused(text):
    with pytest.raises(KdbenchError, match=r"^--device-memory .*: must be a positive size, e\.g\. 80GB$"):
        parse_size(text)


def test_the_table_has_each_device_with_its_memory_and_a_source():
    memory = {d.name: d.memory_bytes for d in DEVICES}
    assert memory == {
        "H100 80GB": 80 * GB,
        "H100 NVL": 94 * GB,
        "H200": 141 * GB,
        "A100 40GB": 40 * GB,
        "A100 80GB": 80 * GB,
        "H100 PCIe": 80 * GB,
        "L4": 24 * GB,
        "T4": 16 * GB,
        "MI300X": 192 * GB,
        "MI325X": 256 * GB,
        "MI250X": 64 * GB,  # one GCD of the package's two: what a rank gets
        "MI210": 64 * GB,
    }
    for d in DEVICES:
        assert d.kind == "gpu"
        vendor = "nvidia.com" if d.name[0] in "HALT" else "amd.com"
        assert "datasheet" in d.source.lower().replace(" ", "") or "data sheet" in d.source.lower()
        assert f"https://www.{vendor}/" in d.source, d.source
        # the source states the figure the table holds (the MI250X: the package's 128 GB, its GCD said in the note)
        figure = 128 if d.name == "MI250X" else d.memory_bytes // GB
        assert f"{figure} GB" in d.source, d.source
    mi250x = find_device("MI250X")
    assert "two graphics compute dies of 64 GB" in mi250x.note


@pytest.mark.parametrize(
    "name, device",
    [
        ("h100", "H100 80GB"),
        ("H100-80GB", "H100 80GB"),
        ("h100_sxm", "H100 80GB"),
        ("H100 NVL", "H100 NVL"),
        ("h100-nvl", "H100 NVL"),
        ("mi300x", "MI300X"),
        ("MI-300X", "MI300X"),
        (" h200 ", "H200"),
        ("a100-40gb", "A100 40GB"),
        ("A100", "A100 80GB"),
        ("mi250x", "MI250X"),
        ("t4", "T4"),
        ("h100 pcie", "H100 PCIe"),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB"),  # the name torch reports finds the card too
        ("nvidia h100 80gb hbm3", "H100 80GB"),
        ("c-p-u", "cpu"),
    ],
)
def test_names_ignore_case_spaces_and_dashes(name, device):
    assert find_device(name).name == device


def test_an_unknown_device_says_the_close_names_and_the_way_out():
    with pytest.raises(KdbenchError) as err:
        find_device("H10")
    message = str(err.value)
    assert message.startswith("--gpu H10: unknown device; did you mean ")
    close = message.split("did you mean ")[1].split("?")[0].split(", ")
    assert {"H200", "H100 NVL"} <= set(close) and "MI300X" not in close
    assert "known: H100 80GB, H100 NVL, H200" in message and "cpu" in message and "--device-memory SIZE" in message
    with pytest.raises(KdbenchError, match="did you mean MI300X"):
        find_device("mi300")
    with pytest.raises(KdbenchError, match=r"^--gpu quantum: unknown device; known: "):
        find_device("quantum")


def test_the_cpu_is_this_machines_available_memory(monkeypatch):
    import psutil

    class Memory:
        total, available = 64 * GIB, 40 * GIB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory())
    cpu = find_device("CPU")
    assert (cpu.kind, cpu.memory_bytes, cpu.usable_bytes) == ("cpu", 64 * GIB, 40 * GIB)  # no context, no share
    assert "psutil" in cpu.source and "what the OS reports available" in cpu.describe()
