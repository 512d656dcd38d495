"""pytest plugin: benchmark your own teacher/student pair with pytest-benchmark, measured as `kdbench run` measures it.

Registered through the ``pytest11`` entry point, so installing kdbench makes the ``kdbench``
fixture available in every pytest session (it needs pytest-benchmark).  A test asks for it and
measures one thing::

    def test_step(kdbench):
        kdbench.step({"pair": {"teacher": "resnet20", "student": "resnet8"}, "batch_size": 32})

    def test_student(kdbench):
        kdbench.inference({"pair": {"teacher": "resnet20", "student": "resnet8"}}, batch_size=1)

``config`` holds the keys of a suite's ``defaults`` (one cell: no matrix), validated as
`kdbench run` validates a suite; ``module:callable`` user models are allowed (the test file is
user code already).  The cell's models, batch, distillation step, math mode and autocast are
built by the same functions :mod:`kdbench.measure.cell` uses, so the timed call is the one a
``kdbench run`` of that cell times, levers included:

* a cell ``kdbench run`` stores as skipped is skipped, with the same reason: a precision the
  backend cannot run, or a GPU-only lever (``graphs``, ``conv_autotune``, ``tunableop``) on the CPU;
* the device-wide levers ``conv_autotune`` (cudnn.benchmark) and ``tunableop`` (TunableOp) are set
  around the measurement and restored after it (:func:`kdbench.measure.levers.device_levers`);
  TunableOp's results file is kept in the session's pytest temporary folder
  (``<basetemp>/kdbench/_tunableop-<device>.csv``: one per device kind, shared by the session's
  tests as a run's cells share theirs), and its path lands in ``extra_info["tunableop_file"]``;
* the student's inference is served by the cell's ``inference.runtime`` (eager, compile,
  onnxruntime, int8) and replayed from a CUDA/HIP graph with ``graphs``
  (:func:`kdbench.measure.runtimes.serve`); the teacher is served eagerly, as `kdbench run`
  serves it.  The served output is checked against eager's before timing: a mismatch fails the
  test, a runtime that cannot run here (``LeverSkip``) skips it.  ``extra_info`` carries the
  ``runtime``, its ``one_off_ms`` / ``one_off_kind`` and the ``output_check``.

What differs is the timer: pytest-benchmark times each call on the host, so on GPUs the call ends
with a device synchronize (a no-op on the CPU) and each round's time is the device's time for that
call, plus the synchronize's return.  One-off costs paid in the first calls (compile, algorithm
search, TunableOp tuning) fall in the untimed warm-up rounds (``warmup_rounds``: keep it above 0
for such levers); `kdbench run` reports them as ``one_off_ms``, the fixture does so for served runtimes.

Loading this module must cost nothing in sessions that never use the fixture: it imports
pytest only; torch and kdbench's measuring code are imported when the fixture's methods run.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

if TYPE_CHECKING:
    from kdbench.config.plan import Cell
    from kdbench.hw.backends import AutocastChoice, Backend
    from kdbench.models import ModelCache

ROLES = ("student", "teacher")


def _fail(message: str) -> NoReturn:
    """Fail the test with kdbench's one-line message, without a traceback (it is the config's fault)."""
    pytest.fail(f"kdbench: {message}", pytrace=False)


def cell_of(config: Mapping[str, Any]) -> Cell:
    """The one cell ``config`` (the keys of a suite's ``defaults``) describes, validated and checked as
    `kdbench run` checks a suite's cells; KdbenchError says what to change."""
    from pydantic import ValidationError

    from kdbench.config.schema import Suite
    from kdbench.core.errors import KdbenchError
    from kdbench.workloads import expand_checked

    if not isinstance(config, Mapping):
        raise KdbenchError(
            f"config must be a dict of cell settings (the keys of a suite's `defaults`), not {type(config).__name__}"
        )
    try:
        suite = Suite(name="pytest", defaults=dict(config), allow_imports=True).located(Path("config"), {})
    except ValidationError as exc:
        raise KdbenchError(f"config: {exc.errors()[0]['msg']}") from None
    cell = expand_checked(suite)[0]  # no matrix: exactly one cell
    if cell.config.world_size != 1:
        raise KdbenchError(
            f"config: world_size {cell.config.world_size}: the kdbench fixture measures one device; "
            "measure data-parallel cells with `kdbench run` (torchrun)"
        )
    return cell


class KdbenchFixture:
    """What the ``kdbench`` fixture returns: :meth:`step` or :meth:`inference`, once per test."""

    def __init__(
        self,
        benchmark: Any,
        cache: Callable[[], ModelCache],
        tunable_dir: Callable[[], str | Path | None] = lambda: None,
        on_contended: Callable[[str], None] = lambda note: None,
    ):
        self.benchmark = benchmark
        self._on_contended = on_contended  # told the note of a benchmark measured on a busy machine
        self._cache = cache
        self._tunable_dir = tunable_dir  # where TunableOp's results file is kept (None: not kept)
        self._used: str | None = None
        self._backend: Backend | None = None
        self._closers: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ measurements

    def step(
        self, config: Mapping[str, Any], device: str = "auto", rounds: int | None = None, warmup_rounds: int = 3
    ) -> float:
        """Benchmark the cell's distillation step (teacher forward, student forward, loss, backward,
        optimizer update on one fixed batch of ``batch_size``); returns the loss of the last call.

        ``rounds=None`` lets pytest-benchmark choose the rounds (``--benchmark-min-rounds``,
        ``--benchmark-max-time``) after ``warmup_rounds`` untimed calls; an int runs
        ``benchmark.pedantic`` with exactly that many rounds of one call each.  The cell's
        ``compile``, ``optimizer.impl``, ``conv_autotune`` and ``tunableop`` hold as in `kdbench run`."""
        self._claim("step", rounds, warmup_rounds)
        from kdbench.core.names import Measurement
        from kdbench.distill.step import DistillStep
        from kdbench.hw.backends import math_mode
        from kdbench.measure.levers import LeverWatch
        from kdbench.workloads import workload_of

        cell, backend = self._prepare(config, device)
        c = cell.config
        workload = workload_of(c)
        teacher, student = self._build(lambda: workload.build_pair(c, backend, self._cache()))

        def build() -> DistillStep:
            x, y = workload.batch(c, c.batch_size, backend.device, c.seed, (teacher, student))
            LeverWatch(c)  # as `kdbench run`: a compiled cell starts from a reset torch._dynamo
            return DistillStep(teacher, student, x, y, c, backend, workload)

        with self._levers(cell, backend):  # the step is built and timed under the cell's device levers
            step = self._build(build)
            self._closers.append(step.close)
            d = step.distiller
            self._record(cell, backend, Measurement.DISTILL_STEP, c.batch_size, d.student_ac, d.teacher_ac)
            with math_mode(d.student_ac.tf32):  # IEEE fp32 unless the cell asks for tf32, as `kdbench run`
                self._run(step, backend, rounds, warmup_rounds)
        loss = float(step.last_loss) if step.last_loss is not None else math.nan
        self.benchmark.extra_info["final_loss"] = loss
        if not math.isfinite(loss):
            _fail(f"the distillation loss is not finite ({loss}); lower optimizer.lr or use bf16/fp32")
        return loss

    def inference(
        self,
        config: Mapping[str, Any],
        batch_size: int = 1,
        model: str = "student",
        device: str = "auto",
        rounds: int | None = None,
        warmup_rounds: int = 3,
    ) -> Any:
        """Benchmark the student's (``model="teacher"``: the teacher's) forward on a fixed batch of
        ``batch_size``, in eval() under inference_mode at the cell's precision; returns the output of
        the last call (a numpy array for ``onnxruntime`` off CUDA).  ``rounds`` and ``warmup_rounds``
        as for :meth:`step`.

        The student is served as `kdbench run` serves it: by the cell's ``inference.runtime``, replayed
        from a CUDA/HIP graph with ``graphs``, its output checked against eager's before timing (a
        MISMATCH fails the test; a runtime that cannot run here skips it).  The teacher is served
        eagerly.  ``extra_info`` records ``runtime``, ``one_off_ms``, ``one_off_kind`` and ``output_check``."""
        self._claim("inference", rounds, warmup_rounds)
        if model not in ROLES:
            _fail(f"model={model!r}: use 'student' or 'teacher'")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            _fail(f"batch_size={batch_size!r}: use a positive int")
        from kdbench.core.names import Measurement
        from kdbench.hw.backends import math_mode
        from kdbench.measure.runtimes import serve
        from kdbench.measure.serving import LeverSkip
        from kdbench.workloads.vision import cell_model, inference_forward, served_columns

        cell, backend = self._prepare(config, device)
        c = cell.config
        net = self._build(lambda: cell_model(getattr(c.pair, model), c, backend, self._cache()))
        info = self.benchmark.extra_info
        with self._levers(cell, backend):  # serving (export, compile, capture) and timing, as `kdbench run`
            forward, x, choice = inference_forward(net, batch_size, c, backend)
            self._record(cell, backend, Measurement(f"{model}_inference"), batch_size, choice)
            info["model"] = getattr(c.pair, model)
            info["runtime"] = "eager"
            if model == "student" and (c.inference.runtime != "eager" or c.graphs):
                try:
                    served = serve(net, x, c.inference.runtime, c, backend, graphs=c.graphs)
                except LeverSkip as exc:  # `kdbench run` stores the row as skipped, with this reason
                    pytest.skip(f"kdbench: {exc}")
                info["runtime"] = served.runtime
                info.update(served_columns(served))
                notes = [n for n in (info.get("notes"), *served.notes) if n]
                info["notes"] = "; ".join(dict.fromkeys(notes)) or None
                if served.check is not None and not served.check.ok:
                    _fail(
                        f"the student served by {served.runtime} does not compute what eager does "
                        f"({served.check.text()}); measure a runtime whose output agrees"
                    )
                forward = served.forward
            with math_mode(choice.tf32):
                return self._run(forward, backend, rounds, warmup_rounds)

    # ------------------------------------------------------------------ parts

    def _claim(self, what: str, rounds: int | None, warmup_rounds: int) -> None:
        if self._used is not None:
            _fail(
                f"this test already measured with kdbench.{self._used}(); pytest-benchmark times one thing per "
                "test: put each measurement in a test of its own (or parametrize)"
            )
        self._used = what
        if rounds is not None and (isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1):
            _fail(f"rounds={rounds!r}: use a positive int, or None to let pytest-benchmark choose")
        if isinstance(warmup_rounds, bool) or not isinstance(warmup_rounds, int) or warmup_rounds < 0:
            _fail(f"warmup_rounds={warmup_rounds!r}: use an int >= 0")

    def _prepare(self, config: Mapping[str, Any], device: str) -> tuple[Cell, Backend]:
        """The validated cell and the backend; skips the test where the backend cannot run the cell's
        precisions or its levers (GPU-only levers on the CPU), as `kdbench run` stores the cell as skipped."""
        from kdbench.core.errors import KdbenchError
        from kdbench.hw.backends import choose_autocast, resolve
        from kdbench.measure.levers import skip_reason

        try:
            cell = cell_of(config)
            backend = resolve(device)
        except KdbenchError as exc:
            _fail(str(exc))
        self._backend = backend
        c = cell.config
        for precision in (c.precision, c.teacher_precision):
            skip = choose_autocast(backend, precision).skip
            if skip:
                pytest.skip(f"kdbench: {skip}")
        skip = skip_reason(c, backend)
        if skip:
            pytest.skip(f"kdbench: {skip}")
        return cell, backend

    @contextlib.contextmanager
    def _levers(self, cell: Cell, backend: Backend) -> Iterator[None]:
        """The cell's device-wide levers (cudnn.benchmark, TunableOp) set inside, restored after, as
        `kdbench run` holds them around a cell's measurements; TunableOp's results file is kept in the
        folder ``tunable_dir`` gives (the session's pytest temporary folder), its path in ``extra_info``."""
        from kdbench.measure.levers import device_kind, device_levers, tunableop_file

        c = cell.config
        tunable = None
        if c.tunableop:
            folder = self._tunable_dir()
            tunable = tunableop_file(str(folder) if folder is not None else None, device_kind(backend))
        with device_levers(c, backend, tunable) as lever_row:
            yield
        info = self.benchmark.extra_info  # filled in when the levers' block ends
        notes = lever_row.pop("notes", None)
        info.update(lever_row)
        if notes:
            info["notes"] = "; ".join(n for n in (info.get("notes"), notes) if n)

    def _build(self, build: Callable[[], Any]) -> Any:
        from kdbench.core.errors import KdbenchError

        try:
            return build()
        except KdbenchError as exc:  # a user model that cannot be imported or built, feature paths, ...
            _fail(str(exc))

    def _record(
        self, cell: Cell, backend: Backend, measurement: str, batch_size: int, *choices: AutocastChoice
    ) -> None:
        """What was measured, in the benchmark's ``extra_info`` (kept in ``--benchmark-json`` and saved runs)."""
        from kdbench.hw.environment import device_facts

        c = cell.config
        notes = [f"{ch.precision}: {ch.note}" for ch in choices if ch.note]
        self.benchmark.extra_info.update(
            {
                "cell_id": cell.cell_id,
                "cell": cell.label,
                "measurement": str(measurement),
                "batch_size": batch_size,
                "precision": c.precision,
                "teacher_precision": c.teacher_precision,
                "autocast": choices[0].applied,
                "backend": backend.name,
                "device_name": device_facts(backend)["device_name"],
                "notes": "; ".join(dict.fromkeys(notes)) or None,
            }
        )
        if self.benchmark.group is None:  # a @pytest.mark.benchmark(group=...) of the test wins
            self.benchmark.group = str(measurement)

    def _run(self, fn: Callable[[], Any], backend: Backend, rounds: int | None, warmup_rounds: int) -> Any:
        """Hand ``fn`` to pytest-benchmark; on GPUs each call ends with a device synchronize, so the
        host's time of a call is the device's time for it."""
        if backend.device_type == "cuda":

            def call() -> Any:
                out = fn()
                backend.synchronize()
                return out
        else:
            call = fn
        backend.synchronize()  # placing the models and the batch: every call starts on an idle device
        with self._host_watch():
            if rounds is not None:
                return self.benchmark.pedantic(call, rounds=rounds, warmup_rounds=warmup_rounds, iterations=1)
            if self.benchmark.enabled:  # pytest-benchmark warms up only with --benchmark-warmup
                for _ in range(warmup_rounds):
                    call()
            return self.benchmark(call)

    @contextlib.contextmanager
    def _host_watch(self) -> Iterator[None]:
        """Watch the host while pytest-benchmark times (as `kdbench run` watches each measurement): the others'
        share lands in ``extra_info`` (``host_busy_share``, ``contended``), and a contended benchmark is named to
        the session, which then cannot pass as judged (:func:`pytest_sessionfinish`)."""
        import torch

        from kdbench.hw.contention import HostMeter, contention_columns

        meter = HostMeter(torch.get_num_threads())
        meter.begin()
        meter.start()
        yield
        meter.stop()
        columns, note = contention_columns(meter.result(), None)
        info = self.benchmark.extra_info
        info.update({k: columns[k] for k in ("host_busy_share", "contended")})
        if note:
            info["notes"] = "; ".join(n for n in (info.get("notes"), note) if n)
            self._on_contended(note)

    def close(self) -> None:
        """After the test: free the step's hooks and gradients, and on GPUs the device memory the test's
        models and tensors held (the next test's peak starts from an empty device)."""
        for close in reversed(self._closers):
            close()
        self._closers.clear()
        if self._backend is not None and self._backend.device_type == "cuda":
            from kdbench.run.cell import free_device_memory

            free_device_memory(self._backend)  # gc.collect and empty_cache: ~0.2 s, spent on GPUs only


@pytest.fixture(scope="session")
def _kdbench_model_cache() -> Callable[[], ModelCache]:
    """One model cache for the session (each model built once, handed out as fresh copies), made on first use."""
    made: list[ModelCache] = []

    def get() -> ModelCache:
        if not made:
            from kdbench.models import ModelCache

            made.append(ModelCache(allow_imports=True))
        return made[0]

    return get


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("kdbench").addoption(
        "--kdbench-allow-unjudged",
        action="store_true",
        default=False,
        help="let a session pass whose kdbench benchmarks were measured on a busy machine (contended); by default "
        f"such a passing session exits {_not_judged()} (could not judge), as `kdbench compare` does",
    )


def _not_judged() -> int:
    from kdbench.core.errors import EXIT_NOT_JUDGED  # the one place the code is kept; kdbench.core imports no torch

    return EXIT_NOT_JUDGED


_CONTENDED = pytest.StashKey[dict[str, str]]()  # test node id -> why its benchmark reads slow


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A session that passed with a kdbench benchmark measured on a busy machine has judged nothing about it
    (pytest-benchmark's --benchmark-compare-fail compared a slow reading): it exits EXIT_NOT_JUDGED, not 0, unless
    ``--kdbench-allow-unjudged``.  A failed session keeps its own code."""
    contended = session.config.stash.get(_CONTENDED, {})
    if contended and exitstatus == 0 and not session.config.getoption("kdbench_allow_unjudged"):
        session.exitstatus = _not_judged()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    contended = config.stash.get(_CONTENDED, {})
    if not contended:
        return
    allowed = config.getoption("kdbench_allow_unjudged")
    outcome = "--kdbench-allow-unjudged: not failing" if allowed else f"exit {_not_judged()}, not judged"
    terminalreporter.write_line(
        f"kdbench: {len(contended)} benchmark(s) measured on a busy machine (contended), so their timings judge "
        f"nothing ({outcome}):"
    )
    for node, note in contended.items():
        terminalreporter.write_line(f"  {node}: {note}")


@pytest.fixture
def kdbench(
    benchmark: Any,
    _kdbench_model_cache: Callable[[], ModelCache],
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
):
    """Benchmark a cell's distillation step (``kdbench.step(config)``) or a model's inference
    (``kdbench.inference(config, batch_size=1)``) with pytest-benchmark, as `kdbench run` measures
    it; ``config`` holds the keys of a suite's ``defaults``.  One measurement per test.  TunableOp's
    results (``tunableop: true``) are kept in ``kdbench/`` of the session's pytest base temporary folder."""
    stash = request.config.stash

    def contended(note: str) -> None:
        stash.setdefault(_CONTENDED, {})[request.node.nodeid] = note

    fixture = KdbenchFixture(
        benchmark, _kdbench_model_cache, lambda: tmp_path_factory.getbasetemp() / "kdbench", contended
    )
    yield fixture
    fixture.close()
