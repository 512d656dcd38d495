"""The fit stage: one GiB-scale cell (qwen2.5-1.5b -> qwen2.5-0.5b, bf16, 2 x 2,048 tokens, fused_linear), its peak
predicted by the fit planner (a fake run, on the CPU) and, on a GPU, measured as ``kdbench run`` measures it: the
prediction against ``max_memory_allocated`` (the row's live peak), the caching allocator's reserve
(``memory_reserved``), and the runtime's context (what ``mem_get_info`` says is used beyond the reserve), beside
what kdbench's headroom model keeps for this card.  GPU review 4, M4: the planner's tolerance was measured on the CPU
with sub-GiB cells, and the headroom (a runtime context, the BLAS workspaces, fragmentation) on no GPU at all; this
stage prints the figures that settle both in one run.  Information, not checks, but the cell must run and be
predicted."""

from __future__ import annotations

import gc
from typing import Any

import torch

from kdbench.config.plan import Cell
from kdbench.config.schema import CellConfig
from kdbench.core.errors import KdbenchError
from kdbench.fit.columns import prediction_of
from kdbench.hw.backends import Backend
from kdbench.models.cache import ModelCache
from kdbench.run.cell import measure_cell

from ..report import Report

GIB = 2**30


def gib_config() -> CellConfig:
    """The stage's cell: a Qwen2.5 1.5B teacher and 0.5B student (random weights, a 151,936-token vocabulary), bf16,
    the teacher's weights held in bf16, 2 x 2,048 tokens, fused_linear; the step alone, timed briefly."""
    return CellConfig.model_validate(
        {
            "pair": {"teacher": "qwen2.5-1.5b", "student": "qwen2.5-0.5b"},
            "data": {"kind": "tokens", "seq_len": 2048, "prompt_fraction": 0.25},
            "method": "forward_kl",
            "precision": "bf16",
            "teacher_precision": "bf16",
            "teacher": {"weights": "bf16"},
            "batch_size": 2,
            "loss_impl": "fused_linear",
            "timing": {"warmup": 1, "min_iters": 3, "min_time_s": 0.2},
            "inference": {"batch_sizes": []},
        }
    )


def check_fit(backend: Backend, report: Report) -> None:
    report.section("fit: a GiB-scale cell, the planner's prediction against the allocator (GPU review 4, M4)")
    config = gib_config()
    # a GPU target's prediction everywhere (its autocast lists, fused attention; on a GPU its BLAS workspaces):
    # on the CPU the stage shows what a GPU will be held against
    prediction = prediction_of(config, "cuda")
    label = "qwen2.5-1.5b->qwen2.5-0.5b bf16 2x2048 fused_linear"
    if not report.check(
        f"{label}: predicted "
        + (
            f"{prediction.peak_bytes / GIB:.2f} GiB in {prediction.phase} ({prediction.seconds:.1f} s fake run)"
            if prediction.ok
            else f"nothing: {prediction.error}"
        ),
        prediction.ok,
    ):
        return
    report.info("breakdown: " + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in prediction.breakdown.items()))
    if backend.device_type != "cuda":
        report.info("no GPU: the measured peak, the reserve and the context need one")
        return
    gc.collect()
    torch.cuda.empty_cache()
    rows = measure_cell(Cell(0, "fit-gib", config), backend, ModelCache()) or []
    step = next((r for r in rows if r.get("measurement") == "distill_step"), None)
    if not report.check(
        f"{label}: measured " + (f"status {step['status']}" if step else "no step row"),
        step is not None and step["status"] == "ok",
    ):
        if step is not None and step.get("error"):
            report.info(f"error: {step['error']}")
        return
    for line in memory_lines(step, device_memory(backend)):
        report.info(line)
    report.info(headroom_line(torch.cuda.get_device_properties(backend.device).name))


def device_memory(backend: Backend) -> dict[str, int]:
    """What the device says now: its total and free memory (``mem_get_info``), this process's allocator reserve and
    allocation, and the context: total - free - reserved (the runtime, kernel images, the BLAS workspaces' share
    outside the reserve, and any other process)."""
    torch.cuda.synchronize(backend.device)
    free, total = torch.cuda.mem_get_info(backend.device)
    reserved = torch.cuda.memory_reserved(backend.device)
    return {
        "total": int(total),
        "free": int(free),
        "reserved": int(reserved),
        "allocated": int(torch.cuda.memory_allocated(backend.device)),
        "context": int(total - free - reserved),
    }


def memory_lines(row: dict[str, Any], device: dict[str, int]) -> list[str]:
    """The stage's figures: predicted against measured, the allocator's reserve at the peak, and the device's."""
    lines = []
    predicted, live = row.get("predicted_peak_bytes"), row.get("live_peak_bytes")
    peak, reserved = row.get("peak_memory_bytes"), row.get("peak_reserved_bytes")
    if predicted and live:
        lines.append(
            f"predicted {predicted / GIB:.3f} GiB, measured {live / GIB:.3f} GiB (max_memory_allocated over one more "
            f"step), measured/predicted {live / predicted:.3f}"
        )
    else:
        lines.append(f"predicted {predicted}, measured {live}: " + str(row.get("notes") or "no reason given"))
    if peak and reserved:
        lines.append(
            f"timed steps: peak allocated {peak / GIB:.3f} GiB, peak reserved {reserved / GIB:.3f} GiB, "
            f"reserved/allocated {reserved / peak:.3f} (the caching allocator's rounding and fragmentation)"
        )
    lines.append(
        f"device now: total {device['total'] / GIB:.2f} GiB, free {device['free'] / GIB:.2f} GiB, reserved "
        f"{device['reserved'] / GIB:.2f} GiB, allocated {device['allocated'] / GIB:.2f} GiB, context "
        f"{device['context'] / GIB:.3f} GiB (total - free - reserved)"
    )
    return lines


def headroom_line(name: str) -> str:
    """What kdbench's headroom model (the device table's entry, not the GPU measured now) takes of the card called
    ``name``, to hold beside the measured figures: the total it starts from, the context and the BLAS workspaces it
    keeps, the fragmentation share of the peak, and what a step may reach; a card the catalogue lacks says so."""
    from kdbench.fit.devices import find_device, headroom_figures

    try:
        device = find_device(name, live=False)
    except KdbenchError:
        return f"kdbench's device table has no {name}: `kdbench fit --device-memory SIZE` judges it"
    f = headroom_figures(device)
    return (
        f"kdbench's headroom model for {device.name}: total {f['total_bytes'] / GIB:.2f} GiB ({f['total_source']}), "
        f"context kept {f['context_bytes'] / GIB:.3f} GiB, BLAS workspaces {f['workspace_bytes'] / 2**20:.0f} MiB, "
        f"fragmentation {f['fragmentation']:.0%} of the peak, usable {f['usable_bytes'] / GIB:.2f} GiB: compare the "
        "context with total - free - reserved and the fragmentation with reserved/allocated - 1"
    )
