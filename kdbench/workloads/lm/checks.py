"""The plan's checks of LM cells against their models, built on the meta device (:mod:`kdbench.models.meta`): LM
heads a loss implementation and the vocabulary slicing can use, the vocabulary policy (and the vocabulary both
models share, :func:`shared_vocab`), tokenizers, uld, the student's generation for on-policy distillation, the
generation backend, speculative decoding, the top-k cache, and a loss with at least one token in it.  What LM and
encoder cells share (the models' facts, feature paths) is :mod:`kdbench.workloads.model_checks`'.

Each function returns :data:`~kdbench.workloads.base.Problems` (setting path, message); a model whose facts are
not known (user code that cannot be built on meta) is left to the run.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from kdbench.config.schema import CellConfig
from kdbench.core.errors import KdbenchError
from kdbench.data.token_file import TokenFile, TokenFileError, open_tokens, scan_tokens, windows_needed
from kdbench.data.tokens import prompt_length, prompt_tokens
from kdbench.distill.lm.impls import pad_unsupported, uld_unsupported
from kdbench.distill.losses import check_method
from kdbench.models.lm import max_positions, model_config
from kdbench.store.teacher_logits import resolve_indices
from kdbench.workloads.base import Problems
from kdbench.workloads.lm.xtok import cross_tokenizer, tokenizer_size
from kdbench.workloads.model_checks import ROLES, Facts


def head_problems(config: CellConfig, facts: Facts) -> Problems:
    """LM heads the cell's loss can use: a head with a 2-D weight (cut to the shared vocabulary), or logits
    (then loss_impl dense, the only implementation that takes logits as they are)."""
    problems: Problems = []
    for role, f in facts.items():
        name = getattr(config.pair, role)
        if f.head is not None:
            why = f"{name}: {f.head}; the loss multiplies the hidden states by the head's weight: give it a Linear head"
            problems.append((("pair", role), why))
        elif f.known and not f.hf and f.returns is not None:
            why = (
                f"{name} has no LM head and its forward returns {f.returns}, not logits (batch, tokens, vocabulary): "
                "return a transformers causal LM (...ForCausalLM) or a module that maps token ids to logits"
            )
            problems.append((("pair", role), why))
        elif f.known and not f.hf and config.loss_impl != "dense":
            why = (
                f"loss_impl {config.loss_impl} computes the logits from the LM heads' weights, and {name} has no LM "
                "head (its forward returns the logits): use loss_impl: dense, or a transformers causal LM"
            )
            problems.append((("loss_impl",), why))
    return problems


def vocab_problems(config: CellConfig, facts: Facts) -> Problems:
    """The vocabularies under ``data.vocab_policy``: error refuses two sizes (slice cuts both heads to the
    smaller); a module:callable's is its logits' width."""
    vocabs = {role: f.vocab for role, f in facts.items() if f.vocab is not None}
    if config.data.tokenizers is not None:  # each model's vocabulary is its own tokenizer's
        return tokenizer_problems(config, vocabs)
    if config.data.vocab_policy == "pad":
        why = pad_unsupported(config.loss_impl)
        problems: Problems = [(("loss_impl",), why)] if why else []
        if config.teacher.mode == "topk_cache":
            why = (
                "teacher.mode topk_cache keeps the teacher's top-k over its own vocabulary: use data.vocab_policy slice"
            )
            problems.append((("data", "vocab_policy"), why))
        return problems
    if len(vocabs) == 2 and vocabs["teacher"] != vocabs["student"] and config.data.vocab_policy == "error":
        why = (
            f"the teacher's vocabulary has {vocabs['teacher']} entries and the student's {vocabs['student']}: "
            "set data.vocab_policy: slice (both heads cut to the smaller) or pad (the smaller padded with -inf), or "
            "give both one vocab_size"
        )
        return [(("data", "vocab_policy"), why)]
    return []


def tokenizer_problems(config: CellConfig, vocabs: dict[str, int]) -> Problems:
    """data.tokenizers: each model's vocabulary must be its tokenizer's size (every id it reads is a row of its
    embedding, every entry of its head a token); data.vocab_policy reconciles one set of token ids, not two."""
    problems: Problems = []
    for role in ROLES:
        spec, vocab = getattr(config.data.tokenizers, role), vocabs.get(role)
        try:
            size = tokenizer_size(spec)
        except KdbenchError as exc:
            problems.append((("data", "tokenizers", role), str(exc)))
            continue
        if vocab is not None and vocab != size:
            why = (
                f"the {role} {getattr(config.pair, role)} has {vocab} vocabulary entries and its tokenizer {spec} "
                f"has {size}: set overrides.{role}.vocab_size: {size}"
            )
            problems.append((("overrides", role, "vocab_size"), why))
    if config.data.vocab_policy != "error":
        why = (
            "data.vocab_policy reconciles two heads over one set of token ids; with data.tokenizers each model keeps "
            "its own vocabulary: remove data.vocab_policy"
        )
        problems.append((("data", "vocab_policy"), why))
    return problems


def aligned_problems(config: CellConfig, methods: list) -> Problems | None:
    """uld, and cells whose models tokenize differently (data.tokenizers with two specs), which only uld trains:
    their problems (None: neither, the cell's other checks apply).  ULD stands alone (its CE and rows are each
    side's own positions; a divergence and hidden_mse pair one position of both models), under a loss_impl that
    computes it, with a live teacher; a cross-tokenizer cell runs on one device, without on-policy generation or
    speculative decoding (each would need the student's tokens read by the teacher)."""
    uld = [m for m in methods if getattr(m.cls, "aligned_rows", False)]
    xtok = cross_tokenizer(config)
    if not uld and not xtok:
        return None
    names = "+".join(m.name for m in methods)
    if not uld:
        t = config.data.tokenizers
        why = (
            f"{names} compares the two models position by position over one vocabulary, and the teacher ({t.teacher}) "
            f"and the student ({t.student}) tokenize the text differently (data.tokenizers): use method: uld"
        )
        return [(("method",), why)]
    problems: Problems = []
    if len(methods) > 1:
        why = (
            f"{names}: uld stands alone (its rows are each model's own positions after the prompt; a divergence or "
            "hidden_mse pairs one position of both models): use method: uld"
        )
        problems.append((("method",), why))
    why = uld_unsupported(config.loss_impl)
    if why:
        problems.append((("loss_impl",), why))
    if config.teacher.mode == "topk_cache" or (xtok and config.teacher.mode != "live"):
        why = (
            f"uld{' across tokenizers' if xtok else ''} trains on the teacher's whole logits over its own tokens: "
            f"teacher.mode live, not {config.teacher.mode}"
        )
        problems.append((("teacher", "mode"), why))
    if config.on_policy is not None:
        why = "on_policy trains on a divergence from the teacher on the student's completions, not on uld: remove it"
        problems.append((("on_policy",), why))
    if config.uld.alignment == "bytes" and config.data.tokenizers is None:
        why = (
            "uld.alignment bytes pairs the positions that have read the same text, and without data.tokenizers the "
            "batch is random token ids with no text: give data.tokenizers, or use uld.alignment: position"
        )
        problems.append((("uld", "alignment"), why))
    if xtok and config.world_size > 1:
        why = (
            "a cross-tokenizer cell (data.tokenizers) runs on one device: its batch's text is each rank's own only "
            "on one rank; set world_size: 1"
        )
        problems.append((("world_size",), why))
    if xtok and config.inference.speculative is not None:
        why = (
            "inference.speculative has the teacher verify the student's draft tokens, and with data.tokenizers the "
            "teacher cannot read the student's tokens: remove inference.speculative"
        )
        problems.append((("inference", "speculative"), why))
    return problems


ULD_NOTE = "a divergence (forward_kl, reverse_kl, jsd, ...) would do; ULD discards the token identities"


def uld_note(config: CellConfig) -> str | None:
    """The note of a uld cell whose models share one tokenizer (no data.tokenizers, or one spec twice)."""
    try:
        methods = check_method(config.method)
    except KdbenchError:
        return None
    if cross_tokenizer(config) or not any(getattr(m.cls, "aligned_rows", False) for m in methods):
        return None
    return f"uld on a pair that shares one tokenizer: {ULD_NOTE}"


def generation_problems(config: CellConfig, facts: Facts) -> Problems:
    """on_policy: the student samples its completions token by token with a KV cache: a transformers causal LM."""
    f = facts.get("student")
    if config.on_policy is None or f is None or not f.known or f.can_generate:
        return []
    name = config.pair.student
    why = (
        f"on_policy has the student sample its completions token by token with a KV cache, and {name} is no "
        "transformers causal LM (it returns logits): give a student that generates (a registered LM, a config.json, "
        "or a module:callable returning ...ForCausalLM), or remove on_policy"
    )
    return [(("on_policy",), why)]


def generation_label(generation: Any) -> str:
    """``dynamic``, ``static`` or ``static + compile``: a generation setting in words (the rows' ``generation``)."""
    if generation is None:
        return "dynamic"
    return generation.cache + (" + compile" if generation.compile else "")


def backend_problems(config: CellConfig) -> Problems:
    """generation: a compiled decode step needs the static cache it is documented with; a backend needs something
    that generates (decode rows or on_policy)."""
    g = config.generation
    problems: Problems = []
    if g.compile and g.cache != "static":
        why = (
            "generation.compile compiles the decode step on a static KV cache, as transformers documents it (a "
            "dynamic cache grows every token and would recompile): set generation.cache: static"
        )
        problems.append((("generation", "compile"), why))
    if (g.cache != "dynamic" or g.compile) and not config.inference.batch_sizes and config.on_policy is None:
        why = (
            "generation sets how decode rows and on_policy generate, and this cell has neither (inference.batch_sizes "
            "is empty, no on_policy): remove it, or add them"
        )
        problems.append((("generation",), why))
    return problems


def prompt_problems(config: CellConfig) -> Problems:
    """A loss with tokens in it: off-policy, the prompt masks its share of each sequence and the last position has
    no next token, so a prompt of seq_len - 1 tokens leaves none; on-policy, the completions are the loss's tokens
    and each is sampled from a prompt of at least one token."""
    fraction, seq_len = config.data.prompt_fraction, config.data.seq_len
    prompt = prompt_tokens(seq_len, fraction)
    if config.on_policy is None and prompt >= seq_len - 1:
        why = (
            f"data.prompt_fraction {fraction:g} of seq_len {seq_len} is a {prompt}-token prompt, which masks every "
            "next-token label (the last position has none): the loss would have no token; lower it to at most "
            f"{(seq_len - 2) / seq_len:.4g}, or raise seq_len"
        )
        return [(("data", "prompt_fraction"), why)]
    if config.on_policy is not None and prompt == 0:
        why = (
            f"on_policy samples each completion from its prompt, and data.prompt_fraction {fraction:g} of seq_len "
            f"{seq_len} rounds to no token: raise it to at least {1 / seq_len:.4g}"
        )
        return [(("data", "prompt_fraction"), why)]
    return []


def speculative_problems(config: CellConfig, facts: dict) -> Problems:
    """inference.speculative: the teacher's batch-size-1 decode row to compare with, and two transformers causal LMs
    (a KV cache each).  Two vocabularies are refused unless data.vocab_policy slices them (as for every LM cell:
    :func:`kdbench.workloads.lm.checks.vocab_problems`); sliced, both draft and verify over the shared entries."""
    if config.inference.speculative is None:
        return []
    problems: Problems = []
    key = ("inference", "speculative")
    if not config.inference.teacher:
        why = (
            "inference.speculative is timed against the teacher decoding alone, and inference.teacher: false "
            "measures no teacher: set inference.teacher: true (or remove inference.speculative)"
        )
        problems.append((key, why))
    if 1 not in config.inference.batch_sizes:
        why = (
            "inference.speculative decodes at batch size 1 and is compared with the batch-size-1 decode rows: add 1 "
            f"to inference.batch_sizes (now {list(config.inference.batch_sizes)})"
        )
        problems.append((key, why))
    g = config.generation
    if g.cache != "dynamic" or g.compile:
        why = (
            "inference.speculative verifies on transformers' dynamic KV cache, cut back after every rejection, and "
            f"its speed-up is read against the decode rows: with generation {generation_label(g)} they would decode "
            "on another backend; remove generation from this cell (sweep it in a cell of its own)"
        )
        problems.append((key, why))
    for role, f in facts.items():
        if f.known and not f.can_generate:
            why = (
                f"inference.speculative decodes with a KV cache per model, and the {role} {getattr(config.pair, role)} "
                "is no transformers causal LM (it returns logits): give a registered LM, a config.json or a "
                "module:callable returning ...ForCausalLM, or remove inference.speculative"
            )
            problems.append((key, why))
    return problems


def on_policy_problems(config: CellConfig, tokens: list, configs: dict) -> Problems:
    """on_policy: a live teacher scores what the student generated; a divergence to train on; positions enough."""
    problems: Problems = []
    if config.teacher.mode != "live":
        mode = config.teacher.mode
        why = f"on_policy: the teacher must score each step's new completions: teacher.mode live, not {mode}"
        problems.append((("teacher", "mode"), why))
    if not tokens:
        why = "on_policy trains on a divergence from the teacher on the student's completions: use e.g. method jsd"
        problems.append((("method",), why))
    if config.parallel == "fsdp":
        why = (
            "on_policy with parallel fsdp: the student generates through its model's own forward, outside the FSDP2 "
            "root, whose embeddings and LM head stay sharded there (DTensor); use parallel: ddp (or remove on_policy)"
        )
        problems.append((("on_policy",), why))
    need = prompt_length(config) + config.on_policy.new_tokens
    for role, c in configs.items():
        limit = max_positions(c)
        if limit is not None and need > limit:
            problems.append(
                (
                    ("on_policy", "new_tokens"),
                    f"the prompt ({prompt_length(config)} tokens) + on_policy.new_tokens = {need} is beyond the "
                    f"{role}'s {limit} positions; lower them",
                )
            )
    return problems


def topk_problems(config: CellConfig, tokens: list, vocabs: dict[str, int]) -> Problems:
    """teacher.mode topk_cache (and offline): the sparse forward KL on the student's dense logits, k within the
    vocabulary."""
    problems: Problems = []
    mode = config.teacher.mode
    if [m.name for m in tokens] != ["forward_kl"]:
        problems.append(
            (
                ("method",),
                f"teacher.mode {mode} trains on the forward KL over the teacher's top-k tokens: use method "
                f"forward_kl{' (optionally +hidden_mse)' if mode == 'topk_cache' else ''}",
            )
        )
    if config.loss_impl != "dense":
        why = (
            f"teacher.mode {mode} computes its sparse KL on the student's logits: use loss_impl dense, "
            f"not {config.loss_impl}"
        )
        problems.append((("loss_impl",), why))
    if config.parallel == "fsdp" and mode == "offline":
        why = (
            "teacher.mode offline is not supported with parallel fsdp (its teacher builds the store whole on rank 0, "
            "and its steps run no teacher to shard): use parallel: ddp; a live twin with parallel: fsdp in the same "
            "run is what its pay-back is measured against"
        )
        problems.append((("parallel",), why))
    elif config.parallel == "fsdp":
        why = (
            f"teacher.mode {mode} is not supported with parallel fsdp: the cache applies the teacher's LM head "
            "outside its FSDP2-sharded forward, and the loss would gather the teacher's root every step for nothing; "
            "use parallel: ddp (or teacher.mode live)"
        )
        problems.append((("teacher", "mode"), why))
    vocab = min(vocabs.values()) if vocabs else None
    if vocab is not None and config.teacher.k > vocab:
        problems.append((("teacher", "k"), f"teacher.k {config.teacher.k} exceeds the vocabulary's {vocab} entries"))
    return problems


def shared_vocab(config: CellConfig, teacher: nn.Module | None = None, student: nn.Module | None = None) -> int:
    """The vocabulary both models share: the token ids both read (the smaller, under vocab_policy slice or pad; two
    sizes under error raise)."""
    sizes = []
    for role, model in (("teacher", teacher), ("student", student)):
        if model is not None and model.vocab_size is not None:
            sizes.append(model.vocab_size)
            continue
        c = model_config(getattr(config.pair, role), getattr(config.overrides, role))
        if c is not None:
            sizes.append(int(c.vocab_size))
    if not sizes:
        raise KdbenchError("cannot tell the vocabulary size of the pair; give a transformers model")
    # the plan refuses two sizes under vocab_policy error (a run never slices unasked); data.tokenizers: each its own
    if len(set(sizes)) > 1 and config.data.vocab_policy == "error" and config.data.tokenizers is None:
        raise KdbenchError(f"the pair's vocabularies differ ({sizes[0]} and {sizes[1]}): set data.vocab_policy: slice")
    return min(sizes)


def offline_problems(config: CellConfig, vocabs: dict[str, int], features: bool) -> Problems:
    """teacher.mode offline: a store of the teacher's top-k over the stdlib text in bytes, or over the token file
    ``teacher.corpus`` names (:func:`corpus_problems`).  (Its keys under another mode are not the cell's: the plan
    leaves them out of its identity.)"""
    problems: Problems = []
    why_not = {
        ("method",): "teacher.mode offline stores the teacher's top-k next tokens, not its features: remove hidden_mse"
        if features
        else None,
        ("data", "tokenizers"): "teacher.mode offline reads the text its store holds, in bytes (both models' tokens): "
        "remove data.tokenizers"
        if config.data.tokenizers is not None
        else None,
        ("on_policy",): "teacher.mode offline stores the teacher on a fixed corpus; on_policy trains on the student's "
        "own completions, which no store holds: remove one"
        if config.on_policy is not None
        else None,
    }
    problems += [(path, why) for path, why in why_not.items() if why]
    vocab = min(vocabs.values()) if vocabs else None
    if config.teacher.corpus is not None:
        problems.extend(corpus_problems(config, vocab))
    elif vocab is not None and vocab < 256:
        why = f"teacher.mode offline stores a corpus of bytes (ids up to 255), and the vocabulary has {vocab} entries"
        problems.append((("teacher", "mode"), why))
    if vocab is not None:
        try:
            resolve_indices(config.teacher.indices, vocab)
        except KdbenchError as exc:
            problems.append((("teacher", "indices"), str(exc)))
    return problems


def corpus_problems(config: CellConfig, vocab: int | None) -> Problems:
    """teacher.corpus: a token file that opens (memory-mapped), holds one batch of windows for every rank and the
    ``store_tokens`` asked for, and whose ids the store reads are within the pair's vocabulary."""
    t, seq_len = config.teacher, config.data.seq_len
    corpus = ("teacher", "corpus")
    try:
        file = open_tokens(t.corpus.path, t.corpus.dtype)  # type: ignore[union-attr]
    except TokenFileError as exc:
        return [(corpus, str(exc))]
    sequences = config.batch_size * config.world_size
    batch = sequences * seq_len + 1
    if file.tokens < batch:
        ranks = f" × world_size {config.world_size}" if config.world_size > 1 else ""
        why = (
            f"token file {file.path} holds {file.tokens} ids, fewer than one batch takes: batch_size "
            f"{config.batch_size}{ranks} windows of seq_len {seq_len} + 1 = {batch}; give a longer corpus or lower "
            "batch_size or data.seq_len"
        )
        return [(corpus, why)]
    n, _ = windows_needed(t.store_tokens, seq_len)
    if (why := store_tokens_beyond(config, file)) is not None:
        return [(("teacher", "store_tokens"), why)]
    if n < sequences:
        why = (
            f"teacher.store_tokens {t.store_tokens} makes {n} window(s) of seq_len {seq_len}, fewer than one batch's "
            f"{sequences}; raise it to at least {sequences * seq_len}"
        )
        return [(("teacher", "store_tokens"), why)]
    try:
        scan_tokens(file, windows_needed(t.store_tokens, seq_len)[1], vocab)
    except TokenFileError as exc:
        return [(corpus, str(exc))]
    return []


def store_tokens_beyond(config: CellConfig, file: TokenFile) -> str | None:
    """Why ``teacher.store_tokens`` asks for more windows than the token file holds (None: it does not)."""
    seq_len, asked = config.data.seq_len, config.teacher.store_tokens
    _, need = windows_needed(asked, seq_len)
    if file.tokens >= need:
        return None
    most = (file.tokens - 1) // seq_len * seq_len
    return (
        f"teacher.store_tokens {asked}: token file {file.path} holds {file.tokens} ids, fewer than the {need} its "
        f"windows of seq_len + 1 take; lower store_tokens to at most {most}"
    )
