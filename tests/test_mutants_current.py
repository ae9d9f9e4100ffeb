"""Every planted violation of ``make mutants`` still applies to the code it names.

A mutant whose snippet no longer occurs exactly once in its file is "stale": ``make mutants``
refuses to run it, so the guarantee it stands for would go unchecked. This test catches that
at ``make test`` time instead (it applies nothing; it only counts occurrences).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import mutants

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent


def test_every_mutant_snippet_occurs_exactly_once() -> None:
    chosen, _ = mutants.load_mutants()
    assert chosen, "no mutants loaded"
    stale = {
        m.id: f"{m.file}: {n} times" for m in chosen if (n := mutants.occurrences(m, ROOT)) != 1
    }
    assert not stale, f"stale mutants (update their snippets): {stale}"


def test_mutant_ids_are_unique() -> None:
    chosen, _ = mutants.load_mutants()
    ids = [m.id for m in chosen]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
