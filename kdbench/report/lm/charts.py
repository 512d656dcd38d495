"""The report's *Language models* charts, drawn with :mod:`kdbench.report.charts` as the report's other charts are,
from the tables of :mod:`kdbench.report.lm.tables`: tokens per second, memory against sequence length and the loss
phase's share of the step (:func:`draw_lm`), speculative decoding's speed-ups (:func:`speculative_chart`) and the
decode rows against their memory-bandwidth floor (:func:`floor_chart`)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, NullLocator

import kdbench.report.charts as charts
from kdbench.core.names import Status
from kdbench.report.charts import Chart
from kdbench.report.format import format_mib
from kdbench.report.lm.tables import LOSS_IMPLS, impl_order, memory_table, status_text


def draw_lm(points: pd.DataFrame, out_dir: Path) -> list[Chart]:
    """The LM section's charts, from :func:`step_points`: tokens/s, memory against sequence length, loss share."""
    return [_tokens_chart(points, out_dir), _memory_chart(points, out_dir), _loss_share_chart(points, out_dir)]


def _impl_colors(impls: list[str]) -> dict[str, tuple]:
    """One colour per loss implementation, the same in every chart and report (by :data:`LOSS_IMPLS`)."""
    known = charts.palette([*LOSS_IMPLS, *(i for i in impl_order(impls) if i not in LOSS_IMPLS)])
    return {i: known.get(i, known.get(i.split(" ")[0])) for i in impls}


def _compact(value: float) -> str:
    return f"{value / 1e3:.3g}k" if value >= 1e3 else f"{value:.3g}"


def _status_bars(ax, here: pd.DataFrame, group: str, impls: list[str], value: str, color: dict, fmt) -> None:
    """Grouped bars of ``value``, one per loss impl in each ``group``, labelled ``fmt(value)``; a cell that did not
    run is a zero bar labelled with its status (``OOM``...). Noisy bars hatched, thin ones dotted."""
    ok = here["status"].eq(Status.OK)
    here = here.assign(bar_=here[value].where(ok).fillna(0.0))

    def style(bars):
        return {"color": color[bars["impl"].iloc[0]], "hatch": charts.flag_hatches(bars)}

    drawn = charts.grouped_bars(ax, here, group, "impl", impls, "bar_", style)
    for impl, bars in drawn.items():
        rows = here[here["impl"].eq(impl)]
        labels = [fmt(v) if s == Status.OK else status_text(s) for v, s in zip(rows[value], rows["status"])]
        texts = ax.bar_label(bars, labels=labels, fontsize=7, padding=2, rotation=90)
        for text, status in zip(texts, rows["status"]):
            if status != Status.OK:
                text.set(color="#b3261e", fontweight="bold")
    ax.margins(y=0.22)
    if not here["bar_"].gt(0).any():  # nothing ran here: no value axis to show
        ax.set_ylim(0, 1)
        ax.set_yticks([])


def _legend(fig, impls: list[str], color: dict, rows: pd.DataFrame, extra=()) -> None:
    handles = [Patch(facecolor=color[i], edgecolor="0.25", label=i) for i in impls]
    handles += charts.flag_patches(rows)
    fig.legend(handles=[*handles, *extra], loc="outside right upper", fontsize=8, title="loss_impl", title_fontsize=8)


def _tokens_chart(points: pd.DataFrame, out_dir: Path) -> Chart:
    title = "LM distillation step: tokens per second"
    if not points["status"].eq(Status.OK).any():
        return charts.not_drawn(title, "no successful LM distill_step measurement")
    rows = charts.rates(points.assign(group=points["pair"] + "\n(" + points["setting"] + ")"))  # tokens/s
    sources = sorted(rows["source"].unique())
    seq_lens = sorted(rows["seq_len"].unique())
    impls = impl_order(rows["impl"])
    color = _impl_colors(impls)
    n_groups = rows.groupby(["source", "seq_len"])["group"].nunique().max()
    width = min(18.0, max(8.0, 2.0 + len(seq_lens) * (1.0 + 0.3 * n_groups * len(impls))))
    groups = list(rows["group"].unique())
    rotated = charts.rotate_labels(groups, 0.7 * width / len(seq_lens))  # as grouped_bars will decide it
    fig, facets = charts.faceted_figure(
        sources, len(seq_lens), width=width, height=4.0 + charts.label_room(groups, rotated)
    )
    for axes, source in zip(facets, sources):
        for ax, seq_len in zip(axes, seq_lens):
            ax.set_title(f"sequence length {seq_len}", fontsize=9)
            here = rows[rows["source"].eq(source) & rows["seq_len"].eq(seq_len)]
            if here.empty:
                ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes, color="0.4")
                ax.set_xticks([])
                continue
            _status_bars(ax, here, "group", impls, "rate", color, _compact)
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}"))
        axes[0].set_ylabel(charts.axis_label("step throughput", charts.RATE_COLUMNS[0]))
    _legend(fig, impls, color, rows)
    caption = (
        "Tokens processed per second by the distillation step of each teacher → student pair, one bar per "
        f"loss implementation, one panel per sequence length (each cell's {charts.POOLED}). A cell that did not run is "
        f"an empty bar labelled with its status (OOM: the device ran out of memory). {charts.HATCHED}."
        + charts.flag_counts(rows[rows["status"].eq(Status.OK)])
    )
    return charts.saved_chart(title, fig, out_dir, "lm_tokens_per_s.png", caption)


def _memory_chart(points: pd.DataFrame, out_dir: Path) -> Chart:
    title = "LM distillation step: memory against sequence length"
    table = memory_table(points)
    if table.empty:
        return charts.not_drawn(title, "no LM distill_step row has a measured peak, a computed logits size or an OOM")
    table["panel"] = table["pair"] + " · " + table["setting"]
    sources = sorted(table["source"].unique())
    panels = {s: sorted(table.loc[table["source"].eq(s), "panel"].unique()) for s in sources}
    ncols = max(len(p) for p in panels.values())
    impls = impl_order(table["impl"])
    color = _impl_colors(impls)
    fig, facets = charts.faceted_figure(sources, ncols, width=min(18.0, 3.0 + 4.5 * ncols), height=3.8)
    for axes, source in zip(facets, sources):
        for ax, panel in itertools.zip_longest(axes, panels[source]):
            if panel is None:
                ax.set_visible(False)
                continue
            _memory_panel(ax, table[table["source"].eq(source) & table["panel"].eq(panel)], impls, color)
            ax.set_title(panel, fontsize=9)
        axes[0].set_ylabel("memory (GiB)")
    looks = [
        Line2D([], [], color="0.2", marker="o", ms=4, label="measured peak"),
        Line2D([], [], color="0.2", linestyle=":", marker="s", ms=3, label="measured footprint"),
        Line2D([], [], color="0.2", linestyle="--", label="computed logits buffers"),
        Line2D([], [], color="0.2", marker="X", linestyle="", ms=8, label="out of memory"),
    ]
    handles = [Line2D([], [], color=color[i], linewidth=3, label=i) for i in impls]
    looks += charts.ring_handles(table[table["peak_gib"].notna()])
    fig.legend(handles=[*handles, *looks], loc="outside right upper", fontsize=8, title="loss_impl", title_fontsize=8)
    below = int(table["memory_note"].astype(bool).sum())
    note = (
        f" In {below} cell{'s' if below != 1 else ''} the logits exceed the footprint (the table below says why)."
        if below
        else ""
    )
    caption = (
        "Memory of the distillation step against the sequence length, measured (on GPUs the allocator's "
        "counters, on the CPU the worker's resident memory): solid, its peak, which holds every buffer alive at "
        "once (on the CPU the whole process: interpreter, libraries, models); dotted, its footprint, the peak minus "
        "what was in use as the step began (models, batch, optimizer state). Beside them in the same colour "
        "(dashed) the memory of the B×S×V-sized buffers the loss implementation holds at its peak, computed from "
        "the shapes: part of the peak, the gap to it is what activations, gradients and the rest take. The "
        "footprint can be below the logits: on the CPU the step reuses memory the process already held as it "
        "began (freed by earlier work, kept by the allocator), which the rise of its resident memory does not "
        "count. A cross at the top marks the sequence length at which a loss implementation ran out of memory. "
        f"{charts.RINGED} (its timing; the memory of a contended step is its own)."
        + note
        + charts.flag_counts(table[table["peak_gib"].notna()])
    )
    return charts.saved_chart(title, fig, out_dir, "lm_memory.png", caption)


def _memory_panel(ax, here: pd.DataFrame, impls: list[str], color: dict) -> None:
    """One pair and setting: per loss impl its peak (solid), its logits (dashed) and its OOMs (crosses on top)."""
    ooms = 0
    for impl in impls:
        pts = here[here["impl"].eq(impl)].sort_values("seq_len")
        peak, logits = pts[pts["peak_gib"].notna()], pts[pts["logits_gib"].notna()]
        footprint = pts[pts["footprint_gib"].notna()]
        ax.plot(peak["seq_len"], peak["peak_gib"], "-o", ms=4, color=color[impl])
        ax.plot(footprint["seq_len"], footprint["footprint_gib"], ":", marker="s", ms=3, color=color[impl])
        ax.plot(logits["seq_len"], logits["logits_gib"], "--", marker=".", ms=5, color=color[impl])
        charts.flag_rings(ax, peak, "seq_len", "peak_gib")
        for seq_len in pts.loc[pts["status"].eq(Status.OOM), "seq_len"]:
            y = 0.93 - 0.1 * ooms
            ax.scatter([seq_len], [y], transform=ax.get_xaxis_transform(), marker="X", s=80, color=color[impl],
                       edgecolors="black", linewidths=0.6, zorder=4, clip_on=False)  # fmt: skip
            ax.annotate("OOM", (seq_len, y), xycoords=("data", "axes fraction"), xytext=(6, -3),
                        textcoords="offset points", fontsize=7, color="#b3261e", fontweight="bold")  # fmt: skip
            ooms += 1
    seq_lens = sorted(here["seq_len"].unique())
    if len(seq_lens) > 1:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(seq_lens, [str(s) for s in seq_lens])
    if len(seq_lens) > 1:
        ax.set_xlim(seq_lens[0] / 1.3, seq_lens[-1] * 1.3)
    top = pd.concat([here["peak_gib"], here["footprint_gib"], here["logits_gib"]]).max()
    ax.set_ylim(0, 1.0 if pd.isna(top) or top <= 0 else top * (1.25 + 0.1 * ooms))
    ax.set_xlabel(charts.axis_label("sequence length", "seq_len"))
    ax.grid(alpha=0.3)


def _loss_share_chart(points: pd.DataFrame, out_dir: Path) -> Chart:
    title = "LM distillation step: share of the step in the loss"
    if not points["loss_share"].notna().any():
        return charts.not_drawn(title, "no successful LM distill_step measurement has a loss phase timing")
    rows = points[points["loss_share"].notna() | points["status"].ne(Status.OK)]
    rows = rows.assign(
        group=rows["pair"] + "\n(seq " + rows["seq_len"].astype(str) + ", " + rows["setting"] + ")",
        share_pct=rows["loss_share"] * 100,
    )
    sources = sorted(rows["source"].unique())
    impls = impl_order(rows["impl"])
    color = _impl_colors(impls)
    n_groups = rows.groupby("source")["group"].nunique().max()
    width = min(16.0, max(8.0, 3.0 + 0.3 * n_groups * len(impls)))
    groups = list(rows["group"].unique())
    room = charts.label_room(groups, charts.rotate_labels(groups, 0.7 * width))  # vertical tick labels
    fig, facets = charts.faceted_figure(sources, 1, width=width, height=3.8 + room)
    for (ax,), source in zip(facets, sources):
        _status_bars(ax, rows[rows["source"].eq(source)], "group", impls, "share_pct", color, lambda v: f"{v:.0f} %")
        ax.set_ylabel("loss phase (% of the step time)")
    _legend(fig, impls, color, rows)
    caption = (
        "The loss phase's median (for LM cells both LM heads and the token loss) as a share of the median "
        "step time, per pair, sequence length and loss implementation: what a cheaper loss implementation "
        f"can save at most. A cell that did not run is an empty bar labelled with its status. {charts.HATCHED}."
        + charts.flag_counts(rows[rows["status"].eq(Status.OK)])
    )
    return charts.saved_chart(title, fig, out_dir, "lm_loss_share.png", caption)


def speculative_chart(table: pd.DataFrame, out_dir: Path) -> Chart:
    """Per source, one panel per pair and setting: the measured speed-up of speculative decoding over the teacher
    alone against the draft length γ (solid, one line per temperature) and the speed-up predicted from α, γ and
    the cost ratio (dashed, same colour)."""
    title = "Speculative decoding: measured and predicted speed-up over the teacher alone"
    rows = table[table["status"].eq(Status.OK)].assign(panel=lambda t: t["pair"] + " · " + t["setting"])
    sources = sorted(rows["source"].unique())
    panels = {src: sorted(rows.loc[rows["source"].eq(src), "panel"].unique()) for src in sources}
    ncols = max(len(p) for p in panels.values())
    temperatures = sorted(rows["spec_temperature"].unique())
    color = charts.palette([f"{t:g}" for t in temperatures])
    fig, facets = charts.faceted_figure(sources, ncols, width=min(16.0, 3.0 + 4.0 * ncols), height=3.4)
    for axes, source in zip(facets, sources):
        for ax, panel in itertools.zip_longest(axes, panels[source]):
            if panel is None:
                ax.set_visible(False)
                continue
            here = rows[rows["source"].eq(source) & rows["panel"].eq(panel)]
            for t in temperatures:
                line = here[here["spec_temperature"].eq(t)].sort_values("draft_tokens")
                c = color[f"{t:g}"]
                ax.plot(line["draft_tokens"], line["spec_speedup"], "-o", ms=4, color=c)
                ax.plot(line["draft_tokens"], line["spec_predicted_speedup"], "--", marker=".", color=c)
                charts.flag_rings(ax, line, "draft_tokens", "spec_speedup")
            ax.axhline(1.0, color="0.5", linewidth=0.8, linestyle=":")
            gammas = sorted(here["draft_tokens"].unique())
            ax.set_xticks(gammas, [str(g) for g in gammas])
            ax.set_xlabel("draft tokens per round (γ)")
            ax.set_title(panel, fontsize=9)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("speed-up over the teacher alone (×)")
    handles = [
        Line2D([], [], color=color[f"{t:g}"], linewidth=3, label="greedy" if t == 0 else f"T {t:g}")
        for t in temperatures
    ]
    handles += [
        Line2D([], [], color="0.2", marker="o", ms=4, label="measured"),
        Line2D([], [], color="0.2", linestyle="--", label="predicted from α, γ, c"),
        *charts.ring_handles(rows),
    ]
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, title="verification", title_fontsize=8)
    caption = (
        "The teacher generating with the student as its draft (speculative_decode rows, batch size 1): its speed-up "
        "over the same cell's teacher decoding alone (solid), and the speed-up predicted from the measured "
        "acceptance rate α, the draft length γ and the cost ratio c of the two models' decode rows, "
        "(1 − α^(γ+1)) / ((1 − α)(γc + 1)) (dashed; Leviathan et al. 2023). Below the dotted line the draft slows "
        "the teacher down. The predicted speed-up costs a verify step as one decode step and takes α independent "
        "from token to token: the gap between the lines is what that leaves out (and the loop's own overhead). "
        f"{charts.RINGED}: the speculative row or one of the decode rows its speed-up divides."
        + charts.flag_counts(rows)
    )
    return charts.saved_chart(title, fig, out_dir, "lm_speculative.png", caption)


def floor_chart(points: pd.DataFrame, out_dir: Path) -> Chart:
    """Per source, one horizontal bar per decode row kind of each pair, setting and batch size: its share of the
    memory-bandwidth floor, labelled with the share and the MB each generated token must read."""
    title = "Decode against its floor: share of the measured memory bandwidth"
    sources = sorted(points["source"].unique())
    most = max(len(points[points["source"].eq(s)]) for s in sources)
    fig, facets = charts.faceted_figure(sources, 1, width=9.0, height=1.2 + 0.32 * most)
    whats = sorted(points["what"].unique())
    color = charts.palette(whats)
    for axes, source in zip(facets, sources):
        ax = axes[0]
        here = points[points["source"].eq(source)].iloc[::-1]
        labels = [
            f"{r.pair} · {r.setting} · seq {r.seq_len} · bs{r.batch_size} · {r.what}"
            for r in here.itertuples(index=False)
        ]
        share = here["bandwidth_share"].astype(float) * 100
        bars = ax.barh(
            range(len(here)), share, color=[color[w] for w in here["what"]], hatch=charts.flag_hatches(here),
            edgecolor="0.25", linewidth=0.5,
        )  # fmt: skip
        ax.set_yticks(range(len(here)), labels, fontsize=7)
        texts = [
            f"{v:.1f} %  ({format_mib(b)}/token)" if pd.notna(b) else f"{v:.1f} %"
            for v, b in zip(share, here["decode_bytes_per_token"])
        ]
        ax.bar_label(bars, labels=texts, fontsize=7, padding=2)
        ax.set_xlabel("share of the probe's copy bandwidth reached by the floor bytes (%)")
        ax.set_xlim(0, max(100.0, float(share.max()) * 1.35))
        ax.axvline(100.0, color="0.5", linewidth=0.8, linestyle=":")
        ax.grid(axis="x", alpha=0.3)
    patches = charts.flag_patches(points)
    if patches:
        fig.legend(handles=patches, loc="outside right upper", fontsize=8)
    caption = (
        "Decoding is memory-bound: each generated token must read the weights (per batch) and the KV cache. Each bar "
        "is a decode row's decode_bytes_per_token × tokens/s over the probe's copy bandwidth (bandwidth_share; the "
        "copy counts bytes read + written); the dotted line is the floor itself. Speculative rows count each verify "
        "step's teacher read and each draft forward's student read per generated token. Weights that stay in a "
        "CPU's caches can put a bar past the line: the floor, not the measurement, is then off. "
        f"{charts.HATCHED}." + charts.flag_counts(points)
    )
    return charts.saved_chart(title, fig, out_dir, "lm_decode_floor.png", caption)
