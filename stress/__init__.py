"""Concurrency stress suite: ``python -m stress [SCENARIO ...] [options]``.

Adding a scenario
-----------------
Create a module ``stress/scenarios/<name>.py`` that defines a class satisfying
:class:`~stress.framework.Scenario` and registers one instance at import time::

    from stress.framework import Monitor, ScenarioMetrics, StressConfig, register
    from stress.invariants import NO_ESCAPED_EXCEPTION, NO_LEAK, NO_THREAD_LEFT

    class SenderLifecycle:
        name = "sender-lifecycle"          # the CLI name
        description = "one line for --help"
        default_duration = 20.0            # seconds of a full run (--quick: 2 s)
        invariants = (NO_ESCAPED_EXCEPTION, NO_LEAK, NO_THREAD_LEFT)  # all get reported

        def run(self, config: StressConfig, monitor: Monitor) -> ScenarioMetrics:
            counters = monitor.counters()          # one per thread, written by it alone
            rng = config.rng(0)                     # Random(seed + thread_index)
            while monitor.running():               # deadline not passed, no stall
                ...                                 # counters.ops / .rooms / .faults += 1
                monitor.violation(NO_LEAK, "detail")  # when an invariant breaks
            monitor.join_all(timeout=config.watchdog_s)  # threads from monitor.spawn()
            return ScenarioMetrics(lock=None, extra={})

    register(SenderLifecycle())

Nothing else changes: :func:`~stress.framework.load_scenarios` imports every public module of
:mod:`stress.scenarios`, the CLI runs all registered scenarios by default, and the report
lists each scenario's declared invariants. The framework (:func:`~stress.framework.run_scenario`)
supplies the switch interval, the ``threading.excepthook`` capture, the watchdog
(``no-deadlock``), the progress line, the bounded join (``no-thread-left``) and the tables.

Invariant names
---------------
A shared vocabulary in :mod:`stress.invariants`: ``no-escaped-exception``,
``no-resurrection``, ``no-leak``, ``counters-consistent``, ``no-deadlock``,
``no-thread-left``, ``lock-order``, ``linearizable`` (histories checked with
:mod:`stress.linearizability`). A scenario may add its own names; give each a report line
with :func:`stress.invariants.describe`.

Reports
-------
After the runs: a summary table (one row per scenario: ``PASS``, ``FAIL`` or ``SKIP``; a
skipped scenario, e.g. ``two-hosts`` without root, is listed with its reason and checked
nothing), the NIXL/UCX lines native code wrote to fd 2, counted by class
(:mod:`stress.native_stderr`; ``--native-stderr show`` prints them too), and the invariant
table, whose first violations carry the tracebacks of escaped exceptions. Rates are per
second of a scenario's run window (``run s``: after its set-up; ``wall s`` is the whole).
On a FAIL the last line is the command that replays it (same seed and options). The seed
fixes every worker's plan (``StressConfig.rng``), not the thread schedule: a replay makes
the same choices, not the same interleavings or op counts. ``--json`` writes all of it.
Exit status: 0, 1 on a FAIL, 2 for bad arguments, 3 under ``--require-all`` when a
scenario was skipped.

Linearizability
---------------
:mod:`stress.linearizability` records operation histories from real threads and checks them
(Wing & Gong search with memoisation) against a sequential model of ``StagingContext``.
"""

from staging._version import __version__
from stress.framework import (
    InvariantReport,
    Monitor,
    Scenario,
    ScenarioMetrics,
    ScenarioResult,
    StressConfig,
    WorkerCounters,
    find_scenario,
    load_scenarios,
    register,
    registered,
    run_scenario,
)

__all__ = [
    "__version__",
    "InvariantReport",
    "Monitor",
    "Scenario",
    "ScenarioMetrics",
    "ScenarioResult",
    "StressConfig",
    "WorkerCounters",
    "find_scenario",
    "load_scenarios",
    "register",
    "registered",
    "run_scenario",
]
