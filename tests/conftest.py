"""Shared pytest fixtures: thread-leak checks and interleaving pressure."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator

import pytest

from stress.ucx_env import confine_to_loopback

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
# Every agent of the tests (and of the peer processes they start) uses lo only: unconfined,
# UCX would also use the veth of a two-host run of another process (stress.ucx_env).
confine_to_loopback()

# NIXL-specific fixtures (real agents, peer processes) live in their own module.
# tests.slow_report: at the end of a run, a warning line per test not marked `slow` whose call
# took SLOW_THRESHOLD_S (15 s) or more, and how many `slow` tests were deselected (run them
# with `make test-slow`). pytester: tests/harness/test_slow_report.py runs small suites in-process.
pytest_plugins = ["tests.fixtures_nixl", "tests.slow_report", "pytester"]


@pytest.fixture
def fast_switch() -> Iterator[None]:
    """Lower the GIL switch interval to 1 µs so races become likely (restored after)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


@pytest.fixture
def frontrun_enabled(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Let ``frontrun.explore`` run inside plain pytest: frontrun skips unless it believes
    it runs under its CLI (``FRONTRUN_ACTIVE=1``); see tests/staging/test_dpor_room_lifecycle.py."""
    monkeypatch.setenv("FRONTRUN_ACTIVE", "1")
    yield


@pytest.fixture
def thread_excepthook() -> Iterator[list[threading.ExceptHookArgs]]:
    """Capture exceptions escaping any thread; the test asserts the list is empty."""
    caught: list[threading.ExceptHookArgs] = []
    old = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        caught.append(args)

    threading.excepthook = hook
    try:
        yield caught
    finally:
        threading.excepthook = old


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Every test must leave no new Python thread alive (bounded grace period)."""
    before = set(threading.enumerate())
    yield
    deadline = 5.0
    leaked: list[threading.Thread] = []
    for t in threading.enumerate():
        if t not in before and t is not threading.current_thread():
            t.join(timeout=deadline)
            if t.is_alive():
                leaked.append(t)
    assert not leaked, f"threads left alive: {[t.name for t in leaked]}"
