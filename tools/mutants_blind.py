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
        site="write-untimed",
        replacement="""\
return threading.Lock()
""",
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
        site="poll-once-return",
        replacement="""\
return True, (chunk, None, False, False)
""",
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
        site="purge-if-2",
        replacement=("""\
if room not in self.rooms:  # another purge won
    return ManagerPurge(room, False, None, (), None)
"""),
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
        site="submit-set-chunks",
        statements=2,
        replacement="""\
chunks = rooms.begin_chunk(
    handle, chunk_idx, start, kv_indices, src_checked, is_last, enqueue=None
)
if chunks and self._enqueue is not None:
    self._enqueue(chunks)  # MUTANT: queued after the lock
if chunks is not None and not self.workers:
    for chunk in chunks:
        self._run_unit([chunk])
""",
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
        site="claim",
        replacement=("""\
return not self.ended and self._claim.acquire(False) is not None
"""),
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
        site="wait-drained",
        replacement="""\
left = len(pending)
""",
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
        site="close-set-settle-until",
        replacement="""\
settle_until = min(deadline, time.monotonic() + _CLAIMED_END_GRACE_S)
""",
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
        site="purge-peek",
        replacement="""\
with self.lock.read():
    entry = self.rooms.get(room)
    busy = entry is not None and bool(entry.inflight)  # MUTANT: in flight before the gate
""",
        also=(
            (
                "purge-hold",
                """\
if busy:
    self.notifier.hold(entry.handle, notice, entry.sessions)
else:
    self.notifier.enqueue(notice, entry.sessions)
""",
            ),
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
        site="account-ends-if-1",
        replacement=("""\
if abandoned:
    # Its writes were given up, not drained: they may still land, so the
    # decode side must not be told it may reuse the room's pages.
    self.notifier.withhold(handle)
elif drained and left <= 1:
    self.notifier.drained(handle)  # its opening's last posted chunk ended
"""),
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
        site="poll-with",
        replacement="""\
if self._released:
    raise TransferReleasedError(f"poll() on a released transfer: {self!r}")
with self._lock:
    if self._done:
        return "DONE"
    if self._failure is not None:
        raise self._failure
    try:
        status = self._ops.getXferStatus(self._handle)
    except Exception as exc:
        converted = self._fail_locked(exc, timed_out=False)
        if converted is exc:
            raise
        raise converted from exc
    if status == _NIXL_DONE:
        self._done = True
        if self._peer.disconnected:  # it completed: the peer is reachable again
            self._peer.disconnected = False
        self._transport._count("transfers_done")
        return "DONE"
    if status != _NIXL_PROC:
        err = TransferFailedError(f"NIXL transfer status {status!r} for {self!r}")
        raise self._fail_locked(err, timed_out=False)
    if time.monotonic() - self._start >= self._timeout_s:
        self._timed_out = True
        late = TransferTimeoutError(self._peer.session_id, self._timeout_s)
        raise self._fail_locked(late, timed_out=True)
    return "PROC"
""",
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
        site="peer-disconnected",
        replacement=("""\
return peer is None or peer.disconnected
"""),
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
        site="scan-pages-if",
        replacement=("""\
if np.count_nonzero(pages[1:] >= pages[:-1]) == n - 1:
    return pages.item(0), pages.item(-1), False
"""),
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
        site="poll-set-timed-out",
        replacement="",  # the statement deleted
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
        id="blind-compat-remove-racy",
        file="staging/compat.py",
        site="remove",
        replacement="""\
if item is None or item not in self:
    raise KeyError(value)
self._discard(item)
""",
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
        id="blind-mark-prefetched-stale",
        file="staging/context.py",
        site="mark-prefetched-call-acquire-write",
        statements=2,
        replacement="""\
early = self._live_quiet(room_id, generation)
lock.acquire_write()
try:
    state = early or self._rooms.get(room_id)
    if state is None or (generation is not None and state.generation != generation):
        self._refuse(room_id, generation)
        return False
    if state.prefetched:
        return False
    state.prefetched = True
    self._prefetched_count += 1
    return True
finally:
    lock.release_write()
""",
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
        site="maybe-sweep",
        replacement=("""\
self._sweep_claim.acquire(False)
"""),
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
