"""Fixtures of the SGLang client tests (``make sglang``; see ``tools/sglang/venvs.py``).

These tests import released SGLang code. In the normal suite (``make test``) SGLang is not
installed, and every test here is *skipped with that reason* (``-ra`` lists it). Under
``make sglang`` the runner sets ``NIXL_STAGING_SGLANG_EXPECT`` to the release it installed:
then an SGLang that does not import, or is another version, is an error, not a skip.

The ``figures`` fixture collects what the tests measured; the session writes it to
``NIXL_STAGING_SGLANG_REPORT`` (JSON) and prints it at the end of pytest's report, so that
CI's output says what each release printed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tools.sglang import drive

EXPECT = os.environ.get("NIXL_STAGING_SGLANG_EXPECT")
_FIGURES: list[str] = []


@pytest.fixture(scope="session")
def up() -> drive.Upstream:
    """The installed release's modules (skips, with the reason, where none is installed)."""
    try:
        upstream = drive.load()
    except ImportError as exc:
        if EXPECT:
            pytest.fail(f"sglang {EXPECT} was to be tested here but does not import: {exc!r}")
        pytest.skip(f"sglang is not installed here ({exc}); `make sglang` runs these tests")
    if EXPECT and upstream.version != EXPECT:
        pytest.fail(f"expected sglang {EXPECT}, imported {upstream.version}")
    return upstream


@pytest.fixture(scope="session")
def sink() -> Iterator[drive.StagingRequests]:
    """The decode side's staging socket (a real ZeroMQ PULL on loopback)."""
    requests = drive.StagingRequests()
    try:
        yield requests
    finally:
        requests.close()


@pytest.fixture
def scheduled(up: drive.Upstream) -> Iterator[None]:
    with drive.schedule_config(up):
        yield


@pytest.fixture(scope="session")
def figures(up: drive.Upstream) -> list[str]:
    """Lines of measured figures, printed at the end and written to the report."""
    return _FIGURES


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("NIXL_STAGING_SGLANG_REPORT")
    if path:
        data: dict[str, Any] = {"release": EXPECT, "exit": int(exitstatus), "figures": _FIGURES}
        Path(path).write_text(json.dumps(data, indent=1))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _FIGURES:
        terminalreporter.section(f"sglang {EXPECT or ''} figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)
