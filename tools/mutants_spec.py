"""What a mutant is, for ``make mutants`` (:mod:`tools.mutants`).

A mutant is one deliberate bug: an exact snippet of one source file and its replacement.
The runner applies it to a scratch copy of the repository and refuses to run it when the
snippet is not found exactly once -- that is how a mutant list that no longer matches the
code is detected. Each data module (``tools/mutants_*.py``) defines ``MUTANTS``, a tuple of
:class:`Mutant`; an empty tuple means "nothing defined yet" and the module is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["race", "lifecycle", "sequential"]
KINDS: tuple[Kind, ...] = ("race", "lifecycle", "sequential")
"""``race``: wrong only under some interleaving (sequentially exact); the target is that a
concurrency check kills it. ``lifecycle``: a room/handle lifecycle rule broken (late writes,
stale handles, closed rooms). ``sequential``: a plain logic bug, visible without threads."""

NOT_CONCURRENCY_CHECKS: tuple[str, ...] = (
    # Counts lock acquisitions and contention: its threads only make contention to count;
    # it judges no interleaving's outcome (a "lock counter" kill is not a concurrency kill).
    "tests/staging/test_locks.py::test_stats_count_acquisitions_and_contention*",
)
"""``fnmatch`` patterns of pytest node ids that start threads (or lower the switch interval)
without checking what an interleaving did: never classified as concurrency checks."""


@dataclass(frozen=True)
class Mutant:
    """One mutant.

    Attributes:
        id: short unique name (``make mutants MUTANTS=id1,id2``).
        file: the source file it changes, relative to the repository root.
        original: the exact snippet to replace (must occur exactly once in ``file``).
        replacement: what replaces it.
        kind: see :data:`KINDS`.
        description: one line: the bug, and what should catch it.
        tests: pytest arguments (files or node ids) of the fast targeted tests to run.
        stress: stress scenarios to run as ``python -m stress --quick SCENARIO``.

    Raises:
        ValueError: an empty field, an unknown kind, a no-op replacement, or nothing to run.
    """

    id: str
    file: str
    original: str
    replacement: str
    kind: Kind
    description: str
    tests: tuple[str, ...]
    stress: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.id or not self.id.replace("-", "").isalnum():
            raise ValueError(f"mutant id {self.id!r}: use letters, digits and '-'")
        if self.kind not in KINDS:
            raise ValueError(f"mutant {self.id}: kind {self.kind!r} not in {KINDS}")
        if not self.original or self.original == self.replacement:
            raise ValueError(f"mutant {self.id}: empty snippet or no-op replacement")
        if not self.description or not (self.tests or self.stress):
            raise ValueError(f"mutant {self.id}: needs a description and something to run")

    @property
    def module(self) -> str:
        """The dotted module name of ``file`` (``staging/context.py`` -> ``staging.context``)."""
        path = self.file.removesuffix(".py")
        return path.replace("/", ".").removesuffix(".__init__")
