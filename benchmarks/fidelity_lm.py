"""The hand-written LM loops `bench_fidelity.py` times kdbench against: a training step as TRL's GKD trainer writes it,
a careful training step, and a greedy KV-cache decode loop.  Each is written as a user writes it, from transformers
and torch alone (no kdbench code), so that anyone can read what kdbench's figure is compared with.

The batch is the cell's (:func:`lm_batch`): kdbench's labels come shifted (the label at i is the token at i + 1, the
last position -100), so the hand steps take them as they are; TRL's ``compute_loss`` slices ``logits[:, :-1]`` and
``labels[:, 1:]`` of unshifted labels instead, the same positions (its slice makes its log-softmax copy the logits,
which the same-work comparison leaves out).
"""

from __future__ import annotations

import copy
import inspect
import statistics
import time

import torch
import torch.nn.functional as F

LM_BATCH, LM_VOCAB, LM_PROMPT, LM_ALPHA, LR = 2, 32000, 0.25, 0.5, 1e-4


def lm_batch(seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cell's batch, written out: ids uniform over the vocabulary from a generator seeded 0 (the cell's seed),
    labels the next tokens, the first quarter of each sequence (the prompt) and its last position -100."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, LM_VOCAB, (LM_BATCH, seq_len), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[:, : round(LM_PROMPT * seq_len)] = -100
    return ids, labels


def llama_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A LlamaForCausalLM of the model's config (same attention implementation), its weights loaded."""
    import transformers

    out = transformers.LlamaForCausalLM(copy.deepcopy(model.config))
    out.load_state_dict(model.state_dict())
    return out


class HandLMStep:
    """A hand-written transformers distillation step, forward KL weighted alpha + (1 - alpha) CE, fp32, AdamW with
    torch's defaults, the teacher frozen in eval() under no_grad, zero_grad(set_to_none=True), backward, step.

    ``form="trl"``: as TRL's GKD trainer (and torchtune's KD recipe) computes the loss: the models' ``.logits`` (the
    heads over every position), the log-softmaxes of the whole logits, ``F.kl_div(..., reduction="none",
    log_target=True)``, the valid rows ``jsd[mask]`` summed over the valid tokens, and ``F.cross_entropy(...,
    ignore_index=-100)`` beside it.  ``form="careful"``: what kdbench's ``dense`` says it does: the base models'
    hidden states, both heads on the valid rows only, the same KL on them, CE read from the student's log-softmax."""

    def __init__(self, teacher, student, ids: torch.Tensor, labels: torch.Tensor, form: str = "trl"):
        self.teacher, self.student = llama_copy(teacher), llama_copy(student)
        self.teacher.eval().requires_grad_(False)
        self.student.train()
        self.optimizer = torch.optim.AdamW(self.student.parameters(), lr=LR)
        self.ids, self.labels, self.form = ids, labels, form
        self.mask = labels != -100
        self.rows = self.mask.flatten().nonzero().squeeze(1)  # found once: the batch is fixed
        self.valid = self.labels.flatten()[self.rows]
        self.loss: torch.Tensor | None = None

    def trl_loss(self) -> torch.Tensor:
        s = self.student(input_ids=self.ids, use_cache=False).logits
        with torch.no_grad():
            t = self.teacher(input_ids=self.ids, use_cache=False).logits
        jsd = F.kl_div(F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1), reduction="none", log_target=True)
        kl = jsd[self.mask].sum() / self.mask.sum().clamp_min(1)
        ce = F.cross_entropy(s.flatten(0, 1), self.labels.flatten(), ignore_index=-100)
        return LM_ALPHA * kl + (1 - LM_ALPHA) * ce

    def careful_loss(self) -> torch.Tensor:
        hs = self.student.model(input_ids=self.ids, use_cache=False).last_hidden_state.flatten(0, 1)
        s = self.student.lm_head(hs[self.rows])
        with torch.no_grad():
            ht = self.teacher.model(input_ids=self.ids, use_cache=False).last_hidden_state.flatten(0, 1)
            t = self.teacher.lm_head(ht[self.rows])
        log_ps, log_pt = F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1)
        n = self.rows.numel()
        kl = (log_pt.exp() * (log_pt - log_ps)).sum() / n
        ce = -log_ps.gather(1, self.valid[:, None]).sum() / n
        return LM_ALPHA * kl + (1 - LM_ALPHA) * ce

    def __call__(self) -> None:
        loss = self.trl_loss() if self.form == "trl" else self.careful_loss()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.loss = loss.detach()


class HandGreedyDecode:
    """A hand-written greedy KV-cache decode loop as a user writes it (no_grad, the model's own DynamicCache): the
    prompt's forward once (untimed, as kdbench's decode row prefills before its timed calls), then each call
    decodes ``new_tokens`` tokens, one forward of the last token on the cache each, argmax, no early stop, and crops
    the cache back to the prompt (every call from the same state).  ``inference_mode``: under
    ``torch.inference_mode()`` instead of ``torch.no_grad()`` (kdbench's serving runs under inference_mode)."""

    def __init__(self, model, prompt: torch.Tensor, new_tokens: int, inference_mode: bool = False):
        self.model = llama_copy(model).eval()
        self.prompt, self.new_tokens = prompt, new_tokens
        self.mode = torch.inference_mode if inference_mode else torch.no_grad
        # the cache's keyword: transformers 5 renames past_key_values to cache
        self.keyword = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        with self.mode():
            out = self.model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        self.cache = getattr(out, "cache", None) or out.past_key_values
        self.first = out.logits[:, -1].argmax(-1, keepdim=True)
        self.tokens: torch.Tensor | None = None

    def __call__(self) -> None:
        token, tokens = self.first, [self.first]
        with self.mode():
            for _ in range(self.new_tokens):
                out = self.model(input_ids=token, use_cache=True, **{self.keyword: self.cache})
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(token)
        self.cache.crop(-self.new_tokens)  # transformers 5: the count of tokens to remove
        self.tokens = torch.cat(tokens, dim=1)


def timed(fn, calls: int, into: list[float]) -> float:
    """`calls` calls of fn, each timed with perf_counter_ns; their times (ms) go to `into`; the median."""
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - start) / 1e6)
    into.extend(times)
    return statistics.median(times)


def interleaved(pair: dict, rounds: int, calls: int) -> dict:
    """The two callables of ``pair`` ({"kdbench": fn, "hand": fn}) in ``rounds`` short rounds of ``calls`` calls each,
    each first in every other round (a noisy machine's drift hits both alike): each one's median, the ratio of the
    medians and the median of the rounds' ratios (kdbench / hand), with the rounds."""
    samples: dict[str, list[float]] = {"kdbench": [], "hand": []}
    out_rounds = []
    for i in range(rounds):
        order = ("kdbench", "hand") if i % 2 == 0 else ("hand", "kdbench")
        med = {name: timed(pair[name], calls, samples[name]) for name in order}
        out_rounds.append({"kdbench_ms": med["kdbench"], "hand_ms": med["hand"], "ratio": med["kdbench"] / med["hand"]})
    ours, hand = statistics.median(samples["kdbench"]), statistics.median(samples["hand"])
    return {
        "kdbench_median_ms": ours,
        "hand_median_ms": hand,
        "ratio_of_medians": ours / hand,
        "median_paired_ratio": statistics.median(r["ratio"] for r in out_rounds),
        "calls_per_round": calls,
        "rounds": out_rounds,
    }
