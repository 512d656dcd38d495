"""Suite loading, plan expansion, exclude, cell ids; and the shipped suites."""

import pytest

from kdbench.config import load_suite
from kdbench.config.plan import cell_id_of
from kdbench.core.errors import KdbenchError
from kdbench.workloads import expand_checked, planned_measurements
from tests.support.paths import ROOT, TESTS

SUITES = ROOT / "suites"


def write(tmp_path, text, name="s.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


BASE = """
name: t
defaults:
  batch_size: 8
  data: {kind: synthetic, shape: [3, 16, 16], num_classes: 10}
matrix:
  pair:
    - {teacher: resnet56, student: resnet20}
    - {teacher: resnet32x4, student: resnet8x4}
  precision: [fp32, bf16, fp16]
"""


def test_cartesian_product_in_matrix_order(tmp_path):
    cells = expand_checked(load_suite(write(tmp_path, BASE)))
    got = [(c.config.pair.teacher, c.config.precision) for c in cells]
    assert got == [
        ("resnet56", "fp32"),
        ("resnet56", "bf16"),
        ("resnet56", "fp16"),
        ("resnet32x4", "fp32"),
        ("resnet32x4", "bf16"),
        ("resnet32x4", "fp16"),
    ]
    assert [c.index for c in cells] == list(range(6))
    # defaults flow into every cell, nested defaults keep their siblings
    assert all(c.config.batch_size == 8 and c.config.data.num_classes == 10 for c in cells)
    assert all(c.config.kd.temperature == 4.0 and c.config.kd.alpha == 0.9 for c in cells)


def test_exclude_by_partial_match(tmp_path):
    text = (
        BASE
        + """
exclude:
  - {pair: {student: resnet8x4}, precision: fp16}
  - {precision: bf16, pair: {teacher: resnet56}}
"""
    )
    cells = expand_checked(load_suite(write(tmp_path, text)))
    got = {(c.config.pair.student, c.config.precision) for c in cells}
    assert got == {("resnet20", "fp32"), ("resnet20", "fp16"), ("resnet8x4", "fp32"), ("resnet8x4", "bf16")}


def test_dotted_axis_and_cases(tmp_path):
    text = """
name: t
defaults:
  pair: {teacher: resnet20, student: resnet8}
  kd: {alpha: 0.5}
matrix:
  kd.temperature: [1.0, 8.0]
  cases:
    - {batch_size: 4, precision: bf16}
    - {batch_size: 16, data: {num_classes: 10}}
"""
    cells = expand_checked(load_suite(write(tmp_path, text)))
    got = [
        (c.config.kd.temperature, c.config.kd.alpha, c.config.batch_size, c.config.precision, c.config.data.num_classes)
        for c in cells
    ]
    assert got == [
        (1.0, 0.5, 4, "bf16", 100),
        (1.0, 0.5, 16, "fp32", 10),
        (8.0, 0.5, 4, "bf16", 100),
        (8.0, 0.5, 16, "fp32", 10),
    ]


def test_cell_id_is_stable_and_depends_on_config_only(tmp_path):
    a = expand_checked(load_suite(write(tmp_path, BASE, "a.yaml")))
    # same cells written differently: other key order, other suite name, default values spelled out
    reordered = """
name: other-name
matrix:
  pair:
    - {student: resnet20, teacher: resnet56}
    - {student: resnet8x4, teacher: resnet32x4}
  precision: [fp32, bf16, fp16]
defaults:
  data: {num_classes: 10, shape: [3, 16, 16]}
  method: kd
  batch_size: 8
"""
    b = expand_checked(load_suite(write(tmp_path, reordered, "b.yaml")))
    assert [c.cell_id for c in a] == [c.cell_id for c in b]
    assert len({c.cell_id for c in a}) == 6
    assert all(len(c.cell_id) == 16 for c in a)
    changed = a[0].config.model_copy(update={"batch_size": 9})
    assert cell_id_of(changed) != a[0].cell_id


def test_planned_measurements():
    from tests.support.helpers import make_config

    cfg = make_config(inference={"batch_sizes": [1, 8]})
    assert planned_measurements(cfg) == [
        ("distill_step", 4),
        ("student_inference", 1),
        ("teacher_inference", 1),
        ("student_inference", 8),
        ("teacher_inference", 8),
    ]
    cfg = make_config(inference={"batch_sizes": [2], "teacher": False})
    assert planned_measurements(cfg) == [("distill_step", 4), ("student_inference", 2)]


@pytest.mark.parametrize(
    "name,cells",
    [
        ("cpu", 4),
        ("amd", 78),
        ("cuda", 78),
        ("seeds", 2),
        ("methods", 72),
        ("gpu-smoke", 9),
        ("gpu-lm", 12),
        ("levers-cpu", 6),
        ("llm-cuda", 52),
        ("llm-amd", 52),
        ("llm-fsdp", 10),
    ],
)
def test_shipped_suites_plan(name, cells):
    plan = expand_checked(load_suite(SUITES / f"{name}.yaml"))
    assert len(plan) == cells


def test_amd_and_cuda_suites_compare_cell_by_cell():
    amd = expand_checked(load_suite(SUITES / "amd.yaml"))
    cuda = expand_checked(load_suite(SUITES / "cuda.yaml"))
    assert [c.cell_id for c in amd] == [c.cell_id for c in cuda]
    assert load_suite(SUITES / "amd.yaml").backend == "rocm"
    assert load_suite(SUITES / "cuda.yaml").backend == "cuda"
    pairs = {(c.config.pair.teacher, c.config.pair.student) for c in amd}
    assert pairs == {("resnet50", "resnet18"), ("resnet34", "resnet18"), ("resnet50", "mobilenet_v3_large")}
    assert {c.config.precision for c in amd} == {"fp32", "fp16", "bf16"}
    assert all(c.config.data.shape == [3, 224, 224] for c in amd)


def test_seed_suite_setups():
    cells = expand_checked(load_suite(SUITES / "seeds.yaml"))
    linear, resnet = (c.config for c in cells)
    assert (linear.pair.teacher, linear.pair.student, linear.kd.temperature) == ("linear", "linear", 2.0)
    assert linear.data.shape == [1, 28, 28] and linear.data.num_classes == 10
    assert (resnet.teacher_precision, resnet.precision) == ("fp32", "fp16")
    assert (resnet.optimizer.name, resnet.optimizer.lr) == ("adamw", 1e-4)


# ---- user mistakes: one line naming file, line, key and what to do


@pytest.mark.parametrize(
    "text,expect",
    [
        (BASE.replace("batch_size: 8", "batchsize: 8"), [":4:", "defaults.batchsize", "did you mean 'batch_size'"]),
        (BASE.replace("batch_size: 8", "batch_size: eight"), [":4:", "defaults.batch_size", "integer"]),
        (BASE.replace("batch_size: 8", "batch_size: 0"), ["defaults.batch_size", "greater than or equal to 1"]),
        (
            BASE.replace("[fp32, bf16, fp16]", "[fp32, fp8]"),
            [":10:", "matrix.precision[1]", "'fp32', 'tf32', 'fp16' or 'bf16'"],
        ),
        (BASE.replace("resnet20", "resnt20"), ["matrix.pair.student", "unknown model 'resnt20'", "resnet20"]),
        (BASE.replace("precision:", "precison:"), ["matrix.precison", "did you mean 'precision'"]),
        (
            BASE + "exclude:\n  - {pair: {student: resnet20}}\n  - {pair: {student: resnet8x4}}\n",
            ["excludes every cell"],
        ),
        (BASE.replace("batch_size: 8", "batch_size: 8\n  batch_size: 9"), [":5:", "duplicate key"]),
        (BASE.replace("defaults:", "defaults:\n  alignment: 48"), ["defaults.alignment", "power of two"]),
        (BASE.replace("defaults:", "defaults:\n  method: kdd"), ["defaults.method", "unknown method 'kdd'"]),
        ("name: t\nmatrix: {precision: [fp32]}\n", ["no teacher/student pair"]),
        ("- just\n- a list\n", ["must be a mapping"]),
        ("name: t\ndefaults: {batch_size: [1\n", ["invalid YAML"]),
    ],
)
def test_mistakes_are_one_line_errors(tmp_path, text, expect):
    path = write(tmp_path, text)
    with pytest.raises(KdbenchError) as info:
        expand_checked(load_suite(path))
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(str(path)), msg
    for part in expect:
        assert part in msg, (part, msg)


def test_missing_file_folder_and_non_utf8(tmp_path):
    with pytest.raises(KdbenchError, match="no such suite file"):
        load_suite(tmp_path / "nope.yaml")
    with pytest.raises(KdbenchError, match="is a folder"):
        load_suite(tmp_path)
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(KdbenchError, match="not UTF-8"):
        load_suite(bad)


def test_object_constructing_tags_and_alias_bombs_are_refused(tmp_path):
    with pytest.raises(KdbenchError, match="invalid YAML|not allowed"):
        load_suite(write(tmp_path, "name: !!python/object/apply:os.system ['true']\n"))
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)
    )
    with pytest.raises(KdbenchError, match="aliases expand"):
        load_suite(write(tmp_path, bomb))


def test_settings_a_cell_does_not_use_give_the_same_cell_once(tmp_path, caplog):
    # ddp options do not touch a world_size 1 cell, nor at.beta a kd cell: one cell each, said once
    text = BASE.split("matrix:")[0] + (
        "  pair: {teacher: resnet20, student: resnet8}\n"
        "matrix:\n  world_size: [1, 2]\n  ddp.static_graph: [false, true]\n  method: [kd, at]\n  at.beta: [10, 1000]\n"
    )
    with caplog.at_level("INFO", logger="kdbench"):
        cells = expand_checked(load_suite(write(tmp_path, text)))
    keys = [(c.config.world_size, c.config.ddp.static_graph, c.config.method, c.config.at.beta) for c in cells]
    assert keys == [
        (1, False, "kd", 10.0),
        (1, False, "at", 10.0),
        (1, False, "at", 1000.0),
        (2, False, "kd", 10.0),
        (2, False, "at", 10.0),
        (2, False, "at", 1000.0),
        (2, True, "kd", 10.0),
        (2, True, "at", 10.0),
        (2, True, "at", 1000.0),
    ]
    assert "7 combination(s) of the matrix repeat a planned cell" in caplog.text
    ids = {c.cell_id for c in cells}
    assert len(ids) == 9


def test_cells_that_differ_only_in_unlabelled_settings_get_distinct_labels(tmp_path):
    # docs review: kd.temperature and data.shape were not in the label, so two cells shared one and the
    # report, which keys its charts by label, drew them as one
    from kdbench.config.load import load_suite
    from tests.support.helpers import write_suite

    suite = write_suite(
        tmp_path / "s.yaml",
        name="s",
        defaults={"pair": {"teacher": "linear", "student": "linear"}},
        matrix={"kd.temperature": [2.0, 4.0], "data.shape": [[3, 8, 8], [3, 16, 16]], "precision": ["fp32", "bf16"]},
    )
    cells = expand_checked(load_suite(suite))
    labels = [c.label for c in cells]
    assert len(set(labels)) == len(cells) == 8
    assert "linear->linear kd fp32 bs32 data.shape=[3,8,8] kd.temperature=2.0" in labels
    one = next(c for c in cells if c.config.precision == "bf16")
    assert one.label.startswith(one.short_label + " ") and "precision" not in one.label_extra  # in the short label
    alone = expand_checked(
        load_suite(
            write_suite(tmp_path / "t.yaml", name="t", defaults={"pair": {"teacher": "linear", "student": "linear"}})
        )
    )
    assert alone[0].label == alone[0].short_label and alone[0].label_extra == ""


def test_a_swept_setting_is_in_every_label_its_default_too(tmp_path):
    # issue 32: llm-cpu sweeps loss_impl, and its dense cells' labels left "dense" out (a default is not shown)
    from tests.support.helpers import write_suite

    lm = expand_checked(load_suite(SUITES / "llm-cpu.yaml"))
    assert {
        c.config.loss_impl: c.label for c in lm if c.config.data.seq_len == 256 and c.config.precision == "fp32"
    } == {
        impl: f"tiny-llama-teacher->tiny-llama-student forward_kl fp32 bs2 seq256 {impl}"
        for impl in ("dense", "natural", "chunked", "fused_linear", "liger", "torch_linear")
    }
    suite = write_suite(
        tmp_path / "s.yaml",
        name="s",
        defaults={"pair": {"teacher": "linear", "student": "linear"}},
        matrix={"memory_format": ["contiguous", "channels_last"], "seed": [0, 1]},
    )
    labels = [c.label for c in expand_checked(load_suite(suite))]
    layouts = ("contiguous", "channels_last")
    assert labels == [f"linear->linear kd fp32 bs32 {layout} seed{seed}" for layout in layouts for seed in (0, 1)]
    alone = expand_checked(load_suite(SUITES / "llm-cpu.yaml"))[0]
    assert "seed" not in alone.label and "contiguous" not in alone.label  # not swept, at its default: not shown
    # cases are no axis of a setting: each case shows its own settings, not the others' defaults
    cases = write_suite(
        tmp_path / "c.yaml",
        name="c",
        defaults={"pair": {"teacher": "linear", "student": "linear"}},
        matrix={"cases": [{}, {"seed": 1}, {"memory_format": "channels_last"}]},
    )
    labels = [c.label for c in expand_checked(load_suite(cases))]
    base = "linear->linear kd fp32 bs32"
    assert labels == [base, f"{base} seed1", f"{base} channels_last"]


SHIPPED_PLANS = TESTS / "data" / "shipped_plans.json"
CELLS_ADDED_SINCE = {
    "llm-fsdp.yaml": 2,  # issue 30: FSDP2 of a bf16-held teacher, with and without bf16 gathers
    "llm-cpu.yaml": 12,  # issue 34: liger and torch_linear at both lengths, every loss_impl in bf16 at 256 tokens;
    # issue 41: natural (the dense loss as TRL and torchtune write it) at both lengths and in bf16
    "gpu-lm.yaml": 5,  # issue 41: natural; issue 42 (GPU review 4, M6): static and compiled decode, speculative, xtok
    "llm-amd.yaml": 4,  # issue 41: natural beside dense, each pair at both lengths
    "llm-cuda.yaml": 4,
    "quality-text.yaml": 4,  # issue 34: the student of its own tokenizer (bpe:512) by uld; issue 45: by uld (bytes);
    # issue 44: two offline-teacher students (fp16 and int8 stores)
}
# Quality jobs that measure more since (a new job id: a resume measures it again); their models' checkpoints keep
# the folder of the id held here (QualityJob.models_id), so a resume does not train them again.
# issue 33: quality-text measures each student as its teacher's draft (quality.speculative).
# issue 34: quality-text trains more models (the bpe:512 student, scratch and uld): another job id and another
# models folder (QUALITY_MODELS_SINCE), so a resume across that change trains its models again.
# issue 45: and the bpe:512 student by uld aligned by bytes: another job id and models folder again.
# issue 44: and two offline-teacher students (fp16 and int8 stores): another job id again.
QUALITY_JOBS_SINCE = {"quality-text.yaml": ["quality-49655a6ccdc7"]}
QUALITY_MODELS_SINCE = {"quality-text.yaml": ["quality-fcb22c8b18d4"]}  # issue 44: and its models folder


@pytest.mark.parametrize("device", ["cpu", "cuda", "rocm"])
def test_shipped_suites_plan_the_cells_they_planned_before_the_redesign(device):
    """Every shipped suite plans the cells (ids, and each cell's planned rows) and the quality job it planned at
    8dd427e, before issue 29's redesign, on every backend: results stored then still resume, compare and report.
    A suite added since is held from when it was added (gpu-lm.yaml: issue 30)."""
    import hashlib
    import json

    from kdbench.run.plan import plan_jobs

    stored = json.loads(SHIPPED_PLANS.read_text())
    assert set(stored) <= {p.name for p in SUITES.glob("*.yaml")}  # suites added since plan what they like
    for name, before in stored.items():
        plan = plan_jobs(load_suite(SUITES / name), None, device)
        cells = []
        for cell in plan.cells:
            planned = ",".join(f"{m}@{bs}" for m, bs in planned_measurements(cell.config))
            cells.append(f"{cell.cell_id} {hashlib.sha256(planned.encode()).hexdigest()[:8]}")
        # the cells it planned then, in their order; the cells added to it since (new ids, nothing to keep) may come
        # between them, where the suite's matrix puts them (llm-cpu's loss_impl axis gained liger and torch_linear):
        # resume, compare and the report go by cell id
        kept = set(before["cells"])
        assert [c for c in cells if c in kept] == before["cells"], name
        assert len(cells) == len(before["cells"]) + CELLS_ADDED_SINCE.get(name, 0), name
        quality = [j for j in plan.jobs if j.job_id.startswith("quality-")]
        assert [j.job_id for j in quality] == QUALITY_JOBS_SINCE.get(name, before["quality_jobs"]), name
        assert [j.models_id for j in quality] == QUALITY_MODELS_SINCE.get(name, before["quality_jobs"]), name
