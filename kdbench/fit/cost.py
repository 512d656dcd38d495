"""What a cell's step costs on a device of the table: its predicted step time (:mod:`kdbench.fit.steptime`, priced
from the operator census of the planner's fake run), what the step processes per second, and for a budget
(``--tokens 10B`` or ``--steps N``) the device-hours and the money at the catalogue's or the user's hourly price.

Everything here is arithmetic on one :class:`~kdbench.fit.planner.Prediction`: the fake run is made once per cell,
whatever the number of devices (:mod:`kdbench.fit.cells`), and each device only re-prices its census.

* **What a step processes**: a token pair (an LM or an encoder) counts tokens, as its step row's ``tokens`` column
  does (the workload's own count: ``batch_size x seq_len`` per rank, an on-policy step its prompt and completion);
  an image pair counts samples (``batch_size`` per rank).  Over ``world_size`` ranks a step processes
  ``world_size`` times that.
* **Hours**: a budget of tokens is ``ceil(tokens / tokens per step)`` steps; ``steps x step time`` is the wall time,
  and ``world_size`` devices are busy for all of it: device-hours = wall hours x ``world_size``.
* **Cost**: device-hours x the hourly price per device (:attr:`kdbench.core.devices.Card.price`, on demand, with
  its source; ``--price`` overrides it).  Nothing else is priced: storage, egress, the host, idle time.

A device without a peak for the cell's precision (a T4 has no bf16 or TF32) has no step time: a
:class:`DeviceTime` that says so (``missing``), not an error.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from kdbench.config.schema import CellConfig
from kdbench.core.devices import Card
from kdbench.core.errors import KdbenchError

TOKENS, SAMPLES, STEPS = "tokens", "samples", "steps"
BUDGET_KINDS = (TOKENS, STEPS)
# The devices the report's "predicted on other devices" table prices every step row on (kdbench.fit.columns).
REPORT_DEVICES = ("H100 80GB", "H200", "MI300X")
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_AMOUNT = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)\s*([kmbgt]?)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Budget:
    """What a run is to do: ``amount`` tokens (a token pair's) or steps (any cell's), as the user wrote it."""

    kind: str  # TOKENS or STEPS
    amount: int
    given: str  # "--tokens 10B": the flag and the text, for messages

    def text(self) -> str:
        return f"{count_text(self.amount)} {self.kind}"


def parse_tokens(text: str, flag: str = "--tokens") -> Budget:
    """A number of tokens as a user writes it: ``10B``, ``500M``, ``2.5T``, ``100k``, ``1e9``, ``1000000``
    (K = 10^3, M = 10^6, B or G = 10^9, T = 10^12); KdbenchError naming ``flag`` for anything else or a count that
    is not positive."""
    found = _AMOUNT.match(str(text))
    if found is None:
        raise KdbenchError(f"{flag} {text!r}: not a number of tokens; write e.g. 10B, 500M, 2.5T or 1e9")
    value = float(found.group(1)) * _SUFFIX[found.group(2).lower()]
    if not math.isfinite(value) or value < 1:
        raise KdbenchError(f"{flag} {str(text).strip()}: must be a positive number of tokens, e.g. 10B")
    return Budget(TOKENS, round(value), f"{flag} {str(text).strip()}")


def steps_budget(steps: int, flag: str = "--steps") -> Budget:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise KdbenchError(f"{flag} {steps}: must be a positive number of steps, e.g. 1000")
    return Budget(STEPS, steps, f"{flag} {steps}")


def parse_price(text: str, flag: str = "--price") -> tuple[str | None, float]:
    """``--price USD_PER_HOUR`` (the one device's) or ``--price DEVICE=USD_PER_HOUR``: (the device as written, or
    None; US dollars per device-hour, finite and not negative)."""
    name, _, value = str(text).rpartition("=")
    if "=" in str(text) and not name.strip():
        raise KdbenchError(f"{flag} {text}: no device before '='; write {flag} H100=2.50 or {flag} 2.50")
    try:
        price = float(value)
    except ValueError:
        raise KdbenchError(
            f"{flag} {text}: {value.strip()!r} is not a price; write US dollars per device-hour, e.g. {flag} 2.50 "
            f"or {flag} H100=2.50"
        ) from None
    if not math.isfinite(price) or price < 0:
        raise KdbenchError(f"{flag} {text}: must be a price of 0 or more US dollars per device-hour, e.g. 2.50")
    return (name.strip() or None), price


def step_items(config: CellConfig) -> tuple[str, int]:
    """(what a step processes, how many per rank): the tokens its step row counts (the workload's own count: an LM
    cell's ``batch_size x seq_len``, an on-policy step's prompt and completion, an encoder's batch of sequences),
    else its samples (an image pair's batch)."""
    from kdbench.core.names import Measurement
    from kdbench.workloads.registry import workload_of

    tokens = workload_of(config).tokens(Measurement.DISTILL_STEP, config.batch_size, config)
    return (TOKENS, int(tokens)) if tokens else (SAMPLES, config.batch_size)


def missing_figure(card: Card, precision: str) -> str | None:
    """Why ``card`` cannot price a ``precision`` cell (no dense peak for it in the table), or None."""
    if card.peaks.get(precision) is not None:
        return None
    have = ", ".join(p for p, v in card.peaks.items() if v is not None)
    return f"no {precision} peak in the device table ({card.name} has {have})"


@dataclass
class DeviceTime:
    """One cell's predicted step on one device, and what a budget costs there."""

    device: str
    ms: float | None = None  # the step's predicted time per rank (None: not predicted, see missing)
    phases: dict[str, float] = field(default_factory=dict)  # ms per phase, in the order the step runs them
    classes: dict[str, float] = field(default_factory=dict)  # ms per operator class
    bound: dict[str, float] = field(default_factory=dict)  # compute / memory / launch shares of the time
    rates: str = ""  # what priced it (the card's datasheet figures x the vendor's achievable fractions)
    unit: str = TOKENS  # what the step processes: tokens or samples
    per_step: int = 0  # of them, all ranks together
    world_size: int = 1
    budget: Budget | None = None
    steps: int | None = None  # the budget in steps
    price: float | None = None  # USD per device-hour
    price_source: str = ""
    missing: str | None = None  # why there is no step time on this device

    @property
    def per_s(self) -> float | None:
        return self.per_step / (self.ms / 1e3) if self.ms else None

    @property
    def wall_hours(self) -> float | None:
        return self.steps * self.ms / 3.6e6 if self.ms is not None and self.steps is not None else None

    @property
    def device_hours(self) -> float | None:
        wall = self.wall_hours
        return wall * self.world_size if wall is not None else None

    @property
    def cost(self) -> float | None:
        hours = self.device_hours
        return hours * self.price if hours is not None and self.price is not None else None

    def shares(self) -> dict[str, float]:
        total = sum(self.phases.values())
        return {k: v / total for k, v in self.phases.items()} if total > 0 else {}

    def text(self) -> str:
        """The device's line (without its name): step time and phase shares, the rate, the budget's hours and cost."""
        if self.ms is None:
            return f"no step time: {self.missing}"
        phases = ", ".join(f"{k} {v:.0%}" for k, v in self.shares().items() if v >= 0.005)
        parts = [f"{ms_text(self.ms)} a step ({phases})", f"{count_text(self.per_s)} {self.unit}/s"]
        if self.budget is not None and self.steps is not None:
            steps = f"{count_text(self.steps)} steps, " if self.budget.kind != STEPS else ""
            hours = f"{self.budget.text()}: {steps}"
            if self.world_size > 1:
                hours += f"{figure_text(self.wall_hours)} h x {self.world_size} devices = "
            hours += f"{figure_text(self.device_hours)} device-hours"
            if self.price is None:
                hours += f", no price for {self.device} (give --price {_price_flag(self.device)}=USD_PER_HOUR)"
            else:
                hours += f", ${figure_text(self.cost)} at ${self.price:,.2f}/device-hour"
            parts.append(hours)
        return "; ".join(parts)

    def record(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "step_ms": self.ms,
            "phases_ms": self.phases,
            "phase_shares": self.shares(),
            "classes_ms": self.classes,
            "bound": self.bound,
            "rates": self.rates,
            "unit": self.unit,
            "per_step": self.per_step,
            "per_s": self.per_s,
            "world_size": self.world_size,
            "budget": None if self.budget is None else {"kind": self.budget.kind, "amount": self.budget.amount},
            "steps": self.steps,
            "wall_hours": self.wall_hours,
            "device_hours": self.device_hours,
            "price_per_hour": self.price,
            "price_source": self.price_source,
            "cost": self.cost,
            "missing": self.missing,
        }


def device_time(
    prediction: Any,
    config: CellConfig,
    card: Card,
    budget: Budget | None = None,
    price: tuple[float, str] | None = None,
    predict_step_time: Any = None,
) -> DeviceTime:
    """``prediction``'s step priced on ``card`` for ``config`` (its precision, its world size), with ``budget``'s
    steps and hours and their cost at ``price`` ((USD per device-hour, its source); the card's own otherwise).
    ``predict_step_time``: :func:`kdbench.fit.steptime.predict_step_time` or a stand-in."""
    unit, per_rank = step_items(config)
    usd, source = price if price is not None else (card.price, card.price_source)
    out = DeviceTime(
        card.name, unit=unit, per_step=per_rank * config.world_size, world_size=config.world_size,
        budget=budget, price=usd, price_source=source,
    )  # fmt: skip
    out.missing = missing_figure(card, config.precision)
    if out.missing is None and getattr(prediction, "census", None) is None:
        out.missing = "no operator census (the cell's fake run did not count its operators)"
    if out.missing is not None:
        return out
    if predict_step_time is None:
        from kdbench.fit.steptime import predict_step_time
    step = predict_step_time(prediction, card, config.precision)
    out.ms, out.phases, out.classes, out.bound, out.rates = step.ms, step.phases, step.classes, step.bound, step.rates
    if budget is not None:
        out.steps = budget.amount if budget.kind == STEPS else math.ceil(budget.amount / max(1, out.per_step))
    return out


def ms_text(ms: float) -> str:
    return f"{ms / 1e3:,.2f} s" if ms >= 1e4 else f"{ms:,.1f} ms" if ms >= 10 else f"{ms:,.2f} ms"


def other_devices(prediction: Any, config: CellConfig, names: tuple[str, ...] = REPORT_DEVICES) -> str | None:
    """A step row's ``predicted_step_devices``: JSON {device: {ms, per_s, unit}} of ``prediction``'s step on each
    of ``names`` that has a peak for the cell's precision (arithmetic on its census, microseconds a device); None
    for an unpredictable cell or one without a census."""
    import json

    from kdbench.core.devices import find_card

    if not getattr(prediction, "ok", False) or getattr(prediction, "census", None) is None:
        return None
    out = {}
    for name in names:
        card = find_card(name)
        if card is None or missing_figure(card, config.precision):
            continue
        t = device_time(prediction, config, card)
        if t.ms is not None:
            out[card.name] = {"ms": t.ms, "per_s": t.per_s, "unit": t.unit}
    return json.dumps(out) if out else None


def figure_text(x: float) -> str:
    """Hours or dollars: 1,234 / 12.35 / 0.0421 (three significant digits below 1)."""
    return f"{x:,.0f}" if x >= 100 else f"{x:,.2f}" if x >= 1 else f"{x:.3g}"


def count_text(n: float | None) -> str:
    """1,234 / 12.3M / 4.56B: a count as people read one (as --tokens takes it)."""
    if n is None:
        return "-"
    for size, name in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if abs(n) >= size:
            return f"{n / size:,.3g}{name}" if abs(n) < 1000 * size else f"{n / size:,.0f}{name}"
    return f"{n:,.0f}" if abs(n) >= 10 else f"{n:,.2f}"


def _price_flag(device: str) -> str:
    return device.replace(" ", "")  # "H10080GB": a name --price finds (case, spaces and dashes ignored)
