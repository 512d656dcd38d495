"""Causal language models: teacher and student built from transformers' classes with random weights
(:mod:`kdbench.models.lm`), distilled on seeded token batches through their next-token distributions,
served by prefill and greedy decoding with a KV cache.

The models.  Each is wrapped in :class:`~kdbench.models.lm.CausalLM`, whose forward returns the final
hidden states (B, S, H): the LM head is applied in the loss phase (:class:`~kdbench.distill.lm.loss.LMLoss`,
handed the vocabulary both models share), by the cell's ``loss_impl`` (:mod:`kdbench.distill.lm.impls`), so
that dense and fused implementations time and hold the same work (heads and loss together).  A
``module:callable`` may return a transformers causal LM (wrapped the same way) or any module mapping token
ids to logits (then only ``loss_impl: dense`` can run).

The batch.  ``batch_size`` sequences of ``data.seq_len`` token ids, uniform over the vocabulary both
models share, from the cell's seed; the labels are the next tokens, with the first
``prompt_fraction`` of each sequence (and its last position, which has no next token) set to -100:
not counted in any loss.

This module holds the LM workload (:class:`LMWorkload`) and its own helpers (the step row's accuracy ledger and
extra FLOPs); its plan checks are :mod:`.checks`', serving :mod:`.serving`'s and :mod:`.speculative`'s, the token
batch :mod:`kdbench.data.tokens`', the decoding :mod:`kdbench.models.generation`'s.
"""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn

from kdbench.config.schema import CellConfig
from kdbench.core.errors import KdbenchError
from kdbench.core.fakes import carry, known_values
from kdbench.core.names import IGNORE_INDEX, Measurement
from kdbench.core.schema import Row
from kdbench.data.tokens import prompt_length, token_batch
from kdbench.distill.lm.impls import unavailable, unsupported
from kdbench.distill.lm.impls.base import get_impl
from kdbench.distill.lm.loss import LMLoss, methods_token_loss
from kdbench.distill.losses import check_method, check_weights
from kdbench.hw.backends import Backend
from kdbench.measure import walltime
from kdbench.measure.failures import error_text
from kdbench.measure.flops import count_flops
from kdbench.measure.levers import eager
from kdbench.models import ModelCache
from kdbench.models.generation import sample
from kdbench.models.hub import is_callable_name
from kdbench.models.lm import CausalLM, build_lm, is_lm_model, layer_stack, make_lm, max_positions, registered_lm
from kdbench.models.meta import lm_facts
from kdbench.workloads.base import (
    Pair,
    Problems,
    Workload,
    encoder_methods,
    model_of,
    serving_plan,
)
from kdbench.workloads.lm import checks as lm_checks
from kdbench.workloads.lm.checks import generation_label, shared_vocab
from kdbench.workloads.lm.serving import measure_serving
from kdbench.workloads.lm.speculative import measure_speculative, planned_speculative
from kdbench.workloads.lm.xtok import cross_tokenizer, paired_step, student_ids, text_token_batch, tokenizer_columns
from kdbench.workloads.model_checks import facts_of, feature_problems, unused_features
from kdbench.workloads.placement import (
    HostFootprint,
    ModelBuild,
    counted,
    fresh_model,
    pair_footprint,
    receive_from_rank0,
    serving_builds,
    step_builds,
)

DEFAULT_LAYERS = 4  # hidden_mse pairs at most this many decoder layers by default


class LMWorkload(Workload):
    family = "lm"
    a_pair = "an LM pair"
    pairs = "LM pairs"
    cell_defaults: ClassVar[dict[str, Any]] = {"data": {"kind": "tokens"}, "method": "forward_kl"}
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
            "inference.speculative",
            "generation",
            "data.prompt_fraction",
            "data.vocab_policy",
            "data.tokenizers",
            "overrides",
        }
    )
    quality_data = "text"

    # ------------------------------------------------------------------ plan time

    def check(self, config: CellConfig, allow_imports: bool) -> Problems:
        problems: Problems = []
        roles = []
        for role in ("teacher", "student"):
            name = getattr(config.pair, role)
            overrides = getattr(config.overrides, role)
            if is_callable_name(name) and overrides:
                problems.append((("overrides", role), f"overrides apply to registered LMs, not to {name!r}"))
            elif is_callable_name(name) or is_lm_model(name):
                roles.append(role)
            else:
                problems.append((("pair", role), _not_an_lm(name)))
        facts, built = facts_of(config, tuple(roles), self.family, allow_imports)
        problems += built
        configs = {role: f.config for role, f in facts.items() if f.config is not None}
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
        problems += lm_checks.vocab_problems(config, facts) + lm_checks.prompt_problems(config)
        problems += lm_checks.head_problems(config, facts) + lm_checks.generation_problems(config, facts)
        problems += lm_checks.speculative_problems(config, facts)
        problems += lm_checks.backend_problems(config)
        vocabs = {role: f.vocab for role, f in facts.items() if f.vocab is not None}
        try:
            methods = check_method(config.method)
            check_weights(config.method, config.weights)
        except KdbenchError:
            return problems  # the plan reports the method itself
        if encoder_methods(methods, "causal LMs"):
            return problems + encoder_methods(methods, "causal LMs")
        image = [m.name for m in methods if m.cls.domain != "lm"]
        if image:
            problems.append(
                (
                    ("method",),
                    f"{', '.join(image)}: image-classifier method(s) (logits over classes, feature maps); on a "
                    "language-model pair use forward_kl, reverse_kl, jsd, tvd, skew_fkl, skew_rkl, uld or hidden_mse "
                    "(`kdbench list methods`)",
                )
            )
            return problems
        tokens = [m for m in methods if getattr(m.cls, "divergence", "")]
        aligned = lm_checks.aligned_problems(config, methods)
        if aligned is not None:  # uld, or a cell whose sides tokenize differently: its own checks
            return problems + aligned
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
        if config.teacher.mode in ("topk_cache", "offline"):
            problems.extend(lm_checks.topk_problems(config, tokens, vocabs))
        if config.teacher.mode == "offline":
            features = any(m.cls.needs_features for m in methods)
            problems.extend(lm_checks.offline_problems(config, vocabs, features))
        if config.on_policy is not None:
            problems.extend(lm_checks.on_policy_problems(config, tokens, configs))
        if any(m.cls.needs_features for m in methods):
            problems.extend(feature_problems(config, facts, DEFAULT_LAYERS, "decoder layers"))
        problems.extend(unused_features(config, methods))
        if config.parallel == "fsdp" and any(is_callable_name(getattr(config.pair, r)) for r in ("teacher", "student")):
            why = "parallel fsdp shards registered LMs and config.json models layer by layer, not module:callable ones"
            problems.append((("parallel",), why))
        return problems

    def planned(self, config: CellConfig) -> list[tuple[Measurement, int]]:
        student = (Measurement.STUDENT_PREFILL, Measurement.STUDENT_DECODE)
        serving = serving_plan(config, student, (Measurement.TEACHER_PREFILL, Measurement.TEACHER_DECODE))
        return serving + planned_speculative(config)

    def on_policy(self, distiller: Any, config: CellConfig):
        """GKD's on-policy batch: each sequence's prompt (its first ``data.prompt_fraction``) completed by
        ``on_policy.new_tokens`` tokens the student samples (eval mode, no gradients, its KV cache, a generator
        seeded from the cell's seed and advanced step by step); the labels are the completion's tokens."""
        if config.on_policy is None:
            return None
        settings = config.on_policy
        prompt_len = prompt_length(config)
        device = distiller.student.lm.device if hasattr(distiller.student.lm, "device") else torch.device("cpu")
        generator = torch.Generator(device=device).manual_seed(config.seed)  # on the device: sampling never syncs

        buffers: dict[str, torch.Tensor] = {}
        generation = config.generation
        store: dict = {}  # the phase's static cache and compiled decode step: let go with this closure
        vocab = distiller.loss_fn.id_vocab  # the ids both models read (data.vocab_policy): the student samples there

        def generate(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            labels = buffers.get("labels")
            lm = distiller.student.lm
            was_training = lm.training
            lm.eval()
            try:
                with torch.no_grad(), distiller.student_ac.context(distiller.device_type):
                    prompt, temperature = x[:, :prompt_len], settings.temperature
                    ids = sample(lm, prompt, settings.new_tokens, temperature, generator, vocab, generation, store)
            finally:
                lm.train(was_training)
            if labels is None or labels.shape != ids.shape:  # one buffer, rewritten: the loss finds its rows once
                buffers["labels"] = torch.full_like(ids, IGNORE_INDEX)
            out = buffers["labels"]
            out[:, prompt_len - 1 : -1] = ids[:, prompt_len:]  # each completion token, predicted one position early
            if known_values(x) is not None:  # a fit's fake run: which labels count is known without their values
                carry(out, partial(_counted_completions, out.shape, prompt_len))
            return ids, out

        return generate

    def skip_reason(self, config: CellConfig, backend: Backend) -> str | None:
        if config.parallel == "fsdp" and config.world_size > 1:
            from kdbench.measure.parallel import fully_shard_api

            if fully_shard_api() is None:
                return f"parallel fsdp needs FSDP2's fully_shard, which torch {torch.__version__} lacks (torch >= 2.6)"
            if config.fsdp.cpu_offload and backend.device_type != "cuda":
                return "fsdp.cpu_offload moves a GPU's shards to host memory; on the CPU there is nothing to offload"
        return unavailable(config.loss_impl)

    def tokens(self, measurement: Measurement, batch_size: int, config: CellConfig) -> int | None:
        if measurement == Measurement.DISTILL_STEP and config.on_policy is not None:  # prompt + completion
            return batch_size * (prompt_length(config) + config.on_policy.new_tokens)
        if measurement in (Measurement.STUDENT_DECODE, Measurement.TEACHER_DECODE, Measurement.SPECULATIVE_DECODE):
            return batch_size * config.inference.decode_tokens
        if measurement == Measurement.STUDENT_PREFILL and cross_tokenizer(config):
            # the student's own tokens of the text, padding included
            return student_ids(config, batch_size, torch.device("cpu"), config.seed + 1).numel()
        return batch_size * config.data.seq_len

    def config_columns(self, config: CellConfig) -> Row:
        return {
            "seq_len": config.data.seq_len,
            "loss_impl": config.loss_impl,
            "chunk_size": config.chunk_size if config.loss_impl not in ("dense", "natural") else None,
            "generation": generation_label(config.generation),
        }

    def model_overrides(self, config: CellConfig, role: str) -> dict[str, Any]:
        return dict(getattr(config.overrides, role))

    def layer_stacks(self, config: CellConfig) -> tuple[int, int] | None:
        t, s = (layer_stack(getattr(config.pair, r), getattr(config.overrides, r)) for r in ("teacher", "student"))
        return (t, s) if t is not None and s is not None else None

    # ------------------------------------------------------------------ the models

    def build_pair(self, config: CellConfig, backend: Backend, cache: ModelCache) -> Pair:
        builds = serving_builds(config) or step_builds(config)  # both whole on the device
        teacher, student = (self._model(config, b, backend, cache) for b in builds)
        return teacher, student

    def step_pair(self, config: CellConfig, backend: Backend, cache: ModelCache, dp: Any = None) -> Pair:
        """An FSDP2 cell's frozen teacher is built whole on rank 0's host and on ``meta`` elsewhere; once sharded, every
        rank's shards receive rank 0's weights (:mod:`kdbench.workloads.placement`): no rank holds a whole copy on
        its device, and only rank 0 one on the host (a ``module:callable`` teacher, which cannot be built on ``meta``,
        is built whole on every rank's host, as the user's code builds it).  The student goes to the device whole,
        as under DDP."""
        user = is_callable_name(config.pair.teacher)
        root = dp is None or dp.root
        teacher_build, student_build = step_builds(config, root or user)
        teacher = self._model(config, teacher_build, backend, cache)
        if teacher_build.sharded and dp is not None and not user:
            whole = {n: p.detach() for n, p in teacher.named_parameters()} if root else None
            receive = partial(receive_from_rank0, whole=whole, group=dp.group, device=backend.device)
            teacher.when_sharded(partial(receive, offload=config.fsdp.cpu_offload))
        return teacher, self._model(config, student_build, backend, cache)

    def _model(self, config: CellConfig, build: ModelBuild, backend: Backend, cache: ModelCache) -> CausalLM:
        name, overrides = getattr(config.pair, build.role), getattr(config.overrides, build.role)
        allow = getattr(cache, "allow_imports", False)
        key = ("lm", name, repr(sorted(overrides.items())), config.seed)
        nbytes = None if is_callable_name(name) else 4 * lm_counts(name, overrides)[0]
        return fresh_model(
            config,
            build,
            backend.device,
            cache,
            key,
            nbytes,
            lambda: make_lm(name, overrides, allow),
            lambda device, dtype: build_lm(name, overrides or None, device=device, dtype=dtype),
            CausalLM,
        )

    def host_footprint(self, config: CellConfig, device_type: str) -> HostFootprint:
        def count(role: str) -> tuple[int, int] | None:
            name = getattr(config.pair, role)
            return None if is_callable_name(name) else lm_counts(name, getattr(config.overrides, role))

        return pair_footprint(config, device_type, count)

    def step_keeps_pair(self, config: CellConfig) -> bool:
        return config.parallel != "fsdp"  # the step sharded the pair in place: serving builds whole copies

    # ------------------------------------------------------------------ the step

    def batch(
        self, config: CellConfig, batch_size: int, device: torch.device, seed: int, models: Pair
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if config.data.tokenizers is not None:  # real text, each model's own tokens: the teacher's here
            return text_token_batch(config, batch_size, device, seed)
        vocab = shared_vocab(config, *models)
        return token_batch(batch_size, config.data.seq_len, vocab, config.data.prompt_fraction, seed, device, config)

    def paired_batch(self, distiller: Any, config: CellConfig):
        """A cross-tokenizer cell's ``align`` phase (:func:`kdbench.workloads.lm.xtok.paired_step`); None otherwise."""
        return paired_step(config, distiller.fixed_input) if cross_tokenizer(config) else None

    def plan_notes(self, config: CellConfig) -> list[str]:
        note = lm_checks.uld_note(config)
        return [note] if note else []

    def feature_paths(self, teacher: nn.Module, student: nn.Module, example: torch.Tensor, config: CellConfig) -> Any:
        from kdbench.distill.hooks import layer_pairs

        given_t, given_s = config.features.teacher, config.features.student
        if not (given_t or teacher.decoder_layers()) or not (given_s or student.decoder_layers()):
            raise KdbenchError("hidden_mse: found no decoder layers; name them in features.teacher / features.student")
        return layer_pairs(teacher.decoder_layers(), student.decoder_layers(), given_t, given_s, DEFAULT_LAYERS)

    def loss(
        self, config: CellConfig, shapes: Any, teacher: nn.Module, student: nn.Module, backend: Backend
    ) -> nn.Module:
        return LMLoss(config, shapes, teacher, student, backend, shared_vocab(config, teacher, student))

    def compact_teacher(self, distiller: Any, outputs: Any, targets: torch.Tensor) -> tuple[Any, Row, Any]:
        """teacher.mode topk_cache: the teacher's top-k next-token log-probabilities at the loss's temperature
        (its logits are made once, whole, for this), with their bytes per token; and, as the diagnostic called
        once the build is timed, what they lose (the KL of the dense distribution against the cache's
        reconstruction: another pass over the logits, with host syncs, which no user's cache build pays)."""
        from kdbench.distill.lm.topk import build_topk, reconstruction_kl

        loss = distiller.loss_fn
        with torch.no_grad():
            logits = loss.teacher.logits(outputs.logits, loss.dtypes[0], loss.vocab)
        cache = build_topk(logits, distiller.config.teacher.k, loss.token.temperature)

        def diagnose() -> Row:
            return {"topk_reconstruction_kl": reconstruction_kl(logits, cache, targets != IGNORE_INDEX)}

        return cache, {"teacher_cache_bytes_per_token": cache.bytes_per_token}, diagnose

    def offline_teacher(self, distiller: Any, config: CellConfig, run_dir: str | None, dp: Any = None) -> Any:
        """teacher.mode offline: the store (built or resumed here; by rank 0 of a data-parallel cell, ``dp``) and its
        prefetching reader, each rank reading its own batches (:mod:`kdbench.workloads.lm.offline`); in a fit's fake
        run, the read buffers alone."""
        from torch._subclasses.fake_tensor import is_fake

        from kdbench.workloads.lm.offline import FakeOfflineTeacher, OfflineTeacher

        if is_fake(distiller.fixed_input):
            return FakeOfflineTeacher(distiller, config)
        return OfflineTeacher(distiller, config, run_dir, dp)

    def step_columns(self, step: Any, config: CellConfig, x: torch.Tensor) -> tuple[Row, tuple[str, ...]]:
        loss = step.distiller.loss_fn
        memory = loss.logits_memory(x.numel())
        row = Row(
            {
                "seq_len": config.data.seq_len,
                "vocab_size": loss.vocab,
                "loss_impl": config.loss_impl,
                "chunk_size": config.chunk_size if config.loss_impl not in ("dense", "natural") else None,
                "logits_memory_bytes": memory["bytes"],
                "logits_buffers": memory["text"],
                "extra_flops": loss_extra_flops(loss),
                "data_ptr_mod64": x.data_ptr() % 64,
                "loss_objective": loss.objective,
                **tokenizer_columns(config),
                **step.cache_columns,
                **(step.offline.columns() if getattr(step, "offline", None) is not None else {}),
            }
        )
        ledger, notes = accuracy_ledger(step)
        row.update(ledger)
        return row, (*loss.notes, *self.plan_notes(config), *notes)

    # ------------------------------------------------------------------ serving

    def serve(
        self,
        measurement: Measurement,
        batch_size: int,
        pair: Pair,
        config: CellConfig,
        backend: Backend,
        budget_s: float | None,
    ) -> Row:
        if measurement == Measurement.SPECULATIVE_DECODE:  # both models: the teacher with the student as its draft
            return measure_speculative(self, measurement, pair, batch_size, config, backend, budget_s)
        _, model = model_of(measurement, pair)
        return measure_serving(self, measurement, model, pair, batch_size, config, backend, budget_s)


LM = LMWorkload()


def _not_an_lm(name: str) -> str:
    """Why ``name`` (no LM, no module:callable) cannot be in an LM pair."""
    from kdbench.models.registry import available_models

    if name in available_models():
        return (
            f"{name!r} is an image classifier and this cell is a language-model cell (data.kind: tokens or an LM "
            "partner): pair LMs with LMs (`kdbench list models`), or use image data"
        )
    try:
        registered_lm(name)
    except KdbenchError as exc:
        return str(exc)
    raise AssertionError(f"{name!r} is an LM")  # only called for names that are not


def _counted_completions(shape: torch.Size, prompt_len: int) -> torch.Tensor:
    """On-policy labels as the loss counts them: every completion token (its value aside), nothing else."""
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    labels[:, prompt_len - 1 : -1] = 0
    return labels


def lm_counts(name: str, overrides: dict[str, Any]) -> tuple[int, int]:
    """(parameters, elements of the largest) of LM ``name`` with ``overrides``, from the plan's model on ``meta``."""
    return counted(lm_facts(name, overrides, allow_imports=False), name)


def accuracy_ledger(step: Any) -> tuple[Row, list[str]]:
    """The step's accuracy ledger (:meth:`LMLoss.ledger`) on the last step's batch (the fixed batch; an on-policy
    step's last generated one): both models' forwards again, in the step's precisions and eagerly (a compiled model
    as well), then the loss twice.  Called once the timed loop is over, before the FLOPs and the live peak are
    taken (each resets what it measures), and counted apart in the wall-time split.  A ledger that raises is a
    note; the row's measurements stand."""
    distiller = step.distiller
    loss, x = distiller.loss_fn, distiller.last_input
    why = loss.ledger_skip() or (None if loss.last_labels is not None else "no step ran")
    if why is not None:
        return {}, [f"accuracy ledger not taken: {why}"]
    try:
        with walltime.spent(walltime.LEDGER), eager(), torch.no_grad():
            cached = step.cache is not None and step.config.teacher.mode == "cached"
            teacher = step.cache.logits if cached else distiller.teacher_outputs(x).logits
            with distiller.student_ac.context(distiller.device_type):  # its own tokens (data.tokenizers)
                student = distiller.trainee(getattr(distiller, "last_student_input", x))[0]
            extra = getattr(distiller, "last_extra", None) or {}
            return loss.ledger(student, teacher, loss.last_labels, extra.get("teacher_targets"), extra.get("alignment"))
    except Exception as exc:  # a diagnostic: its failure is data, never the row's
        return {}, [f"accuracy ledger failed: {error_text(exc)}"]


def loss_extra_flops(loss: LMLoss) -> int | None:
    """FLOPs the cell's loss implementation executes beyond dense's for the last step's shapes: its heads run on
    the masked tokens too (liger; torch_linear's cross-entropy), or a head runs twice (torch_linear's KL after its
    CE).  Both counted on meta tensors (:meth:`LMLoss.on_meta`); an implementation that cannot run there (liger
    reads a value back) is taken as dense over the rows its heads run on.  0 for dense; None where not counted
    (a top-k cached teacher, a model that returns its logits)."""
    dense = loss.on_meta("dense")
    if loss.impl == "dense" or dense is None or loss.topk:
        return 0 if loss.impl == "dense" and not loss.topk else None
    try:
        executed = count_flops(loss.on_meta(loss.impl))
    except RuntimeError:  # it reads a value back: dense over the rows its heads run on
        executed = count_flops(loss.on_meta("dense", every_row=not get_impl(loss.impl).valid_only))
    return max(0, executed - count_flops(dense))
