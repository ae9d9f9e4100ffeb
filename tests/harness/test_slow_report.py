"""tests/slow_report.py (issue 34, item 1): a test not marked ``slow`` whose call takes the
threshold or more is reported, never failed; deselected ``slow`` tests are counted and
``make test-slow`` named. Small suites run in-process (pytester) with a 0.2 s threshold."""

from __future__ import annotations

import pytest

from tests import slow_report

pytestmark = pytest.mark.timeout(60)

SUITE = """
import time
import pytest

def test_quick():
    pass

def test_sluggish():
    time.sleep(0.3)

@pytest.mark.slow
def test_marked():
    time.sleep(0.3)

@pytest.mark.slow
def test_marked_too():
    pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setattr(slow_report, "SLOW_THRESHOLD_S", 0.2)
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n")
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def test_an_unmarked_slow_test_is_reported_not_failed(suite: pytest.Pytester) -> None:
    result = suite.runpytest_inprocess("-p", "tests.slow_report", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)  # only a report: the run passes
    out = result.stdout.str()
    warnings = [line for line in out.splitlines() if line.startswith("WARNING:")]
    assert len(warnings) == 1, out
    assert "test_suite.py::test_sluggish took" in warnings[0]
    assert "0.2 s threshold, and is not marked slow" in warnings[0]
    assert "deselected" not in out


def test_deselected_slow_tests_are_counted_and_make_test_slow_named(
    suite: pytest.Pytester,
) -> None:
    result = suite.runpytest_inprocess(
        "-p", "tests.slow_report", "-p", "no:cacheprovider", "-m", "not slow"
    )
    result.assert_outcomes(passed=2, deselected=2)
    result.stdout.fnmatch_lines(
        ["2 tests marked slow were deselected: run them with `make test-slow`*"]
    )
