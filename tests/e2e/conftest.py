"""Every test under ``tests/e2e/`` is ``slow``: each starts decode peer processes (or a second
network namespace) and runs rooms end to end, seconds per test. ``make test`` leaves them
out; ``make test-slow`` and ``make test-all`` (CI) run them."""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.slow)
