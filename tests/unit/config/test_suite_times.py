"""suites/times.toml, the one record of how long each shipped suite takes: read, checked, and complete."""

import pytest

from kdbench.config.suite_times import SuiteTime, duration, suite_times
from kdbench.core.errors import KdbenchError
from tests.support.paths import ROOT

SUITES = ROOT / "suites"


def test_every_shipped_suite_has_one_entry_and_every_entry_a_suite():
    assert set(suite_times(SUITES)) == {p.name for p in SUITES.glob("*.yaml")}


def test_the_recorded_figures_read_as_they_were_obtained():
    times = suite_times(SUITES)
    cpu = times["cpu.yaml"]
    assert cpu.how == "measured" and cpu.cpu_text() == f"{cpu.cpu_s // 60} min {cpu.cpu_s % 60} s"
    assert times["methods.yaml"].cpu_text() == "about 20 min"
    assert times["encoder-cpu.yaml"].cpu_text() == "under 1 min 18 s"  # taken under load: an upper bound
    assert times["cifar100-tables.yaml"].cpu_text() == "about 2 h (extrapolated)"
    assert times["quality.yaml"].cpu_text() == "not measured"
    assert times["llm-xtok.yaml"].machine == "2-core AMD EPYC VM, 24 GiB, no GPU (the CI machine type)"  # the default
    assert times["llm-cpu.yaml"].machine.endswith("AVX-512 BF16 (bf16 native)")  # its own: its bf16 cells ran there
    assert all(t.cpu_s is None or t.source for t in times.values())  # every figure says where it came from


@pytest.mark.parametrize(
    ("seconds", "rounded", "text"),
    [
        (75, False, "1 min 15 s"),
        (60, False, "1 min"),
        (59.6, False, "1 min"),
        (1210, True, "20 min"),
        (7200, True, "2 h"),
        (5400, False, "1 h 30 min"),
        (5400, True, "1 h"),
        (14390, False, "4 h"),
    ],
)
def test_duration(seconds, rounded, text):
    assert duration(seconds, rounded) == text


def test_cpu_line_joins_figure_date_and_note():
    assert SuiteTime(101, "measured", "m", date="2026-12-02", note="idle").cpu_line() == "1 min 41 s; 2026-12-02; idle"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('["a.yaml"]\ncpu_s = 60\nhow = "roughly"\n', "how = 'roughly'; use one of measured, about, under"),
        ('["a.yaml"]\nhow = "measured"\n', "give cpu_s with how = 'measured'"),
        ('["a.yaml"]\ncpu_s = 60\nhow = "not measured"\n', "leave it out with 'not measured'"),
        ('["a.yaml"]\ncpu_s = -1\n', "cpu_s = -1; give the seconds, a number > 0"),
        ('["a.yaml"]\ncpu_s = 60\nsecs = 1\n', "unknown key 'secs'; the keys are cpu_s, date,"),
        ('["a.yaml"\n', "not valid TOML"),
    ],
)
def test_a_malformed_entry_is_one_line_naming_the_file_and_entry(tmp_path, text, message):
    (tmp_path / "times.toml").write_text(text)
    with pytest.raises(KdbenchError) as err:
        suite_times(tmp_path)
    assert str(err.value).startswith(str(tmp_path / "times.toml")) and message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_missing_file_says_what_it_holds(tmp_path):
    with pytest.raises(KdbenchError, match="times.toml: missing; it records how long each shipped suite takes"):
        suite_times(tmp_path)


def test_the_help_epilogs_rough_times_agree_with_the_record():
    """`kdbench --help` gives a long CPU run's time in passing (~20 min): it must agree, within a minute, with
    the one figure times.toml records, so that a new figure there cannot leave an old one in the help."""
    import re

    from kdbench.cli.parser import EPILOG

    times = suite_times(SUITES)
    stated = re.findall(r"kdbench run suites/([\w.-]+\.yaml)\b.*~(\d+) min", EPILOG)  # not fit's times
    assert {name for name, _ in stated} == {"methods.yaml", "levers-cpu.yaml"}
    for name, minutes in stated:
        assert abs(times[name].cpu_s / 60 - int(minutes)) <= 1, (name, minutes, times[name])
