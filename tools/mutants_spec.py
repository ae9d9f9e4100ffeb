"""What a mutant is, for ``make mutants`` (:mod:`tools.mutants`).

A mutant is one deliberate bug: a named *site* of one source file -- the statement after (or
on) a ``# mutant-site: NAME`` comment tag -- and the code that replaces it
(:mod:`tools.mutant_sites`). No mutant quotes a library line: the code may change freely, and
the runner refuses to run a mutant whose tag is missing or duplicated -- that is how a mutant
list that no longer matches the code is detected. Each data module (``tools/mutants_*.py``)
defines ``MUTANTS``, a tuple of :class:`Mutant`; an empty tuple means "nothing defined yet" and
the module is skipped.

Writing a mutant: put ``# mutant-site: some-name`` on its own line above the statement to
break (same indentation; or at the end of the statement's first line), then add
``Mutant(id=..., file=..., site="some-name", replacement=..., ...)``. The replacement
is the whole new code of the site (any indentation: it is dedented, then indented to the
site's; empty: the site is deleted); ``statements=N`` makes the site N consecutive sibling
statements. A block statement (``with``, ``if``, ``for``, ``try``) is one statement with its
whole body.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tools.mutant_sites import NAME_RE

Kind = Literal["race", "lifecycle", "sequential"]
KINDS: tuple[Kind, ...] = ("race", "lifecycle", "sequential")
"""``race``: wrong only under some interleaving (sequentially exact); the target is that a
concurrency check kills it. ``lifecycle``: a room/handle lifecycle rule broken (late writes,
stale handles, closed rooms). ``sequential``: a plain logic bug, visible without threads."""

NOT_CONCURRENCY_CHECKS: tuple[str, ...] = (
    # Counts lock acquisitions and contention: its threads only make contention to count;
    # it judges no interleaving's outcome (a "lock counter" kill is not a concurrency kill).
    "tests/test_locks.py::test_stats_count_acquisitions_and_contention*",
)
"""``fnmatch`` patterns of pytest node ids that start threads (or lower the switch interval)
without checking what an interleaving did: never classified as concurrency checks."""


@dataclass(frozen=True)
class Mutant:
    """One mutant.

    Attributes:
        id: short unique name (``make mutants MUTANTS=id1,id2``).
        file: the source file it changes, relative to the repository root.
        site: the name of its site tag (``# mutant-site: NAME``, exactly once in ``file``).
        replacement: the code that replaces the site's statements (dedented, re-indented).
        kind: see :data:`KINDS`.
        description: one line: the bug, and what should catch it.
        tests: pytest arguments (files or node ids) of the fast targeted tests to run.
        stress: stress scenarios to run as ``python -m stress --quick SCENARIO``.
        statements: how many consecutive sibling statements, from the tagged one, the site is.

    Raises:
        ValueError: an empty field, a site name that is not kebab-case, an unknown kind,
            fewer than one statement, or nothing to run.
    """

    id: str
    file: str
    site: str
    replacement: str
    kind: Kind
    description: str
    tests: tuple[str, ...]
    stress: tuple[str, ...] = field(default=())
    statements: int = 1

    def __post_init__(self) -> None:
        if not self.id or not self.id.replace("-", "").isalnum():
            raise ValueError(f"mutant id {self.id!r}: use letters, digits and '-'")
        if self.kind not in KINDS:
            raise ValueError(f"mutant {self.id}: kind {self.kind!r} not in {KINDS}")
        if not NAME_RE.match(self.site):
            raise ValueError(f"mutant {self.id}: site {self.site!r}: use kebab-case")
        if self.statements < 1:
            raise ValueError(f"mutant {self.id}: statements={self.statements} (at least 1)")
        if not self.description or not (self.tests or self.stress):
            raise ValueError(f"mutant {self.id}: needs a description and something to run")

    @property
    def module(self) -> str:
        """The dotted module name of ``file`` (``staging/context.py`` -> ``staging.context``)."""
        path = self.file.removesuffix(".py")
        return path.replace("/", ".").removesuffix(".__init__")
