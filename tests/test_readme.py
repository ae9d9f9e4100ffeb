"""The README's usage example runs as written (real NIXL, in-process decode peer)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(60)]

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_usage_example_runs() -> None:
    text = README.read_text()
    usage = text[text.index("## Usage") :]
    match = re.search(r"```python\n(.*?)```", usage, re.S)
    assert match, "no python example under '## Usage'"
    exec(compile(match.group(1), "README.md:usage", "exec"), {"__name__": "readme_example"})
