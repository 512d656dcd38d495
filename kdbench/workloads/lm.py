"""Causal language models: teacher and student built from transformers' classes with random weights
(:mod:`kdbench.models.lm`), distilled on seeded token batches through their next-token distributions,
served by prefill and greedy decoding with a KV cache.

The models.  Each is wrapped in :class:`CausalLM`, whose forward returns the final hidden states
(B, S, H): the LM head is applied in the loss phase, by the cell's ``loss_impl``
(:mod:`kdbench.distill.lm.impls`), so that dense and fused implementations time and hold the same
work (heads and loss together).  A ``module:callable`` may return a transformers causal LM (wrapped
the same way) or any module mapping token ids to logits (then only ``loss_impl: dense`` can run).

The batch.  ``batch_size`` sequences of ``data.seq_len`` token ids, uniform over the vocabulary both
models share, from the cell's seed; the labels are the next tokens, with the first
``prompt_fraction`` of each sequence (and its last position, which has no next token) set to -100:
not counted in any loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from kdbench.distill.lm.topk import TopKTeacher
from kdbench.distill.losses import WeightedTerms, check_method, check_weights, params_of
from kdbench.errors import KdbenchError
from kdbench.models.lm import is_lm_model
from kdbench.names import Measurement
from kdbench.schema import Row
from kdbench.workloads.base import Pair, Problems, Workload, cast_teacher_weights, model_of, serving_plan

IGNORE = -100
DEFAULT_LAYERS = 4  # hidden_mse pairs at most this many decoder layers by default


class CausalLM(nn.Module):
    """A causal LM whose forward is ids -> final hidden states; ``head`` is its LM head (None when the wrapped
    module only maps ids to logits)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
        self.hf = head is not None and hasattr(lm, "base_model") and lm.base_model is not lm
        self._head = (head,) if self.hf else (None,)  # a tuple: no second registration of the head's weights

    @property
    def head(self) -> nn.Module | None:
        return self._head[0]

    @property
    def vocab_size(self) -> int | None:
        if self.head is not None:
            return int(self.head.weight.shape[0])
        config = getattr(self.lm, "config", None)
        return getattr(config, "vocab_size", None)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.hf:
            out = self.lm(input_ids)
            return getattr(out, "logits", out)
        return self.lm.base_model(input_ids=input_ids, use_cache=False).last_hidden_state

    def decoder_layers(self) -> list[str]:
        """Module paths of the decoder layers, in order (the longest ModuleList of the model)."""
        lists = [(n, m) for n, m in self.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
        if not lists:
            return []
        name, layers = max(lists, key=lambda nm: len(nm[1]))
        return [f"{name}.{i}" for i in range(len(layers))]


# --------------------------------------------------------------------------- building


def build(name: str, overrides: dict[str, Any], allow_imports: bool) -> nn.Module:
    """The LM ``name`` (registered name, ``config.json`` path or ``module:callable``) with random weights."""
    from kdbench.models.lm import build_lm

    if ":" in name:
        from kdbench.models.registry import check_model_name

        check_model_name(name, allow_imports)
        module = _imported(name)
        if overrides:
            raise KdbenchError(f"overrides apply to registered LMs and config.json files, not to {name!r}")
        return module
    return build_lm(name, overrides or None)


def _imported(name: str) -> nn.Module:
    import importlib

    module_name, _, attr = name.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise KdbenchError(f"model {name!r}: cannot import it ({exc}); check the name and PYTHONPATH") from None
    model = obj() if callable(obj) and not isinstance(obj, nn.Module) else obj
    if not isinstance(model, nn.Module):
        raise KdbenchError(f"model {name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _config(name: str, overrides: dict[str, Any]):
    """The transformers config of a registered LM or config.json (None for module:callable)."""
    from kdbench.models.lm import _resolve_config

    if ":" in name:
        return None
    return _resolve_config(name, overrides or None)


def max_positions(config) -> int | None:
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) else None


# --------------------------------------------------------------------------- the workload


class LMWorkload(Workload):
    family = "lm"
    a_pair = "an LM pair"
    pairs = "LM pairs"
    takes = frozenset(
        {
            "parallel",
            "world_size",
            "teacher.weights",
            "teacher.mode",
            "on_policy",
            "loss_impl",
            "chunk_size",
            "inference.decode_tokens",
            "data.prompt_fraction",
            "data.vocab_policy",
            "overrides",
        }
    )
    quality_data = "text"

    # ------------------------------------------------------------------ plan time

    def check(self, config: Any, allow_imports: bool) -> Problems:
        from kdbench.distill.lm.impls import unsupported

        problems: Problems = []
        configs = {}
        for role in ("teacher", "student"):
            name = getattr(config.pair, role)
            overrides = getattr(config.overrides, role)
            if ":" in name:
                try:
                    from kdbench.models.registry import check_model_name

                    check_model_name(name, allow_imports)
                except KdbenchError as exc:
                    problems.append((("pair", role), str(exc)))
                if overrides:
                    problems.append((("overrides", role), f"overrides apply to registered LMs, not to {name!r}"))
                continue
            if not is_lm_model(name):
                from kdbench.models.registry import available_models

                if name in available_models():
                    problems.append(
                        (
                            ("pair", role),
                            f"{name!r} is an image classifier and this cell is a language-model cell (data.kind: "
                            "tokens or an LM partner): pair LMs with LMs (`kdbench list models`), or use image data",
                        )
                    )
                else:
                    from kdbench.models.lm import _check_name

                    try:
                        _check_name(name)
                    except KdbenchError as exc:
                        problems.append((("pair", role), str(exc)))
                continue
            try:
                configs[role] = _config(name, overrides)
            except KdbenchError as exc:
                key = ("overrides", role) if overrides and "override" in str(exc) else ("pair", role)
                problems.append((key, str(exc)))
        if problems:
            return problems
        if config.data.kind != "tokens":
            return [(("data", "kind"), "a language-model pair needs token data: set data.kind: tokens (and seq_len)")]
        need = config.data.seq_len + (config.inference.decode_tokens if config.inference.batch_sizes else 0)
        for role, c in configs.items():
            limit = max_positions(c)
            if limit is not None and need > limit:
                what = "data.seq_len" + (" + inference.decode_tokens" if config.inference.batch_sizes else "")
                problems.append(
                    (
                        ("data", "seq_len"),
                        f"{what} = {need} is beyond the {role} {getattr(config.pair, role)}'s {limit} positions; "
                        f"lower it, or raise max_position_embeddings in overrides.{role}",
                    )
                )
        vocabs = {role: int(c.vocab_size) for role, c in configs.items()}
        if len(vocabs) == 2 and vocabs["teacher"] != vocabs["student"] and config.data.vocab_policy == "error":
            problems.append(
                (
                    ("data", "vocab_policy"),
                    f"the teacher's vocabulary has {vocabs['teacher']} entries and the student's {vocabs['student']}: "
                    "set data.vocab_policy: slice (both heads cut to the smaller) or give both one vocab_size",
                )
            )
        try:
            methods = check_method(config.method)
            check_weights(config.method, config.weights)
        except KdbenchError:
            return problems  # the plan reports the method itself
        encoder = [m.name for m in methods if m.cls.domain == "encoder"]
        if encoder:
            why = f"{', '.join(encoder)}: an encoder method; it distils BERT-shaped encoders: pair two encoders"
            return [*problems, (("method",), f"{why} (`kdbench list models`), not causal LMs")]
        image = [m.name for m in methods if m.cls.domain != "lm"]
        if image:
            problems.append(
                (
                    ("method",),
                    f"{', '.join(image)}: image-classifier method(s) (logits over classes, feature maps); on a "
                    "language-model pair use forward_kl, reverse_kl, jsd, tvd, skew_fkl, skew_rkl or hidden_mse "
                    "(`kdbench list methods`)",
                )
            )
            return problems
        tokens = [m for m in methods if getattr(m.cls, "divergence", "")]
        if len(tokens) > 1:
            problems.append(
                (
                    ("method",),
                    f"{'+'.join(m.name for m in tokens)}: an LM cell takes one token-level divergence (combine it with "
                    "hidden_mse); for a mixture of the two KLs use jsd with beta",
                )
            )
            return problems
        why = unsupported(config.loss_impl, methods_token_loss(config))
        if why:
            problems.append((("loss_impl",), why))
        if config.teacher.mode == "topk_cache":
            problems.extend(_topk_problems(config, tokens, vocabs))
        if config.on_policy is not None:
            problems.extend(_on_policy_problems(config, tokens, configs))
        if config.parallel == "fsdp" and any(":" in getattr(config.pair, r) for r in ("teacher", "student")):
            why = "parallel fsdp shards registered LMs and config.json models layer by layer, not module:callable ones"
            problems.append((("parallel",), why))
        return problems

    def planned(self, config: Any) -> list[tuple[Measurement, int]]:
        student = (Measurement.STUDENT_PREFILL, Measurement.STUDENT_DECODE)
        return serving_plan(config, student, (Measurement.TEACHER_PREFILL, Measurement.TEACHER_DECODE))

    def on_policy(self, distiller: Any, config: Any):
        """GKD's on-policy batch: each sequence's prompt (its first ``data.prompt_fraction``) completed by
        ``on_policy.new_tokens`` tokens the student samples (eval mode, no gradients, its KV cache, a generator
        seeded from the cell's seed and advanced step by step); the labels are the completion's tokens."""
        if config.on_policy is None:
            return None
        from kdbench.workloads.lm_serving import sample

        settings = config.on_policy
        prompt_len = prompt_length(config)
        device = distiller.student.lm.device if hasattr(distiller.student.lm, "device") else torch.device("cpu")
        generator = torch.Generator(device=device).manual_seed(config.seed)  # on the device: sampling never syncs

        buffers: dict[str, torch.Tensor] = {}

        def generate(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            labels = buffers.get("labels")
            lm = distiller.student.lm
            was_training = lm.training
            lm.eval()
            try:
                with torch.no_grad(), distiller.student_ac.context(distiller.device_type):
                    ids = sample(lm, x[:, :prompt_len], settings.new_tokens, settings.temperature, generator)
            finally:
                lm.train(was_training)
            if labels is None or labels.shape != ids.shape:  # one buffer, rewritten: the loss finds its rows once
                buffers["labels"] = torch.full_like(ids, IGNORE)
            out = buffers["labels"]
            out[:, prompt_len - 1 : -1] = ids[:, prompt_len:]  # each completion token, predicted one position early
            return ids, out

        return generate

    def skip_reason(self, config: Any, backend: Any) -> str | None:
        from kdbench.distill.lm.impls import unavailable

        if config.parallel == "fsdp" and config.world_size > 1:
            from kdbench.measure.parallel import fully_shard_api

            if fully_shard_api() is None:
                return f"parallel fsdp needs FSDP2's fully_shard, which torch {torch.__version__} lacks (torch >= 2.6)"
            if config.fsdp.cpu_offload and backend.device_type != "cuda":
                return "fsdp.cpu_offload moves a GPU's shards to host memory; on the CPU there is nothing to offload"
        return unavailable(config.loss_impl)

    def tokens(self, measurement: Measurement, batch_size: int, config: Any) -> int | None:
        if measurement == Measurement.DISTILL_STEP and config.on_policy is not None:  # prompt + completion
            return batch_size * (prompt_length(config) + config.on_policy.new_tokens)
        if measurement in (Measurement.STUDENT_DECODE, Measurement.TEACHER_DECODE):
            return batch_size * config.inference.decode_tokens
        return batch_size * config.data.seq_len

    def config_columns(self, config: Any) -> Row:
        return {
            "seq_len": config.data.seq_len,
            "loss_impl": config.loss_impl,
            "chunk_size": config.chunk_size if config.loss_impl != "dense" else None,
        }

    def model_overrides(self, config: Any, role: str) -> dict[str, Any]:
        return dict(getattr(config.overrides, role))

    # ------------------------------------------------------------------ the models

    def build_pair(self, config: Any, backend: Any, cache: Any) -> Pair:
        allow = getattr(cache, "allow_imports", False)
        models = []
        for role in ("teacher", "student"):
            name, overrides = getattr(config.pair, role), getattr(config.overrides, role)
            key = ("lm", name, repr(sorted(overrides.items())), config.seed)
            model = cache.get_built(key, config.seed, lambda n=name, o=overrides: build(n, o, allow))
            wrapped = CausalLM(model)
            models.append((cast_teacher_weights(wrapped, config) if role == "teacher" else wrapped).to(backend.device))
        return models[0], models[1]

    def step_pair(self, config: Any, backend: Any, cache: Any) -> Pair:
        """An FSDP2 cell on a GPU keeps its teacher on the host: ``fully_shard`` moves each unit to the device as it
        shards it, so no rank ever holds the whole teacher on its device (the pair that does not fit one device is
        the point of sharding).  The student goes to the device whole, as under DDP."""
        if config.parallel != "fsdp" or backend.device_type == "cpu":
            return self.build_pair(config, backend, cache)
        from kdbench.hw.backends import Backend

        teacher, student = self.build_pair(config, Backend("cpu", torch.device("cpu")), cache)
        return teacher, student.to(backend.device)

    def step_keeps_pair(self, config: Any) -> bool:
        return config.parallel != "fsdp"  # the step sharded the pair in place: serving builds whole copies

    # ------------------------------------------------------------------ the step

    def batch(
        self, config: Any, batch_size: int, device: torch.device, seed: int, models: Pair
    ) -> tuple[torch.Tensor, torch.Tensor]:
        vocab = shared_vocab(config, *models)
        return token_batch(batch_size, config.data.seq_len, vocab, config.data.prompt_fraction, seed, device, config)

    def feature_paths(self, teacher: nn.Module, student: nn.Module, example: torch.Tensor, config: Any) -> Any:
        from kdbench.distill.hooks import layer_pairs

        given_t, given_s = config.features.teacher, config.features.student
        if not (given_t or teacher.decoder_layers()) or not (given_s or student.decoder_layers()):
            raise KdbenchError("hidden_mse: found no decoder layers; name them in features.teacher / features.student")
        return layer_pairs(teacher.decoder_layers(), student.decoder_layers(), given_t, given_s, DEFAULT_LAYERS)

    def loss(self, config: Any, shapes: Any, teacher: nn.Module, student: nn.Module, backend: Any) -> nn.Module:
        return LMLoss(config, shapes, teacher, student, backend)

    def compact_teacher(self, distiller: Any, outputs: Any, targets: torch.Tensor) -> tuple[Any, Row]:
        """teacher.mode topk_cache: the teacher's top-k next-token log-probabilities at the loss's temperature
        (its logits are made once, whole, for this), with their bytes per token and what they lose (the KL of
        the dense distribution against the cache's reconstruction)."""
        from kdbench.distill.lm.topk import build_topk, reconstruction_kl

        loss = distiller.loss_fn
        teacher = loss._models[0]
        with torch.no_grad():
            logits = _logits(teacher, outputs.logits, loss.dtypes[0])[..., : loss.vocab]
        cache = build_topk(logits, distiller.config.teacher.k, loss.token.temperature)
        kl = reconstruction_kl(logits, cache, targets != IGNORE)
        return cache, {"teacher_cache_bytes_per_token": cache.bytes_per_token, "topk_reconstruction_kl": kl}

    def step_columns(self, step: Any, config: Any, x: torch.Tensor) -> tuple[Row, tuple[str, ...]]:
        loss = step.distiller.loss_fn
        memory = loss.logits_memory(x.numel())
        row = Row(
            {
                "seq_len": config.data.seq_len,
                "vocab_size": loss.vocab,
                "loss_impl": config.loss_impl,
                "chunk_size": config.chunk_size if config.loss_impl != "dense" else None,
                "logits_memory_bytes": memory["bytes"],
                "logits_buffers": memory["text"],
                "data_ptr_mod64": x.data_ptr() % 64,
                **step.cache_columns,
            }
        )
        return row, tuple(loss.notes)

    # ------------------------------------------------------------------ serving

    def serve(
        self, measurement: Measurement, batch_size: int, pair: Pair, config: Any, backend: Any, budget_s: float | None
    ) -> Row:
        from kdbench.workloads.lm_serving import measure_serving

        _, model = model_of(measurement, pair)
        return measure_serving(self, measurement, model, pair, batch_size, config, backend, budget_s)


LM = LMWorkload()


def _on_policy_problems(config: Any, tokens: list, configs: dict) -> Problems:
    """on_policy: a live teacher scores what the student generated; a divergence to train on; positions enough."""
    problems: Problems = []
    if config.teacher.mode != "live":
        mode = config.teacher.mode
        why = f"on_policy: the teacher must score each step's new completions: teacher.mode live, not {mode}"
        problems.append((("teacher", "mode"), why))
    if not tokens:
        why = "on_policy trains on a divergence from the teacher on the student's completions: use e.g. method jsd"
        problems.append((("method",), why))
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


def _topk_problems(config: Any, tokens: list, vocabs: dict[str, int]) -> Problems:
    """teacher.mode topk_cache: the sparse forward KL on the student's dense logits, k within the vocabulary."""
    problems: Problems = []
    if [m.name for m in tokens] != ["forward_kl"]:
        problems.append(
            (
                ("method",),
                "teacher.mode topk_cache trains on the forward KL over the teacher's top-k tokens: use method "
                "forward_kl (optionally +hidden_mse)",
            )
        )
    if config.loss_impl != "dense":
        why = (
            "teacher.mode topk_cache computes its sparse KL on the student's logits: use loss_impl dense, "
            f"not {config.loss_impl}"
        )
        problems.append((("loss_impl",), why))
    vocab = min(vocabs.values()) if vocabs else None
    if vocab is not None and config.teacher.k > vocab:
        problems.append((("teacher", "k"), f"teacher.k {config.teacher.k} exceeds the vocabulary's {vocab} entries"))
    return problems


def methods_token_loss(config: Any):
    """The TokenLoss of the cell's token-level method (with CE at the smallest of its terms' weights)."""
    from kdbench.distill.lm.impls import TokenLoss

    methods = check_method(config.method)
    token = [m for m in methods if getattr(m.cls, "divergence", "")]
    ce = min(1.0 - params_of(config, m).alpha if m in token else 1.0 for m in methods)
    if not token:
        return TokenLoss(None, ce_weight=ce)
    term = token[0].cls(params_of(config, token[0]), None)
    return term.token_loss(float(config.weights.get(token[0].name, 1.0)), ce)


def shared_vocab(config: Any, teacher: nn.Module | None = None, student: nn.Module | None = None) -> int:
    """The vocabulary both models share (the smaller, under vocab_policy slice)."""
    sizes = []
    for role, model in (("teacher", teacher), ("student", student)):
        if model is not None and model.vocab_size is not None:
            sizes.append(model.vocab_size)
            continue
        c = _config(getattr(config.pair, role), getattr(config.overrides, role))
        if c is not None:
            sizes.append(int(c.vocab_size))
    if not sizes:
        raise KdbenchError("cannot tell the vocabulary size of the pair; give a transformers model")
    return min(sizes)


def prompt_length(config: Any) -> int:
    """Tokens of each sequence's prompt: ``prompt_fraction`` of ``seq_len`` (at least 1 on-policy, which samples
    from it; at most seq_len − 1)."""
    prompt = min(round(config.data.prompt_fraction * config.data.seq_len), config.data.seq_len - 1)
    return max(prompt, 1) if config.on_policy is not None else prompt


def token_batch(
    batch_size: int, seq_len: int, vocab: int, prompt_fraction: float, seed: int, device, config: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, S) and next-token labels (B, S), the prompt share and the last position -100."""
    from kdbench.hw.layout import place_aligned

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    labels = torch.full_like(ids, IGNORE)
    labels[:, :-1] = ids[:, 1:]
    prompt = min(round(prompt_fraction * seq_len), seq_len - 1)
    labels[:, :prompt] = IGNORE
    return place_aligned(ids.to(device), config.alignment), place_aligned(labels.to(device), config.alignment)


# --------------------------------------------------------------------------- the loss


class LMLoss(WeightedTerms):
    """ce_weight × CE(next tokens) + weight × alpha × the token-level divergence, computed with the LM heads by
    the cell's ``loss_impl``, + the feature terms (hidden_mse); the heads run at each model's precision, the
    loss in float32."""

    def __init__(self, config: Any, shapes: Any, teacher: CausalLM, student: CausalLM, backend: Any):
        super().__init__(config, shapes)
        from kdbench.hw.backends import choose_autocast

        self.token = methods_token_loss(config)
        self.features = [(w, t) for w, t in zip(self.weights, self.terms) if not getattr(t, "divergence", "")]
        self.impl, self.chunk_size = config.loss_impl, config.chunk_size
        self.topk = config.teacher.mode == "topk_cache"
        self._models = (teacher, student)  # not submodules: the trainee owns the student's head
        self.vocab = shared_vocab(config, teacher, student)
        self.notes: list[str] = []
        self._rows_of: torch.Tensor | None = None  # the labels tensor whose valid rows are kept, and those rows
        self._rows: torch.Tensor | None = None
        if teacher.vocab_size != student.vocab_size:
            self.notes.append(
                f"vocabularies {teacher.vocab_size} (teacher) and {student.vocab_size} (student): both heads sliced "
                f"to the first {self.vocab} entries"
            )
        if (student.head is None or teacher.head is None) and self.impl != "dense":
            raise KdbenchError(
                f"loss_impl {self.impl} needs the LM heads of transformers models; a module that returns logits "
                "runs with loss_impl: dense"
            )
        self.dtypes = tuple(
            _compute_dtype(choose_autocast(backend, p)) for p in (config.teacher_precision, config.precision)
        )

    def logits_memory(self, n_tokens: int) -> dict[str, Any]:
        from kdbench.distill.lm.impls import logits_memory

        size = torch.empty((), dtype=self.dtypes[1]).element_size()
        if self.topk:  # the student's logits whole and its float32 work: log q, the rest bucket's copy, gradients
            each = n_tokens * self.vocab
            shape = f"{n_tokens}×{self.vocab}"
            text = f"1 × {shape} {_dtype_name(self.dtypes[1])} (student logits) + 4 × {shape} fp32 (float32 work)"
            return {"bytes": each * (size + 4 * 4), "text": text}
        return logits_memory(self.impl, n_tokens, self.vocab, size, self.chunk_size, self.token)

    def valid_rows(self, labels: torch.Tensor) -> torch.Tensor:
        """The flattened indices of the tokens ``labels`` counts, found once per labels tensor: a timed cell's
        batch is fixed (an on-policy cell rewrites its completion labels in place, every position but the
        prompt's valid), so no step reads the labels back (a host-device sync on a GPU)."""
        from kdbench.distill.lm.impls import valid_rows

        if self._rows_of is not labels:
            self._rows_of, self._rows = labels, valid_rows(labels)
        return self._rows

    def forward(self, inp: Any) -> torch.Tensor:
        from kdbench.distill.lm.impls import lm_loss

        teacher, student = self._models
        t_dtype, s_dtype = self.dtypes
        labels = inp.targets
        rows = self.valid_rows(labels)
        autocast_off = torch.amp.autocast(device_type=labels.device.type, enabled=False)
        with autocast_off, _gathered(teacher, reshard=True), _gathered(student, reshard=False):
            if isinstance(inp.teacher_logits, TopKTeacher):  # the offline teacher: the sparse KL on its top-k
                s_logits = _logits(student, inp.student_logits, s_dtype)[..., : self.vocab]
                loss = _topk_loss(s_logits, inp.teacher_logits, labels, self.token, rows)
            elif student.head is None or teacher.head is None:  # a module that returns logits: dense on them
                s_logits = _logits(student, inp.student_logits, s_dtype)[..., : self.vocab]
                t_logits = _logits(teacher, inp.teacher_logits, t_dtype)[..., : self.vocab]
                loss = _dense_on_logits(s_logits, t_logits, labels, self.token, rows)
            else:
                sw, sb = _head(student.head, self.vocab, s_dtype)
                tw, tb = _head(teacher.head, self.vocab, t_dtype)
                loss = lm_loss(
                    self.impl,
                    inp.student_logits.to(s_dtype),
                    sw,
                    sb,
                    inp.teacher_logits.to(t_dtype),
                    tw,
                    tb,
                    labels,
                    self.token,
                    chunk_size=self.chunk_size,
                    rows=rows,
                )
            for weight, term in self.features:
                loss = loss + weight * term(inp)
        return loss


def _logits(model: CausalLM, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A model's logits from its forward's output: the output itself, or its head applied to it."""
    if model.head is None:
        return out
    weight, bias = _head(model.head, model.head.weight.shape[0], dtype)
    return torch.nn.functional.linear(out.to(dtype), weight, bias)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def _compute_dtype(choice: Any) -> torch.dtype:
    return choice.dtype if choice.applied and choice.dtype is not None else torch.float32


def _head(head: nn.Module, vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head's weight and bias, cut to ``vocab`` rows, at the compute dtype (autograd flows to the originals)."""
    weight = head.weight[:vocab].to(dtype)
    bias = head.bias[:vocab].to(dtype) if getattr(head, "bias", None) is not None else None
    return weight, bias


@contextlib.contextmanager
def _gathered(model: nn.Module, reshard: bool) -> Iterator[None]:
    """An FSDP2-sharded model's root parameters (embeddings, final norm, LM head) gathered for the loss, which
    applies the LM head outside the forward, where FSDP2 has resharded them; with ``reshard`` sharded again after
    (the teacher: no backward needs them), else left to FSDP2, whose backward reshards them once it has
    reduce-scattered their gradients (the student).  Nothing for a model FSDP2 does not shard."""
    root = getattr(model, "fsdp_root", (None,))[0]
    if root is None:
        yield
        return
    root.unshard()
    try:
        yield
    finally:
        if reshard:
            root.reshard()


def _ce(student: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with the next tokens, mean over the valid ones (their count from ``rows``, on the host)."""
    s = student.float()
    ce = torch.nn.functional.cross_entropy(
        s.reshape(-1, s.shape[-1]), labels.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return ce / max(rows.numel(), 1)


def _topk_loss(student: torch.Tensor, cache: Any, labels: torch.Tensor, token: Any, rows: torch.Tensor) -> torch.Tensor:
    from kdbench.distill.lm.topk import topk_forward_kl

    return token.ce_weight * _ce(student, labels, rows) + token.kd_weight * topk_forward_kl(student, cache, rows=rows)


def _dense_on_logits(
    student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, token: Any, rows: torch.Tensor
) -> torch.Tensor:
    """ce_weight × CE + kd_weight × the divergence, on whole logits (a module that returns them)."""
    from kdbench.distill.lm.impls import DIVERGENCES

    loss = token.ce_weight * _ce(student, labels, rows)
    if token.divergence:
        fn = DIVERGENCES[token.divergence]
        kwargs = {"beta": token.beta} if token.divergence == "jsd" else {}
        if token.divergence.startswith("skew"):
            kwargs = {"lam": token.lam}
        vocab = student.shape[-1]
        s, t = (x.reshape(-1, vocab).index_select(0, rows) for x in (student, teacher))
        loss = loss + token.kd_weight * fn(s, t, None, temperature=token.temperature, **kwargs)
    return loss


def analytic_forward_flops(model: CausalLM, batch_size: int, seq_len: int, with_head: bool = True) -> int:
    """The forward's FLOPs from the shapes, to cross-check the counted ones: 2 per multiply-add of every matmul
    weight (the decoder layers' and, ``with_head``, the LM head's; embeddings are lookups) for each token, plus
    attention's two S×S products per layer, 4·B·S²·H (the full square, as torch's flop counter counts SDPA)."""
    embeddings = {id(p) for m in model.lm.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    base = model.lm.base_model
    weights = {id(p): p for p in base.parameters() if p.dim() == 2 and id(p) not in embeddings}
    matmul = sum(p.numel() for p in weights.values()) + (model.head.weight.numel() if with_head else 0)
    config = model.lm.config
    tokens = batch_size * seq_len
    return 2 * matmul * tokens + 4 * batch_size * int(config.num_hidden_layers) * seq_len**2 * int(config.hidden_size)
