"""Published GPU timings of the operations kdbench runs, and each row's operation as a fake run executes it.

The rows: ``tests/data/published/liger_benchmark_data.csv``, Liger-Kernel's own benchmark data (the README beside
it gives the source, the licence and the columns): cross-entropy, KL divergence, JSD, TVD, fused-linear
cross-entropy, fused-linear JSD and the JSD distillation loss (CE + JSD over two LM heads), forward, backward and
full (forward + backward) speed, and full memory, on an A100, two H100s and a B200, torch's (or huggingface's)
eager code beside Liger's kernels.

A row's operation (:func:`operation`) is what its script timed, at its exact shapes and dtype, runnable under
``FakeTensorMode`` (:func:`published_census.run_fake`): the script's torch code or Liger's wrapper with its Triton
kernel as one recorded operator (:mod:`published_liger`); for the distillation loss's liger rows, whose producing
code cannot be pinned (the README says why), kdbench's own ``fused_linear``, Liger's design in kdbench's code.
:func:`kdbench_twin` is the same operation as kdbench computes it, where kdbench has one: its ``dense`` loss for
torch's rows, ``fused_linear`` for Liger's (the fused-linear kernels; on bare logits kdbench runs no loss alone).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import published_liger as liger
import torch
import torch.nn.functional as F

from kdbench.distill.lm.divergences import TokenLoss
from kdbench.distill.lm.impls import lm_loss

__all__ = ["DATA", "Operation", "Row", "kdbench_twin", "load_rows", "operation"]

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "published" / "liger_benchmark_data.csv"
SCRIPT, WRAPPER, PROXY, KDBENCH = "script", "liger wrapper", "kdbench proxy", "kdbench"
_DTYPES = {"torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16, "torch.float32": torch.float32}


@dataclass(frozen=True)
class Row:
    """One row of the published data, its values as the file has them (times in ms, memory in MB of 2^20 B)."""

    kernel: str
    provider: str  # "liger", "torch" or "huggingface"
    mode: str  # "forward", "backward" or "full"
    metric: str  # "speed" or "memory"
    unit: str
    x_name: str  # the swept dimension: "V" (vocabulary) or "BT" (tokens)
    x: int
    p50: float
    p20: float
    p80: float
    config: dict = field(hash=False)  # the script's fixed sizes (B, T, H, V, dtype, ...)
    gpu: str  # as torch.cuda.get_device_name reported it
    timestamp: str
    liger_version: str

    @property
    def label(self) -> str:
        return f"{self.kernel} {self.provider} {self.mode} {self.x_name}={self.x}"

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.config.get("dtype", "torch.float32")]

    @property
    def precision(self) -> str:
        """The precision whose datasheet figures price it: the script's dtype."""
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype, "fp32")


def load_rows(path: Path = DATA, metric: str | None = "speed") -> list[Row]:
    """The published rows of ``metric`` (None: every row), in the file's order."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = [
            Row(
                r["kernel_name"],
                r["kernel_provider"],
                r["kernel_operation_mode"],
                r["metric_name"],
                r["metric_unit"],
                r["x_name"],
                int(r["x_value"]),
                float(r["y_value_50"]),
                float(r["y_value_20"]),
                float(r["y_value_80"]),
                json.loads(r["extra_benchmark_config_str"]),
                r["gpu_name"],
                r["timestamp"],
                r["liger_version"],
            )
            for r in csv.DictReader(f)
        ]
    return [r for r in rows if metric is None or r.metric == metric]


@dataclass(frozen=True)
class Operation:
    """A row's operation: ``build()`` makes its tensors (fake, under the caller's mode) and returns the timed call;
    ``source`` says whose code it is (the script's, Liger's wrapper, kdbench's), ``what`` in words."""

    build: Callable[[], Callable[[], None]]
    source: str
    what: str


def _rows_vocab(row: Row) -> tuple[int, int]:
    """(rows, vocabulary) of a logits-level row: B x T rows and V = x, or BT = x rows of ``vocab_size``."""
    c = row.config
    return (c["B"] * c["T"], row.x) if row.x_name == "V" else (row.x, c["vocab_size"])


def _logits_op(row: Row) -> Operation:
    """cross_entropy, kl_div, jsd and tvd: (rows, V) float32 inputs, as each script made them."""
    n, v = _rows_vocab(row)
    liger_row = row.provider == "liger"
    newer = row.x_name == "BT"  # the B200 rows: benchmark_jsd.py at 8ef203a4 (random grad_output)

    def build():
        if row.kernel == "cross_entropy":  # b5672a15: the logits themselves are the leaf
            x, target = liger.leaf(n, v), liger.labels(n, v)
            fwd = (lambda: liger.ce_liger(x, target)) if liger_row else (lambda: torch.nn.CrossEntropyLoss()(x, target))
            return liger.timed(fwd, row.mode)
        first = liger.leaf(n, v)  # the script's randn(requires_grad) leaf, then a (log-)softmax of it
        if row.kernel == "kl_div":  # a307eac8: log-probabilities against probabilities
            x, y = first.log_softmax(dim=-1), liger.leaf(n, v, grad=False).softmax(dim=-1)
            fwd = (
                (lambda: liger.kl_liger(x, y))
                if liger_row
                else (lambda: torch.nn.KLDivLoss(reduction="batchmean")(x, y))
            )
            return liger.timed(fwd, row.mode, retain=True)
        if row.kernel == "jsd":  # 6817c2d3 (H100 PCIe) or 8ef203a4 (B200): log-probabilities, both
            x, y = first.log_softmax(dim=-1), liger.leaf(n, v, grad=False).log_softmax(dim=-1)
            if liger_row:
                fwd = lambda: liger.jsd_liger(x, y, newer=newer, grad_is_one=not newer)  # noqa: E731
            else:
                fwd = lambda: liger.torch_jsd(x, y, newer=newer)  # noqa: E731
            return liger.timed(fwd, row.mode, retain=True, random_grad=newer)
        if row.kernel == "tvd":  # 5c9cecc8: probabilities, both
            p, q = first.softmax(dim=-1), liger.leaf(n, v, grad=False).softmax(dim=-1)
            fwd = (lambda: liger.tvd_liger(p, q)) if liger_row else (lambda: liger.tvd_torch(p, q))
            return liger.timed(fwd, row.mode, retain=True)
        raise KeyError(row.kernel)

    return Operation(build, WRAPPER if liger_row else SCRIPT, f"{row.kernel} on ({n}, {v}) float32")


def _heads(row: Row):
    """The fused-linear rows' tensors: hidden states and heads in the row's dtype (the heads are nn.Linear weights:
    they require grad), targets; the distillation loss's student has H / 2."""
    c, dt, bt = row.config, row.dtype, row.x
    hs_dim = c["H"] // 2 if row.kernel == "distill_jsd_loss" else c["H"]
    hs, ws = liger.leaf(bt, hs_dim, dtype=dt), liger.leaf(c["V"], hs_dim, dtype=dt)
    ht, wt = liger.leaf(bt, c["H"], dtype=dt, grad=False), liger.leaf(c["V"], c["H"], dtype=dt)
    return hs, ws, ht, wt, liger.labels(bt, c["V"])


def _fused_linear_op(row: Row) -> Operation:
    """fused_linear_cross_entropy (90fb5e4a), fused_linear_jsd (ff6650bb), distill_jsd_loss (aa2d23dc)."""
    c, liger_row = row.config, row.provider == "liger"
    if row.kernel == "distill_jsd_loss" and liger_row:
        twin = kdbench_twin(row)
        return Operation(twin.build, PROXY, f"kdbench fused_linear for Liger's chunked JSD loss; {twin.what}")

    def build():
        hs, ws, ht, wt, target = _heads(row)
        if row.kernel == "fused_linear_cross_entropy":
            if liger_row:
                fwd = lambda: liger.fl_ce_liger(hs, ws, target)  # noqa: E731
            else:
                fwd = lambda: torch.nn.CrossEntropyLoss(ignore_index=-100)(F.linear(hs, ws), target)  # noqa: E731
        elif row.kernel == "fused_linear_jsd":
            if liger_row:
                fwd = lambda: liger.fl_jsd_liger(hs, ws, ht, wt)  # noqa: E731
            else:

                def fwd():
                    s, t = F.linear(hs, ws), F.linear(ht, wt)
                    s_lp, t_lp = torch.log_softmax(s / 1.0, dim=-1), torch.log_softmax(t / 1.0, dim=-1)
                    return liger.torch_jsd(s_lp, t_lp, dtype=row.dtype)

        elif row.kernel == "distill_jsd_loss":
            fwd = lambda: liger.hf_distill_jsd(hs, ws, ht, wt, target)  # noqa: E731
        else:
            raise KeyError(row.kernel)
        return liger.timed(fwd, row.mode)

    what = f"{row.kernel}: BT {row.x}, H {c['H']}, V {c['V']}, {str(row.dtype).removeprefix('torch.')}"
    return Operation(build, WRAPPER if liger_row else SCRIPT, what)


LOGITS_KERNELS = ("cross_entropy", "kl_div", "jsd", "tvd")
FUSED_LINEAR_KERNELS = ("fused_linear_cross_entropy", "fused_linear_jsd", "distill_jsd_loss")


def operation(row: Row) -> Operation:
    """What ``row``'s script timed, runnable on fake tensors (module docstring)."""
    if row.kernel in LOGITS_KERNELS:
        return _logits_op(row)
    if row.kernel in FUSED_LINEAR_KERNELS:
        return _fused_linear_op(row)
    raise KeyError(f"no operation for {row.kernel!r}")


def token_loss(row: Row) -> TokenLoss:
    """The loss the row computes, as kdbench's TokenLoss: CE; the JSD at beta 0.5; CE + JSD at 0.5 each."""
    if row.kernel == "fused_linear_cross_entropy":
        return TokenLoss(None, ce_weight=1.0)
    if row.kernel == "fused_linear_jsd":
        return TokenLoss("jsd", beta=0.5)
    return TokenLoss("jsd", kd_weight=0.5, ce_weight=0.5, beta=0.5)


def kdbench_twin(row: Row, chunk_size: int = 1024) -> Operation | None:
    """The row's operation as kdbench computes it (module docstring): ``lm_loss`` with ``dense`` for torch's rows,
    ``fused_linear`` (``chunk_size`` tokens a chunk) for Liger's, every token counted; None for the logits kernels."""
    if row.kernel not in FUSED_LINEAR_KERNELS:
        return None
    impl = "fused_linear" if row.provider == "liger" else "dense"
    loss = token_loss(row)

    def build():
        hs, ws, ht, wt, target = _heads(row)
        rows = torch.arange(row.x)

        def fwd():
            return lm_loss(impl, hs, ws, None, ht, wt, None, target, loss, chunk_size, rows=rows)

        return liger.timed(fwd, row.mode)

    return Operation(build, KDBENCH, f"kdbench {impl}, {row.x} tokens, {str(row.dtype).removeprefix('torch.')}")
