"""The plan's checks that LM and encoder cells share, against their models built on the meta device
(:mod:`kdbench.models.meta`): the models' facts (and the override a model cannot take), feature paths the models
have and pair as given, and features given to a method that pairs none.

Each function returns :data:`~kdbench.workloads.base.Problems` (setting path, message); a model whose facts are
not known (user code that cannot be built on meta) is left to the run.
"""

from __future__ import annotations

from kdbench.config.schema import CellConfig
from kdbench.core.errors import KdbenchError, did_you_mean
from kdbench.models.meta import ModelFacts, encoder_facts, lm_facts
from kdbench.workloads.base import Problems, config_problem

ROLES = ("teacher", "student")
Facts = dict[str, ModelFacts]


def model_problem(role: str, overrides: dict, exc: KdbenchError) -> tuple[tuple[str, ...], str]:
    """A model that cannot be built, at the key to change: the override at fault (``overrides.ROLE.FIELD``), else
    ``overrides.ROLE`` or ``pair.ROLE``."""
    field = getattr(exc, "field", None)
    if field is not None and field in overrides:
        return ("overrides", role, field), str(exc)
    return config_problem(role, overrides, exc)


def facts_of(config: CellConfig, roles: tuple[str, ...], family: str, allow_imports: bool) -> tuple[Facts, Problems]:
    """The facts of the cell's ``roles`` models (LMs, or encoders with ``family`` "encoder"), built on meta, and the
    problems of those that cannot be built."""
    facts: Facts = {}
    problems: Problems = []
    for role in roles:
        name, overrides = getattr(config.pair, role), getattr(config.overrides, role)
        try:
            if family == "encoder":
                facts[role] = encoder_facts(name, overrides)
            else:
                facts[role] = lm_facts(name, overrides, allow_imports)
        except KdbenchError as exc:
            problems.append(model_problem(role, overrides, exc))
    return facts, problems


def feature_problems(config: CellConfig, facts: Facts, most: int, layers: str) -> Problems:
    """``features.teacher`` / ``features.student`` of a feature method on a stack of layers: paths the wrapped
    models have, lists of one length when both are given, a list the other model's default layers can pair whole
    (it is never cut), and layers to pair when none are given (``most``: the default pairs at most this many;
    ``layers``: what the models' layers are called)."""
    given = {role: getattr(config.features, role) for role in ROLES}
    known = {role: f for role, f in facts.items() if f.known}
    problems: Problems = []
    for role, f in known.items():
        name = getattr(config.pair, role)
        for path in given[role] or ():
            if path not in f.modules:
                hint = did_you_mean(path, sorted(f.modules), n=1, quote=True)
                example = f" (its {layers}: '{f.layers[0]}' ... '{f.layers[-1]}')" if f.layers else ""
                why = f"{name} has no module '{path}'{example}; {hint}give paths as named_modules() lists them"
                problems.append((("features", role), why))
    if problems:
        return problems
    t, s = given["teacher"], given["student"]
    if t and s and len(t) != len(s):
        why = f"features.teacher lists {len(t)} modules and features.student {len(s)}: they are paired in order; "
        return [(("features",), why + "give both the same number")]
    for role, other in (("teacher", "student"), ("student", "teacher")):
        f = known.get(other)
        if given[role] and not given[other] and f is not None:
            k = min(len(f.layers), most)
            if len(given[role]) > k:
                why = (
                    f"features.{role} lists {len(given[role])} modules, and the {other}'s default is {k} of its "
                    f"{layers}: {len(given[role]) - k} of yours would go unpaired; give features.{other} too, or "
                    f"list at most {k}"
                )
                problems.append((("features", role), why))
    for role, f in known.items():
        if not given[role] and not f.layers:
            why = f"{getattr(config.pair, role)} has no {layers} to pair; name its modules in features.{role}"
            problems.append((("features", role), why))
    return problems


def unused_features(config: CellConfig, methods: list) -> Problems:
    """``features`` given to a cell whose method pairs no layers: refused, not ignored."""
    given = [role for role in ROLES if getattr(config.features, role)]
    if not given or any(m.cls.needs_features for m in methods):
        return []
    why = (
        f"features.{given[0]} names layers for a feature method (hidden_mse) to pair, and method {config.method} "
        f"pairs none: remove features, or add the feature method (e.g. {config.method}+hidden_mse)"
    )
    return [(("features",), why)]
