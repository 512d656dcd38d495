"""The suite's ``quality:`` block: the data set, the one training recipe every model follows, and the trained
students as drafts (``quality.speculative``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from kdbench.config.base import Strict
from kdbench.config.optimizer import OptimizerConfig

DatasetName = Literal["digits", "imagefolder", "cifar10", "cifar100", "python-stdlib"]
DISK_DATASETS = ("imagefolder", "cifar10", "cifar100")
TEXT_DATASETS = ("python-stdlib",)  # text for LM pairs (kdbench.quality.text); the others are images
DEFAULT_TEXT_SEQ_LEN = 128  # quality.seq_len when not given


class DraftsConfig(Strict):
    """``quality.speculative`` (text data sets): each trained student as the draft of its seed's trained teacher in
    speculative decoding (:mod:`kdbench.quality.drafts`): the acceptance rate, tokens per verify step and the
    measured and predicted speed-ups, per draft length."""

    # the draft lengths γ measured: tokens the student proposes per verify step of the teacher
    draft_tokens: list[int] = Field(default_factory=lambda: [2, 4, 8], min_length=1, max_length=8)
    # sampling temperature of both models (softmax(logits / T); 0: greedy, the target's argmax)
    temperature: float = Field(1.0, ge=0, le=100)
    # held-out windows whose first prompt_tokens bytes are the prompts (evenly spaced over the held-out windows)
    prompts: int = Field(3, ge=1, le=1000)
    prompt_tokens: int | None = Field(None, ge=1, le=1 << 16)  # null: half of quality.seq_len
    # tokens generated after each prompt
    new_tokens: int = Field(24, ge=1, le=1 << 16)
    # timed repeats of every generation (the teacher alone, the student alone, speculative at each γ); medians
    repeats: int = Field(3, ge=1, le=100)

    @field_validator("draft_tokens")
    @classmethod
    def _lengths(cls, v: list[int]) -> list[int]:
        bad = [g for g in v if not 1 <= g <= 64]
        if bad:
            raise ValueError(f"draft_tokens are proposals per verify step, 1 to 64; got {bad[0]}")
        if len(set(v)) != len(v):
            raise ValueError(f"draft_tokens lists a length twice: {v}")
        return v

    def prompt_length(self, seq_len: int) -> int:
        """The prompts' length in tokens, with windows of ``seq_len``: prompt_tokens, or half a window."""
        return self.prompt_tokens if self.prompt_tokens is not None else max(1, seq_len // 2)


class QualityConfig(Strict):
    """The suite's ``quality:`` block: the data set and the one training recipe every model follows."""

    dataset: DatasetName = "digits"
    root: str | None = None  # the data set's folder; required for imagefolder, cifar10, cifar100
    epochs: int = Field(20, ge=1, le=10_000)
    seeds: int = Field(3, ge=1, le=100)
    # quality = target x the seed's teacher accuracy (text: a perplexity at most the teacher's / target)
    target: float = Field(0.95, gt=0, le=1)
    batch_size: int = Field(64, ge=1, le=1 << 20)
    lr: float = Field(0.05, gt=0, le=10)  # peak learning rate; cosine-annealed to 0 over all steps
    optimizer: Literal["sgd", "adamw"] = "sgd"  # sgd: momentum 0.9
    weight_decay: float = Field(5e-4, ge=0, le=1)
    test_fraction: float = Field(0.25, gt=0, lt=1)  # held out when the data set has no split of its own
    max_samples: int | None = Field(None, ge=2, le=100_000_000)  # cap on the images loaded (train + test)
    # python-stdlib: bytes per training window, each predicting its next byte (null: 128)
    seq_len: int | None = Field(None, ge=2, le=1 << 16)
    # python-stdlib: cap on the bytes used, train + held-out, shared as test_fraction says (null: the whole corpus)
    max_bytes: int | None = Field(None, ge=2, le=1 << 40)
    # python-stdlib: each student as the draft of its seed's teacher in speculative decoding (null: not measured;
    # true: the defaults)
    speculative: DraftsConfig | None = None

    @field_validator("speculative", mode="before")
    @classmethod
    def _speculative_on_off(cls, v: Any) -> Any:
        return {} if v is True else None if v is False else v

    @model_validator(mode="after")
    def _root(self) -> QualityConfig:
        if self.dataset in DISK_DATASETS and not self.root:
            raise ValueError(
                f"quality.root is required for dataset {self.dataset}: give the folder that holds the images"
            )
        if self.dataset not in DISK_DATASETS and self.root:
            raise ValueError(
                f"quality.root is only for imagefolder, cifar10 and cifar100; remove it for {self.dataset}"
            )
        text = self.dataset in TEXT_DATASETS
        for key in ("seq_len", "max_bytes") if not text else ():
            if getattr(self, key) is not None:
                raise ValueError(f"quality.{key} is for text (dataset python-stdlib); remove it for {self.dataset}")
        if not text and self.speculative is not None:
            raise ValueError(
                f"quality.speculative measures LM students as drafts on text (dataset python-stdlib); remove it for "
                f"{self.dataset}"
            )
        if self.speculative is not None and self.speculative.prompt_length(self.text_seq_len) > self.text_seq_len:
            raise ValueError(
                f"quality.speculative.prompt_tokens {self.speculative.prompt_tokens} is longer than the held-out "
                f"windows (seq_len {self.text_seq_len}) the prompts are cut from; lower it"
            )
        if text and self.max_samples is not None:
            raise ValueError("quality.max_samples caps images; for python-stdlib cap the bytes with max_bytes")
        if text and self.max_bytes is not None:
            window = self.text_seq_len + 1
            held_out = round(self.max_bytes * self.test_fraction)
            if min(held_out, self.max_bytes - held_out) < window:
                raise ValueError(
                    f"quality.max_bytes {self.max_bytes} leaves a split shorter than one window of seq_len + 1 = "
                    f"{window} bytes (test_fraction {self.test_fraction:g}); raise max_bytes or lower seq_len"
                )
        return self

    @property
    def text_seq_len(self) -> int:
        """The window length of a text data set (seq_len, or its default)."""
        return self.seq_len if self.seq_len is not None else DEFAULT_TEXT_SEQ_LEN

    def optimizer_config(self) -> OptimizerConfig:
        return OptimizerConfig(name=self.optimizer, lr=self.lr, weight_decay=self.weight_decay, momentum=0.9)
