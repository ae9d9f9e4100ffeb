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
whole body. A bug that needs two edits (a value read early, used later) names its further
sites in ``also``: ``(site, replacement)`` pairs of one statement each, in the same file.
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
        site: the name of its site tag (``# mutant-site: NAME``, exactly once in ``file``).
        replacement: the code that replaces the site's statements (dedented, re-indented).
        kind: see :data:`KINDS`.
        description: one line: the bug, and what should catch it.
        tests: pytest arguments (files or node ids) of the fast targeted tests to run.
        stress: stress scenarios to run as ``python -m stress --quick SCENARIO``.
        statements: how many consecutive sibling statements, from the tagged one, the site is.
        also: further ``(site, replacement)`` pairs in ``file``, one statement each, applied
            after the first.

    Raises:
        ValueError: an empty field, a site name that is not kebab-case or named twice, an
            unknown kind, fewer than one statement, or nothing to run.
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
    also: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.id or not self.id.replace("-", "").isalnum():
            raise ValueError(f"mutant id {self.id!r}: use letters, digits and '-'")
        if self.kind not in KINDS:
            raise ValueError(f"mutant {self.id}: kind {self.kind!r} not in {KINDS}")
        sites = [site for site, _, _ in self.edits]
        for site in sites:
            if not NAME_RE.match(site):
                raise ValueError(f"mutant {self.id}: site {site!r}: use kebab-case")
        if len(set(sites)) != len(sites):
            raise ValueError(f"mutant {self.id}: a site named twice in {sites}")
        if self.statements < 1:
            raise ValueError(f"mutant {self.id}: statements={self.statements} (at least 1)")
        if not self.description or not (self.tests or self.stress):
            raise ValueError(f"mutant {self.id}: needs a description and something to run")

    @property
    def edits(self) -> tuple[tuple[str, str, int], ...]:
        """Every ``(site, replacement, statements)`` it makes, in order."""
        also = tuple((site, code, 1) for site, code in self.also)
        return ((self.site, self.replacement, self.statements), *also)

    @property
    def module(self) -> str:
        """The dotted module name of ``file`` (``staging/context.py`` -> ``staging.context``)."""
        path = self.file.removesuffix(".py")
        return path.replace("/", ".").removesuffix(".__init__")


# The tests of an audit once lived in one file each; they now live in the files of the behaviour
# they check (tests by contract). A mutant that named such a file runs the same tests.
ISSUE_9_TESTS: tuple[str, ...] = (
    "tests/sender/test_post_fence.py::test_cleared_room_never_writes_pages_given_to_another_room",
    "tests/sender/test_chunks_end_once.py::test_two_inline_progress_calls_never_count_a_chunk_twice",
    "tests/sender/test_failure_reporting.py::test_transfer_released_by_transport_fails_room_within_deadline",
    "tests/sender/test_workers_never_die.py::test_worker_survives_fail_session_under_lock_timeout_and_long_reader",
    "tests/sender/test_workers_never_die.py::test_worker_survives_any_error_while_handling_a_transport_error",
    "tests/sender/test_clear.py::test_clear_never_raises_and_purges_all_under_lock_timeout",
    "tests/sender/test_failure_reporting.py::test_failure_exception_never_raises_another_openings_exception",
    "tests/sender/test_close.py::test_room_opened_while_close_runs_does_not_survive_close",
    "tests/sender/test_close.py::test_close_racing_open_room_repeatedly",
    "tests/sender/test_bad_input.py::test_short_info_after_init_is_refused_and_fails_the_room",
    "tests/sender/test_bad_input.py::test_send_after_a_short_info_fails_cleanly",
)
"""Found by the audit of issue 9."""

ISSUE_16_TESTS: tuple[str, ...] = (
    "tests/sender/test_draining.py::test_settled_hung_chunk_ends_under_steady_traffic",
    "tests/sender/test_close.py::test_close_with_a_huge_timeout_closes",
    "tests/sender/test_bad_input.py::test_bad_close_timeout_changes_nothing",
    "tests/sender/test_draining.py::test_huge_slot_timeout_waits_instead_of_failing",
    "tests/sender/test_bad_input.py::test_poll_interval_past_the_deadline_is_refused",
    "tests/sender/test_bad_input.py::test_repeated_destination_pages_are_refused",
    "tests/sender/test_bad_input.py::test_unaddressable_destination_page_is_refused",
    "tests/sender/test_bad_input.py::test_a_built_info_with_repeats_is_refused_and_changes_nothing",
    "tests/sender/test_bad_input.py::test_two_chunks_never_write_one_decode_page_twice",
    "tests/sender/test_transport.py::test_write_pages_racing_close_raises_transport_closed",
    "tests/sender/test_transport.py::test_write_pages_racing_close_only_ever_raises_transport_closed",
    "tests/sender/test_close.py::test_close_does_not_withhold_the_notice_of_a_chunk_ending_elsewhere",
)
"""Found by the audit of issue 16, under load."""
