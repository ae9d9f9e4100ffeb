"""Mutants of the contract sentences that an outside set of planted bugs got past (issue 23,
section 3): the notifier, the staging pool's leases, the failure records, inline progress
and the listeners' fan-out. The compat views' sentences are in ``tools/mutants_compat.py``,
the decode peer's below. Each is planted somewhere else than the line its check was first
expected to watch; the checks are in the files of the behaviours they check (``SENTENCES``) and
``tests/harness/test_decode_peer.py`` (docs/THREADING.md, the guarantee table).

Each mutant names a site tag (``# mutant-site: NAME``) in its file; see
:mod:`tools.mutant_sites`. A missing or duplicated tag makes it stale.
"""

from __future__ import annotations

from tools.mutants_spec import Mutant

SENTENCES = (
    "tests/sender/test_room_notices.py::test_a_queued_notice_and_its_counters_change_together",
    "tests/sender/test_room_notices.py::test_pending_notices_include_those_skipped_to_dead_peers",
    "tests/sender/test_room_notices.py::test_close_returns_while_a_notice_send_hangs",
    "tests/staging/test_slot_pool.py::test_a_stale_release_never_frees_a_slot_someone_else_holds",
    "tests/sender/test_failure_reporting.py::test_a_failure_record_is_popped_for_its_opening",
    "tests/sender/test_draining.py::test_progress_ends_a_purged_rooms_draining_chunk",
    "tests/sender/test_failure_reporting.py::test_fanout_survives_a_listener_that_cannot_be_printed",
)
PEER_SENTENCES = ("tests/harness/test_decode_peer.py",)
REMOVED = "tests/sender/test_removed_peers.py"
ISOLATION = "tests/sender/test_peer_isolation.py"
NOTIFIER = "sender/notifier.py"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        id="slot-wait-ignores-hung-holders",
        file="sender/pipeline.py",
        site="run-pool-unit",
        statements=2,
        replacement="""\
if parked_at is None:
    parked_at = now
    self._give_up_if_slots_all_hung(chunk.session_id)  # MUTANT: first try only
""",
        kind="race",
        description="only the check before a slot wait gives up when hung chunks hold every "
        "slot; a chunk that began waiting before the last holder hung waits out "
        "slot_timeout_s (violates 'a chunk waiting for a slot gives up as soon as every slot "
        "is held by a hung chunk')",
        tests=("tests/sender/test_properties.py::"
               "test_a_slot_wait_gives_up_at_once_when_only_hung_chunks_hold_the_slots",),
    ),
    Mutant(
        id="hung-chunks-snapshot-misses-slots",
        file="sender/rooms.py",
        site="hung-chunks",
        replacement="""\
return [c for c in self.hung.values() if c.transfer is None]  # MUTANT
""",
        kind="sequential",
        description="the hung-chunk snapshot drops every posted chunk: the slot wait counts "
        "no hung holder and waits out slot_timeout_s (and the sweep never ends a settled hung "
        "chunk) (violates 'a chunk waiting for a slot gives up as soon as every slot is held "
        "by a hung chunk')",
        tests=("tests/sender/test_properties.py::"
               "test_a_slot_wait_gives_up_at_once_when_only_hung_chunks_hold_the_slots",),
    ),
    Mutant(
        id="notifier-put-after-the-lock",
        file=NOTIFIER,
        site="enqueue",
        replacement="""\
with self._lock:
    if self._stopped:  # close() stopped the thread: nobody would send it
        self._withheld += 1
        return
    self._queued += len(sessions)
self._queue.put((notice, sessions))  # MUTANT: queued after the lock is released
""",
        kind="race",
        description="enqueue counts under the lock but queues after it: a stop() in between "
        "puts its sentinel first, and the notice is counted queued yet never sent nor "
        "withheld (violates 'a queued notice and its counters change together under the "
        "notifier's lock')",
        tests=SENTENCES,
    ),
    Mutant(
        id="notifier-counted-after-the-put",
        file=NOTIFIER,
        site="enqueue",
        replacement="""\
with self._lock:
    if self._stopped:  # close() stopped the thread: nobody would send it
        self._withheld += 1
        return
    self._queue.put((notice, sessions))
with self._lock:  # MUTANT: counted in a second critical section
    self._queued += len(sessions)
""",
        kind="race",
        description="enqueue queues, then counts in a second critical section: the notifier "
        "thread sends (and counts sent) a message not yet counted queued; pending goes "
        "negative (violates 'a queued notice and its counters change together')",
        tests=SENTENCES,
    ),
    Mutant(
        id="notices-pending-ignores-skipped-dead",
        file="sender/manager.py",
        site="stats-return",
        replacement="""\
return ManagerStats(
    open_rooms=open_rooms,
    transfers_inflight=inflight,
    transfers_draining=draining,
    rooms_failed_by_code=by_code,
    notices_sent=notices.sent,
    notices_failed=notices.failed,
    notices_withheld=notices.withheld,
    notices_queued=notices.queued,
    notices_pending=notices.queued - notices.sent - notices.failed,  # MUTANT
    notices_skipped_dead=notices.skipped_dead,
    **counts,
)
""",
        kind="sequential",
        description="stats().notices_pending leaves out the notices skipped to dead peers: a "
        "room told to a dead session stays pending forever (violates 'the pending-notice "
        "count includes notices skipped to dead peers')",
        tests=SENTENCES,
    ),
    Mutant(
        id="close-joins-the-notifier-unbounded",
        file="sender/manager.py",
        site="close-call-stop",
        replacement="""\
self.notifier.stop(float("inf"))  # MUTANT: the notices of a close must all go out
""",
        kind="lifecycle",
        description="close() waits for the notifier as long as it takes: a notice send "
        "blocked in NIXL on a partitioned peer blocks close() (violates 'stop()'s join is "
        "bounded')",
        tests=SENTENCES,
    ),
    Mutant(
        id="pool-release-by-slot-index",
        file="staging/buffers.py",
        site="release",
        replacement="""\
live = self._leases.get(slot.index)  # MUTANT: whatever lease the index has now
freed = self._release_unlocked(
    slot.index, slot.lease if live is None else live.lease, retire=retire
)
""",
        kind="race",
        description="release() frees the slot's index whoever leases it now: a stale or "
        "repeated release frees a slot another owner holds (violates 'a slot's release names "
        "its lease')",
        tests=SENTENCES,
    ),
    Mutant(
        id="failure-record-pop-by-room-id",
        file="sender/manager.py",
        site="pop-failure-record",
        replacement="""\
with self._room_lock.write():
    if self.rooms.live_locked(handle) is None:
        return None
# MUTANT: the ownership check and the pop in two critical sections (by room id)
with self.failure_lock.write():
    return self.rooms.failure_records.pop(handle.room, None)
""",
        kind="race",
        description="pop_failure_record checks the opening under the room lock, then pops by "
        "room id after releasing it: a stale handle takes the next opening's record "
        "(violates 'a record is popped for its opening, never by room id alone')",
        tests=SENTENCES,
    ),
    Mutant(
        id="progress-polls-only-its-own-draining",
        file="sender/rooms.py",
        site="pending-of",
        replacement="""\
# MUTANT: "each scheduler polls its own room's chunks"
pending.extend(c for c in self.draining.values() if c.handle == handle)
""",
        kind="sequential",
        description="inline progress(handle) polls only the draining chunks of its own "
        "handle: a purged room's in-flight chunk never ends (nobody polls a cleared room) "
        "(violates 'progress() counts draining chunks')",
        tests=SENTENCES,
    ),
    Mutant(
        id="fanout-error-names-the-listener",
        file="sender/events.py",
        site="failed",
        replacement="""\
self._last_error = f"{listener}: {text}"  # MUTANT: name the listener
""",
        kind="sequential",
        description="FanOut's error report formats the listener with str(): a listener whose "
        "__str__ raises escapes onto the manager's thread (violates 'FanOut survives a "
        "listener whose __repr__/__str__ raises while an error is being reported')",
        tests=SENTENCES,
    ),
    Mutant(
        id="peer-notice-dedup-by-room",
        file="stress/harness/peer.py",
        site="learn-locked",
        replacement="""\
if any(room == notice.room for room, _ in self._failed):  # MUTANT: by room id
    self._counts["duplicates"] += 1
    return
""",
        kind="sequential",
        description="the decode peer drops a notice whose room id it already knows: the "
        "second opening of a room is never learnt, its pages never freed (violates 'a notice "
        "is de-duplicated by (room, generation), never by room id alone')",
        tests=PEER_SENTENCES,
    ),
    Mutant(
        id="peer-assign-reads-failed-before-the-lock",
        file="stress/harness/peer.py",
        site="assign-pages",
        replacement="""\
told = self.room_failed(room, gen) is not None  # MUTANT: asked before the lock
with self._cond:
    if told:
        self._free.update(idx)
        self._counts["pages_freed"] += len(idx)
        return False
    self._assigned.pop(key, None)
    self._assigned[key] = idx
    self._free.difference_update(idx)
    while len(self._assigned) > self._max_failed:
        del self._assigned[next(iter(self._assigned))]
        self._counts["assignments_dropped"] += 1
    return True
""",
        kind="race",
        description="assign_pages asks whether the opening failed before taking the peer's "
        "lock: a notice learnt in between frees nothing, and the pages stay assigned to a "
        "room that will never complete (violates 'page assignment checks a room's failed "
        "state under the peer's lock')",
        tests=PEER_SENTENCES,
    ),
    Mutant(
        id="remove-peer-releases-unsettled-writes",
        file="sender/transport.py",
        site="keep-if-unsettled",
        replacement="""\
if True:  # MUTANT: released all the same, also while NIXL still has it
    return False
""",
        kind="sequential",
        description="remove_peer releases a write NIXL still has in progress: its chunk ends "
        "at once and its room's pages are reused while its bytes may still land (violates 'a "
        "write in flight when its peer is removed keeps its opening draining until NIXL "
        "settles it')",
        tests=(REMOVED,),
    ),
    Mutant(
        id="kept-write-settles-without-asking-nixl",
        file="sender/transport.py",
        site="settled",
        replacement="""\
if not self._timed_out:  # MUTANT: a kept write counts as settled at once
    return True
""",
        kind="sequential",
        description="settled() answers True for a write remove_peer kept without asking "
        "NIXL: the manager ends the chunk at its next sweep and the room drains while the "
        "write is still in progress (violates 'a write in flight when its peer is removed "
        "keeps its opening draining until NIXL settles it')",
        tests=(REMOVED,),
    ),
    Mutant(
        id="kept-write-ends-its-chunk-at-once",
        file="sender/pipeline.py",
        site="poll-once-if-2",
        replacement="""\
if isinstance(exc, TransferTimeoutError):  # MUTANT: a kept write's failure ends it
    settled = getattr(transfer, "settled", None)
    if settled is not None and not settled():
        self._hang(chunk, exc)  # NIXL still has it: it may yet write
        self._retire_if_peer_removed(chunk)
        return True, None
""",
        kind="sequential",
        description="the manager ends a chunk whose write remove_peer kept as soon as a poll "
        "raises, releasing it unsettled: its room drains at once (violates 'a write in flight "
        "when its peer is removed keeps its opening draining until NIXL settles it')",
        tests=(REMOVED,),
    ),
    # Peer isolation (THREADING.md, "Peer isolation"; tests/sender/test_peer_isolation.py).
    Mutant(
        id="worker-waits-on-its-chunks",
        file="sender/pipeline.py",
        site="worker-main-if",
        replacement="""\
while pending:  # MUTANT: a worker polls its own chunks until they end
    pending = self.poll_all(pending)
""",
        kind="sequential",
        description="a worker polls the chunks it posted until they end before it takes the "
        "next unit: num_workers chunks of a hung peer stop every healthy room (violates 'no "
        "transfer worker waits on a hung peer's chunks')",
        tests=(f"{ISOLATION}::test_workers_do_not_wait_on_a_hung_peers_chunks",),
        stress=("peer-isolation",),
    ),
    Mutant(
        id="session-slots-uncapped",
        file="sender/pipeline.py",
        site="lease-or-park",
        replacement="""\
chunk.slot = pool.try_acquire(
    chunk.handle, group=chunk.session_id, group_cap=None  # MUTANT: no cap
)
""",
        kind="sequential",
        description="a worker leases slots without its session's cap: a hung peer's chunks "
        "take every slot (violates 'a hung peer holds at most its session's cap of slots')",
        tests=(f"{ISOLATION}::test_a_hung_peer_holds_at_most_its_share_of_the_staging_slots",),
    ),
    Mutant(
        id="removed-peer-keeps-its-slots",
        file="sender/pipeline.py",
        site="retire-if-peer-removed",
        replacement="""\
pass  # MUTANT: a removed peer's kept write keeps its slot counted
""",
        kind="sequential",
        description="a removed peer's kept write keeps its slot leased and counted: "
        "remove_peer gives nothing back (violates 'remove_peer gives that share back')",
        tests=(f"{ISOLATION}::test_remove_peer_gives_back_the_hung_peers_slots",),
    ),
    Mutant(
        id="close-releases-unsettled-writes",
        file="sender/pipeline.py",
        site="abandon-draining",
        replacement="""\
unknowable = left  # MUTANT: close() releases writes NIXL may still move
""",
        kind="sequential",
        description="close() releases the writes NIXL still has in progress past its timeout: "
        "draining says 0 while their bytes may land (violates the drain rule on every path)",
        tests=(f"{ISOLATION}::test_the_drain_rule_holds_when_the_region_goes_or_the_manager_closes",),
    ),
    Mutant(
        id="deregister-region-releases-unsettled-writes",
        file="sender/transport.py",
        site="deregister-region",
        replacement="""\
if True:  # MUTANT: deregister_region releases writes NIXL may still move
    t.release()
""",
        kind="sequential",
        description="deregister_region releases the writes from the region that NIXL still has "
        "in progress: their chunks end and draining says 0 while their bytes may land "
        "(violates the drain rule on every path)",
        tests=(f"{ISOLATION}::test_the_drain_rule_holds_when_the_region_goes_or_the_manager_closes",),
    ),
)
