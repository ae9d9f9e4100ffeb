"""Mutants of the sender (the room table ``sender/rooms.py``, the chunk pipeline
``sender/pipeline.py``, ``sender/manager.py``, ``sender/nixl_sender.py``) and of the staging
purge it relies on: the eight defects of the sender audit put back one at a time, plus the
lifecycle bugs the audit's mutation run found our checks blind to.

Each mutant names a site tag (``# mutant-site: NAME``) in its file; see
:mod:`tools.mutant_sites`. A missing or duplicated tag makes it stale.
"""

from __future__ import annotations

from tools.mutants_spec import ISSUE_9_TESTS, ISSUE_16_TESTS, Mutant

MANAGER = "sender/manager.py"
ROOMS = "sender/rooms.py"
PIPELINE = "sender/pipeline.py"
REGRESSIONS = ISSUE_9_TESTS
DPOR = "tests/sender/test_dpor_clear.py"
DPOR_FENCE = "tests/sender/test_dpor_post_fence.py"
DPOR_PROGRESS = "tests/sender/test_dpor_progress.py"
DPOR_PURGE = "tests/sender/test_dpor_purge.py"
SENDER_TESTS = ("tests/sender/test_sender.py", *REGRESSIONS)
SENDER_STRESS = ("sender-audit",)
PROPERTIES = "tests/sender/test_properties.py"
LOAD_DEFECTS = ISSUE_16_TESTS

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        id="fail-session-keeps-staging-keys",
        file=ROOMS,
        site="fail-session-locked",
        replacement="""\
pass  # MUTANT: the failed session's staging keys are left behind
""",
        kind="sequential",
        description="KVManager.fail_session does not call staging.purge_session: the dead "
        "session's staging keys stay in every room",
        tests=(
            "tests/sender/test_fail_session.py",
            "tests/sender/test_sender.py::test_remote_disconnect_fails_every_room_of_that_session",
        ),
    ),
    Mutant(
        id="d1-post-without-recheck",
        file=ROOMS,
        site="register",
        replacement="""\
if True:  # MUTANT: liveness checked only before the slot wait
    for chunk in chunks:
        entry.inflight[chunk.chunk_id] = chunk
    return True
""",
        kind="race",
        description="defect 1: a worker posts a chunk whose room was purged while it waited "
        "for a slot (no re-check at the fence): cross-room page corruption",
        tests=(*SENDER_TESTS, DPOR_FENCE),
        stress=SENDER_STRESS,
    ),
    Mutant(
        id="d1-purge-without-gate",
        file=ROOMS,
        site="purge-gate",
        replacement="""\
gate = PlainGate()  # MUTANT: a fresh gate for each purge: purge waits for no post
""",
        kind="race",
        description="defect 1 (fence half): purge_room does not take the room's post gate, so "
        "a post that passed its check lands after clear() returned",
        tests=(*SENDER_TESTS, DPOR_FENCE),
        stress=SENDER_STRESS,
    ),
    Mutant(
        id="d2-end-without-claim",
        file=PIPELINE,
        site="end-many",
        replacement="""\
chunk.claim()  # MUTANT: whoever sees the end accounts for it
""",
        kind="race",
        description="defect 2: a chunk's end is not claimed once: two progress() calls count it "
        "twice and a room reports a false Success",
        tests=(*SENDER_TESTS, DPOR_PROGRESS, DPOR),
        stress=SENDER_STRESS,
    ),
    Mutant(
        id="d3-transport-release-skips-chunk",
        file=ROOMS,
        site="account-ends-if-2",
        replacement="""\
if drained or entry is None or abandoned or released:  # MUTANT
    counts["chunks_drained"] += 1
    if released:
        counts["chunks_released_by_transport"] += 1
    outcome = "drained"
elif exc is None:
    entry.jobs_done += 1
    counts["chunks_done"] += 1
    if entry.last_chunk_seen and entry.jobs_done == entry.jobs_total:
        self.maybe_succeed_locked(entry, after)
    outcome = "done"
else:
    counts["chunks_failed"] += 1
    outcome = "failed"
""",
        kind="lifecycle",
        description="defect 3: a transfer released by the transport is taken for a purge: the "
        "chunk is skipped and its open room stays Transferring forever",
        tests=SENDER_TESTS,
        stress=SENDER_STRESS,
    ),
    Mutant(
        id="d5-staging-purge-times-out",
        file="staging/context.py",
        site="purge-room",
        replacement="""\
with self._lock.write():  # MUTANT: a purge may time out half-way
    state = self._close_locked(room_id, generation)
""",
        kind="race",
        description="defect 5: StagingContext.purge_room honours lock_timeout: clear() raises "
        "LockTimeoutError and leaves the room half-purged under a long reader",
        tests=(*REGRESSIONS, "tests/sender/test_sender.py"),
        stress=SENDER_STRESS,
    ),
    Mutant(
        id="d6-failure-exception-by-room-id",
        file="sender/nixl_sender.py",
        site="failure-exception",
        replacement="""\
purge = self.kv_mgr.purge_room(self.bootstrap_room)  # MUTANT: whatever opening
""",
        kind="race",
        description="defect 6: failure_exception() purges by bare room id: it can take (and "
        "raise) the exception of the room's next opening",
        tests=(*SENDER_TESTS, DPOR_PURGE),
        stress=SENDER_STRESS,
    ),
    Mutant(
        id="d7-open-room-checks-closed-late",
        file=ROOMS,
        site="close-begin",
        replacement="""\
with self.lock.write_untimed():
    for entry in self.rooms.values():
        handles.append(entry.handle)
self.closing = True  # MUTANT: set after the open rooms were listed
""",
        kind="race",
        description="defect 7: open_room checks a flag close() sets after snapshotting the "
        "open rooms: a room opened in between survives close()",
        tests=(*SENDER_TESTS, DPOR_PURGE),
        stress=SENDER_STRESS,
    ),
    Mutant(
        id="d8-short-info-accepted",
        file=ROOMS,
        site="add-info",
        replacement="""\
short = False and (  # MUTANT: an info after init() is not checked
    info.dst_pages.size < entry.num_kv_indices
)
""",
        kind="sequential",
        description="defect 8: a transfer info that arrives after init() with too few "
        "destination pages is accepted; the room later fails as an internal error or hangs",
        tests=SENDER_TESTS,
        stress=SENDER_STRESS,
    ),
    Mutant(
        id="manager-purge-two-critical-sections",
        file=ROOMS,
        site="purge-if-1",
        replacement="""\
if entry is None or (generation is not None and entry.handle.generation != generation):
    return ManagerPurge(room, False, None, (), None)
with entry.gate.write_untimed(), self.lock.write_untimed():  # MUTANT: a first section
    if self.rooms.get(room) is not entry:  # closes the room; the tables go in a second
        return ManagerPurge(room, False, None, (), None)
    del self.rooms[room]
""",
        also=(("purge-if-2", ""), ("purge-close", "")),
        kind="race",
        description="KVManager.purge_room in two critical sections: an observer sees the room "
        "closed while its status, exception and staging keys are still there",
        tests=(*SENDER_TESTS, DPOR_PURGE),
        stress=SENDER_STRESS,
    ),
    Mutant(
        id="purge-returns-slots-early",
        file=ROOMS,
        site="purge-set-staged",
        replacement="""\
staged = self.staging.purge_room(entry.handle)
if self.pool is not None:  # MUTANT: slots back under pending transfers
    self.pool.release_owner(entry.handle)
""",
        kind="lifecycle",
        description="purge_room returns the room's staging slots while posted transfers still "
        "read from them: another room can lease and overwrite a slot under a pending write",
        tests=SENDER_TESTS,
        stress=SENDER_STRESS,
    ),
    Mutant(
        id="drain-ignores-held-slots",
        file=ROOMS,
        site="lingering-locked",
        replacement="""\
return n  # MUTANT: slots a thread still holds for a purged opening are not counted
""",
        kind="race",
        description="draining()/wait_drained() count only the posted chunks of a purged "
        "opening, not the staging slots a worker leased for it before the purge: they answer "
        "0/True while a slot is still held",
        tests=(*SENDER_TESTS, PROPERTIES),
        stress=SENDER_STRESS,
    ),
    Mutant(
        id="hung-chunk-ends-before-settling",
        file=PIPELINE,
        site="poll-once-if-1",
        replacement="""\
if True:  # MUTANT: a hung chunk ends at its first sweep, settled or not
    return True, (chunk, chunk.hung, False, True)
""",
        kind="race",
        description="a hung chunk is ended (handle released, slot returned) at the first sweep "
        "although NIXL still has its write in progress: its late bytes may land in pages or a "
        "slot given to another room",
        tests=(PROPERTIES, *LOAD_DEFECTS),
        stress=SENDER_STRESS,
    ),
    Mutant(
        id="abandon-ignores-the-claim",
        file=PIPELINE,
        site="end-many",
        replacement="""\
if not chunk.claim() and not end[2]:  # MUTANT: close() abandons claimed chunks too
    continue
""",
        kind="race",
        description="close()'s abandon path ends a chunk another thread already claimed (its "
        "poll saw the end first): the transfer is released twice and the chunk counted twice",
        tests=(
            "tests/sender/test_close.py::test_close_never_abandons_a_chunk_another_thread_claimed",
            PROPERTIES, *LOAD_DEFECTS, DPOR,
        ),
        stress=SENDER_STRESS,
    ),
    Mutant(
        id="notice-before-the-last-drain",
        file=ROOMS,
        site="account-ends-if-1",
        replacement="""\
if abandoned:
    # Its writes were given up, not drained: they may still land, so the
    # decode side must not be told it may reuse the room's pages.
    self.notifier.withhold(handle)
elif drained:  # MUTANT: the notice goes when the first draining chunk ends
    self.notifier.drained(handle)  # its opening's last posted chunk ended
""",
        kind="race",
        description="a purged opening's room notice is queued when its first draining chunk "
        "ends, not its last: the decode side is told its pages are free while a write of the "
        "room may still land in them",
        tests=("tests/sender/test_room_notices.py", PROPERTIES),
        stress=SENDER_STRESS,
    ),
    Mutant(
        id="batched-send-registers-outside-the-gate",
        file=PIPELINE,
        site="submit-with",
        replacement="""\
chunks = rooms.begin_chunk(  # MUTANT: registered before the gate is taken
    handle, chunk_idx, start, kv_indices, src_checked, is_last, entry_expected=entry
)
with entry.gate.write_untimed():
    if chunks:
        ends = self._post_all(chunks)
""",
        kind="race",
        description="the batched inline send registers its chunks before taking the room's "
        "post gate: a purge between registration and post returns, then the writes are posted",
        tests=(DPOR_FENCE, "tests/sender/test_sender.py"),
        stress=SENDER_STRESS,
    ),
    Mutant(
        id="small-page-list-repeats-missed",
        file="sender/pages.py",
        site="scan-pages-return",
        replacement="""\
return min(values), max(values), False  # MUTANT: short lists never repeat
""",
        kind="sequential",
        description="the Python path of the page scan (up to 32 pages) never reports a repeat: "
        "repeated destination pages of short lists pass make_transfer_info and CheckedPages",
        tests=(PROPERTIES, *LOAD_DEFECTS, "tests/sender/test_data_path.py"),
    ),
    Mutant(
        id="sweep-only-when-idle",
        file=PIPELINE,
        site="worker-main-call-maybe-sweep",
        replacement="""\
if unit is _IDLE and pause >= HUNG_SWEEP_S:  # MUTANT: idle only
    self.maybe_sweep()
""",
        kind="race",
        description="a worker sweeps hung chunks only when its queue stays empty for 50 ms "
        "(the audited shape): under steady traffic a settled hung chunk keeps its slot",
        tests=LOAD_DEFECTS,
        stress=SENDER_STRESS,
    ),
    Mutant(
        id="checked-pages-skip-bounds",
        file="sender/transport.py",
        site="write-pages-if-1",
        replacement="""\
if not (  # MUTANT: checked page lists are trusted against any region
    type(src_pages) is CheckedPages and type(dst_pages) is CheckedPages and dst_pages.unique
):
    _check_pages(src, li.num_pages, "src_pages", src_region, unique=False)
    _check_pages(dst, remote.num_pages, "dst_pages", dst_region, unique=True)
""",
        kind="sequential",
        description="write_pages trusts CheckedPages without comparing their bound with the "
        "regions: a checked list built for a larger pool reaches NIXL",
        tests=("tests/sender/test_data_path.py",),
    ),
    Mutant(
        id="checked-slice-drops-bound",
        file="sender/pages.py",
        site="getitem",
        replacement="""\
out._indices, out._max, out._unique = view, 0, self._unique  # MUTANT: bound lost
""",
        kind="sequential",
        description="a CheckedPages slice forgets its parent's bound: out-of-range pages of "
        "a slice pass the transport's O(1) check",
        tests=("tests/sender/test_data_path.py",),
    ),
    Mutant(
        id="e25-inline-slot-wait-only-sweeps",
        file=PIPELINE,
        site="on-wake-2",
        replacement="""\
self.maybe_sweep()  # MUTANT: nobody ends the slot holders
""",
        kind="sequential",
        description="issue 25 defect 1: an inline send waiting for a slot only sweeps hung "
        "chunks; its own completed writes hold the slots until slot_timeout_s fails the room",
        tests=("tests/sender/test_draining.py::test_inline_scheduler_step_with_fewer_slots_than_chunks",),
    ),
    Mutant(
        id="e25-skip-without-event",
        file=ROOMS,
        site="skipped-locked",
        replacement="""\
if False:  # MUTANT: a skipped chunk is counted but never told
    now = time.monotonic()
    for chunk in chunks:
        after.ended.append(
            (chunk.session_id, "skipped", now - chunk.made_at, self.nbytes(chunk))
        )
""",
        kind="sequential",
        description="issue 25 defect 3: skipped chunks reach stats() but not the listener: "
        "the chunk histograms no longer add up to chunks_ended_total",
        tests=(
            "tests/sender/test_chunks_end_once.py::test_listener_sees_skipped_and_slot_failed_chunks",
            "tests/sender/test_chunks_end_once.py::test_listener_counts_equal_stats_with_clears_racing_sends",
        ),
    ),
    Mutant(
        id="e25-success-then-fail-by-code",
        file=ROOMS,
        site="fail-locked",
        replacement="""\
if first:  # MUTANT: a room failed after Success is counted by code again
    # A room that concluded Success and is failed afterwards (abort() or
    # record_failure() before clear()) is Failed from now on, but it is counted
    # neither in rooms_failed nor by code: rooms_failed_by_code sums to rooms_failed.
    code = code or code_for(reason, exc)
    entry.failure_code = code
    self.failed_by_code[code] = self.failed_by_code.get(code, 0) + 1
    entry.concluded = True
    self.counts["rooms_failed"] += 1
    if after is not None:
        if self.events is not None:
            after.concluded.append(
                (room, handle.generation, "failed", code,
                 time.monotonic() - entry.opened_at)
            )
        if not quiet:
            after.logs.append(
                (
                    logging.WARNING,
                    "room %d generation %d failed (sessions %s): %s: %s",
                    (room, handle.generation, ", ".join(entry.sessions), code,
                     reason),
                )
            )
""",
        kind="sequential",
        description="issue 25 defect 4: abort() after Success counts the room in "
        "rooms_failed (and by code): a room concludes twice",
        tests=("tests/sender/test_failure_reporting.py::test_abort_after_success_counts_no_failure_and_sends_no_notice",),
    ),
    Mutant(
        id="e25-close-joins-itself",
        file=PIPELINE,
        site="join-workers",
        replacement="""\
if True:  # MUTANT: close() from a worker joins the current thread
    worker.join(bounded_wait(max(0.5, deadline - time.monotonic())))
""",
        kind="sequential",
        description="issue 25 defect 6: close() from a listener callback on a worker raises "
        "'cannot join current thread' half-way and leaves the notifier running",
        tests=("tests/sender/test_close.py::test_close_from_a_listener_callback_on_a_worker",),
    ),
    Mutant(
        id="e25-unposted-failure-without-event",
        file=ROOMS,
        site="ended-locked",
        replacement="""\
if False:  # MUTANT: a chunk failing before its post is never told
    after.ended.append(
        (chunk.session_id, "failed", time.monotonic() - chunk.made_at,
         self.nbytes(chunk))
    )
""",
        kind="sequential",
        description="issue 25 defect 3: a chunk that fails before its post (no staging slot) "
        "reaches stats() but not the listener",
        tests=(
            "tests/sender/test_chunks_end_once.py::test_listener_sees_skipped_and_slot_failed_chunks",
            "tests/sender/test_chunks_end_once.py::test_listener_counts_equal_stats_with_clears_racing_sends",
        ),
    ),
)
