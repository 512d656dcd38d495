"""The results schema: every column a result row may have, with its type, unit, meaning and group.

``COLUMNS`` is the single source of the column list.  Every result row is built as a
:class:`Row`, a record whose keys must be stored columns and whose values must have their
column's type, checked where the row is made and wherever a value is set.  Parts are written
in ``STORED_SCHEMA`` (every column but the derived ones), docs/results.md documents ``COLUMNS`` (a
test keeps the two equal), and :func:`kdbench.store.read_results` returns every column, the
derived ones computed at read time (:mod:`kdbench.store.derived`).  Torch-free: the measuring
code, the store and the report all import it from here, the one door.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
import pyarrow as pa

from kdbench.core.limits import CONTENDED_FREE_SHARE, FIT_TOLERANCE, STEP_TIME_TOLERANCE
from kdbench.core.names import ALIGN, GENERATE, PHASES, REMAINDER_COLUMN, TEACHER_READ

SCHEMA_VERSION = 2  # 1: one parquet file per run, derived columns stored; 2: a folder of parts per run

IDENTITY, CONFIG, STATISTICS, RESULT, DERIVED, QUALITY, ENVIRONMENT = (
    "identity",
    "config",
    "statistics",
    "result",
    "derived",
    "quality",
    "environment",
)


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    unit: str
    doc: str
    group: str

    @property
    def derived(self) -> bool:
        """Computed at read time from other rows and tables, never stored."""
        return self.group == DERIVED


_S, _I, _F, _B = pa.string(), pa.int64(), pa.float64(), pa.bool_()


def _group(group: str, *columns: tuple[str, pa.DataType, str, str]) -> tuple[Column, ...]:
    return tuple(Column(name, type_, unit, doc, group) for name, type_, unit, doc in columns)


COLUMNS: tuple[Column, ...] = (
    *_group(
        IDENTITY,
        ("schema_version", pa.int32(), "", f"version of this column layout ({SCHEMA_VERSION})"),
        ("run_id", _S, "", "unique id of the run; also the name of its folder"),
        ("suite", _S, "", "the suite's `name`"),
        ("suite_file", _S, "", "path of the suite YAML as given to `run`"),
        (
            "suite_commit",
            _S,
            "",
            "git commit (12 hex digits, `+dirty` with uncommitted changes) of the repository the suite file lies "
            "in, when it lies in one: the report's history of a suite's runs is labelled by it",
        ),
        (
            "cell_id",
            _S,
            "",
            "stable hash of the resolved cell config (same cell, same id, in any rerun and on any "
            "machine); quality rows: the id of the suite's quality job",
        ),
        ("cell_label", _S, "", "short human label of the cell"),
        (
            "repeat",
            _I,
            "",
            "which of the cell's measurements in fresh worker processes this row is: 1..N with the "
            "suite's `repeat: N` (null in runs stored before repeats: read as 1)",
        ),
        (
            "measurement",
            _S,
            "",
            "`distill_step`, `student_inference`, `teacher_inference`, LM pairs' `student_prefill`, `student_decode`, "
            "`teacher_prefill`, `teacher_decode` and `speculative_decode`, or `quality`",
        ),
        ("status", _S, "", "`ok`, `failed`, `oom`, `timeout` or `skipped`"),
        ("error", _S, "", "why the measurement failed or was skipped (null when ok)"),
        ("notes", _S, "", "caveats of an ok row, e.g. why autocast was not applied at the asked precision"),
        (
            "measured_in_cell",
            _S,
            "",
            "a teacher_inference row reused from the first cell of the run that measured the same teacher at "
            "the same precision, batch, input, placement and repeat: that cell's cell_id (null: measured here)",
        ),
        ("timestamp", pa.timestamp("us", tz="UTC"), "UTC", "when the measurement was stored"),
    ),
    *_group(
        CONFIG,
        ("teacher", _S, "", "teacher model name"),
        ("student", _S, "", "student model name"),
        ("method", _S, "", "distillation method (`kd`, ...)"),
        ("precision", _S, "", "student precision: `fp32` (IEEE), `tf32`, `fp16` or `bf16`"),
        ("teacher_precision", _S, "", "teacher forward precision in the distillation step"),
        (
            "teacher_weights",
            _S,
            "",
            "dtype the frozen teacher's parameters are held in (`teacher.weights`: `fp32`, or `bf16`/`fp16` for LM "
            "and encoder teachers)",
        ),
        ("batch_size", _I, "samples", "batch size of this measurement (per rank)"),
        ("backend", _S, "", "backend the cell ran on: `cpu`, `cuda` or `rocm`"),
        ("device", _S, "", "torch device, e.g. `cpu` or `cuda:0`"),
        ("memory_format", _S, "", "`contiguous` or `channels_last`"),
        ("alignment", _I, "bytes", "requested byte alignment of the step's input buffers"),
        ("pad_to", _I, "", "classifier width padded to a multiple of this (1: no padding)"),
        ("padded_classes", _I, "", "classifier width after padding (the pad is sliced out of loss and accuracy)"),
        ("world_size", _I, "ranks", "data-parallel ranks"),
        (
            "dist_backend",
            _S,
            "",
            "torch.distributed backend of world_size > 1 cells: `gloo` (CPU) or `nccl` (CUDA, RCCL on ROCm)",
        ),
        ("parallel", _S, "", "world_size > 1 cells: `ddp` (the student replicated) or `fsdp` (the pair FSDP2-sharded)"),
        (
            "fsdp_reshard_after_forward",
            _B,
            "",
            "FSDP2 cells: each of the student's layers' gathered parameters freed after its forward (the frozen "
            "teacher's always are)",
        ),
        ("fsdp_cpu_offload", _B, "", "FSDP2 cells: the shards kept in host memory"),
        ("ddp_bucket_cap_mb", _F, "MiB", "DDP gradient bucket size"),
        ("ddp_gradient_as_bucket_view", _B, "", "DDP gradient_as_bucket_view"),
        ("ddp_static_graph", _B, "", "DDP static_graph"),
        ("data_kind", _S, "", "`synthetic` (images) or `tokens` (LM pairs)"),
        ("data_shape", _S, "", "shape of one input sample, e.g. `3x32x32` (null for token data)"),
        (
            "seq_len",
            _I,
            "tokens",
            "LM pairs: tokens per sequence (of the step's batch, and of the prompts served; text quality rows: of "
            "the training and held-out windows)",
        ),
        (
            "loss_impl",
            _S,
            "",
            "LM pairs: how the LM heads and the token loss were computed (`dense`, `natural`, `chunked`, "
            "`fused_linear`, `liger`, `torch_linear`)",
        ),
        (
            "chunk_size",
            _I,
            "tokens",
            "LM pairs: tokens per chunk of the loss implementation (null for dense and natural)",
        ),
        (
            "decode_tokens",
            _I,
            "tokens",
            "decode rows: new tokens each timed call generates greedily (speculative_decode: the teacher generates, "
            "the student drafting)",
        ),
        (
            "draft_tokens",
            _I,
            "tokens",
            "speculative_decode rows: γ, the tokens the student (the draft) proposes per round for the teacher to "
            "verify in one forward (inference.speculative.draft_tokens)",
        ),
        (
            "spec_temperature",
            _F,
            "",
            "speculative_decode rows: the verification temperature T; 0: greedy (the output is the teacher's greedy "
            "output), above 0: sampled (Leviathan et al. 2023's rejection sampling, distributed as the teacher's own)",
        ),
        (
            "generation",
            _S,
            "",
            "LM cells: the generation backend of decode rows and the on-policy phase: `dynamic` (transformers' "
            "growing KV cache), `static` (its StaticCache) or `static + compile` (the decode step torch.compiled)",
        ),
        (
            "on_policy_lambda",
            _F,
            "",
            "on-policy LM cells: GKD's λ, the share of a training run's steps that generate (every timed step does)",
        ),
        ("on_policy_new_tokens", _I, "tokens", "on-policy LM cells: tokens the student generates per sequence"),
        ("num_classes", _I, "", "classifier width"),
        ("kd_temperature", _F, "", "KD softmax temperature T"),
        ("kd_alpha", _F, "", "KD weight α of the soft-target term"),
        ("method_params", _S, "", "JSON of the hyper-parameters of the cell's method terms (and `weights`)"),
        (
            "teacher_mode",
            _S,
            "",
            "`live` (teacher forward every step), `cached` (its outputs computed once) or `topk_cache` (its top-k "
            "next tokens computed once, LM pairs)",
        ),
        ("optimizer", _S, "", "student optimizer name"),
        ("lr", _F, "", "student learning rate"),
        ("seed", _I, "", "random seed of weights and data"),
        ("warmup", _I, "iterations", "untimed iterations after the first (cold) one"),
        ("min_iters", _I, "iterations", "minimum timed iterations"),
        ("min_time_s", _F, "s", "minimum timed duration"),
        ("autocast", _B, "", "whether torch.amp.autocast was applied to the measured forward"),
        ("teacher_autocast", _B, "", "whether autocast was applied to the teacher forward of the step"),
        ("grad_scaler", _B, "", "whether a GradScaler scaled the loss (fp16 steps)"),
        (
            "compile",
            _S,
            "",
            "lever: torch.compile mode of the student (`off`, `default`, `reduce-overhead`, `max-autotune`)",
        ),
        ("compile_teacher", _B, "", "lever: the teacher's forward compiled too"),
        ("graphs", _B, "", "lever: the student's inference replayed from a CUDA/HIP graph"),
        ("optimizer_impl", _S, "", "lever: the optimizer's implementation (`default`, `foreach`, `fused`)"),
        ("conv_autotune", _B, "", "lever: torch.backends.cudnn.benchmark (cuDNN / MIOpen algorithm search)"),
        ("tunableop", _B, "", "lever: PyTorch TunableOp GEMM tuning"),
        (
            "runtime",
            _S,
            "",
            "inference rows: how the model was served (`eager`, `compile`, `onnxruntime`, `int8`, `+ graphs`)",
        ),
        (
            "grad_mode",
            _S,
            "",
            "how torch's autograd ran in the timed calls: `autograd` (distill_step: the student's forward and "
            "backward, the teacher under `no_grad`), `inference_mode` (serving rows: `torch.inference_mode()`, a few "
            "% faster than a `torch.no_grad()` loop where per-operator overhead dominates); null where torch did not "
            "run the calls (onnxruntime)",
        ),
        ("config_json", _S, "", "the whole resolved cell config as JSON"),
    ),
    *_group(  # what an FSDP2 step's collectives moved (fsdp.param_dtype / fsdp.reduce_dtype: its MixedPrecisionPolicy)
        RESULT,
        (
            "fsdp_all_gather_dtype",
            _S,
            "",
            "FSDP2 step rows: the dtype the student's parameters were all-gathered (and computed) in: "
            "fsdp.param_dtype, else their own",
        ),
        (
            "fsdp_teacher_all_gather_dtype",
            _S,
            "",
            "FSDP2 step rows: the dtype the teacher's parameters were all-gathered in: fsdp.param_dtype, else their "
            "own (teacher.weights)",
        ),
        (
            "fsdp_reduce_dtype",
            _S,
            "",
            "FSDP2 step rows: the dtype the student's gradients were reduce-scattered in: fsdp.reduce_dtype, else "
            "fsdp.param_dtype, else the parameters' own",
        ),
    ),
    *_group(
        STATISTICS,
        ("n", _I, "samples", "number of timed iterations"),
        ("median_ms", _F, "ms", "median iteration time"),
        ("mean_ms", _F, "ms", "mean iteration time"),
        ("std_ms", _F, "ms", "standard deviation (ddof=1)"),
        ("iqr_ms", _F, "ms", "interquartile range p75 − p25"),
        ("p05_ms", _F, "ms", "5th percentile"),
        ("p25_ms", _F, "ms", "25th percentile (lower quartile)"),
        ("p75_ms", _F, "ms", "75th percentile (upper quartile)"),
        ("p90_ms", _F, "ms", "90th percentile"),
        ("p95_ms", _F, "ms", "95th percentile"),
        ("p99_ms", _F, "ms", "99th percentile (with under 100 samples, interpolated towards the slowest)"),
        ("min_ms", _F, "ms", "fastest iteration"),
        ("max_ms", _F, "ms", "slowest iteration"),
        ("first_ms", _F, "ms", "the first (cold) iteration, not among the samples"),
        (
            "cold_excess_ms",
            _F,
            "ms",
            "the cold and warm-up calls (host time between synchronizations) minus as many median calls: what this "
            "measurement paid once (compile, algorithm search, allocator and cache warm-up); a lever's net one-off "
            "cost subtracts its twin's",
        ),
        (
            "samples_ms",
            pa.list_(_F),
            "ms",
            "every timed iteration, in order (for world_size > 1, each at its slowest rank)",
        ),
        ("rel_iqr", _F, "ratio", "iqr_ms / median_ms"),
        (
            "median_ci_low_ms",
            _F,
            "ms",
            "lower end of the median's 95 % confidence interval (distribution-free, from order statistics; "
            "null under 6 samples)",
        ),
        ("median_ci_high_ms", _F, "ms", "upper end of the median's 95 % confidence interval"),
        ("noisy", _B, "", "rel_iqr > 0.10: treat the median with care"),
        (
            "thin",
            _B,
            "",
            "fewer timed calls than `min_iters` (the time budget stopped the loop; notes say how): kept and "
            "shown, never judged by compare, budgets or break-even (null in older rows: read as n < min_iters)",
        ),
        (
            "host_busy_share",
            _F,
            "ratio",
            "CPU time other processes used on the cores this run may run on (its affinity) over the timed window, "
            "over the window's wall time x those cores: 0 idle, 1 every core busy with others; this run's own "
            "process tree (engine, workers, ranks) left out (kdbench.hw.contention); a window under 0.25 s is read "
            "from the measurement's start, and one still shorter gives null (the per-core counters tick every 10 ms)",
        ),
        (
            "device_other_processes",
            _I,
            "",
            "GPUs: the most processes other than this run's seen on the measured GPU at the timed window's edges "
            "(NVML / amdsmi process lists); null where they cannot be read and on the CPU",
        ),
        (
            "contended",
            _B,
            "",
            f"measured on a busy machine: other processes left this run fewer than {CONTENDED_FREE_SHARE:g} x the "
            "cores its threads need, or ran on its GPU (notes give the figure); kept and shown, not judged by "
            "compare or budgets unless --judge-contended (null: too short a measurement to tell, or a row from "
            "before it was measured)",
        ),
        ("timer", _S, "", "`perf_counter_ns` (host clock) or `device_event` (CUDA/HIP events)"),
        (
            "time_to_steady_ms",
            _F,
            "ms",
            "from the cold call's start to the end of the first call within 10 % of the "
            "median (first_ms is the cold call alone)",
        ),
        ("steady_after_iters", _I, "iterations", "calls (cold one included) until the first steady one"),
        (
            "host_ms",
            _F,
            "ms",
            "GPUs: median host time to issue one warm-up call on an idle device (Python, "
            "dispatch and kernel launches), apart from the device's work",
        ),
        (
            "launch_bound",
            _B,
            "",
            "GPUs: host_ms >= 0.9 x median_ms: the device waits for the host, so the row "
            "measures Python and launch overhead rather than the GPU (notes say so); null on the CPU",
        ),
        (
            "window_ms",
            _F,
            "ms",
            "host wall time of the whole timed window, gaps between iterations included (the "
            "samples are the iterations alone)",
        ),
    ),
    *_group(
        RESULT,
        (
            "throughput",
            _F,
            "samples/s",
            "world_size × batch_size / median time (for world_size > 1, each iteration's slowest rank)",
        ),
        (
            "window_throughput",
            _F,
            "samples/s",
            "world_size × batch_size × n / window_ms: what the timed window sustained, with the gaps "
            "and stalls (GC pauses, allocator calls, throttling) that the median leaves out; the "
            "report flags a row whose window throughput is over 5 % below its throughput",
        ),
        (
            "served_weights",
            _S,
            "",
            "LM serving rows (prefill, decode, speculative_decode): the dtype the served model's parameters were held "
            "in during the timed calls: a bf16 or fp16 cell serves its models held in that dtype, cast once after "
            "the step, as a deployment holds them (held in fp32, each call would re-cast every weight); "
            "speculative rows: both models' (`bf16`, or `teacher/student` when they differ)",
        ),
        (
            "decode_bytes_per_token",
            _F,
            "bytes",
            "decode rows: the bytes a decode step must read per generated token, weights (as stored, less the input "
            "embedding rows not looked up) / batch_size + the KV cache of one sequence (2 × layers × kv_heads × "
            "head_dim × the cache dtype's bytes per position) at its mean length over the call, prompt + "
            "(decode_tokens − 1) / 2 (kdbench.measure.decode_floor; decode is memory-bound: the roofline model, "
            "Williams et al. 2009); speculative_decode rows: (verifies × the teacher's + draft forwards × the "
            "student's bytes per batch-1 decode step) / decode_tokens, the last timed call's counts. Where steps "
            "run transformers' repeat_kv (attention_path `repeated`), plus its copy: K and V written × groups "
            "(query heads per kv head) at every position a step attends (a static cache: its allocated length, "
            "prompt + decode_tokens) and read back by SDPA, 2 × groups × the KV bytes per position × those "
            "positions (× the share of calls that repeat); speculative rows: the bytes repeat_kv wrote in an "
            "untimed call, × 2, / decode_tokens. A note gives the extra bytes",
        ),
        (
            "attention_path",
            _S,
            "",
            "LM serving rows (prefill, decode, speculative_decode): how a GQA model's attention reached "
            "scaled_dot_product_attention in transformers' sdpa integration on the timed calls "
            "(kdbench.models.attention_path): `enable_gqa` (SDPA's own GQA: no mask, K/V head size <= 256, or "
            "TRANSFORMERS_SDPA_FORCE_GQA=1), `packed` (one query token, eager: pack_gqa folds the query's groups "
            "into its sequence, attention runs on the kv heads), `repeated` (repeat_kv writes K and V × groups "
            "over the whole cache every step, SDPA reads the copy: a static cache's mask at one query token under "
            "torch.compile, a verify forward of several tokens on a cache), `mha` (one query head per kv head: "
            "nothing to do); `A+B` when one model's calls took several (most first); speculative rows: `teacher "
            "X, student Y` when the models differ. Watched on an untimed eager call; a compiled decode step, which "
            "cannot be, by transformers' rule (its eager pass, which attention_kernel describes, packs where it "
            "repeats). Null: not known (no transformers SDPA attention, or a transformers without the rule)",
        ),
        ("tokens", _I, "tokens", "LM rows: tokens one timed call processes (step, prefill: B×S; decode: B×new tokens)"),
        (
            "tokens_per_s",
            _F,
            "tokens/s",
            "LM rows: world_size × tokens / median time (the step's and prefill's processed tokens, decode's new ones)",
        ),
        (
            "vocab_size",
            _I,
            "",
            "LM step rows: the vocabulary both heads cover in the loss (uld: the student's; each head keeps its own)",
        ),
        (
            "teacher_tokenizer",
            _S,
            "",
            "cross-tokenizer LM step rows (data.tokenizers): the teacher's tokenizer, `bytes` or its spec with its "
            "size and a sha256 digest of its vocabulary (null: the models share token ids)",
        ),
        ("student_tokenizer", _S, "", "cross-tokenizer LM step rows: the student's tokenizer, as teacher_tokenizer"),
        (
            "uld_alignment",
            _S,
            "",
            "uld rows (LM step rows of a uld cell, text quality rows of a student distilled by uld): which positions "
            "ULD pairs, `position` (the authors' form: the i-th counted of each side) or `bytes` (the positions that "
            "have read the same text; uld.alignment)",
        ),
        (
            "uld_matched",
            _F,
            "ratio",
            "uld rows: the share of the student's counted positions that ULD pairs (the others count in no ULD "
            "term): on the cell's batch, or on the quality protocol's training windows",
        ),
        (
            "spec_alpha",
            _F,
            "ratio",
            "speculative_decode rows: the acceptance rate α, the draft's proposals the teacher accepted over those it "
            "judged (a round's proposals after its first rejection are never judged); for sampled verification "
            "E[α] = 1 − TV(teacher, student) at the temperature",
        ),
        (
            "spec_accepted_per_verify",
            _F,
            "tokens",
            "speculative_decode rows: accepted draft tokens per verify step (teacher forward)",
        ),
        (
            "spec_tokens_per_verify",
            _F,
            "tokens",
            "speculative_decode rows: new tokens per verify step (the accepted draft tokens and the teacher's own); "
            "decode_tokens / spec_tokens_per_verify teacher forwards replace decode_tokens",
        ),
        (
            "logits_memory_bytes",
            _F,
            "bytes",
            "LM step rows: the memory the loss implementation's B×S×V-sized buffers take at its peak, computed from "
            "the shapes (compare with the measured peak)",
        ),
        (
            "teacher_cache_bytes_per_token",
            _I,
            "bytes",
            "teacher.mode topk_cache: the cache's bytes per token (k log-probabilities, their indices, the rest)",
        ),
        (
            "topk_reconstruction_kl",
            _F,
            "nats",
            "teacher.mode topk_cache: KL of the teacher's dense next-token distribution against the cache's "
            "reconstruction (top-k entries, the rest's mass spread evenly), mean over the valid tokens; offline: "
            "against the store's decoded entries (its encoding's loss too), mean over the build's first 4,096 tokens",
        ),
        (
            "teacher_store_encoding",
            _S,
            "",
            "teacher.mode offline: the store's encoding, `k<k> <values> <indices> <compression>[ top_p <p>]` "
            "(docs/lm.md, Offline teacher stores)",
        ),
        ("teacher_store_tokens", _I, "tokens", "teacher.mode offline: the positions the store holds a top-k for"),
        (
            "teacher_store_bytes_per_token",
            _F,
            "bytes",
            "teacher.mode offline: the store's shard bytes on disk / its tokens (uncompressed: k × value bytes + "
            "(8 for int8's offset and scale) + the ids' bytes + 4 for the rest, exactly; the token ids apart)",
        ),
        (
            "teacher_store_build_s",
            _F,
            "s",
            "teacher.mode offline: the store's build, teacher forward plus encode + write, over every session that "
            "built it (null: no shard built)",
        ),
        (
            "teacher_store_forward_tokens_per_s",
            _F,
            "tokens/s",
            "teacher.mode offline: the build's teacher forward with its LM head, tokens per second (host time "
            "between synchronizations)",
        ),
        (
            "teacher_store_encode_tokens_per_s",
            _F,
            "tokens/s",
            "teacher.mode offline: the build's log-softmax, top-k, encoding, compression, checksum and atomic "
            "writes, tokens per second",
        ),
        (
            "teacher_read_ms",
            _F,
            "ms",
            "teacher.mode offline: median time the reader's thread took to read, decode and copy to the device one "
            "step's batch and its top-k (compare phase_teacher_read_ms: what the step waited of it)",
        ),
        (
            "teacher_read_wait_ms",
            _F,
            "ms",
            "teacher.mode offline: median wait for the next batch over every step (warm-up and counted calls too)",
        ),
        ("teacher_read_tokens_per_s", _F, "tokens/s", "teacher.mode offline: the reader's tokens per second"),
        (
            "teacher_store_page_cache",
            _S,
            "",
            "teacher.mode offline: `warm` (the OS's page cache as it was) or `cold` (each shard's pages dropped "
            "before its read with posix_fadvise DONTNEED), or why cold was not had",
        ),
        ("logits_buffers", _S, "", "LM step rows: the B×S×V-sized buffers logits_memory_bytes counts, and their dtype"),
        (
            "loss_objective",
            _S,
            "",
            "LM step rows: the objective the token loss computed, in words: its CE weight, divergence with its "
            "parameters, T and where T² applies, the vocabulary entries (and the vocab_policy slice), the feature "
            "terms added (e.g. `0.5·CE + 0.5·forward_kl(T=2, ×T²) over 32000 entries`)",
        ),
        (
            "loss_rel_err",
            _F,
            "",
            "LM step rows, the accuracy ledger: |L − L64| / |L64|, the token loss computed by the cell's loss_impl "
            "in its precision against dense in float64 on the same inputs (the batch's hidden states as the cell "
            "made them, its first 1024 counted tokens at most; the heads' own parameters upcast), taken once after "
            "the timed loop, outside every timed figure and memory peak; null where "
            "not taken (a note says why: a top-k cached teacher, a model returning logits, FSDP2) or L64 = 0",
        ),
        (
            "grad_rel_err",
            _F,
            "",
            "LM step rows, the accuracy ledger: ‖g − g64‖₂ / ‖g64‖₂, g the student's gradients w.r.t. its final "
            "hidden states and LM head (weight, and bias if any) flattened and concatenated, the Euclidean norm over "
            "all their entries (as loss_rel_err: the cell's loss_impl and precision against dense in float64); null "
            "where not taken or g64 = 0",
        ),
        (
            "grad_rel_err_hidden",
            _F,
            "",
            "LM step rows, the accuracy ledger: grad_rel_err over the gradient w.r.t. the student's hidden states "
            "alone",
        ),
        (
            "grad_rel_err_head",
            _F,
            "",
            "LM step rows, the accuracy ledger: grad_rel_err over the gradient w.r.t. the student's LM head alone",
        ),
        (
            "attn_implementation",
            _S,
            "",
            "encoder rows: the attention implementation the models ran (`sdpa`, `eager`; `teacher X, student Y` "
            "when they differ); minilm reads Q, K, V from hooks on the projections, so SDPA stays",
        ),
        (
            "attention_kernel",
            _S,
            "",
            "the kernel each scaled_dot_product_attention call of the row's counted call ran, read from the aten op "
            "it dispatched to: `flash` (`_scaled_dot_product_flash_attention`, and on the CPU "
            "`_scaled_dot_product_flash_attention_for_cpu`), `cudnn`, `mem_efficient`, or `math` (none of them: "
            "torch's matmuls and softmax, the S×S scores materialised); `teacher X, student Y` on a step when the "
            "models differ, `A+B` when one model's calls ran several (most calls first). Null: no SDPA call (eager "
            "attention, an image model), or no FLOP count (over the time budget)",
        ),
        ("final_loss", _F, "", "distillation loss of the last timed step (distill_step rows; mean over ranks)"),
        ("nonfinite_steps", _I, "steps", "steps whose loss was inf or NaN (all calls, warm-up included)"),
        ("scaler_skips", _I, "steps", "optimizer updates the fp16 GradScaler skipped for inf/NaN gradients"),
        *((p.column, _F, "ms", f"median {p.doc}") for p in PHASES),
        (GENERATE.column, _F, "ms", f"median of the {GENERATE.doc} (null: the step generates nothing)"),
        (ALIGN.column, _F, "ms", f"median of the {ALIGN.doc} (null: one tokenizer)"),
        (TEACHER_READ.column, _F, "ms", f"median of the {TEACHER_READ.doc} (null: no offline teacher)"),
        (REMAINDER_COLUMN, _F, "ms", "median of step time − sum of its phases (Python overhead between stamps)"),
        (
            "teacher_cache_ms",
            _F,
            "ms",
            "one-off time to compute the cached teacher outputs (teacher.mode cached), in the step's fp32 math mode; "
            "host time between synchronizations",
        ),
        (
            "one_off_ms",
            _F,
            "ms",
            "the levers' one-off cost for this measurement, all it paid once: compile, algorithm search or GEMM "
            "tuning (the cold and warm-up calls minus as many steady calls, in host time between synchronizations); "
            "graph capture, ONNX export and session creation, quantization (plus the served model's own "
            "cold_excess_ms)",
        ),
        ("one_off_kind", _S, "", "what one_off_ms paid for"),
        ("graph_breaks", _I, "", "torch.compile: graph breaks torch._dynamo counted"),
        ("compiled_graphs", _I, "", "torch.compile: graphs compiled"),
        (
            "recompiles",
            _I,
            "",
            "torch.compile: frames compiled inside the timed window (non-zero: the samples include compiling)",
        ),
        (
            "output_check",
            _S,
            "",
            "inference rows served by another runtime: its outputs against eager's on the same batch, checked "
            "before timing (`ok: ...` or `MISMATCH: ...`); decode rows with a generation backend: its greedy tokens "
            "against the dynamic cache's, checked after timing (`ok to a near-tie: ...` where they first differ at "
            "a token whose reference top-2 logits lie within the serving dtype's resolution: rounding decides)",
        ),
        ("output_max_abs_diff", _F, "", "largest |runtime output − eager output| over the batch's logits"),
        ("output_top1_agreement", _F, "ratio", "share of samples whose top-1 class matches eager's"),
        ("tunableop_file", _S, "", "TunableOp's results file (kept beside the results)"),
        ("teacher_features", _S, "", "teacher module paths whose outputs feature methods compare"),
        ("student_features", _S, "", "student module paths paired with teacher_features"),
        ("student_params", _I, "parameters", "student model parameter count (what serves inference)"),
        (
            "adapter_params",
            _I,
            "parameters",
            "parameters of the feature adapters (e.g. FitNet's regressor), trained with the student",
        ),
        ("trainable_params", _I, "parameters", "student + adapter parameters: what the distillation step trains"),
        ("teacher_params", _I, "parameters", "teacher parameter count"),
        (
            "flops",
            _F,
            "FLOP",
            "FLOPs of one iteration on one device (torch.utils.flop_counter: matmuls, convolutions and attention), "
            "attention as its kernel executes it: a causal call on a fused kernel (flash, cuDNN, mem-efficient, the "
            "CPU's flash) counts its unmasked (query, key) pairs, S(S+1)/2 per head, the math kernel the whole S×S "
            "square (attention_kernel says which ran)",
        ),
        ("teacher_forward_flops", _F, "FLOP", "the teacher forward's share of `flops` (distill_step, live teacher)"),
        ("student_flops", _F, "FLOP", "student forward + backward (+ adapters) share of `flops` (distill_step)"),
        (
            "extra_flops",
            _F,
            "FLOP",
            "LM step rows: FLOPs the loss_impl executed beyond dense's for the same step (heads run on masked tokens "
            "too, a head run twice), counted on meta tensors of the step's shapes and left out of `flops` (and of "
            "student_flops), so that `flops` and MFU count the same model work for every loss_impl; 0 for dense",
        ),
        (
            "ceiling_tflops",
            _F,
            "TFLOP/s",
            "this device's measured matmul rate at the cell's precision (the newest "
            "`kdbench probe` when the run started)",
        ),
        (
            "teacher_ceiling_tflops",
            _F,
            "TFLOP/s",
            "the same probe's matmul rate at the teacher's precision (for "
            "a step whose teacher runs at another precision)",
        ),
        (
            "ceiling_gbps",
            _F,
            "GB/s",
            "the same probe's copy bandwidth (bytes read + written per second by a device-to-device copy: "
            "`kdbench probe`'s copy), the memory-bandwidth ceiling decode rows are held against",
        ),
        ("ceiling_probe_id", _S, "", "the probe the ceiling comes from"),
        (
            "memory_kind",
            _S,
            "",
            "`device` (allocator peak, reset before the measurement), `rss_hwm` (kernel "
            "high-water mark of the worker process, reset before) or `rss` (sampled)",
        ),
        (
            "peak_memory_bytes",
            _I,
            "bytes",
            "peak allocated device memory, or the worker's peak resident memory on the CPU",
        ),
        ("peak_reserved_bytes", _I, "bytes", "peak memory reserved by the caching allocator (GPUs)"),
        ("memory_growth_bytes", _I, "bytes", "memory at the end of the measurement minus at its start"),
        (
            "memory_footprint_bytes",
            _I,
            "bytes",
            "peak_memory_bytes minus the memory in use when the measurement "
            "started: what the measurement itself needed (garbage collected and, on GPUs, the allocator's cache "
            "emptied first)",
        ),
        (
            "optimizer_state_bytes",
            _I,
            "bytes",
            "bytes of the optimizer's state tensors after the measurement (distill_step; this rank's shards "
            "under FSDP2)",
        ),
        (
            "model_state_bytes",
            _I,
            "bytes",
            "distill_step rows: the bytes this rank holds of both models' parameters, the gradients and the "
            "optimizer state after the measurement (FSDP2: its shards; DDP: whole copies), counted from the tensors",
        ),
        ("telemetry", _S, "", "`pynvml` or `amdsmi` when GPU telemetry was read; else `unavailable: why`"),
        (
            "telemetry_device",
            _S,
            "",
            "the GPU the telemetry was read from: the NVML UUID or PCI address that matched "
            "torch's device (never its index)",
        ),
        ("power_w_mean", _F, "W", "mean board power over the timed iterations"),
        ("power_w_max", _F, "W", "highest power sample"),
        ("clock_mhz_mean", _F, "MHz", "mean graphics clock"),
        ("temperature_c_max", _F, "°C", "highest GPU temperature sample"),
        (
            "gpu_util_pct_mean",
            _F,
            "%",
            "mean share of time some kernel was running, as the driver reports it "
            "(NVML `utilization.gpu`, amdsmi `gfx_activity`): kernel activity, not how busy the GPU's units were",
        ),
        ("energy_per_step_j", _F, "J", "energy of the timed iterations / their number"),
        ("samples_per_joule", _F, "samples/J", "samples processed per joule"),
        (
            "energy_source",
            _S,
            "",
            "`counter`: the GPU's energy counter read at the timed window's edges (NVML total "
            "energy, amdsmi energy count); `sampled power`: power samples integrated where there is no counter",
        ),
        ("energy_window_s", _F, "s", "the window the energy covers; under 5 s the figure is rough (notes say so)"),
        ("trace_file", _S, "", "torch.profiler Chrome trace of the cell's step (`profile: true` or --profile)"),
        (
            "top_ops",
            _S,
            "",
            "JSON: the traced step's top operators by self time (ms per step): device kernels on "
            "GPUs, CPU operators on the CPU",
        ),
        (
            "trace_error",
            _S,
            "",
            "why the profiler trace is missing (it could not start or write); the timed row stands",
        ),
        ("data_ptr_mod64", _I, "bytes", "input batch's realised data_ptr() % 64 (labels are placed alike)"),
        ("memory_format_verified", _B, "", "the input and every 4-D weight are contiguous in `memory_format`"),
    ),
    *_group(  # the host's memory (issue 30): measured beside the device's, and counted by the plan
        RESULT,
        (
            "host_peak_bytes",
            _I,
            "bytes",
            "the measuring process's peak resident memory on the host over the timed measurement (the kernel's "
            "high-water mark VmHWM, reset at its start), on every backend: on the CPU the same peak as "
            "peak_memory_bytes, on a GPU the host's beside the device's (null where the kernel keeps none)",
        ),
        (
            "host_models_bytes",
            _I,
            "bytes",
            "the plan's count of what the cell's models take of the host on rank 0, at most at once: every copy it "
            "holds (a cached fp32 master, a fresh copy, a model built on the host in its dtype, FSDP2 shards kept "
            "on the host, the largest tensor drawn while a model is built on the device, the whole copies built for "
            "serving after an FSDP2 step), parameters x bytes per dtype; not activations, gradients or optimizer "
            "state (null: a module:callable model, not counted before it is built). `kdbench run --dry-run` prints "
            "it per cell; a cell whose ranks on one node need more than the machine has available is skipped",
        ),
    ),
    *_group(  # will it fit (issue 31): the fit planner's predicted peak against the measured one
        RESULT,
        (
            "predicted_peak_bytes",
            _I,
            "bytes",
            "distill_step rows: the fit planner's prediction of one device's (rank 0's) peak of live tensor bytes "
            "during the step: the cell's own step run on fake tensors, nothing allocated (kdbench.fit.planner); "
            "on a GPU plus the BLAS workspaces its step holds (cuBLAS/hipBLAS(Lt), allocated through the caching "
            "allocator, as max_memory_allocated counts them: kdbench.fit.runtime); "
            "null when the cell is unpredictable, with the reason in notes (`fit: ...`)",
        ),
        (
            "predicted_peak_phase",
            _S,
            "",
            "the phase the predicted peak falls in: `setup`, `cache build` or a step phase (`teacher_forward`, "
            "`student_forward`, `loss`, `backward`, `optimizer`, `generate`)",
        ),
        (
            "predicted_breakdown",
            _S,
            "",
            "JSON: the predicted peak's bytes by kind (`parameters`, `gradients`, `optimizer state`, "
            "`activations`, `temporaries`, `inputs`; on a GPU `blas workspaces`)",
        ),
        ("fit_seconds", _F, "s", "what the fit planner's fake run of the step took"),
        (
            "fit_check",
            _S,
            "",
            "distill_step rows: what became of the cell's fit check (the suite's `fit_check`): `checked` (the "
            "planner's prediction and the live peak beside it), `off` (`fit_check: false`, --no-fit-check) or "
            "`skipped (auto)` (`fit_check: auto` and a timed loop shorter than the pair's last fit check in its "
            "worker: the note says both times)",
        ),
        (
            "live_peak_bytes",
            _I,
            "bytes",
            "distill_step rows: the measured peak of live tensor bytes during one more step after the timed loop "
            "(not taken when the cell ran over its time budget): on GPUs the caching allocator's peak "
            "(max_memory_allocated, reset as the step starts), on the CPU the bytes of the live tensors before "
            "the step plus the peak of torch's allocations during it (its profiler's memory events), the worker's "
            "model cache left out; counted independently of the planner, and unlike peak_memory_bytes on the CPU "
            "not the process's resident memory (host_peak_bytes is that)",
        ),
        (
            "predicted_peak_ratio",
            _F,
            "ratio",
            f"live_peak_bytes / predicted_peak_bytes; outside {FIT_TOLERANCE[0]:.2f}–{FIT_TOLERANCE[1]:.2f} "
            "(kdbench.core.limits.FIT_TOLERANCE) the row's notes say so with both figures and the report flags it",
        ),
        (
            "predicted_step_ms",
            _F,
            "ms",
            "distill_step rows: the step-time model's prediction of one step (kdbench.fit.steptime): the fit "
            "planner's operator census of the step priced per operator (roofline with achievable fractions, a "
            "launch floor, ring collectives), from the run's probe of this device (its measured matmul and copy "
            "ceilings) where there is one, else the device table's datasheet figures, with the step's operator "
            "calls timed at their shapes on the row's own device (kdbench.measure.replay) in place of their "
            "roofline; null with a note (`fit: ...`) where neither is known or the cell is unpredictable",
        ),
        (
            "predicted_step_ratio",
            _F,
            "ratio",
            f"median_ms / predicted_step_ms; outside {STEP_TIME_TOLERANCE[0]:.2f}–{STEP_TIME_TOLERANCE[1]:.2f} "
            "(kdbench.core.limits.STEP_TIME_TOLERANCE) the row's notes say so with both figures",
        ),
        (
            "predicted_step_devices",
            _S,
            "",
            "distill_step rows: the same step predicted on other devices of the table (kdbench.fit.cost."
            "REPORT_DEVICES: H100 80GB, H200, MI300X, each with a peak for the cell's precision), JSON {device: "
            "{ms, per_s, unit}}: the fake run's census priced at the card's datasheet figures and published "
            "fractions (arithmetic, no other fake run; per_s: tokens for a token pair, LM or encoder, else "
            "samples, all ranks); the report's 'predicted on other devices' table; null where the step time is not "
            "predicted",
        ),
    ),
    *_group(
        DERIVED,
        (
            "speedup_vs_teacher",
            _F,
            "×",
            "teacher median / student median at this batch size, same run and cell (student_inference rows; on LM "
            "pairs student_prefill and student_decode rows, against the teacher's prefill and decode)",
        ),
        (
            "spec_speedup",
            _F,
            "×",
            "speculative_decode rows: the median of the same cell's batch-size-1 teacher_decode row (same run and "
            "repeat, the same decode_tokens) over this row's median: the teacher's speed-up from its draft, measured",
        ),
        (
            "spec_cost_ratio",
            _F,
            "ratio",
            "speculative_decode rows: c, the same cell's batch-size-1 student_decode median over its teacher_decode "
            "median (a draft forward's time over a target forward's)",
        ),
        (
            "spec_predicted_speedup",
            _F,
            "×",
            "speculative_decode rows: the speed-up predicted from spec_alpha, draft_tokens and spec_cost_ratio, "
            "(1 − α^(γ+1)) / ((1 − α)(γc + 1)) (Leviathan et al. 2023, Theorem 3.8)",
        ),
        (
            "spec_predicted_tokens_per_verify",
            _F,
            "tokens",
            "speculative_decode rows: the tokens per verify step predicted from spec_alpha and draft_tokens, "
            "(1 − α^(γ+1)) / (1 − α) (Leviathan et al. 2023, eq. 1), beside the measured spec_tokens_per_verify",
        ),
        (
            "scaling_efficiency",
            _F,
            "ratio",
            "throughput / (world_size × throughput of the same cell at "
            "world_size 1), when that cell is in the same run",
        ),
        ("achieved_tflops", _F, "TFLOP/s", "flops / median time, per device"),
        ("datasheet_device", _S, "", "the accelerator of the peak table this device matched"),
        (
            "datasheet_peak_tflops",
            _F,
            "TFLOP/s",
            "vendor dense peak at the cell's precision (kdbench.core.devices.CATALOGUE); for a distill_step whose "
            "live teacher runs at another precision, flops / (teacher_forward_flops / teacher's peak + the rest / "
            "student's peak)",
        ),
        (
            "mfu",
            _F,
            "ratio",
            "achieved_tflops / datasheet_peak_tflops; `flops` counts causal attention as executed (half the square "
            "on fused kernels, the whole on math: see attention_kernel), so rows of different kernels compare",
        ),
        (
            "ceiling_utilization",
            _F,
            "ratio",
            "achieved_tflops / ceiling_tflops (mixed steps: the ceilings of both precisions, weighted alike)",
        ),
        (
            "bandwidth_share",
            _F,
            "ratio",
            "decode rows: decode_bytes_per_token × tokens_per_s / (ceiling_gbps × 1e9): the share of the probe's "
            "measured bandwidth the decode's floor bytes reach (1: at the memory-bandwidth floor)",
        ),
        (
            "floor_ms_per_token",
            _F,
            "ms",
            "decode rows: decode_bytes_per_token / (ceiling_gbps × 1e9), in ms: the time per generated token at the "
            "bandwidth floor (its batch's tokens decode in parallel: a call's floor is decode_tokens × batch_size × "
            "this)",
        ),
        (
            "teacher_cache_saving_ms",
            _F,
            "ms",
            "cached and topk_cache distill_step rows: median of the same cell with a live teacher (same run) minus "
            "this median",
        ),
        (
            "teacher_cache_payback_steps",
            _I,
            "steps",
            "cached and topk_cache distill_step rows: steps after which the saving "
            "repays teacher_cache_ms (null when caching is not faster)",
        ),
        (
            "offline_saving_ms_per_token",
            _F,
            "ms",
            "teacher.mode offline distill_step rows: teacher_cache_saving_ms (the live twin's median minus this one) "
            "per token of the step (world_size × tokens: every rank's batch)",
        ),
        (
            "offline_payback_epochs",
            _F,
            "epochs",
            "teacher.mode offline distill_step rows: epochs over a corpus after which the steps' saving repays the "
            "store's build (build seconds per token / saving seconds per token: the same for any corpus size; "
            "null when the offline step is not faster)",
        ),
        (
            "offline_twin",
            _S,
            "",
            "teacher.mode offline distill_step rows: the live twin the saving and pay-back are measured against: "
            "`live` (one device), `live ddp`, or `live fsdp` (its teacher FSDP2-sharded: a world_size > 1 offline "
            "cell takes that twin where the run has it, else its DDP one)",
        ),
        (
            "lever_baseline_ms",
            _F,
            "ms",
            "rows with a one-off cost: the centre (geometric mean over repeats) of the same measurement of the same "
            "cell without its levers, in the same run, each repeat against the twin's same repeat",
        ),
        (
            "lever_gain_ms",
            _F,
            "ms",
            "what the levers save per call: the mean over repeats of the twin's median minus this cell's",
        ),
        (
            "lever_gain_low_ms",
            _F,
            "ms",
            "lower end of the gain's 95 % paired t-interval over repeats (null: one repeat)",
        ),
        ("lever_gain_high_ms", _F, "ms", "upper end of the gain's 95 % interval"),
        (
            "lever_one_off_net_ms",
            _F,
            "ms",
            "one_off_ms minus the twin's own cold_excess_ms (what the plain cell pays once anyway), mean over repeats",
        ),
        (
            "break_even_steps",
            _I,
            "calls",
            "calls (steps, or inference calls) after which lever_gain_ms repays lever_one_off_net_ms (null: never)",
        ),
        (
            "break_even_tokens",
            _I,
            "tokens",
            "decode rows: break_even_steps × tokens (new tokens per call, all sequences): the generated tokens after "
            "which a generation backend's one-off cost (a compiled decode step) is repaid (null: never)",
        ),
        (
            "break_even_low_steps",
            _I,
            "calls",
            "the fewest calls to break even that the gain's interval allows (at lever_gain_high_ms; null: never)",
        ),
        (
            "break_even_high_steps",
            _I,
            "calls",
            "the most calls to break even that the gain's interval allows (at lever_gain_low_ms; null: the interval "
            "reaches no gain, so possibly never)",
        ),
    ),
    *_group(
        QUALITY,
        ("quality_role", _S, "", "quality rows: `teacher`, `scratch` (student trained alone) or `distilled`"),
        (
            "teacher_overrides",
            _S,
            "",
            "quality rows of language models: the teacher's config overrides (sorted JSON; null without any)",
        ),
        ("student_overrides", _S, "", "quality rows of language models: the student's config overrides (as above)"),
        (
            "quality_dataset",
            _S,
            "",
            "quality rows: the real data set (`digits`, `imagefolder`, `cifar10`, `cifar100`; `python-stdlib`: text)",
        ),
        ("quality_epochs", _I, "epochs", "quality rows: training epochs"),
        (
            "quality_target",
            _F,
            "ratio",
            "quality rows: the target, as a fraction of the teacher's accuracy (text: the threshold is the teacher's "
            "perplexity per byte / target)",
        ),
        (
            "accuracy",
            _F,
            "ratio",
            "quality rows: top-1 test accuracy after the last epoch (text: of the next byte, over the held-out bytes; "
            "null for a student of its own tokenizer)",
        ),
        ("best_accuracy", _F, "ratio", "quality rows: best top-1 test accuracy over the epochs"),
        (
            "agreement",
            _F,
            "ratio",
            "quality rows: share of test samples where student and teacher predict the same class (text: the same "
            "next byte; null for a student of its own tokenizer)",
        ),
        (
            "time_to_target_s",
            _F,
            "s",
            "quality rows: training wall time until accuracy ≥ target × the teacher's (text: bits per byte ≤ the "
            "teacher's + log2(1 / target), i.e. perplexity per byte ≤ the teacher's / target), at epoch ends (null: "
            "not reached)",
        ),
        ("epochs_to_target", _I, "epochs", "quality rows: epochs until the target was reached"),
        ("train_time_s", _F, "s", "quality rows: total training wall time (evaluation excluded)"),
        (
            "tokenizer",
            _S,
            "",
            "text quality rows: the model's tokenizer: `bytes` (one token per byte), or a student's own "
            "(`bpe:<N> <sha256 of its vocabulary>`, trained on the training split)",
        ),
        (
            "perplexity",
            _F,
            "",
            "text quality rows: held-out perplexity after the last epoch, exp of the mean next-token cross-entropy "
            "(nats) over every held-out token predicted: per token of the row's tokenizer, so not comparable across "
            "tokenizers (bits_per_byte is)",
        ),
        ("best_perplexity", _F, "", "text quality rows: the lowest held-out perplexity over the epochs"),
        (
            "bits_per_byte",
            _F,
            "bits",
            "text quality rows: the total next-token cross-entropy over the held-out text in bits, over the bytes "
            "predicted (each window's bytes but its first, the same bytes whatever the tokenizer): comparable "
            "across tokenizers; for bytes, log2 perplexity",
        ),
        (
            "perplexity_by_epoch",
            pa.list_(_F),
            "",
            "text quality rows: the held-out perplexity after each epoch (against train_time_by_epoch_s)",
        ),
        (
            "train_time_by_epoch_s",
            pa.list_(_F),
            "s",
            "text quality rows: the training wall time accumulated by the end of each epoch",
        ),
        (
            "quality_corpus",
            _S,
            "",
            "text quality rows: what the corpus was (Python version, files per split, bytes per split, sha256 of "
            "the bytes): the same string, the same data",
        ),
        (
            "quality_train_tokens",
            _I,
            "tokens",
            "text quality rows: tokens (of the row's tokenizer; bytes for bytes) the model predicts per epoch",
        ),
        (
            "quality_test_tokens",
            _I,
            "tokens",
            "text quality rows: held-out tokens (of the row's tokenizer) predicted in each evaluation",
        ),
        (
            "draft_gammas",
            pa.list_(_I),
            "tokens",
            "text quality rows of students with `quality.speculative`: the draft lengths γ measured, the student "
            "proposing γ tokens per verify step of its seed's trained teacher (the order of the other draft_* lists)",
        ),
        (
            "draft_alpha",
            pa.list_(_F),
            "ratio",
            "per γ: the acceptance rate α, accepted / judged proposals over every prompt and round (proposals after "
            "a rejection are never judged)",
        ),
        (
            "draft_alpha_predicted",
            _F,
            "ratio",
            "the acceptance rate predicted from held-out text: 1 − the mean TV(p_teacher, p_student) at the "
            "temperature over the held-out positions (Leviathan et al. 2023, Corollary 3.6; temperature 0: the share "
            "where both argmax agree)",
        ),
        (
            "draft_accepted_per_verify",
            pa.list_(_F),
            "tokens",
            "per γ: the student's proposals the teacher accepted per verify step (0 to γ)",
        ),
        (
            "draft_tokens_per_verify",
            pa.list_(_F),
            "tokens",
            "per γ: the tokens generated per verify step, the accepted proposals and the teacher's own (1 to γ + 1)",
        ),
        (
            "draft_cost_ratio",
            _F,
            "ratio",
            "the cost ratio c: the student alone's median generation wall time over the teacher alone's, the same "
            "prompts, tokens and sampling",
        ),
        (
            "draft_speedup",
            pa.list_(_F),
            "x",
            "per γ: the measured speed-up, the teacher alone's median generation wall time over speculative decoding's "
            "with the student as draft (same prompts, tokens, temperature and generator seed)",
        ),
        (
            "draft_speedup_predicted",
            pa.list_(_F),
            "x",
            "per γ: the speed-up predicted from draft_alpha, γ and draft_cost_ratio, (1 − α^(γ+1)) / ((1 − α)(γc + 1)) "
            "(Leviathan et al. 2023, Theorem 3.8)",
        ),
        (
            "draft_protocol",
            _S,
            "",
            "how the draft_* figures were obtained: prompts, tokens, temperature, generator seed, repeats",
        ),
    ),
    *_group(
        ENVIRONMENT,
        ("device_name", _S, "", "GPU name, or the CPU model for cpu cells"),
        ("device_arch", _S, "", "GPU architecture (`gfx942`, `sm_90`, ...); CPU machine type for cpu"),
        (
            "device_arch_full",
            _S,
            "",
            "the architecture string as torch reports it (ROCm: with its feature suffix, "
            "e.g. `gfx942:sramecc+:xnack-`)",
        ),
        (
            "device_compute_units",
            _I,
            "",
            "the GPU's compute units (CUs on AMD, SMs on NVIDIA): fewer than the "
            "full chip's on a partitioned MI300X (CPX/DPX), whose peaks are scaled to them",
        ),
        ("device_count", _I, "", "visible GPUs (0 on a CPU-only machine)"),
        ("device_memory_bytes", _I, "bytes", "total memory of the device (host RAM for cpu)"),
        ("driver_version", _S, "", "GPU driver version where readable"),
        ("torch_version", _S, "", "torch.__version__"),
        ("torchvision_version", _S, "", "torchvision.__version__"),
        ("cuda_version", _S, "", "torch.version.cuda (null on ROCm and CPU builds)"),
        ("hip_version", _S, "", "torch.version.hip (null on CUDA and CPU builds)"),
        ("cudnn_version", _S, "", "torch.backends.cudnn.version(): cuDNN on CUDA, MIOpen on ROCm"),
        ("cpu_model", _S, "", "CPU model name"),
        ("cpu_threads", _I, "threads", "torch.get_num_threads() during the run (set explicitly)"),
        ("cpu_count", _I, "", "logical CPUs of the host"),
        ("hostname", _S, "", "host name"),
        ("os", _S, "", "platform.platform()"),
        ("python_version", _S, "", "Python version"),
        ("kdbench_version", _S, "", "kdbench version"),
        ("git_commit", _S, "", "kdbench git commit, when run from a checkout"),
        ("cudnn_benchmark", _B, "", "torch.backends.cudnn.benchmark"),
        ("blas_library", _S, "", "torch.backends.cuda.preferred_blas_library() on GPUs"),
        ("cpu_capability", _S, "", "the CPU kernels torch dispatches to (`AVX2`, `AVX512`, ...)"),
        (
            "float32_matmul_precision",
            _S,
            "",
            "the fp32 matmul setting the measurement ran with: `ieee` or `tf32` "
            "(torch.backends.cuda.matmul.fp32_precision), or on torch < 2.9 torch.get_float32_matmul_precision() "
            "(`highest` keeps fp32 GEMMs exact)",
        ),
        (
            "tf32_matmul",
            _B,
            "",
            "fp32 matmuls ran in TF32 (read in the worker, for this measurement: only `tf32` cells set it)",
        ),
        (
            "tf32_cudnn",
            _B,
            "",
            "fp32 cuDNN/MIOpen convolutions ran in TF32 (read in the worker, for this "
            "measurement; torch's own default is on, kdbench sets it off but for `tf32` cells)",
        ),
        (
            "bf16_reduced_reduction",
            _B,
            "",
            "bf16 GEMMs may reduce in reduced precision (torch.backends.cuda.matmul."
            "allow_bf16_reduced_precision_reduction, torch's default on; cuBLAS/hipBLASLt only), read in the "
            "worker for this measurement: part of a bf16 cell's arithmetic and of its ledger's error (null where "
            "torch lacks it)",
        ),
        (
            "fp16_reduced_reduction",
            _B,
            "",
            "the same switch for fp16 GEMMs (allow_fp16_reduced_precision_reduction)",
        ),
        (
            "miopen_cache_warm",
            _B,
            "",
            "ROCm: MIOpen's find-db or kernel cache held entries when the run started (null elsewhere)",
        ),
        (
            "tunableop_cache_warm",
            _B,
            "",
            "TunableOp enabled and its results file present when the run started (null when disabled)",
        ),
        ("env_knobs", _S, "", "JSON of speed-changing environment variables (MIOPEN_*, PYTORCH_TUNABLEOP_*, ...)"),
    ),
)

COLUMN_NAMES = tuple(c.name for c in COLUMNS)
DERIVED_COLUMNS = tuple(c.name for c in COLUMNS if c.derived)
ENVIRONMENT_COLUMNS = tuple(c.name for c in COLUMNS if c.group == ENVIRONMENT)
_METADATA = {"kdbench_schema_version": str(SCHEMA_VERSION)}
SCHEMA = pa.schema([pa.field(c.name, c.type) for c in COLUMNS]).with_metadata(_METADATA)  # what readers get
STORED_SCHEMA = pa.schema([pa.field(c.name, c.type) for c in COLUMNS if not c.derived]).with_metadata(_METADATA)


STORED_COLUMNS = {c.name: c for c in COLUMNS if not c.derived}


def _accepts(type_: pa.DataType, value: Any) -> bool:
    """Whether ``value`` can be stored in a column of ``type_`` (None always can)."""
    if value is None:
        return True
    if pa.types.is_boolean(type_):
        return isinstance(value, (bool, np.bool_))
    if pa.types.is_integer(type_):
        return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
    if pa.types.is_floating(type_):
        return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    if pa.types.is_string(type_):
        return isinstance(value, str)
    if pa.types.is_timestamp(type_):
        return isinstance(value, datetime)
    if pa.types.is_list(type_):
        return hasattr(value, "__len__") and not isinstance(value, (str, bytes, Mapping))
    return True


class Row(dict):
    """One result row: a ``dict`` of stored columns (:data:`COLUMNS`), checked as it is made and whenever a
    value is set or updated, so that a misspelled column or a value of the wrong type is an error where it is
    written, not when the part is stored.  Columns left out are null in the part.  A row crosses process
    boundaries and reads like any dict."""

    __slots__ = ()

    def __init__(self, *args: Mapping[str, Any] | Iterable[tuple[str, Any]], **values: Any) -> None:
        super().__init__()
        self.update(*args, **values)

    def __setitem__(self, key: str, value: Any) -> None:
        column = STORED_COLUMNS.get(key)
        if column is None:
            known = "derived at read time" if key in DERIVED_COLUMNS else "not a column of kdbench.core.schema.COLUMNS"
            raise KeyError(f"result row: {key!r} is {known}")
        if not _accepts(column.type, value) and not (isinstance(value, float) and math.isnan(value)):
            raise TypeError(f"result row: {key} is {column.type}, got {type(value).__name__} {value!r:.60}")
        super().__setitem__(key, value)

    def update(self, *args: Any, **values: Any) -> None:  # type: ignore[override]
        for key, value in dict(*args, **values).items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def copy(self) -> Row:
        return Row(self)

    def __or__(self, other: Mapping[str, Any]) -> Row:  # type: ignore[override]
        return Row({**self, **other})

    def __reduce__(self):  # pickles as a Row (the checks run again where it lands)
        return (Row, (dict(self),))


def rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Rows (:class:`Row` or dicts) to a table in STORED_SCHEMA; an unknown or derived key is a bug, a missing
    one null."""
    stored = set(STORED_SCHEMA.names)
    for row in rows:
        extra = set(row) - stored
        if extra:
            raise ValueError(f"row has columns that are not stored (unknown or derived): {sorted(extra)}")
    data = {name: [row.get(name) for row in rows] for name in STORED_SCHEMA.names}
    return pa.Table.from_pydict(data, schema=STORED_SCHEMA)


def schema_markdown() -> str:
    """The results schema as the Markdown table docs/results.md carries (generated: python -m kdbench.docgen)."""
    lines = ["| column | type | unit | meaning |", "|---|---|---|---|"]
    for c in COLUMNS:
        doc = c.doc.replace("|", "\\|") + (" *(derived at read time)*" if c.derived else "")
        lines.append(f"| `{c.name}` | `{c.type}` | {c.unit} | {doc} |")  # in backticks: list<...> is no HTML tag
    return "\n".join(lines)
