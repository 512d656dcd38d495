"""How often `kdbench compare` cries wolf, and how often it finds a real slowdown: the figures docs/verdicts.md
Verdicts section quotes, from many synthetic comparisons through compare's own statistics.

    python benchmarks/verdict_calibration.py [--trials 2000] [--out benchmarks/.results/verdicts.json]

A synthetic comparison has m = 20 measurements and r repeats a side.  Each repeat's level moves by the
process-to-process noise (lognormal with the given spread, or two process states: 30 % of processes 40 %
slower, the bimodal noise seen on a 2-core VM; or mixed: half the measurements at 2 %, half at 12 %); each
repeat's median by the sampling noise of 30 iterations at 2 % spread.  "False alarm" = the gate fails (a
measurement called regressed) when nothing changed: the family-wise rate the confidence bounds; "power" = one
cell's step made 1.5x slower is called regressed.
With one repeat a side compare does not judge; `--gate-single-repeat` judges on the iterations of one
process, simulated here with 30 samples per side.  Not collected by pytest (it is a calibration, not a test:
tests/unit/report/test_compare.py asserts the bounds on smaller draws).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kdbench.core.stats.repeats import bootstrap_ratio, simultaneous_t, spending  # noqa: E402
from kdbench.report.compare.verdicts import Verdict, undecided, verdict_of  # noqa: E402

M, WITHIN, N = 20, 0.02, 30


def family(rng, r: int, process: float, tails: str):
    if tails == "two-state":
        level = np.where(rng.random((2, M, r)) < 0.3, np.log(1.4), 0.0)
    elif tails == "mixed":
        level = rng.normal(0, 1, (2, M, r)) * np.where(np.arange(M) % 2 == 0, 0.02, 0.12)[None, :, None]
    else:
        level = rng.normal(0, process, (2, M, r))
    sampling = WITHIN * np.sqrt(np.pi / 2 / N)
    medians = np.exp(level + rng.normal(0, sampling, (2, M, r)))
    return [(medians[0, j], medians[1, j], sampling**2) for j in range(M)]


def rates(r: int, process: float, trials: int, tails: str = "normal", slow: float = 1.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    alarms = found = 0
    for _ in range(trials):
        fam = family(rng, r, process, tails)
        if slow != 1.0:
            b, n, f = fam[0]
            fam[0] = (b, n * slow, f)
        if r == 1:  # --gate-single-repeat: the within-process bootstrap of each side's iterations
            each = 1 - 0.05 / M
            verdicts = []
            for j, (b, n, _) in enumerate(fam):
                bs = b[0] * np.exp(rng.normal(0, WITHIN, N))
                ns = n[0] * np.exp(rng.normal(0, WITHIN, N))
                verdicts.append(verdict_of(bootstrap_ratio(bs, ns, each, seed=j, n_boot=2000), 0.05))
        else:
            verdicts = [verdict_of(iv, 0.05) for iv in simultaneous_t(fam, 0.95)]
        rest = verdicts[1:] if slow != 1.0 else verdicts
        alarms += Verdict.REGRESSED in rest
        found += slow != 1.0 and verdicts[0] == Verdict.REGRESSED
    return alarms / trials, found / trials


# The sequential design (compare --rerun-undecided): the noise of this 2-core VM's missed copies, the cap the docs
# recommend, and the slowdowns the docs state the power at.
SEQ_PROCESS, SEQ_REPEATS, SEQ_ROUNDS, SEQ_RATIOS = 0.15, 3, 6, (1.2, 1.5, 2.0)


def sequential(
    slow: float,
    trials: int,
    rounds: int = SEQ_ROUNDS,
    process: float = SEQ_PROCESS,
    r0: int = SEQ_REPEATS,
    m: int = M,
    seed: int = 0,
    confidence: float = 0.95,
    threshold: float = 0.05,
) -> dict:
    """Simulated sequential comparisons (`compare --rerun-undecided rounds`): m measurements, r0 repeats a side,
    then up to ``rounds`` rounds that give each undecided measurement one more repeat a side, look k judging at
    its share of alpha (kdbench.core.stats.repeats.spending) with compare's own intervals, verdicts and undecided
    rule; a measurement decided at a look keeps its verdict.  Measurement 0 of NEW is ``slow`` times slower.  Each
    repeat's level is lognormal with sd ``process`` (plus the sampling noise of a median of 30 iterations at 2 %).
    Returns the share of comparisons that called measurement 0 regressed ("found"), the share that called any
    other (any, when slow is 1) regressed ("false_alarm"), and the mean extra repeats a side per comparison."""
    rng = np.random.default_rng(seed)
    levels = [1 - a for a in spending(1 - confidence, rounds + 1)]
    sampling = WITHIN * np.sqrt(np.pi / 2 / N)
    found = alarms = extra = 0
    for _ in range(trials):
        medians = np.exp(rng.normal(0, process, (2, m, r0 + rounds)) + rng.normal(0, sampling, (2, m, r0 + rounds)))
        medians[1, 0] *= slow
        n = np.full(m, r0)
        verdicts: list = [None] * m
        open_ = np.ones(m, dtype=bool)
        for look, level in enumerate(levels, start=1):
            family = [(medians[0, j, : n[j]], medians[1, j, : n[j]], sampling**2) for j in range(m)]
            for j, iv in enumerate(simultaneous_t(family, level)):
                if open_[j]:
                    verdicts[j] = verdict_of(iv, threshold)
                    open_[j] = undecided(verdicts[j], iv.ratio, iv.high, threshold) and look < len(levels)
            if not open_.any():
                break
            n[open_] += 1
            extra += int(open_.sum())
        others = verdicts[1:] if slow != 1 else verdicts
        alarms += Verdict.REGRESSED in others
        found += slow != 1 and verdicts[0] == Verdict.REGRESSED
    return {"found": found / trials, "false_alarm": alarms / trials, "extra_repeats": extra / trials}


def sequential_table(trials: int) -> list[dict]:
    """The docs' power table: at 1 (A/A) and each of SEQ_RATIOS, without reruns and with SEQ_ROUNDS."""
    rows = []
    for rounds in (0, SEQ_ROUNDS):
        for i, slow in enumerate((1.0, *SEQ_RATIOS)):
            rows.append({"rounds": rounds, "slowdown": slow, **sequential(slow, trials, rounds, seed=10 * i + rounds)})
    return rows


def sequential_markdown(rows: list[dict]) -> str:
    """The table docs/verdicts.md holds between its sequential-power markers."""
    by = {(r["rounds"], r["slowdown"]): r for r in rows}
    head = "| | gate fails, nothing changed | " + " | ".join(f"{s:g}× slower found" for s in SEQ_RATIOS)
    lines = [head + " | extra repeats a side (A/A) |", "|---" * (len(SEQ_RATIOS) + 3) + "|"]
    for rounds in (0, SEQ_ROUNDS):
        what = f"`--repeat {SEQ_REPEATS}`" + (f", `--rerun-undecided {rounds}`" if rounds else "")
        cells = [f"{by[rounds, 1.0]['false_alarm']:.1%}"] + [f"{by[rounds, s]['found']:.1%}" for s in SEQ_RATIOS]
        lines.append(f"| {what} | " + " | ".join(cells) + f" | {by[rounds, 1.0]['extra_repeats']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / ".results" / "verdicts.json")
    ap.add_argument(
        "--sequential",
        action="store_true",
        help="print the sequential design's power table (compare --rerun-undecided) for docs/verdicts.md",
    )
    args = ap.parse_args()
    if args.sequential:
        print(sequential_markdown(sequential_table(args.trials)), end="")
        return
    table = []
    for tails, process in (("normal", 0.03), ("normal", 0.10), ("two-state", 0.0), ("mixed", 0.0)):
        for r in (1, 2, 3, 5, 10):
            trials = args.trials // 4 if r == 1 else args.trials
            false_alarm, _ = rates(r, process, trials, tails, seed=r)
            power = {s: rates(r, process, trials // 2, tails, slow=s, seed=100 + r)[1] for s in (1.5,)}
            row = {
                "noise": tails,
                "process": process,
                "repeats": r,
                "false_alarm": false_alarm,
                "power_1.5x": power[1.5],
            }
            row["note"] = "--gate-single-repeat" if r == 1 else ""
            table.append(row)
            print(
                f"{tails:9s} {process:4.0%} r={r:2d}: false alarm {false_alarm:6.1%} of comparisons, "
                f"1.5x found {power[1.5]:6.1%} {row['note']}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"m": M, "trials": args.trials, "table": table}, indent=2) + "\n")
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
