"""Quality on real text for language-model pairs: the standard library's own source, byte by byte.

``quality: {dataset: python-stdlib, ...}`` trains the suite's LM pairs on the ``.py`` files of the running interpreter's
standard library (``sysconfig.get_paths()["stdlib"]``): real text that ships with every Python, so nothing is
downloaded.

The corpus, its split by file, its byte windows and a student's BPE windows are :mod:`kdbench.data.text`'s (every
``.py`` file of the stdlib folder but those installed, tests and the build's configuration: :mod:`kdbench.data.corpus`);
``quality_corpus`` on each row names it, with a hash of its bytes.

The protocol is :mod:`kdbench.quality.protocol`'s (:class:`TextRun` is its run,
:class:`kdbench.quality.train.QualityRun`, with the language-model parts): per seed the teacher trains with next-byte
cross-entropy, each distinct student from scratch, and each student distilled from that seed's teacher by each of the
suite's LM methods through ``Distiller.train_step``, one recipe, one batch order per seed. The models are built with
``vocab_size: 256`` laid over the cells' ``overrides`` (forced, as the image protocol sets the classifiers' classes to
the data set's); a ``module:callable`` must have 256 outputs.

Each row records the held-out ``bits_per_byte`` (the total next-token cross-entropy in bits over the held-out bytes
predicted: comparable across tokenizers) and **perplexity** (exp of the mean next-token cross-entropy in nats per
held-out token predicted: per token of the row's ``tokenizer``) after the last epoch, the perplexity after every epoch
against the training time by then, next-byte top-1 ``accuracy``, ``agreement`` with the teacher's next-byte argmax, and
the time to quality: the training time until the bits per byte are at most the seed's teacher's + log2(1 / ``target``)
(for byte models: the perplexity at most the teacher's / ``target``).

A student with its own tokenizer (``data.tokenizers: {teacher: bytes, student: "bpe:<N>"}``, ``method: uld``;
:func:`kdbench.quality.own_tokens.check_tokenizers`): its BPE is trained on the training split's text only, once per run
(:func:`kdbench.data.text.train_split_tokenizer`); it is built with ``vocab_size`` N, trained from scratch on its own
tokens and distilled by uld from the seed's byte teacher on the same windows in the same order
(:meth:`TextRun.distil_across`), each window's first byte one token and the rest BPE-encoded, so it predicts exactly the
bytes the byte models predict (:func:`kdbench.data.text.bpe_windows`). Its accuracy and agreement are null (tokens of
different tokenizers) and it is no draft (the verification is token by token).  ULD pairs its positions with the
teacher's by the cell's ``uld.alignment`` (by position, the authors' form, or by the bytes read: the row's
``uld_alignment``, and ``uld_matched`` the share of its positions paired).

With ``quality.speculative`` each student's row also records it as the draft of its seed's teacher in speculative
decoding (:mod:`kdbench.quality.drafts`): the run keeps each student's model until its row is filled (and rebuilds it
from its checkpoint on a resume, as it does teachers).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kdbench.config.plan import config_dict
from kdbench.config.quality import QualityConfig
from kdbench.config.schema import CellConfig
from kdbench.core.errors import KdbenchError
from kdbench.core.names import IGNORE_INDEX
from kdbench.data.corpus import stdlib_root
from kdbench.data.text import BYTES, TextData, in_own_tokens, load_text, own_tokenizer, tokenizer_of, vocab_of
from kdbench.data.tokenizers import BPETokenizer, token_lengths
from kdbench.data.tokenizers import digest as tokenizer_digest
from kdbench.distill.losses import LossInputs, WeightedTerms
from kdbench.distill.step import backward_and_update, make_optimizer
from kdbench.hw.backends import AutocastChoice, Backend, choose_autocast, grad_scaler, math_mode
from kdbench.measure.failures import error_text
from kdbench.quality.checkpoints import Checkpoints
from kdbench.quality.drafts import DRAFT_ROW_KEYS, measure_draft
from kdbench.quality.drafts import describe as describe_draft
from kdbench.quality.own_tokens import check_tokenizers, model_overrides, paired_share, window_alignment
from kdbench.quality.train import DeviceData, QualityRun, Trained, ce_step, fit, init_seed

EVAL_TOKENS = 1 << 15  # held-out tokens per evaluation forward
logger = logging.getLogger(__name__)


def check_text(cfg: QualityConfig, configs: Iterable[CellConfig]) -> None:
    """The cheap checks, before anything runs: language-model cells, the windows within their positions."""
    from kdbench.models.lm import max_positions, model_config
    from kdbench.workloads import workload_of

    for c in configs:
        workload = workload_of(c)
        check_tokenizers(c)
        if workload.quality_data != "text":
            what = (
                "an image pair; use dataset digits, imagefolder or cifar"
                if workload.quality_data == "images"
                else f"of the {workload.family} family, not causal LMs"
            )
            raise KdbenchError(
                f"quality dataset {cfg.dataset} trains causal language models on text, and the pair "
                f"{c.pair.teacher} -> {c.pair.student} is {what}"
            )
        for role in ("teacher", "student"):
            name = getattr(c.pair, role)
            try:
                config = model_config(name, model_overrides(c, role))
            except KdbenchError:
                continue  # the cell's own checks report it
            limit = max_positions(config)
            if limit is not None and cfg.text_seq_len > limit:
                raise KdbenchError(
                    f"quality.seq_len {cfg.text_seq_len} is beyond the {role} {name}'s {limit} positions; lower it"
                )
            spec = cfg.speculative
            need = None if spec is None else spec.prompt_length(cfg.text_seq_len) + spec.new_tokens
            if need is not None and limit is not None and need > limit:
                raise KdbenchError(
                    f"quality.speculative: prompt_tokens + new_tokens = {need} is "
                    f"beyond the {role} {name}'s {limit} positions; lower new_tokens"
                )
    if not stdlib_root().is_dir():
        raise KdbenchError(f"the standard library folder {stdlib_root()} is not there; python-stdlib reads it")


def bits_per_byte(nats_per_token: float, tokens_per_byte: float = 1.0) -> float:
    """Bits per byte of the held-out text: the total next-token cross-entropy over the tokens that cover the bytes
    predicted, in bits, over those bytes; from the mean nats per predicted token and the predicted tokens per
    predicted byte (1 for the bytes)."""
    return nats_per_token * tokens_per_byte / math.log(2)


def reach_bits(result: Trained, threshold: float) -> tuple[float | None, int | None]:
    """(training seconds, 1-based epoch) at the end of the first epoch with bits per byte <= threshold."""
    for epoch, ((seconds, _), loss) in enumerate(zip(result.history, result.test_losses), 1):
        if bits_per_byte(loss, result.tokens_per_byte) <= threshold:
            return seconds, epoch
    return None, None


def text_columns(cfg: QualityConfig, c: CellConfig | None = None, role: str = "teacher") -> dict[str, Any]:
    """The text columns of a planned row (the corpus's are added once it is read; with ``speculative``, the draft
    columns, which a student's row fills); ``tokenizer``: the ``role`` model's of cell ``c`` (role teacher,
    scratch or distilled; student: either of the last two); a student distilled by uld: its ``uld_alignment``."""
    drafts = dict.fromkeys(DRAFT_ROW_KEYS) if cfg.speculative is not None else {}
    tokenizer = "bytes" if c is None else tokenizer_of(c, role)
    alignment = c.uld.alignment if c is not None and role == "distilled" and c.method == "uld" else None
    columns = {"seq_len": cfg.text_seq_len, "tokenizer": tokenizer, "uld_alignment": alignment}
    return dict.fromkeys(TEXT_ROW_KEYS) | columns | drafts


ACROSS_NOTE = (
    "its tokenizer is its own, not the teacher's bytes: accuracy and agreement are per token of different "
    "tokenizers, so null; compare bits_per_byte (perplexity is per token of its own tokenizer)"
)
DRAFT_ACROSS_NOTE = (
    "draft figures not measured: speculative decoding verifies the draft's tokens with the teacher's, and this "
    "student's tokenizer is not the teacher's"
)

TEXT_ROW_KEYS = (
    "tokenizer",
    "perplexity",
    "best_perplexity",
    "bits_per_byte",
    "perplexity_by_epoch",
    "train_time_by_epoch_s",
    "seq_len",
    "quality_corpus",
    "quality_train_tokens",
    "quality_test_tokens",
    "uld_alignment",
    "uld_matched",
)


# --------------------------------------------------------------------------- training and evaluation


def evaluate_text(
    model: nn.Module, data: DeviceData, choice: AutocastChoice, backend: Backend
) -> tuple[float, torch.Tensor, float]:
    """(next-token top-1 accuracy, the argmax per held-out position on the CPU, mean next-token cross-entropy in
    nats per predicted token), in eval mode under inference_mode; the model's mode is restored.  The tokens are the
    bytes, or a student's own (``data.num_classes`` of them), the labels of -100 (padding) not counted."""
    was_training = model.training
    model.eval()
    batch = max(1, EVAL_TOKENS // data.x_test.shape[1])
    total, count, preds = 0.0, 0, []
    try:
        with torch.inference_mode(), choice.context(backend.device_type):
            for i in range(0, len(data.x_test), batch):
                logits = model.logits(model(data.x_test[i : i + batch])).float()
                if logits.shape[-1] != data.num_classes:
                    raise KdbenchError(
                        f"the model has {logits.shape[-1]} outputs per token; its tokenizer has {data.num_classes}"
                    )
                y = data.y_test[i : i + batch].to(logits.device)
                total += float(
                    F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
                )
                count += int((y != IGNORE_INDEX).sum())
                preds.append(logits.argmax(dim=-1).flatten().cpu())
    finally:
        model.train(was_training)
    out = torch.cat(preds)
    accuracy = int((out == data.y_test.flatten()).sum()) / max(count, 1)
    return accuracy, out, total / max(count, 1)


def _perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))  # a diverged model: a huge but finite perplexity


class TextRun(QualityRun):
    """The quality protocol's run with language models on text: the data, the models and their record."""

    def __init__(
        self, cfg: QualityConfig, backend: Backend, allow_imports: bool, checkpoints: Checkpoints | None = None
    ):
        super().__init__(cfg, backend, allow_imports, checkpoints)
        self.text: TextData | None = None
        self.device_text: DeviceData | None = None
        self.own: dict[str, tuple[BPETokenizer, DeviceData, float]] = {}  # spec -> tokenizer, its data, tokens/byte
        self.lengths: dict[str, torch.Tensor] = {}  # spec -> its tokens' byte lengths (ULD by bytes)

    def data(self, c: CellConfig) -> DeviceData:
        """The byte windows on the device; for a cell whose student has its own tokenizer, the same windows in the
        student's tokens (the teacher's are the bytes: :meth:`byte_data`)."""
        spec = own_tokenizer(c)
        if spec is None:
            return self.byte_data()
        return self.own_tokenized(spec)[1]

    def own_tokenized(self, spec: str) -> tuple[BPETokenizer, DeviceData, float]:
        """The student's ``bpe:<N>`` tokenizer (trained on the training split once per run: one split serves every
        seed), the windows in its tokens, and its held-out tokens per predicted byte."""
        if spec not in self.own:
            self.byte_data()
            t = self.text
            assert t is not None
            began = time.perf_counter()
            tokenizer, tokens, ratio = in_own_tokens(t, spec)
            self.own[spec] = (tokenizer, self.to_device(tokens), ratio)
            logger.info(
                "quality: the student's tokenizer %s trained on the %d training bytes in %.1f s (sha256 %s): %.3f "
                "tokens per held-out byte",
                spec,
                t.corpus.train_bytes,
                time.perf_counter() - began,
                tokenizer_digest(tokenizer),
                ratio,
            )
        return self.own[spec]

    def byte_lengths(self, spec: str) -> torch.Tensor:
        """The ``spec`` tokens' byte lengths (V,), on the run's device: where the student's positions lie."""
        if spec not in self.lengths:
            self.lengths[spec] = torch.tensor(token_lengths(self.own_tokenized(spec)[0]), device=self.backend.device)
        return self.lengths[spec]

    def aligned(self, kind: str, spec: str, x: torch.Tensor, y: torch.Tensor, x_t: torch.Tensor, y_t: torch.Tensor):
        """ULD's rows of windows in the student's ``spec`` tokens (``x``, ``y``) and the teacher's bytes (``x_t``,
        ``y_t``), by the cell's ``uld.alignment`` ``kind`` (:mod:`kdbench.quality.own_tokens`)."""
        return window_alignment(kind, self.byte_lengths(spec), x, y, x_t, y_t)

    def uld_matched(self, kind: str, spec: str) -> float:
        """The share of the student's counted training positions that ULD's ``kind`` alignment pairs."""
        data, text = self.own_tokenized(spec)[1], self.byte_data()
        return paired_share(kind, self.byte_lengths(spec), data.x_train, data.y_train, text.x_train, text.y_train)

    def byte_data(self) -> DeviceData:
        if self.device_text is None:
            self.text = t = load_text(self.cfg, seed=0)
            self.device_text = self.to_device(t)
            spec = self.cfg.speculative
            if spec is not None and spec.prompts > len(t.x_test):
                raise KdbenchError(
                    f"quality.speculative.prompts {spec.prompts} is more than the {len(t.x_test)} held-out windows the "
                    "prompts are cut from; lower it or raise max_bytes"
                )
        return self.device_text

    def to_device(self, t: TextData) -> DeviceData:
        """The windows to train on on the run's device (the held-out labels stay on the host)."""
        dev, fmt = self.backend.device, torch.contiguous_format
        return DeviceData(t.x_train.to(dev), t.y_train.to(dev), t.x_test.to(dev), t.y_test, t.num_classes, fmt)

    @property
    def keeps_students(self) -> bool:
        return self.cfg.speculative is not None  # each is measured as a draft once trained

    def reused_times(self, role: str) -> str:
        if role == "teacher" or not self.keeps_students:
            return super().reused_times(role)
        return (
            "its training times are that invocation's; its draft figures (draft_*) are this invocation's, measured now"
        )

    def cell(self, c: CellConfig, seed: int) -> CellConfig:
        """The image protocol's cell, with each model's vocabulary over the overrides (:func:`model_overrides`) and
        the block's windows."""
        cell = super().cell(c, seed)
        overrides = cell.overrides.model_copy(update={r: model_overrides(c, r) for r in ("teacher", "student")})
        data = cell.data.model_copy(update={"seq_len": self.cfg.text_seq_len})
        return cell.model_copy(update={"overrides": overrides, "data": data})

    def model(self, name: str, cell: CellConfig, role: str) -> nn.Module:
        from kdbench.models.lm import CausalLM, make_lm

        overrides = getattr(cell.overrides, role)
        seed = init_seed(cell.seed, role)
        key = ("lm", name, repr(sorted(overrides.items())), seed)
        lm = self.cache.get_built(key, seed, lambda: make_lm(name, overrides, self.cache.allow_imports))
        model = CausalLM(lm).to(self.backend.device)
        want = vocab_of(cell, role)
        if model.vocab_size is not None and model.vocab_size != want:
            raise KdbenchError(f"{name} has a vocabulary of {model.vocab_size}; its tokenizer has {want}")
        return model

    def ce_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, choice: Any) -> Callable:
        return ce_step(model, optimizer, choice, self.backend, logits=lambda x: model.logits(model(x)))

    def fit(self, step: Callable, model: nn.Module, optimizer: Any, data: DeviceData, seed: int, choice: Any):
        def evaluate(m: nn.Module) -> tuple[float, torch.Tensor, float]:
            return evaluate_text(m, data, choice, self.backend)

        talk = self.talk
        out = fit(step, model, optimizer, data, self.cfg, self.backend, seed, choice, evaluate=evaluate, talk=talk)
        out.tokens_per_byte = self.tokens_per_byte(data)
        return out

    def tokens_per_byte(self, data: DeviceData) -> float:
        """Held-out tokens per predicted byte of the data a model trained on: 1 for the bytes."""
        return next((ratio for _, d, ratio in self.own.values() if d is data), 1.0)

    def train_ce(self, config: CellConfig, seed: int, role: str, key: Any) -> Trained | str:
        if role == "teacher" and own_tokenizer(config) is not None:  # the teacher reads the bytes
            config = config.model_copy(update={"data": config.data.model_copy(update={"tokenizers": None})})
        out = super().train_ce(config, seed, role, key)
        spec = own_tokenizer(config) if role != "teacher" else None
        if isinstance(out, Trained) and spec is not None:
            out.tokens_per_byte = self.own_tokenized(spec)[2]
        return out

    def distil(self, config: CellConfig, seed: int, teacher: Trained) -> Trained:
        """A fresh student distilled from ``teacher``: through ``Distiller.train_step`` where the two share the
        bytes; a student with its own tokenizer by :meth:`distil_across`."""
        spec = own_tokenizer(config)
        if spec is None:
            return super().distil(config, seed, teacher)
        out = self.distil_across(config, seed, teacher, spec)
        out.tokens_per_byte = self.own_tokenized(spec)[2]
        return out

    def distil_across(self, config: CellConfig, seed: int, teacher: Trained, spec: str) -> Trained:
        """The student of its own tokenizer ``spec`` distilled from the seed's byte-level teacher by the cell's
        method (uld: :func:`check_tokenizers`), one step per batch of windows: the teacher reads the windows'
        bytes, the student the same windows in its tokens (the same window indices, so the same text in the same
        order as every byte student of the seed); the loss is ce_weight x CE(student, its own next tokens) + the
        method's term on both sides' logits, each side with its own labels.  There is no prompt: every position
        with a label counts, and ULD pairs the i-th of the student's with the i-th of the teacher's, per window
        (``uld.alignment: position``), or each student position with the teacher's position that has read the
        same bytes of the window (``bytes``: :meth:`aligned`)."""
        cell = self.cell(config, seed)

        def train() -> tuple[Trained, nn.Module]:
            data, text = self.data(cell), self.byte_data()
            student = self.model(cell.pair.student, cell, "student")
            student.train()
            assert teacher.model is not None, "a seed's teacher is kept while its students train"
            teacher_model = copy.deepcopy(teacher.model).eval().requires_grad_(False)
            optimizer = make_optimizer(student.parameters(), cell.optimizer)
            choice = choose_autocast(self.backend, cell.precision)
            teacher_choice = choose_autocast(self.backend, cell.teacher_precision)
            terms = WeightedTerms(cell).to(self.backend.device)
            scaler = grad_scaler(self.backend, choice)
            device_type = self.backend.device_type
            kind = cell.uld.alignment

            def step(x: torch.Tensor, y: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
                assert indices is not None, "fit hands each batch's window indices"
                with torch.no_grad(), teacher_choice.context(device_type):
                    t_logits = teacher_model.logits(teacher_model(text.x_train[indices]))
                with choice.context(device_type):
                    s_logits = student.logits(student(x))
                with torch.amp.autocast(device_type=device_type, enabled=False):
                    t_y = text.y_train[indices]
                    align = self.aligned(kind, spec, x, y, text.x_train[indices], t_y)
                    inp = LossInputs(s_logits, t_logits, y, teacher_targets=t_y, indices=indices, alignment=align)
                    ce = F.cross_entropy(s_logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
                    loss = terms.ce_weight * ce
                    for weight, term in zip(terms.weights, terms.terms):
                        loss = loss + weight * term(inp)
                optimizer.zero_grad(set_to_none=True)
                backward_and_update(loss, optimizer, scaler)
                return loss.detach()

            with math_mode(choice.tf32):
                out = self.fit(step, student, optimizer, data, seed, choice)
            if self.keeps_students:
                out.model = student
            return out, student

        def rebuild(state: dict[str, torch.Tensor]) -> nn.Module:
            model = self.model(cell.pair.student, cell, "student")
            model.load_state_dict(state)
            return model.train()

        keep = rebuild if self.keeps_students else None
        return self.kept(seed, "distilled", config_dict(config), cell, train, teacher=teacher, rebuild=keep)

    def fill(self, row: dict[str, Any], result: Trained | str, reference: Trained | str | None) -> dict[str, Any]:
        spec = row.get("tokenizer")
        own = spec not in (None, "bytes")
        if self.text is not None:
            c = self.text.corpus
            row.update(
                quality_corpus=c.describe(),
                quality_train_tokens=int(self.text.y_train.numel()),
                quality_test_tokens=int(self.text.y_test.numel()),
            )
            if own and spec in self.own:
                tokenizer, data, _ = self.own[spec]
                row.update(
                    tokenizer=f"{spec} {tokenizer_digest(tokenizer)}",
                    quality_train_tokens=int((data.y_train != IGNORE_INDEX).sum()),
                    quality_test_tokens=int((data.y_test != IGNORE_INDEX).sum()),
                )
        if isinstance(result, str):
            return super().fill(row, result, reference)
        losses = result.test_losses
        row.update(
            accuracy=result.accuracy,
            best_accuracy=result.best_accuracy,
            train_time_s=result.train_time_s,
            perplexity=_perplexity(losses[-1]),
            best_perplexity=_perplexity(min(losses)),
            bits_per_byte=bits_per_byte(losses[-1], result.tokens_per_byte),
            perplexity_by_epoch=[_perplexity(v) for v in losses],
            train_time_by_epoch_s=[s for s, _ in result.history],
        )
        if own and spec in self.own and row.get("uld_alignment") is not None:  # the share of its positions ULD pairs
            row["uld_matched"] = self.uld_matched(row["uld_alignment"], spec)
        if own:  # its tokens are not the teacher's: no per-token comparison with it, no drafting for it
            row.update(accuracy=None, best_accuracy=None)
            size = str(spec).split(" ")[0].split(":")[1]
            self.note(row, f"built with vocab_size {size}, its tokenizer's, over the overrides; " + ACROSS_NOTE)
        if isinstance(reference, Trained):
            # time to quality in bits per byte (for byte models the same as perplexity <= the teacher's / target)
            teacher_bits = bits_per_byte(reference.test_losses[-1], reference.tokens_per_byte)
            seconds, epoch = reach_bits(result, teacher_bits - math.log2(self.cfg.target))
            row.update(time_to_target_s=seconds, epochs_to_target=epoch)
            if reference is not result and not own:
                row["agreement"] = float((result.preds == reference.preds).float().mean())
            if reference is not result and self.cfg.speculative is not None:
                if own:
                    self.note(row, DRAFT_ACROSS_NOTE)
                    result.model = None
                else:
                    self.draft(row, result, reference)
        return row

    @staticmethod
    def note(row: dict[str, Any], note: str) -> None:
        row["notes"] = "; ".join(n for n in (row["notes"], note) if n)

    def draft(self, row: dict[str, Any], student: Trained, teacher: Trained) -> None:
        """``row`` with the student's figures as the draft of its seed's teacher (:mod:`kdbench.quality.drafts`);
        a note instead where they could not be measured.  The student's model is let go once measured."""
        spec, seed = self.cfg.speculative, row["seed"]
        what = f"quality seed {seed}: {row['quality_role']} {row['method'] or row['student']}"
        began = time.perf_counter()
        try:
            if student.model is None or teacher.model is None:
                raise ValueError("the trained models are not at hand")
            choice = choose_autocast(self.backend, row["precision"])
            x_test = self.byte_data().x_test
            row.update(measure_draft(teacher.model, student.model, x_test, spec, choice, self.backend, seed, BYTES))
        except Exception as exc:  # the row's training figures stand; the draft's are missing, and it says why
            note = f"draft figures not measured: {error_text(exc)}"
            self.note(row, note)
            logger.info("  %s: %s", what, note)
        else:
            logger.info("  %s: %s; measured in %.1f s", what, describe_draft(row), time.perf_counter() - began)
        finally:
            student.model = None

    def describe(self, result: Trained, agreement: float | None = None) -> str:
        loss = result.test_losses[-1]
        per = "byte" if result.tokens_per_byte == 1.0 else "token"
        text = (
            f"{bits_per_byte(loss, result.tokens_per_byte):.3f} bits/byte (perplexity {_perplexity(loss):.3f} per "
            f"{per}), next-{per} top-1 {result.accuracy:.1%}, {result.train_time_s:.2f} s training"
        )
        return text + (f", agreement {agreement:.1%}" if agreement is not None else "")
