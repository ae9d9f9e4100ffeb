"""The child side of ``make mutants``: a pytest plugin and a ``python -m stress`` wrapper.

Both run inside the scratch copy (cwd and ``PYTHONPATH`` = the copy) and append JSON lines to
the file named by env ``MUTANTS_RESULT``:

* ``{"event": "imports", ...}`` -- where ``staging``, ``sender``, ``stress``, ``tests`` and
  the mutated module (env ``MUTANTS_MODULE``) were imported from. Anything imported from
  outside the copy (env ``MUTANTS_SCRATCH``) is a problem: the mutant would not be what ran.
* ``{"event": "test", ...}`` -- per pytest test: outcome, phase, and the *concurrency
  signals* seen while its body ran: ``fast_switch`` (the GIL switch interval was lowered),
  ``threads`` (the test's own code started threads), ``dpor`` (frontrun explored it),
  ``stress`` (it ran a stress scenario, whose threads the stress framework started).

Pytest: ``python -m pytest -p tools.mutants_guard ...``. Stress:
``python -m tools.mutants_guard SCENARIO [stress options]``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Generator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

RESULT_ENV = "MUTANTS_RESULT"
SCRATCH_ENV = "MUTANTS_SCRATCH"
MODULE_ENV = "MUTANTS_MODULE"
CHECKED_PACKAGES = ("staging", "sender", "stress", "tests", "tools")
FAST_SWITCH_S = 1e-3
"""A switch interval below this (the default is 5 ms) counts as ``fast_switch``."""

_signals: dict[str, set[str]] = {}


def _emit(record: dict[str, Any]) -> None:
    path = os.environ.get(RESULT_ENV)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(record, sort_keys=True) + "\n")


def import_report() -> dict[str, Any]:
    """Where the checked packages and the mutated module came from, and what is wrong."""
    scratch = Path(os.environ.get(SCRATCH_ENV, "")).resolve()
    module = os.environ.get(MODULE_ENV, "")
    problems: list[str] = []
    files: dict[str, str | None] = {}
    for name in (*CHECKED_PACKAGES, module):
        mod = sys.modules.get(name) if name else None
        if mod is None:
            continue
        file = getattr(mod, "__file__", None)
        files[name] = file
        if file is None or not Path(file).resolve().is_relative_to(scratch):
            problems.append(f"{name} imported from {file}, not from the scratch copy {scratch}")
    return {
        "event": "imports",
        "scratch": str(scratch),
        "module": module,
        "module_loaded": bool(module) and module in sys.modules,
        "files": files,
        "problems": problems,
    }


def _origin(frame: FrameType | None) -> str:
    """Who started a thread: the first frame outside ``threading`` and this module."""
    scratch = Path(os.environ.get(SCRATCH_ENV, "")).resolve()
    here = Path(__file__).resolve()
    while frame is not None:
        file = Path(frame.f_code.co_filename)
        if file.name != "threading.py" and file.resolve() != here:
            if "frontrun" in file.parts:
                return "dpor"
            try:
                top = file.resolve().relative_to(scratch).parts[0]
            except ValueError:
                return "other"
            return {"tests": "threads", "stress": "stress"}.get(top, "library")
        frame = frame.f_back
    return "other"


# ---------------------------------------------------------------------------- pytest hooks


def pytest_collection_finish(session: pytest.Session) -> None:
    report = import_report()
    _emit(report)
    if report["problems"]:
        pytest.exit("; ".join(report["problems"]), returncode=3)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    signals: set[str] = set()
    if sys.getswitchinterval() < FAST_SWITCH_S:
        signals.add("fast_switch")
    fixtures = getattr(item, "fixturenames", ())
    module = getattr(item, "module", None)
    if "frontrun_enabled" in fixtures or "frontrun" in getattr(module, "__dict__", {}):
        signals.add("dpor")
    original = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        origin = _origin(sys._getframe(1))
        if origin in ("threads", "stress", "dpor"):
            signals.add(origin)
            if sys.getswitchinterval() < FAST_SWITCH_S:
                signals.add("fast_switch")
        original(thread)

    threading.Thread.start = start  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        threading.Thread.start = original  # type: ignore[method-assign]
        _signals[item.nodeid] = signals


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call" and not report.failed:
        return
    message = ""
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = str(getattr(crash, "message", "") or report.longreprtext[-300:])
    _emit(
        {
            "event": "test",
            "nodeid": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "signals": sorted(_signals.get(report.nodeid, ())),
            "message": message[:300],
        }
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    report = import_report()
    report["event"] = "imports-at-end"
    _emit(report)


# ---------------------------------------------------------------------------- stress wrapper


def stress_main(argv: list[str]) -> int:
    """Import the scenario, check where everything came from, then run the stress CLI."""
    if not argv:
        print("usage: python -m tools.mutants_guard SCENARIO [stress options]", file=sys.stderr)
        return 2
    from stress.cli import main
    from stress.framework import find_scenario

    if find_scenario(argv[0]) is None:
        print(f"unknown stress scenario {argv[0]!r}", file=sys.stderr)
        return 2
    report = import_report()
    _emit(report)
    if report["problems"]:
        print("; ".join(report["problems"]), file=sys.stderr)
        return 3
    return main(argv)


if __name__ == "__main__":
    sys.exit(stress_main(sys.argv[1:]))
