"""Every chunk ends exactly once (docs/THREADING.md, "Every chunk ends exactly once"): never
counted twice, never lost, every end reaches the listener once (its counts equal ``stats()``)."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import pytest

from sender.manager import KVManager
from sender.poll import KVPoll
from staging.buffers import StagingBufferPool, StagingSlot
from tests.fixtures_nixl import requires_nixl
from tests.polling import conclude, wait_until
from tests.sender._listeners import Recorder
from tests.sender._real_wrappers import HeldTransfer, HeldTransport
from tests.sender._scripted import Rig, ScriptedTransport, sender
from tests.sender._sessions import (
    SESSIONS_PAGE_BYTES,
    A,
    SessionsRig,
    one_session_sender,
    two_session_sender,
)

pytestmark = [pytest.mark.nixl, requires_nixl]


def quiescent_sum(mgr: KVManager) -> tuple[int, int]:
    st = mgr.stats()
    return st.chunks_submitted, (
        st.chunks_done + st.chunks_failed + st.chunks_skipped + st.chunks_drained
    )


class GatedPool(StagingBufferPool):
    """A real pool whose first lease waits until ``gate`` is set (the one worker is then
    busy with that chunk while the test purges other rooms' queued chunks)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self._first = True

    def try_acquire(self, owner: Any, **kw: Any) -> StagingSlot | None:
        if self._first:
            self._first = False
            self.entered.set()
            assert self.gate.wait(30)
        return super().try_acquire(owner, **kw)


class ReleaseRaises:
    """A real transfer that says it completed inside its post and whose first release
    raises (then releases the real transfer)."""

    REPORTS_DONE_AT_POST = True

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.done = True

    def poll(self) -> str:
        return "DONE"

    def release(self) -> None:
        self.inner.release()
        raise RuntimeError("planted release error")


class MixedTransport(HeldTransport):
    """Session A's writes report done at post and raise on release; session B's are held
    (in flight) until ``go``."""

    def write_pages(self, session_id: str, *args: Any, **kw: Any) -> Any:
        real = self.inner.write_pages(session_id, *args, **kw)
        if session_id == A:
            while real.poll() != "DONE":  # really done before we say so
                time.sleep(0.0005)
            return ReleaseRaises(real)
        t = HeldTransfer(real, self)
        self.transfers.append(t)
        return t


@pytest.mark.timeout(30)
def test_two_inline_progress_calls_never_count_a_chunk_twice(rig: Rig) -> None:
    """Inline mode, two chunks: the first is DONE, the second still in flight. Two threads
    call ``progress`` at once and both poll the DONE transfer (they meet inside its poll).
    The room must stay Transferring (1 of 2 chunks done), never report Success; at 8343a9b
    both threads finished the first chunk, jobs_done reached 2 and the room said Success.

    Found by the audit of issue 9 (defect d2, at 8343a9b).
    """
    script = ScriptedTransport(rig.tx, meet=[1], hold=[2])
    # "as mgr, script": leaving, the hold ends first, then the manager closes.
    with KVManager(script, rig.kv, num_workers=0, transfer_timeout_s=30) as mgr, script:
        s = sender(mgr, 3, [40, 41])
        s.send([7])
        s.send([8])
        assert len(script.transfers) == 2
        script.transfers[0].inner.wait(10)  # the first chunk is really DONE at NIXL
        start = threading.Barrier(2, timeout=5)
        errors: list[BaseException] = []

        def progress() -> None:
            try:
                start.wait()
                mgr.progress(s.handle)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=progress, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        assert mgr.status(3) is KVPoll.Transferring, "a false Success (chunk counted twice)"
        assert mgr.stats().chunks_done == 1
        script.unheld.set()  # the second chunk completes now
        assert conclude(s, 10) is KVPoll.Success
        assert mgr.stats().chunks_done == 2
        assert rig.peer.read_pages([40, 41]) == rig.sp.page_bytes_of([7, 8])
        s.clear()
        assert mgr.footprint(3) == ()


@pytest.mark.timeout(60)
def test_listener_sees_skipped_and_slot_failed_chunks(sessions_rig: SessionsRig) -> None:
    """Skipped chunks (room purged before its queued chunks ran) and a chunk failing before
    its post (no staging slot) each reach the listener, so its counts by outcome equal
    ``stats()``. On 3a76f2e the listener saw neither (0 skipped, 0 failed).

    Found by the audit of issue 25 (section 1, defect 3, at 3a76f2e).
    """
    pool = sessions_rig.with_pool(2, 4, cls=GatedPool)
    rec = Recorder()
    with KVManager(
        sessions_rig.tx,
        sessions_rig.kv,
        num_workers=1,
        staging_pool=pool,
        events=rec,
        slot_timeout_s=0.05,
    ) as mgr:
        first = one_session_sender(mgr, 1, [0, 1, 2, 3])
        first.send([10, 11, 12, 13])
        assert pool.entered.wait(10)  # the one worker waits in its lease: queued units wait
        second = two_session_sender(mgr, 2, 4)
        second.send([20, 21, 22, 23])  # 2 units queued behind the gate
        second.clear()  # purged before they run: both are skipped
        pool.gate.set()
        assert conclude(first, 10.0) is KVPoll.Success
        first.clear()
        held = [pool.try_acquire("test"), pool.try_acquire("test")]  # no slot for room 3
        third = one_session_sender(mgr, 3, [0, 1, 2, 3])
        third.send([30, 31, 32, 33])
        assert conclude(third, 10.0) is KVPoll.Failed
        third.clear()
        for slot in held:
            assert slot is not None and pool.release(slot)
        assert mgr.wait_drained(None, 10.0)
        st = mgr.stats()
        assert (st.chunks_done, st.chunks_skipped, st.chunks_failed) == (1, 2, 1)
        ended = dict(rec.chunks)
        assert ended == {
            k: v
            for k, v in {
                "done": st.chunks_done,
                "failed": st.chunks_failed,
                "skipped": st.chunks_skipped,
                "drained": st.chunks_drained,
            }.items()
            if v
        }
        assert sum(ended.values()) == st.chunks_submitted
        assert rec.nbytes["skipped"] == 2 * 4 * SESSIONS_PAGE_BYTES  # what they would have carried


@pytest.mark.timeout(30)
def test_posted_bytes_counts_drained_chunks(sessions_rig: SessionsRig) -> None:
    """3 chunks of 8 KiB posted, then their room cleared while they are in flight: they
    drain, and all 24,576 bytes were posted. On 3a76f2e ``bytes_posted`` was 0 (only chunks
    that completed for open rooms counted).

    Found by the audit of issue 25 (section 1, defect 8, at 3a76f2e).
    """
    tx = HeldTransport(sessions_rig.tx)
    with KVManager(tx, sessions_rig.kv, num_workers=0) as mgr:  # type: ignore[arg-type]
        s = one_session_sender(mgr, 1, list(range(6)))
        for i in range(3):
            s.send([10 + 2 * i, 11 + 2 * i])
        assert len(tx.transfers) == 3
        s.clear()
        tx.go.set()
        assert mgr.wait_drained(None, 10.0)
        st = mgr.stats()
        assert st.chunks_drained == 3
        assert st.bytes_posted == 3 * 2 * SESSIONS_PAGE_BYTES


@pytest.mark.timeout(60)
def test_release_error_at_post_keeps_the_units_other_chunks_polled(
    sessions_rig: SessionsRig,
) -> None:
    """Worker mode, no pool: one unit holds both sessions' chunks. A's completes at its post
    and its release raises; B's is still in flight. On 3a76f2e the worker dropped B's chunk
    from its list: nobody polled it and the room stayed Transferring. Now the room fails
    (internal error) and B's chunk still ends.

    Found by the audit of issue 25 (section 1, a suspicion settled by a fix, at 3a76f2e).
    """
    tx = MixedTransport(sessions_rig.tx)
    with KVManager(tx, sessions_rig.kv, num_workers=1) as mgr:  # type: ignore[arg-type]
        s = two_session_sender(mgr, 1, 2)
        s.send([3, 4])
        assert wait_until(lambda: len(tx.transfers) == 1, 10.0)
        tx.go.set()
        assert conclude(s, 10.0) is KVPoll.Failed
        assert "planted release error" in (mgr.failure_records.get(1) or "")
        # B's chunk is polled by the worker and ends (not left in flight).
        assert wait_until(lambda: mgr.stats().transfers_inflight == 0, 10.0)
        submitted, ended = quiescent_sum(mgr)
        assert submitted == ended == 2
        s.clear()


@pytest.mark.timeout(180)
def test_listener_counts_equal_stats_with_clears_racing_sends(sessions_rig: SessionsRig) -> None:
    """The contract's sentence (docs/METRICS.md): every chunk end reaches the listener once,
    so at a quiescent point its counts by outcome equal ``stats()``. A scheduler thread
    sends 4 one-page chunks to each of 24 two-session rooms while a second thread clears
    the rooms in a random order (switch interval 1 µs), two workers and one staging slot
    with a short slot timeout: chunks end done, skipped (before the worker, at the fence,
    after the slot wait), failed (no slot) and drained, in whatever interleaving the run
    gets. Seeded (printed) for replay of the clear order.

    Found beside the audit of issue 25 (section 1, at 3a76f2e).
    """
    import random

    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    pool = sessions_rig.with_pool(1, 1)  # two workers contend for it: some chunks get no slot
    rec = Recorder()
    rooms = 24
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    errors: list[BaseException] = []
    try:
        with KVManager(
            sessions_rig.tx,
            sessions_rig.kv,
            num_workers=2,
            staging_pool=pool,
            events=rec,
            slot_timeout_s=0.002,
        ) as mgr:
            senders = [two_session_sender(mgr, r, 4) for r in range(rooms)]
            order = list(range(rooms))
            rng.shuffle(order)
            pauses = [rng.randrange(3) for _ in order]
            started = threading.Event()

            def scheduler() -> None:
                try:
                    started.set()
                    for page in range(4):
                        for s in senders:
                            s.send([page])
                except BaseException as exc:
                    errors.append(exc)

            def clearer() -> None:
                try:
                    assert started.wait(10)
                    for r, pause in zip(order, pauses, strict=True):
                        if pause:
                            time.sleep(0.003 * pause)
                        senders[r].clear()
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=f, daemon=True) for f in (scheduler, clearer)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert [t for t in threads if t.is_alive()] == []
            assert errors == []
            assert mgr.wait_drained(None, 30.0)
            # Queued units of purged rooms end (skipped) when a worker reaches them.
            assert wait_until(lambda: (lambda a, b: a == b)(*quiescent_sum(mgr)), 30.0)
            st = mgr.stats()
    finally:
        sys.setswitchinterval(old)
    want = {
        "done": st.chunks_done,
        "failed": st.chunks_failed,
        "skipped": st.chunks_skipped,
        "drained": st.chunks_drained,
    }
    assert dict(rec.chunks) == {k: v for k, v in want.items() if v}, f"seed {seed}: {want}"
    assert sum(rec.chunks.values()) == st.chunks_submitted
    print(f"seed {seed}: {want}")
