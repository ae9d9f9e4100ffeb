"""The stress framework's own guarantees, on tiny fake scenarios (in-process, fast).

Each invariant the framework enforces for every scenario is shown to fire: escaped
exceptions (worker-loop catch and ``threading.excepthook``), lock-order errors by name, the
watchdog's ``no-deadlock`` (with a stack dump), the bounded join's ``no-thread-left``; and the
switch interval and excepthook are restored afterwards.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from staging import LockReentryError
from stress.cli import main
from stress.framework import (
    Monitor,
    ScenarioMetrics,
    StressConfig,
    find_scenario,
    percentile,
    register,
    registered,
    run_scenario,
)
from stress.invariants import (
    LOCK_ORDER,
    NO_DEADLOCK,
    NO_ESCAPED_EXCEPTION,
    NO_THREAD_LEFT,
)

pytestmark = pytest.mark.timeout(60)


@dataclass
class Fake:
    """A scenario whose body is a test-supplied function."""

    body: Callable[[StressConfig, Monitor], None]
    name: str = "fake"
    description: str = "test double"
    default_duration: float = 0.3
    invariants: tuple[str, ...] = (NO_ESCAPED_EXCEPTION, LOCK_ORDER, NO_DEADLOCK, NO_THREAD_LEFT)
    seen_switch: list[float] = field(default_factory=list)

    def run(self, config: StressConfig, monitor: Monitor) -> ScenarioMetrics:
        self.seen_switch.append(sys.getswitchinterval())
        self.body(config, monitor)
        return ScenarioMetrics()


def counts(result: object) -> dict[str, int]:
    return {inv.name: inv.violations for inv in result.invariants}  # type: ignore[attr-defined]


def test_clean_run_holds_and_restores_process_state() -> None:
    def body(config: StressConfig, monitor: Monitor) -> None:
        counters = monitor.counters()

        def work() -> None:
            while monitor.running():
                counters.ops += 1

        monitor.spawn(work, "w")
        monitor.join_all(timeout=5)

    before_switch, before_hook = sys.getswitchinterval(), threading.excepthook
    fake = Fake(body)
    result = run_scenario(fake, StressConfig(seed=3, switch_interval=1e-5), progress=False)
    assert result.ok and result.ops > 0 and result.seed == 3
    assert fake.seen_switch == [pytest.approx(1e-5)]
    assert sys.getswitchinterval() == before_switch and threading.excepthook is before_hook
    assert set(counts(result)) == set(fake.invariants)


def test_escaped_exceptions_are_counted_by_name() -> None:
    def body(config: StressConfig, monitor: Monitor) -> None:
        def raises() -> None:
            raise LockReentryError("staging", "write", "read")

        monitor.spawn(raises, "spawned")  # caught by the spawn wrapper
        raw = threading.Thread(target=lambda: 1 / 0, daemon=True)  # reaches the excepthook
        raw.start()
        raw.join(5)
        monitor.join_all(timeout=5)

    result = run_scenario(Fake(body), StressConfig(), progress=False)
    got = counts(result)
    assert got[NO_ESCAPED_EXCEPTION] == 2 and got[LOCK_ORDER] == 1 and not result.ok
    examples = next(i for i in result.invariants if i.name == NO_ESCAPED_EXCEPTION).examples
    assert any("ZeroDivisionError" in e for e in examples)


def test_watchdog_reports_a_stall_and_the_join_a_stuck_thread(
    capsys: pytest.CaptureFixture[str],
) -> None:
    release = threading.Event()

    def body(config: StressConfig, monitor: Monitor) -> None:
        monitor.spawn(release.wait, "stuck")  # never makes progress
        monitor.stop.wait(5)  # set by the watchdog

    try:
        config = StressConfig(watchdog_s=0.3, duration=5)
        result = run_scenario(Fake(body), config, progress=False)
    finally:
        release.set()
    got = counts(result)
    assert got[NO_DEADLOCK] == 1 and got[NO_THREAD_LEFT] == 1
    err = capsys.readouterr().err
    assert "DEADLOCK?" in err and "stuck" in err  # the stacks were dumped


def test_registry_finds_staging_race_and_refuses_duplicates() -> None:
    assert find_scenario("staging-race") is registered()["staging-race"]
    assert find_scenario("no-such-scenario") is None
    with pytest.raises(ValueError, match="registered twice"):
        register(Fake(lambda c, m: None, name="staging-race"))


def test_percentile_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(range(1, 101), 99) == 99
    assert percentile([5.0], 99) == 5.0


def test_planted_lock_reentry_fails_lock_order(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["staging-race", "--duration", "0.5", "--seed", "3", "--plant-bug", "reentry"]
    assert main([*argv, "--threads", "2", "--progress", "off"]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "seed: 3"
    row = next(line for line in out.splitlines() if line.startswith("lock-order"))
    assert int(row.split()[1]) > 0


# ---------------------------------------------------------------- stuck, or slow?


def _quiet(seconds: float) -> None:
    """Make no progress for ``seconds`` (a step that is slow, not stuck)."""
    threading.Event().wait(seconds)


@pytest.mark.slow
def test_a_slow_declared_step_is_not_a_stall_and_an_undeclared_one_is() -> None:
    """Three watchdog periods without progress: inside ``long_step`` (bound 30 s, far past
    what a busy machine adds to a 3 s wait) the run is slow, not stuck; the same quiet
    outside a declared step is a stall (the check can fail)."""

    def declared(config: StressConfig, monitor: Monitor) -> None:
        with monitor.long_step("a peer process starting", 30.0):
            _quiet(3.0)
        counters = monitor.counters()
        counters.ops += 1

    def undeclared(config: StressConfig, monitor: Monitor) -> None:
        _quiet(3.0)

    config = StressConfig(watchdog_s=1.0, duration=5)
    assert counts(run_scenario(Fake(declared), config, progress=False))[NO_DEADLOCK] == 0
    assert counts(run_scenario(Fake(undeclared), config, progress=False))[NO_DEADLOCK] == 1


def test_a_real_stall_inside_a_declared_step_is_caught_past_its_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A thread blocked for good inside a declared step (bound 0.6 s): reported once the
    bound passed, the step named — a declared step hides nothing past its own bound."""
    release = threading.Event()

    def body(config: StressConfig, monitor: Monitor) -> None:
        def stuck() -> None:
            with monitor.long_step("drain", 0.6):
                release.wait()

        monitor.spawn(stuck, "stuck")
        monitor.stop.wait(30)  # set by the watchdog

    try:
        result = run_scenario(Fake(body), StressConfig(watchdog_s=0.3, duration=30), progress=False)
    finally:
        release.set()
    assert counts(result)[NO_DEADLOCK] == 1
    example = next(i for i in result.invariants if i.name == NO_DEADLOCK).examples[0]
    assert "step 'drain' is past its bound of 0.6 s" in example
    assert "DEADLOCK?" in capsys.readouterr().err


@pytest.mark.slow
def test_beats_keep_a_coarse_unit_of_progress_live() -> None:
    """Rooms counted per batch (the sender rig): a batch slower than the period is live
    while its rooms conclude (beats), and a stall without beats is caught."""

    def batch(beating: bool) -> Callable[[StressConfig, Monitor], None]:
        def body(config: StressConfig, monitor: Monitor) -> None:
            counters = monitor.counters()
            for _ in range(60):  # 60 rooms, 50 ms each: 3 s = 3 periods for the batch
                _quiet(0.05)
                if beating:
                    counters.beats += 1
            counters.rooms += 60

        return body

    config = StressConfig(watchdog_s=1.0, duration=5)
    assert counts(run_scenario(Fake(batch(True)), config, progress=False))[NO_DEADLOCK] == 0
    assert counts(run_scenario(Fake(batch(False)), config, progress=False))[NO_DEADLOCK] == 1


def test_long_step_bounds_are_checked() -> None:
    monitor = Monitor("m", [NO_DEADLOCK], duration_s=1.0, watchdog_s=1.0)
    for bad in (0, -1.0, float("inf"), float("nan"), "5"):
        with pytest.raises(ValueError, match="bound_s"):
            monitor.begin_step("x", bad)  # type: ignore[arg-type]
    token = monitor.begin_step("x", 5.0)
    assert [s[0] for s in monitor.open_steps()] == ["x"] and monitor.liveness() == (0, 1)
    monitor.end_step(token)
    monitor.end_step(token)  # idempotent
    assert monitor.open_steps() == [] and monitor.liveness() == (0, 2)
