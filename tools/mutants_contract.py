"""Mutants of the contract sentences that an outside set of planted bugs written from
docs/THREADING.md got past (issue 33, item 0): the inline slot wait's check before it waits,
a kept write's room-only failure, a purge's counters, held notices per opening, a purge's own
status, and the compat views' logging and ``&=``. Each is planted somewhere else than the line
the sentence's check was first expected to watch (an error class, the stats reader, the
notifier's table, the compat core's batched write); the checks are in
the files of the behaviours they check (``_SENDER_CHECKS``, ``COMPAT``)
(docs/THREADING.md, the guarantee table).

Each mutant names a site tag (``# mutant-site: NAME``) in its file; see
:mod:`tools.mutant_sites`. A missing or duplicated tag makes it stale (``make mutants`` refuses
to run it; ``tests/harness/test_mutants_current.py`` says so at test time). The sender's chunk
pipeline and room table are being redesigned: the checks use only public behaviour and stay
valid; a mutant of ``sender/pipeline.py``, ``sender/rooms.py`` or ``sender/manager.py`` whose
site goes away is to be re-planted in the new code, with the same description.
"""

from __future__ import annotations

from tools.mutants_spec import Mutant

_SENDER_CHECKS = {
    "test_a_inline_slot_wait_checks_for_hung_holders_before_it_waits": (
        "tests/sender/test_draining.py::"
        "test_inline_slot_wait_checks_for_hung_holders_before_it_waits"
    ),
    "test_b_a_write_kept_at_remove_peer_fails_its_room_not_its_session": (
        "tests/sender/test_draining.py::"
        "test_a_write_kept_at_remove_peer_fails_its_room_not_its_session"
    ),
    "test_c_no_scrape_between_a_purge_and_its_count": (
        "tests/sender/test_clear.py::"
        "test_no_scrape_between_a_purge_and_its_count"
    ),
    "test_c_two_concurrent_purges_lose_no_count": (
        "tests/sender/test_clear.py::"
        "test_two_concurrent_purges_lose_no_count"
    ),
    "test_d_a_notice_is_held_and_released_per_opening": (
        "tests/sender/test_room_notices.py::"
        "test_a_notice_is_held_and_released_per_opening"
    ),
    "test_e_a_purge_reports_counts_and_tells_the_status_of_its_own_section": (
        "tests/sender/test_clear.py::"
        "test_a_purge_reports_counts_and_tells_the_status_of_its_own_section"
    ),
}
"""Each sender sentence's check, by its first name, where it lives now (tests by contract)."""
TOMBSTONE_LOGGED = (
    "tests/staging/test_late_writers.py::"
    "test_a_tombstone_refusal_is_logged_after_the_lock_is_released"
)
COMPAT = (
    TOMBSTONE_LOGGED,
    "tests/staging/test_compat_views.py::test_intersection_is_decided_on_the_state_inside_the_lock",
)


def _sender(test: str) -> tuple[str, ...]:
    return (_SENDER_CHECKS[test],)


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        id="contract-slot-check-only-once-waiting",
        file="sender/pipeline.py",
        site="on-wake-1",
        replacement="""\
waits: list[None] = []

def on_wake() -> None:  # MUTANT: the hung-holder check only once a wait has begun
    self._end_slot_holders()
    if waits:
        self._give_up_if_slots_all_hung(session)
    waits.append(None)
""",
        kind="sequential",
        description="the slot wait's hung-holder check is skipped on its first call, which "
        "inline is the check before the wait: with slot_timeout_s=0 the room fails with a "
        "plain PoolExhaustedError (violates 'inline, a chunk waiting for a slot checks before "
        "it waits whether every slot is leased to a hung chunk')",
        tests=_sender("test_a_inline_slot_wait_checks_for_hung_holders_before_it_waits"),
    ),
    Mutant(
        id="contract-removed-peer-is-a-hung-peer",
        file="sender/errors.py",
        site="module",
        replacement="""\
class PeerNotFoundError(TransportError):
    \"\"\"No peer with this session id is known to the transport.

    Chosen as a :class:`TransportError` (and a member of :data:`TRANSPORT_ERRORS`) rather than
    a ``KeyError``: a session is unknown either because it was never added (a bug, which tests
    catch) or because another thread removed it after a failure — at run time the second case
    dominates, and for the caller it means the same as NIXL's ``nixlNotFoundError`` for a
    removed remote agent: the peer is gone.

    Attributes:
        session_id: The unknown session id.
    \"\"\"

    def __init__(self, session_id: str) -> None:
        TransportError.__init__(self, f"unknown session {session_id!r} (never added, or removed)")
        self.session_id = session_id


PeerNotFoundError.__bases__ = (TransferTimeoutError,)  # MUTANT: a removed peer is a hung one
""",
        kind="sequential",
        description="PeerNotFoundError becomes a TransferTimeoutError: a write kept at "
        "remove_peer is session-fatal and fails every room of the session id, which may "
        "already name a new peer (violates 'a kept write fails its room at once but not its "
        "session')",
        tests=_sender("test_b_a_write_kept_at_remove_peer_fails_its_room_not_its_session"),
    ),
    Mutant(
        id="contract-stats-counters-read-apart",
        file="sender/manager.py",
        site="stats-with",
        replacement="""\
counts = dict(rooms.counts)  # MUTANT: the counters read apart from the gauges
with self._room_lock.read():
    by_code = MappingProxyType(dict(rooms.failed_by_code))
    open_rooms, inflight, draining = rooms.gauges()
    pending = rooms.pending_locked()
""",
        kind="race",
        description="stats() copies the counters before its read section: a purge in "
        "between is seen in open_rooms but not in purges/rooms_cleared (violates 'a stats() "
        "or metrics scrape between the purge and its count must be impossible')",
        tests=_sender("test_c_no_scrape_between_a_purge_and_its_count"),
    ),
    Mutant(
        id="contract-purge-counted-after-the-section",
        file="sender/rooms.py",
        site="purge-count",
        replacement="",
        also=(
            (
                "purge-publish",
                """\
purges = self.counts["purges"]  # MUTANT: counted after the section, read then write
self.counts["purges"] = purges + 1
self.publish(after)
""",
            ),
        ),
        kind="race",
        description="a purge's count is made after its critical section (read, then "
        "write): a scrape in between sees the room gone but not counted, and two concurrent "
        "purges lose a count (violates 'a purge's counters change in the same critical "
        "section as the room's status')",
        tests=(
            *_sender("test_c_no_scrape_between_a_purge_and_its_count"),
            *_sender("test_c_two_concurrent_purges_lose_no_count"),
        ),
    ),
    Mutant(
        id="contract-notice-held-per-room-id",
        file="sender/notifier.py",
        site="init",
        replacement="""\
self._held: dict[RoomHandle, _Item] = type(  # MUTANT: held per room id
    "HeldByRoomId",
    (dict,),
    {
        "__setitem__": lambda d, k, v: dict.__setitem__(d, k.room, v),
        "__contains__": lambda d, k: dict.__contains__(d, k.room),
        "pop": lambda d, k, *default: dict.pop(d, k.room, *default),
    },
)()
""",
        kind="lifecycle",
        description="the notifier holds a room notice per room id, not per opening: the "
        "second opening's notice replaces the first's and goes out when the first drains "
        "(violates 'a room notice is held and released per opening, never per room id')",
        tests=_sender("test_d_a_notice_is_held_and_released_per_opening"),
    ),
    Mutant(
        id="contract-purge-status-before-the-gate",
        file="sender/rooms.py",
        site="purge-peek",
        replacement="""\
with self.lock.read():
    entry = self.rooms.get(room)
    seen = self.request_status.get(room)  # MUTANT: the status read before the gate
""",
        also=(("purge-status", "status = seen\n"),),
        kind="race",
        description="a purge reports, counts and tells the status it read before taking the "
        "room's gate: a failure or success in between is cleared over (counted twice, "
        "'cleared' told) (violates 'the status a purge reports, counts and sends is the one "
        "read in its own critical section')",
        tests=_sender("test_e_a_purge_reports_counts_and_tells_the_status_of_its_own_section"),
    ),
    Mutant(
        id="contract-batched-refusal-logged-under-the-lock",
        file="staging/compat.py",
        site="write-many",
        statements=2,
        replacement="""\
with self._lock.write():
    if self._strict:
        self._check_batch_strict([x if rooms_view else x[0] for x in (*adds, *toggles)])
    for item in discards:
        changed += discard(item)
    if keep is not None:
        for item in list(self._items_locked(rooms_view)):
            if item not in keep:
                changed += discard(item)
    for item in adds:
        changed += add(item, to_log)
    for item in toggles:
        changed += discard(item) or add(item, to_log)
    _log_refusals(to_log, self._tombstone_capacity)  # MUTANT: logged under the lock
""",
        kind="sequential",
        description="a batched write (update, |=, ^=) logs its tombstone refusals while it "
        "holds the context's lock: a handler that reads the context deadlocks (violates "
        "'refusals are logged after the lock is released'; 'no logging under a lock')",
        # Three of the check's cases: each one the plant breaks is a deadlock, waited for.
        tests=tuple(
            f"{TOMBSTONE_LOGGED}[{case}]"
            for case in (
                "keys.update-mutex",
                "keys.^=-rw",
                "rooms.symmetric_difference_update-mutex",
            )
        ),
    ),
    Mutant(
        id="contract-intersection-discards-from-a-snapshot",
        file="staging/compat.py",
        site="write-many",
        replacement="""\
before = [] if keep is None else list(self._items_locked(rooms_view))  # MUTANT
with self._lock.write():
    if self._strict:
        self._check_batch_strict([x if rooms_view else x[0] for x in (*adds, *toggles)])
    for item in discards:
        changed += discard(item)
    if keep is not None:
        for item in before:  # what to discard was decided before the lock
            if item not in keep:
                changed += discard(item)
    for item in adds:
        changed += add(item, to_log)
    for item in toggles:
        changed += discard(item) or add(item, to_log)
""",
        kind="race",
        description="the compat core decides what &= / intersection_update discards from the "
        "view as it was before the lock: an element discarded and re-added meanwhile is "
        "dropped while one added meanwhile outside `other` is kept (violates "
        "'intersection_update / &= decide on the view's state inside the lock')",
        tests=COMPAT,
    ),
    Mutant(
        id="contract-intersection-discard-list-from-a-snapshot",
        file="staging/compat.py",
        site="intersection-update-if",
        replacement="""\
if keep is not None:  # MUTANT: what to discard computed from a snapshot before the lock
    gone = [x for x in self.snapshot() if x not in keep]
    self._core.write_many(self._ROOMS, discards=gone)
""",
        kind="race",
        description="the outside study's version: intersection_update computes its discard "
        "list from a snapshot taken before the lock; it passes the in-place operator cases "
        "of tests/staging/test_compat_views.py, not an element outside `other` added while "
        "another is discarded and re-added (violates 'intersection_update / &= decide on the "
        "view's state inside the lock')",
        tests=COMPAT,
    ),
    Mutant(
        id="publication-sealed-after-the-lock",
        file="sender/rooms.py",
        site="deciding-with",
        replacement="""\
with self.lock.write_untimed() if untimed else self.lock.write():
    yield after
self.seal_locked(after)  # MUTANT: sealed after ROOM is released
""",
        kind="race",
        description="a deciding section seals its After only after it released ROOM: a reader "
        "in between sees the room's new status but nothing to publish or await, and returns "
        "before the listener is told and the log written (violates 'what a locked section "
        "decides runs ... by the deciding thread or the first reader to see it'); "
        "test_publication's reader right after a deciding section catches it",
        tests=("tests/sender/test_publication.py",),
    ),
    Mutant(
        id="publication-claim-in-two-sections",
        file="sender/rooms.py",
        site="emit-claim-with",
        replacement="""\
with self._publish_lock:  # MUTANT: 'is it taken yet?' in one section ...
    if after not in self._unpublished:
        return  # emitted meanwhile
    done = self._unpublished[after]
if done is None:
    claim = threading.Lock()
    claim.acquire()  # a fresh lock: never blocks
    with self._publish_lock:  # ... the claim in another: two threads may both emit it
        self._unpublished[after] = claim
""",
        kind="race",
        description="_emit checks that an After is not taken yet and claims it in two "
        "_publish_lock sections: the deciding thread and a reader both emit one After, the "
        "listener hears a chunk end twice (violates 'every chunk end reaches it once ... its "
        "counts equal stats()'); the DPOR end-vs-stats check of test_dpor_progress catches it",
        tests=(
            "tests/sender/test_dpor_progress.py::"
            "test_every_chunk_end_reaches_the_listener_once_beside_a_reader",
        ),
    ),
    Mutant(
        id="publication-reader-does-not-wait",
        file="sender/rooms.py",
        site="emit-wait-if",
        replacement="""\
if wait and not done.locked():  # MUTANT: a reader waits only for a publication made
    with done:
        pass
""",
        kind="race",
        description="a reader that finds an After being emitted by another thread returns "
        "without waiting for it: it answers before the listener call returned (violates "
        "'handle_status, status, stats, wait_drained run or await it before returning'); "
        "test_publication's reader awaiting a publication another thread is making catches it",
        tests=("tests/sender/test_publication.py",),
    ),
    Mutant(
        id="listener-called-under-the-gate",
        file="sender/pipeline.py",
        site="start-with",
        statements=3,
        replacement="""\
with entry.gate.write_untimed():
    registered = rooms.register(handle, entry, unit, skipped)
    ends = self._post_all(unit) if registered else []
    if registered:
        self._posted(unit, ends)  # MUTANT: ends at post (and their listener calls) under the gate
if not registered:
    self._return_slots(unit)
    rooms.publish(skipped)
    return []
""",
        # Sequential, like contract-batched-refusal-logged-under-the-lock: every run calls the
        # listener under the gate, and its check needs no interleaving (nor threads, inline).
        kind="sequential",
        description="a unit's chunks ended at their post are ended (and the listener told) "
        "while the room's post gate is still held (violates 'a listener is called holding no "
        "lock of the model or gate'); test_publication's debug-mode held_locks() check inside "
        "the listener catches it (workers and pool paths)",
        tests=("tests/sender/test_publication.py",),
    ),
    Mutant(
        id="pool-release-checked-then-freed-apart",
        file="staging/buffers.py",
        site="end-lease-with",
        replacement="""\
with self._lock.read():  # MUTANT: the lease checked in a read section ...
    live = self._leases.get(slot.index)
    held = live is not None and live.lease == slot.lease
with self._lock.write():  # ... then the index's current lease freed in a second one
    current = self._leases.get(slot.index)
    lease = current.lease if held and current is not None else slot.lease
    freed = self._release_unlocked(slot.index, lease, retire=retire)
""",
        kind="race",
        description="a release checks its lease in a read section and frees the index's "
        "current lease in a second write section: a repeated release racing another frees "
        "the slot a new holder leased meanwhile (violates 'a stale or repeated one is a "
        "no-op, never freeing a slot someone else holds'); test_slot_pool's repeated "
        "release vs release-and-acquire interleavings catch it",
        tests=("tests/staging/test_slot_pool.py",),
    ),
    Mutant(
        id="compat-pop-chosen-then-removed-apart",
        file="staging/compat.py",
        site="pop-item-with",
        replacement="""\
chosen: list[Any] = []
with self._lock.read():  # MUTANT: the element chosen under a read section ...
    for item in self._items_locked(rooms_view):
        chosen.append(item)
        break
for item in chosen:
    self.write_many(rooms_view, discards=(item,))  # ... removed in a second one
    return item
""",
        kind="race",
        description="view.pop() chooses its element under a read section and removes it in a "
        "second section, ignoring whether it was still there: two poppers of a one-element "
        "view both get it (violates 'view.pop(): write, atomic'); test_dpor_compat's pop vs "
        "pop DPOR check catches it",
        tests=("tests/staging/test_dpor_compat.py",),
    ),
    Mutant(
        id="fanout-count-outside-the-lock",
        file="sender/events.py",
        site="pass-count",
        replacement="""\
self._events += 1  # MUTANT: counted outside _lock
""",
        kind="race",
        description="FanOut counts an event outside its lock: two threads passing events "
        "lose a count and stats().events falls behind what the listeners got (violates "
        "'FanOut's counters: leaf locks held for one update'); test_metrics' bytecode-level "
        "DPOR check of two events catches it",
        tests=("tests/sender/test_metrics.py",),
    ),
    Mutant(
        id="one-thread-owner-read-then-set-apart",
        file="sender/_one_thread.py",
        site="enter-with",
        replacement="""\
with self._lock:  # MUTANT: the owner read in one critical section ...
    owner = self._owner
    inside = self._method
if owner is None:
    with self._lock:  # ... and set in another
        self._owner = me
        self._method = method
        self._depth = 1
    return self
if owner is me:
    with self._lock:
        self._depth += 1
    return self
""",
        kind="race",
        description="debug mode's OneThreadCheck.enter reads the owner in one section and "
        "sets it in another: two threads both see no owner and are inside one sender's init() "
        "at once, undetected (violates 'a thread entering one of the five while another is "
        "inside one gets a ConcurrentSenderUseError'); test_one_thread's init-vs-init check at "
        "every preemption point catches it",
        tests=("tests/sender/test_one_thread.py",),
    ),
)
