"""Benchmark: greedy decode of the tiny LM pair with each generation backend, against its memory-bandwidth floor.

suites/llm-cpu.yaml's pair (tiny-llama-teacher -> tiny-llama-student, a 32,000-entry vocabulary), fp32, on the
CPU: a batch of BATCH prompts of PROMPT tokens, each decode call generating NEW tokens greedily from the
prompt's KV cache, as kdbench's decode rows do (:class:`kdbench.models.generation.GreedyServing`, each call
from the same state), with the three generation backends: ``dynamic`` (transformers' growing cache, eager),
``static`` (its StaticCache) and ``static + compile`` (the decode step through ``torch.compile``, fullgraph, mode
default).  Each is timed by kdbench's loop (a cold call, WARMUP untimed ones, RUNS timed ones): tokens/s at the
median call; the one-off cost is the cold and warm-up calls' excess over as many median calls (the compile),
net of the dynamic backend's own; the break-even is the calls (and tokens) after which the per-call gain over
dynamic repays it (none when there is no gain).  Each generated token must read ``decode_bytes_per_token``
(:mod:`kdbench.measure.decode_floor`: weights / batch + the KV cache at its mean length); its share of the
bandwidth ceiling is that × tokens/s over the ceiling: the newest ``kdbench probe`` of this device in
``results/probes`` if there is one, else a quick copy-bandwidth measurement (:func:`measure_ceilings` with the
copy only).  The copy's GB/s count bytes read + written; the model's weights may sit in the CPU's caches (the
student's are ~20 MB), so a share above 1 is possible here and means the floor, not the measurement, is off.
Every backend's tokens must equal dynamic's (asserted); no speed is asserted (the machine is shared).  The
figures are printed, attached to pytest-benchmark's record and written to benchmarks/.results/decode_backends.json.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from kdbench.hw.backends import resolve
from kdbench.measure.decode_floor import model_decode_bytes_per_token
from kdbench.measure.levers import release_compiled
from kdbench.measure.timing import timed_loop
from kdbench.models.generation import GreedyServing, release
from kdbench.models.lm import build_lm
from kdbench.store.derived import payback_steps

BATCH, PROMPT, NEW, VOCAB = 1, 64, 16, 32000
WARMUP, RUNS = 1, 3
ROLES = {"student": "tiny-llama-student", "teacher": "tiny-llama-teacher"}
BACKENDS = {"dynamic": None, "static": ("static", False), "static + compile": ("static", True)}
ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).resolve().parent / ".results" / "decode_backends.json"


class Generation:  # what a cell's `generation` holds
    def __init__(self, cache: str, compile: bool):
        self.cache, self.compile = cache, compile


def _ceiling(backend) -> tuple[float, str]:
    """The copy bandwidth (GB/s) and where it comes from: the newest probe of this device, else measured now."""
    from kdbench.hw.environment import capture
    from kdbench.measure.probe import measure_ceilings
    from kdbench.store.probes import latest_ceiling

    found = latest_ceiling(ROOT / "results" / "probes", capture(backend)["device_name"], backend.name)
    if found and found.get("copy"):
        return float(found["copy"]), f"probe {found['probe_id']}"
    (copy,) = measure_ceilings(backend, dtypes=(), min_time_s=0.3)
    return float(copy["value"]), f"measured now ({copy['size'] / 2**20:.0f} MiB copy, p05 of its calls)"


def _measure(lm, ids, setting) -> dict:
    generation = None if setting is None else Generation(*setting)
    gen = GreedyServing(lm, ids, NEW, generation, "cpu")

    def call() -> None:
        with torch.inference_mode():
            gen.decode()

    with torch.inference_mode():
        gen.start()
    raw = timed_loop(call, resolve("cpu").clock(), warmup=WARMUP, min_iters=RUNS, min_time_s=0.0, max_iters=RUNS)
    median = statistics.median(raw.samples_ms)
    out = {
        "median_ms": median,
        "times_ms": raw.samples_ms,
        "tokens_per_s": BATCH * NEW / (median / 1e3),
        "cold_excess_ms": raw.cold_excess_ms(median),
        "tokens": gen.generated().tolist(),
    }
    if release(gen.store):  # what it compiled: not alive in the next backend's measurement
        release_compiled(resolve("cpu"))
    return out


def _pair() -> dict:
    backend = resolve("cpu")
    gbps, source = _ceiling(backend)
    ids = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    out = {"ceiling_gbps": gbps, "ceiling_source": source, "models": {}}
    for role, name in ROLES.items():
        torch.manual_seed(0)
        lm = build_lm(name, {"vocab_size": VOCAB}, device="cpu", dtype=torch.float32).eval()
        per_token = model_decode_bytes_per_token(lm, 4, BATCH, PROMPT, NEW)
        rows = {label: _measure(lm, ids, setting) for label, setting in BACKENDS.items()}
        dynamic = rows["dynamic"]
        for row in rows.values():
            row["bytes_per_token"] = per_token
            row["bandwidth_share"] = per_token * row["tokens_per_s"] / (gbps * 1e9)
            row["same_tokens_as_dynamic"] = row["tokens"] == dynamic["tokens"]
            net = max(0.0, row["cold_excess_ms"] - dynamic["cold_excess_ms"])
            gain = dynamic["median_ms"] - row["median_ms"]
            calls = payback_steps(net, gain)
            row.update(one_off_net_ms=net, gain_ms=gain, break_even_calls=calls)
            row["break_even_tokens"] = None if calls is None else calls * BATCH * NEW
        out["models"][role] = {"name": name, "floor_ms_per_token": per_token / (gbps * 1e9) * 1e3, "backends": rows}
    return out


def test_decode_backends(benchmark, report_line):
    result = benchmark.pedantic(_pair, rounds=1, iterations=1)
    result.update(batch=BATCH, prompt=PROMPT, new_tokens=NEW, vocab=VOCAB, runs=RUNS, threads=torch.get_num_threads())
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    benchmark.extra_info.update({k: v for k, v in result.items() if k != "models"})

    report_line(
        f"Greedy decode, tiny Llama pair, {VOCAB} vocab, fp32, batch {BATCH}, {PROMPT}-token prompt, {NEW} new "
        f"tokens a call, {result['threads']} threads; bandwidth ceiling {result['ceiling_gbps']:.1f} GB/s "
        f"({result['ceiling_source']}):"
    )
    report_line(
        f"  {'model':<9}{'backend':<18}{'tokens/s':>10}{'MB/token':>10}{'of floor':>10}{'one-off ms':>12}"
        f"{'break-even tokens':>19}  same tokens"
    )
    for role, model in result["models"].items():
        for label, row in model["backends"].items():
            even = "never" if row["break_even_tokens"] is None else f"{row['break_even_tokens']:,}"
            report_line(
                f"  {role:<9}{label:<18}{row['tokens_per_s']:>10,.0f}{row['bytes_per_token'] / 1e6:>10.2f}"
                f"{row['bandwidth_share']:>10.1%}{row['one_off_net_ms']:>12,.0f}{even:>19}  "
                f"{row['same_tokens_as_dynamic']}"
            )
    report_line(f"  saved to {OUT}")

    for role, model in result["models"].items():
        for label, row in model["backends"].items():
            assert row["same_tokens_as_dynamic"], f"{role} {label}: its greedy tokens differ from dynamic's"
            assert row["bandwidth_share"] > 0 and row["tokens_per_s"] > 0
        assert model["backends"]["static + compile"]["one_off_net_ms"] > 0  # the compile is paid once
