"""The tests' suite factory (tests/support/suites.py): its base is a suite kdbench plans, and overrides merge."""

from __future__ import annotations

from kdbench import api
from kdbench.config.plan import cell_id_of
from tests.support.helpers import make_config, write_suite
from tests.support.suites import BASE, RESNET8, TINY_LM, merged, tiny_suite
from tests.unit.workloads.test_lm_workload import lm_config


def test_the_base_is_a_one_cell_cpu_suite_kdbench_plans(tmp_path):
    suite = api.load_suite(write_suite(tmp_path / "s.yaml", **tiny_suite()))
    assert (suite.name, suite.backend, suite.threads) == ("tiny", "cpu", 1)
    [job] = api.plan(suite, device="cpu").jobs
    config = job.cell.config
    assert (config.pair.teacher, config.pair.student, config.batch_size) == ("linear", "linear", 4)
    assert (config.data.kind, tuple(config.data.shape), config.data.num_classes) == ("synthetic", (1, 4, 4), 4)
    assert (config.timing.warmup, config.timing.min_iters, config.timing.min_time_s) == (0, 3, 0.0)
    assert config.inference.batch_sizes == [1]


def test_overrides_merge_into_nested_mappings_and_replace_the_rest():
    suite = tiny_suite(
        name="mine",
        defaults={"timing": {"min_time_s": 0.3}, "inference": {"batch_sizes": [2, 8], "teacher": False}},
        matrix={"seed": [0, 1]},
    )
    assert suite["name"] == "mine" and suite["backend"] == "cpu" and suite["matrix"] == {"seed": [0, 1]}
    defaults = suite["defaults"]
    assert defaults["timing"] == {"warmup": 0, "min_iters": 3, "min_time_s": 0.3}  # the base's other keys kept
    assert defaults["inference"] == {"batch_sizes": [2, 8], "teacher": False}  # a list replaces, a new key is added
    assert defaults["pair"] == BASE["defaults"]["pair"] and defaults["batch_size"] == 4


def test_pair_and_data_replace_as_a_whole():
    tokens = tiny_suite(defaults={"pair": {"teacher": "resnet8"}, "data": {"kind": "tokens", "seq_len": 16}})
    assert tokens["defaults"]["pair"] == {"teacher": "resnet8"}  # no student inherited from the base's pair
    assert tokens["defaults"]["data"] == {"kind": "tokens", "seq_len": 16}  # no image shape under token data


def test_the_base_and_the_overrides_are_never_changed_or_shared():
    before = merged(BASE, {})
    timing = {"warmup": 2}
    suite = tiny_suite(defaults={"timing": timing, "data": RESNET8["data"]})
    suite["defaults"]["timing"]["min_iters"] = 99
    suite["defaults"]["data"]["shape"].append(1)
    suite["defaults"]["inference"]["batch_sizes"].append(2)
    assert before == BASE and timing == {"warmup": 2} and RESNET8["data"]["shape"] == [3, 16, 16]
    assert tiny_suite() == before


def test_a_merged_variant_keeps_what_it_does_not_name():
    quality = tiny_suite(matrix={"method": ["kd", "dkd"]}, quality={"dataset": "digits", "epochs": 1})
    variant = merged(quality, {"matrix": {"method": ["kd"]}, "quality": {"epochs": 2}})
    assert variant["matrix"] == {"method": ["kd"]} and variant["quality"] == {"dataset": "digits", "epochs": 2}
    assert quality["quality"]["epochs"] == 1


def test_the_resnet8_fragment_plans_make_configs_cell(tmp_path):
    suite = tiny_suite(defaults={**RESNET8, "timing": {"warmup": 1}, "inference": {"batch_sizes": [1, 4]}})
    [job] = api.plan(api.load_suite(write_suite(tmp_path / "s.yaml", **suite)), device="cpu").jobs
    assert job.cell.cell_id == cell_id_of(make_config())


def test_the_lm_fragment_plans_the_trimmed_tiny_llama_cell(tmp_path):
    suite = tiny_suite(defaults=merged(TINY_LM, {"inference": {"decode_tokens": 3}}))
    [job] = api.plan(api.load_suite(write_suite(tmp_path / "s.yaml", **suite)), device="cpu").jobs
    config = job.cell.config
    assert (config.pair.teacher, config.pair.student) == ("tiny-llama-teacher", "tiny-llama-student")
    assert config.overrides.model_dump(exclude_defaults=True) == TINY_LM["overrides"]
    assert (config.method, config.batch_size, config.data.kind, config.data.seq_len) == ("forward_kl", 2, "tokens", 16)
    assert (config.timing.warmup, config.timing.min_iters, config.timing.min_time_s) == (0, 2, 0.0)  # base's, and 2
    assert (config.inference.batch_sizes, config.inference.decode_tokens) == ([1], 3)
    assert job.cell.cell_id == cell_id_of(lm_config())  # the LM tests' own cell (test_lm_workload.lm_config)


def test_overrides_go_with_their_pair():
    other = merged(TINY_LM, {"pair": {"teacher": "tiny-llama-teacher", "student": "x:y"}, "overrides": {"teacher": {}}})
    assert other["overrides"] == {"teacher": {}}  # the fragment's trimmed student is not carried to another student
    untrimmed = tiny_suite(defaults=merged(TINY_LM, {"overrides": {}}))
    assert untrimmed["defaults"]["overrides"] == {} and TINY_LM["overrides"]["student"] == {"num_hidden_layers": 1}
