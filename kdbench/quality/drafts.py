"""The trained students as drafts: speculative decoding with the text quality protocol's trained pairs.

``quality.speculative`` (:class:`kdbench.config.quality.DraftsConfig`) measures every scratch and distilled
student of a text quality run as the draft of its seed's trained teacher (the target), with the loop of
:func:`kdbench.models.generation.speculative_generate` (batch 1; Leviathan et al. 2023 / Chen et al. 2023
rejection sampling at ``temperature`` > 0, greedy verification at 0).  Per student:

* **the prompts**: ``prompts`` held-out windows, evenly spaced over the held-out split, cut to their first
  ``prompt_tokens`` bytes (half a window by default); each generation adds ``new_tokens`` tokens to each prompt.
* **the timed generations**: the teacher alone (:func:`sampled_generate`: one forward and the same sampling
  per token), the student alone, and speculative decoding at each draft length γ.  One short warm-up of each on
  the first prompt, then ``repeats`` rounds; in a round each prompt goes through every generation in turn (a
  busy moment of the machine falls on all of them alike), each generation drawing from its own generator seeded
  with 100 × the quality seed + r at the start of round r (each round draws other tokens, every run the same);
  a generation's time in a round is its sum over the prompts, and the times are the medians over the rounds.
* **per γ**: the acceptance rate α = accepted / judged proposals and the accepted and generated tokens per
  verify step, over every prompt and round; the measured speed-up, the teacher alone's median wall time over
  speculative decoding's; and the speed-up Leviathan et al.'s Theorem 3.8 predicts from α, γ and the cost
  ratio c, (1 − α^(γ+1)) / ((1 − α)(γc + 1)) (:func:`kdbench.core.speculation.predicted_speedup`).
* **the cost ratio** c: the student alone's median wall time over the teacher alone's, for the same prompts and
  tokens (the time of a draft forward over a target forward, per token, prefill included in both).
* **the predicted α**: 1 − the mean over held-out positions (the first :data:`TV_TOKENS`, teacher-forced) of
  TV(p_teacher, p_student) at the temperature (Leviathan et al., Corollary 3.6: α = E[1 − TV]); at temperature 0,
  the share of those positions where both models' argmax agree (the TV of one-hot distributions).  The
  measured α is over the positions the generation visits, the predicted one over held-out text: they agree as
  far as the student fits the teacher on both alike.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from kdbench.config.quality import DraftsConfig
from kdbench.core.speculation import predicted_speedup
from kdbench.distill.lm.token_losses import tv_per_position
from kdbench.hw.backends import AutocastChoice, Backend
from kdbench.models.generation import sampled_generate, speculative_generate

WARMUP_TOKENS = 8  # tokens of each generation's warm-up, on the first prompt
TV_TOKENS = 1 << 16  # held-out positions the predicted α is averaged over (the first windows')
TV_BATCH_TOKENS = 1 << 15  # positions per forward of that pass

DRAFT_ROW_KEYS = (
    "draft_gammas",
    "draft_alpha",
    "draft_alpha_predicted",
    "draft_accepted_per_verify",
    "draft_tokens_per_verify",
    "draft_cost_ratio",
    "draft_speedup",
    "draft_speedup_predicted",
    "draft_protocol",
)


def decoder(model: nn.Module) -> nn.Module | None:
    """The transformers causal LM inside a quality model (:class:`kdbench.models.lm.CausalLM`, compiled or not),
    which the speculative loop drives on its KV cache; None for a module that is none (a ``module:callable``)."""
    model = getattr(model, "_orig_mod", model)
    return model.lm if getattr(model, "hf", False) else None


@contextlib.contextmanager
def evaluating(*models: nn.Module) -> Iterator[None]:
    """The models in eval mode, their modes restored after."""
    modes = [m.training for m in models]
    try:
        for m in models:
            m.eval()
        yield
    finally:
        for m, mode in zip(models, modes):
            m.train(mode)


def prompt_windows(n_windows: int, prompts: int) -> list[int]:
    """The held-out windows the prompts are cut from: ``prompts`` of ``n_windows``, evenly spaced."""
    if prompts == 1:
        return [0]
    return [round(i * (n_windows - 1) / (prompts - 1)) for i in range(prompts)]


def predicted_alpha(
    target: nn.Module,
    draft: nn.Module,
    x: torch.Tensor,
    temperature: float,
    choice: AutocastChoice,
    backend: Backend,
    tokens: int = TV_TOKENS,
) -> tuple[float, int]:
    """(1 − the mean TV(p_target, p_draft) at ``temperature`` over the first ``tokens`` positions of the windows
    ``x`` (N, S), the positions it is over); at temperature 0 the share of positions whose argmax agree.  The
    models are quality LMs (``model.logits(model(x))``)."""
    windows = max(1, min(len(x), tokens // x.shape[1]))
    batch = max(1, TV_BATCH_TOKENS // x.shape[1])
    total, count = 0.0, 0
    with evaluating(target, draft), torch.inference_mode(), choice.context(backend.device_type):
        for i in range(0, windows, batch):
            xb = x[i : min(i + batch, windows)]
            p = target.logits(target(xb)).float()
            q = draft.logits(draft(xb)).float()
            greedy = temperature == 0  # the TV of one-hot distributions: whether the argmax differ
            tv = (p.argmax(-1) != q.argmax(-1)).float() if greedy else tv_per_position(p, q, temperature)
            total += float(tv.sum())
            count += tv.numel()
    return 1.0 - total / count, count


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _timed(backend: Backend, fn: Callable[..., Any], *args: Any) -> float:
    """The wall time of ``fn(*args)``, the device synchronised before and after."""
    backend.synchronize()
    start = time.perf_counter()
    fn(*args)
    backend.synchronize()
    return time.perf_counter() - start


def measure_draft(
    target: nn.Module,
    draft: nn.Module,
    x_test: torch.Tensor,
    spec: DraftsConfig,
    choice: AutocastChoice,
    backend: Backend,
    seed: int,
    vocab: int | None = None,
) -> dict[str, Any]:
    """The draft columns (:data:`DRAFT_ROW_KEYS`) of ``draft`` drafting for ``target`` (quality LMs, see
    :func:`decoder`) on prompts cut from the held-out windows ``x_test`` (N, S), as the module's docstring says."""
    t_lm, d_lm = decoder(target), decoder(draft)
    if t_lm is None or d_lm is None:
        raise ValueError("speculative decoding drives transformers causal LMs on their KV cache; this pair has none")
    indices = prompt_windows(len(x_test), spec.prompts)
    length = spec.prompt_length(x_test.shape[1])
    prompts = [x_test[i : i + 1, :length] for i in indices]
    temperature, gammas, new = spec.temperature, list(spec.draft_tokens), spec.new_tokens
    device = x_test.device

    counts: dict[int, list[int]] = {g: [0, 0, 0, 0] for g in gammas}  # accepted, rejected, verifies, new tokens

    def generate(kind: Any, prompt: torch.Tensor, tokens: int, g: torch.Generator, count: bool) -> None:
        """One generation: the teacher alone, the student alone, or speculative at γ = ``kind``."""
        if kind in ("target", "draft"):
            sampled_generate(t_lm if kind == "target" else d_lm, prompt, tokens, temperature, g, vocab)
            return
        s = speculative_generate(t_lm, d_lm, prompt, tokens, kind, temperature, g, vocab)
        if count:
            c = counts[kind]
            c[0], c[1], c[2], c[3] = c[0] + s.accepted, c[1] + s.rejected, c[2] + s.verifies, c[3] + tokens

    kinds: list[Any] = ["target", "draft", *gammas]
    times: dict[Any, list[float]] = {k: [] for k in kinds}
    with evaluating(target, draft), torch.inference_mode(), choice.context(backend.device_type):
        for kind in kinds:  # a short warm-up of each generation on the first prompt, not counted
            generate(kind, prompts[0], min(new, WARMUP_TOKENS), _generator(device, seeded(seed, 0)), False)
        for r in range(spec.repeats):
            # every generation of the round draws from its own generator, seeded alike; the generations of one
            # prompt run one after the other, so that a busy moment of the machine falls on all of them
            generators = {k: _generator(device, seeded(seed, r)) for k in kinds}
            total = dict.fromkeys(kinds, 0.0)
            for prompt in prompts:
                for kind in kinds:
                    total[kind] += _timed(backend, generate, kind, prompt, new, generators[kind], True)
            for kind in kinds:
                times[kind].append(total[kind])
    median = {k: statistics.median(v) for k, v in times.items()}
    cost = median["draft"] / median["target"]
    alpha, accepted, per_verify, speedup, predicted = [], [], [], [], []
    for g in gammas:
        acc, rej, verifies, tokens = counts[g]
        a = acc / (acc + rej)  # every round judges at least one proposal
        alpha.append(a)
        accepted.append(acc / verifies)
        per_verify.append(tokens / verifies)
        speedup.append(median["target"] / median[g])
        predicted.append(predicted_speedup(a, g, cost))
    a_tv, positions = predicted_alpha(target, draft, x_test, temperature, choice, backend)
    return {
        "draft_gammas": gammas,
        "draft_alpha": alpha,
        "draft_alpha_predicted": a_tv,
        "draft_accepted_per_verify": accepted,
        "draft_tokens_per_verify": per_verify,
        "draft_cost_ratio": cost,
        "draft_speedup": speedup,
        "draft_speedup_predicted": predicted,
        "draft_protocol": protocol(spec, length, indices, positions, seed),
    }


def seeded(seed: int, round_: int) -> int:
    """The generator seed of round ``round_`` of quality seed ``seed``'s draft measurement."""
    return 100 * seed + round_


def protocol(spec: DraftsConfig, length: int, indices: list[int], positions: int, seed: int) -> str:
    """How a row's draft figures were obtained, for the row."""
    sampling = "greedy (temperature 0)" if spec.temperature == 0 else f"sampled at temperature {spec.temperature:g}"
    parts = (
        "the seed's teacher as target, this student as draft, batch 1",
        f"{len(indices)} prompt(s): the first {length} bytes of held-out windows {indices}",
        f"{spec.new_tokens} new tokens each, {sampling}",
        f"round r's generations from generators seeded {seeded(seed, 0)} + r",
        f"wall times: medians of {spec.repeats} round(s) of the teacher alone, the student alone and speculative "
        "decoding at each draft length over all prompts (interleaved prompt by prompt), after a short warm-up",
        "speed-up: the teacher alone over speculative",
        "cost ratio: the student alone over the teacher alone",
        "alpha and tokens per verify: over every prompt and round",
        f"predicted alpha: 1 - mean TV over {positions} held-out positions",
        "predicted speed-up: Leviathan et al. 2023 Theorem 3.8",
    )
    return "; ".join(parts)


def describe(row: dict[str, Any]) -> str:
    """A log line of a row's draft figures."""

    def each(values: list[float], fmt: str) -> str:
        return "/".join(format(v, fmt) for v in values)

    return (
        f"as a draft: alpha {each(row['draft_alpha'], '.2f')} (1 - TV {row['draft_alpha_predicted']:.2f}) at "
        f"gamma {each(row['draft_gammas'], 'd')}: {each(row['draft_tokens_per_verify'], '.2f')} tokens per verify, "
        f"speed-up {each(row['draft_speedup'], '.2f')}x (predicted {each(row['draft_speedup_predicted'], '.2f')}x "
        f"at c {row['draft_cost_ratio']:.2f})"
    )
