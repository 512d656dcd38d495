"""The sizes and values a language model's or encoder's config cannot take, said before transformers is asked:
numbers YAML read as text, counts below 1, key/value heads that do not divide the query heads, a vocabulary too
small for a next-token distribution, a padding token beyond it (:mod:`kdbench.models.meta` builds the model)."""

from __future__ import annotations

import contextlib
import re
import types
from typing import Any

from kdbench.core.errors import KdbenchError, did_you_mean

SIZE_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "head_dim",
    "type_vocab_size",
)
# an override named like a size or a count (widths, heads, experts): below 1 it builds a model of nothing
_COUNT_NAME = re.compile(r"^(?!.*window)(num_\w+|\w+_size|\w+_dim)$")


# Names other code bases give a config's fields (Meta's params.json, GPT-2, T5, fairseq) -> transformers' own.
OTHER_NAMES = {
    **dict.fromkeys(("n_heads", "n_head", "num_heads", "n_attention_heads"), "num_attention_heads"),
    **dict.fromkeys(("n_kv_heads", "num_kv_heads", "n_key_value_heads"), "num_key_value_heads"),
    **dict.fromkeys(("n_layers", "n_layer", "num_layers", "layers"), "num_hidden_layers"),
    **dict.fromkeys(("dim", "d_model", "n_embd", "embed_dim", "hidden_dim_model"), "hidden_size"),
    **dict.fromkeys(("ffn_dim", "hidden_dim", "d_ff", "n_inner", "ffn_hidden_size"), "intermediate_size"),
    **dict.fromkeys(("norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rms_eps"), "rms_norm_eps"),
    **dict.fromkeys(("max_seq_len", "n_positions", "n_ctx", "max_position"), "max_position_embeddings"),
    **dict.fromkeys(("vocab", "n_vocab", "vocabulary_size"), "vocab_size"),
    **dict.fromkeys(("activation", "activation_function", "act_fn", "hidden_activation"), "hidden_act"),
}


class ModelConfigError(KdbenchError):
    """A model that cannot be built or run as configured; ``field`` is the override at fault (None: the model or
    its config.json itself), ``text`` what transformers said."""

    def __init__(self, message: str, field: str | None = None, text: str | None = None):
        super().__init__(message)
        self.field = field
        self.text = text  # transformers' own words, when it refused


def number(value: Any) -> float | None:
    """The number a text spells (None: not a text, or not a number)."""
    try:
        return float(value) if isinstance(value, str) else None
    except ValueError:
        return None


def unquote_fix(value: str, want: str) -> str:
    """How to write text ``value`` as the ``want`` ("int"/"float") YAML reads it as (a float needs its dot)."""
    if want == "float" and re.fullmatch(r"[+-]?\d+[eE][+-]?\d+", value.strip()):
        mantissa, _, exponent = value.strip().lower().partition("e")
        return f"YAML reads {value} (no dot) as text: write {mantissa}.0e{exponent}"
    return f"write {value} without quotes: YAML reads a quoted number as text"


def value_problem(key: str, value: Any, expected: Any) -> str | None:
    """A number written as text where the config holds a number (``"4"``, ``1e-5`` without a dot): transformers
    of any version would refuse it or fail on it later."""
    if isinstance(expected, bool) or not isinstance(expected, (int, float)) or number(value) is None:
        return None
    want = "int" if isinstance(expected, int) else "float"
    return f"{key} is the text {value!r}; {unquote_fix(value, want)}"


def shape_problems(config: Any, next_token: bool) -> list[tuple[tuple[str, ...], str]]:
    """(the fields involved, what is wrong) of the sizes a config's model cannot take: a size below 1, a vocabulary
    of fewer than 2 entries for a next-token distribution, key/value heads that do not divide the query heads, a
    padding token beyond the vocabulary, a negative layer count."""
    out: list[tuple[tuple[str, ...], str]] = []

    def get(name: str) -> Any:
        value = getattr(config, name, None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    for name in SIZE_FIELDS:
        if get(name) is not None and get(name) < 1:
            out.append(((name,), f"{name} {get(name)} must be at least 1"))
    if get("num_hidden_layers") is not None and get("num_hidden_layers") < 0:
        out.append((("num_hidden_layers",), f"num_hidden_layers {get('num_hidden_layers')} must be 0 or more"))
    vocab, least = get("vocab_size"), 2 if next_token else 1
    if vocab is not None and vocab < least:
        why = " (a next-token distribution over one entry has nothing to distil)" if next_token else ""
        out.append((("vocab_size",), f"vocab_size {vocab} must be at least {least}{why}"))
    heads, kv = get("num_attention_heads"), get("num_key_value_heads")
    if heads and kv and heads >= 1 and kv >= 1 and heads % kv:
        divisors = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
        why = (
            f"num_key_value_heads {kv} does not divide num_attention_heads {heads} (each key/value head serves an "
            f"equal group of query heads): use one of {divisors} key/value heads"
        )
        out.append((("num_key_value_heads", "num_attention_heads"), why))
    pad = get("pad_token_id")
    if pad is not None and vocab is not None and vocab >= least and not 0 <= pad < vocab:
        why = f"pad_token_id {pad} is outside the vocabulary's {vocab} entries: raise vocab_size or lower pad_token_id"
        out.append((("pad_token_id", "vocab_size"), why))
    return out


def check_shapes(config: Any, fields: dict[str, Any], what: str, next_token: bool) -> None:
    """:func:`shape_problems` raised at the override involved (the first; none: the model's own config)."""
    for involved, why in shape_problems(config, next_token):
        given = [f for f in involved if f in fields]
        raise ModelConfigError(f"{what}: {why}", given[0] if given else None)


def check_values(base: Any, defaults: dict[str, Any], overrides: dict[str, Any], what: str, next_token: bool) -> None:
    """Numbers written as text, and sizes no model can take (a head count of 0, a vocabulary of 1), said before
    transformers is asked (it would fail on them with a ZeroDivisionError or build a model of nothing)."""
    for key, value in overrides.items():
        expected = getattr(base, key, None)
        why = value_problem(key, value, defaults.get(key, expected) if expected is None else expected)
        if why:
            raise ModelConfigError(f"{what}: {why}", key)
        least = 0 if key == "num_hidden_layers" else 1
        known = key in defaults or hasattr(base, key)  # a field the config lacks is refused as such, later
        if (
            known
            and _COUNT_NAME.match(key)
            and isinstance(value, int)
            and not isinstance(value, bool)
            and value < least
        ):
            raise ModelConfigError(f"{what}: {key} {value} must be {'0 or more' if least == 0 else 'at least 1'}", key)
    if overrides:
        check_shapes(types.SimpleNamespace(**{**base.to_dict(), **overrides}), overrides, what, next_token)


# Legacy names a config class still takes in its constructor (transformers 5 folds them
# into ``rope_parameters``; 4.x keeps them as fields).
_ROPE_LEGACY = ("rope_theta", "rope_scaling")


def _valid_fields(config_class) -> set[str]:
    """Every field a config of this class takes: its constructor's names, the fields of a
    default instance, the aliases in ``attribute_map`` and the legacy rope names."""
    import inspect

    fields: set[str] = set()
    for klass in config_class.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        with contextlib.suppress(TypeError, ValueError):
            params = inspect.signature(init).parameters.values()
            fields.update(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    fields.discard("self")
    fields.update(config_class().to_dict())
    fields.update(getattr(config_class, "attribute_map", {}))
    if fields & {"rope_parameters", *_ROPE_LEGACY}:
        fields.update(_ROPE_LEGACY)
    return fields


def check_config_fields(config_class, keys, what: str) -> None:
    """Raise :class:`KdbenchError` for a key ``config_class`` takes under no name, with transformers' name for it
    where another code base's name was used."""
    valid = _valid_fields(config_class)
    for key in keys:
        if key not in valid:
            other = OTHER_NAMES.get(key)
            if other is not None and other not in valid:  # this class's own name for it (GPT-2's n_inner)
                other = next((o for o, same in OTHER_NAMES.items() if same == other and o in valid), None)
            hint = did_you_mean(key, sorted(valid), n=1, cutoff=0.8, quote=True)  # spelt alike: GPT-2's n_layer
            hint = hint or (f"did you mean {other!r} (transformers' name for it)?" if other else "")
            hint = hint or did_you_mean(key, sorted(valid), quote=True)
            raise KdbenchError(f"{what}: {config_class.__name__} has no field {key!r}; {hint}".rstrip("; ").rstrip())
