"""Pytest plugin (registered by tests/conftest.py): keeps the ``slow`` marker honest.

The README ("Set-up and tests") says the tests that take 15 s or more are marked ``slow``, so
that ``make test`` (``-m "not slow"``) stays the everyday run. At the end of a run this plugin
writes, in the terminal summary:

* one warning line per test *not* marked ``slow`` whose call took :data:`SLOW_THRESHOLD_S`
  or more (measured, not guessed). It only reports: the machines this runs on are shared and
  noisy, and a test that is slow once under load is not necessarily slow; mark it
  ``@pytest.mark.slow`` when it is slow on a quiet run too;
* how many tests marked ``slow`` the marker expression deselected, and that
  ``make test-slow`` (or ``make test-all``) runs them.
"""

from __future__ import annotations

import pytest

SLOW_THRESHOLD_S = 15.0
"""A test whose call takes this long or more (seconds) belongs under ``@pytest.mark.slow``
(README, "Set-up and tests")."""

SLOW_MARK = "slow"


class SlowReport:
    """The plugin's state for one pytest run (one per ``pytest.Config``)."""

    def __init__(self, threshold_s: float) -> None:
        self.threshold_s = threshold_s
        self.unmarked_slow: list[tuple[str, float]] = []
        self.deselected_slow = 0

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.deselected_slow += sum(
            1 for item in items if item.get_closest_marker(SLOW_MARK) is not None
        )

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call" or report.duration < self.threshold_s:
            return
        if SLOW_MARK not in report.keywords:
            self.unmarked_slow.append((report.nodeid, report.duration))

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.unmarked_slow:
            terminalreporter.write_sep("=", "tests at or over the slow threshold, not marked slow")
            for nodeid, duration in sorted(self.unmarked_slow, key=lambda x: -x[1]):
                terminalreporter.write_line(
                    f"WARNING: {nodeid} took {duration:.1f} s (call), at or over the "
                    f"{self.threshold_s:g} s threshold, and is not marked slow: if it is as "
                    "slow on a quiet machine, mark it @pytest.mark.slow (README, 'Set-up and "
                    "tests'); this is only a report, the run does not fail for it",
                    yellow=True,
                )
        if self.deselected_slow:
            n = self.deselected_slow
            terminalreporter.write_line(
                f"{n} test{'s' if n != 1 else ''} marked slow "
                f"{'were' if n != 1 else 'was'} deselected: run them with `make test-slow` "
                "(or every test with `make test-all`)"
            )


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SlowReport(SLOW_THRESHOLD_S), "slow-report")
