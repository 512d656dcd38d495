"""Benchmark: kdbench's step-time model against published GPU timings, beside torch's plain roofline.

Issue 43 scope 6.  For every speed row of ``tests/data/published/liger_benchmark_data.csv`` (Liger-Kernel's own
benchmark data: the distillation and divergence losses kdbench computes, on an A100, two H100s and a B200; the
README beside it gives the source), the row's operation runs once on fake tensors at its exact shapes and dtype
(:mod:`published_ops`), and its calls are priced two ways on the device's datasheet figures
(``kdbench.core.devices``):

* torch's plain roofline: per aten call max(FLOPs / peak, bytes / bandwidth), summed (:mod:`published_census`);
* kdbench's model: :func:`kdbench.fit.steptime.predict_step_time` of kdbench's census of the same calls, on
  :func:`kdbench.fit.steptime.rates_for` the device.

Each is printed beside the published median with its error (predicted / published - 1), per device and operation,
then the median |error| per device, the rows off by more than 2x, and whether kdbench's median beats the
roofline's.  Where kdbench has its own implementation of a fused-linear row (``dense`` for torch's rows,
``fused_linear`` for Liger's), its predicted time at the same shapes is printed too (a different computation from the
one timed: no error).  A device the catalogue lacks (the B200) is listed, not priced.  The distillation loss's
liger rows are priced on kdbench's ``fused_linear`` standing in for code that cannot be pinned (the data's README):
printed, marked, and left out of the medians and the bound.

Issue 43's bound (kdbench's median |error| <= 25 % per device, no row off by more than 2x, below the roofline's
median) is printed with its verdict, not asserted: the model's constants are the step-time model's to settle.  Asserted:
every row of a catalogue device is priced, both ways, to a positive finite time.  Figures: printed, attached to
pytest-benchmark's record and written to benchmarks/.results/step_time_published.json.  About 10 s on the 2-core VM
(fake tensors: no memory, no arithmetic).  ``python benchmarks/bench_step_time_published.py`` prints the same.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

from published_census import roofline_ms, run_fake
from published_ops import PROXY, kdbench_twin, load_rows, operation

from kdbench.core.devices import find_card
from kdbench.fit.steptime import predict_step_time

OUT = Path(__file__).resolve().parent / ".results" / "step_time_published.json"
BOUND = 0.25  # issue 43: kdbench's median |error| per device
FACTOR = 2.0  # issue 43: no row off by more than this factor


def _err(predicted: float, published: float) -> float:
    return predicted / published - 1.0


def _off(err: float) -> bool:
    ratio = 1.0 + err
    return ratio > FACTOR or ratio < 1.0 / FACTOR


def evaluate() -> dict:
    """Every speed row priced both ways, and the per-device summaries (module docstring)."""
    rows, missing = [], {}
    for row in load_rows():
        card = find_card(row.gpu)
        if card is None:
            missing[row.gpu] = missing.get(row.gpu, 0) + 1
            continue
        op = operation(row)
        fake = run_fake(op.build)
        roof = roofline_ms(fake.ops, card)
        step = predict_step_time(fake.census, card, row.precision)
        entry = {
            "device": card.name,
            "gpu": row.gpu,
            "kernel": row.kernel,
            "provider": row.provider,
            "mode": row.mode,
            "x_name": row.x_name,
            "x": row.x,
            "published_ms": row.p50,
            "published_p20_p80_ms": [row.p20, row.p80],
            "source": op.source,
            "what": op.what,
            "flops": fake.flops,
            "bytes": fake.bytes,
            "roofline_ms": roof,
            "roofline_err": _err(roof, row.p50),
            "kdbench_ms": step.ms,
            "kdbench_err": _err(step.ms, row.p50),
            "kdbench_bound": step.bound,
            "kdbench_classes_ms": step.classes,
        }
        twin = kdbench_twin(row)
        if twin is not None:
            tfake = run_fake(twin.build)
            entry["kdbench_impl"] = {
                "what": twin.what,
                "roofline_ms": roofline_ms(tfake.ops, card),
                "kdbench_ms": predict_step_time(tfake.census, card, row.precision).ms,
            }
        rows.append(entry)
    devices = {}
    for name in dict.fromkeys(r["device"] for r in rows):
        mine = [r for r in rows if r["device"] == name and r["source"] != PROXY]
        roof = statistics.median(abs(r["roofline_err"]) for r in mine)
        kdb = statistics.median(abs(r["kdbench_err"]) for r in mine)
        off = [r for r in mine if _off(r["kdbench_err"])]
        devices[name] = {
            "rows": len(mine),
            "proxy_rows_left_out": sum(r["device"] == name and r["source"] == PROXY for r in rows),
            "roofline_median_abs_err": roof,
            "kdbench_median_abs_err": kdb,
            "kdbench_off_2x": len(off),
            "roofline_off_2x": sum(_off(r["roofline_err"]) for r in mine),
            "kdbench_beats_roofline": kdb < roof,
            "issue_bound_met": kdb <= BOUND and not off and kdb < roof,
        }
    met = bool(devices) and all(d["issue_bound_met"] for d in devices.values())
    return {"rows": rows, "devices": devices, "not_priced": missing, "issue_bound_met": met}


def lines(result: dict) -> list[str]:
    """The printed table and summaries."""
    out = []
    head = f"  {'operation':<44} {'published':>10} {'roofline':>10} {'err':>7} {'kdbench':>10} {'err':>7}  kdbench impl"
    for name, summary in result["devices"].items():
        proxies = summary["proxy_rows_left_out"]
        note = f"; * {proxies} rows priced on kdbench's proxy, left out of the medians" if proxies else ""
        out.append(f"{name} ({summary['rows']} rows{note}; ms):")
        out.append(head)
        for r in (r for r in result["rows"] if r["device"] == name):
            label = f"{r['kernel']} {r['provider']} {r['mode']} {r['x_name']}={r['x']}"
            impl = r.get("kdbench_impl")
            tail = f"  {impl['what'].split(',')[0]} {impl['kdbench_ms']:,.2f}" if impl else ""
            mark = "*" if r["source"] == PROXY else " "
            out.append(
                f" {mark}{label:<44} {r['published_ms']:>10,.3f} {r['roofline_ms']:>10,.3f} {r['roofline_err']:>+7.0%} "
                f"{r['kdbench_ms']:>10,.3f} {r['kdbench_err']:>+7.0%}{tail}"
            )
    out.append("median |error| per device (issue 43: kdbench <= 25 %, none off > 2x, below the roofline's):")
    for name, s in result["devices"].items():
        out.append(
            f"  {name:<10} roofline {s['roofline_median_abs_err']:6.1%} ({s['roofline_off_2x']} off > 2x)   "
            f"kdbench {s['kdbench_median_abs_err']:6.1%} ({s['kdbench_off_2x']} off > 2x)   "
            f"{'beats' if s['kdbench_beats_roofline'] else 'does not beat'} the roofline; "
            f"bound {'met' if s['issue_bound_met'] else 'not met'}"
        )
    for gpu, n in result["not_priced"].items():
        out.append(f"  {gpu}: {n} rows not priced (no datasheet figures in kdbench.core.devices)")
    return out


def test_the_step_time_model_against_published_gpu_timings(benchmark, report_line):
    start = time.perf_counter()
    result = benchmark.pedantic(evaluate, rounds=1, iterations=1)
    result["seconds"] = time.perf_counter() - start
    for line in lines(result):
        report_line(line)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    benchmark.extra_info.update({"devices": result["devices"], "issue_bound_met": result["issue_bound_met"]})
    assert result["rows"], "no published row was priced"
    for r in result["rows"]:
        for key in ("roofline_ms", "kdbench_ms"):
            assert math.isfinite(r[key]) and r[key] > 0, f"{r['kernel']} {r['provider']} {r['mode']} {r['x']}: {key}"


if __name__ == "__main__":
    t0 = time.perf_counter()
    res = evaluate()
    print("\n".join(lines(res)))
    print(f"{time.perf_counter() - t0:.1f} s")
