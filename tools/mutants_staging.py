"""Mutants of the staging layer (``staging/context.py``, ``staging/locks.py``).

Each snippet must match the current source exactly once; when the code changes, update the
snippet here (``make mutants`` stops with "stale mutant" until then).
"""

from __future__ import annotations

from tools.mutants_spec import Mutant

STAGING_TESTS = (
    "tests/test_staging_contract.py",
    "tests/test_staging_races.py",
    "tests/test_staging_point_reads.py",
    "tests/test_linearizability.py",
)
# The DPOR proofs only for the lifecycle mutants: mutants that add shared-memory steps to the
# explored paths (caches, a second critical section, a check outside the lock) make the
# exploration outgrow its 120 s limit, which is a timeout, not a finding.
WITH_DPOR = (*STAGING_TESTS, "tests/test_dpor_staging.py")
STAGING_STRESS = ("staging-race",)

CONTEXT = "staging/context.py"

_IS_REQUESTED = """\
        state = self._rooms.get(room_id)
        return (
            state is not None
            and (generation is None or state.generation == generation)
            and (chunk_idx, session_id) in state.requests
        )
"""

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        id="is-requested-first-read-cache",
        file=CONTEXT,
        original=_IS_REQUESTED,
        replacement="""\
        state = self._rooms.get(room_id)
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
        original=_IS_REQUESTED,
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
        original="""\
        with self._lock.write_untimed():
            return self._purge_locked(room_id, generation)
""",
        replacement="""\
        with self._lock.write_untimed():  # MUTANT: the room is closed in one critical section
            state = self._rooms.get(room_id)
            if state is None or (generation is not None and state.generation != generation):
                return RoomPurge(room_id, False, False, frozenset())
            del self._rooms[room_id]
        with self._lock.write_untimed():  # ... and its keys and counters go in a second one
            for _, session in state.requests:
                self._drop_session_ref(session, room_id)
            self._requested_keys -= len(state.requests)
            if state.prefetched:
                self._prefetched_count -= 1
            self._purges += 1
            return RoomPurge(
                room_id, True, state.prefetched, frozenset(state.requests), state.generation
            )
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
        original="""\
        with self._lock.write():
            state = self._live(room_id, generation)
            if state is None or key in state.requests:
                return False
""",
        replacement="""\
        if self.is_requested(room, chunk_idx, session_id):  # MUTANT: checked outside the lock
            return False
        with self._lock.write():
            state = self._live(room_id, generation)
            if state is None:
                return False
""",
        kind="race",
        description="request_prefetch tests the key before taking the lock: two threads both "
        "add it and both report True; counters and the session index drift",
        tests=STAGING_TESTS,
        stress=STAGING_STRESS,
    ),
    Mutant(
        id="purge-session-keeps-room-keys",
        file=CONTEXT,
        original="""\
                state.requests.difference_update(doomed)
""",
        replacement="""\
                pass  # MUTANT: the session's keys stay in the room (index and counter go)
""",
        kind="sequential",
        description="purge_session drops the session index and the counter but leaves the "
        "keys in their rooms",
        tests=(*STAGING_TESTS, "tests/test_staging_fail_session.py"),
        stress=STAGING_STRESS,
    ),
    Mutant(
        id="live-ignores-handle-generation",
        file=CONTEXT,
        original="""\
        state = self._live_quiet(room_id, generation)
        if state is None:
""",
        replacement="""\
        state = self._live_quiet(room_id, None)  # MUTANT: a stale handle is not refused
        if state is None:
""",
        kind="lifecycle",
        description="writers' _live drops the generation check: a stale handle writes into "
        "the room's next opening",
        tests=WITH_DPOR,
        stress=STAGING_STRESS,
    ),
    Mutant(
        id="mark-prefetched-closed-room-accepted",
        file=CONTEXT,
        original="""\
            if state is None or state.prefetched:
                return False
            state.prefetched = True
            self._prefetched_count += 1
            return True
""",
        replacement="""\
            if state is not None and state.prefetched:
                return False
            if state is not None:
                state.prefetched = True
                self._prefetched_count += 1
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
        original="""\
        return _Guard(self, self._rw.gen_wlock(), "write")
""",
        replacement="""\
        return _Guard(self, self._rw.gen_rlock(), "write")  # MUTANT: writers share the lock
""",
        kind="race",
        description="RWLock.write() takes the shared (read) side: writers and readers of an "
        "rw context run together",
        tests=("tests/test_locks.py", *STAGING_TESTS),
        stress=STAGING_STRESS,
    ),
    Mutant(
        id="fast-mutex-guard-skips-wait",
        file="staging/locks.py",
        original="""\
        if not self._inner.acquire(False):
            self._lock._acquire_contended(self._inner, self._mode, untimed=self._untimed)
            return
        lock = self._lock""",
        replacement="""\
        if not self._inner.acquire(False):
            return  # MUTANT: a contended acquisition goes on without the lock
        lock = self._lock""",
        kind="race",
        description="the inline (non-debug) mutex guard enters without waiting when the lock "
        "is taken: mutual exclusion is lost only under contention",
        tests=("tests/test_locks.py", *STAGING_TESTS),
        stress=STAGING_STRESS,
    ),
)
