"""Causal language models for distillation, with random weights (issue 23).

The shapes people distil (Llama 3.x, Qwen2.5, GPT-2) are held here as the numbers of
their published ``config.json`` files, and built from Hugging Face ``transformers``
model classes with random weights: nothing is downloaded, no hub is reached (no
``from_pretrained``).  A tiny Llama teacher and student are there for the CPU and the
tests.

A cell's LM is built by :func:`make_lm` (a registered name, a ``config.json`` path or a
``module:callable``) and wrapped in :class:`CausalLM` for distillation: its forward returns the
final hidden states, and its LM head is applied apart (:meth:`CausalLM.logits`, or by the loss
through :meth:`CausalLM.head_weights`).

``transformers`` is imported only inside the functions, so ``kdbench`` imports
without it; a function that needs it and finds it missing raises a
:class:`~kdbench.core.errors.KdbenchError` naming the extra (``pip install 'kdbench[lm]'``, or
``pip install -e '.[lm]'`` in a clone: :func:`kdbench.core.install.extra_hint`); one that does not work with the
installed torch is said the same way (:func:`kdbench.core.install.check_transformers`).

The registered shapes are the data table :mod:`kdbench.models.lm_configs`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kdbench.core.errors import KdbenchError, did_you_mean
from kdbench.core.install import check_transformers, extra_hint
from kdbench.models.config_checks import check_config_fields
from kdbench.models.hub import hf_config_path, is_callable_name, is_hf_name
from kdbench.models.lm_configs import LM_CONFIGS


def transformers_module():
    try:
        import transformers
    except ImportError as e:
        raise KdbenchError(f"the language models need Hugging Face transformers ({e}): {extra_hint('lm')}") from None
    check_transformers()
    return transformers


def config_class_named(class_name: str):
    transformers = transformers_module()
    try:
        return getattr(transformers, class_name)
    except AttributeError:
        raise KdbenchError(
            f"transformers {transformers.__version__} has no {class_name}; upgrade it: {extra_hint('lm')}"
        ) from None


def is_lm_model(name: str) -> bool:
    """A registered language model's name, a local transformers ``config.json``, or ``hf:ORG/NAME`` (its config in
    the local Hugging Face cache: :mod:`kdbench.models.hub`)."""
    return name in LM_CONFIGS or name.endswith(".json") or is_hf_name(name)


def registered_lm(name: str) -> dict[str, Any]:
    if not isinstance(name, str) or name not in LM_CONFIGS:
        hint = did_you_mean(str(name), LM_CONFIGS)
        raise KdbenchError(f"unknown language model {name!r}; {hint}known: {', '.join(LM_CONFIGS)}")
    return LM_CONFIGS[name]


def lm_config(name: str, overrides: dict[str, Any] | None = None):
    """The ``transformers`` config of registered model ``name``, with ``overrides``
    (any config field, e.g. ``{"num_hidden_layers": 2}``) applied."""
    entry = registered_lm(name)
    config_class = config_class_named(entry["config_class"])
    overrides = dict(overrides or {})
    check_config_fields(config_class, overrides, f"override for {name}")
    return config_class(**copy.deepcopy({**entry["config"], **overrides}))  # transformers fills dicts in place


def lm_config_from_file(path: str | Path):
    """The ``transformers`` config of a local ``config.json`` (its class picked by
    ``model_type``, which must name a causal-LM architecture ``transformers`` knows)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise KdbenchError(f"cannot read model config {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise KdbenchError(f"model config {path} is not JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(data, dict):
        raise KdbenchError(f"model config {path} must hold a JSON object, not {type(data).__name__}")
    model_type = data.get("model_type")
    if not isinstance(model_type, str):
        raise KdbenchError(f'model config {path} has no "model_type" string (e.g. "llama", "qwen2", "gpt2")')
    transformers_module()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type not in CONFIG_MAPPING:
        hint = did_you_mean(model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, quote=True)
        raise KdbenchError(
            f"model config {path}: model_type {model_type!r} is no causal LM transformers knows; {hint}".rstrip(
                "; "
            ).rstrip()
        )
    config_class = CONFIG_MAPPING[model_type]
    return config_class.from_dict({k: v for k, v in data.items() if k != "model_type"})


def _resolve_config(name_or_config, overrides: dict[str, Any] | None):
    if is_hf_name(name_or_config):
        config = lm_config_from_file(hf_config_path(name_or_config))
    elif isinstance(name_or_config, Path) or (
        isinstance(name_or_config, str) and name_or_config not in LM_CONFIGS and name_or_config.endswith(".json")
    ):
        config = lm_config_from_file(name_or_config)
    elif isinstance(name_or_config, str):
        return lm_config(name_or_config, overrides)
    else:
        transformers = transformers_module()
        if not isinstance(name_or_config, transformers.PretrainedConfig):
            raise KdbenchError(
                f"a language model is a registered name, a config.json path or a transformers config, "
                f"not {type(name_or_config).__name__}"
            )
        config = copy.deepcopy(name_or_config)
    if overrides:
        check_config_fields(type(config), overrides, f"override for {type(config).__name__}")
        for key, value in copy.deepcopy(overrides).items():
            setattr(config, key, value)
        # Qwen2-style per-layer attention types follow the layer count when they were uniform.
        layer_types = getattr(config, "layer_types", None)
        follows = "num_hidden_layers" in overrides and "layer_types" not in overrides
        if follows and layer_types and len(set(layer_types)) == 1:
            config.layer_types = [layer_types[0]] * config.num_hidden_layers
    return config


def _causal_lm_class(config):
    transformers_module()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise KdbenchError(f"{type(config).__name__} has no causal-LM model class in transformers") from None


def build_lm(
    name_or_config,
    overrides: dict[str, Any] | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """The causal LM of ``name_or_config`` (a registered name, a ``config.json`` path or a
    ``transformers`` config) with random weights, built directly on ``device`` (``"meta"``
    allocates nothing) in ``dtype``, in eval mode, with SDPA attention where the class has it."""
    config = _resolve_config(name_or_config, overrides)
    model_class = _causal_lm_class(config)
    transformers = transformers_module()
    kwargs: dict[str, Any] = {}
    if getattr(model_class, "_supports_sdpa", False):
        kwargs["attn_implementation"] = "sdpa"
    return from_config(transformers.AutoModelForCausalLM, config, kwargs, dtype, device)


def from_config(auto_class, config, kwargs: dict[str, Any], dtype, device) -> nn.Module:
    """``auto_class.from_config`` with random weights, built directly on ``device`` in ``dtype`` (the keyword is
    ``dtype`` from transformers 5, ``torch_dtype`` before), in eval mode.  Off the CPU or below float32 its random
    draws come from the host's generator in float32, one tensor at a time (:func:`kdbench.models.seeded.host_draws`):
    seeded alike, the weights equal a float32 CPU build's, cast, wherever and in whatever dtype it is built."""
    from kdbench.models.seeded import host_draws, needs_host_draws

    if dtype is not None:
        major = int(transformers_module().__version__.split(".")[0])
        kwargs = {**kwargs, "dtype" if major >= 5 else "torch_dtype": dtype}
    where = torch.device(device) if device is not None else contextlib.nullcontext()
    with where, host_draws(needs_host_draws(device, dtype)):
        model = auto_class.from_config(config, **kwargs)
    return model.eval()


def lm_parameter_count(name_or_config, overrides: dict[str, Any] | None = None) -> int:
    """Parameters of the model, built on the meta device (no memory), tied embeddings
    counted once (as ``model.num_parameters()``)."""
    model = build_lm(name_or_config, overrides, device="meta")
    unique = {id(p): p for p in model.parameters()}
    return sum(p.numel() for p in unique.values())


def make_lm(name: str, overrides: dict[str, Any], allow_imports: bool) -> nn.Module:
    """The LM ``name`` with random weights: a registered name, a ``config.json`` path or ``hf:ORG/NAME``
    (:func:`build_lm`, with ``overrides``), or a ``module:callable`` (imported; with ``allow_imports``, and no
    overrides)."""
    if is_callable_name(name):
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


def model_config(name: str, overrides: dict[str, Any]):
    """The transformers config :func:`make_lm` builds ``name`` from (None for a ``module:callable``)."""
    if is_callable_name(name):
        return None
    return _resolve_config(name, overrides or None)


# transformers' model types whose decoder layers are all built alike from the config (per-layer lists aside:
# checked in uniform_layers)
UNIFORM_LAYERS = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gpt2", "phi3", "gemma", "granite", "olmo2", "starcoder2"}
)


def uniform_layers(config) -> bool:
    """Whether a transformers config's decoder layers are all built alike: a model type of :data:`UNIFORM_LAYERS`
    whose per-layer lists (``layer_types``: sliding-window or full attention) hold one value each."""
    if getattr(config, "model_type", None) not in UNIFORM_LAYERS:
        return False
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        return False
    for value in config.to_dict().values():
        if isinstance(value, (list, tuple)) and len(value) == layers and len({repr(v) for v in value}) > 1:
            return False
    return True


def layer_stack(name: str, overrides: dict[str, Any]) -> int | None:
    """The layers of LM ``name`` (with ``overrides``) where they are alike (:func:`uniform_layers`), else None: a
    ``module:callable`` (the user's code builds it), a config that does not build (its run says why)."""
    if is_callable_name(name):
        return None
    try:
        config = model_config(name, dict(overrides))
    except KdbenchError:
        return None
    return int(config.num_hidden_layers) if uniform_layers(config) else None


def max_positions(config) -> int | None:
    """The positions a config's model takes (``max_position_embeddings``; None where it has none)."""
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) else None


@contextlib.contextmanager
def as_measured_batches() -> Any:
    """transformers' packed-sequence check answered, for a fake run (:mod:`kdbench.fit`), as a real run answers it.

    Every forward without an attention mask or a cache reads its position ids back to find packed sequences
    (``masking_utils.find_packed_sequence_indices``, transformers 5.x); a fake tensor has no values, so
    transformers takes it for a traced graph and builds a full B x 1 x S x S mask that the real run, which
    finds one sequence per row in kdbench's batches (position ids 0..S-1), never builds.

    A process that has not imported transformers runs no transformers model: nothing to answer, and transformers
    is not imported for it (3.6 s of a vision worker's start here)."""
    if "transformers" not in sys.modules:
        yield
        return
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    saved = getattr(masking_utils, "find_packed_sequence_indices", None)
    if saved is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = saved


class CausalLM(nn.Module):
    """A causal LM whose forward is ids -> final hidden states (B, S, H), its LM head applied apart
    (:meth:`logits`, or by a loss implementation through :meth:`head_weights`); a module that maps ids to
    logits (no transformers model) is wrapped too, with no ``head``, its forward's output the logits.

    ``fsdp_root``: the FSDP2 module whose root parameters (embeddings, final norm, LM head) this model's head
    lives in, once :func:`kdbench.measure.parallel.shard` has sharded it (None otherwise): the loss gathers
    them around the head, which runs outside the forward (where FSDP2 has resharded them).  It is held in a
    tuple, so that it is no submodule (the root is this model or holds it: no module cycle)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
        self.hf = head is not None and hasattr(lm, "base_model") and lm.base_model is not lm
        self._head = (head,) if self.hf else (None,)  # a tuple: no second registration of the head's weights
        self._fsdp_root: tuple[nn.Module | None] = (None,)
        self._on_sharded = None  # what runs once sharded (when_sharded)

    @property
    def head(self) -> nn.Module | None:
        return self._head[0]

    @property
    def fsdp_root(self) -> nn.Module | None:
        return self._fsdp_root[0]

    def set_fsdp_root(self, root: nn.Module) -> None:
        """Name the FSDP2 module holding this model's root parameters (:attr:`fsdp_root`) once
        :func:`kdbench.measure.parallel.shard` has sharded it; then run :meth:`when_sharded`'s ``fn``."""
        self._fsdp_root = (root,)
        pending, self._on_sharded = self._on_sharded, None
        if pending is not None:
            pending(root)

    def when_sharded(self, fn) -> None:
        """Have ``fn(root)`` run once this model is sharded: an FSDP2 teacher built on ``meta`` off rank 0 receives
        rank 0's weights (:func:`kdbench.workloads.placement.receive_from_rank0`)."""
        self._on_sharded = fn

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

    def head_weights(self, vocab: int | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's weight and bias, cut to ``vocab`` rows (None: all), at ``dtype`` (autograd flows to the
        originals).  A ``vocab`` beyond the head's rows pads it (``data.vocab_policy: pad``): zero weight rows and a
        -inf bias there (a bias of 0 on its own rows where it has none), so those logits are -inf."""
        weight = self.head.weight[:vocab].to(dtype)
        bias = getattr(self.head, "bias", None)
        bias = bias[:vocab].to(dtype) if bias is not None else None
        extra = 0 if vocab is None else vocab - weight.shape[0]
        if extra > 0:
            weight = torch.cat([weight, weight.new_zeros(extra, weight.shape[1])])
            own = bias if bias is not None else weight.new_zeros(weight.shape[0] - extra)
            bias = torch.cat([own, own.new_full((extra,), float("-inf"))])
        return weight, bias

    def logits(self, out: torch.Tensor, dtype: torch.dtype | None = None, vocab: int | None = None) -> torch.Tensor:
        """The logits of the forward's output ``out``: the head applied to the hidden states (at ``dtype``, the
        hidden states and head cast to it; None: the head as it is, under whatever autocast is on); a model
        without a head returns its logits, taken as they are.  ``vocab``: the first entries only."""
        if self.head is None:
            if vocab is not None and vocab > out.shape[-1]:  # padded with -inf (data.vocab_policy: pad)
                return torch.nn.functional.pad(out, (0, vocab - out.shape[-1]), value=float("-inf"))
            return out if vocab is None else out[..., :vocab]
        if dtype is None and vocab is None:
            return self.head(out)
        weight, bias = self.head_weights(vocab, dtype if dtype is not None else self.head.weight.dtype)
        return torch.nn.functional.linear(out.to(weight.dtype), weight, bias)

    def decoder_layers(self) -> list[str]:
        """Module paths of the decoder layers, in order (the longest ModuleList of the model)."""
        lists = [(n, m) for n, m in self.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
        if not lists:
            return []
        name, layers = max(lists, key=lambda nm: len(nm[1]))
        return [f"{name}.{i}" for i in range(len(layers))]


def analytic_forward_flops(
    model: CausalLM, batch_size: int, seq_len: int, with_head: bool = True, fused: bool = True
) -> int:
    """The forward's FLOPs from the shapes, to cross-check the counted ones: 2 per multiply-add of every matmul
    weight (the decoder layers' and, ``with_head``, the LM head's; embeddings are lookups) for each token, plus
    attention's two products per layer (QKᵀ and PV) as kdbench's flop counter counts them, as executed
    (:mod:`kdbench.measure.flops`): over the S(S+1)/2 unmasked (query, key) pairs of the causal square on a
    ``fused`` kernel (flash, cuDNN, mem-efficient, the CPU's flash: what SDPA picks), the whole S² on the math
    kernel: 2·B·pairs·heads·(d_qk + d_v) per layer."""
    embeddings = {id(p) for m in model.lm.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    base = model.lm.base_model
    weights = {id(p): p for p in base.parameters() if p.dim() == 2 and id(p) not in embeddings}
    matmul = sum(p.numel() for p in weights.values()) + (model.head.weight.numel() if with_head else 0)
    config = model.lm.config
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads)
    pairs = seq_len * (seq_len + 1) // 2 if fused else seq_len**2
    attention = 2 * batch_size * pairs * heads * 2 * head_dim
    return 2 * matmul * batch_size * seq_len + int(config.num_hidden_layers) * attention
