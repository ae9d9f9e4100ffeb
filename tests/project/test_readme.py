"""The README's examples run as written: the native staging quick start (core install) and
the sender usage example (real NIXL, in-process decode peer). The compat quick start is run
by ``tests/staging/test_compat.py``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


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


def test_readme_end_to_end_headline_is_typical_with_spread_and_command() -> None:
    """The headline was one outlier run (425 rooms/s, where the runs docs/PERFORMANCE.md
    quotes gave 141-184 and a new user measured 194): a headline is the typical figure,
    with its spread and the command that gives it."""
    text = README.read_text(encoding="utf-8")
    (row,) = [ln for ln in text.splitlines() if ln.startswith("| end to end")]
    assert "`python -m bench stress-rooms`" in row
    assert re.search(r"\b\d{3}\u2013\d{3} in \w+ runs\b", row), row  # a spread, with its runs
    assert "425" not in row or "outlier" in row
    perf = (README.parent / "docs" / "PERFORMANCE.md").read_text(encoding="utf-8")
    assert "303\u2013319 in three runs" in perf and "outlier" in perf


def test_readme_sglang_install_command_works_before_publication() -> None:
    """"Using it with SGLang" began with `pip install nixl-staging`, which finds nothing
    (not published): its first command installs from a clone, as "Install" says."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Using it with SGLang") : text.index("## Install")]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match
    first = match.group(1).splitlines()[0]
    assert first.startswith("pip install ./nixl-staging"), first
    assert "pip install nixl-staging " not in section.replace("`", " ")
