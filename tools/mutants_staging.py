"""Mutants of the staging layer (``staging/context.py``, ``staging/locks.py``).

Each mutant names a site tag (``# mutant-site: NAME``) in its file; see
:mod:`tools.mutant_sites`. A missing or duplicated tag makes it stale.
"""

from __future__ import annotations

from tools.mutants_spec import Mutant

STAGING_TESTS = (
    "tests/staging/test_context.py",
    "tests/staging/test_late_writers.py",
    "tests/staging/test_races.py",
    "tests/staging/test_point_reads.py",
    "tests/staging/test_linearizability.py",
)
# The DPOR proofs only for the lifecycle mutants: mutants that add shared-memory steps to the
# explored paths (caches, a second critical section, a check outside the lock) make the
# exploration outgrow its 120 s limit, which is a timeout, not a finding.
WITH_DPOR = (*STAGING_TESTS, "tests/staging/test_dpor_room_lifecycle.py")
STAGING_STRESS = ("staging-race",)

CONTEXT = "staging/context.py"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        id="is-requested-first-read-cache",
        file=CONTEXT,
        site="is-requested-return",
        replacement="""\
if state is None or (generation is not None and state.generation != generation):
    return False
cache = self.__dict__.setdefault("_mutant_cache", {})
keys = cache.get((room_id, state.generation))
if keys is None:  # MUTANT: an opening's keys cached at its first read, never refreshed
    keys = cache[(room_id, state.generation)] = frozenset(state.requests)
return (chunk_idx, session_id) in keys
""",
        kind="sequential",
        description="is_requested answers from a cache filled at the first read of an opening "
        "(contract tests read only after writing); staging-race's quiescent point reads",
        tests=STAGING_TESTS,
        stress=STAGING_STRESS,
    ),
    Mutant(
        id="is-requested-stale-cache-race",
        file=CONTEXT,
        site="is-requested-set-state",
        statements=2,
        replacement="""\
cache = self.__dict__.get("_mutant_cache")
if cache is None or cache[0] != self._lock.stats().write_acquisitions:
    keys = self.prefetch_requested  # under the read lock ...
    # MUTANT: ... but the stamp is read after it: a writer in between leaves old keys
    # under its new stamp, stale until the next write
    cache = (self._lock.stats().write_acquisitions, keys)
    self.__dict__["_mutant_cache"] = cache
state = self._rooms.get(room_id)
return (
    state is not None
    and (generation is None or state.generation == generation)
    and (room_id, chunk_idx, session_id) in cache[1]
)
""",
        kind="race",
        description="is_requested answers from a snapshot cache whose write-count stamp is "
        "read after the snapshot (sequentially exact); read-your-writes under readers",
        tests=STAGING_TESTS,
        stress=STAGING_STRESS,
    ),
    Mutant(
        id="purge-room-two-critical-sections",
        file=CONTEXT,
        site="purge-room",
        replacement="""\
with self._lock.write_untimed():  # MUTANT: the room is closed in one critical section
    state = self._rooms.get(room_id)
    if state is None or (generation is not None and state.generation != generation):
        return RoomPurge(room_id, False, False, frozenset())
    del self._rooms[room_id]
with self._lock.write_untimed():  # ... and its keys and counters go in a second one
    self._rooms[room_id] = state
    self._close_locked(room_id, None)
""",
        kind="race",
        description="purge_room closes the room, releases the lock, then drops its keys and "
        "counters under a second acquisition: a half-purged room is observable",
        tests=STAGING_TESTS,
        stress=STAGING_STRESS,
    ),
    Mutant(
        id="request-prefetch-check-then-act",
        file=CONTEXT,
        site="request-prefetch-set-requests",
        statements=3,
        replacement="""\
requests = state.requests
if key in requests:
    return False
lock.release_write()  # MUTANT: the lock is let go between the test and the add
lock.acquire_write()
requests.add(key)
""",
        kind="race",
        description="request_prefetch lets the lock go between testing the key and adding it: "
        "two threads both add it and both report True; the key counter drifts",
        tests=STAGING_TESTS,
        stress=STAGING_STRESS,
    ),
    Mutant(
        id="purge-session-keeps-room-keys",
        file=CONTEXT,
        site="purge-session-call-difference-update",
        replacement="""\
pass  # MUTANT: the session's keys stay in the room (index and counter go)
""",
        kind="sequential",
        description="purge_session drops the session index and the counter but leaves the "
        "keys in their rooms",
        tests=(*STAGING_TESTS, "tests/sender/test_fail_session.py"),
        stress=STAGING_STRESS,
    ),
    Mutant(
        id="live-ignores-handle-generation",
        file=CONTEXT,
        site="request-prefetch-if",
        replacement="""\
if state is None:  # MUTANT: a stale handle is not refused
    self._refuse(room_id, generation)
    return False
""",
        kind="lifecycle",
        description="request_prefetch drops the generation check of the open room: a stale "
        "handle writes into the room's next opening",
        tests=WITH_DPOR,
        stress=STAGING_STRESS,
    ),
    Mutant(
        id="mark-prefetched-closed-room-accepted",
        file=CONTEXT,
        site="mark-prefetched-return",
        replacement="""\
return True  # MUTANT: a mark on a closed room (or stale handle) reports success
""",
        kind="lifecycle",
        description="mark_prefetched on a closed room or through a stale handle returns True "
        "(a late writer is told its write landed)",
        tests=WITH_DPOR,
        stress=STAGING_STRESS,
    ),
    Mutant(
        id="rw-write-lock-shared",
        file="staging/locks.py",
        site="write",
        replacement="""\
return _Guard(self, self._inner("read"), "write")  # MUTANT: writers share the lock
""",
        kind="race",
        description="RWLock.write() takes the shared (read) side: writers and readers of an "
        "rw context run together",
        tests=("tests/staging/test_locks.py", *STAGING_TESTS),
        stress=STAGING_STRESS,
    ),
    Mutant(
        id="mutex-contended-skips-wait",
        file="staging/locks.py",
        site="take-try-acquire",
        replacement="""\
inner.acquire(False)  # MUTANT: a contended acquisition goes on without the lock
""",
        kind="race",
        description="a try-acquire that fails goes on as if it had the lock: mutual exclusion "
        "is lost only under contention",
        tests=("tests/staging/test_locks.py", *STAGING_TESTS),
        stress=STAGING_STRESS,
    ),
    Mutant(
        id="owner-cleared-after-release",
        file="staging/locks.py",
        site="give",
        statements=2,
        replacement="""\
inner.release()  # MUTANT: the lock is let go before the owner is cleared ...
if mode == "write" or self._exclusive_only:
    self._owner = None  # ... which can erase the next holder's own entry
""",
        kind="race",
        description="the release lets the lock go before clearing the owner: under contention "
        "it erases the next holder's ownership (assert_held fails in the holder)",
        tests=("tests/staging/test_locks.py", *STAGING_TESTS),
        stress=STAGING_STRESS,
    ),
    Mutant(
        id="mutex-acquire-write-skips-wait",
        file="staging/locks.py",
        site="acquire-write-try",
        replacement="""\
mutex.acquire(False)  # MUTANT: a contended acquire_write goes on without the lock
""",
        kind="race",
        description="MutexLock.acquire_write (the context writers' path) goes on when its "
        "try-acquire fails: mutual exclusion is lost only under contention",
        tests=("tests/staging/test_locks.py", *STAGING_TESTS),
        stress=STAGING_STRESS,
    ),
    Mutant(
        id="mutex-release-write-owner-cleared-after",
        file="staging/locks.py",
        site="release-write",
        statements=2,
        replacement="""\
self._mutex.release()  # MUTANT: release_write lets the mutex go before clearing the owner
self._owner = None
""",
        kind="race",
        description="MutexLock.release_write clears the owner after letting the mutex go: it "
        "can erase the next holder's ownership",
        tests=("tests/staging/test_locks.py", *STAGING_TESTS),
        stress=STAGING_STRESS,
    ),
    Mutant(
        id="contended-waiter-claims-owner",
        file="staging/locks.py",
        site="acquire-contended",
        statements=2,
        replacement="""\
with self._stats_lock:
    self._contended += 1
self._owner = _get_ident()  # MUTANT: a waiter names itself owner before it holds it
timeout = -1.0 if untimed else self._timeout_arg
""",
        kind="race",
        description="a contended acquisition writes the owner before it has the lock: the "
        "holder's assert_held fails while another thread waits",
        tests=("tests/staging/test_locks.py", *STAGING_TESTS),
        stress=STAGING_STRESS,
    ),
    Mutant(
        id="purge-session-room-by-room",
        file=CONTEXT,
        site="purge-session-with",
        replacement="""\
with self._lock.write_untimed():
    by_room = self._session_rooms.pop(session_id, None)
    if not by_room:
        return frozenset()
for room_id in by_room:  # MUTANT: each room's keys go in a critical section of its own
    with self._lock.write_untimed():
        state = self._rooms.get(room_id)
        if state is None:
            continue
        state.sessions.discard(session_id)
        doomed = [key for key in state.requests if key[1] == session_id]
        if doomed:
            state.requests.difference_update(doomed)
            self._requested_keys -= len(doomed)
            touched.append(room_id)
            if not state.requests:
                self._unindex(state, room_id)
    if touched:
        self._session_purges += 1
""",
        kind="race",
        description="purge_session drops the session's keys room by room, one acquisition "
        "per room: a multi-key reader (snapshot, prefetch_requested) sees it half done",
        tests=STAGING_TESTS,
        stress=STAGING_STRESS,
    ),
    Mutant(
        id="prefetch-requested-room-by-room",
        file=CONTEXT,
        site="prefetch-requested",
        replacement="""\
keys: list[PrefetchKey] = []  # MUTANT: one locked read per room, not one for all
for room in self.open_rooms:
    keys.extend((room, chunk, session) for chunk, session in self.room_requests(room))
return frozenset(keys)
""",
        kind="race",
        description="the prefetch_requested snapshot reads the rooms one acquisition at a "
        "time (purge_session itself intact): a session can be seen half removed",
        tests=STAGING_TESTS,
        stress=STAGING_STRESS,
    ),
)
