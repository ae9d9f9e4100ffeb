"""The README's examples run as written: the native staging quick start (core install) and
the sender usage example (real NIXL, in-process decode peer). The compat quick start is run
by ``tests/test_compat.py``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _first_python_block(start: str, end: str | None = None) -> str:
    """The first ``python`` block after the heading ``start`` (and before ``end``)."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index(start) : None if end is None else text.index(end)]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"no python example under {start!r}"
    return match.group(1)


@pytest.mark.timeout(30)
def test_readme_native_staging_quick_start_runs() -> None:
    code = _first_python_block("### The native API: `StagingContext`", "## Usage")
    assert "torch" not in code and "sender" not in code  # the core install is enough
    assert "StagingContext()" in code
    exec(compile(code, "README.md:native-quick-start", "exec"), {"__name__": "native_quick_start"})


@pytest.mark.nixl
@pytest.mark.timeout(60)
def test_readme_usage_example_runs() -> None:
    code = _first_python_block("## Usage")
    exec(compile(code, "README.md:usage", "exec"), {"__name__": "readme_example"})
