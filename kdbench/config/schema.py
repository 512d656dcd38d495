"""Suite YAML -> validated, typed configuration.

A suite file has the top-level keys ``name, description, backend, threads,
allow_imports, cell_timeout_s, profile, launcher, quality, defaults, matrix, exclude``.  ``defaults`` holds one cell's
configuration (``CellConfig``); every key it may hold may also be a ``matrix``
axis (a list of values), and nested keys may be swept with a dotted axis name
(``kd.temperature: [2, 4]``).  The plan (``kdbench.config.plan``) overlays each
combination of matrix values on ``defaults``.

Every error a user can make here is raised as ``KdbenchError`` with one line that
names the file, the line (where known), the key path and what to change.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kdbench.errors import KdbenchError

Precision = Literal["fp32", "fp16", "bf16"]
BackendName = Literal["auto", "cpu", "cuda", "rocm"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Pair(_Strict):
    teacher: str = Field(min_length=1)
    student: str = Field(min_length=1)


class KDParams(_Strict):
    """Hinton KD: alpha * T^2 * KL(teacher || student) + (1 - alpha) * CE."""

    temperature: float = Field(4.0, gt=0, le=1000)
    alpha: float = Field(0.9, ge=0, le=1)


class FitNetParams(_Strict):
    """FitNets (Romero et al. 2015), one stage: beta * MSE(regressor(student hint), teacher hint) + CE."""

    beta: float = Field(100.0, ge=0, le=1e7)
    hint_layer: int | None = Field(None, ge=-64, le=63)  # index into the paired feature lists; null: the middle one


class ATParams(_Strict):
    """Attention transfer (Zagoruyko & Komodakis 2017) + CE."""

    beta: float = Field(1000.0, ge=0, le=1e9)
    p: float = Field(2.0, gt=0, le=16)
    form: Literal["code", "paper"] = "code"  # code: beta/2 * sum mean((Qs-Qt)^2); paper: beta/2 * sum mean ||Qs-Qt||_2


class DKDParams(_Strict):
    """Decoupled KD (Zhao et al. 2022): warm-up * (alpha * TCKD + beta * NCKD) + CE."""

    alpha: float = Field(1.0, ge=0, le=1000)
    beta: float = Field(8.0, ge=0, le=1000)
    temperature: float = Field(4.0, gt=0, le=1000)
    warmup: int = Field(20, ge=0, le=10_000_000)  # steps over which the DKD term ramps up linearly from 0


class FeaturesConfig(_Strict):
    """Module paths whose outputs feature methods compare; null picks the family's stage ends."""

    teacher: list[str] | None = Field(None, min_length=1, max_length=16)
    student: list[str] | None = Field(None, min_length=1, max_length=16)


class TeacherConfig(_Strict):
    mode: Literal["live", "cached"] = "live"  # cached: teacher outputs computed once for the fixed batch


class DataConfig(_Strict):
    kind: Literal["synthetic"] = "synthetic"
    shape: list[int] = Field(default_factory=lambda: [3, 32, 32], min_length=1, max_length=4)
    num_classes: int = Field(100, ge=2, le=1_000_000)

    @field_validator("shape")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(d < 1 or d > 65536 for d in v):
            raise ValueError("every dimension must be between 1 and 65536")
        return v


class OptimizerConfig(_Strict):
    name: Literal["adamw", "adam", "sgd"] = "adamw"
    lr: float = Field(1e-4, gt=0, le=10)
    weight_decay: float | None = Field(None, ge=0, le=1)
    momentum: float = Field(0.9, ge=0, lt=1)


class TimingConfig(_Strict):
    warmup: int = Field(3, ge=0, le=100_000)
    min_iters: int = Field(10, ge=1, le=1_000_000)
    min_time_s: float = Field(1.0, ge=0, le=86_400)
    max_iters: int = Field(10_000, ge=1, le=10_000_000)

    @model_validator(mode="after")
    def _order(self) -> TimingConfig:
        if self.max_iters < self.min_iters:
            raise ValueError(f"max_iters ({self.max_iters}) must be >= min_iters ({self.min_iters})")
        return self


class InferenceConfig(_Strict):
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 32], max_length=64)
    teacher: bool = True

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(b < 1 or b > 1 << 20 for b in v):
            raise ValueError("every batch size must be between 1 and 1048576")
        if len(set(v)) != len(v):
            raise ValueError("batch sizes must not repeat")
        return v


class DDPConfig(_Strict):
    """DistributedDataParallel options of the student, for cells with world_size > 1."""

    bucket_cap_mb: float = Field(25.0, gt=0, le=10_000)
    gradient_as_bucket_view: bool = False
    static_graph: bool = False


class CellConfig(_Strict):
    """Everything one cell measures; `defaults` and each matrix combination build one."""

    pair: Pair | None = None
    method: str = "kd"
    kd: KDParams = KDParams()
    fitnet: FitNetParams = FitNetParams()
    at: ATParams = ATParams()
    dkd: DKDParams = DKDParams()
    weights: dict[str, float] = Field(default_factory=dict)  # per-term weight of a combined method (default 1)
    features: FeaturesConfig = FeaturesConfig()
    teacher: TeacherConfig = TeacherConfig()
    precision: Precision = "fp32"
    teacher_precision: Precision = "fp32"
    batch_size: int = Field(32, ge=1, le=1 << 20)
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    timing: TimingConfig = TimingConfig()
    inference: InferenceConfig = InferenceConfig()
    alignment: int = Field(64, ge=1, le=4096)
    pad_to: int = Field(1, ge=1, le=4096)
    memory_format: Literal["contiguous", "channels_last"] = "contiguous"
    world_size: int = Field(1, ge=1, le=1024)
    ddp: DDPConfig = DDPConfig()
    seed: int = Field(0, ge=0, le=2**63 - 1)

    @field_validator("alignment")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"alignment must be a power of two in bytes (1, 2, 4, ... 4096), got {v}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> CellConfig:
        if self.memory_format == "channels_last" and len(self.data.shape) != 3:
            raise ValueError("memory_format channels_last needs image data: data.shape must be [C, H, W]")
        return self


DatasetName = Literal["digits", "imagefolder", "cifar10", "cifar100"]
DISK_DATASETS = ("imagefolder", "cifar10", "cifar100")


class QualityConfig(_Strict):
    """The suite's ``quality:`` block: the data set and the one training recipe every model follows."""

    dataset: DatasetName = "digits"
    root: str | None = None  # the data set's folder; required for imagefolder, cifar10, cifar100
    epochs: int = Field(20, ge=1, le=10_000)
    seeds: int = Field(3, ge=1, le=100)
    target: float = Field(0.95, gt=0, le=1)  # quality = target x the seed's teacher accuracy
    batch_size: int = Field(64, ge=1, le=1 << 20)
    lr: float = Field(0.05, gt=0, le=10)  # peak learning rate; cosine-annealed to 0 over all steps
    optimizer: Literal["sgd", "adamw"] = "sgd"  # sgd: momentum 0.9
    weight_decay: float = Field(5e-4, ge=0, le=1)
    test_fraction: float = Field(0.25, gt=0, lt=1)  # held out when the data set has no split of its own
    max_samples: int | None = Field(None, ge=2, le=100_000_000)  # cap on the images loaded (train + test)

    @model_validator(mode="after")
    def _root(self) -> QualityConfig:
        if self.dataset in DISK_DATASETS and not self.root:
            raise ValueError(
                f"quality.root is required for dataset {self.dataset}: give the folder that holds the images"
            )
        if self.dataset == "digits" and self.root:
            raise ValueError("quality.root is only for imagefolder, cifar10 and cifar100; remove it for digits")
        return self

    def optimizer_config(self) -> OptimizerConfig:
        return OptimizerConfig(name=self.optimizer, lr=self.lr, weight_decay=self.weight_decay, momentum=0.9)


class LauncherConfig(_Strict):
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


class SuiteModel(_Strict):
    name: str = Field(min_length=1, max_length=200)
    description: str = ""
    backend: BackendName = "auto"
    threads: int | None = Field(None, ge=1, le=4096)
    allow_imports: bool = False
    cell_timeout_s: float = Field(3600.0, gt=0, le=7 * 86_400)
    profile: bool = False  # a torch.profiler trace of every cell's step (as --profile)
    quality: QualityConfig | None = None  # opt-in accuracy run on real data (kdbench.quality.protocol)
    launcher: LauncherConfig = LauncherConfig()
    defaults: dict[str, Any] = Field(default_factory=dict)
    matrix: dict[str, list[Any]] = Field(default_factory=dict)
    exclude: list[dict[str, Any]] = Field(default_factory=list)


@dataclass(frozen=True)
class Suite:
    """A validated suite: top-level settings plus the raw sweep (expanded by kdbench.config.plan)."""

    path: Path
    name: str
    description: str
    backend: str
    threads: int | None
    allow_imports: bool
    cell_timeout_s: float
    launcher: LauncherConfig
    profile: bool
    quality: QualityConfig | None
    defaults: dict[str, Any]
    matrix: dict[str, list[Any]]
    exclude: list[dict[str, Any]]
    lines: dict[tuple, int] = field(default_factory=dict, repr=False, compare=False)

    def error(self, loc: tuple, message: str) -> KdbenchError:
        """A KdbenchError located at a key path of this suite's file."""
        return KdbenchError(f"{_where(self.path, self.lines, loc)}: {message}")


# --------------------------------------------------------------------------- loading


_MAX_NODES = 100_000  # a suite expanded through its aliases; real suites have hundreds


def _check_expansion(path: Path, root: Any) -> None:
    """Refuse documents whose aliases expand to a huge tree ("billion laughs").

    The composed graph shares aliased nodes; the expanded size is counted with a
    memo per node, so the check itself never expands anything.
    """
    sizes: dict[int, int] = {}

    def size(n: Any) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        sizes[id(n)] = 1  # guards against recursive aliases
        if isinstance(n, yaml.MappingNode):
            total = 1 + sum(size(k) + size(v) for k, v in n.value)
        elif isinstance(n, yaml.SequenceNode):
            total = 1 + sum(size(v) for v in n.value)
        else:
            total = 1
        sizes[id(n)] = min(total, _MAX_NODES + 1)
        if total > _MAX_NODES:
            raise KdbenchError(
                f"{path}:{n.start_mark.line + 1}: the YAML aliases expand to more than {_MAX_NODES} values; "
                "write the values out instead of nesting anchors"
            )
        return sizes[id(n)]

    if root is not None:
        size(root)


def _read_text(path: Path) -> str:
    if not path.exists():
        raise KdbenchError(f"{path}: no such suite file; give the path of a suite YAML (see suites/)")
    if path.is_dir():
        raise KdbenchError(f"{path}: is a folder, not a suite file; give a .yaml file such as {path}/cpu.yaml")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise KdbenchError(f"{path}: is not UTF-8 text (byte {exc.start}); save the suite as UTF-8") from None


def _yaml_error(path: Path, text: str, exc: yaml.YAMLError) -> KdbenchError:
    mark = getattr(exc, "problem_mark", None)
    line = f":{mark.line + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    bad_line = text.splitlines()[mark.line] if mark is not None and mark.line < len(text.splitlines()) else ""
    hint = "; indent with spaces, not tabs" if "\t" in bad_line else ""
    if "constructor" in problem:
        hint = "; tags that build Python objects are not allowed, remove it"
    return KdbenchError(f"{path}{line}: invalid YAML: {problem}{hint}")


def _line_map(path: Path, text: str) -> tuple[Any, dict[tuple, int]]:
    """Compose the YAML node tree: check it, and map each key path to its 1-based line."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise _yaml_error(path, text, exc) from None
    lines: dict[tuple, int] = {}
    _check_expansion(path, node)

    def walk(n: Any, loc: tuple) -> None:
        if n is None:
            return
        lines.setdefault(loc, n.start_mark.line + 1)
        if n.tag and n.tag.startswith("!") and not n.tag.startswith("!!"):
            raise KdbenchError(f"{path}:{n.start_mark.line + 1}: YAML tag {n.tag} is not allowed; remove it")
        if isinstance(n, yaml.MappingNode):
            seen: set[Any] = set()
            for k, v in n.value:
                key = k.value if isinstance(k, yaml.ScalarNode) else str(k.value)
                if key in seen:
                    raise KdbenchError(
                        f"{path}:{k.start_mark.line + 1}: {_dotted(loc + (key,))}: duplicate key; keep one of them"
                    )
                seen.add(key)
                lines[loc + (key,)] = k.start_mark.line + 1
                walk(v, loc + (key,))
        elif isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                walk(v, loc + (i,))

    walk(node, ())
    return node, lines


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _where(path: Path, lines: dict[tuple, int], loc: tuple) -> str:
    for n in range(len(loc), -1, -1):
        if loc[:n] in lines:
            return f"{path}:{lines[loc[:n]]}: {_dotted(loc)}"
    return f"{path}: {_dotted(loc)}"


def _fields(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def _sub_model(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    """The pydantic model a field holds (also inside `X | None`), or None for a plain value."""
    ann = model.model_fields[name].annotation
    args = (ann, *getattr(ann, "__args__", ()))
    sub = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
    return sub[0] if sub else None


def _model_at(loc: tuple, root: type[BaseModel]) -> type[BaseModel] | None:
    """The pydantic model that holds the key at `loc` (for 'did you mean')."""
    model: Any = root
    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue
        if part not in model.model_fields:
            return None
        model = _sub_model(model, part)
    return model


def _describe(err: dict, root: type[BaseModel]) -> str:
    """One pydantic error as a short instruction."""
    loc = tuple(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        model = _model_at(loc, root)
        names = _fields(model) if model else []
        close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else f"allowed keys: {', '.join(names)}"
        return f"unknown key '{loc[-1]}'; {hint}"
    if kind == "missing":
        return "is required; add it"
    got = err.get("input")
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    got_text = "" if isinstance(got, (dict, list)) or "got " in msg else f" (got {got!r})"
    return f"{msg[0].lower()}{msg[1:]}{got_text}"


def validation_error(path: Path, lines: dict[tuple, int], exc: ValidationError, prefix: tuple, root) -> KdbenchError:
    errors = exc.errors()
    first = errors[0]
    loc = prefix + tuple(first["loc"])
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return KdbenchError(f"{_where(path, lines, loc)}: {_describe(first, root)}{more}")


def axis_path(axis: str) -> tuple[str, ...]:
    return tuple(axis.split("."))


def nest(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    for key in reversed(path):
        value = {key: value}
    return value  # type: ignore[return-value]


CASES = "cases"  # the matrix axis whose values are whole partial cells (several keys at once)


def overlay(axis: str, value: Any) -> dict[str, Any]:
    """What one matrix value lays over the defaults."""
    return value if axis == CASES else nest(axis_path(axis), value)


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` laid on `base`; nested mappings merge key by key, anything else replaces."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "pair":
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def check_axis_name(suite_path: Path, lines: dict[tuple, int], loc: tuple, key: str) -> tuple[str, ...]:
    """A matrix axis or exclude key (at `loc`) must name a CellConfig key, dotted for nested ones."""
    path = axis_path(key)
    model: Any = CellConfig
    for i, part in enumerate(path):
        names = _fields(model) if model else []
        if part not in names:
            close = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
            hint = f"did you mean '{'.'.join(path[:i] + (close[0],))}'?" if close else f"allowed: {', '.join(names)}"
            raise KdbenchError(f"{_where(suite_path, lines, loc)}: unknown key '{key}'; {hint}")
        model = _sub_model(model, part)
        if model is None and i < len(path) - 1:
            raise KdbenchError(
                f"{_where(suite_path, lines, loc)}: '{part}' has no sub-keys; sweep '{'.'.join(path[: i + 1])}' itself"
            )
    return path


def load_suite(path: str | Path) -> Suite:
    """Read, parse and validate a suite file (the sweep itself is expanded by kdbench.config.plan)."""
    path = Path(path)
    text = _read_text(path)
    _node, lines = _line_map(path, text)
    try:
        raw = yaml.load(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:  # composed fine, but a tag names no safe constructor
        raise _yaml_error(path, text, exc) from None
    if raw is None:
        raise KdbenchError(f"{path}: the suite is empty; it needs at least `name` and `defaults` (see suites/cpu.yaml)")
    if not isinstance(raw, dict):
        raise KdbenchError(
            f"{path}:1: a suite must be a mapping of keys (name, defaults, matrix, ...), not a {type(raw).__name__}"
        )
    if "name" not in raw:
        raw = {**raw, "name": path.stem}
    try:
        top = SuiteModel.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(path, lines, exc, (), SuiteModel) from None
    suite = Suite(
        path=path,
        name=top.name,
        description=top.description,
        backend=top.backend,
        threads=top.threads,
        allow_imports=top.allow_imports,
        cell_timeout_s=top.cell_timeout_s,
        launcher=top.launcher,
        profile=top.profile,
        quality=top.quality,
        defaults=top.defaults,
        matrix=top.matrix,
        exclude=top.exclude,
        lines=lines,
    )
    _validate_sweep(suite)
    return suite


def validate_cell(suite: Suite, raw: dict[str, Any], prefix: tuple) -> CellConfig:
    try:
        return CellConfig.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(suite.path, suite.lines, exc, prefix, CellConfig) from None


def _validate_sweep(suite: Suite) -> None:
    """Check defaults, each matrix value and each exclude entry where the user wrote it."""
    validate_cell(suite, suite.defaults, ("defaults",))
    for axis, values in suite.matrix.items():
        if not values:
            raise suite.error(("matrix", axis), "has no values; list at least one or remove the axis")
        path = () if axis == CASES else check_axis_name(suite.path, suite.lines, ("matrix", axis), axis)
        for i, value in enumerate(values):
            if axis == CASES and not isinstance(value, dict):
                raise suite.error(
                    ("matrix", axis, i), f"each case is a mapping of cell keys, not {type(value).__name__}"
                )
            try:
                CellConfig.model_validate(deep_merge(suite.defaults, overlay(axis, value)))
            except ValidationError as exc:
                for err in exc.errors():
                    loc = tuple(err["loc"])
                    if loc[: len(path)] == path:
                        where = ("matrix", axis, i) + loc[len(path) :]
                        raise KdbenchError(
                            f"{_where(suite.path, suite.lines, where)}: {_describe(err, CellConfig)}"
                        ) from None
    for i, entry in enumerate(suite.exclude):
        if not entry:
            raise suite.error(("exclude", i), "is empty and would exclude every cell; give the keys to match")
        for key in entry:
            check_axis_name(suite.path, suite.lines, ("exclude", i, key), key)
