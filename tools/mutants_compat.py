"""Mutants of the compat views (``staging/compat.py``): races that a concurrency check of
the compat contract must kill (``tests/staging/test_dpor_compat.py``, the threaded upstream-shaped
runs of ``tests/staging/test_compat.py``).

Each mutant names a site tag (``# mutant-site: NAME``) in its file; see
:mod:`tools.mutant_sites`. A missing or duplicated tag makes it stale.
"""

from __future__ import annotations

from tools.mutants_spec import Mutant

COMPAT = "staging/compat.py"
COMPAT_TESTS = (
    "tests/staging/test_dpor_compat.py",
    "tests/staging/test_compat.py",
    "tests/staging/test_compat_leniency.py",
)

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        id="compat-purge-tombstone-split",
        file=COMPAT,
        site="purge-and-tombstone-with",
        replacement="""\
with self._lock.write_untimed():
    result = self._purge_locked(room, None)
# MUTANT: the tombstone is set in a second critical section; a late add in between
# re-creates the purged room, and the tombstone then hides it from nothing
with self._lock.write_untimed():
    if self._tombstone_capacity:
        tombstones = self._tombstones
        if room in tombstones:
            tombstones.move_to_end(room)
            tombstones[room] = False  # a new purge: its first refusal logs again
        else:
            tombstones[room] = False
            if len(tombstones) > self._tombstone_capacity:
                tombstones.popitem(last=False)
    return result
""",
        kind="race",
        description="purge_room purges under one acquisition and tombstones under a second: "
        "a late add between them resurrects the room (DPOR purge-vs-late-add)",
        tests=(*COMPAT_TESTS, "tests/staging/test_races.py"),
        stress=("staging-race",),
    ),
    Mutant(
        id="compat-test-and-add-check-then-act",
        file=COMPAT,
        site="test-and-add",
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
        site="update",
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

SENTENCE_TESTS = (
    "tests/staging/test_compat_views.py",
    "tests/staging/test_late_writers.py",
    "tests/staging/test_compat.py",
)
"""The checks of issue 23's compat sentences (and the compat unit tests)."""

MUTANTS += (
    Mutant(
        id="compat-reopen-lifts-tombstone-early",
        file=COMPAT,
        site="reopen-room",
        replacement="""\
room = check_room_id(room)
# MUTANT: the tombstone is lifted in its own critical section before reopen drops
# the id's keys: a late write in between is accepted, then silently dropped
with self._core._lock.write_untimed():
    self._core._tombstones.pop(room, None)
return self._core.reopen(room)
""",
        kind="race",
        description="reopen_room lifts the tombstone and drops the keys in two critical "
        "sections: a late write between them is accepted and lost (violates 'reopen_room "
        "lifts a tombstone and drops the id's keys in one critical section')",
        tests=SENTENCE_TESTS,
    ),
    Mutant(
        id="compat-repurge-keeps-tombstone-age",
        file=COMPAT,
        site="purge-and-tombstone-if",
        replacement="""\
tombstones[room] = False  # MUTANT: one insert path; a re-purge keeps its age
if len(tombstones) > self._tombstone_capacity:
    tombstones.popitem(last=False)
""",
        kind="sequential",
        description="a re-purged id keeps its old place in the tombstone window and is "
        "evicted before younger purges (violates 'a re-purge renews the tombstone's age')",
        tests=SENTENCE_TESTS,
    ),
    Mutant(
        id="compat-intersection-decided-on-a-snapshot",
        file=COMPAT,
        site="intersection-update-if",
        replacement="""\
if keep is not None:
    keep = keep & self.snapshot()  # MUTANT: "only what is there can be kept"
    self._core.write_many(self._ROOMS, keep=keep)
""",
        kind="race",
        description="intersection_update narrows what it keeps to a snapshot taken before "
        "the lock: an element of `other` added meanwhile is dropped (violates 'the in-place "
        "operators decide on the view's state inside the lock')",
        tests=SENTENCE_TESTS,
    ),
    Mutant(
        id="compat-intersection-raw-elements",
        file=COMPAT,
        site="intersection-update-set-plain",
        replacement="""\
plain = these  # MUTANT: the caller's raw elements are compared under the lock
""",
        kind="sequential",
        description="intersection_update compares the caller's own elements under the write "
        "lock: a str subclass's __eq__ that reads the context deadlocks (issue 25 defect 7; "
        "violates 'user code never runs under a lock of the context')",
        tests=SENTENCE_TESTS,
    ),
    Mutant(
        id="compat-self-comparison-two-snapshots",
        file=COMPAT,
        site="pair",
        statements=2,
        replacement="""\
theirs = _frozen(other)  # MUTANT: the view itself is snapshotted a second time
""",
        kind="race",
        description="view == view (and view - view ...) takes two snapshots: under "
        "concurrent writes the view disagrees with itself (issue 25's suspicion)",
        tests=SENTENCE_TESTS,
    ),
    Mutant(
        id="compat-purge-session-per-room",
        file="staging/context.py",
        site="purge-session-with",
        replacement="""\
with self._lock.write_untimed():
    by_room = self._session_rooms.pop(session_id, None)
if not by_room:
    return frozenset()
for room_id in list(by_room):
    with self._lock.write_untimed():  # MUTANT: one critical section per room
        state = self._rooms[room_id]
        state.sessions.discard(session_id)
        doomed = [key for key in state.requests if key[1] == session_id]
        if doomed:
            state.requests.difference_update(doomed)
            self._requested_keys -= len(doomed)
            touched.append(room_id)
            if not state.requests:
                self._unindex(state, room_id)
if touched:
    with self._lock.write_untimed():
        self._session_purges += 1
""",
        kind="race",
        description="purge_session drops each room's keys in its own critical section: a "
        "snapshot sees some rooms purged and others not (violates 'purge_session removes "
        "every room's keys at one instant for a reader of several keys')",
        tests=SENTENCE_TESTS,
    ),
)
