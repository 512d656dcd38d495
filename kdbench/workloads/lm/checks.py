"""The plan's checks of LM and encoder cells against their models, built on the meta device
(:mod:`kdbench.models.meta`): the override a model cannot take, feature paths the models have and pair as given,
LM heads a loss implementation and the vocabulary slicing can use, the vocabulary policy, the student's generation
for on-policy distillation, and a loss with at least one token in it.

Each function returns :data:`~kdbench.workloads.base.Problems` (setting path, message); a model whose facts are
not known (user code that cannot be built on meta) is left to the run.
"""

from __future__ import annotations

from typing import Any

from kdbench.core.errors import KdbenchError, did_you_mean
from kdbench.models.meta import ModelFacts, encoder_facts, lm_facts
from kdbench.workloads.base import Problems, config_problem

ROLES = ("teacher", "student")
Facts = dict[str, ModelFacts]


def model_problem(role: str, overrides: dict, exc: KdbenchError) -> tuple[tuple[str, ...], str]:
    """A model that cannot be built, at the key to change: the override at fault (``overrides.ROLE.FIELD``), else
    ``overrides.ROLE`` or ``pair.ROLE``."""
    field = getattr(exc, "field", None)
    if field is not None and field in overrides:
        return ("overrides", role, field), str(exc)
    return config_problem(role, overrides, exc)


def facts_of(config: Any, roles: tuple[str, ...], family: str, allow_imports: bool) -> tuple[Facts, Problems]:
    """The facts of the cell's ``roles`` models (LMs, or encoders with ``family`` "encoder"), built on meta, and the
    problems of those that cannot be built."""
    facts: Facts = {}
    problems: Problems = []
    for role in roles:
        name, overrides = getattr(config.pair, role), getattr(config.overrides, role)
        try:
            if family == "encoder":
                facts[role] = encoder_facts(name, overrides)
            else:
                facts[role] = lm_facts(name, overrides, allow_imports)
        except KdbenchError as exc:
            problems.append(model_problem(role, overrides, exc))
    return facts, problems


def feature_problems(config: Any, facts: Facts, most: int, layers: str) -> Problems:
    """``features.teacher`` / ``features.student`` of a feature method on a stack of layers: paths the wrapped
    models have, lists of one length when both are given, a list the other model's default layers can pair whole
    (it is never cut), and layers to pair when none are given (``most``: the default pairs at most this many;
    ``layers``: what the models' layers are called)."""
    given = {role: getattr(config.features, role) for role in ROLES}
    known = {role: f for role, f in facts.items() if f.known}
    problems: Problems = []
    for role, f in known.items():
        name = getattr(config.pair, role)
        for path in given[role] or ():
            if path not in f.modules:
                hint = did_you_mean(path, sorted(f.modules), n=1, quote=True)
                example = f" (its {layers}: '{f.layers[0]}' ... '{f.layers[-1]}')" if f.layers else ""
                why = f"{name} has no module '{path}'{example}; {hint}give paths as named_modules() lists them"
                problems.append((("features", role), why))
    if problems:
        return problems
    t, s = given["teacher"], given["student"]
    if t and s and len(t) != len(s):
        why = f"features.teacher lists {len(t)} modules and features.student {len(s)}: they are paired in order; "
        return [(("features",), why + "give both the same number")]
    for role, other in (("teacher", "student"), ("student", "teacher")):
        f = known.get(other)
        if given[role] and not given[other] and f is not None:
            k = min(len(f.layers), most)
            if len(given[role]) > k:
                why = (
                    f"features.{role} lists {len(given[role])} modules, and the {other}'s default is {k} of its "
                    f"{layers}: {len(given[role]) - k} of yours would go unpaired; give features.{other} too, or "
                    f"list at most {k}"
                )
                problems.append((("features", role), why))
    for role, f in known.items():
        if not given[role] and not f.layers:
            why = f"{getattr(config.pair, role)} has no {layers} to pair; name its modules in features.{role}"
            problems.append((("features", role), why))
    return problems


def unused_features(config: Any, methods: list) -> Problems:
    """``features`` given to a cell whose method pairs no layers: refused, not ignored."""
    given = [role for role in ROLES if getattr(config.features, role)]
    if not given or any(m.cls.needs_features for m in methods):
        return []
    why = (
        f"features.{given[0]} names layers for a feature method (hidden_mse) to pair, and method {config.method} "
        f"pairs none: remove features, or add the feature method (e.g. {config.method}+hidden_mse)"
    )
    return [(("features",), why)]


def head_problems(config: Any, facts: Facts) -> Problems:
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


def vocab_problems(config: Any, facts: Facts) -> Problems:
    """The vocabularies under ``data.vocab_policy``: error refuses two sizes (slice cuts both heads to the
    smaller); a module:callable's is its logits' width."""
    vocabs = {role: f.vocab for role, f in facts.items() if f.vocab is not None}
    if config.data.tokenizers is not None:  # each model's vocabulary is its own tokenizer's
        return tokenizer_problems(config, vocabs)
    if config.data.vocab_policy == "pad":
        from kdbench.distill.lm.impls import pad_unsupported

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


def tokenizer_problems(config: Any, vocabs: dict[str, int]) -> Problems:
    """data.tokenizers: each model's vocabulary must be its tokenizer's size (every id it reads is a row of its
    embedding, every entry of its head a token); data.vocab_policy reconciles one set of token ids, not two."""
    from kdbench.workloads.lm.xtok import tokenizer_size

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


def aligned_problems(config: Any, methods: list) -> Problems | None:
    """uld, and cells whose models tokenize differently (data.tokenizers with two specs), which only uld trains:
    their problems (None: neither, the cell's other checks apply).  ULD stands alone (its CE and rows are each
    side's own positions; a divergence and hidden_mse pair one position of both models), under a loss_impl that
    computes it, with a live teacher; a cross-tokenizer cell runs on one device, without on-policy generation or
    speculative decoding (each would need the student's tokens read by the teacher)."""
    from kdbench.distill.lm.impls import uld_unsupported
    from kdbench.workloads.lm.xtok import cross_tokenizer

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


def uld_note(config: Any) -> str | None:
    """The note of a uld cell whose models share one tokenizer (no data.tokenizers, or one spec twice)."""
    from kdbench.distill.losses import check_method
    from kdbench.workloads.lm.xtok import cross_tokenizer

    try:
        methods = check_method(config.method)
    except KdbenchError:
        return None
    if cross_tokenizer(config) or not any(getattr(m.cls, "aligned_rows", False) for m in methods):
        return None
    return f"uld on a pair that shares one tokenizer: {ULD_NOTE}"


def generation_problems(config: Any, facts: Facts) -> Problems:
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


def backend_problems(config: Any) -> Problems:
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


def prompt_problems(config: Any) -> Problems:
    """A loss with tokens in it: off-policy, the prompt masks its share of each sequence and the last position has
    no next token, so a prompt of seq_len - 1 tokens leaves none; on-policy, the completions are the loss's tokens
    and each is sampled from a prompt of at least one token."""
    fraction, seq_len = config.data.prompt_fraction, config.data.seq_len
    prompt = min(round(fraction * seq_len), seq_len - 1)
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
