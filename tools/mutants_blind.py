"""Mutants of an outside (blind) mutation study of the sender's concurrency contract.

Written from docs/THREADING.md (without its last section), docs/PROTOCOL.md section 3 and the
code, before reading the tests or the other mutant lists. Each description names the contract
sentence the mutant violates. Run: ``python -m tools.mutants --only ID,...``.

The study chose each mutant's test targets by file name; each also runs the property checks
of its area (:data:`AREA_CHECKS`, added when the study's survivors were answered), as a
maintainer of that module would.
"""

from __future__ import annotations

import dataclasses

from tools.mutants_spec import ISSUE_9_TESTS, ISSUE_16_TESTS, Mutant

AREA_CHECKS: dict[str, tuple[str, ...]] = {
    "sender/": (
        "tests/sender/test_properties.py",
        *ISSUE_16_TESTS,
        "tests/sender/test_dpor_post_fence.py",
        "tests/sender/test_dpor_purge.py",
        "tests/sender/test_dpor_transport.py",
    ),
    "staging/compat.py": (
        "tests/staging/test_dpor_compat.py",
        "tests/staging/test_compat_leniency.py",
    ),
    "staging/": ("tests/staging/test_locks.py", "tests/staging/test_linearizability.py"),
}
"""The checks of each area (a path prefix; the first that matches a mutant's file)."""


def _with_area_checks(mutant: Mutant) -> Mutant:
    for prefix, checks in AREA_CHECKS.items():
        if mutant.file.startswith(prefix):
            tests = tuple(dict.fromkeys((*mutant.tests, *checks)))
            return dataclasses.replace(mutant, tests=tests)
    return mutant


_STUDY: tuple[Mutant, ...] = (
    Mutant(
        id="blind-gate-fresh-lock",
        file="sender/rooms.py",
        original=("    def write_untimed(self) -> threading.Lock:\n        return self._lock\n"),
        replacement=(
            "    def write_untimed(self) -> threading.Lock:\n        return threading.Lock()\n"
        ),
        kind="race",
        description=(
            "PlainGate hands out a fresh lock per use, so a room's post gate excludes nobody: "
            "violates 'once purge_room, clear() or failure_exception() has returned, on any "
            "thread, no chunk of that opening is ever posted' (the post fence; worker and "
            "inline paths alike; debug-mode gates unaffected)"
        ),
        tests=(
            "tests/sender/test_dpor_post_fence.py",
            "tests/sender/test_sender.py",
            "tests/sender/test_dpor_purge.py",
        ),
        stress=("sender-audit",),
    ),
    Mutant(
        id="blind-poll-unposted-done",
        file="sender/pipeline.py",
        original=(
            "        if transfer is None:  # registered, still being posted\n"
            "            return False, None\n"
        ),
        replacement=(
            "        if transfer is None:  # registered, still being posted\n"
            "            return True, (chunk, None, False, False)\n"
        ),
        kind="race",
        description=(
            "a poller (inline progress() on another thread) that meets a chunk registered "
            "under the gate but not yet posted ends it as done: violates 'Every chunk ends "
            "exactly once ... whichever thread sees its end first' and the batched send's "
            "'registered under the gate before its post' (the room may succeed before its "
            "bytes land; the later post's transfer is never released)"
        ),
        tests=(
            "tests/sender/test_dpor_progress.py",
            "tests/sender/test_sender.py",
            "tests/sender/test_properties.py",
        ),
        stress=("sender-audit",),
    ),
    Mutant(
        id="blind-purge-by-id",
        file="sender/rooms.py",
        original=("            if self.rooms.get(room) is not entry:  # another purge won\n"),
        replacement=("            if room not in self.rooms:  # another purge won\n"),
        kind="race",
        description=(
            "purge re-checks by room id instead of by entry under the gate: a stale purge "
            "that loses to purge+reopen deletes the NEW opening (without its gate): violates "
            "'A stale handle never purges a newer generation' / 'Per opening, never per id' "
            "(clear() of an old handle purges a newer opening)"
        ),
        tests=(
            "tests/sender/test_dpor_purge.py",
            "tests/sender/test_sender.py",
            *ISSUE_9_TESTS,
        ),
        stress=("sender-audit",),
    ),
    Mutant(
        id="blind-enqueue-after-lock",
        file="sender/pipeline.py",
        original=(
            "                handle, chunk_idx, start, kv_indices, src_checked, is_"
            "last, enqueue=enqueue\n"
            "            )\n"
            "            return 0 if chunks is None else len(chunks)\n"
        ),
        replacement=(
            "                handle, chunk_idx, start, kv_indices, src_checked, is_"
            "last, enqueue=None\n"
            "            )\n"
            "            return 0 if not chunks else (enqueue(chunks), len(chunks))[1]\n"
        ),
        kind="race",
        description=(
            "worker mode queues a send's unit after the ROOM lock is released, so close()'s "
            "stop sentinels can queue before it and no worker ever runs it: violates 'In "
            "worker mode the unit is queued (under the ROOM lock, behind which close()'s stop "
            "sentinels queue)' and 'ManagerStats counts each submitted chunk once' (the chunk "
            "never ends)"
        ),
        tests=(
            "tests/sender/test_sender.py",
            "tests/sender/test_dpor_clear.py",
            "tests/sender/test_properties.py",
        ),
        stress=("sender-audit",),
    ),
    Mutant(
        id="blind-claim-test-then-set",
        file="sender/chunks.py",
        original=("        return self._claim.acquire(False)\n"),
        replacement=("        return not self.ended and self._claim.acquire(False) is not None\n"),
        kind="race",
        description=(
            "the claim tests 'ended' and then acquires, ignoring the acquire's result: two "
            "threads that both see it unclaimed both win; violates 'Every started chunk "
            "carries a one-shot claim ... any other thread finds it claimed and does nothing' "
            "/ 'Two threads calling inline progress() never count a chunk twice'"
        ),
        tests=(
            "tests/sender/test_dpor_progress.py",
            "tests/sender/test_properties.py",
            "tests/sender/test_sender.py",
        ),
        stress=("sender-audit",),
    ),
    Mutant(
        id="blind-drained-ignores-slots",
        file="sender/pipeline.py",
        original=(
            "                left = rooms.lingering_locked(handle)\n"
            "            rooms.await_published(unpublished)"
        ),
        replacement=(
            "                left = len(pending)\n"
            "            rooms.await_published(unpublished)"
        ),
        kind="race",
        description=(
            "wait_drained() counts only draining chunks, not the staging slots a worker still "
            "holds for a purged opening (leased before the purge, returned at the fence): "
            "violates 'wait_drained(handle): polls until draining(handle) is 0 (True)' where "
            "draining includes 'the staging slots workers still hold for it' (True while "
            "draining(handle) > 0)"
        ),
        tests=(
            "tests/sender/test_sender.py",
            "tests/sender/test_properties.py",
            *ISSUE_9_TESTS,
        ),
        stress=("sender-audit",),
    ),
    Mutant(
        id="blind-close-grace-min",
        file="sender/manager.py",
        original=(
            "        settle_until = max(deadline, time.monotonic() + _CLAIMED_END_GRACE_S)\n"
        ),
        replacement=(
            "        settle_until = min(deadline, time.monotonic() + _CLAIMED_END_GRACE_S)\n"
        ),
        kind="race",
        description=(
            "close() no longer waits past its (already spent) deadline for chunk ends another "
            "thread had claimed: violates 'A chunk another thread had already claimed is not "
            "abandoned: close() waits for its end (at least 0.5 s) so that its room's notice "
            "is queued before the notifier stops' (the notice is withheld instead)"
        ),
        tests=(
            "tests/sender/test_room_notices.py",
            "tests/sender/test_sender.py",
            *ISSUE_9_TESTS,
        ),
        stress=("sender-audit",),
    ),
    Mutant(
        id="blind-notice-hold-stale",
        file="sender/rooms.py",
        original=(
            "        with self.lock.read():\n"
            "            entry = self.rooms.get(room)\n"
            "        if entry is None or (generation is not None and entry.handle.g"
            "eneration != generation):\n"
            "            return ManagerPurge(room, False, None, (), None, 0, 0)\n"
            "        after = After()\n"
            "        with entry.gate.write_untimed(), self.lock.write_untimed():\n"
            "            if self.rooms.get(room) is not entry:  # another purge won\n"
            "                return ManagerPurge(room, False, None, (), None, 0, 0)\n"
            "            del self.rooms[room]\n"
            "            status = self.request_status.get(room)\n"
            "            exception = self.exceptions.get(room)\n"
            "            tables: list[str] = []\n"
            "            for name, table in self.tables_locked():  # a plain loop: "
            "DPOR traces it precisely\n"
            "                if table.pop(room, None) is not None:\n"
            "                    tables.append(name)\n"
            "            staged = self.staging.purge_room(entry.handle)\n"
            "            # Staging slots are not returned here: every slot of this "
            "opening is held by a\n"
            "            # thread (gathering into it, or under a posted chunk), and"
            " that thread returns it\n"
            "            # when it skips the chunk or when the chunk ends. Returnin"
            "g it now would let\n"
            "            # another room lease and overwrite a slot that a transfer "
            "still reads from.\n"
            "            with self.failure_lock.write():\n"
            "                record = self.failure_records.pop(room, None)\n"
            "                if record is not None:\n"
            '                    tables.append("failure_records")\n'
            "            for chunk_id, chunk in entry.inflight.items():\n"
            "                self.draining[chunk_id] = chunk\n"
            "            draining = len(entry.inflight)\n"
            "            if draining:\n"
            "                self.draining_by_handle[entry.handle] = draining\n"
            "            entry.inflight.clear()\n"
            '            self.counts["purges"] += 1\n'
            "            if not is_concluded(status):\n"
            '                self.counts["rooms_cleared"] += 1\n'
            "                entry.concluded = True\n"
            "                after.logs.append(\n"
            "                    (\n"
            "                        logging.INFO,\n"
            '                        "room %d generation %d cleared before it concl'
            'uded (status %s, "\n'
            '                        "%d chunks draining)",\n'
            "                        (room, entry.handle.generation, getattr(status"
            ', "name", status),\n'
            "                         draining),\n"
            "                    )\n"
            "                )\n"
            "                if self.events is not None:\n"
            "                    after.concluded.append(\n"
            '                        (room, entry.handle.generation, "cleared", "cleared",\n'
            "                         time.monotonic() - entry.opened_at)\n"
            "                    )\n"
            "            # None for a room that succeeded, then failed (docs/PROTOCOL.md).\n"
            "            if self.notifier.enabled and status is not KVPoll.Success and not entry"
            ".succeeded:\n"
            "                failed = status is _FAILED\n"
            "                notice = RoomNotice(\n"
            "                    room,\n"
            "                    entry.handle.generation,\n"
            '                    "failed" if failed else "cleared",\n'
            "                    (entry.failure_code or code_for(record, exception)"
            ') if failed else "cleared",\n'
            "                )\n"
            "                if draining:\n"
        ),
        replacement=(
            "        with self.lock.read():\n"
            "            entry = self.rooms.get(room)\n"
            "            busy = entry is not None and bool(entry.inflight)\n"
            "        if entry is None or (generation is not None and entry.handle.g"
            "eneration != generation):\n"
            "            return ManagerPurge(room, False, None, (), None, 0, 0)\n"
            "        after = After()\n"
            "        with entry.gate.write_untimed(), self.lock.write_untimed():\n"
            "            if self.rooms.get(room) is not entry:  # another purge won\n"
            "                return ManagerPurge(room, False, None, (), None, 0, 0)\n"
            "            del self.rooms[room]\n"
            "            status = self.request_status.get(room)\n"
            "            exception = self.exceptions.get(room)\n"
            "            tables: list[str] = []\n"
            "            for name, table in self.tables_locked():  # a plain loop: "
            "DPOR traces it precisely\n"
            "                if table.pop(room, None) is not None:\n"
            "                    tables.append(name)\n"
            "            staged = self.staging.purge_room(entry.handle)\n"
            "            # Staging slots are not returned here: every slot of this "
            "opening is held by a\n"
            "            # thread (gathering into it, or under a posted chunk), and"
            " that thread returns it\n"
            "            # when it skips the chunk or when the chunk ends. Returnin"
            "g it now would let\n"
            "            # another room lease and overwrite a slot that a transfer "
            "still reads from.\n"
            "            with self.failure_lock.write():\n"
            "                record = self.failure_records.pop(room, None)\n"
            "                if record is not None:\n"
            '                    tables.append("failure_records")\n'
            "            for chunk_id, chunk in entry.inflight.items():\n"
            "                self.draining[chunk_id] = chunk\n"
            "            draining = len(entry.inflight)\n"
            "            if draining:\n"
            "                self.draining_by_handle[entry.handle] = draining\n"
            "            entry.inflight.clear()\n"
            '            self.counts["purges"] += 1\n'
            "            if not is_concluded(status):\n"
            '                self.counts["rooms_cleared"] += 1\n'
            "                entry.concluded = True\n"
            "                after.logs.append(\n"
            "                    (\n"
            "                        logging.INFO,\n"
            '                        "room %d generation %d cleared before it concl'
            'uded (status %s, "\n'
            '                        "%d chunks draining)",\n'
            "                        (room, entry.handle.generation, getattr(status"
            ', "name", status),\n'
            "                         draining),\n"
            "                    )\n"
            "                )\n"
            "                if self.events is not None:\n"
            "                    after.concluded.append(\n"
            '                        (room, entry.handle.generation, "cleared", "cleared",\n'
            "                         time.monotonic() - entry.opened_at)\n"
            "                    )\n"
            "            # None for a room that succeeded, then failed (docs/PROTOCOL.md).\n"
            "            if self.notifier.enabled and status is not KVPoll.Success and not entry"
            ".succeeded:\n"
            "                failed = status is _FAILED\n"
            "                notice = RoomNotice(\n"
            "                    room,\n"
            "                    entry.handle.generation,\n"
            '                    "failed" if failed else "cleared",\n'
            "                    (entry.failure_code or code_for(record, exception)"
            ') if failed else "cleared",\n'
            "                )\n"
            "                if busy:\n"
        ),
        kind="race",
        description=(
            "purge decides hold-vs-queue from entry.inflight read under the read lock BEFORE "
            "it takes the gate (two lines): a chunk registered in between is draining but the "
            "notice is queued at once (or held forever if it ended in between): violates 'The "
            "notice is queued by the purge when nothing of that opening is draining, else by "
            "the end of its last draining chunk, so when the decode side learns it no byte of "
            "the room can land any more'"
        ),
        tests=(
            "tests/sender/test_room_notices.py",
            "tests/sender/test_dpor_purge.py",
            "tests/sender/test_sender.py",
        ),
        stress=("sender-audit",),
    ),
    Mutant(
        id="blind-notice-one-early",
        file="sender/rooms.py",
        original=("                elif drained and left == 0:\n"),
        replacement=("                elif drained and left <= 1:\n"),
        kind="sequential",
        description=(
            "the held notice is queued when the second-to-last draining chunk of the opening "
            "ends: violates 'else by the end of its last draining chunk' (decode told while a "
            "write may still land)"
        ),
        tests=(
            "tests/sender/test_room_notices.py",
            "tests/sender/test_sender.py",
        ),
        stress=("sender-audit",),
    ),
    Mutant(
        id="blind-poll-released-unlocked",
        file="sender/transport.py",
        original=(
            "        with self._lock:\n"
            "            if self._released:\n"
            '                raise TransferReleasedError(f"poll() on a released tra'
            'nsfer: {self!r}")\n'
        ),
        replacement=(
            "        if self._released:\n"
            '            raise TransferReleasedError(f"poll() on a released transfe'
            'r: {self!r}")\n'
            "        with self._lock:\n"
        ),
        kind="race",
        description=(
            "Transfer.poll() tests _released before taking the transfer's lock: a release "
            "(remove_peer, close) between the test and the lock makes the poll call the "
            "binding with a None agent (AttributeError) instead of raising "
            "TransferReleasedError: violates 'Transfer.poll(): serialised with release()' and "
            "'A transfer released by the transport ... makes its next poll raise "
            "TransferReleasedError ... counted in chunks_released_by_transport'"
        ),
        tests=(
            "tests/sender/test_transport.py",
            "tests/sender/test_dpor_transport.py",
            "tests/sender/test_data_path.py",
        ),
        stress=("sender-audit",),
    ),
    Mutant(
        id="blind-unknown-peer-dead",
        file="sender/transport.py",
        original=("        return peer is not None and peer.disconnected\n"),
        replacement=("        return peer is None or peer.disconnected\n"),
        kind="sequential",
        description=(
            "peer_disconnected() says True for a session that is not a peer (removed, never "
            "added), so its notices are skipped as dead instead of failing: violates 'False "
            "for an unknown session' and PROTOCOL 3 'a session that is dead or not a peer of "
            "the transport any more makes send_notif raise; that notice is counted in "
            "stats().notices_failed' (skipped_dead only for a reported disconnect)"
        ),
        tests=(
            "tests/sender/test_room_notices.py",
            "tests/sender/test_transport.py",
        ),
    ),
    Mutant(
        id="blind-scan-nondecreasing",
        file="sender/pages.py",
        original=("    if np.count_nonzero(pages[1:] > pages[:-1]) == n - 1:\n"),
        replacement=("    if np.count_nonzero(pages[1:] >= pages[:-1]) == n - 1:\n"),
        kind="sequential",
        description=(
            "scan_pages' fast path takes NON-decreasing lists (over 32 pages) as strictly "
            "increasing, so a repeated page is not seen: violates CheckedPages 'distinct if "
            "unique' and write_pages 'duplicate destination pages' -> TransportParamError"
        ),
        tests=(
            "tests/sender/test_data_path.py",
            "tests/sender/test_transport.py",
            "tests/sender/test_bad_input.py",
        ),
    ),
    Mutant(
        id="blind-timeout-not-marked",
        file="sender/transport.py",
        original=(
            "                err2 = TransferTimeoutError(self._peer.session_id, sel"
            "f._timeout_s)\n"
            "                self._timed_out = True\n"
        ),
        replacement=(
            "                err2 = TransferTimeoutError(self._peer.session_id, self._timeout_s)\n"
        ),
        kind="sequential",
        description=(
            "Transfer.poll() no longer marks a deadline failure as ours (the line looks "
            "redundant next to _fail_locked(timed_out=True)), so settled() is True while NIXL "
            "still has the write in progress: violates 'a chunk past its deadline while NIXL "
            "still reports it in progress is hung ... keeps its transfer handle and its slot, "
            "and stays in draining, until the transfer settles'"
        ),
        tests=(
            "tests/e2e/test_peer_faults.py",
            "tests/sender/test_properties.py",
            "tests/sender/test_transport.py",
        ),
        stress=("sender-audit",),
    ),
    Mutant(
        id="blind-guard-owner-after-release",
        file="staging/locks.py",
        original=("        self._lock._owner = None\n        self._inner.release()\n"),
        replacement=("        self._inner.release()\n        self._lock._owner = None\n"),
        kind="race",
        description=(
            "_FastMutexGuard releases the mutex before clearing the owner, so it can erase "
            "the NEXT holder's owner: violates 'then the holder writes the owner and its "
            "counter, as the full path does' (assert_held() on a non-debug mutex fails for "
            "its real holder)"
        ),
        tests=(
            "tests/staging/test_locks.py",
            "tests/staging/test_context.py",
            "tests/staging/test_late_writers.py",
            "tests/staging/test_races.py",
        ),
        stress=("staging-race",),
    ),
    Mutant(
        id="blind-compat-remove-racy",
        file="staging/compat.py",
        original=(
            "        item = _maybe(self._check, value)\n"
            "        if item is None or not self._discard(item):\n"
            "            raise KeyError(value)\n"
        ),
        replacement=(
            "        item = _maybe(self._check, value)\n"
            "        if item is None or item not in self:\n"
            "            raise KeyError(value)\n"
            "        self._discard(item)\n"
        ),
        kind="race",
        description=(
            "view.remove() tests membership lock-free, then discards: two removers of one key "
            "both succeed (no KeyError): violates 'remove: Thread-safe; write lock; atomic "
            "(one check-and-remove). Raises KeyError: value was not there'"
        ),
        tests=(
            "tests/staging/test_compat.py",
            "tests/staging/test_dpor_compat.py",
            "tests/staging/test_compat_leniency.py",
        ),
        stress=("staging-race",),
    ),
    Mutant(
        id="blind-compat-tombstone-split",
        file="staging/compat.py",
        original=(
            "        with self._lock.write_untimed():\n"
            "            result = self._purge_locked(room, None)\n"
            "            if self._tombstone_capacity:\n"
        ),
        replacement=(
            "        with self._lock.write_untimed():\n"
            "            result = self._purge_locked(room, None)\n"
            "        with self._lock.write_untimed():\n"
            "            if self._tombstone_capacity:\n"
        ),
        kind="race",
        description=(
            "CompatStagingContext.purge_room purges and tombstones in two critical sections: "
            "a late add in between re-creates the room, which is then open AND tombstoned "
            "after the purge returned: violates 'purge_and_tombstone: Purge the room (both "
            "views) and remember its id, in ONE critical section' and 'a room id is never "
            "open and tombstoned at once' (a late writer resurrects a purged room)"
        ),
        tests=(
            "tests/staging/test_compat.py",
            "tests/staging/test_dpor_compat.py",
            "tests/staging/test_races.py",
        ),
        stress=("staging-race",),
    ),
    Mutant(
        id="blind-mark-prefetched-stale",
        file="staging/context.py",
        original=(
            "        lock = self._lock\n"
            "        lock.acquire_write()\n"
            "        try:\n"
            "            state = self._rooms.get(room_id)\n"
            "            if state is None or (generation is not None and state.generation != "
            "generation):\n"
            "                self._refuse(room_id, generation)\n"
            "                return False\n"
            "            if state.prefetched:\n"
        ),
        replacement=(
            "        lock = self._lock\n"
            "        early = self._live_quiet(room_id, generation)\n"
            "        lock.acquire_write()\n"
            "        try:\n"
            "            state = early or self._rooms.get(room_id)\n"
            "            if state is None or (generation is not None and state.generation != "
            "generation):\n"
            "                self._refuse(room_id, generation)\n"
            "                return False\n"
            "            if state.prefetched:\n"
        ),
        kind="race",
        description=(
            "mark_prefetched() decides on the room state it looked up lock-free before taking "
            "the lock: a purge in between is missed, the purged room is marked and True "
            "returned: violates 'no write to that generation is accepted after it' / 'A write "
            "... is refused -- returns False, records nothing, increments "
            "stats().refused_late_writes -- when the room is not open'"
        ),
        tests=(
            "tests/staging/test_races.py",
            "tests/staging/test_linearizability.py",
            "tests/staging/test_dpor_room_lifecycle.py",
            "tests/staging/test_context.py",
            "tests/staging/test_late_writers.py",
        ),
        stress=("staging-race",),
    ),
    Mutant(
        id="blind-sweep-claim-ignored",
        file="sender/pipeline.py",
        original=(
            "        if not self._sweep_claim.acquire(False):\n            return\n        try:\n"
        ),
        replacement=("        self._sweep_claim.acquire(False)\n        try:\n"),
        kind="race",
        description=(
            "maybe_sweep() ignores a failed try-acquire of the sweep claim: two threads sweep "
            "at once and the second release of the claim raises RuntimeError out of "
            "maybe_sweep (a worker's idle loop, progress(), wait_drained()): violates 'one "
            "thread sweeps at a time', 'maybe_sweep: Never raises; never blocks' and 'Workers "
            "never die'"
        ),
        tests=(
            "tests/sender/test_properties.py",
            "tests/e2e/test_peer_faults.py",
            "tests/sender/test_sender.py",
        ),
        stress=("sender-audit",),
    ),
)

MUTANTS: tuple[Mutant, ...] = tuple(_with_area_checks(m) for m in _STUDY)
