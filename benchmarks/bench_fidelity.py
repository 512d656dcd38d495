"""Benchmark: kdbench's distillation step costs what a careful hand-written KD loop costs.

Fidelity.  kdbench's `DistillStep` (the `cpu_step` fixture: resnet20 -> resnet8, batch 16,
3x32x32, 100 classes, fp32, AdamW lr 1e-4, KD at T=4, alpha=0.9) is timed against a KD step
written here by hand, independently of kdbench's step: the same models built from the same
seed, the same batch, the teacher frozen in eval() and run under no_grad, then
alpha*T^2*KL(softmax(t/T) || softmax(s/T)) (batchmean) + (1-alpha)*CE, zero_grad(set_to_none=True),
backward, AdamW step.  Their first losses must agree (same computation).  The two are timed
in one process in short interleaved rounds (CALLS calls of one, then CALLS of the other, each first
in every other round, so a noisy machine's drift hits both alike); the bound: the median over
rounds of each round's ratio (kdbench's median / the hand loop's) is at most 1 + 5 %.

The article's step.  A second test times the careful loop against the AMD article's step as
written: the teacher left in train() mode, its forward not under no_grad (nor detached), the
step under the deprecated `torch.cuda.amp.autocast` / `torch.cuda.amp.GradScaler`.  Those target
CUDA; this benchmark runs on the CPU in fp32 (fp16 autocast is far too slow on a CPU), so there the
article's step takes the CPU equivalent, `torch.amp.autocast("cpu", enabled=False)` and a disabled
`torch.amp.GradScaler("cpu")`, and measures causes (a) train()-mode BatchNorm and (b) the recorded
teacher graph, each alone and together; cause (c), the deprecated API, is timed (host cost of the
autocast context) only where CUDA is available.  No bound: it documents the difference and its
causes; the figures must be finite and positive.

The language model.  A third test times kdbench's LM step and decode against hand-written loops (TRL's form of
the step against ``loss_impl: natural``, a careful step against ``dense``, a greedy KV-cache loop against the decode
row's call): see its section below and benchmarks/fidelity_lm.py.

The figures are printed, attached to pytest-benchmark's record (`extra_info`) and written to
benchmarks/.results/fidelity.json and benchmarks/.results/fidelity_article.json.
"""

import json
import math
import os
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from fidelity_lm import LM_VOCAB, HandGreedyDecode, HandLMStep, interleaved, lm_batch, timed

from kdbench.hw.contention import HostMeter
from kdbench.models import build_model

T, ALPHA, LR = 4.0, 0.9, 1e-4
BATCH, SHAPE, CLASSES = 16, (3, 32, 32), 100
ROUNDS = 40  # kdbench vs hand loop
CALLS = 8  # calls per variant per round
ARTICLE_ROUNDS = 24  # careful loop vs the article's step and its causes alone
ARTICLE_CALLS = 6
TOLERANCE = 0.05
RESULTS = Path(__file__).resolve().parent / ".results"
OUT = RESULTS / "fidelity.json"
OUT_ARTICLE = RESULTS / "fidelity_article.json"
STEP = "resnet20->resnet8 kd fp32 bs16 3x32x32 cpu"


def build_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The cpu_step fixture's models: seed 0, then the teacher, then the student (the same weights)."""
    torch.manual_seed(0)
    return build_model("resnet20", CLASSES, SHAPE), build_model("resnet8", CLASSES, SHAPE)


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The fixture's fixed batch: standard-normal inputs and uniform labels from a generator seeded 0."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn((BATCH, *SHAPE), generator=g)
    y = torch.randint(0, CLASSES, (BATCH,), generator=g)
    return x, y


def kd_loss(s: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    kl = F.kl_div(F.log_softmax(s / T, dim=1), F.softmax(t / T, dim=1), reduction="batchmean")
    return kl * T * T * ALPHA + (1 - ALPHA) * F.cross_entropy(s, y)


def article_amp(device: torch.device):
    """The article's AMP objects: torch.cuda.amp on CUDA; on the CPU (where torch.cuda.amp would only
    disable itself with a warning) the CPU API, disabled, so the step runs in fp32."""
    if device.type == "cuda":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the deprecation is cause (c), timed apart
            return torch.cuda.amp.autocast, torch.cuda.amp.GradScaler(), "torch.cuda.amp (deprecated API)"
    return (
        lambda: torch.amp.autocast("cpu", enabled=False),
        torch.amp.GradScaler("cpu", enabled=False),
        'torch.amp.autocast("cpu", enabled=False) + disabled GradScaler: fp32',
    )


class KDLoop:
    """A hand-written KD step.  The defaults are the careful loop: teacher frozen in eval() and run
    under no_grad.  `teacher_train` leaves the teacher in train() (BatchNorm uses batch statistics and
    updates its running ones); `teacher_no_grad=False` runs its forward with autograd on and its
    parameters requiring grad, so the teacher graph is recorded and the backward runs through it;
    `amp=True` runs the step under the article's autocast with its GradScaler."""

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        teacher_train: bool = False,
        teacher_no_grad: bool = True,
        amp: bool = False,
    ):
        self.teacher, self.student = build_pair()
        self.teacher.train(teacher_train)
        self.teacher.requires_grad_(not teacher_no_grad)
        self.student.train()
        self.optimizer = torch.optim.AdamW(self.student.parameters(), lr=LR)
        self.x, self.y = x, y
        self.no_grad = teacher_no_grad
        self.autocast, self.scaler, self.amp_note = article_amp(x.device) if amp else (None, None, "")
        self.loss: torch.Tensor | None = None

    def _forward(self) -> torch.Tensor:
        if self.no_grad:
            with torch.no_grad():
                t = self.teacher(self.x)
        else:
            t = self.teacher(self.x)
        s = self.student(self.x)
        return kd_loss(s, t, self.y)

    def __call__(self) -> None:
        if self.scaler is None:
            loss = self._forward()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        else:
            with self.autocast():
                loss = self._forward()
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.loss = loss.detach()


def test_kdbench_step_is_as_fast_as_a_hand_written_kd_loop(benchmark, report_line, cpu_step):
    step, _ = cpu_step("kd")
    x, y = make_batch()
    assert torch.equal(x, step.x) and torch.equal(y, step.y)
    hand = KDLoop(x, y)
    for ours, theirs in ((step.distiller.student, hand.student), (step.distiller.teacher, hand.teacher)):
        assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))
    step()
    hand()
    # Same models, batch and loss: the first step's losses agree (kdbench's KL takes log-probabilities).
    torch.testing.assert_close(step.last_loss, hand.loss, rtol=1e-5, atol=1e-6)
    first_loss = float(hand.loss)
    for _ in range(4):  # warm up both
        step()
        hand()

    threads = torch.get_num_threads()
    samples: dict[str, list[float]] = {"kdbench": [], "hand": []}
    rounds = []
    for i in range(ROUNDS):
        order = ("kdbench", "hand") if i % 2 == 0 else ("hand", "kdbench")
        med = {name: timed(step if name == "kdbench" else hand, CALLS, samples[name]) for name in order}
        rounds.append({"kdbench_ms": med["kdbench"], "hand_ms": med["hand"], "ratio": med["kdbench"] / med["hand"]})
    assert torch.get_num_threads() == threads
    ours_ms, hand_ms = statistics.median(samples["kdbench"]), statistics.median(samples["hand"])
    ratio = statistics.median(r["ratio"] for r in rounds)
    result = {
        "threads": threads,
        "step": STEP,
        "rounds": rounds,
        "calls_per_round": CALLS,
        "kdbench_median_ms": ours_ms,
        "hand_median_ms": hand_ms,
        "ratio_of_medians": ours_ms / hand_ms,
        "median_paired_ratio": ratio,
        "tolerance": TOLERANCE,
        "first_loss": first_loss,
    }
    report_line(f"kdbench's DistillStep vs a hand-written KD loop, {STEP}, {threads} threads:")
    report_line(
        f"  kdbench {ours_ms:.3f} ms, hand loop {hand_ms:.3f} ms (medians of {len(samples['kdbench'])} steps each; "
        f"ratio {ours_ms / hand_ms:.4f}); first-step loss {first_loss:.5f} in both"
    )
    report_line(
        f"  median of the {ROUNDS} paired round ratios (kdbench / hand): {ratio:.4f} "
        f"(must be <= {1 + TOLERANCE:.2f}); saved to {OUT}"
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    benchmark.extra_info.update(result)
    benchmark.pedantic(hand, rounds=10, iterations=1, warmup_rounds=1)  # the hand loop, saved by pytest-benchmark
    assert ratio <= 1 + TOLERANCE


def saved_teacher_bytes(x: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps from a grad-enabled teacher forward (parameters left out)."""
    teacher, _ = build_pair()
    params = {p.data_ptr() for p in teacher.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        teacher(x)
    return sum(seen.values())


def deprecated_api_cost_us(n: int = 20_000) -> dict[str, float]:
    """Host µs to enter and leave the autocast context: torch.cuda.amp.autocast() vs torch.amp.autocast("cuda")."""
    makers = {
        "torch.cuda.amp.autocast()": torch.cuda.amp.autocast,
        'torch.amp.autocast("cuda")': lambda: torch.amp.autocast("cuda"),
    }
    out: dict[str, list[float]] = {k: [] for k in makers}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for _ in range(5):
            for name, make in makers.items():
                start = time.perf_counter_ns()
                for _ in range(n):
                    with make():
                        pass
                out[name].append((time.perf_counter_ns() - start) / n / 1e3)
    return {k: statistics.median(v) for k, v in out.items()}


def test_article_step_difference_and_its_causes(benchmark, report_line):
    x, y = make_batch()
    variants = {
        "careful": KDLoop(x, y),
        "(a) teacher train()": KDLoop(x, y, teacher_train=True),
        "(b) no no_grad": KDLoop(x, y, teacher_no_grad=False),
        "article (a)+(b)": KDLoop(x, y, teacher_train=True, teacher_no_grad=False, amp=True),
    }
    names = list(variants)
    article = variants["article (a)+(b)"]
    # (a)'s numerics: batch statistics instead of running ones, before any step.
    fresh, _ = build_pair()
    with torch.no_grad():
        eval_logits = fresh.eval()(x)
        train_logits = build_pair()[0].train()(x)
    logit_gap = float((train_logits - eval_logits).abs().max())
    for loop in variants.values():
        for _ in range(3):
            loop()

    samples: dict[str, list[float]] = {n: [] for n in names}
    round_diffs: dict[str, list[float]] = {n: [] for n in names[1:]}
    for i in range(ARTICLE_ROUNDS):
        order = names[i % len(names) :] + names[: i % len(names)]  # each variant first in turn
        med = {n: timed(variants[n], ARTICLE_CALLS, samples[n]) for n in order}
        for n in names[1:]:
            round_diffs[n].append(med[n] - med["careful"])
    medians = {n: statistics.median(v) for n, v in samples.items()}
    diffs = {n: statistics.median(v) for n, v in round_diffs.items()}
    steps_run = len(samples["careful"]) + 3
    bn_moved = max(
        float((a - b).abs().max())
        for (name, a), b in zip(article.teacher.state_dict().items(), fresh.state_dict().values())
        if name.endswith("running_mean")
    )
    teacher_grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in article.teacher.parameters())
    saved = saved_teacher_bytes(x)
    cuda = torch.cuda.is_available()
    api = deprecated_api_cost_us() if cuda else None

    result = {
        "threads": torch.get_num_threads(),
        "step": STEP,
        "rounds": ARTICLE_ROUNDS,
        "calls_per_round": ARTICLE_CALLS,
        "median_ms": medians,
        "median_paired_difference_ms": diffs,
        "article_amp": article.amp_note,
        "teacher_logit_gap_train_vs_eval": logit_gap,
        "teacher_bn_running_mean_moved": bn_moved,
        "teacher_saved_activation_bytes": saved,
        "teacher_grad_bytes": teacher_grad_bytes,
        "deprecated_api_us": api,
    }
    care, art = medians["careful"], medians["article (a)+(b)"]
    report_line(f"the AMD article's KD step as written vs the careful hand loop, {STEP}:")
    report_line(
        f"  careful loop {care:.3f} ms, article's step {art:.3f} ms (medians of {len(samples['careful'])} steps "
        f"each): difference {art - care:+.3f} ms ({(art / care - 1) * 100:+.1f} %), median paired round "
        f"difference {diffs['article (a)+(b)']:+.3f} ms"
    )
    report_line(f"  article's AMP here: {article.amp_note}")
    if not cuda:
        report_line(
            "  (the article's torch.cuda.amp.autocast / GradScaler target CUDA: on this CPU-only machine they would "
            "only disable themselves with a warning; fp16 autocast on a CPU is out of the question, so both steps "
            "run in fp32 and the difference below is causes (a) and (b))"
        )
    report_line("  causes (each alone: median paired round difference vs the careful loop):")
    report_line(
        f"  (a) teacher in train(): {diffs['(a) teacher train()']:+.3f} ms ({medians['(a) teacher train()']:.3f} ms): "
        f"BatchNorm normalises with batch statistics and updates its running ones every step; the teacher's logits "
        f"differ from eval()'s (freshly initialised running statistics) by up to {logit_gap:.3g} on this batch, "
        f"and after {steps_run} article steps its running means moved by up to {bn_moved:.3g} (a different, "
        f"drifting teacher)"
    )
    report_line(
        f"  (b) no torch.no_grad() around the teacher: {diffs['(b) no no_grad']:+.3f} ms "
        f"({medians['(b) no no_grad']:.3f} ms): autograd records the teacher's graph and keeps "
        f"{saved / 2**20:.2f} MiB of its activations per step, and since its outputs are not detached the backward "
        f"runs through the teacher too, into {teacher_grad_bytes / 2**20:.2f} MiB of gradients no optimizer uses"
    )
    both = diffs["(a) teacher train()"] + diffs["(b) no no_grad"]
    report_line(
        f"  (a) and (b) alone add up to {both:+.3f} ms; together (the article's step) "
        f"{diffs['article (a)+(b)']:+.3f} ms"
    )
    if api is not None:
        old, new = api["torch.cuda.amp.autocast()"], api['torch.amp.autocast("cuda")']
        report_line(
            f"  (c) the deprecated torch.cuda.amp API: entering and leaving its autocast costs {old:.2f} µs on the "
            f'host vs {new:.2f} µs for torch.amp.autocast("cuda") (same kernels; a FutureWarning, and a '
            f"GradScaler that is CUDA-only)"
        )
    else:
        report_line(
            "  (c) the deprecated torch.cuda.amp API vs torch.amp.autocast(device_type): not measured (no GPU here); "
            'it is torch.amp.autocast("cuda") behind a FutureWarning and runs the same kernels; it is CUDA-only '
            "(on a CPU it disables itself with a warning), and on a GPU its fp16 autocast of the teacher changes "
            "the precision, which this fp32 comparison leaves out"
        )
    report_line(f"  saved to {OUT_ARTICLE}")
    OUT_ARTICLE.parent.mkdir(parents=True, exist_ok=True)
    OUT_ARTICLE.write_text(json.dumps(result, indent=2))
    benchmark.extra_info.update(result)
    benchmark.pedantic(article, rounds=10, iterations=1, warmup_rounds=1)  # the article's step, saved
    assert all(math.isfinite(v) and v > 0 for v in medians.values())
    assert all(math.isfinite(v) for v in diffs.values())
    assert math.isfinite(logit_gap) and saved > 0 and teacher_grad_bytes > 0


# --------------------------------------------------------------------------- the language-model step and decode
#
# Three comparisons on the LM, each interleaved in one process (kdbench's call and the hand loop's in short rounds,
# each first in every other round), the hand loops in benchmarks/fidelity_lm.py: (a) loss_impl natural against the
# step as TRL's GKD trainer writes it, (b) loss_impl dense against a careful hand step of the same work, (c)
# kdbench's greedy decode (its decode row's call) against a hand greedy KV-cache loop.  The tiny Llama pair at a
# 32,000 vocabulary, 2 sequences (the prompt a quarter of each), forward KL + CE, fp32, AdamW; decode: 32 tokens at
# batch 1 after a prompt of the sequence length.  Bounds: (a) and (b) within +-5 %, (c) within +-10 % (neither faster
# nor slower); asserted only when the machine was idle enough (kdbench's own contention meter: other processes left
# the run's threads 75 % of their cores), else printed with the reason; a comparison outside its bound is measured
# once more, and fails only when it is outside again.  The bounds hold at the size, 2 x 512 tokens
# (KDBENCH_FIDELITY_LM_SEQ=512; KDBENCH_FIDELITY_LM_ROUNDS for more rounds): there the paired ratios read 0.965-1.032
# on the idle VM.  CI runs 2 x 128 tokens and prints the figures without asserting them: there, on the same idle VM,
# natural/TRL-form read 0.83-1.08 from run to run and the decode 0.85-0.98 (at a short prompt per-operator
# overhead dominates, where inference_mode saves most), a spread no +-5 % bound survives.

LM_SEQ = int(os.environ.get("KDBENCH_FIDELITY_LM_SEQ", "128"))  # tokens per sequence (the figure: 512)
LM_ROUNDS = int(os.environ.get("KDBENCH_FIDELITY_LM_ROUNDS", "6"))  # rounds per comparison
BOUNDED_SEQ = 512  # the bounds are asserted at this size and above
LM_CALLS, DECODE_CALLS, DECODE_TOKENS = 2, 3, 32
LM_BOUNDS = {"natural vs TRL-form step": 0.05, "dense vs careful step": 0.05, "greedy decode": 0.10}
OUT_LM = RESULTS / "fidelity_lm.json"


def kdbench_decode(step, prompt: torch.Tensor):
    """kdbench's decode row's call on the student (kdbench.workloads.lm.serving): GreedyServing's decode of
    DECODE_TOKENS tokens under inference_mode, after its untimed prefill."""
    from kdbench.models.generation import GreedyServing

    lm = step.distiller.student.lm
    gen = GreedyServing(lm, prompt, DECODE_TOKENS)
    with torch.inference_mode():
        gen.start()

    def call() -> None:
        with torch.inference_mode():
            gen.decode()

    return call, gen


def compared(name: str, ours, hand, rounds: int, calls: int) -> dict:
    """One interleaved comparison, with the host's load over it (kdbench's contention meter)."""
    meter = HostMeter(torch.get_num_threads())
    meter.start()
    result = interleaved({"kdbench": ours, "hand": hand}, rounds, calls)
    meter.stop()
    load = meter.result()
    result["bound"] = LM_BOUNDS[name]
    result["host"] = load.describe() if load is not None else "not read"
    result["contended"] = bool(load is not None and load.contended)
    return result


def test_kdbench_lm_step_and_decode_cost_what_hand_written_loops_cost(benchmark, report_line, cpu_lm_step):
    ids, labels = lm_batch(LM_SEQ)
    steps = {impl: cpu_lm_step(LM_SEQ, impl)[0] for impl in ("natural", "dense")}
    hands = {}
    for impl, form in (("natural", "trl"), ("dense", "careful")):
        step = steps[impl]
        assert torch.equal(ids, step.x) and torch.equal(labels, step.y)
        ours_t, ours_s = step.distiller.teacher.lm, step.distiller.student.lm
        hands[impl] = hand = HandLMStep(ours_t, ours_s, ids, labels, form)
        for ours, theirs in ((ours_s, hand.student), (ours_t, hand.teacher)):
            assert ours.config._attn_implementation == theirs.config._attn_implementation
            mine, other = ours.state_dict(), theirs.state_dict()
            assert mine.keys() == other.keys() and all(torch.equal(mine[k], other[k]) for k in mine)
        step()
        hand()
        # Same models, batch and loss: the first step's losses agree
        torch.testing.assert_close(step.last_loss, hand.loss, rtol=1e-5, atol=1e-6)
        step()  # warm up both (one more: the optimizer state exists)
        hand()
    prompt = ids[:1]
    ours_decode, gen = kdbench_decode(steps["dense"], prompt)
    hand_decode = HandGreedyDecode(steps["dense"].distiller.student.lm, prompt, DECODE_TOKENS)
    ours_decode()
    hand_decode()
    assert torch.equal(gen.generated(), hand_decode.tokens)  # the same greedy tokens

    threads = torch.get_num_threads()
    plan = {
        "natural vs TRL-form step": (steps["natural"], hands["natural"], LM_ROUNDS, LM_CALLS),
        "dense vs careful step": (steps["dense"], hands["dense"], LM_ROUNDS, LM_CALLS),
        "greedy decode": (ours_decode, hand_decode, 2 * LM_ROUNDS, DECODE_CALLS),
    }
    results = {name: compared(name, *args) for name, args in plan.items()}
    for name, r in list(results.items()):
        # a figure outside its bound on an idle machine is measured once more before it fails: one run's process
        # state (e.g. glibc's mmap threshold for the large logits) can favour one side; a real cost shows twice
        if LM_SEQ >= BOUNDED_SEQ and not r["contended"] and abs(r["median_paired_ratio"] - 1) > r["bound"]:
            results[name] = {**compared(name, *plan[name]), "first_median_paired_ratio": r["median_paired_ratio"]}
    for impl, key in (("natural", "natural vs TRL-form step"), ("dense", "dense vs careful step")):
        n = len(steps[impl].marks) - 2
        results[key]["kdbench_phase_median_ms"] = {k: statistics.median(v) for k, v in steps[impl].phase_ms(n).items()}
    what = (
        f"tiny Llama pair, {LM_VOCAB} vocab, 2x{LM_SEQ} tokens (prompt 25 %), forward KL + CE (alpha 0.5), "
        f"fp32, AdamW, cpu; decode {DECODE_TOKENS} tokens at batch 1 after {LM_SEQ} prompt tokens"
    )
    report_line(
        f"kdbench's LM step and decode vs hand-written loops (benchmarks/fidelity_lm.py), {what}, {threads} threads:"
    )
    failed = []
    for name, r in results.items():
        ratio, bound = r["median_paired_ratio"], r["bound"]
        ok = abs(ratio - 1) <= bound
        verdict = f"{'within' if ok else 'OUTSIDE'} 1 +- {bound:.2f}"
        if "first_median_paired_ratio" in r:
            verdict += f"; measured again, the first read {r['first_median_paired_ratio']:.4f}"
        if r["contended"]:
            verdict += ", not asserted: the machine was busy"
        elif LM_SEQ < BOUNDED_SEQ:
            verdict += f", not asserted below {BOUNDED_SEQ} tokens a sequence (the bound's size)"
        elif not ok:
            failed.append(name)
        report_line(
            f"  {name}: kdbench {r['kdbench_median_ms']:.1f} ms, hand {r['hand_median_ms']:.1f} ms; median paired "
            f"ratio {ratio:.4f} ({verdict}); {r['host']}"
        )
        if "kdbench_phase_median_ms" in r:
            phases = r["kdbench_phase_median_ms"]
            report_line("    kdbench's phases (ms, medians): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    dense, natural = results["dense vs careful step"], results["natural vs TRL-form step"]
    report_line(
        f"  what dense saves against natural (the same loss and gradients): {natural['kdbench_median_ms']:.1f} -> "
        f"{dense['kdbench_median_ms']:.1f} ms ({dense['kdbench_median_ms'] / natural['kdbench_median_ms']:.2f}x); "
        f"saved to {OUT_LM}"
    )
    out = {"threads": threads, "what": what, "seq_len": LM_SEQ, "comparisons": results}
    OUT_LM.parent.mkdir(parents=True, exist_ok=True)
    OUT_LM.write_text(json.dumps(out, indent=2))
    benchmark.extra_info.update(out)
    benchmark.pedantic(hands["dense"], rounds=2, iterations=1)  # the careful hand step, saved by pytest-benchmark
    assert not failed, f"outside their bounds on an idle machine: {failed}"
