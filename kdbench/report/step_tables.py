"""The report's tables of the distillation step: where its time goes (phases, cold start, compute rate, memory,
energy: :func:`profile_rows`), live against cached teacher (:func:`caching_rows`), offline teacher stores against
their live twins, scaled to a corpus (:func:`offline_rows`), the levers' one-off cost against their gain
(:func:`lever_rows`) and the top operators with the link to each trace (:func:`top_op_rows`).

Each returns the rows of one table of the page, formatted (:mod:`kdbench.report.format`), each cell's repeats
pooled as compare centres them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import quote

import pandas as pd

from kdbench.core.names import REMAINDER_COLUMN, Measurement
from kdbench.core.sizes import GB
from kdbench.report.charts import THIN_NOTE
from kdbench.report.format import (
    MISSING,
    format_int,
    format_mib,
    format_ms,
    format_percent,
    format_sig,
    text,
)
from kdbench.report.summaries import (
    MEASUREMENT_ORDER,
    REMAINDER_LIMIT,
    caching_pairs,
    latest_steps,
    offline_pairs,
    phase_gap,
    pooled,
    shown_phases,
)
from kdbench.store.logit_store import token_id_bytes

STALL_GAP = 0.05  # window throughput this far below the median-based one: the window had gaps or stalls


def lever_rows(df: pd.DataFrame) -> list[dict]:
    """The cells that paid a one-off cost for their levers, with the break-even against the same
    measurement without levers (derived columns, pooled over matched repeats), by run and cell."""
    rows = pooled(df)
    rows = rows[rows["one_off_ms"].notna()]
    rows = rows.assign(order_=rows["measurement"].map(MEASUREMENT_ORDER))
    out = []
    for r in rows.sort_values(["run_id", "cell_label", "order_", "batch_size"]).itertuples(index=False):
        gain = r.lever_gain_ms
        share = gain / r.lever_baseline_ms if pd.notna(gain) and r.lever_baseline_ms else None
        if r.thin is True:
            verdict = "thin: not judged"
        elif pd.isna(gain):
            verdict = "no twin without levers in this run"
        elif gain <= 0:
            verdict = "never: not faster"
        else:
            verdict = format_int(r.break_even_steps)
            tokens = getattr(r, "break_even_tokens", None)
            if pd.notna(tokens):  # a decode row: also in generated tokens
                verdict += f" ({format_int(tokens)} tokens)"
        if pd.notna(r.lever_gain_low_ms) and r.thin is not True:
            low = format_int(r.break_even_low_steps) if pd.notna(r.break_even_low_steps) else "never"
            high = format_int(r.break_even_high_steps) if pd.notna(r.break_even_high_steps) else "never"
            span = f"{low} – {high}"
            gain_range = f"{format_ms(r.lever_gain_low_ms)} – {format_ms(r.lever_gain_high_ms)}"
        else:
            span = gain_range = MISSING
        out.append(
            {
                "run_id": r.run_id,
                "cell_label": text(r.cell_label),
                "measurement": text(r.measurement)
                + (f" bs{int(r.batch_size)}" if r.measurement != Measurement.DISTILL_STEP else ""),
                "runtime": text(r.runtime) if pd.notna(r.runtime) else MISSING,
                "kind": text(r.one_off_kind),
                "one_off_s": format_sig(r.one_off_ms / 1e3),
                "net_s": format_sig(None if pd.isna(r.lever_one_off_net_ms) else r.lever_one_off_net_ms / 1e3),
                "repeats": int(r.repeats),
                "baseline": format_ms(r.lever_baseline_ms),
                "median": format_ms(r.median_ms),
                "gain": format_ms(gain),
                "gain_range": gain_range,
                "gain_pct": format_percent(share) if share is not None else MISSING,
                "break_even": verdict,
                "break_even_range": span,
                "check": text(r.output_check) if pd.notna(r.output_check) else "",
                "compile": MISSING
                if pd.isna(r.graph_breaks)
                else f"{int(r.graph_breaks)} breaks, {int(r.compiled_graphs)} graphs, {int(r.recompiles)} recompiles"
                if pd.notna(r.recompiles)
                else f"{int(r.graph_breaks)} breaks",
            }
        )
    return out


def _remainder(rem, median) -> tuple[str, bool | None]:
    """'0.130 ms (1.1 %)' and whether |remainder| exceeds REMAINDER_LIMIT of the median (None: unknown)."""
    if pd.isna(rem):
        return MISSING, None
    if pd.isna(median) or float(median) <= 0:
        return format_sig(rem, "ms"), None
    share = float(rem) / float(median)
    return f"{format_sig(rem, 'ms')} ({share * 100:.1f} %)", abs(share) > REMAINDER_LIMIT


def _gflops(flops, extra) -> str:
    """The step's model GFLOPs, and the loss_impl's extra work beside them where it did any (``+ 1.2 extra``)."""
    text = format_sig(None if pd.isna(flops) else flops / 1e9)
    if text != MISSING and pd.notna(extra) and extra > 0:
        text += f" + {format_sig(extra / 1e9)} extra"
    return text


def _varied(per_iteration, gap, median) -> str | None:
    """Why the phases shown do not add up although each iteration's did (its own phases left ``per_iteration``):
    the phase medians come from different iterations."""
    if pd.isna(per_iteration) or pd.isna(gap) or pd.isna(median) or float(median) <= 0:
        return None
    if abs(float(per_iteration)) / float(median) > REMAINDER_LIMIT:
        return None  # the stamps themselves leave time out: the remainder says so
    return (
        f"each iteration's phases add up to its step (median gap {format_sig(per_iteration, 'ms')}), but the phases "
        "varied between iterations: their medians, from different iterations, do not sum to the step median"
    )


def profile_rows(df: pd.DataFrame) -> list[dict]:
    """Per ok distill_step cell: its phases, cold start, compute rate, memory and energy, formatted (its
    repeats pooled as compare centres them).  The remainder and "adds up" are the step median minus the phases
    the row shows (:func:`kdbench.report.summaries.phase_gap`)."""
    out = []
    steps = pooled(df)
    steps = steps[steps["measurement"].eq(Measurement.DISTILL_STEP)].sort_values(["run_id", "cell_label"])
    phases = shown_phases(df)  # the same columns for every row (html.py heads the table with them)
    steps = steps.assign(gap_=phase_gap(steps))
    for r in steps.to_dict("records"):
        remainder, bad = _remainder(r["gap_"], r["median_ms"])
        steady = format_sig(r["time_to_steady_ms"])
        if steady != MISSING and pd.notna(r["steady_after_iters"]):
            steady += f" ({int(r['steady_after_iters'])} calls)"
        mfu = format_percent(r["mfu"])
        if mfu != MISSING and pd.notna(r["datasheet_device"]):
            mfu += f" of {r['datasheet_device']}"
        mfu_title = (
            f"achieved / datasheet peak {format_sig(r['datasheet_peak_tflops'], 'TFLOP/s')}"
            if pd.notna(r["datasheet_peak_tflops"])
            else ""
        )
        ceiling_title = "" if pd.isna(r["ceiling_probe_id"]) else f"probe {r['ceiling_probe_id']}"
        if pd.notna(r["ceiling_tflops"]):
            ceiling = f"measured ceiling {format_sig(r['ceiling_tflops'], 'TFLOP/s')}"
            ceiling_title = f"{ceiling}, {ceiling_title}" if ceiling_title else ceiling
        memory = format_mib(r["peak_memory_bytes"])
        if memory != MISSING and pd.notna(r["memory_kind"]):
            memory += f" ({r['memory_kind']})"
        warnings = []
        for column, what in (("nonfinite_steps", "non-finite step"), ("scaler_skips", "GradScaler skip")):
            if pd.notna(r[column]) and r[column] != 0:
                warnings.append(f"{int(r[column])} {what}{'s' if r[column] != 1 else ''}")
        if pd.notna(r["window_throughput"]) and pd.notna(r["throughput"]) and r["throughput"] > 0:
            gap = 1 - r["window_throughput"] / r["throughput"]
            if gap > STALL_GAP:
                warnings.append(f"window {gap:.0%} below the median's throughput: gaps or stalls")
        if bad and (why := _varied(r[REMAINDER_COLUMN], r["gap_"], r["median_ms"])):
            warnings.append(why)
        if r["launch_bound"] is True:
            warnings.append("launch-bound: measures the host, not the GPU")
        if r["thin"] is True:
            warnings.append(THIN_NOTE)
        if pd.notna(r["energy_window_s"]) and r["energy_window_s"] < 5:
            warnings.append(f"energy over {r['energy_window_s']:.2g} s: rough")
        out.append(
            {
                "run_id": r["run_id"],
                "cell_label": text(r["cell_label"]),
                "median": format_ms(r["median_ms"]),
                "repeats": int(r["repeats"]),
                "phases": [format_ms(r[p.column]) for p in phases],
                "remainder": remainder,
                "remainder_bad": bad,
                "first": format_ms(r["first_ms"]),
                "steady": steady,
                "gflops": _gflops(r["flops"], r["extra_flops"]),
                "tflops": format_sig(r["achieved_tflops"]),
                "mfu": mfu,
                "mfu_title": mfu_title,
                "ceiling": format_percent(r["ceiling_utilization"]),
                "ceiling_title": ceiling_title,
                "memory": memory,
                "optimizer_state": format_mib(r["optimizer_state_bytes"]),
                "energy": format_sig(r["energy_per_step_j"]),
                "samples_per_joule": format_sig(r["samples_per_joule"]),
                "warnings": warnings,
            }
        )
    return out


def caching_rows(df: pd.DataFrame) -> list[dict]:
    """Live vs cached teacher of the same cell and run: the saving per step and when caching pays back."""
    out = []
    for r in caching_pairs(df).to_dict("records"):
        saving = r["teacher_cache_saving_ms"]
        if pd.notna(r["teacher_cache_payback_steps"]):
            payback = format_int(r["teacher_cache_payback_steps"])
        elif saving <= 0:
            payback = "never (cached is not faster)"
        else:
            payback = MISSING
        out.append(
            {
                "run_id": r["run_id"],
                "cell_label": text(r["cell_label"]),
                "cached_label": text(r["cached_label"]),
                "live": format_ms(r["median_ms_live"]),
                "cached": format_ms(r["median_ms_cached"]),
                "saving_ms": format_ms(saving),
                "saving_pct": f"{saving / r['median_ms_live'] * 100:.1f} %" if r["median_ms_live"] > 0 else MISSING,
                "one_off": format_ms(r["teacher_cache_ms"]),
                "payback": payback,
            }
        )
    return out


OFFLINE_CORPUS = 10**9  # the offline section's stated corpus (tokens): the rows have none; its figures scale linearly


def _waited(phase_ms, wait_ms) -> tuple[str, str]:
    """How long an offline step waited for its batch and top-k, and which figure says it: the step's own phase
    (``phase_teacher_read_ms``, the counted steps' median) where the row has it, else the reader's wait
    (``teacher_read_wait_ms``, every step's median, warm-up too)."""
    if pd.notna(phase_ms):
        return format_ms(phase_ms), "phase"
    if pd.notna(wait_ms):
        return format_ms(wait_ms), "wait"
    return MISSING, ""


def _freed(live_bytes, offline_bytes) -> str:
    """The twin's peak minus the offline row's, in MiB (negative: the offline step holds more)."""
    if pd.isna(live_bytes) or pd.isna(offline_bytes):
        return MISSING
    return format_mib(float(live_bytes) - float(offline_bytes))


def offline_rows(df: pd.DataFrame, corpus: int = OFFLINE_CORPUS) -> list[dict]:
    """Offline-teacher cells against their live twins (:func:`kdbench.report.summaries.offline_pairs`): the store
    (encoding, bytes per token, build and read rates, page cache), the step's wait and medians, the saving per token
    and the pay-back in epochs (a corpus's size cancels), and for a corpus of ``corpus`` tokens the disk (top-k and
    token ids), the build's hours and the teacher memory freed (predicted and measured peaks)."""
    out = []
    for r in offline_pairs(df).to_dict("records"):
        per_token = r["saving_ms_per_token"]
        if pd.notna(r["payback_epochs"]):
            payback = format_sig(r["payback_epochs"])
        elif pd.notna(per_token) and per_token <= 0:
            payback = "never (offline is not faster)"
        else:
            payback = MISSING  # no build in this run (the store was reused) or no tokens
        bytes_per_token = r["teacher_store_bytes_per_token"]
        disk = format_sig(None if pd.isna(bytes_per_token) else corpus * float(bytes_per_token) / GB)
        seq_len = r.get("seq_len")
        ids = token_id_bytes(corpus, int(seq_len)) / GB if pd.notna(seq_len) and seq_len > 0 else None
        built, tokens = r["teacher_store_build_s"], r["teacher_store_tokens"]
        build_h = corpus * float(built) / float(tokens) / 3600 if pd.notna(built) and tokens and tokens > 0 else None
        waited, which = _waited(r.get("phase_teacher_read_ms"), r.get("teacher_read_wait_ms"))
        out.append(
            {
                "run_id": r["run_id"],
                "cell_label": text(r["cell_label"]),
                "twin": f"{text(r['offline_twin'])}: {text(r['twin_label'])}",
                "encoding": text(r["teacher_store_encoding"]),
                "bytes_per_token": format_sig(bytes_per_token),
                "forward_tps": format_int(r["teacher_store_forward_tokens_per_s"]),
                "encode_tps": format_int(r["teacher_store_encode_tokens_per_s"]),
                "read_tps": format_int(r["teacher_read_tokens_per_s"]),
                "read_ms": format_ms(r["teacher_read_ms"]),
                "page_cache": text(r["teacher_store_page_cache"]),
                "waited": waited,
                "waited_by": which,
                "live": format_ms(r["median_ms_live"]),
                "offline": format_ms(r["median_ms"]),
                "saving_per_token": format_sig(per_token),
                "payback": payback,
                "disk_gb": disk,
                "ids_gb": format_sig(ids),
                "build_h": format_sig(build_h),
                "freed_predicted": _freed(r["predicted_peak_bytes_live"], r["predicted_peak_bytes"]),
                "freed_measured": _freed(r["live_peak_bytes_live"], r["live_peak_bytes"]),
                "kl": format_sig(r["topk_reconstruction_kl"]),
            }
        )
    return out


def trace_link(trace_file: str, out_dir: str | Path) -> tuple[str, str]:
    """(href, text) of the link to a trace from the report folder.

    The text is the path relative to the report folder (forward slashes); the href is
    that path percent-encoded, so that no stored path can become another URL scheme
    (``javascript:``), a fragment or a query.  Both are HTML-escaped by the template.
    """
    try:
        rel = os.path.relpath(trace_file, out_dir)
    except ValueError:  # another drive (Windows): keep the path as it is
        rel = trace_file
    rel = rel.replace(os.sep, "/")
    return quote(rel, safe="/"), rel


def top_op_rows(df: pd.DataFrame, out_dir: Path) -> list[dict]:
    """Per traced ok distill_step cell: its top operators by self time, and the link to its trace."""
    out = []
    for r in latest_steps(df).to_dict("records"):
        if pd.isna(r["top_ops"]):
            continue
        try:
            ops = json.loads(r["top_ops"])
            rows = [
                {"op": str(o["op"]), "ms": format_ms(o.get("self_ms_per_call")), "count": format_int(o.get("count"))}
                for o in ops
            ]
            error = ""
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            rows, error = [], f"unreadable top_ops ({type(exc).__name__})"
        href, shown = (None, None) if pd.isna(r["trace_file"]) else trace_link(str(r["trace_file"]), out_dir)
        out.append(
            {
                "run_id": r["run_id"],
                "cell_label": text(r["cell_label"]),
                "ops": rows,
                "error": error,
                "href": href,
                "trace": shown,
            }
        )
    return out
