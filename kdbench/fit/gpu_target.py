"""What a GPU does differently from the CPU in a cell's fake run, so that a prediction for a GPU counts a GPU's bytes.

The planner's fake run is the CPU's whatever device is asked about (fake CUDA tensors are not usable without a
GPU: SDPA falls to its math kernel and autograd's backward needs a device).  Some of the CPU's operator choices
move a GPU step's bytes (gpu-review-4 M5); :class:`GpuTarget` replaces them for a ``cuda`` or ``rocm`` target
(ROCm runs CUDA's autocast lists and kernels' choices: its tensors are ``cuda`` ones).  A ``cpu`` target's fake
run is left as it was.

1. **Autocast's op lists.**  Under CUDA's autocast ``layer_norm``, ``softmax``, ``log_softmax``, ``exp``, ``pow``,
   ``rsqrt``, ``sum``, ``cumsum``, ``logsumexp`` and the rest of :data:`CUDA_FP32` / :data:`CUDA_FP32_SET_OPT_DTYPE`
   return float32 from 16-bit inputs; the CPU's autocast leaves them 16-bit.  BERT's eager attention softmax, one
   (B, H, S, S) tensor per layer, is float32 on a GPU.  While the step's autocast is on, CUDA's policy is put in
   the CPU's (:func:`cuda_autocast_lists`): a Python kernel at the ``AutocastCPU`` dispatch key per op of CUDA's
   lists, which casts as CUDA's wrapper does (the float32 copies of 16-bit inputs included, which the meter then
   sees), and a fallthrough for the ops only the CPU's lists hold (``cross_entropy_loss``, ``cat``, the 3-d
   pools, ...).  The lists are torch 2.14's, transcribed once here from ``ATen/autocast_mode.h`` (the
   ``AT_FORALL_*`` macros, shipped in the wheel under ``torch/include``) and ``aten/src/ATen/autocast_mode.cpp``
   (``TORCH_LIBRARY_IMPL(aten, Autocast, m)``); a test holds them against that header and this torch's
   dispatcher.  Not copied: the cache of weight casts for the lower-precision ops CUDA's list has and the
   CPU's lacks (``einsum``, ``addmv``, ``mv``, the RNN cells: no kdbench model runs them).
2. **Attention with dropout.**  The CPU's flash kernel refuses dropout, so a training BERT's SDPA (dropout 0.1)
   runs the math kernel with (B, H, S, S) scores, probabilities and a dropout mask, its 16-bit inputs upcast to
   float32.  CUDA's flash kernel (16-bit) and memory-efficient kernel (float32, or with a mask) take dropout as a
   philox counter and keep only the output and a float32 logsumexp.  Rule: on a GPU target an SDPA call with
   ``dropout_p > 0`` runs on the fake tensors with ``dropout_p = 0``, where the CPU picks its flash kernel, whose
   saved tensors are that output and logsumexp.  The philox seed and offset (two int64 scalars; on the host on
   CUDA, on the device on ROCm) are not counted.
3. **Dropout.**  A CUDA tensor's ``dropout`` is the fused ``native_dropout``, whose backward keeps a bool mask
   (1 byte an element); the CPU's multiplies by a noise tensor of the input's dtype (2 or 4 bytes), which the
   backward keeps (``aten/src/ATen/native/Dropout.cpp``, ``is_fused_kernel_acceptable``).  On a GPU target a
   training ``dropout`` (not in place: that one is never fused) runs as ``native_dropout``.
4. **Sort's workspace.**  A CUDA ``sort`` along a dimension longer than 4,096 (``should_use_small_sort``,
   ``ATen/native/cuda/Sort.h``) runs CUB radix sorts whose buffers come from the caching allocator beside the
   sort's outputs (ULD sorts two (rows, V) probability tensors per chunk): :func:`sort_workspace_bytes`, an
   estimate, counted as a transient tensor while the outputs are alive (``LiveBytes.workspace``).
5. **The optimizer's default.**  An optimizer left to its default (``optimizer.impl: default``: neither ``foreach``
   nor ``fused`` given) runs torch's multi-tensor ``foreach`` implementation when every parameter is a plain tensor
   on a CUDA device, and the per-tensor loop on the CPU (``torch/optim/optimizer.py``,
   ``_default_to_fused_or_foreach``; FSDP2's DTensor parameters take the loop there too).  Its temporaries are
   lists over every parameter at once (Adam's ``_foreach_sqrt`` of the second moments: a float32 copy of them all,
   where the loop holds one parameter's) and it launches a kernel per operation, not per parameter
   (:meth:`GpuTarget.optimizer`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kdbench.fit.tracker import LiveBytes

GPU_TARGETS = ("cuda", "rocm")  # the device types whose fake run gets this module's GPU operator choices

# --- CUDA's autocast lists (torch 2.14: ATen/autocast_mode.h AT_FORALL_*, aten/src/ATen/autocast_mode.cpp) -------
# "op" or "op.overload" as the dispatcher names them (without "aten::").

# lower_precision_fp: inputs cast to the autocast dtype.  Only those the CPU's list lacks get a kernel here (the
# CPU's own kernels, with their cache of weight casts, keep the rest: linear, matmul, bmm, conv*, SDPA, ...).
CUDA_LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
    "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)  # fmt: skip
# fp32: every floating input (but float64) cast to float32
CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
    "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)  # fmt: skip
# fp32_set_opt_dtype: an eligible first input runs with dtype=float32 unless a dtype was given
CUDA_FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)  # fmt: skip
# softmax(x, dim, dtype=float32) of a CUDA float16 x: aten's half-to-float kernel (aten/src/ATen/native/SoftMax.cpp)
HALF_TO_FLOAT = {"softmax.int": torch.ops.aten._softmax.default, "log_softmax.int": torch.ops.aten._log_softmax.default}
# fp32_append_dtype: redispatched to the overload that takes a dtype, with float32
CUDA_FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
# promote: the widest floating input's dtype (float32 over the autocast dtype; float64 ignored)
CUDA_PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot",
    "scatter_add",
)  # fmt: skip
CUDA_BANNED = ("binary_cross_entropy",)  # raises under CUDA's autocast
BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast (CUDA's autocast raises "
    "for them); use binary_cross_entropy_with_logits"
)

# CUB's buffers of a CUDA sort (estimates; see sort_workspace_bytes)
SMALL_SORT = 4096  # ATen/native/cuda/Sort.h should_use_small_sort: an in-place bitonic sort up to this length
INT_MAX = 2**31 - 1


# ------------------------------------------------------------------ autocast


def _overload(name: str) -> torch._ops.OpOverload:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _eligible(t: Any) -> bool:
    """CUDA's ``is_eligible``: a floating tensor that is not float64 (on the device: every fake tensor here)."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """CUDA's ``cached_cast`` of one argument (a tensor, a list of them, or anything else, left)."""
    if isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor) for v in value):
        cast = [_cast(v, dtype) for v in value]
        return cast if isinstance(value, list) else tuple(cast)
    return value.to(dtype) if _eligible(value) and value.dtype != dtype else value


_NO_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _below_autocast(op: Callable, args: tuple, kwargs: dict) -> Any:
    """Run ``op`` with the CPU's autocast excluded for it and everything it calls, as CUDA's wrappers do."""
    with torch._C._ExcludeDispatchKeyGuard(_NO_AUTOCAST):
        return op(*args, **kwargs)


def _positional(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple:
    """``args`` with the positional arguments the caller left out at their schema defaults."""
    out = list(args)
    for a in op._schema.arguments[len(args) :]:
        if a.kwarg_only or a.name in kwargs or not a.has_default_value():
            break
        out.append(a.default_value)
    return tuple(out)


def _kernel(policy: str, name: str) -> Callable:
    """The ``AutocastCPU`` kernel of ``name`` under CUDA's ``policy`` (the wrappers of ``autocast_mode.h``)."""
    op = _overload(name)

    def cast_all(dtype: torch.dtype) -> Callable:
        def kernel(*args, **kwargs):
            to = torch.get_autocast_dtype("cpu") if dtype is None else dtype
            return _below_autocast(op, _cast(args, to), {k: _cast(v, to) for k, v in kwargs.items()})

        return kernel

    at = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), -1)  # the dtype argument

    def set_opt_dtype(*args, **kwargs):
        if args and _eligible(args[0]):  # else as called: CUDA's wrapper leaves an ineligible call alone
            if at < len(args):
                args = (*args[:at], torch.float32 if args[at] is None else args[at], *args[at + 1 :])
            elif kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
            dtype = args[at] if at < len(args) else kwargs["dtype"]
            if name in HALF_TO_FLOAT and args[0].dtype == torch.float16 and dtype == torch.float32:
                # SoftMax.cpp: a CUDA fp16 input runs the half-to-float kernel, no float32 copy of the input
                return _below_autocast(HALF_TO_FLOAT[name], (args[0], args[1], True), {})
        return _below_autocast(op, args, kwargs)

    def append_dtype(*args, **kwargs):
        dtype = torch.float32 if _eligible(args[0]) else args[0].dtype
        full = _overload(CUDA_FP32_APPEND_DTYPE[name])
        return _below_autocast(full, _positional(op, args, kwargs), {**kwargs, "dtype": dtype})

    def promote(*args, **kwargs):
        to = _widest(torch.get_autocast_dtype("cpu"), [*args, *kwargs.values()])
        return _below_autocast(op, _cast(args, to), {k: _cast(v, to) for k, v in kwargs.items()})

    def banned(*args, **kwargs):
        raise RuntimeError(BANNED_MESSAGE)

    kernels = {
        "fp32": cast_all(torch.float32),
        "lower": cast_all(None),
        "set_opt_dtype": set_opt_dtype,
        "append_dtype": append_dtype,
        "promote": promote,
        "banned": banned,
    }
    return kernels[policy]


def _widest(lower: torch.dtype, values: list) -> torch.dtype:
    """CUDA's ``promote_type``: float32 if an eligible input is float32, else the autocast dtype (an eligible input
    of another 16-bit dtype raises there, and here)."""
    found = lower
    for v in values:
        for t in v if isinstance(v, list | tuple) else (v,):
            if not _eligible(t):
                continue
            if t.dtype == torch.float32 or found == torch.float32:
                found = torch.float32
            elif t.dtype != lower:
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return found


def _has_autocast_kernel(name: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", key)


def _exists(name: str) -> bool:
    try:
        _overload(name)
    except (AttributeError, RuntimeError):  # an op this torch has not (the lists are torch 2.14's)
        return False
    return True


def cuda_policy() -> dict[str, str]:
    """Op name -> the policy this module gives it at ``AutocastCPU`` for a GPU target: ``fp32``,
    ``set_opt_dtype``, ``append_dtype``, ``promote``, ``lower`` (CUDA lower-precision ops the CPU's list lacks),
    ``banned``, or ``fallthrough`` (ops only the CPU's lists hold).  The rest keep the CPU's kernel (the
    lower-precision ops of both lists, and ``linalg_matrix_sqrth``, in both outside the ``AT_FORALL_*`` lists)."""
    policy = {name: "lower" for name in CUDA_LOWER_PRECISION_FP if not _has_autocast_kernel(name, "AutocastCPU")}
    policy |= {name: "fp32" for name in CUDA_FP32}
    policy |= {name: "set_opt_dtype" for name in CUDA_FP32_SET_OPT_DTYPE}
    policy |= {name: "append_dtype" for name in CUDA_FP32_APPEND_DTYPE}
    policy |= {name: "promote" for name in CUDA_PROMOTE}
    policy |= {name: "banned" for name in CUDA_BANNED}
    for full in torch._C._dispatch_get_all_op_names():
        if full.startswith("aten::"):
            name = full[len("aten::") :]
            if _has_autocast_kernel(name, "AutocastCPU") and not _has_autocast_kernel(name, "AutocastCUDA"):
                policy[name] = "fallthrough"
    return {name: p for name, p in policy.items() if _exists(name)}


@contextlib.contextmanager
def cuda_autocast_lists() -> Iterator[None]:
    """CUDA's autocast policy in the CPU's autocast (:func:`cuda_policy`), for this context: registered at the
    ``AutocastCPU`` key of this process's dispatcher and removed on the way out (the CPU's own kernels return).
    Process-wide while open: a fake run is the only CPU autocast a planning process runs."""
    global _open
    lib = None
    _open += 1  # the dispatcher is the process's: registered once, however many contexts are open
    try:
        if _open == 1:
            lib = torch.library.Library("aten", "IMPL")
            for name, policy in cuda_policy().items():
                kernel = torch.library.fallthrough_kernel if policy == "fallthrough" else _kernel(policy, name)
                lib.impl(name, kernel, "AutocastCPU")
        yield
    finally:
        _open -= 1
        if lib is not None:
            lib._destroy()


_open = 0  # cuda_autocast_lists contexts open


# ------------------------------------------------------------------ attention


class FusedKernels(TorchFunctionMode):
    """A GPU's fused attention and dropout kernels in the fake run (rules 2 and 3 of the module's docstring), by
    the functions a model calls (``torch.nn.functional.scaled_dot_product_attention`` and ``dropout``)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = 0  # SDPA calls with dropout counted as the fused kernel's
        self.dropouts = 0  # dropouts counted as native_dropout's

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            if len(args) > 4 and args[4]:  # (query, key, value, attn_mask, dropout_p, ...)
                args = (*args[:4], 0.0, *args[5:])
                self.attention += 1
            elif kwargs.get("dropout_p"):
                kwargs = {**kwargs, "dropout_p": 0.0}
                self.attention += 1
        elif func is torch.nn.functional.dropout or func is torch.dropout:
            names = ("input", "p", "training", "inplace") if func is not torch.dropout else ("input", "p", "train")
            bound = {**dict(zip(names, args, strict=False)), **kwargs}
            x, p = bound["input"], bound.get("p", 0.5)
            train = bound.get("training", bound.get("train", True))
            # Dropout.cpp is_fused_kernel_acceptable (a CUDA tensor); the in-place form is never fused
            if train and not bound.get("inplace", False) and 0 < p < 1 and x.numel() > 0:
                self.dropouts += 1
                return torch.native_dropout(x, p, True)[0]
        return func(*args, **kwargs)


# ------------------------------------------------------------------ sort


def sort_workspace_bytes(shape: tuple[int, ...], dim: int, key_bytes: int) -> int:
    """What a CUDA ``sort`` of a contiguous tensor of ``shape`` along ``dim`` allocates beside its values and
    int64 indices, an estimate from torch 2.14's ``aten/src/ATen/native/cuda/SortStable.cu`` and CUB's
    ``DispatchSegmentedRadixSort``/``DispatchRadixSort``:

    - up to 4,096 along ``dim``: nothing (an in-place bitonic sort);
    - one segment (or a dimension of a million): an int64 index buffer (8 per element) and CUB's temporary
      storage, a third key and value buffer (``key_bytes + 8``, its ``SortPairs`` not allowed to overwrite its
      input), 16 + ``key_bytes`` per element;
    - 2 to 127 segments (``segmented_sort_pairs_by_full_sort``): two int2 buffers (16), the sorted keys (CUB's
      ``keys_out``, ``key_bytes``) and CUB's third key and int2 value buffer (``key_bytes + 8``):
      24 + 2·``key_bytes`` per element;
    - 128 segments or more (``segmented_sort_pairs``): a reverse-index buffer (8) and CUB's third key and value
      buffer, 16 + ``key_bytes`` per element.

    Per batch of at most 2³¹ − 1 elements (torch sorts larger tensors in such batches, one after the other).
    CUB's radix histogram (the device-wide sort's spine, kilobytes) is left out.  ROCm's hipCUB/rocPRIM is
    taken to need the same (not checked)."""
    if not shape:
        return 0
    nsort = shape[dim]
    numel = 1
    for size in shape:
        numel *= size
    if nsort <= SMALL_SORT or numel == 0:
        return 0
    n = (min(numel, INT_MAX) // nsort) * nsort  # the elements of one batch
    segments = n // nsort
    if segments == 1 or nsort >= 1_000_000:
        return nsort * (16 + key_bytes)
    if segments < 128:
        return n * (24 + 2 * key_bytes)
    return n * (16 + key_bytes)


class _SortWorkspace:
    """The tracker's workspace hook on a GPU target: a sort's CUB buffers (:func:`sort_workspace_bytes`)."""

    def __init__(self) -> None:
        self.largest = 0
        self.sorts = 0

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> int:
        if getattr(func, "overloadpacket", None) is not torch.ops.aten.sort:
            return 0
        names = [a.name for a in func._schema.arguments]
        bound = {**dict(zip(names, args, strict=False)), **kwargs}
        self_ = bound.get("self")
        if not isinstance(self_, torch.Tensor):
            return 0
        dim = bound.get("dim", -1)
        dim = dim if isinstance(dim, int) else -1
        found = sort_workspace_bytes(tuple(self_.shape), dim, self_.element_size())
        if found:
            self.sorts += 1
            self.largest = max(self.largest, found)
        return found


# ------------------------------------------------------------------ the target


def is_gpu_target(device_type: str) -> bool:
    return device_type in GPU_TARGETS


class GpuTarget:
    """The fake run's GPU operator choices for ``device_type`` (nothing for a CPU target): enter it inside the
    fake mode and the meter (``tracker``); :attr:`notes` says afterwards what it changed."""

    def __init__(self, device_type: str, tracker: LiveBytes) -> None:
        self.gpu = is_gpu_target(device_type)
        self.tracker = tracker
        self.kernels = FusedKernels()
        self.sort = _SortWorkspace()
        self.foreach = False  # the optimizer's default run as a GPU's (rule 5)
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> GpuTarget:
        if not self.gpu:
            return self
        stack = contextlib.ExitStack()
        stack.enter_context(cuda_autocast_lists())
        stack.enter_context(self.kernels)
        self.tracker.workspace = self.sort
        stack.callback(setattr, self.tracker, "workspace", None)
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def optimizer(self, optimizer: torch.optim.Optimizer, impl: str) -> None:
        """Rule 5: on a GPU target an optimizer left to its default (``impl`` ``default``) runs as torch picks it for
        CUDA parameters: ``foreach``, unless a parameter is no plain tensor (FSDP2's DTensors)."""
        if not self.gpu or impl != "default":
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if any(type(p).__name__ == "DTensor" or hasattr(p, "_local_tensor") for p in params):
            return
        for group in optimizer.param_groups:
            if group.get("foreach") is None and not group.get("fused") and not group.get("differentiable"):
                group["foreach"] = True
                self.foreach = True  # unsaid, as autocast's lists: every GPU cell's default optimizer

    @property
    def notes(self) -> tuple[str, ...]:
        """What the fake run counted of a GPU's own (autocast's lists, applied to every GPU cell, go unsaid)."""
        out = []
        if self.kernels.attention:
            out.append("SDPA with dropout counted as a GPU's fused kernel holds it (output and logsumexp, no S × S)")
        if self.sort.sorts:
            mib = self.sort.largest / 2**20
            out.append(f"a GPU sort's CUB workspace counted (estimated; the largest {mib:,.1f} MiB)")
        return tuple(out)
