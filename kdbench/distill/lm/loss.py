"""A language-model cell's whole loss: the token-level term computed with the LM heads by the cell's
``loss_impl``, plus the feature terms (``hidden_mse``); or ULD's (``uld``): the CE on the student's own tokens
and the ULD term of the two heads, each over its own vocabulary, on rows paired by position after the prompt
(:mod:`kdbench.distill.lm.uld`).

The models are :class:`~kdbench.models.lm.CausalLM` s, whose forward returns the final hidden states: the
heads are applied here, in the loss phase, by the implementation (:mod:`kdbench.distill.lm.impls`), so
dense and fused implementations time and hold the same work.  A model that returns its logits (a
``module:callable`` that is no transformers model) runs the dense token loss on them; the offline teacher
(``teacher.mode: topk_cache``) the sparse forward KL of :mod:`kdbench.distill.lm.topk`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kdbench.core.errors import KdbenchError
from kdbench.core.fakes import known_values, with_values
from kdbench.distill.lm.divergences import TokenLoss
from kdbench.distill.lm.impls import impl_note, lm_loss, uld_lm_loss
from kdbench.distill.lm.impls.chunks import valid_rows
from kdbench.distill.lm.impls.dense import cross_entropy, token_loss
from kdbench.distill.lm.impls.memory import logits_memory
from kdbench.distill.lm.ledger import LEDGER_TOKENS, ledger_tokens, loss_ledger, objective_text
from kdbench.distill.lm.topk import TopKTeacher, topk_forward_kl
from kdbench.distill.lm.uld import Alignment, first_sequences, uld_alignment, uld_loss
from kdbench.distill.losses import WeightedTerms, check_method, params_of
from kdbench.models.lm import CausalLM

__all__ = ["LMLoss", "methods_token_loss"]


def methods_token_loss(config: Any) -> TokenLoss:
    """The TokenLoss of the cell's token-level method (with CE at the smallest of its terms' weights)."""
    methods = check_method(config.method)
    token = [m for m in methods if getattr(m.cls, "divergence", "")]
    weighed = [m for m in methods if m in token or _aligned(m.cls)]  # the terms that weigh CE with 1 − alpha
    ce = min(1.0 - params_of(config, m).alpha if m in weighed else 1.0 for m in methods)
    if not token:
        return TokenLoss(None, ce_weight=ce)
    term = token[0].cls(params_of(config, token[0]), None)
    return term.token_loss(float(config.weights.get(token[0].name, 1.0)), ce)


def _aligned(term: Any) -> bool:
    """A term on each side's own tokens, over rows paired by position (ULD)."""
    return bool(getattr(term, "aligned_rows", False))


class LMLoss(WeightedTerms):
    """ce_weight × CE(next tokens) + weight × alpha × the token-level divergence, computed with the LM heads by
    the cell's ``loss_impl``, + the feature terms (hidden_mse); the heads run at each model's precision, the
    loss in float32.  ``vocab``: the vocabulary both models share (the workload's; both heads are cut to it)."""

    def __init__(self, config: Any, shapes: Any, teacher: CausalLM, student: CausalLM, backend: Any, vocab: int):
        super().__init__(config, shapes)
        from kdbench.hw.backends import choose_autocast

        self.token = methods_token_loss(config)
        # ULD: weight × alpha × its term, each head whole (its own vocabulary); the plan lets it stand alone
        self.uld = [(w * t.params.alpha, t.params.temperature) for w, t in zip(self.weights, self.terms) if _aligned(t)]
        self.uld_alignment = next((t.params.alignment for t in self.terms if _aligned(t)), "position")
        feature_names = [
            n for n, t in zip(self.names, self.terms) if not getattr(t, "divergence", "") and not _aligned(t)
        ]
        self.features = [
            (w, t) for w, t in zip(self.weights, self.terms) if not getattr(t, "divergence", "") and not _aligned(t)
        ]
        self._alignment: tuple | None = None  # (student labels, teacher labels, their Alignment), found once
        self.impl, self.chunk_size = config.loss_impl, config.chunk_size
        self.topk = config.teacher.mode in ("topk_cache", "offline")  # the sparse KL on a stored top-k
        self._models = (teacher, student)  # not submodules: the trainee owns the student's head
        self.id_vocab = vocab  # the token ids both models read
        sizes = [m.vocab_size for m in (teacher, student) if m.vocab_size is not None]
        self.pad = config.data.vocab_policy == "pad" and len(set(sizes)) > 1 and not self.uld
        if self.uld and student.vocab_size is not None:  # each head whole: the row's vocabulary is the student's
            self.vocab = student.vocab_size
        else:  # the vocabulary both heads cover: the larger, the smaller head padded with -inf (pad); else shared
            self.vocab = max(sizes) if self.pad else vocab
        self.notes: list[str] = []
        self._rows_of: torch.Tensor | None = None  # the labels tensor whose valid rows are kept, and those rows
        self._rows: torch.Tensor | None = None
        self._heads: tuple | None = None  # the last lm_loss call's (shape, dtype, requires_grad) per input
        if self.pad:
            self.notes.append(
                f"vocabularies {teacher.vocab_size} (teacher) and {student.vocab_size} (student): the smaller head "
                f"padded with -inf logits to {self.vocab} entries (no entry dropped)"
            )
        elif teacher.vocab_size != student.vocab_size and not self.uld:
            self.notes.append(
                f"vocabularies {teacher.vocab_size} (teacher) and {student.vocab_size} (student): both heads sliced "
                f"to the first {self.vocab} entries"
            )
        if not self.topk and impl_note(self.impl):  # the top-k cache computes its own sparse loss
            self.notes.append(impl_note(self.impl))
        if (student.head is None or teacher.head is None) and self.impl != "dense":
            raise KdbenchError(
                f"loss_impl {self.impl} needs the LM heads of transformers models; a module that returns logits "
                "runs with loss_impl: dense"
            )
        self.dtypes = tuple(
            _compute_dtype(choose_autocast(backend, p)) for p in (config.teacher_precision, config.precision)
        )
        self.objective = objective_text(
            self.token,
            self.vocab,
            (teacher.vocab_size, student.vocab_size),
            [(w, n) for (w, _), n in zip(self.features, feature_names)],
            config.teacher.k if self.topk else None,
            "pad" if self.pad else "slice",
            self.uld,
            self.uld_alignment,
        )

    @property
    def teacher(self) -> CausalLM:
        return self._models[0]

    def logits_memory(self, n_tokens: int) -> dict[str, Any]:
        """The logits-sized buffers of the loss at its peak (:func:`~kdbench.distill.lm.impls.memory.logits_memory`)
        over the last step's tokens and valid tokens (an on-policy step's are its generated batch's), else over
        ``n_tokens``, every one valid."""
        size = torch.empty((), dtype=self.dtypes[1]).element_size()
        n_valid = None
        if self._rows is not None:
            n_tokens, n_valid = self._rows_of.numel(), self._rows.numel()
        if self.uld:  # two vocabularies over two sets of rows: not counted (kdbench.distill.lm.impls.memory)
            return {"bytes": None, "text": "not counted for uld"}
        if self.topk:  # the student's logits whole and its float32 work: log q, the rest bucket's copy, gradients
            each = n_tokens * self.vocab
            shape = f"{n_tokens}×{self.vocab}"
            text = f"1 × {shape} {_dtype_name(self.dtypes[1])} (student logits) + 4 × {shape} fp32 (float32 work)"
            return {"bytes": each * (size + 4 * 4), "text": text}
        return logits_memory(self.impl, n_tokens, self.vocab, size, self.chunk_size, self.token, n_valid)

    def on_meta(self, impl: str, every_row: bool = False) -> Callable[[], None] | None:
        """One forward and backward of the token loss computed by ``impl`` on meta tensors of the last step's
        shapes (no memory, no arithmetic: what FLOPs are counted on), over its valid rows (``every_row``: over every
        token); None before a step that ran the heads' loss (or where the loss is no head's)."""
        if self._heads is None or self._rows is None:
            return None
        shapes, n_rows = self._heads, self._rows_of.numel() if every_row else self._rows.numel()

        def run() -> None:
            heads = [
                None if s is None else torch.empty(s[0], dtype=s[1], device="meta", requires_grad=s[2]) for s in shapes
            ]
            rows = torch.empty(n_rows, dtype=torch.long, device="meta")
            loss = lm_loss(impl, *heads, self.token, chunk_size=self.chunk_size, rows=rows)
            if loss.requires_grad:
                loss.backward()

        return run

    @property
    def last_labels(self) -> torch.Tensor | None:
        """The labels of the last step (an on-policy step's: its generated batch's), None before a step."""
        return self._rows_of

    def ledger_skip(self) -> str | None:
        """Why :meth:`ledger` is not taken for this loss (None: it is)."""
        teacher, student = self._models
        if self.topk:
            return "the top-k cached teacher's sparse KL (its loss against the dense teacher: topk_reconstruction_kl)"
        if student.head is None or teacher.head is None:
            return "a model that returns its logits has no LM head to evaluate in float64"
        if student.fsdp_root is not None or teacher.fsdp_root is not None:
            return "an FSDP2-sharded pair (its heads are gathered by all ranks together, the ledger runs on rank 0)"
        return None

    def ledger(
        self,
        student_hidden: torch.Tensor,
        teacher_hidden: torch.Tensor,
        labels: torch.Tensor,
        teacher_labels: torch.Tensor | None = None,
        alignment: Alignment | None = None,
    ) -> tuple[dict[str, float | None], list[str]]:
        """The accuracy ledger of the token loss (:func:`~kdbench.distill.lm.ledger.loss_ledger`) on these inputs
        (their first :data:`~kdbench.distill.lm.ledger.LEDGER_TOKENS` counted tokens): the cell's ``loss_impl`` at
        its dtypes against ``dense`` in float64 on the same hidden states and the heads' own parameters upcast; the
        feature terms (hidden_mse) are not in it.  Its columns (empty where it is not taken) and notes (why not).
        Reads values back: call it outside every timed figure."""
        teacher, student = self._models
        why = self.ledger_skip()
        if why is not None:
            return {}, [f"accuracy ledger not taken: {why}"]
        if self.uld:  # each side's own tokens (teacher_labels: the teacher's, where its tokenizer is not the student's)
            t_labels = labels if teacher_labels is None else teacher_labels
            return self._uld_ledger(student_hidden, teacher_hidden, labels, t_labels, alignment)
        t_dtype, s_dtype = self.dtypes
        student_hidden, teacher_hidden, labels, rows = ledger_tokens(student_hidden, teacher_hidden, labels)
        autocast_off = torch.amp.autocast(device_type=labels.device.type, enabled=False)
        with autocast_off:
            cell = (
                student_hidden.to(s_dtype),
                *student.head_weights(self.vocab, s_dtype),
                teacher_hidden.to(t_dtype),
                *teacher.head_weights(self.vocab, t_dtype),
            )
            reference = (
                student_hidden,
                *student.head_weights(self.vocab, torch.float64),
                teacher_hidden,
                *teacher.head_weights(self.vocab, torch.float64),
            )
            return loss_ledger(self.impl, cell, reference, labels, self.token, self.chunk_size, rows)

    def valid_rows(self, labels: torch.Tensor) -> torch.Tensor:
        """The flattened indices of the tokens ``labels`` counts, found once per labels tensor: a timed cell's
        batch is fixed (an on-policy cell rewrites its completion labels in place, every position but the
        prompt's valid), so no step reads the labels back (a host-device sync on a GPU)."""
        if self._rows_of is not labels:
            self._rows_of, self._rows = labels, valid_rows(labels)
        return self._rows

    def alignment(self, inp: Any) -> Alignment:
        """The aligned rows of ULD: the step's (its align phase paired them), else found from both sides' labels
        once per pair of labels tensors (a fixed batch: no step reads the labels back)."""
        if inp.alignment is not None:
            return inp.alignment
        t_labels = inp.targets if inp.teacher_targets is None else inp.teacher_targets
        if self._alignment is None or self._alignment[0] is not inp.targets or self._alignment[1] is not t_labels:
            self._alignment = (inp.targets, t_labels, _paired(inp.targets, t_labels))
        return self._alignment[2]

    def _uld(self, inp: Any, rows: torch.Tensor) -> torch.Tensor:
        """ce_weight × CE(student, its own labels) + Σ weight × alpha × ULD, each head whole (its own
        vocabulary), computed by the cell's loss_impl (dense on the logits of a model that returns them)."""
        teacher, student = self._models
        t_dtype, s_dtype = self.dtypes
        labels, align = inp.targets, self.alignment(inp)
        t_labels = labels if inp.teacher_targets is None else inp.teacher_targets
        if student.head is None or teacher.head is None:
            s_logits = student.logits(inp.student_logits, s_dtype)
            t_logits = teacher.logits(inp.teacher_logits, t_dtype)
            loss = self.token.ce_weight * cross_entropy(s_logits, labels, rows.numel())
            for weight, temp in self.uld:
                loss = loss + weight * uld_loss(s_logits, t_logits, labels, t_labels, temp, temp)
            return loss
        sw, sb = student.head_weights(None, s_dtype)
        tw, tb = teacher.head_weights(None, t_dtype)
        hs, ht = inp.student_logits.to(s_dtype), inp.teacher_logits.to(t_dtype)
        return self._uld_heads(self.impl, hs, sw, sb, ht, tw, tb, labels, align, rows)

    def _uld_heads(self, impl: str, hs, sw, sb, ht, tw, tb, labels, align: Alignment, rows) -> torch.Tensor:
        """ce_weight × CE + Σ weight × alpha × ULD of the two heads, computed by ``impl``."""
        if self.token.has_ce:  # the student's own CE, by the same impl (its head stands in for the teacher's)
            ce_heads = (hs, sw, sb, hs.detach(), sw.detach(), None if sb is None else sb.detach(), labels)
            loss = lm_loss(impl, *ce_heads, self.token, chunk_size=self.chunk_size, rows=rows)
        else:
            loss = torch.zeros((), dtype=torch.float32, device=labels.device)
        for weight, temp in self.uld:
            term = uld_lm_loss(impl, hs, sw, sb, ht, tw, tb, align, temp, temp, self.chunk_size)
            loss = loss + weight * term
        return loss

    def _uld_ledger(
        self,
        student_hidden: torch.Tensor,
        teacher_hidden: torch.Tensor,
        labels: torch.Tensor,
        t_labels: torch.Tensor,
        alignment: Alignment | None = None,
    ) -> tuple[dict[str, float | None], list[str]]:
        """The ledger of a ULD loss: CE + ULD computed by the cell's impl at its dtypes against ``dense`` in float64,
        on the batch's first sequences whose aligned rows number at most LEDGER_TOKENS (at least one sequence), on
        the step's ``alignment`` (its align phase's, e.g. by bytes) or else by position."""
        teacher, student = self._models
        full = uld_alignment(labels, t_labels) if alignment is None else alignment
        per_seq = torch.bincount(full.sequence, minlength=labels.shape[0])
        k = max(1, int((per_seq.cumsum(0) <= LEDGER_TOKENS).sum()))
        labels, t_labels, hs, ht = labels[:k], t_labels[:k], student_hidden[:k], teacher_hidden[:k]
        align = uld_alignment(labels, t_labels) if alignment is None else first_sequences(alignment, k)
        rows = valid_rows(labels)
        t_dtype, s_dtype = self.dtypes
        autocast_off = torch.amp.autocast(device_type=labels.device.type, enabled=False)
        with autocast_off:
            cell = (
                hs.to(s_dtype),
                *student.head_weights(None, s_dtype),
                ht.to(t_dtype),
                *teacher.head_weights(None, t_dtype),
            )
            reference = (hs, *student.head_weights(None, torch.float64), ht, *teacher.head_weights(None, torch.float64))

            def objective(impl: str, *inputs: Any) -> torch.Tensor:
                return self._uld_heads(impl, *inputs, labels, align, rows)

            return loss_ledger(self.impl, cell, reference, labels, self.token, self.chunk_size, rows, objective)

    def forward(self, inp: Any) -> torch.Tensor:
        teacher, student = self._models
        t_dtype, s_dtype = self.dtypes
        labels = inp.targets
        rows = self.valid_rows(labels)
        autocast_off = torch.amp.autocast(device_type=labels.device.type, enabled=False)
        with autocast_off, _gathered(teacher, reshard=True), _gathered(student, reshard=False):
            if self.uld:
                loss = self._uld(inp, rows)
            elif isinstance(inp.teacher_logits, TopKTeacher):  # the offline teacher: the sparse KL on its top-k
                s_logits = student.logits(inp.student_logits, s_dtype, self.vocab)
                loss = self.token.ce_weight * cross_entropy(s_logits, labels, rows.numel())
                loss = loss + self.token.kd_weight * topk_forward_kl(s_logits, inp.teacher_logits, rows=rows)
            elif student.head is None or teacher.head is None:  # a module that returns logits: dense on them
                loss = token_loss(
                    _valid(student.logits(inp.student_logits, s_dtype, self.vocab), rows),
                    _valid(teacher.logits(inp.teacher_logits, t_dtype, self.vocab), rows),
                    labels.reshape(-1).index_select(0, rows),
                    self.token,
                )
            else:
                sw, sb = student.head_weights(self.vocab, s_dtype)
                tw, tb = teacher.head_weights(self.vocab, t_dtype)
                heads = (inp.student_logits.to(s_dtype), sw, sb, inp.teacher_logits.to(t_dtype), tw, tb, labels)
                self._heads = tuple(None if t is None else (t.shape, t.dtype, t.requires_grad) for t in heads)
                loss = lm_loss(self.impl, *heads, self.token, chunk_size=self.chunk_size, rows=rows)
            for weight, term in self.features:
                loss = loss + weight * term(inp)
        return loss


def _paired(student: torch.Tensor, teacher: torch.Tensor) -> Alignment:
    """ULD's alignment of two labels tensors; for a fit's fake labels (kdbench.fit), found on the values they
    carry and handed back as fake tensors carrying theirs (finding the rows reads values: ``nonzero``)."""
    if known_values(student) is None or known_values(teacher) is None:
        return uld_alignment(student, teacher)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        real = uld_alignment(known_values(student), known_values(teacher))
    parts = (real.student, real.teacher, real.weight, real.sequence)
    return Alignment(*(with_values(student.fake_mode.from_tensor(t), t) for t in parts))


def _valid(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The (n_valid, V) logits of the valid tokens, picked by index (no boolean mask: no host-device sync)."""
    return logits.reshape(-1, logits.shape[-1]).index_select(0, rows)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def _compute_dtype(choice: Any) -> torch.dtype:
    return choice.dtype if choice.applied and choice.dtype is not None else torch.float32


@contextlib.contextmanager
def _gathered(model: CausalLM, reshard: bool) -> Iterator[None]:
    """An FSDP2-sharded model's root parameters (embeddings, final norm, LM head) gathered for the loss, which
    applies the LM head outside the forward; with ``reshard`` sharded again after (the teacher: no backward frees
    them), else left to FSDP2, whose backward reshards them once it has reduce-scattered their gradients (the
    student).  A root's forward leaves its parameters gathered (torch's default for roots,
    :func:`kdbench.measure.parallel.shard`), so ``unshard`` is a no-op after it and each root is gathered once per
    step; it gathers only a root whose forward did not run this step (a cached teacher's).  Nothing for a model
    FSDP2 does not shard."""
    root = model.fsdp_root
    if root is None:
        yield
        return
    root.unshard()
    try:
        yield
    finally:
        if reshard:
            root.reshard()
