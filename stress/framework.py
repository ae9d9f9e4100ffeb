"""The stress framework: configuration, the scenario protocol and registry, the run monitor.

A run of one scenario (:func:`run_scenario`) does, around ``scenario.run(config, monitor)``:

* sets ``sys.setswitchinterval(config.switch_interval)`` (restored after);
* installs a ``threading.excepthook`` that counts every escaped exception under
  ``no-escaped-exception`` (and lock-model errors also under ``lock-order``);
* starts a watchdog thread that fails the run under ``no-deadlock`` (and dumps every thread's
  stack to stderr) when nothing moves for ``config.watchdog_s`` seconds — no progress
  counter, no liveness beat, no declared long step begun or ended — and no declared long step
  is still within its own bound (:meth:`Monitor.long_step`; see :class:`_Watchdog`);
* draws a progress line on stderr when it is a TTY (through a :class:`~stress.console.Console`:
  other output, Python's or NIXL's, is printed above it and the line is redrawn);
* with a :class:`~stress.native_stderr.NativeStderr` capture active (the CLI's), counts the
  NIXL/UCX lines written to fd 2 during the run by class (``ScenarioResult.native``);
* after the scenario returns, joins every thread started with :meth:`Monitor.spawn` within a
  bound and counts the survivors under ``no-thread-left``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import math
import os
import pkgutil
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Protocol

from staging._version import install_extra_hint
from stress.console import Console, ConsoleStream
from stress.invariants import (
    DEADLOCK_ERROR_NAMES,
    LOCK_ERROR_NAMES,
    LOCK_ORDER,
    NO_DEADLOCK,
    NO_ESCAPED_EXCEPTION,
    NO_THREAD_LEFT,
)
from stress.native_stderr import NativeLines, NativeStderr, merge
from stress.sender_log import LogCounts

QUICK_DURATION_S = 2.0
"""Per-scenario duration under ``--quick``."""

MAX_EXAMPLES = 5
"""Violation details kept per invariant (the count is always exact)."""

JSONValue = str | int | float | bool | None | list["JSONValue"] | dict[str, "JSONValue"]


@dataclass(frozen=True)
class StressConfig:
    """Everything the CLI passes to a scenario. Scenarios ignore options that do not apply.

    ``duration`` is ``None`` for "the scenario's default" (or :data:`QUICK_DURATION_S` under
    ``quick``). ``plant_bug`` is test-only: it names a deliberate bug a scenario swaps in so
    that tests can check the invariants fail.
    """

    threads: int = 4
    rooms: int = 32
    chunks: int = 8
    fault_rate: float = 0.01
    peer_kill: bool = False
    peer_stop: bool = False
    duration: float | None = None
    seed: int = 0
    switch_interval: float = 1e-6
    lock: str = "mutex"  # the library's default (StagingContext, KVManager)
    quick: bool = False
    watchdog_s: float = 10.0
    plant_bug: str | None = None

    def duration_for(self, scenario: Scenario) -> float:
        """Seconds to run ``scenario``: ``--duration``, else 2 s under ``--quick``, else its
        default."""
        if self.duration is not None:
            return self.duration
        if self.quick:
            return QUICK_DURATION_S
        return float(scenario.default_duration)

    def rng(self, thread_index: int) -> random.Random:
        """The random source of worker ``thread_index``: ``Random(seed + thread_index)``."""
        return random.Random(self.seed + thread_index)

    def to_json(self) -> dict[str, JSONValue]:
        """The config as a JSON-ready dict."""
        out: dict[str, JSONValue] = {}
        for key, value in asdict(self).items():
            out[key] = value
        return out


@dataclass
class ScenarioMetrics:
    """What a scenario hands back besides the counters the monitor already holds.

    ``lock``: counters of the main lock under test (e.g. ``LockStats`` as a dict), or
    ``None``. ``extra``: anything scenario-specific worth putting in the JSON. ``skipped``:
    why the scenario could not run here (e.g. it needs root), or ``None``; a skipped
    scenario is reported ``SKIP`` with this reason, not ``PASS``.
    """

    lock: dict[str, JSONValue] | None = None
    extra: dict[str, JSONValue] = field(default_factory=dict)
    skipped: str | None = None


class Scenario(Protocol):
    """One stress scenario. Implementations may use plain class attributes for the four
    read-only members.

    ``run`` must: start its threads with :meth:`Monitor.spawn`, drive them until
    ``monitor.deadline`` passes or ``monitor.stop`` is set, count work in the per-thread
    :class:`WorkerCounters` from :meth:`Monitor.counters`, report broken invariants with
    :meth:`Monitor.violation` (names from :mod:`stress.invariants`), join its threads, check
    its end-of-run invariants, and return :class:`ScenarioMetrics`. Random choices of worker
    ``i`` come from ``config.rng(i)`` so ``--seed`` replays the plan. It should not raise
    (an exception it raises is counted under ``no-escaped-exception``).
    """

    @property
    def name(self) -> str:
        """CLI name, e.g. ``"staging-race"``."""
        ...

    @property
    def description(self) -> str:
        """One line for ``--help``."""
        ...

    @property
    def default_duration(self) -> float:
        """Seconds of a full (non-quick) run."""
        ...

    @property
    def invariants(self) -> tuple[str, ...]:
        """The invariant names this scenario checks (all are reported, 0 = held)."""
        ...

    def run(self, config: StressConfig, monitor: Monitor) -> ScenarioMetrics:
        """Run the scenario once; see the class docstring."""
        ...


# ---------------------------------------------------------------------------- registry

_REGISTRY: dict[str, Scenario] = {}
_LOADED = False


def register(scenario: Scenario) -> Scenario:
    """Add ``scenario`` to the registry under ``scenario.name``; returns it.

    Raises:
        ValueError: another scenario already has that name.
    """
    existing = _REGISTRY.get(scenario.name)
    if existing is not None and existing is not scenario:
        raise ValueError(f"stress scenario {scenario.name!r} registered twice")
    _REGISTRY[scenario.name] = scenario
    return scenario


SENDER_EXTRA_MODULES = frozenset({"torch", "numpy", "nixl"})
"""Top-level modules that only the ``sender`` extra installs."""

_SKIPPED: dict[str, str] = {}


def missing_extra(exc: BaseException) -> str | None:
    """One line naming the ``sender`` extra if ``exc`` is the import of a module only that
    extra installs (a sender scenario in a core-only install), else ``None``."""
    name = exc.name if isinstance(exc, ModuleNotFoundError) else None
    if name is None or name.partition(".")[0] not in SENDER_EXTRA_MODULES:
        return None
    return f"needs the 'sender' extra (no module {name!r}): " + install_extra_hint("sender")


def load_scenarios() -> None:
    """Import every module of :mod:`stress.scenarios` (each registers itself). Idempotent.

    A module that needs the ``sender`` extra where it is not installed is skipped and listed
    by :func:`skipped_scenarios`; any other import error propagates.
    """
    global _LOADED
    if _LOADED:
        return
    package = importlib.import_module("stress.scenarios")
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            try:
                importlib.import_module(f"stress.scenarios.{info.name}")
            except ModuleNotFoundError as exc:
                reason = missing_extra(exc)
                if reason is None:
                    raise
                _SKIPPED[info.name.replace("_", "-")] = reason
    _LOADED = True


def skipped_scenarios() -> dict[str, str]:
    """Scenarios not loaded because an extra is missing: name -> one-line reason (loads first)."""
    load_scenarios()
    return dict(_SKIPPED)


def find_scenario(name: str) -> Scenario | None:
    """The scenario called ``name``, or ``None``.

    Tries the module named after it first (``staging-race`` -> ``stress.scenarios.staging_race``)
    so that running one scenario does not import every other scenario's dependencies; falls
    back to loading them all.

    Raises:
        ModuleNotFoundError: the scenario's module needs a module that is not installed (for
            the ``sender`` extra, :func:`missing_extra` gives the one-line reason).
    """
    if name in _REGISTRY:
        return _REGISTRY[name]
    module = "stress.scenarios." + name.replace("-", "_")
    if name.replace("-", "_").isidentifier() and not name.startswith("_"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    if name not in _REGISTRY:
        load_scenarios()
    return _REGISTRY.get(name)


def registered() -> dict[str, Scenario]:
    """All registered scenarios by name, in registration order (loads them first)."""
    load_scenarios()
    return dict(_REGISTRY)


# ---------------------------------------------------------------------------- monitor


class WorkerCounters:
    """Progress counters of ONE thread; only that thread writes them (no lock needed).

    ``beats`` is liveness only (never reported): a thread whose counted unit of work is
    coarse (a batch of rooms) beats once per finer step (a room), so that the watchdog sees
    a slow batch move.
    """

    __slots__ = ("beats", "faults", "ops", "rooms")

    def __init__(self) -> None:
        self.ops = 0
        self.rooms = 0
        self.faults = 0
        self.beats = 0


@dataclass(frozen=True)
class InvariantReport:
    """One invariant's outcome: violation count and up to :data:`MAX_EXAMPLES` details."""

    name: str
    violations: int
    examples: tuple[str, ...] = ()
    tracebacks: tuple[str, ...] = ()
    """Tracebacks of the first escaped exceptions (``no-escaped-exception`` and the
    invariants an exception counts under), in the order of ``examples``' exceptions."""

    @property
    def held(self) -> bool:
        """``True`` if there was no violation."""
        return self.violations == 0


class Monitor:
    """Shared state of one scenario run: counters, violations, threads, latencies.

    Thread-safety: every method may be called from any thread. ``stop`` is set by the
    watchdog on a stall (and by the framework at the end); workers should poll it.
    """

    def __init__(
        self,
        scenario: str,
        invariants: Sequence[str],
        *,
        duration_s: float,
        watchdog_s: float,
    ) -> None:
        self.scenario = scenario
        self.duration_s = duration_s
        self.watchdog_s = watchdog_s
        self.stop = threading.Event()
        self.created = time.monotonic()  # the set-up's start (restart_clock keeps it)
        self.started = self.created
        self.deadline = self.started + duration_s
        self.total_rooms: int | None = None
        self._lock = threading.Lock()  # guards the fields below
        self._violations: dict[str, int] = dict.fromkeys(invariants, 0)
        self._examples: dict[str, list[str]] = {name: [] for name in invariants}
        self._tracebacks: dict[str, list[str]] = {name: [] for name in invariants}
        self._counters: list[WorkerCounters] = []
        self._threads: list[threading.Thread] = []
        self._latencies: list[float] = []
        self._groups: list[str] = []  # the group of each latency, in step with _latencies
        self._deadlocked = False
        self._reported_alive: set[str] = set()
        self._native: NativeLines | None = None
        # Called once after a stall's stack dump (e.g. to have a child process dump its own
        # stacks too); guarded by _lock for add and copy, called outside it.
        self._stall_hooks: list[Callable[[], None]] = []
        # Declared long steps (long_step): token -> (what, bound_s, deadline); and how many
        # were begun or ended (each one is a movement for the watchdog).
        self._steps: dict[int, tuple[str, float, float]] = {}
        self._step_seq = 0
        self._step_events = 0

    # -- counters ----------------------------------------------------------------------

    def counters(self) -> WorkerCounters:
        """A fresh counter set for the calling thread (register once, write it alone)."""
        mine = WorkerCounters()
        with self._lock:
            self._counters.append(mine)
        return mine

    def totals(self) -> tuple[int, int, int]:
        """``(ops, rooms, faults)`` summed over all counters (racy reads; for display)."""
        with self._lock:
            counters = list(self._counters)
        return (
            sum(c.ops for c in counters),
            sum(c.rooms for c in counters),
            sum(c.faults for c in counters),
        )

    def latency(self, seconds: float, group: str = "") -> None:
        """Record one room-lifecycle latency; ``group`` names the part of the run or the kind
        of room it belongs to (e.g. ``"during a peer fault, failed"``; ``""``: the scenario's
        rooms as a whole), kept for the latency pictures (``--plot``). Any thread. Raises:
        nothing."""
        with self._lock:
            self._latencies.append(seconds)
            self._groups.append(group)

    def latencies(self) -> list[float]:
        """A copy of the recorded latencies, in seconds."""
        with self._lock:
            return list(self._latencies)

    def latency_groups(self) -> dict[str, tuple[float, ...]]:
        """The recorded latencies in seconds by group (:meth:`latency`), groups in the order
        they were first seen. Raises: nothing."""
        with self._lock:
            pairs = list(zip(self._groups, self._latencies, strict=True))
        grouped: dict[str, list[float]] = {}
        for group, seconds in pairs:
            grouped.setdefault(group, []).append(seconds)
        return {group: tuple(values) for group, values in grouped.items()}

    def native_lines(self, lines: NativeLines) -> None:
        """Add NIXL/UCX lines counted elsewhere (e.g. in a child process's own stderr file)
        to this run's ``ScenarioResult.native``. Thread-safe; raises nothing."""
        with self._lock:
            self._native = merge(self._native, lines)

    def reported_native(self) -> NativeLines | None:
        """What :meth:`native_lines` added up, or ``None``. Thread-safe; raises nothing."""
        with self._lock:
            return self._native

    # -- invariants --------------------------------------------------------------------

    def violation(self, invariant: str, detail: str, *, tb: str | None = None) -> None:
        """Count one violation of ``invariant`` (keeping the first few details, and the
        traceback ``tb`` of an exception behind it)."""
        with self._lock:
            self._violations[invariant] = self._violations.get(invariant, 0) + 1
            examples = self._examples.setdefault(invariant, [])
            if len(examples) < MAX_EXAMPLES:
                examples.append(detail)
                if tb is not None:
                    self._tracebacks.setdefault(invariant, []).append(tb)

    def exception(self, exc: BaseException, where: str) -> None:
        """Count an exception that escaped (or would have escaped) a worker, with its
        traceback."""
        detail = f"{where}: {type(exc).__name__}: {exc}"
        tb = format_traceback(exc)
        self.violation(NO_ESCAPED_EXCEPTION, detail, tb=tb)
        if type(exc).__name__ in LOCK_ERROR_NAMES:
            self.violation(LOCK_ORDER, detail, tb=tb)
        elif type(exc).__name__ in DEADLOCK_ERROR_NAMES:
            self.deadlock(detail)

    def deadlock(self, detail: str) -> None:
        """Record a stall once: dump every thread's stack to stderr and set ``stop``."""
        with self._lock:
            first = not self._deadlocked
            self._deadlocked = True
        if first:
            print(f"\n[{self.scenario}] DEADLOCK? {detail}; stacks follow", file=sys.stderr)
            dump_stacks(sys.stderr)
            self.violation(NO_DEADLOCK, detail)
            with self._lock:
                hooks = list(self._stall_hooks)
            for hook in hooks:
                try:
                    hook()
                except Exception as exc:  # a diagnostic: never in the way of the report
                    print(f"[{self.scenario}] stall hook failed: {exc!r}", file=sys.stderr)
        self.stop.set()

    def on_stall(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` once after the first stall's stack dump (what it raises is
        printed, not raised). Thread-safe."""
        with self._lock:
            self._stall_hooks.append(hook)

    def reports(self) -> tuple[InvariantReport, ...]:
        """Per-invariant outcome, in declaration order (undeclared names after)."""
        with self._lock:
            return tuple(
                InvariantReport(
                    name,
                    count,
                    tuple(self._examples.get(name, ())),
                    tuple(self._tracebacks.get(name, ())),
                )
                for name, count in self._violations.items()
            )

    # -- threads -----------------------------------------------------------------------

    def spawn(self, target: Callable[[], None], name: str) -> threading.Thread:
        """Start a daemon thread running ``target``; what it raises is counted, not lost."""

        def run() -> None:
            try:
                target()
            except BaseException as exc:  # counted as a violation; the thread just ends
                self.exception(exc, name)

        thread = threading.Thread(target=run, name=f"{self.scenario}:{name}", daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()
        return thread

    def join_all(self, timeout: float) -> list[str]:
        """Join every spawned thread within ``timeout`` s in all; count and name survivors."""
        end = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        alive: list[str] = []
        for thread in threads:
            thread.join(max(0.0, end - time.monotonic()))
            if thread.is_alive():
                alive.append(thread.name)
        with self._lock:
            fresh = [name for name in alive if name not in self._reported_alive]
            self._reported_alive.update(fresh)
        for name in fresh:  # each survivor is counted once, however often it is joined
            self.violation(NO_THREAD_LEFT, f"thread {name} still alive after {timeout:g} s")
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
        return alive

    # -- liveness (the watchdog) --------------------------------------------------------

    def liveness(self) -> tuple[int, int]:
        """``(beats, step events)``: summed liveness beats of every counter set and how many
        long steps were begun or ended (racy reads; the watchdog's "did anything move")."""
        with self._lock:
            counters = list(self._counters)
            events = self._step_events
        return sum(c.beats for c in counters), events

    def begin_step(self, what: str, bound_s: float) -> int:
        """Declare that from now on a step may legitimately pass up to ``bound_s`` seconds with
        no progress (see :meth:`long_step`); returns the token for :meth:`end_step`.

        Raises:
            ValueError: ``bound_s`` is not a finite number > 0.
        """
        if not (isinstance(bound_s, int | float) and 0 < bound_s < math.inf):
            raise ValueError(f"bound_s must be a finite number > 0, got {bound_s!r}")
        with self._lock:
            self._step_seq += 1
            self._steps[self._step_seq] = (what, float(bound_s), time.monotonic() + bound_s)
            self._step_events += 1
            return self._step_seq

    def end_step(self, token: int) -> None:
        """End a step begun with :meth:`begin_step` (ending counts as progress). Idempotent."""
        with self._lock:
            if self._steps.pop(token, None) is not None:
                self._step_events += 1

    @contextlib.contextmanager
    def long_step(self, what: str, bound_s: float) -> Iterator[None]:
        """A step that makes no progress for a while and is not stuck: starting a decode peer
        process, a drain, a fault's repair. Inside it the watchdog calls the run stuck only
        once ``bound_s`` passed with nothing moving; after it, the usual period counts again
        from its end. Take ``bound_s`` from the step's own timeout (past it the step fails by
        itself, e.g. ``PeerProcess(start_timeout_s=...)``) plus the watchdog period, so that
        a step stuck for good is still reported. Thread-safe; steps may overlap.

        Raises:
            ValueError: ``bound_s`` is not a finite number > 0.
        """
        token = self.begin_step(what, bound_s)
        try:
            yield
        finally:
            self.end_step(token)

    def open_steps(self) -> list[tuple[str, float, float]]:
        """The declared steps not ended: ``(what, bound_s, deadline)`` (``time.monotonic()``)."""
        with self._lock:
            return list(self._steps.values())

    def restart_clock(self) -> None:
        """Start the run's duration now: for scenarios with a slow set-up (peer processes)."""
        with self._lock:
            self.started = time.monotonic()
            self.deadline = self.started + self.duration_s

    def time_left(self) -> float:
        """Seconds until ``deadline`` (<= 0 once passed)."""
        return self.deadline - time.monotonic()

    def running(self) -> bool:
        """``True`` until the deadline passes or ``stop`` is set."""
        return not self.stop.is_set() and time.monotonic() < self.deadline

    def excepthook(self, args: threading.ExceptHookArgs) -> None:
        """``threading.excepthook`` replacement installed during a run."""
        if args.exc_type is SystemExit:
            return
        exc = args.exc_value if args.exc_value is not None else args.exc_type()
        where = args.thread.name if args.thread is not None else "thread"
        self.exception(exc, f"excepthook[{where}]")

    # -- progress ----------------------------------------------------------------------

    def progress_line(self, now: float | None = None) -> str:
        """One progress line: elapsed bar, ops, rooms (of total), faults, rates.

        Until a counter moves the scenario is still setting up (e.g. starting decode peer
        processes): the line says ``setting up`` with the time so far and shows no bar (a
        bar would fill with nothing counted). The bar and the time never pass the run's
        duration; the time spent past it (joins, end-of-run checks) is shown as
        ``+N.Ns finishing``. Rates are per second of the run so far.
        """
        ops, rooms, faults = self.totals()
        now = time.monotonic() if now is None else now
        with self._lock:
            started = self.started
        elapsed = max(0.0, now - started)
        if ops == 0 and rooms == 0 and faults == 0:
            setting_up = max(0.0, now - self.created)
            return f"[{self.scenario}] setting up {setting_up:.1f}s (nothing counted yet)"
        duration = self.duration_s
        shown = min(elapsed, duration) if duration > 0 else elapsed
        frac = shown / duration if duration > 0 else 1.0
        width = 20
        done = int(frac * width)
        bar = "#" * done + "." * (width - done)
        over = elapsed - duration
        tail = f" +{over:.1f}s finishing" if duration > 0 and over >= 0.05 else ""
        rooms_txt = f"{rooms:,}" if self.total_rooms is None else f"{rooms:,}/{self.total_rooms:,}"
        per_s = max(1e-9, shown)
        return (
            f"[{self.scenario}] [{bar}] {shown:5.1f}/{duration:.1f}s{tail} "
            f"ops {ops:,}  rooms {rooms_txt}  faults {faults:,}  "
            f"{_si(ops / per_s)} ops/s  {_si(rooms / per_s)} rooms/s"
        )


def format_traceback(exc: BaseException) -> str:
    """``exc``'s traceback as the interpreter prints it (with its chained causes)."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()


def dump_stacks(stream: IO[str]) -> None:
    """Every thread's stack to ``stream``: ``faulthandler`` when ``stream`` has a file
    descriptor, else (e.g. under pytest's capture) the same from ``sys._current_frames``."""
    try:
        stream.flush()
        faulthandler.dump_traceback(file=stream, all_threads=True)
        return
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        pass
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        stream.write(f"Thread {names.get(ident, hex(ident))} (most recent call last):\n")
        stream.write("".join(traceback.format_stack(frame)))
    stream.flush()


def _si(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.1f}M"
    if value >= 1e3:
        return f"{value / 1e3:.1f}k"
    return f"{value:.0f}"


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0..100) of ``values``; ``None`` if empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


# ---------------------------------------------------------------------------- results


def latency_summary(groups: Mapping[str, Sequence[float]]) -> dict[str, JSONValue]:
    """Per group of latencies in seconds: ``n`` and ``p50_ms``/``p99_ms``/``max_ms``
    (nearest rank). Raises: nothing."""
    out: dict[str, JSONValue] = {}
    for group, values in groups.items():
        p50, p99 = percentile(values, 50), percentile(values, 99)
        out[group] = {
            "n": len(values),
            "p50_ms": None if p50 is None else round(p50 * 1e3, 3),
            "p99_ms": None if p99 is None else round(p99 * 1e3, 3),
            "max_ms": round(max(values) * 1e3, 3) if values else None,
        }
    return out


def counted_json(lines: NativeLines | None) -> dict[str, JSONValue] | None:
    """Counted lines (NIXL/UCX lines, log records) as ``{"counts": ..., "examples": ...}``,
    or ``None`` when not captured."""
    if lines is None:
        return None
    return {
        "counts": dict(lines.counts),
        "examples": {k: list(v) for k, v in lines.examples.items()},
    }


@dataclass(frozen=True)
class ScenarioResult:
    """The outcome of one scenario run (what the summary table and ``--json`` show)."""

    name: str
    seed: int
    threads: int
    duration_s: float
    elapsed_s: float
    ops: int
    rooms: int
    faults: int
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    lock: dict[str, JSONValue] | None
    invariants: tuple[InvariantReport, ...]
    extra: dict[str, JSONValue] = field(default_factory=dict)
    run_s: float | None = None
    """Seconds of the run window: from the scenario's start of work (``Monitor.started``,
    moved by :meth:`Monitor.restart_clock` past a slow set-up) to the return of its
    ``run``. The time base of :attr:`ops_per_s` and :attr:`rooms_per_s` (``None``: the
    wall time ``elapsed_s``, which includes set-up and the end-of-run checks)."""
    skipped: str | None = None
    """Why the scenario did not run here, or ``None`` (see :attr:`status`)."""
    native: NativeLines | None = None
    """NIXL/UCX lines written to fd 2 during the run, by class (``None``: not captured)."""
    sender_log: LogCounts | None = None
    """The library's own log records during the run, by kind (``None``: not captured;
    :mod:`stress.sender_log`)."""
    latency_groups: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """Every recorded room latency in seconds, by group (:meth:`Monitor.latency`): what the
    latency pictures plot (``--plot``); ``--json`` has each group's count and percentiles."""

    @property
    def ok(self) -> bool:
        """``True`` if every invariant held (a skipped scenario violated none)."""
        return all(inv.held for inv in self.invariants)

    @property
    def status(self) -> str:
        """``"FAIL"`` if an invariant was violated, else ``"SKIP"`` if the scenario did not
        run here, else ``"PASS"``."""
        if not self.ok:
            return "FAIL"
        return "SKIP" if self.skipped is not None else "PASS"

    @property
    def rate_base_s(self) -> float:
        """The seconds the rates are per: :attr:`run_s`, else :attr:`elapsed_s`."""
        return self.run_s if self.run_s is not None else self.elapsed_s

    @property
    def violations(self) -> int:
        """Total violations over all invariants."""
        return sum(inv.violations for inv in self.invariants)

    @property
    def ops_per_s(self) -> float:
        """Operations per second of :attr:`rate_base_s` (the run window)."""
        base = self.rate_base_s
        return self.ops / base if base > 0 else 0.0

    @property
    def rooms_per_s(self) -> float:
        """Room lifecycles per second of :attr:`rate_base_s` (the run window)."""
        base = self.rate_base_s
        return self.rooms / base if base > 0 else 0.0

    def to_json(self) -> dict[str, JSONValue]:
        """The result as a JSON-ready dict."""
        return {
            "name": self.name,
            "ok": self.ok,
            "status": self.status,
            "skipped": self.skipped,
            "seed": self.seed,
            "threads": self.threads,
            "duration_s": self.duration_s,
            "elapsed_s": round(self.elapsed_s, 3),
            "run_s": None if self.run_s is None else round(self.run_s, 3),
            "ops": self.ops,
            "rooms": self.rooms,
            "faults": self.faults,
            "rates_per": "run_s" if self.run_s is not None else "elapsed_s",
            "ops_per_s": round(self.ops_per_s, 1),
            "rooms_per_s": round(self.rooms_per_s, 1),
            "latency_p50_ms": self.latency_p50_ms,
            "latency_p99_ms": self.latency_p99_ms,
            "lock": self.lock,
            "violations": self.violations,
            "invariants": {
                inv.name: {
                    "violations": inv.violations,
                    "examples": list(inv.examples),
                    "tracebacks": list(inv.tracebacks),
                }
                for inv in self.invariants
            },
            "native_stderr": counted_json(self.native),
            "sender_log": counted_json(self.sender_log),
            "latency_groups": latency_summary(self.latency_groups),
            "extra": self.extra,
        }


# ---------------------------------------------------------------------------- running


class _Watchdog:
    """Fails the run (``no-deadlock``) when it is stuck, not when it is slow; optionally
    hard-exits later.

    *Moving* is any change of the progress counters (:meth:`Monitor.totals`), of the liveness
    beats, or a long step begun or ended (:meth:`Monitor.liveness`). The run is *stuck* when
    nothing moved for ``period`` s **and** no declared long step is still inside its own
    bound (:meth:`Monitor.long_step`). So:

    * a step that is slow but declared (a peer process starting on a loaded machine: it may
      take its own start timeout) is not flagged before its bound; one that overruns it is,
      named in the report;
    * outside declared steps the bound is ``period`` as before: a thread blocked for good
      (a deadlock, a lost wake-up) is flagged ``period`` s after the last movement;
    * scenarios whose unit of progress is coarse beat per finer step (``WorkerCounters.beats``:
      the sender rig beats per concluded room, not per batch of 32), so a slow batch is
      live, a stuck room is not.

    Why not CPU time or stack sampling: NIXL's progress threads use CPU whether or not the
    run is stuck, and a thread legitimately waiting (on a child process, on a deadline)
    shows the same unchanged stack as a deadlocked one.
    """

    def __init__(self, monitor: Monitor, period: float, hard_exit: bool) -> None:
        self._monitor = monitor
        self._period = period
        self._hard_exit = hard_exit
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stress-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finish(self) -> None:
        self._done.set()
        self._thread.join(5.0)

    def _state(self) -> tuple[tuple[int, int, int], tuple[int, int]]:
        return self._monitor.totals(), self._monitor.liveness()

    def stall(self, now: float, last_move: float) -> str | None:
        """Why the run counts as stuck at ``now`` (nothing moved since ``last_move``), or
        ``None`` while it may still be slow (within ``period``, or inside a declared step's
        own bound)."""
        quiet = now - last_move
        steps = self._monitor.open_steps()
        if quiet < self._period:
            return None
        within = [s for s in steps if s[2] > now]
        if within:
            return None
        if steps:
            what, bound, _ = max(steps, key=lambda s: s[2])
            return (
                f"no progress for {quiet:.1f} s; step {what!r} is past its bound of {bound:g} s"
            )
        return f"no progress for {self._period:g} s"

    def _run(self) -> None:
        tick = min(0.25, self._period / 4)
        last = self._state()
        last_move = time.monotonic()
        while not self._done.wait(tick):
            state = self._state()
            now = time.monotonic()
            if state != last:
                last, last_move = state, now
                continue
            why = self.stall(now, last_move)
            if why is not None:
                self._monitor.deadlock(why)
                # Lock waits time out after 2 periods and joins are bounded by one period each,
                # so a run that is not done 5 periods after the stall is stuck for good.
                if self._hard_exit and not self._done.wait(5 * self._period):
                    print(
                        f"[{self._monitor.scenario}] still stuck {5 * self._period:g} s after the "
                        "stall: exiting with status 1",
                        file=sys.stderr,
                        flush=True,
                    )
                    os._exit(1)
                return


class _Progress:
    """Redraws :meth:`Monitor.progress_line` on a TTY every 0.2 s, as the status line of a
    :class:`~stress.console.Console` (text printed meanwhile goes above it)."""

    def __init__(self, monitor: Monitor, console: Console) -> None:
        self._monitor = monitor
        self._console = console
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stress-progress", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finish(self) -> None:
        self._done.set()
        self._thread.join(5.0)
        self._draw()
        self._console.end_status()

    def _draw(self) -> None:
        self._console.status(self._monitor.progress_line())

    def _run(self) -> None:
        while not self._done.wait(0.2):
            self._draw()


def run_scenario(
    scenario: Scenario,
    config: StressConfig,
    *,
    progress: bool | None = None,
    hard_exit: bool = False,
    stream: IO[str] | None = None,
    native: NativeStderr | None = None,
) -> ScenarioResult:
    """Run ``scenario`` once under the framework's checks (see the module docstring).

    ``progress=None`` draws the progress line only if ``stream`` (default stderr) is a TTY;
    while it is drawn, ``sys.stderr`` (and ``sys.stdout`` when it is a terminal) print
    through its console. ``hard_exit=True`` (the CLI) makes the watchdog ``os._exit(1)`` if
    the run is still stuck five watchdog periods after a detected stall. ``native``: an
    active fd-2 capture whose counts of this run go into ``ScenarioResult.native``.
    """
    capturing = native is not None and native.active
    if stream is not None:
        out = stream
    else:
        out = native.stderr if native is not None and capturing else sys.stderr
    duration = config.duration_for(scenario)
    monitor = Monitor(
        scenario.name,
        scenario.invariants,
        duration_s=duration,
        watchdog_s=config.watchdog_s,
    )
    show = out.isatty() if progress is None else progress
    old_switch = sys.getswitchinterval()
    old_hook = threading.excepthook
    watchdog = _Watchdog(monitor, config.watchdog_s, hard_exit)
    console = Console(out) if show else None
    bar = _Progress(monitor, console) if console is not None else None
    old_streams = (sys.stdout, sys.stderr)
    if console is not None:
        sys.stderr = ConsoleStream(console, sys.stderr)
        if _isatty(sys.stdout):
            sys.stdout = ConsoleStream(console, sys.stdout)
    if native is not None and capturing:
        native.attach(console)
    metrics = ScenarioMetrics()
    threading.excepthook = monitor.excepthook
    sys.setswitchinterval(config.switch_interval)
    started = time.perf_counter()
    try:
        watchdog.start()
        if bar is not None:
            bar.start()
        try:
            metrics = scenario.run(config, monitor)
        except Exception as exc:  # a scenario bug or a broken invariant that raised
            monitor.exception(exc, f"{scenario.name}.run")
        run_s = max(0.0, time.monotonic() - monitor.started)
    finally:
        elapsed = time.perf_counter() - started
        monitor.stop.set()
        monitor.join_all(timeout=config.watchdog_s)
        watchdog.finish()
        if bar is not None:
            bar.finish()
        if console is not None:
            sys.stdout, sys.stderr = old_streams
        sys.setswitchinterval(old_switch)
        threading.excepthook = old_hook
    lines = monitor.reported_native()
    if native is not None and capturing:
        native.sync(1.0)  # what this process wrote to fd 2 so far has been read
        native.attach(None)
        lines = merge(native.take(), lines)
    ops, rooms, faults = monitor.totals()
    lat = monitor.latencies()
    p50, p99 = percentile(lat, 50), percentile(lat, 99)
    skipped = metrics.skipped
    if skipped is None and isinstance(metrics.extra.get("skipped"), str):
        skipped = str(metrics.extra["skipped"])
    invariants = monitor.reports()
    if skipped is not None and all(inv.held for inv in invariants):
        invariants = ()  # nothing was checked: no row may read as "held"
    return ScenarioResult(
        name=scenario.name,
        seed=config.seed,
        threads=config.threads,
        duration_s=duration,
        elapsed_s=elapsed,
        ops=ops,
        rooms=rooms,
        faults=faults,
        latency_p50_ms=None if p50 is None else round(p50 * 1e3, 3),
        latency_p99_ms=None if p99 is None else round(p99 * 1e3, 3),
        lock=metrics.lock,
        invariants=invariants,
        extra=metrics.extra,
        run_s=None if skipped is not None else run_s,
        skipped=skipped,
        native=lines,
        latency_groups=monitor.latency_groups(),
    )


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def skipped_result(name: str, reason: str, config: StressConfig) -> ScenarioResult:
    """The result of a scenario that could not even be loaded here (e.g. a missing extra):
    ``SKIP`` with ``reason``, nothing counted, nothing checked."""
    return ScenarioResult(
        name=name,
        seed=config.seed,
        threads=config.threads,
        duration_s=0.0,
        elapsed_s=0.0,
        ops=0,
        rooms=0,
        faults=0,
        latency_p50_ms=None,
        latency_p99_ms=None,
        lock=None,
        invariants=(),
        skipped=reason,
    )
