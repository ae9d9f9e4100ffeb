"""Every planted violation of ``make mutants`` still has its site in the code it names.

A mutant names a site tag (``# mutant-site: NAME``) in its file, never a quoted line; a
mutant whose tag is missing or duplicated is "stale": ``make mutants`` refuses to run it, so
the guarantee it stands for would go unchecked. This test catches that at ``make test`` time
instead (it checks tags, not library lines: changing a tagged statement never fails it). The
apply function itself is tested on small temporary files.
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from tools import mutant_sites, mutants
from tools.mutants_spec import Mutant

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def test_every_mutant_site_tag_occurs_exactly_once() -> None:
    chosen, _ = mutants.load_mutants()
    assert chosen, "no mutants loaded"
    stale = {m.id: p for m in chosen if (p := mutants.site_problem(m, ROOT)) is not None}
    assert not stale, f"stale mutants (put their site tags back): {stale}"


def test_mutant_ids_are_unique() -> None:
    chosen, _ = mutants.load_mutants()
    ids = [m.id for m in chosen]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})


def test_every_site_tag_is_used_once_per_file() -> None:
    """No tag name twice in a file (also tags that no mutant uses yet)."""
    chosen, _ = mutants.load_mutants()
    for file in sorted({m.file for m in chosen}):
        names = [t.name for t in mutant_sites.tags((ROOT / file).read_text(encoding="utf-8"))]
        assert len(names) == len(set(names)), (file, names)


SOURCE = textwrap.dedent(
    """\
    import threading


    class Box:
        def __init__(self) -> None:
            self.lock = threading.Lock()
            self.items: list[int] = []

        def put(self, item: int) -> int:
            # mutant-site: put-lock
            with self.lock:
                self.items.append(item)
                size = len(self.items)
            return size

        def take(self) -> int:
            if not self.items:  # mutant-site: take-empty
                raise LookupError("empty")
            # mutant-site: take-pop
            item = self.items.pop()
            count = len(self.items)
            return item + 0 * count
    """
)


def _mutant(site: str, replacement: str, statements: int = 1) -> Mutant:
    return Mutant(
        id="t",
        file="box.py",
        site=site,
        replacement=replacement,
        kind="sequential",
        description="test",
        tests=("x",),
        statements=statements,
    )


def _write(tmp_path: Path, source: str) -> Path:
    (tmp_path / "box.py").write_text(source, encoding="utf-8")
    return tmp_path


def _apply(tmp_path: Path, mutant: Mutant, source: str = SOURCE) -> str:
    mutants.apply(mutant, _write(tmp_path, source))
    return (tmp_path / "box.py").read_text(encoding="utf-8")


def test_apply_own_line_tag_replaces_a_whole_block(tmp_path: Path) -> None:
    """An own-line tag: the next statement (a ``with`` and its body) is replaced, re-indented."""
    out = _apply(tmp_path, _mutant("put-lock", "self.items.append(item)\nsize = len(self.items)\n"))
    assert "        # mutant-site: put-lock\n" in out  # the tag line stays
    assert (
        "        self.items.append(item)\n"
        "        size = len(self.items)\n"
        "        return size\n" in out
    )
    assert "with self.lock" not in out
    assert out.count("\n") == SOURCE.count("\n") - 1


def test_apply_trailing_tag_and_dedent(tmp_path: Path) -> None:
    """A trailing tag: the statement starting on its line; the replacement may be indented."""
    out = _apply(tmp_path, _mutant("take-empty", "    if self.items is None:\n        pass\n"))
    expected = "        if self.items is None:\n            pass\n        # mutant-site: take-pop"
    assert expected in out
    assert "LookupError" not in out


def test_apply_two_statements_and_a_deletion(tmp_path: Path) -> None:
    out = _apply(tmp_path, _mutant("take-pop", "item = self.items[-1]\n", statements=2))
    assert "        item = self.items[-1]\n        return item + 0 * count\n" in out
    assert "pop()" not in out and "count = len" not in out
    out = _apply(tmp_path, _mutant("take-pop", "", statements=2))
    assert "        # mutant-site: take-pop\n        return item" in out


def test_a_mutant_with_further_sites_makes_every_edit(tmp_path: Path) -> None:
    """``also``: a value read at one site and used at another, one mutant."""
    mutant = dataclasses.replace(
        _mutant("put-lock", "self.items.append(item)\nsize = len(self.items)\n"),
        also=(("take-empty", "if len(self.items) < 0:\n    pass\n"),),
    )
    out = _apply(tmp_path, mutant)
    assert "with self.lock" not in out and "LookupError" not in out
    assert "        if len(self.items) < 0:\n            pass\n" in out
    missing = dataclasses.replace(mutant, also=(("no-such-site", "pass\n"),))
    assert "no-such-site" in str(mutants.site_problem(missing, tmp_path))


def test_a_site_inside_an_earlier_edit_or_named_twice_is_refused(tmp_path: Path) -> None:
    """Sites are found in the unchanged file but edited in order: a site that an earlier
    edit removed is stale, not a crash; a site named twice is refused when declared."""
    nested = SOURCE.replace(
        "self.items.append(item)\n", "self.items.append(item)  # mutant-site: put-append\n"
    )
    mutant = dataclasses.replace(
        _mutant("put-lock", "pass\n"), also=(("put-append", "self.items.clear()\n"),)
    )
    assert mutants.site_problem(mutant, _write(tmp_path, nested)) is None
    with pytest.raises(mutants.StaleMutantError, match="put-append"):
        mutants.apply(mutant, tmp_path)
    with pytest.raises(ValueError, match="named twice"):
        dataclasses.replace(mutant, also=(("put-lock", "pass\n"),))


def test_a_changed_site_line_still_applies(tmp_path: Path) -> None:
    """The point of tags: the tagged code may change; the mutant still finds its site."""
    changed = SOURCE.replace("with self.lock:", "with self.lock:  # held briefly")
    out = _apply(tmp_path, _mutant("put-lock", "pass\n"), changed)
    assert "        pass\n        return size\n" in out


@pytest.mark.parametrize(
    ("source", "site", "statements", "why"),
    [
        (SOURCE, "nowhere", 1, "found 0 times"),
        (SOURCE + "# mutant-site: put-lock\nx = 1\n", "put-lock", 1, "found 2 times"),
        (SOURCE, "take-pop", 4, "only 3 sibling statements"),
        (SOURCE + "# mutant-site: end\n", "end", 1, "no statement after it"),
        ("x = 1; y = 2  # mutant-site: two\n", "two", 1, "code after the site"),
        ("if True:\n    x = 1\n# mutant-site: odd\n    y = 2\n", "odd", 1, "not at its"),
    ],
)
def test_apply_refuses_a_bad_site(
    tmp_path: Path, source: str, site: str, statements: int, why: str
) -> None:
    with pytest.raises(mutants.StaleMutantError, match=why):
        _apply(tmp_path, _mutant(site, "pass\n", statements), source)


def test_apply_refuses_a_no_op_and_a_broken_file(tmp_path: Path) -> None:
    with pytest.raises(mutants.StaleMutantError, match="no-op"):
        _apply(tmp_path, _mutant("take-pop", "item = self.items.pop()\n"))
    with pytest.raises(mutants.StaleMutantError, match="does not parse"):
        _apply(tmp_path, _mutant("take-pop", "item = (\n"))


def test_a_tag_inside_a_string_is_no_tag() -> None:
    text = 's = "# mutant-site: fake"\n# mutant-site: real\nx = 1\n'
    assert [t.name for t in mutant_sites.tags(text)] == ["real"]


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
