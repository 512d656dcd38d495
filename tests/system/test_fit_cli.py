"""`kdbench fit`: the verdict against a device, the changes that make a cell fit, the largest batch by bisection
over fake runs (checked against real steps' measured peaks), the command end to end and its one-line errors."""

import json
import math
import re
import subprocess
import sys
import textwrap

import pytest

from kdbench.cli import main
from kdbench.config.schema import CellConfig
from kdbench.core.errors import KdbenchError
from kdbench.core.sizes import GIB
from kdbench.fit.devices import sized_device
from kdbench.fit.planner import Prediction, predict
from kdbench.fit.verdict import (
    BATCH_CAP,
    FITS,
    FITS_WITH,
    NO_FIT,
    UNPREDICTABLE,
    Predictor,
    judge,
    largest,
    size_cap,
    with_size,
)
from tests.support.helpers import write_suite
from tests.support.paths import ROOT
from tests.support.suites import TINY_LM, merged, tiny_suite

MIB = 2**20


def tiny(batch_size=2, seq_len=1024, loss_impl="dense", **more) -> CellConfig:
    return CellConfig.model_validate(
        {
            "pair": {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
            "method": "forward_kl",
            "batch_size": batch_size,
            "loss_impl": loss_impl,
            "data": {"kind": "tokens", "seq_len": seq_len},
            **more,
        }
    )


@pytest.fixture(scope="module")
def peaks() -> dict[str, int]:
    """The tiny pair's predicted peaks at 2 x 1,024 tokens, each loss implementation the verdict tries."""
    return {
        "dense": predict(tiny()).peak_bytes,
        "fused_linear": predict(tiny(loss_impl="fused_linear")).peak_bytes,
    }


# --------------------------------------------------------------------------- the verdict


def test_the_verdict_is_fits_at_or_above_the_peak_and_fused_linear_between(peaks):
    dense, fused = peaks["dense"], peaks["fused_linear"]
    assert fused < dense  # at 1,024 tokens fused_linear's chunks hold less than dense's whole logits
    predictor = Predictor("cuda")
    assert judge(tiny(), dense, predictor).outcome == FITS  # exactly the peak fits
    between = judge(tiny(), (dense + fused) // 2, predictor)
    assert between.outcome == FITS_WITH and between.changes == ("loss_impl fused_linear",)
    assert between.changed.peak_bytes == fused and between.config.loss_impl == "fused_linear"
    assert between.line((dense + fused) // 2).startswith("fits only with: loss_impl fused_linear (predicted ")
    assert judge(tiny(), dense - 1, predictor).outcome == FITS_WITH


def test_a_cell_nothing_rescues_does_not_fit_and_says_what_was_tried():
    predictor = Predictor("cuda")
    verdict = judge(tiny(seq_len=128), 1 * MIB, predictor)  # less than the parameters alone
    assert verdict.outcome == NO_FIT and not verdict.changes and verdict.changed is None
    assert verdict.tried[0] == "loss_impl fused_linear" and verdict.tried[-1] == "batch_size 1"
    assert "teacher.weights bf16 with teacher_precision bf16" in verdict.tried
    # FSDP2 at 2, 4 and 8 ranks, each predicted per rank (it lowers the peak, so it is kept for the next change)
    assert [t for t in verdict.tried if "fsdp" in t] == [f"parallel fsdp at world_size {n}" for n in (2, 4, 8)]
    assert verdict.line(1 * MIB).startswith("does not fit (") and "no change tried fits" in verdict.line(1 * MIB)


def test_an_unpredictable_cell_is_never_judged_to_fit():
    def failing(config, device_type, allow_imports=False):
        return Prediction(None, error="the fake run cannot run aten.nonzero.default")

    verdict = judge(tiny(), 10**15, Predictor("cuda", failing))
    assert verdict.outcome == UNPREDICTABLE
    assert verdict.line(10**15) == "unpredictable: the fake run cannot run aten.nonzero.default"


def llama_8b_to_1b(**more) -> CellConfig:
    """The cell of issue 45: Llama-3.1-8B into Llama-3.2-1B at 4,096 tokens, fp32, dense, batch 8."""
    pair = {"teacher": "llama-3.1-8b", "student": "llama-3.2-1b"}
    data = {"kind": "tokens", "seq_len": 4096}
    return CellConfig.model_validate(
        {"pair": pair, "method": "forward_kl", "batch_size": 8, "loss_impl": "dense", "data": data, **more}
    )


def eight_b_figures(config, device_type, allow_imports=False):
    """A stand-in planner with the 8B -> 1B cell's shape (a fake run of 8B models takes minutes): the models'
    bytes (an fp32 teacher 32 GB, halved in bf16; the student's weights, gradients and Adam 20 GB; both sharded by
    FSDP) and per sequence of 4,096 tokens 20 GB dense, 12 GB fused_linear, 11 GB with smaller chunks."""
    teacher = 16e9 if config.teacher.weights == "bf16" else 32e9
    ranks = config.world_size if config.parallel == "fsdp" else 1
    per_sequence = {"dense": 20e9, "fused_linear": 12e9 if config.chunk_size >= 1024 else 11e9}.get(
        config.loss_impl, 20e9
    )
    return Prediction(int((teacher + 20e9) / ranks + per_sequence * config.batch_size), phase="loss")


def test_the_verdict_and_the_max_lines_of_the_8b_cell_say_the_same():
    """Issue 45: on an H100 the 8B -> 1B cell was said to fit "only with fused_linear, chunk 256, bf16 teacher
    weights, FSDP at 8 ranks, batch 4" while --max said "largest batch_size with loss_impl dense: 1": it fits one
    GPU as it is at batch 1.  Both now come from one search: the verdict's first way is the cell as it is at the
    largest batch that fits, the --max line of its own loss_impl prints that same batch, and the levers' way
    follows as the other."""
    from kdbench.fit.cells import fit_cells
    from kdbench.fit.devices import find_device

    h100 = find_device("H100", live=False)
    lines: list[str] = []
    report = fit_cells(
        [llama_8b_to_1b()], h100, "cuda", "batch_size", talk=lines.append,
        predictor=Predictor("cuda", eight_b_figures, runtime=h100.runtime),
    )  # fmt: skip
    cell = report.cells[0]
    verdict = cell.verdict
    assert verdict.outcome == FITS_WITH and verdict.changes == ("batch_size 1",) and verdict.config.batch_size == 1
    assert verdict.as_is.value == 1
    (other,) = verdict.others
    assert other.changes[0] == "loss_impl fused_linear" and other.changes[-1].startswith("batch_size ")
    assert other.config.batch_size > 1 and other.config.parallel == "fsdp"
    said = next(line for line in lines if "fits only with" in line)
    assert (
        said.startswith("      fits only with: batch_size 1 (predicted ") and "; or with loss_impl fused_linear" in said
    )
    dense = next(line for line in lines if "largest batch_size with loss_impl dense" in line)
    assert dense.startswith("      largest batch_size with loss_impl dense: 1 (")
    found = dict((c.loss_impl, f) for c, f in cell.largest)
    assert found["dense"] is verdict.as_is  # the same search, not a second one that could disagree
    assert cell.record["verdict"]["as_is_batch_size"] == 1


@pytest.mark.parametrize("budget_gb", [40, 55, 73, 80, 95, 200, 300])
def test_the_verdict_never_contradicts_the_largest_batch(budget_gb):
    """Whatever the device: the verdict fits as given exactly when the largest batch is at least the cell's, says
    "does not fit" only when no batch fits as it is, and otherwise names the cell as it is at that largest batch
    (or levers at its own batch, with that batch as the other way)."""
    from kdbench.fit.verdict import Sizes

    budget = int(budget_gb * 1e9)
    predictor = Predictor("cuda", eight_b_figures)
    sizes = Sizes(budget, predictor)
    verdict = judge(llama_8b_to_1b(), budget, predictor, sizes)
    biggest = sizes.largest(llama_8b_to_1b(), "batch_size")
    assert (verdict.outcome == FITS) == (biggest.value >= 8)
    if verdict.outcome == NO_FIT:
        assert biggest.value == 0
    if verdict.outcome == FITS_WITH and 1 <= biggest.value < 8:
        ways = [verdict.changes, *(o.changes for o in verdict.others)]
        assert (f"batch_size {biggest.value}",) in ways


# --------------------------------------------------------------------------- the largest size that fits


def linear(base: int, per_sample: int):
    """A stand-in planner: the peak grows by ``per_sample`` bytes a sequence."""

    def predict_(config, device_type, allow_imports=False):
        return Prediction(base + per_sample * config.batch_size, phase="loss")

    return predict_


@pytest.mark.parametrize("start", [1, 2, 30, 31, 32, 1000])
def test_bisection_finds_the_last_batch_that_fits_from_any_start(start):
    predictor = Predictor("cuda", linear(1000, 300))
    found = largest(tiny(batch_size=start), "batch_size", 10_000, predictor)
    assert found.value == 30  # 1000 + 300 x 30 = 10,000 fits; 31 does not
    assert found.prediction.peak_bytes == 10_000 and found.above.peak_bytes == 10_300
    assert found.runs <= 2 * 12  # doubling (or halving), then bisection: logarithmic in the answer


def test_bisection_stops_at_the_cap_and_says_when_nothing_fits():
    assert largest(tiny(), "batch_size", 10**15, Predictor("cuda", linear(1000, 300))).value == BATCH_CAP == 2**16
    none = largest(tiny(batch_size=8), "batch_size", 1200, Predictor("cuda", linear(1000, 300)))
    assert none.value == 0 and none.text() == "none (batch_size 1 does not fit)"
    assert size_cap(tiny(), "seq_len") == 2048  # tiny-llama-student's max_position_embeddings


def test_the_longest_sequence_is_bisected_up_to_the_models_positions():
    def per_token(config, device_type, allow_imports=False):
        return Prediction(5000 + 7 * config.data.seq_len * config.batch_size, phase="loss")

    predictor = Predictor("cuda", per_token)
    found = largest(tiny(batch_size=2, seq_len=128), "seq_len", 5000 + 7 * 2 * 1000, predictor)
    assert (found.value, found.prediction.peak_bytes, found.above.peak_bytes) == (1000, 19_000, 19_014)
    # the pair's 2,048 positions hold the sequence and the 32 tokens its serving decodes: 2,016 is the longest
    longest = largest(tiny(seq_len=128), "seq_len", 10**12, Predictor("cuda", per_token))
    assert (longest.value, longest.cap, longest.above) == (2016, 2048, None)
    assert longest.text() == "2016 (0.00 GiB): seq_len 2017 is beyond what the cell takes"


def test_bisection_over_real_fake_runs_returns_a_batch_whose_next_does_not_fit():
    cell = tiny(seq_len=128)
    budget = 100 * MIB
    found = largest(cell, "batch_size", budget, Predictor("cuda"))
    assert found.value and found.value > 2
    at, above = (predict(with_size(cell, "batch_size", b)).peak_bytes for b in (found.value, found.value + 1))
    assert at <= budget < above, (found.value, at, above)


# --pair of LMs plans bf16 mixed precision with a bf16 teacher unless told (issue 45 item 7): the schema's fp32
FP32 = ["--precision", "fp32", "--teacher-precision", "fp32", "--teacher-weights", "fp32"]


@pytest.mark.slow
def test_the_largest_batch_predicted_is_the_largest_a_real_step_fits(tmp_path):
    """Done when: at 1,024 tokens against a stated budget, `--max batch_size` predicts b, and a real step's measured
    live-tensor peak at b fits the budget while at 2b it does not."""
    device = sized_device("1.4GiB")  # usable: (1.4 GiB - a 768 MiB context) / 1.05 = 664,697,320 bytes
    budget = device.usable_bytes
    assert budget == int((round(1.4 * GIB) - 768 * MIB) / 1.05)
    out = tmp_path / "fit.json"
    argv = ["fit", "--pair", "tiny-llama-teacher", "tiny-llama-student", "--seq-len", "1024", "--batch-size", "2"]
    argv += FP32  # the real steps below are fp32 ones
    assert main([*argv, "--device-memory", "1.4GiB", "--max", "batch_size", "--out", str(out)]) == 0
    dense = next(r for r in json.loads(out.read_text())["cells"][0]["largest"] if r["loss_impl"] == "dense")
    b = dense["value"]
    assert b >= 2 and dense["peak_bytes"] <= budget < dense["above_peak_bytes"]
    script = textwrap.dedent(
        f"""
        import torch
        from kdbench.config.schema import CellConfig
        from kdbench.distill.step import DistillStep
        from kdbench.hw.backends import resolve
        from kdbench.measure.memory import live_tensor_peak
        from kdbench.models.cache import ModelCache
        from kdbench.workloads.registry import workload_of
        torch.set_num_threads(1)
        for bs in ({b}, {2 * b}):
            pair = {{"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"}}
            cfg = CellConfig.model_validate({{"pair": pair,
                "method": "forward_kl", "batch_size": bs, "data": {{"kind": "tokens", "seq_len": 1024}}}})
            backend, workload = resolve("cpu"), workload_of(cfg)
            pair = workload.step_pair(cfg, backend, ModelCache(capacity=0), None)
            x, y = workload.batch(cfg, bs, backend.device, cfg.seed, pair)
            step = DistillStep(*pair, x, y, cfg, backend, workload)
            step()
            print(live_tensor_peak(step))
            step.close()
            del step, pair, x, y
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    real_b, real_2b = (int(line) for line in r.stdout.split())
    print(f"b {b}: predicted {dense['peak_bytes']}, measured {real_b}; budget {budget}; 2b measured {real_2b}")
    assert real_b <= budget < real_2b, (b, real_b, budget, real_2b)


# --------------------------------------------------------------------------- the command

# tiny() as a suite: the untrimmed tiny pair at 2 x 1,024 tokens, timed and served as the schema's defaults say
# (a user's suite that sets neither), each loss implementation the verdict tries
SUITE = tiny_suite(
    name="fit-tiny",
    defaults=merged(
        TINY_LM,
        {
            "overrides": {},
            "data": {"kind": "tokens", "seq_len": 1024},
            "timing": {"warmup": 3, "min_iters": 10, "min_time_s": 1.0},
            "inference": {"batch_sizes": [1, 32]},
        },
    ),
    matrix={"loss_impl": ["dense", "fused_linear"]},
)


@pytest.fixture
def suite(tmp_path):
    return write_suite(tmp_path / "fit.yaml", **SUITE)


# a GPU of 1.02 GiB: usable (1.02 GiB - a 768 MiB context) / 1.05 = 263.3 MiB, between fused_linear's peak and
# dense's, each with the 2 x 32 MiB of cuBLAS workspaces a GPU of unknown architecture is taken to hold
SIZE = "1.02GiB"
WORKSPACES = 2 * 32 * MIB


def test_fit_judges_every_cell_of_a_suite_and_writes_json(suite, tmp_path, capsys, peaks):
    out = tmp_path / "fit.json"
    dense_peak, fused_peak = peaks["dense"] + WORKSPACES, peaks["fused_linear"] + WORKSPACES
    assert fused_peak < sized_device(SIZE).usable_bytes < dense_peak
    assert main(["fit", str(suite), "--device-memory", SIZE, "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("kdbench fit: each cell's own distillation step") and "nothing allocated" in lines[0]
    assert lines[1].startswith("device a device of 1.02GiB: 1.02 GiB") and "usable 0.26 GiB per device" in lines[1]
    assert lines[2].startswith("[1/2] tiny-llama-teacher->tiny-llama-student forward_kl fp32 bs2 seq1024 dense  (cell ")
    assert lines[3].startswith(f"      peak {dense_peak / GIB:.2f} GiB per rank in loss (parameters ")
    assert "logits" in lines[3] and "of it" in lines[3] and "blas workspaces 0.06" in lines[3]
    assert "fake run" in lines[4]
    fused = f"{fused_peak / GIB:.2f} GiB"
    # the levers at the cell's batch first, then the cell as it is at the largest batch that fits (its 1 sequence)
    verdict = f"      fits only with: loss_impl fused_linear (predicted {fused} of 0.26 GiB usable, in loss)"
    assert lines[5].startswith(verdict + "; or with batch_size 1 (") and lines[5].endswith(" GiB)")
    assert lines[6].startswith("[2/2] ") and "fused_linear" in lines[6]
    assert lines[9] == f"      fits ({fused} of 0.26 GiB usable)"
    assert lines[10].startswith("2 cells: 1 fits only with, 1 fits; ") and "fake runs" in lines[10]
    assert lines[11] == f"predictions -> {out}"
    record = json.loads(out.read_text())
    assert record["device"]["memory_bytes"] == round(1.02 * GIB)
    assert record["device_type"] == "cuda"  # --device-memory is a GPU of that size
    dense, fused = record["cells"]
    assert dense["prediction"]["peak_bytes"] == dense_peak and dense["verdict"]["outcome"] == FITS_WITH
    assert dense["verdict"]["changes"] == ["loss_impl fused_linear"]
    assert dense["verdict"]["changed"]["peak_bytes"] == fused["prediction"]["peak_bytes"] == fused_peak
    assert fused["verdict"]["outcome"] == FITS and len(dense["cell_id"]) == 16


def test_api_fit_from_a_notebook_gives_the_command_lines_verdicts(suite, tmp_path, capsys, peaks):
    """`api.fit` is the command's work: called from Python it prints nothing and returns what `kdbench fit` printed
    and wrote (the same verdicts, records and lines, timings aside), for a suite file or bare cells."""
    from kdbench import api

    out = tmp_path / "fit.json"
    assert main(["fit", str(suite), "--device-memory", SIZE, "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    cli = json.loads(out.read_text())
    report = api.fit(suite, sized_device(SIZE))
    assert capsys.readouterr().out == ""  # no talk: nothing printed
    ids = [c["cell_id"] for c in cli["cells"]]
    assert report.verdicts == {c["cell_id"]: c["verdict"]["outcome"] for c in cli["cells"]}
    assert list(report.verdicts.values()) == [FITS_WITH, FITS] and list(report.verdicts) == ids
    assert report.cells[0].verdict.changes == ("loss_impl fused_linear",)
    assert [c.prediction.peak_bytes for c in report.cells] == [
        peaks["dense"] + WORKSPACES,
        peaks["fused_linear"] + WORKSPACES,
    ]
    record = report.record()
    assert record["device"] == cli["device"] and record["device_type"] == cli["device_type"] == "cuda"
    for mine, theirs in zip(record["cells"], cli["cells"]):
        untimed = ("outcome", "line", "changes")  # the changed cell's prediction has its fake run's seconds
        assert {k: mine["verdict"][k] for k in untimed} == {k: theirs["verdict"][k] for k in untimed}
        assert (mine["verdict"]["changed"] or {}).get("peak_bytes") == (theirs["verdict"]["changed"] or {}).get(
            "peak_bytes"
        )
    assert [c["label"] for c in record["cells"]] == [c["label"] for c in cli["cells"]]
    untimed = [i for i, line in enumerate(printed[:-1]) if "fake run" not in line]  # all but the timings
    assert [report.lines[i] for i in untimed] == [printed[i] for i in untimed] and len(report.lines) == len(printed) - 1
    assert report.outcomes == {FITS_WITH: 1, FITS: 1} and report.text().startswith(printed[0])
    # bare cells (CellConfig) and a GPU by name: the same cell ids, judged against the H200's memory
    h200 = api.fit([tiny(), tiny(loss_impl="fused_linear")], "H200")
    assert h200.device.name == "H200" and h200.verdicts == dict.fromkeys(ids, FITS)
    assert [c.label for c in h200.cells] == [c["label"] for c in cli["cells"]]
    with pytest.raises(KdbenchError, match="max_key batch_size: needs a device"):
        api.fit([tiny()], None, max_key="batch_size")


def test_fit_without_a_device_prints_predictions_only(capsys):
    argv = ["fit", "--pair", "tiny-llama-teacher", "tiny-llama-student", "--seq-len", "128", "--loss-impl", "chunked"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "no device given: predictions only" in out
    # an LM pair is planned as it is run (bf16, its teacher held in bf16), said first; the schema's bs32
    assert out.startswith("--pair of LMs: planned as such a pair is run, --precision bf16 --teacher-precision bf16 ")
    assert (
        "tiny-llama-teacher->tiny-llama-student forward_kl bf16 teacher-bf16 teacher-weights-bf16 bs32 seq128 chunked"
        in out
    )
    assert "peak " in out and "fits" not in out and out.strip().splitlines()[-1].startswith("1 cells: 1 predicted")


def test_an_lm_pair_defaults_to_bf16_and_its_flags_plan_another(monkeypatch, capsys):
    """Issue 45 item 7: `--pair llama-3.1-8b llama-3.2-1b` planned fp32 (681 GiB at batch 32), a cell no one runs.
    An LM pair is now planned in bf16 mixed precision with its teacher held and run in bf16, and the first line
    says so; each flag given keeps its own value; an image pair keeps the schema's fp32."""
    from kdbench import api

    cells = []
    monkeypatch.setattr(api, "fit", lambda c, *a, **k: cells.extend(c) or type("R", (), {"record": dict})())
    assert main(["fit", "--pair", "llama-3.1-8b", "llama-3.2-1b", "--seq-len", "4096"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("--pair of LMs: planned as such a pair is run, --precision bf16 --teacher-precision bf16 ")
    config = cells.pop().config
    assert (config.precision, config.teacher_precision, config.teacher.weights) == ("bf16", "bf16", "bf16")
    argv = ["fit", "--pair", "llama-3.1-8b", "llama-3.2-1b", "--precision", "fp32", "--teacher-weights", "fp32"]
    assert main(argv) == 0 and "--pair of LMs" not in capsys.readouterr().out  # both given: nothing to say
    config = cells.pop().config
    assert (config.precision, config.teacher_precision, config.teacher.weights) == ("fp32", "fp32", "fp32")
    assert main(["fit", "--pair", "llama-3.1-8b", "llama-3.2-1b", "--teacher-precision", "fp32"]) == 0
    assert capsys.readouterr().out.startswith("--pair of LMs: planned as such a pair is run, --precision bf16 (")
    config = cells.pop().config
    assert (config.precision, config.teacher_precision, config.teacher.weights) == ("bf16", "fp32", "fp32")
    assert main(["fit", "--pair", "resnet56", "resnet20"]) == 0 and "--pair of LMs" not in capsys.readouterr().out
    assert cells.pop().config.precision == "fp32"


@pytest.mark.slow
def test_fit_max_sizes_every_loss_impl_of_an_lm_cell(capsys):
    argv = ["fit", "--pair", "tiny-llama-teacher", "tiny-llama-student", "--seq-len", "128", "--batch-size", "2", *FP32]
    assert main([*argv, "--device-memory", "1.1GiB", "--max", "batch_size"]) == 0
    out = capsys.readouterr().out
    # liger too: its backward's host branch (grad_output != 1) is taken as False in the fake run
    for impl in ("dense", "chunked", "fused_linear", "torch_linear", "liger"):
        assert re.search(rf"      largest batch_size with loss_impl {impl}: \d+ \([0-9.]+ GiB\)", out), impl
    assert "unpredictable" not in out


def test_fit_prices_each_gpu_side_by_side_from_one_fake_run(tmp_path, capsys):
    """Issue 43, scope 4: several --gpu, each with its verdict and its predicted step (phase shares, tokens/s)
    and, for --tokens, steps, device-hours and cost at the table's price or --price; one fake run for the cell (no
    offline twin without --epochs); the JSON and api.fit carry the same figures."""
    out = tmp_path / "fit.json"
    argv = ["fit", "--pair", "tiny-llama-teacher", "tiny-llama-student", "--seq-len", "128", "--batch-size", "2"]
    argv += ["--gpu", "H100", "--gpu", "mi300x", "--gpu", "h100-80gb", "--tokens", "1B", "--price", "MI300X=2"]
    assert main([*argv, "--out", str(out)]) == 0
    said, *lines = capsys.readouterr().out.splitlines()
    assert said.startswith("--pair of LMs: planned as such a pair is run, --precision bf16 ")  # issue 45 item 7
    assert [line.split(":")[0] for line in lines[1:3]] == ["device H100 80GB", "device MI300X"]  # h100-80gb once
    assert lines[3].startswith("budget --tokens 1B: device-hours = steps x predicted step time x world_size")
    assert any(line.startswith("      H100 80GB: fits (") for line in lines)
    assert any(line.startswith("      MI300X: fits (") for line in lines)
    h100 = next(line for line in lines if line.startswith("      step on H100 80GB  "))
    mi300x = next(line for line in lines if line.startswith("      step on MI300X     "))
    for line in (h100, mi300x):
        assert " ms a step (teacher_forward " in line and " tokens/s; 1B tokens: 3.91M steps, " in line
    assert h100.endswith(" at $3.90/device-hour") and mi300x.endswith(" at $2.00/device-hour")  # the table's, given
    assert lines[-2].startswith("1 cells: H100 80GB 1 fits; MI300X 1 fits; 1 fake runs in ")
    assert not any(line.startswith("      offline teacher") for line in lines)  # its twin: only with --epochs
    record = json.loads(out.read_text())
    assert [d["name"] for d in record["devices"]] == ["H100 80GB", "MI300X"] and record["device"]["name"] == "H100 80GB"
    h, m = record["cells"][0]["step_time"]
    assert (h["device"], h["price_per_hour"], m["price_per_hour"], m["price_source"]) == (
        "H100 80GB",
        3.90,
        2.0,
        "given: --price",
    )
    for t in (h, m):
        assert t["steps"] == 3_906_250 == math.ceil(10**9 / 256) and t["unit"] == "tokens"
        assert t["device_hours"] == pytest.approx(t["steps"] * t["step_ms"] / 3.6e6)
        assert t["cost"] == pytest.approx(t["device_hours"] * t["price_per_hour"])
        assert sum(t["phase_shares"].values()) == pytest.approx(1.0) and t["per_s"] == pytest.approx(
            256 / (t["step_ms"] / 1e3)
        )
    assert set(record["cells"][0]["verdicts"]) == {"H100 80GB", "MI300X"}
    from kdbench import api

    cell = CellConfig.model_validate(
        {
            "pair": {"teacher": "tiny-llama-teacher", "student": "tiny-llama-student"},
            "method": "forward_kl",
            "batch_size": 2,
            "data": {"kind": "tokens", "seq_len": 128},
            **{"precision": "bf16", "teacher_precision": "bf16", "teacher": {"weights": "bf16"}},  # --pair's for LMs
        }
    )
    report = api.fit([cell], ["H100", "MI300X"], tokens="1B", prices={"mi300x": 2})
    assert report.runs == 1 and [t.ms for t in report.cells[0].times] == pytest.approx([h["step_ms"], m["step_ms"]])
    assert [t.cost for t in report.cells[0].times] == pytest.approx([h["cost"], m["cost"]])


# --------------------------------------------------------------------------- user mistakes


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpu", "h10"], "--gpu h10: unknown device; did you mean "),
        (["--device-memory", "lots"], "--device-memory 'lots': not a size; write a number and a unit"),
        (["--device-memory", "0"], "--device-memory 0: must be a positive size, e.g. 80GB"),
        (["--device-memory=-80GB"], "--device-memory -80GB: must be a positive size, e.g. 80GB"),
        (["--gpu", "H200", "--max", "precision"], "--max precision: not a size key; --max takes batch_size or seq_len"),
        (
            ["--max", "batch_size"],
            "--max batch_size: needs a device to fit into; add --gpu NAME or --device-memory SIZE",
        ),
        (["--gpu", "H200", "--out", "FOLDER"], "--out FOLDER: is a folder; give a file name"),
        (["--gpu", "H200", "--device-memory", "80GB"], "argument --device-memory: not allowed with argument --gpu"),
        (["--batch-size", "4"], "--batch-size: sets the cell of --pair; a suite's cells are set in the suite"),
        (["--pair", "a", "b"], "give a suite or --pair TEACHER STUDENT, not both"),
        # a budget and its prices (issue 43): each before any fake run
        (["--gpu", "H100", "--tokens", "-5"], "--tokens -5: must be a positive number of tokens, e.g. 10B"),
        (["--gpu", "H100", "--tokens", "ten"], "--tokens 'ten': not a number of tokens; write e.g. 10B, 500M"),
        (["--gpu", "H100", "--steps", "-3"], "--steps: must be >= 1, got -3"),
        (["--gpu", "H100", "--steps", "x"], "--steps: expected an integer, got 'x'"),
        (["--gpu", "H100", "--tokens", "1B", "--steps", "5"], "argument --steps: not allowed with argument --tokens"),
        (["--tokens", "1B"], "--tokens 1B: prices a step on a GPU of the device table; add --gpu NAME"),
        (["--device-memory", "80GB", "--steps", "9"], "--steps 9: a device of 80GB is not a GPU of the device table"),
        (
            ["--gpu", "H100", "--gpu", "cpu"],
            "--gpu cpu: this machine's memory is judged with a CPU's fake run; give it",
        ),
        (["--gpu", "H100", "--tokens", "1B", "--price", "-1"], "--price -1: must be a price of 0 or more US dollars"),
        (["--gpu", "H100", "--tokens", "1B", "--price", "abc"], "--price abc: 'abc' is not a price; write US dollars"),
        (["--gpu", "H100", "--price", "2"], "--price 2: prices a budget's device-hours; add --tokens N or --steps N"),
        (
            ["--gpu", "H100", "--gpu", "MI300X", "--tokens", "1B", "--price", "2"],
            "--price 2: a bare price is the one --gpu's, and 2 are given (H100 80GB, MI300X); write --price DEVICE=2",
        ),
        (
            ["--gpu", "H100", "--tokens", "1B", "--price", "MI300X=2"],
            "--price MI300X=2: MI300X is not one of the --gpu devices (H100 80GB); add --gpu MI300X",
        ),
        (["--gpu", "H100", "--tokens", "1B", "--price", "H1000=2"], "--price H1000=2: unknown device 'H1000'; "),
        # the offline-teacher block's passes over the corpus (issue 44)
        (["--gpu", "H100", "--tokens", "1B", "--epochs", "0"], "--epochs: must be > 0, got 0"),
        (["--gpu", "H100", "--tokens", "1B", "--epochs", "-1"], "--epochs: must be > 0, got -1"),
        (["--gpu", "H100", "--tokens", "1B", "--epochs", "abc"], "--epochs: expected a number, got 'abc'"),
        (["--gpu", "H100", "--tokens", "1B", "--epochs", "inf"], "--epochs: expected a finite number, got 'inf'"),
        (
            ["--gpu", "H100", "--epochs", "3"],
            "--epochs 3: counts passes over a corpus of --tokens N; add --tokens N, the corpus's size",
        ),
        (
            ["--gpu", "H100", "--steps", "5", "--epochs", "2.5"],
            "--epochs 2.5: counts passes over a corpus of --tokens N (--steps 5 counts steps); add --tokens N",
        ),
    ],
)
def test_fit_mistakes_are_one_line_naming_the_flag(argv, message, suite, tmp_path, capsys):
    argv = [str(tmp_path) if a == "FOLDER" else a for a in argv]
    assert main(["fit", str(suite), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kdbench: error: "), err
    assert message.replace("FOLDER", str(tmp_path)) in err[0], err


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "fit: give a suite file (kdbench fit SUITE) or one pair (kdbench fit --pair TEACHER STUDENT)"),
        (["--pair", "tiny-llama-teacher", "tiny-lama-student"], "--pair: "),
        (["--pair", "tiny-llama-teacher", "tiny-llama-student", "--loss-impl", "fused"], "--loss-impl: "),
        (["--pair", "tiny-llama-teacher", "tiny-llama-student", "--parallel", "fsdp"], "--parallel: parallel fsdp"),
        (
            ["--pair", "resnet8", "linear", "--loss-impl", "fused_linear"],
            "--loss-impl: loss_impl fused_linear computes",
        ),
        (
            [
                "--pair",
                "tiny-llama-teacher",
                "tiny-llama-student",
                "--teacher-weights",
                "bf16",
                "--teacher-precision",
                "fp32",
            ],
            "--teacher-weights: teacher.weights bf16 computes the teacher in bf16",
        ),
        (
            ["--pair", "tiny-llama-teacher", "tiny-llama-student", "--precision", "bf16", "--gpu", "T4", "--tokens",
             "1B"],
            "--gpu T4: no bf16 peak in the device table (T4 has fp32, fp16), and cell 1 (",
        ),
        (
            ["--pair", "resnet8", "linear", "--gpu", "H100", "--tokens", "1B"],
            "--tokens 1B: cell 1 (resnet8->linear kd fp32 bs32) counts samples, not tokens (an image pair); give a "
            "number of steps, --steps N",
        ),
    ],
)  # fmt: skip
def test_fit_pair_mistakes_are_one_line(argv, message, capsys):
    assert main(["fit", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kdbench: error: {message}"), err


def test_a_fit_mistake_from_the_real_command_has_no_traceback():
    r = subprocess.run(
        [sys.executable, "-m", "kdbench", "fit", str(ROOT / "suites" / "llm-cuda.yaml"), "--gpu", "H2000"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "did you mean H200" in r.stderr


CORPUS = sorted((ROOT / "tests" / "malformed").glob("*.yaml"))


@pytest.mark.parametrize("path", CORPUS[::12], ids=[p.stem for p in CORPUS[::12]])
def test_fit_reads_suites_as_run_does_so_the_malformed_corpus_says_the_same(path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    expected = path.read_bytes().splitlines()[0].decode("ascii").removeprefix("# expect: ")
    assert main(["fit", str(path), "--gpu", "H200"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kdbench: error: {path}") and expected in err[0], err
