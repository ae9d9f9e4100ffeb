"""DPOR (``frontrun``) over double completion: two threads calling inline
``KVManager.progress()`` on the same room, every interleaving with at most one preemption.

The guarantee (``docs/THREADING.md``, issue 9 defect 2): every chunk ends exactly once --
done, failed or drained, counted once whichever thread sees it -- so a room is ``Success``
only when every one of its chunks was DONE. A chunk's end is claimed (``Chunk.claim``, a
test-and-set) before its transfer and slot are released and it is counted.

The room has two chunks: the first chunk's transfer is DONE, the second's is still in
progress (``PROC``). Threads A and B both call ``progress(handle)``; each snapshots the
pending chunks and polls them. Invariant: nothing raised; the room is still
``Transferring`` (never ``Success``, never ``Failed``); ``chunks_done`` is 1 and nothing
failed; the first transfer was released exactly once and the second not at all. Then, to
check that nothing leaks: the room is cleared (the second chunk drains and keeps its staging
slot), its transfer completes, ``wait_drained`` ends it: both transfers released exactly
once, nothing of the room anywhere, every chunk ended exactly once.

Planted bug: a manager whose chunks' end is never exclusive (the claim is taken but its
answer ignored, i.e. the end without ``if not chunk.claim(): continue``): both
threads see the DONE chunk, both end it -- the chunk is counted twice and the room reports
``Success`` though its second chunk never completed (or the second thread polls the released
transfer and fails the room). Planted so that the claim lock is still taken, as in the
real end: with a ``claim`` that returned ``True`` without touching the lock, the
explorer only ever found the second variant -- no false ``Success`` in 2,800 runs -- as
frontrun 0.7 apparently reorders the two threads' polls only around the claim lock's events,
not around the stand-in transfer's own lock.

In-memory transport stand-ins because the explorer must schedule every step (see
``tests/sender/test_dpor_clear.py``); concurrent ``progress()`` also runs over real NIXL in the
sender tests and the stress suite.
"""

from __future__ import annotations

from typing import Any

import frontrun
import numpy as np
import pytest
import torch

from sender.chunks import Chunk
from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.poll import KVPoll
from staging import StagingContext
from staging.buffers import StagingBufferPool
from tests.sender._instant_transport import EXPLORE, PAGE_BYTES, InstantTransport

pytestmark = pytest.mark.timeout(300)

ROOM = 5



class _UnclaimedChunk(Chunk):
    """PLANTED BUG: the claim is taken but its answer ignored -- every caller that sees the
    chunk's end gets to end it (``_end_many`` without ``if not chunk.claim(): continue``)."""

    __slots__ = ()

    def claim(self) -> bool:
        super().claim()
        return True


class DoubleEndingManager(KVManager):
    """PLANTED BUG: a started chunk's end is not claimed once (the end without the claim)."""

    def submit_chunk(self, handle: Any, *args: Any) -> int:
        n = super().submit_chunk(handle, *args)
        for chunk in self.rooms.rooms[handle.room].inflight.values():
            chunk.__class__ = _UnclaimedChunk
        return n


class ProgressRig:
    """A room of two chunks: the first chunk's transfer DONE, the second's in progress."""

    manager_cls: type[KVManager] = KVManager

    def __init__(self) -> None:
        self.transport = InstantTransport(states=("DONE", "PROC"))
        self.kv = torch.zeros((8, PAGE_BYTES), dtype=torch.uint8)
        self.pool = StagingBufferPool(2, 4, PAGE_BYTES)
        self.mgr = self.manager_cls(
            self.transport,
            self.kv,
            num_workers=0,
            staging=StagingContext(lock="mutex"),
            staging_pool=self.pool,
            session_slots=2,  # both chunks hold a slot at once
        )
        self.sender = NixlKVSender(self.mgr, ROOM, ["d0"], [make_transfer_info("d0", range(4))])
        self.sender.init(4)
        self.sender.send(np.array([0, 1]))
        self.sender.send(np.array([2, 3]))  # the last chunk: the room may conclude
        assert len(self.transport.transfers) == 2
        self.errors: list[BaseException] = []

    def progress(self) -> None:
        try:
            self.mgr.progress(self.sender.handle)
        except BaseException as exc:
            self.errors.append(exc)

    def holds(self) -> bool:
        mgr, handle = self.mgr, self.sender.handle
        assert not self.errors, f"raised: {self.errors!r}"
        status = mgr.handle_status(handle)
        assert status is KVPoll.Transferring, (
            f"room is {status!r} with its second chunk still in progress"
        )
        st = mgr.stats()
        assert (st.chunks_done, st.chunks_failed, st.chunks_skipped) == (1, 0, 0), (
            f"the DONE chunk was not counted exactly once: {st}"
        )
        releases = [t.raw_releases for t in self.transport.transfers]
        assert releases == [1, 0], f"transfer releases: {releases}"
        # No leak: clear (the pending chunk drains: its slot stays leased, NIXL may still
        # read it), let its transfer finish, drain.
        self.sender.clear()
        assert mgr.draining(handle) == 1, "the pending chunk does not drain after clear()"
        assert self.pool.stats().in_use == 1, "a draining transfer's slot went back to the pool"
        self.transport.transfers[1].state = "DONE"
        assert mgr.wait_drained(None, 1.0) and mgr.draining() == 0
        releases = [t.raw_releases for t in self.transport.transfers]
        assert releases == [1, 1], f"transfer releases after drain: {releases}"
        assert mgr.footprint(ROOM) == (), f"room {ROOM} left in {mgr.footprint(ROOM)}"
        assert self.pool.stats().in_use == 0, "a staging slot was not returned"
        st = mgr.stats()
        ended = st.chunks_done + st.chunks_skipped + st.chunks_failed + st.chunks_drained
        assert (st.chunks_submitted, ended, st.chunks_drained) == (2, 2, 1), str(st)
        return True


class DoubleEndingRig(ProgressRig):
    manager_cls = DoubleEndingManager


# Exhaustive takes ~2,800 runs (~100 s quiet): every interleaving with at most one preemption
# instead, which already holds both double-completion races (B polls the chunk DONE before
# A released it, or polls it after; the claim must refuse B in both).
BOUNDED = {**EXPLORE, "preemption_bound": 1}


def _explore(rig: type[ProgressRig], label: str) -> Any:
    result = frontrun.explore(
        setup=rig,
        workers=[ProgressRig.progress, ProgressRig.progress],
        invariant=ProgressRig.holds,
        **BOUNDED,
    )
    print(f"{label}: {result.num_explored} interleavings explored, holds={result.property_holds}")
    assert result.num_explored > 0, "frontrun explored nothing (skipped or misconfigured)"
    return result


@pytest.mark.slow
@pytest.mark.usefixtures("frontrun_enabled")
def test_two_inline_progress_calls_one_preemption() -> None:
    result = _explore(ProgressRig, "progress vs progress")
    assert result.property_holds is True, result.explanation


@pytest.mark.usefixtures("frontrun_enabled")
def test_planted_unclaimed_end_is_caught() -> None:
    result = _explore(DoubleEndingRig, "planted unclaimed end")
    assert result.property_holds is False, "the explorer missed the double completion"
    print((result.explanation or "").splitlines()[0])


class TwoClaims:
    """One chunk; two threads claim its end."""

    def __init__(self) -> None:
        from staging.context import RoomHandle

        self.chunk = Chunk(
            RoomHandle(ROOM, 1), 0, "d0", None, None, None, "kv", True, 1, 0.0
        )
        self.won: list[int] = []

    def claim(self) -> None:
        if self.chunk.claim():
            self.won.append(1)

    def holds(self) -> bool:
        assert len(self.won) == 1, f"{len(self.won)} threads won the one-shot claim"
        return True


@pytest.mark.usefixtures("frontrun_enabled")
def test_a_chunks_claim_has_exactly_one_winner_all_interleavings() -> None:
    """``Chunk.claim`` is a one-shot test-and-set (docs/THREADING.md, "Every chunk ends exactly
    once"): of two threads, exactly one wins, whatever the interleaving."""
    result = frontrun.explore(
        setup=TwoClaims, workers=[TwoClaims.claim, TwoClaims.claim], invariant=TwoClaims.holds,
        **EXPLORE,
    )
    print(f"claim vs claim: {result.num_explored} interleavings, holds={result.property_holds}")
    assert result.num_explored > 0
    assert result.property_holds is True, result.explanation


def _one_winner(rig: TwoClaims) -> str | None:
    return None if len(rig.won) == 1 else f"{len(rig.won)} threads won the one-shot claim"


def test_a_chunks_claim_has_exactly_one_winner_at_every_preemption_point() -> None:
    """The same sentence, deterministically with real threads (``tests/interleave.py``): the
    first claimer is stopped at each line and return of the library's code it passes (a
    return splits a call from what its caller does next), the second claims meanwhile. No
    dependence on the machine's load: every such schedule runs, every time."""
    from tests.interleave import explore

    result = explore(TwoClaims, TwoClaims.claim, TwoClaims.claim, _one_winner)
    print(f"claim vs claim: {result.schedules} schedules, {result.blocked} blocked")
    assert result.schedules >= 2
    assert not result.failures, result.failures


class _CheckThenClaimChunk(Chunk):
    """PLANTED BUG: the claim asks whether the chunk ended, then takes the lock and reports
    a win whatever the acquire answered."""

    __slots__ = ()

    def claim(self) -> bool:
        if self.ended:
            return False
        self._claim.acquire(False)
        return True


class _TwoPlantedClaims(TwoClaims):
    def __init__(self) -> None:
        super().__init__()
        self.chunk.__class__ = _CheckThenClaimChunk


def test_planted_check_then_claim_is_caught_at_a_preemption_point() -> None:
    from tests.interleave import explore

    result = explore(
        _TwoPlantedClaims, _TwoPlantedClaims.claim, _TwoPlantedClaims.claim, _one_winner
    )
    print(f"planted: {result.schedules} schedules, failing at {result.failures}")
    assert result.failures, "the preemption explorer missed the check-then-claim"


@pytest.mark.timeout(120)
def test_a_chunks_claim_has_exactly_one_winner_under_perturbed_threads() -> None:
    """The same sentence with real threads, perturbed: every thread runs under a trace hook
    that yields the CPU at every Python function return (so a check and an act split by any
    call can be interleaved, which the GIL alone almost never does at a 1 µs switch
    interval), four threads race for each of 300 chunks' claims."""
    import os
    import sys
    import threading

    from staging.context import RoomHandle

    def yielding(frame: Any, event: str, arg: Any) -> Any:
        if event == "return":
            os.sched_yield()
        return yielding

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    doubles = 0
    try:
        for n in range(300):
            chunk = Chunk(
                RoomHandle(ROOM, n + 1), 0, "d0", None, None, None, "kv", True, n, 0.0
            )
            won: list[int] = []
            start = threading.Barrier(4)

            def claimer(chunk: Chunk = chunk, won: list[int] = won,
                        start: threading.Barrier = start) -> None:
                sys.settrace(yielding)
                try:
                    start.wait(10)
                    if chunk.claim():
                        won.append(1)
                finally:
                    sys.settrace(None)

            threads = [threading.Thread(target=claimer, daemon=True) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            assert not any(t.is_alive() for t in threads)
            doubles += len(won) != 1
    finally:
        sys.setswitchinterval(old)
    assert doubles == 0, f"{doubles} of 300 chunks' claims had more or fewer than one winner"


class EndAndRead:
    """A room of one posted chunk whose transfer is DONE: one thread ends it
    (``progress``), another reads the manager (``stats``). A listener counts the events."""

    def __init__(self) -> None:
        from tests.sender._instant_transport import _mem_manager
        from tests.sender._listeners import Recorder

        self.listener = Recorder()
        self.mgr = _mem_manager(InstantTransport(states=("DONE",)), events=self.listener)
        self.sender = NixlKVSender(self.mgr, ROOM, ["d0"], [make_transfer_info("d0", range(2))])
        self.sender.init(2)
        self.sender.send(np.array([0, 1]))
        self.read: tuple[Any, dict[str, int]] | None = None

    def end(self) -> None:
        self.mgr.progress(self.sender.handle)

    def stats(self) -> None:
        st = self.mgr.stats()
        self.read = (st, dict(self.listener.chunks))


def _told_once(rig: EndAndRead) -> str | None:
    rig.mgr.wait_drained(None, 1.0)
    st = rig.mgr.stats()
    chunks, rooms = dict(rig.listener.chunks), dict(rig.listener.rooms)
    try:
        if st.chunks_done != 1 or chunks != {"done": 1} or rooms != {"success": 1}:
            return f"chunks_done={st.chunks_done}, listener chunks {chunks}, rooms {rooms}"
        if rig.read is not None and rig.read[0].chunks_done > rig.read[1].get("done", 0):
            return f"stats() returned chunks_done={rig.read[0].chunks_done}, told {rig.read[1]}"
        return None
    finally:
        rig.mgr.close(1.0)


def test_every_chunk_end_reaches_the_listener_once_beside_a_reader() -> None:
    """docs/THREADING.md, *Listeners*: 'Every chunk end reaches it once ...: its counts
    equal ``stats()``'; *The sender*: what a section decided is emitted by the deciding
    thread or the first reader to see it. The ending thread is stopped at every point of the
    library's code (``tests/interleave.py``) while ``stats()`` runs: whichever of the two
    emits the end, the listener hears it (and the room's success) exactly once."""
    from tests.interleave import explore

    result = explore(EndAndRead, EndAndRead.end, EndAndRead.stats, _told_once, block_s=0.05)
    print(f"end vs stats: {result.schedules} schedules, {result.blocked} blocked")
    assert result.schedules >= 2
    assert not result.failures, result.failures[:3]
