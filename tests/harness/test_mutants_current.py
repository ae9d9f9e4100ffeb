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

ROOT = Path(__file__).resolve().parents[2]


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


def test_every_mutants_tests_name_existing_test_files_and_functions() -> None:
    """A mutant's ``tests`` are the files (or node ids) that kill it: after a test moves, each
    must still name a file that exists and, for a node id, a test function defined in it."""
    chosen, _ = mutants.load_mutants()
    missing: dict[str, list[str]] = {}
    for m in chosen:
        for target in m.tests:
            path, _, node = target.partition("::")
            file = ROOT / path
            if not file.is_file():
                missing.setdefault(m.id, []).append(f"{target}: no such file")
                continue
            name = node.split("[")[0].split("::")[-1].rstrip("*")
            if name and f"def {name}" not in file.read_text(encoding="utf-8"):
                missing.setdefault(m.id, []).append(f"{target}: no test {name}")
    assert not missing, f"mutants naming tests that do not exist: {missing}"
