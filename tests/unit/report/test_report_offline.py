"""The report's Offline teacher stores section (issue 44): each offline cell beside its live twin, every figure it
prints recomputed here from the rows (pooled over repeats), the disk, build hours and memory freed for the stated
corpus of 1B tokens, "never" where the offline step is slower, and no section for a run without offline cells."""

from __future__ import annotations

import html
import json
import math
import re
from datetime import UTC, datetime

import pytest

from kdbench.core.schema import Row
from kdbench.report import render_report
from kdbench.report.format import format_mib, format_ms, format_sig
from tests.support.helpers import as_read
from tests.support.rows import result_row, timing

MIB = 2**20
N = 10**9  # the section's stated corpus
SEQ = 32
TOKENS = 2 * SEQ  # a step's tokens: batch 2 of 32


def _config(mode: str, **teacher) -> str:
    return json.dumps(
        {"pair": {"teacher": "gpt2", "student": "gpt2"}, "seq_len": SEQ, "teacher": {"mode": mode, **teacher}},
        sort_keys=True,
    )


def _row(label: str, mode: str, median_ms: float, repeat: int = 1, run: str = "run-o", **extra) -> Row:
    teacher = extra.pop("teacher", {})
    row = result_row(
        run_id=run, suite="lm", cell_id=f"id-{run}-{label}", cell_label=label, batch_size=2, precision="fp32",
        teacher="gpt2", student="gpt2", method="forward_kl", world_size=1, data_kind="tokens", seq_len=SEQ,
        tokens=TOKENS, repeat=repeat, teacher_mode=mode, config_json=_config(mode, **teacher),
        timestamp=datetime(2026, 1, 2, 3, 4, 5 + repeat, tzinfo=UTC),
    )  # fmt: skip
    row.update(timing(median_ms, 2, n=20, iqr=0.02, p05=0.97, p95=1.05))
    return row | extra


LIVE = [
    _row("live", "live", ms, repeat=i + 1, predicted_peak_bytes=900 * MIB, live_peak_bytes=950 * MIB)
    for i, ms in enumerate((20.0, 22.0))
]
FAST = dict(  # faster than its twin: pays back
    teacher={"k": 32, "values": "fp16"}, teacher_store_encoding="k32 fp16 int32 none",
    teacher_store_bytes_per_token=196.0, teacher_store_build_s=30.0, teacher_store_tokens=65536,
    teacher_store_forward_tokens_per_s=50000.0, teacher_store_encode_tokens_per_s=20000.0,
    teacher_read_tokens_per_s=400000.0, teacher_read_ms=0.35, teacher_read_wait_ms=0.2, phase_teacher_read_ms=0.05,
    teacher_store_page_cache="warm", topk_reconstruction_kl=0.0123, predicted_peak_bytes=400 * MIB,
    live_peak_bytes=420 * MIB,
)  # fmt: skip
SLOW = dict(  # slower than its twin: never pays back; no phase (the wait instead), no measured peak
    teacher={"k": 8, "values": "bf16", "compression": "zstd"}, teacher_store_encoding="k8 bf16 int32 zstd",
    teacher_store_bytes_per_token=52.5, teacher_store_build_s=12.0, teacher_store_tokens=32768,
    teacher_store_forward_tokens_per_s=60000.0, teacher_store_encode_tokens_per_s=9000.0,
    teacher_read_tokens_per_s=80000.0, teacher_read_ms=1.8, teacher_read_wait_ms=1.5,
    teacher_store_page_cache="cold", topk_reconstruction_kl=0.25, predicted_peak_bytes=380 * MIB,
)  # fmt: skip
OFFLINE = [
    *(_row("offline k32", "offline", ms, repeat=i + 1, **FAST) for i, ms in enumerate((12.0, 13.0))),
    *(_row("offline k8", "offline", ms, repeat=i + 1, **SLOW) for i, ms in enumerate((25.0, 24.0))),
]
HEADER = (
    "run_id", "cell", "twin", "encoding", "bytes/token", "forward", "encode", "read", "read ms", "page cache",
    "waited", "live", "offline", "saving", "payback", "disk", "ids", "build h", "freed predicted", "freed measured",
    "kl",
)  # fmt: skip


def _cells(tr: str) -> list[str]:
    return [html.unescape(re.sub(r"<[^>]+>", "", td)).strip() for td in re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)]


def _page(rows, out) -> str:
    return render_report(as_read(rows), out).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def offline(tmp_path_factory) -> dict[str, dict[str, str]]:
    page = _page(LIVE + OFFLINE, tmp_path_factory.mktemp("offline"))
    assert "Offline teacher stores" in page and "a stated corpus of N = 1,000,000,000 tokens" in page
    rows = [dict(zip(HEADER, _cells(tr))) for tr in re.findall(r'<tr class="offline-row">(.*?)</tr>', page, re.S)]
    assert all(len(r) == len(HEADER) for r in rows)
    return {r["cell"]: r for r in rows}


def test_each_offline_cell_is_shown_beside_its_live_twin_with_the_store_figures(offline):
    assert sorted(offline) == ["offline k32", "offline k8"]  # the live cell is a twin, not a row
    fast, slow = offline["offline k32"], offline["offline k8"]
    assert (fast["run_id"], fast["twin"], fast["encoding"], fast["page cache"]) == (
        "run-o",
        "live: live",
        "k32 fp16 int32 none",
        "warm",
    )
    assert (fast["bytes/token"], fast["forward"], fast["encode"]) == ("196", "50,000", "20,000")
    assert (fast["read"], fast["read ms"], fast["kl"]) == ("400,000", "0.350", "0.0123")
    assert fast["waited"] == "0.0500 (phase)"  # phase_teacher_read_ms where the row has it
    assert slow["waited"] == "1.50 (wait)"  # else teacher_read_wait_ms
    assert (slow["encoding"], slow["page cache"], slow["bytes/token"]) == ("k8 bf16 int32 zstd", "cold", "52.5")


def test_the_saving_and_pay_back_are_the_pooled_medians_arithmetic(offline):
    live = math.sqrt(20.0 * 22.0)  # repeats pooled as compare centres them: the geometric mean
    fast_ms, slow_ms = math.sqrt(12.0 * 13.0), math.sqrt(25.0 * 24.0)
    fast, slow = offline["offline k32"], offline["offline k8"]
    assert (fast["live"], fast["offline"], slow["offline"]) == (format_ms(live), format_ms(fast_ms), "24.5")
    per_token = (live - fast_ms) / TOKENS
    assert fast["saving"] == format_sig(per_token) == "0.133"
    # pay-back in epochs: the build's ms per token over the saving per token (a corpus's size cancels)
    assert fast["payback"] == format_sig(30.0 * 1e3 / 65536 / per_token) == "3.45"
    assert slow["saving"] == format_sig((live - slow_ms) / TOKENS) == "-0.0550"
    assert slow["payback"] == "never (offline is not faster)"


def test_the_corpus_figures_scale_the_rows_to_a_billion_tokens(offline):
    fast, slow = offline["offline k32"], offline["offline k8"]
    assert fast["disk"] == format_sig(N * 196.0 / 1e9) == "196"  # GB: N x bytes/token
    assert slow["disk"] == "52.5"
    ids = math.ceil(N / SEQ) * (SEQ + 1) * 4 / 1e9  # int32 windows of seq_len + 1
    assert fast["ids"] == slow["ids"] == format_sig(ids) == "4.12"  # 4.125 GB: 31,250,000 windows of 33 ids
    assert fast["build h"] == format_sig(N * 30.0 / 65536 / 3600) == "127"
    assert slow["build h"] == format_sig(N * 12.0 / 32768 / 3600) == "102"
    assert fast["freed predicted"] == format_mib(500 * MIB) == "500.0 MiB"  # the twin's predicted peak minus its own
    assert fast["freed measured"] == format_mib(530 * MIB)  # live_peak_bytes: 950 - 420 MiB
    assert (slow["freed predicted"], slow["freed measured"]) == ("520.0 MiB", "—")  # no measured peak on the row


def test_a_store_not_built_in_the_run_has_no_build_or_pay_back(tmp_path):
    reused = [r if r["cell_label"] != "offline k32" else r | {"teacher_store_build_s": None} for r in OFFLINE]
    page = _page(LIVE + reused, tmp_path)
    (tr,) = [tr for tr in re.findall(r'<tr class="offline-row">(.*?)</tr>', page, re.S) if "offline k32" in tr]
    row = dict(zip(HEADER, _cells(tr)))
    assert (row["build h"], row["payback"], row["disk"]) == ("—", "—", "196")


def test_a_run_without_offline_cells_has_no_section(tmp_path):
    assert "Offline teacher stores" not in _page(LIVE, tmp_path / "live")
    alone = _page([_row("offline k32", "offline", 12.0, run="run-x", **FAST)] + LIVE, tmp_path / "alone")
    assert "No offline-teacher cell has a live twin in its run." in alone and 'class="offline-row"' not in alone


def test_a_data_parallel_offline_cell_is_shown_beside_its_fsdp_sharded_twin(tmp_path):
    def ranks(label, mode, median_ms, parallel, **extra):
        row = _row(label, mode, median_ms, world_size=2, parallel=parallel, **extra)
        config = json.loads(row["config_json"]) | {"world_size": 2}
        config |= {"ddp": {"bucket_cap_mb": 25}} if parallel == "ddp" else {"parallel": "fsdp", "fsdp": {}}
        return row | {"config_json": json.dumps(config, sort_keys=True)}

    rows = [
        ranks("ddp live", "live", 16.0, "ddp", predicted_peak_bytes=900 * MIB),
        ranks("fsdp live", "live", 18.0, "fsdp", predicted_peak_bytes=700 * MIB),
        ranks("offline ddp", "offline", 10.0, "ddp", **FAST),
    ]
    page = _page(rows, tmp_path)
    (tr,) = re.findall(r'<tr class="offline-row">(.*?)</tr>', page, re.S)
    row = dict(zip(HEADER, _cells(tr)))
    assert (row["twin"], row["live"], row["offline"]) == ("live fsdp: fsdp live", "18.0", "10.0")
    assert row["saving"] == format_sig(8.0 / (2 * TOKENS)) == "0.0625"  # every rank's tokens
    assert row["freed predicted"] == "300.0 MiB"  # the FSDP twin's 700 MiB minus the offline cell's 400
