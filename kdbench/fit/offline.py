"""The offline-teacher decision for an LM cell and a corpus (``kdbench fit --tokens N --epochs E``): what a store of
the teacher's top-k on disk (``teacher: {mode: offline}``) costs and saves against the live teacher, on one device.

Everything is arithmetic on two predictions of the cell's twins, each from its own fake run (the live twin: the
teacher held and run every step; the offline twin: no teacher, its read buffers only, :class:`kdbench.workloads.lm.
offline.FakeOfflineTeacher`), priced on the device by :func:`kdbench.fit.cost.device_time`:

* **disk**: ``N x`` the encoding's bytes per token (:attr:`kdbench.store.teacher_logits.Encoding.bytes_per_token`,
  before compression), and apart the token ids the store keeps beside them (int32, ``seq_len + 1`` a sequence);
* **build**: ``N x`` the teacher's forward per token, the live twin's ``teacher_forward`` phase over the tokens of a
  step.  Not counted: the teacher's LM head where the loss applies it (``loss_impl dense``, the only one the offline
  step takes, applies both heads in the loss phase), the log-softmax and top-k, the encoding, compression, checksum
  and writes (a measured offline row has them: ``teacher_store_encode_tokens_per_s``);
* **saving** per step: the live twin's predicted step minus the offline twin's (the missing teacher forward and
  the read buffers both counted; the read itself is taken to hide behind the step, as a measured row shows it
  does: its ``phase_teacher_read_ms``);
* **pay-back**: the build over the saving of one epoch (``ceil(N / tokens a step)`` steps); none where the offline
  step is not faster ("never pays back");
* **memory freed**: the live twin's predicted peak minus the offline twin's (the teacher's weights, less the read
  buffers, where both peak in the same phase);
* **E epochs**: the live twin's device-hours and cost for ``E x N`` tokens against the offline twin's plus the build.

No torch at import: the twins' fake runs are the caller's predictor's (:mod:`kdbench.fit.cells`), the checks that
make the twins and the encoding's vocabulary are imported where they are used.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kdbench.config.schema import CellConfig
from kdbench.core.errors import KdbenchError
from kdbench.core.sizes import GIB, MIB, gib
from kdbench.fit.cost import TOKENS, Budget, DeviceTime, count_text, device_time, figure_text, missing_figure, ms_text
from kdbench.store.logit_store import token_id_bytes
from kdbench.store.teacher_logits import Encoding

NOT_COUNTED = (
    "the teacher's LM head where the loss applies it (loss_impl dense), log-softmax, top-k, encode, compression, "
    "checksum and writes"
)


def disk_bytes(encoding: Encoding, tokens: int) -> int:
    """The store's top-k for ``tokens`` tokens: the encoding's bytes per token (the format's arithmetic, before
    compression) times the tokens."""
    return tokens * encoding.bytes_per_token


def payback_epochs(build_ms: float, saving_ms_per_step: float, steps_per_epoch: int) -> float | None:
    """Epochs after which the steps' saving repays the build: ``build / (saving a step x steps an epoch)``; None
    (never) where the offline step is not faster."""
    if not saving_ms_per_step > 0 or steps_per_epoch < 1:
        return None
    return build_ms / (saving_ms_per_step * steps_per_epoch)


@dataclass(frozen=True)
class OfflineDecision:
    """One device's figures for a corpus of ``tokens`` and ``epochs`` passes: ``live`` and ``offline`` are the twins'
    steps priced for the E-epoch budget (:func:`kdbench.fit.cost.device_time`: their hours and cost at the price in
    use), ``teacher_forward_ms`` the live twin's teacher_forward phase a step."""

    tokens: int  # N: the corpus
    epochs: float  # E
    encoding: Encoding
    live: DeviceTime
    offline: DeviceTime
    live_peak_bytes: int
    offline_peak_bytes: int
    teacher_forward_ms: float
    seq_len: int

    @property
    def device(self) -> str:
        return self.live.device

    @property
    def tokens_per_step(self) -> int:
        return self.live.per_step

    @property
    def disk_bytes(self) -> int:
        return disk_bytes(self.encoding, self.tokens)

    @property
    def token_bytes(self) -> int:
        return token_id_bytes(self.tokens, self.seq_len)

    @property
    def build_ms(self) -> float:
        return self.tokens * self.teacher_forward_ms / self.tokens_per_step

    @property
    def build_hours(self) -> float:
        """The build's wall hours (on ``world_size`` devices, as the step's tokens are)."""
        return self.build_ms / 3.6e6

    @property
    def saving_ms(self) -> float:
        """The live twin's step minus the offline twin's (negative: the offline step is slower)."""
        return self.live.ms - self.offline.ms

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.tokens / self.tokens_per_step)

    @property
    def payback_epochs(self) -> float | None:
        return payback_epochs(self.build_ms, self.saving_ms, self.steps_per_epoch)

    @property
    def memory_freed_bytes(self) -> int:
        return self.live_peak_bytes - self.offline_peak_bytes

    @property
    def live_device_hours(self) -> float | None:
        return self.live.device_hours

    @property
    def offline_device_hours(self) -> float | None:
        hours = self.offline.device_hours
        return None if hours is None else hours + self.build_hours * self.offline.world_size

    @property
    def price(self) -> float | None:
        return self.live.price

    def _cost(self, hours: float | None) -> float | None:
        return None if hours is None or self.price is None else hours * self.price

    def text(self) -> str:
        """The device's line (without its name): build, steps, saving, pay-back, memory, the E-epoch totals."""
        tf = f"{ms_text(self.teacher_forward_ms)} a step of {count_text(self.tokens_per_step)} tokens"
        ranks = f" x {self.offline.world_size} devices" if self.offline.world_size > 1 else ""
        parts = [f"build {figure_text(self.build_hours)} h{ranks} (the live step's teacher_forward, {tf})"]
        step = f"step {ms_text(self.live.ms)} live, {ms_text(self.offline.ms)} offline"
        if self.payback_epochs is None:
            parts.append(f"{step}: the offline step is not faster, never pays back")
        else:
            share = self.saving_ms / self.live.ms
            parts.append(
                f"{step}: saves {ms_text(self.saving_ms)} a step ({share:.0%}), pays back after "
                f"{self.payback_epochs:,.3g} epochs"
            )
        freed = self.memory_freed_bytes
        peaks = f"peak {_memory(self.live_peak_bytes)} live, {_memory(self.offline_peak_bytes)} offline"
        parts.append(
            f"teacher memory freed {_memory(freed)} ({peaks})"
            if freed >= 0
            else f"no teacher memory freed: the offline step holds {_memory(-freed)} more ({peaks})"
        )
        total = f"{self.epochs:g} epochs: live {figure_text(self.live_device_hours)} device-hours"
        total += f" (${figure_text(self._cost(self.live_device_hours))})" if self.price is not None else ""
        total += f", offline {figure_text(self.offline_device_hours)} with the build"
        total += f" (${figure_text(self._cost(self.offline_device_hours))})" if self.price is not None else ""
        if self.price is None:
            total += f", no price for {self.device}"
        parts.append(total)
        return "; ".join(parts)

    def record(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "tokens": self.tokens,
            "epochs": self.epochs,
            "encoding": self.encoding.as_dict(),
            "encoding_label": self.encoding.label,
            "bytes_per_token": self.encoding.bytes_per_token,
            "disk_bytes": self.disk_bytes,
            "token_id_bytes": self.token_bytes,
            "tokens_per_step": self.tokens_per_step,
            "steps_per_epoch": self.steps_per_epoch,
            "teacher_forward_ms": self.teacher_forward_ms,
            "build_ms": self.build_ms,
            "build_hours": self.build_hours,
            "not_counted": NOT_COUNTED,
            "live_step_ms": self.live.ms,
            "offline_step_ms": self.offline.ms,
            "saving_ms_per_step": self.saving_ms,
            "payback_epochs": self.payback_epochs,
            "live_peak_bytes": self.live_peak_bytes,
            "offline_peak_bytes": self.offline_peak_bytes,
            "memory_freed_bytes": self.memory_freed_bytes,
            "live_device_hours": self.live_device_hours,
            "offline_device_hours": self.offline_device_hours,
            "price_per_hour": self.price,
            "price_source": self.live.price_source,
            "live_cost": self._cost(self.live_device_hours),
            "offline_cost": self._cost(self.offline_device_hours),
        }


def _disk(n: float) -> str:
    """A store's bytes in a disk's decimal units: 516 GB, 1.2 TB, 34.5 MB."""
    for size, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= size:
            return f"{n / size:,.3g} {unit}"
    return f"{n:,.0f} B"


def _memory(n: float) -> str:
    """A peak's bytes in the allocator's binary units: 13.50 MiB, 14.93 GiB."""
    return gib(n) if n >= GIB else f"{n / MIB:,.2f} MiB"


def store_line(encoding: Encoding, source: str, tokens: int, seq_len: int) -> str:
    """The block's first line: the encoding and where it comes from, the store's bytes for the corpus."""
    zstd = "; zstd is measured, not predicted" if encoding.compression != "none" else ""
    ids, disk = _disk(token_id_bytes(tokens, seq_len)), _disk(disk_bytes(encoding, tokens))
    return (
        f"offline teacher ({encoding.label}: {source}): store {count_text(tokens)} tokens x "
        f"{encoding.bytes_per_token} B = {disk} on disk before compression, + {ids} of token ids{zstd}; build not "
        f"counting {NOT_COUNTED}"
    )


def check_epochs(epochs: float | None, budget: Budget | None) -> None:
    """``epochs``' mistakes, before any fake run: not a positive finite number, or no corpus (``--tokens N``) to pass
    over."""
    if epochs is None:
        return
    if isinstance(epochs, bool) or not isinstance(epochs, int | float) or not (0 < epochs < float("inf")):
        raise KdbenchError(f"--epochs {epochs}: must be a positive number of passes over the corpus, e.g. 3")
    if budget is None or budget.kind != TOKENS:
        given = f" ({budget.given} counts steps)" if budget is not None else ""
        raise KdbenchError(
            f"--epochs {epochs:g}: counts passes over a corpus of --tokens N{given}; add --tokens N, the corpus's size"
        )


def offline_twins(config: CellConfig) -> tuple[CellConfig, CellConfig, str] | str:
    """An LM cell's live and offline twins (``teacher.mode`` live and offline, all else the cell's) and what was
    changed beyond the mode (the offline step takes ``loss_impl dense`` only: both twins get it); or why the cell
    has no offline twin (the check that refuses it)."""
    from kdbench.fit.verdict import changed
    from kdbench.workloads.registry import check_cell

    def twin(c: CellConfig, mode: str, more: dict[str, Any]) -> CellConfig | None:
        return c if c.teacher.mode == mode and not more else changed(c, {"teacher": {"mode": mode}, **more})

    for more in ({}, {"loss_impl": "dense"}):
        if more and config.loss_impl == "dense":
            break
        live, offline = twin(config, "live", more), twin(config, "offline", more)
        if live is not None and offline is not None:
            return live, offline, "" if not more else f"both twins at loss_impl dense (the cell's: {config.loss_impl})"
    raw = config.model_dump(mode="json")
    raw["teacher"]["mode"], raw["loss_impl"] = "offline", "dense"
    try:
        problems = check_cell(CellConfig.model_validate(raw), True)
    except ValueError as exc:
        return f"the offline twin is not a valid cell ({exc})".splitlines()[0]
    return problems[0][1] if problems else "the offline twin is not a cell kdbench runs"


def offline_block(
    out: Any,
    devices: list[Any],
    predictors: list[Any],
    budget: Budget,
    epochs: float,
    prices: Mapping[str, float],
    line: Callable[[str], None],
) -> None:
    """An LM cell's offline-teacher block (``out``: a :class:`kdbench.fit.cells.CellFit` whose steps are priced; a
    :class:`kdbench.fit.verdict.Predictor` per device): the store for the budget's tokens, then per GPU of the
    table the build, the saving, the pay-back, the memory freed and the E-epoch totals; each twin from its own fake
    run (the cell's own is one of them)."""
    from kdbench.workloads import workload_of

    if "teacher.mode" not in workload_of(out.config).takes or not out.times:  # an LM pair's (topk_cache, offline)
        return
    from kdbench.config.schema import TeacherConfig
    from kdbench.workloads.lm.checks import shared_vocab
    from kdbench.workloads.lm.offline import encoding_of

    twins = offline_twins(out.config)
    if isinstance(twins, str):
        line(f"      offline teacher: no offline twin of this cell: {twins}")
        out.record["offline_teacher"] = {"missing": twins}
        return
    live_cfg, off_cfg, note = twins
    encoding = encoding_of(off_cfg, shared_vocab(off_cfg))
    keys = ("k", "values", "indices", "compression", "top_p")
    default = all(getattr(off_cfg.teacher, k) == getattr(TeacherConfig(), k) for k in keys)
    source = (
        "the cell's encoding"
        if out.config.teacher.mode == "offline"
        else "kdbench's default offline encoding, teacher: {mode: offline}"
        if default
        else "the cell's teacher keys under teacher.mode offline"
    )
    seq_len = off_cfg.data.seq_len
    line(f"      {store_line(encoding, source, budget.amount, seq_len)}{'; ' + note if note else ''}")
    record: dict[str, Any] = {"encoding_source": source, "note": note, "devices": []}
    out.record["offline_teacher"] = record
    corpus = Budget(TOKENS, max(1, round(epochs * budget.amount)), f"{epochs:g} epochs of {budget.given}")
    width = max(len(t.device) for t in out.times)
    for d, predictor in zip(devices, predictors):
        if d.card is None or d.kind != "gpu" or missing_figure(d.card, out.config.precision):
            continue
        twin_p = {"live": predictor(live_cfg), "offline": predictor(off_cfg)}
        broken = [f"{m} twin: {p.error}" for m, p in twin_p.items() if not p.ok]
        if broken:
            line(f"      offline teacher on {d.name:<{width}}  unpredictable: {'; '.join(broken)}")
            record["devices"].append({"device": d.name, "missing": "; ".join(broken)})
            continue
        price = (prices[d.card.name], "given: --price") if d.card.name in prices else None
        live_t = device_time(twin_p["live"], live_cfg, d.card, corpus, price)
        off_t = device_time(twin_p["offline"], off_cfg, d.card, corpus, price)
        decision = OfflineDecision(
            budget.amount, epochs, encoding, live_t, off_t, twin_p["live"].peak_bytes, twin_p["offline"].peak_bytes,
            live_t.phases.get("teacher_forward", 0.0), seq_len,
        )  # fmt: skip
        line(f"      offline teacher on {d.name:<{width}}  {decision.text()}")
        record["devices"].append(decision.record())
