"""``kdbench fit``'s flags: the device or devices, the size key, the budget (``--tokens`` / ``--steps``) and the
prices, each value checked where it is parsed (one-line errors naming the flag)."""

from __future__ import annotations

from pathlib import Path

from kdbench.cli.flags import number, out_file
from kdbench.core.errors import KdbenchError


def _size_key(text: str) -> str:
    from kdbench.fit.verdict import SIZE_KEYS

    key = text.strip().replace("-", "_").removeprefix("data.")
    if key not in SIZE_KEYS:
        raise KdbenchError(f"--max {text}: not a size key; --max takes {' or '.join(SIZE_KEYS)}")
    return key


def _memory(text: str) -> str:
    from kdbench.fit.devices import parse_size

    parse_size(text, "--device-memory")  # checked here, before any suite is read
    return text


def _tokens(text: str):
    from kdbench.fit.cost import parse_tokens

    return parse_tokens(text, "--tokens")


def _price(text: str) -> tuple[str | None, float, str]:
    from kdbench.fit.cost import parse_price

    return (*parse_price(text, "--price"), text)


# --pair of LMs: what people run such a pair in (bf16 mixed precision, the frozen teacher held and run in bf16),
# where the schema's defaults (fp32 throughout) plan a cell no one runs: each unless its flag is given
LM_PAIR_DEFAULTS = {
    "precision": ("--precision", "bf16"),
    "teacher_precision": ("--teacher-precision", "bf16"),
    "teacher_weights": ("--teacher-weights", "bf16"),
}


def lm_pair_defaults(takes: frozenset, given: dict) -> tuple[dict, str]:
    """The values :data:`LM_PAIR_DEFAULTS` adds to ``given`` (dest -> the flag's value, None: not given) for a pair
    whose family ``takes`` those keys (an LM pair: the one whose loss has implementations, its logits being what
    decides it), and the line that says so (the first ``kdbench fit`` prints); nothing for other families, or when
    the user set the precision and the teacher's."""
    if "loss_impl" not in takes:
        return {}, ""
    teacher_given = given.get("teacher_precision") is not None or given.get("teacher_weights") is not None
    added = {
        dest: value
        for dest, (_, value) in LM_PAIR_DEFAULTS.items()
        if given.get(dest) is None and (dest == "precision" or not teacher_given)
    }
    if not added:
        return {}, ""
    flags = " ".join(f"{LM_PAIR_DEFAULTS[d][0]} {v}" for d, v in added.items())
    return added, (
        f"--pair of LMs: planned as such a pair is run, {flags} (bf16 mixed precision, the teacher held and run in "
        "bf16); give those flags to plan another (fp32: the schema's defaults)"
    )


def add_fit(sub) -> None:
    """The ``fit`` subcommand: its flags and help texts (docs/cli.md is generated from them)."""
    from kdbench.core.names import PRECISIONS

    fit = sub.add_parser(
        "fit",
        help="will each cell fit a device, how long is its step there, and what does a budget cost? its peak "
        "memory per rank and its step's operators, from running the cell's own step on fake tensors (nothing "
        "allocated)",
        description="Predict each cell's peak memory per device: the cell's own distillation step (its pair, batch, "
        "loss and optimizer, two steps) runs under FakeTensorMode, where every tensor has its shape and bytes and "
        "none is allocated, metered operator by operator. With a device (--gpu or --device-memory) each cell is "
        "judged: fits, does not fit, or fits only with the first changes that make it fit (loss_impl fused_linear, "
        "a smaller chunk_size, a bf16-held teacher, FSDP2 over 2/4/8 ranks, half the batch), each predicted. "
        "Sizes: GB = 10^9 bytes, GiB = 2^30 bytes, a bare number is bytes. A GPU's peak (its BLAS workspaces "
        "included) may reach its total as torch reports it (the GPU this process runs on: what is free now) less "
        "the runtime's context and, at world_size > 1, NCCL's buffers, over 1.05 for fragmentation (docs/fit.md). "
        "On each GPU of the table the same fake run's operators are priced (kdbench.fit.steptime: a roofline per "
        "operator at published achievable fractions of the datasheet's peaks, a launch floor, ring collectives): the "
        "predicted step time with its phase shares and the tokens (LM, encoder) or samples (image pairs) per "
        "second; with --tokens or --steps, the steps, device-hours (x world_size devices) and their cost at the "
        "table's or --price's price.",
    )
    fit.add_argument("suite", type=Path, nargs="?", default=None, help="suite YAML file (or give --pair)")
    fit.add_argument(
        "--pair", nargs=2, metavar=("TEACHER", "STUDENT"), default=None, help="one cell of this pair, from defaults"
    )
    where = fit.add_mutually_exclusive_group()
    where.add_argument(
        "--gpu",
        action="append",
        default=None,
        metavar="NAME",
        help="judge against this device of the table (H100 80GB, H100 NVL, H200, A100 40GB, A100 80GB, L4, T4, "
        "MI300X, MI325X, MI250X: case, spaces and dashes ignored; the GPU this process runs on is measured now, "
        "mem_get_info) or cpu (this machine's available memory); repeat it to compare devices side by side "
        "(--gpu H100 --gpu MI300X: one fake run per cell serves them all), each GPU with its predicted step time",
    )
    where.add_argument(
        "--device-memory",
        type=_memory,
        default=None,
        metavar="SIZE",
        help="judge against a GPU of this much memory per device: 141GB (GB = 10^9 bytes), 80GiB (GiB = 2^30 "
        "bytes), 192e9 (bytes), 1.5TB",
    )
    fit.add_argument(
        "--max",
        type=_size_key,
        default=None,
        metavar="KEY",
        help="also find the largest batch_size or seq_len that fits (bisection over fake runs; for every loss_impl "
        "of an LM cell); needs --gpu or --device-memory",
    )
    budget = fit.add_mutually_exclusive_group()
    budget.add_argument(
        "--tokens",
        type=_tokens,
        default=None,
        metavar="N",
        help="a training budget of N tokens (a token pair: LM or encoder): 10B, 500M, 2.5T, 1e9 (K, M, B, T = 10^3, "
        "10^6, 10^9, 10^12); each --gpu line adds its steps, device-hours (x world_size devices) and their cost; with "
        "--epochs (or for a cell whose teacher is offline) an LM cell also gets an offline-teacher block for a corpus "
        "of N tokens",
    )
    budget.add_argument(
        "--steps",
        type=number(int, "--steps", 1),
        default=None,
        metavar="N",
        help="a training budget of N steps (any cell), as --tokens",
    )
    fit.add_argument(
        "--epochs",
        type=number(float, "--epochs", 0, above=True),
        default=None,
        metavar="E",
        help="passes over the corpus of --tokens N (needs --tokens; a positive number): an LM cell gets "
        "an offline-teacher block per --gpu (one more fake run a cell, its twin's; a cell whose teacher is offline "
        "gets it without --epochs, at 1 epoch), the teacher's top-k stored on disk (teacher: {mode: offline}) against "
        "the live teacher: the store's disk bytes for N tokens at the cell's encoding (kdbench's default offline "
        "encoding for a live cell), the build's hours (N x the live step's predicted teacher_forward per token; the LM "
        "head where the loss applies it, top-k, encode and writes not counted), the predicted saving a step (each "
        "twin from its own fake run), the epochs that repay the build (or never), the teacher memory freed (the "
        "twins' predicted peaks) and both twins' device-hours and cost over E epochs",
    )
    fit.add_argument(
        "--price",
        action="append",
        type=_price,
        default=None,
        metavar="USD_PER_HOUR",
        help="the price of one device-hour, US dollars, for the cost of --tokens/--steps: --price 2.50 (the one "
        "--gpu) or --price DEVICE=2.50 (repeat it per device); default: the device table's on-demand price, its "
        "source in docs/fit.md",
    )
    fit.add_argument("--out", type=out_file, default=None, metavar="FILE", help="also write the predictions as JSON")
    fit.add_argument(
        "--allow-imports", action="store_true", help="allow `module:callable` models, as `allow_imports: true` does"
    )
    cell = fit.add_argument_group("the cell of --pair (each a cell key; the schema's defaults otherwise)")
    cell.add_argument("--method", default=None, help="distillation method (default: kd; LM pairs forward_kl)")
    cell.add_argument(
        "--batch-size", type=number(int, "--batch-size", 1, 1 << 20), default=None, metavar="N", help="per device"
    )
    cell.add_argument(
        "--seq-len", type=number(int, "--seq-len", 2, 1 << 20), default=None, metavar="N", help="tokens a sequence"
    )
    cell.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=None,
        help="the student's precision (default: LM pairs bf16, else fp32)",
    )
    cell.add_argument(
        "--teacher-precision",
        choices=PRECISIONS,
        default=None,
        help="the teacher's (default: --teacher-weights' dtype; LM pairs bf16; else fp32)",
    )
    cell.add_argument(
        "--teacher-weights",
        default=None,
        metavar="DTYPE",
        help="the teacher held in fp32, bf16 or fp16 (default: LM pairs bf16, run in bf16; else fp32)",
    )
    cell.add_argument(
        "--loss-impl", default=None, metavar="IMPL", help="dense, natural, chunked, fused_linear, liger or torch_linear"
    )
    cell.add_argument(
        "--chunk-size", type=number(int, "--chunk-size", 1, 1 << 20), default=None, metavar="N", help="tokens a chunk"
    )
    cell.add_argument(
        "--world-size", type=number(int, "--world-size", 1, 1024), default=None, metavar="N", help="ranks"
    )
    cell.add_argument("--parallel", default=None, metavar="HOW", help="ddp or fsdp (world_size > 1)")
