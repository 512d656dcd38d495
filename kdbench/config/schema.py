"""The suite's schema: typed, validated pydantic models of everything a suite may say.

A suite file has the top-level keys of :class:`Suite`.  ``defaults`` holds one cell's
configuration (:data:`CellConfig`); every key it may hold may also be a ``matrix``
axis (a list of values), and nested keys may be swept with a dotted axis name
(``kd.temperature: [2, 4]``).  :mod:`kdbench.config.plan` overlays each combination
of matrix values on ``defaults``.

The hyper-parameters of each distillation method are the model the method registers
with itself (:mod:`kdbench.distill.losses`), under the method's name as a key: the
cell model is built from that registry, so adding a method touches its own file only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, create_model, field_validator, model_validator

from kdbench.config.base import FitCheck, Strict
from kdbench.config.budgets import Budget
from kdbench.config.corpus import Corpus
from kdbench.config.optimizer import OptimizerConfig
from kdbench.config.quality import QualityConfig
from kdbench.config.yaml_errors import Lines, where
from kdbench.core.errors import KdbenchError
from kdbench.core.names import MEMORY_FORMATS, PRECISIONS
from kdbench.distill.losses import METHODS

Precision = Literal[PRECISIONS]  # type: ignore[valid-type]
MemoryFormat = Literal[MEMORY_FORMATS]  # type: ignore[valid-type]
BackendName = Literal["auto", "cpu", "cuda", "rocm"]
CompileMode = Literal["off", "default", "reduce-overhead", "max-autotune"]
Runtime = Literal["eager", "compile", "onnxruntime", "int8"]


def _on_off(value: Any, on: str) -> Any:
    """YAML reads `off`/`on` as booleans: as a mode, False is "off" and True is ``on``."""
    if value is False:
        return "off"
    if value is True:
        return on
    return value


class Pair(Strict):
    # registry name of the teacher, or `module:callable` (with allow_imports)
    teacher: str = Field(min_length=1)
    # registry name of the student, or `module:callable` (with allow_imports)
    student: str = Field(min_length=1)


class FeaturesConfig(Strict):
    """Module paths whose outputs feature methods compare; null picks the family's stage ends."""

    # the teacher's module paths (e.g. `layer3`); null: the family's stage ends
    teacher: list[str] | None = Field(None, min_length=1, max_length=16)
    # the student's module paths, paired in order with the teacher's
    student: list[str] | None = Field(None, min_length=1, max_length=16)


class TeacherConfig(Strict):
    # live: the teacher runs every step; cached: its outputs computed once for the fixed batch; topk_cache (LM
    # pairs): its top-k next-token log-probabilities computed once and stored compactly, the student trained on
    # the sparse KL over them (offline distillation); offline (LM pairs): those top-k written once for a token
    # corpus to a store on disk (teacher.store), which every step reads ahead on a background thread
    mode: Literal["live", "cached", "topk_cache", "offline"] = "live"
    # topk_cache and offline: next-token entries kept per token
    k: int = Field(128, ge=1, le=1 << 20)
    # offline: the store's folder, built there by the cell where it is missing or unfinished (resumed after its
    # finished shards); relative: under the run's output folder; null: teacher-stores/<its key's digest> there
    store: str | None = Field(None, min_length=1)
    # offline: the stored log-probabilities: fp16, bf16, or int8 with a per-token offset and scale
    values: Literal["fp16", "bf16", "int8"] = "fp16"
    # offline: the stored vocabulary ids: int32, int16 (unsigned: V <= 65536), packed17 (17 bits each, Megatron's:
    # V <= 131072), auto (int16 where the vocabulary fits, else int32)
    indices: Literal["auto", "int32", "int16", "packed17"] = "auto"
    # offline: each shard's compression: none (read by rows in place) or zstd:<level> (1..22, read whole)
    compression: str = "none"
    # offline: a top-p cut: per token, the fewest of the k entries whose mass reaches top_p (the rest in its bucket)
    top_p: float | None = Field(None, gt=0, le=1)
    # offline: corpus tokens the store holds (the stdlib text or teacher.corpus, in windows of data.seq_len + 1
    # tokens); the steps read it in order (each rank its own batches) and start over at its end
    store_tokens: int = Field(32768, ge=1, le=1 << 40)
    # offline: the token corpus the store is built over: a file of token ids, `corpus: PATH` (a .npy) or
    # `corpus: {path: PATH, dtype: uint16}` (a raw binary); null: the stdlib text in bytes
    corpus: Corpus = None
    # offline: warm (the OS's page cache as it is) or cold (each shard's pages dropped before it is read, with
    # posix_fadvise DONTNEED where the OS has it: the row says which it got)
    page_cache: Literal["warm", "cold"] = "warm"
    # the dtype the frozen teacher's parameters are held in (LM and encoder pairs): fp32, or bf16 / fp16, half
    # the teacher's memory, as torchtune and TRL load a teacher; it needs teacher_precision of the same dtype
    weights: Literal["fp32", "bf16", "fp16"] = "fp32"

    @field_validator("compression")
    @classmethod
    def _compression(cls, v: str) -> str:
        from kdbench.store.teacher_logits import parse_compression

        codec, level = parse_compression(v)
        return codec if level is None else f"{codec}:{level}"


DataKind = Literal["synthetic", "tokens"]
VocabPolicy = Literal["error", "slice", "pad"]
TOKENIZER_FORMS = "bytes, bpe:<vocab_size> (e.g. bpe:1024) or the path of a tokenizer.json kdbench wrote"


class TokenizersConfig(Strict):
    # Each model's own tokenizer (a pair whose models do not share token ids; tokens data): bytes (one token per
    # byte value, 256 entries), bpe:<vocab_size> (a byte-level BPE trained here, with the tokenizers library, on the
    # training text: nothing downloaded), or the path of a tokenizer.json that kdbench wrote
    # (kdbench.data.tokenizers). Given, the batch is real text tokenized by each side's own tokenizer.
    teacher: str = "bytes"
    student: str = "bytes"

    @field_validator("teacher", "student")
    @classmethod
    def _form(cls, v: str) -> str:
        v = v.strip()
        if v == "bytes" or v.endswith(".json"):
            return v
        if v.startswith("bpe:"):
            size = v[4:]
            if size.isdigit() and 256 < int(size) <= 1 << 20:
                return f"bpe:{int(size)}"
            raise ValueError(f"bpe:<vocab_size> takes a whole number in (256, 1048576], got {size!r}")
        raise ValueError(f"a tokenizer is {TOKENIZER_FORMS}; got {v!r}")


class DataConfig(Strict):
    # synthetic: seeded random images (or any tensor shape) and class labels; tokens: seeded random token ids
    # for a causal-LM pair, next-token labels with the prompt share masked. One fixed batch (no data loading).
    kind: DataKind = "synthetic"  # type: ignore[valid-type]
    # one sample's shape, e.g. [3, 32, 32] (CIFAR) or [3, 224, 224] (ImageNet); synthetic data only
    shape: list[int] = Field(default_factory=lambda: [3, 32, 32], min_length=1, max_length=4)
    # classifier width: the models are built with this many outputs; synthetic data only
    num_classes: int = Field(100, ge=2, le=1_000_000)
    # tokens per sequence (tokens data; the batch is batch_size sequences of this many tokens)
    seq_len: int = Field(512, ge=2, le=1 << 20)
    # share of each sequence's first positions that are prompt: not counted in any loss (tokens data)
    prompt_fraction: float = Field(0.25, ge=0, lt=1)
    # Teacher and student vocabularies of different sizes (tokens data): error; slice both LM heads to the
    # smaller vocabulary (the larger head's extra entries are dropped and its distribution renormalised over the
    # rest); or pad the smaller head with -inf logits up to the larger vocabulary (no entry dropped: the smaller
    # model gives its extra entries probability 0; loss_impl dense, chunked or fused_linear). The batch's token ids
    # lie in the smaller vocabulary either way.
    vocab_policy: VocabPolicy = "error"  # type: ignore[valid-type]
    # each model's tokenizer, when the two do not share token ids (TokenizersConfig); null: one set of token ids
    tokenizers: TokenizersConfig | None = None

    @field_validator("shape")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(d < 1 or d > 65536 for d in v):
            raise ValueError("every dimension must be between 1 and 65536")
        return v

    @property
    def is_tokens(self) -> bool:
        """Token ids (LM and encoder pairs), not images: which of the data keys apply (:data:`TOKEN_DATA_KEYS`
        or :data:`IMAGE_DATA_KEYS`).  Not the pair's family, which :mod:`kdbench.workloads.registry` decides."""
        return self.kind == "tokens"

    @property
    def applies(self) -> tuple[str, ...]:
        """The data keys this kind of data takes (the others are left out of the cell's identity)."""
        return TOKEN_DATA_KEYS if self.is_tokens else IMAGE_DATA_KEYS


TOKEN_DATA_KEYS = ("seq_len", "prompt_fraction", "vocab_policy", "tokenizers")  # data keys of tokens data only
IMAGE_DATA_KEYS = ("shape", "num_classes")  # data keys of synthetic data only


class TimingConfig(Strict):
    # untimed calls after the cold call
    warmup: int = Field(3, ge=0, le=100_000)
    # timed calls at least (fewer, under a time budget, make the row thin)
    min_iters: int = Field(10, ge=1, le=1_000_000)
    # seconds of timed calls at least
    min_time_s: float = Field(1.0, ge=0, le=86_400)
    # timed calls at most
    max_iters: int = Field(10_000, ge=1, le=10_000_000)
    # Go on past min_iters/min_time_s while the median's 95 % interval is wider than this share of it,
    # up to max_time_s of timed calls; null: stop at min_iters and min_time_s.
    target_rel_ci: float | None = Field(None, gt=0, lt=1)
    # with target_rel_ci: seconds of timed calls at most
    max_time_s: float = Field(10.0, gt=0, le=86_400)
    # The cell's time budget, shared among its measurements; a share bounds its whole measurement, cold call
    # included: later calls are estimated from the warm ones and the counts shrink to fit, which makes the row
    # thin (null: the backend's default, 300 s on the CPU and none on GPUs; > 0).
    cell_budget_s: float | None = Field(None, gt=0, le=7 * 86_400)

    @model_validator(mode="after")
    def _order(self) -> TimingConfig:
        if self.max_iters < self.min_iters:
            raise ValueError(f"max_iters ({self.max_iters}) must be >= min_iters ({self.min_iters})")
        return self


class SpeculativeConfig(Strict):
    """LM pairs: the teacher generating ``inference.decode_tokens`` new tokens with the student as its draft
    (speculative decoding), one speculative_decode row per draft length and temperature, at batch size 1."""

    # draft tokens (γ) the student proposes per round, each a row
    draft_tokens: list[int] = Field(default_factory=lambda: [4], min_length=1, max_length=16)
    # verification temperatures, each a row: 0 greedy (the output is the teacher's greedy output), above 0 sampled
    # (Leviathan et al. 2023's rejection sampling: the output is distributed as the teacher's own sampling)
    temperature: list[float] = Field(default_factory=lambda: [0.0], min_length=1, max_length=16)

    @field_validator("draft_tokens")
    @classmethod
    def _draft_tokens(cls, v: list[int]) -> list[int]:
        if any(g < 1 or g > SPECULATIVE_MAX_DRAFT for g in v):
            raise ValueError(f"every draft length must be between 1 and {SPECULATIVE_MAX_DRAFT}")
        if len(set(v)) != len(v):
            raise ValueError("draft lengths must not repeat")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: list[float]) -> list[float]:
        if any(not (0 <= t <= 100) for t in v):
            raise ValueError("every temperature must be between 0 (greedy) and 100")
        if len(set(v)) != len(v):
            raise ValueError("temperatures must not repeat")
        return v


SPECULATIVE_MAX_DRAFT = 64  # draft tokens per round at most: past it a draft's proposals are almost never all accepted


class InferenceConfig(Strict):
    # batch sizes of the inference measurements (empty: the step alone)
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 32], max_length=64)
    # measure the teacher's inference too (the student's always is)
    teacher: bool = True
    runtime: Runtime = "eager"  # how the student is served: eager, torch.compile, ONNX Runtime, int8 (CPU)
    # LM pairs: new tokens each decode measurement generates greedily from the prompt's KV cache (no early stop)
    decode_tokens: int = Field(32, ge=1, le=1 << 16)
    # LM pairs: speculative decoding rows, the teacher generating with the student as its draft (null: none)
    speculative: SpeculativeConfig | None = None

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(b < 1 or b > 1 << 20 for b in v):
            raise ValueError("every batch size must be between 1 and 1048576")
        if len(set(v)) != len(v):
            raise ValueError("batch sizes must not repeat")
        return v


class DDPConfig(Strict):
    """DistributedDataParallel options of the student, for cells with world_size > 1."""

    # DDP's gradient bucket size (MB)
    bucket_cap_mb: float = Field(25.0, gt=0, le=10_000)
    # DDP's gradient_as_bucket_view: gradients are views into the buckets
    gradient_as_bucket_view: bool = False
    # DDP's static_graph: the same graph every step
    static_graph: bool = False


class OverridesConfig(Strict):
    """transformers config fields laid over a language model's registered config (LM pairs)."""

    # fields of the teacher's config, e.g. {num_hidden_layers: 2}
    teacher: dict[str, Any] = Field(default_factory=dict)
    # fields of the student's config, e.g. {vocab_size: 32000}
    student: dict[str, Any] = Field(default_factory=dict)


class OnPolicyConfig(Strict):
    """GKD's on-policy distillation (Agarwal et al. 2024; TRL's GKDTrainer): the student generates the completions
    it trains on."""

    # the share of a training run's steps that generate (GKD's λ, TRL's GKDConfig.lmbda); every timed step
    # generates, and the row keeps λ so that a run's mean step reads λ × this step + (1 − λ) × the off-policy one
    lmbda: float = Field(1.0, gt=0, le=1)
    # tokens the student samples per sequence after its prompt (data.prompt_fraction of seq_len)
    new_tokens: int = Field(32, ge=1, le=1 << 16)
    # the sampling temperature (softmax(logits / T), multinomial, seeded)
    temperature: float = Field(1.0, gt=0, le=100)


class GenerationConfig(Strict):
    """How an LM pair generates: its decode rows and the on-policy phase (kdbench.models.generation)."""

    # dynamic: transformers' default KV cache, grown token by token; static: its StaticCache, preallocated for the
    # prompt and the new tokens (the tensors keep their shapes and addresses)
    cache: Literal["dynamic", "static"] = "dynamic"
    # torch.compile of the decode step (the model's forward, fullgraph), as transformers documents it for a
    # static cache: needs cache: static; compiled once per decode row (and per on-policy step row), the
    # compile counted as a one-off cost
    compile: bool = False


LossImpl = Literal["dense", "natural", "chunked", "fused_linear", "liger", "torch_linear"]


class FSDPConfig(Strict):
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) options of ``parallel: fsdp`` cells."""

    # free each of the student's decoder layers' gathered parameters after its forward (re-gathered for the
    # backward); the frozen teacher's are freed after every forward whatever this says (no backward frees them)
    reshard_after_forward: bool = True
    # keep the sharded parameters (and the student's gradients and optimizer state) in host memory (GPUs)
    cpu_offload: bool = False
    # FSDP2's MixedPrecisionPolicy.param_dtype: both models' parameters all-gathered and computed in fp32, bf16
    # or fp16 (cast from their shards); null: in their own dtypes (fp32, or teacher.weights)
    param_dtype: Literal["fp32", "bf16", "fp16"] | None = None
    # MixedPrecisionPolicy.reduce_dtype: the student's gradients reduce-scattered in fp32, bf16 or fp16; null:
    # in param_dtype, else in the parameters' own dtype
    reduce_dtype: Literal["fp32", "bf16", "fp16"] | None = None


class _CellBase(Strict):
    """Everything one cell measures but its methods' hyper-parameters (see :data:`CellConfig`)."""

    # the teacher and the student
    pair: Pair
    # LM pairs: transformers config fields over each model's registered config
    overrides: OverridesConfig = OverridesConfig()
    # distillation method, or methods joined by `+` (e.g. `kd+at`): the Methods page lists them
    method: str = "kd"
    weights: dict[str, float] = Field(default_factory=dict)  # per-term weight of a combined method (default 1)
    # where feature methods tap the models
    features: FeaturesConfig = FeaturesConfig()
    # how the teacher runs in the step
    teacher: TeacherConfig = TeacherConfig()
    # the student's precision: fp32 (IEEE), tf32, bf16 or fp16 (autocast; fp16 with a GradScaler)
    precision: Precision = "fp32"  # type: ignore[valid-type]
    # the teacher's precision in the step
    teacher_precision: Precision = "fp32"  # type: ignore[valid-type]
    # the step's batch size, per device
    batch_size: int = Field(32, ge=1, le=1 << 20)
    # the input batch
    data: DataConfig = DataConfig()
    # the student's optimizer
    optimizer: OptimizerConfig = OptimizerConfig()
    # how long each measurement runs
    timing: TimingConfig = TimingConfig()
    # the inference measurements
    inference: InferenceConfig = InferenceConfig()
    # byte alignment of the input's data pointer (a power of two)
    alignment: int = Field(64, ge=1, le=4096)
    # pad the classifier's width to a multiple of this (1: none)
    pad_to: int = Field(1, ge=1, le=4096)
    # models and input in contiguous (NCHW) or channels_last (NHWC)
    memory_format: MemoryFormat = "contiguous"  # type: ignore[valid-type]
    # data-parallel ranks (torchrun; DDP of the student)
    world_size: int = Field(1, ge=1, le=1024)
    # DDP options (world_size > 1)
    ddp: DDPConfig = DDPConfig()
    # how world_size > 1 ranks share the pair: ddp (the student replicated, DistributedDataParallel) or fsdp (LM
    # pairs: both models sharded with FSDP2, decoder layer by decoder layer, the teacher frozen)
    parallel: Literal["ddp", "fsdp"] = "ddp"
    # FSDP2 options (parallel: fsdp)
    fsdp: FSDPConfig = FSDPConfig()
    # random seed of the weights and the data
    seed: int = Field(0, ge=0, le=2**63 - 1)
    # Levers (kdbench.measure.levers): each at its default is left out of the cell's identity.
    # torch.compile of the student's forward and backward in the step (its inference only with
    # inference.runtime: compile, then in this mode)
    compile: CompileMode = "off"  # type: ignore[valid-type]
    compile_teacher: bool = False  # torch.compile of the teacher's forward in the step too
    graphs: bool = False  # CUDA/HIP graph replay of the student's inference (GPUs)
    conv_autotune: bool = False  # torch.backends.cudnn.benchmark: cuDNN / MIOpen algorithm search (GPUs)
    tunableop: bool = False  # PyTorch TunableOp GEMM tuning (GPUs)
    # LM pairs: how the LM heads and the token loss are computed: dense (both logits whole), natural (as TRL and
    # torchtune write it: both logits of every position, masked afterwards), chunked (logits whole, float32 work
    # per token chunk), fused_linear (hidden states and head weights, chunk by chunk: the
    # logits never exist whole), liger (liger-kernel's chunked losses), torch_linear (F.linear_cross_entropy)
    loss_impl: LossImpl = "dense"  # type: ignore[valid-type]
    # tokens per chunk of the chunked, fused_linear and liger loss implementations
    chunk_size: int = Field(1024, ge=1, le=1 << 20)
    # LM pairs: on-policy distillation (GKD): every step first samples the completions from the student, a phase
    # of its own, then trains on prompt + completion (null: off-policy, the fixed batch)
    on_policy: OnPolicyConfig | None = None
    # LM pairs: the generation backend of decode rows and of the on-policy phase (a lever: its one-off cost and
    # break-even against the same cell without it)
    generation: GenerationConfig = GenerationConfig()

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_on_off(cls, v: Any) -> Any:
        return _on_off(v, "default")

    @field_validator("alignment")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"alignment must be a power of two in bytes (1, 2, 4, ... 4096), got {v}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> CellConfig:
        if self.memory_format == "channels_last" and (len(self.data.shape) != 3 or self.data.is_tokens):
            raise ValueError("memory_format channels_last needs image data: data.shape must be [C, H, W]")
        return self


# A resolved cell: the base fields plus one field per registered method, named after it.
CellConfig = create_model(
    "CellConfig",
    __base__=_CellBase,
    __module__=__name__,
    __doc__="Everything one cell measures; `defaults` and each matrix combination build one.",
    **{name: (m.params, m.params()) for name, m in METHODS.items()},
)

# `defaults` alone, before the matrix adds what it lacks (the pair may come from an axis).
CellDefaults = create_model("CellDefaults", __base__=CellConfig, __module__=__name__, pair=(Pair | None, None))


class LauncherConfig(Strict):
    """How torchrun starts world_size > 1 cells; the default is one node, standalone."""

    nnodes: int = Field(1, ge=1, le=4096)
    rdzv_backend: str = Field("c10d", min_length=1)
    rdzv_endpoint: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:\[\]-]+:[0-9]{1,5}$")
    rdzv_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$")
    extra_args: list[str] = Field(default_factory=list)

    @field_validator("extra_args")
    @classmethod
    def _flags(cls, v: list[str]) -> list[str]:
        if v and not v[0].startswith("--"):
            raise ValueError("extra_args are torchrun flags and must start with --, e.g. ['--log-dir', 'logs']")
        return v

    @model_validator(mode="after")
    def _endpoint(self) -> LauncherConfig:
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("nnodes > 1 needs rdzv_endpoint: HOST:PORT of the rendezvous, the same on every node")
        return self


class Suite(Strict):
    """A validated suite: top-level settings and the raw sweep (expanded by :mod:`kdbench.config.plan`),
    with the file it came from and the line of each key (for errors)."""

    name: str = Field(min_length=1, max_length=200)
    description: str = ""
    backend: BackendName = "auto"
    threads: int | None = Field(None, ge=1, le=4096)
    allow_imports: bool = False
    cell_timeout_s: float = Field(3600.0, gt=0, le=7 * 86_400)
    profile: bool = False  # a torch.profiler trace of every cell's step (as --profile)
    # The fit planner's prediction beside every step's measured peak (kdbench.fit.columns); `false` (as
    # --no-fit-check) saves its cost, a fake run and one profiled step per cell; `auto` (--fit-check auto) skips it
    # where a cell's timed loop was shorter than its pair's last fit check in the worker; the rows say so (docs/fit.md)
    fit_check: FitCheck = True
    repeat: int = Field(1, ge=1, le=100)  # measure every cell this many times, each round in fresh workers
    # A precision measured at least 3x slower than fp32 here (kdbench.hw.speed): `measure` warns and measures
    # its cells; `skip` stores them as skipped, saying how much slower, so a quick suite stays quick.
    slow_precisions: Literal["measure", "skip"] = "measure"
    budgets: list[Budget] = Field(default_factory=list)  # absolute limits: a missed one makes `run` exit 1
    quality: QualityConfig | None = None  # opt-in accuracy run on real data (kdbench.quality.protocol)
    launcher: LauncherConfig = LauncherConfig()
    defaults: dict[str, Any] = Field(default_factory=dict)
    matrix: dict[str, list[Any]] = Field(default_factory=dict)
    exclude: list[dict[str, Any]] = Field(default_factory=list)

    # the keys a section holds that is no model of its own (for "did you mean": `defaults` holds a cell's keys)
    sections: ClassVar[dict[str, Any]] = {"defaults": CellDefaults}

    _path: Path = PrivateAttr(default=Path("<suite>"))
    _lines: Lines = PrivateAttr(default_factory=dict)

    @property
    def path(self) -> Path:
        return self._path

    @property
    def lines(self) -> Lines:
        return self._lines

    def located(self, path: Path, lines: Lines) -> Suite:
        """This suite, remembering the file and lines it was read from."""
        self._path, self._lines = path, lines
        return self

    def error(self, loc: tuple, message: str) -> KdbenchError:
        """A KdbenchError located at a key path of this suite's file."""
        return KdbenchError(f"{where(self.path, self.lines, loc)}: {message}")

    def locate(self, key: str, *sub: str) -> tuple[str, ...]:
        """Where a cell setting was written: its matrix axis when swept, else under defaults."""
        return ("matrix" if key in self.matrix else "defaults", key, *sub)
