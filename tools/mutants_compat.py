"""Mutants of the compat views (``staging/compat.py``): races that a concurrency check of
the compat contract must kill (``tests/test_dpor_compat.py``, the threaded upstream-shaped
runs of ``tests/test_compat.py``).

Each snippet must match the current source exactly once; when the code changes, update the
snippet here (``make mutants`` stops with "stale mutant" until then).
"""

from __future__ import annotations

from tools.mutants_spec import Mutant

COMPAT = "staging/compat.py"
COMPAT_TESTS = (
    "tests/test_dpor_compat.py",
    "tests/test_compat.py",
    "tests/test_compat_leniency.py",
)

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        id="compat-purge-tombstone-split",
        file=COMPAT,
        original="""\
        with self._lock.write_untimed():
            result = self._purge_locked(room, None)
            if self._tombstone_capacity:
""",
        replacement="""\
        with self._lock.write_untimed():
            result = self._purge_locked(room, None)
        # MUTANT: the tombstone is set in a second critical section; a late add in between
        # re-creates the purged room, and the tombstone then hides it from nothing
        with self._lock.write_untimed():
            if self._tombstone_capacity:
""",
        kind="race",
        description="purge_room purges under one acquisition and tombstones under a second: "
        "a late add between them resurrects the room (DPOR purge-vs-late-add)",
        tests=COMPAT_TESTS,
    ),
    Mutant(
        id="compat-test-and-add-check-then-act",
        file=COMPAT,
        original="""\
        return self._test_and_add(self._check(value))
""",
        replacement="""\
        item = self._check(value)
        present = item in self  # MUTANT: tested lock-free, then added: two winners
        self._test_and_add(item)
        return not present
""",
        kind="race",
        description="test_and_add checks with the lock-free `in` and then adds: two threads "
        "can both get True (DPOR two-adders)",
        tests=COMPAT_TESTS,
    ),
    Mutant(
        id="compat-update-per-element",
        file=COMPAT,
        original="""\
        if items:
            self._core.write_many(self._ROOMS, adds=items)
""",
        replacement="""\
        for item in items:  # MUTANT: one lock acquisition per element
            self._core.write_many(self._ROOMS, adds=(item,))
""",
        kind="race",
        description="update (and |=) takes the lock once per element: a snapshot sees half "
        "an update (DPOR update-vs-snapshot)",
        tests=COMPAT_TESTS,
    ),
)
