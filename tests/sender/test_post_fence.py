"""The post fence (docs/THREADING.md, "The post fence: no post after purge"): a chunk of a
cleared or failed room is never posted, so it never writes decode pages given to another room.
The exhaustive explorations of the fence are in ``tests/sender/test_dpor_post_fence.py``."""

from __future__ import annotations

import time

import pytest

from sender.errors import KVTransferError
from sender.manager import KVManager
from sender.poll import KVPoll
from tests.fixtures_nixl import PAGE_BYTES, requires_nixl
from tests.polling import conclude, wait_until
from tests.sender._real_wrappers import SignallingPool
from tests.sender._scripted import Rig, sender

pytestmark = [pytest.mark.nixl, requires_nixl]


@pytest.mark.timeout(30)
def test_cleared_room_never_writes_pages_given_to_another_room(rig: Rig) -> None:
    """Room A's worker waits for the only staging slot (held by another room); A is aborted
    and reported (``failure_exception``); the driver hands A's decode pages to room B, which
    writes and verifies them; then the slot frees. A's chunk must never be posted: B's
    pages must keep B's bytes. At 8343a9b the worker posted A's chunk onto B's pages.

    Found by the audit of issue 9 (defect d1, at 8343a9b).
    """
    pool = SignallingPool(1, 4, PAGE_BYTES)
    rig.tx.register_region("staging", pool.tensor, PAGE_BYTES)
    blocker = pool.acquire("another-room", timeout=1.0)
    dst, src_a, src_b = [20, 21, 22, 23], [100, 101, 102, 103], [200, 201, 202, 203]
    with KVManager(rig.tx, rig.kv, num_workers=1, staging_pool=pool, slot_timeout_s=20) as mgr_a, \
            KVManager(rig.tx, rig.kv, num_workers=0) as mgr_b:  # fmt: skip
        a = sender(mgr_a, 1, dst)
        a.send(src_a)
        assert pool.waiting.wait(10), "the worker never waited for a slot"
        time.sleep(0.05)  # let it settle inside acquire()
        a.abort()
        with pytest.raises(KVTransferError):
            a.failure_exception()
        # The decode side now reuses A's pages for B (B needs no staging slot).
        started = rig.tx.stats().transfers_started
        b = sender(mgr_b, 2, dst)
        b.send(src_b)
        assert conclude(b, 10) is KVPoll.Success
        assert rig.peer.read_pages(dst) == rig.sp.page_bytes_of(src_b), "B did not verify"
        b.clear()
        pool.release(blocker)  # the slot frees: A's worker gets it

        def worker_done() -> bool:
            st = mgr_a.stats()
            return st.chunks_skipped + st.chunks_done + st.chunks_failed >= 1

        assert wait_until(worker_done, 10), "A's worker never finished its chunk"
        assert wait_until(lambda: pool.stats().in_use == 0, 10)
        assert wait_until(lambda: rig.tx.stats().live_transfers == 0, 10)
        time.sleep(0.2)  # a late write would have landed by now
        landed = rig.peer.read_pages(dst)
        a_landed = landed == rig.sp.page_bytes_of(src_a)
        b_kept = landed == rig.sp.page_bytes_of(src_b)
        assert not a_landed, "A's bytes landed on B's pages"
        assert b_kept, "B's pages were overwritten"
        assert rig.tx.stats().transfers_started == started + 1, "A's chunk was posted"
        assert mgr_a.footprint(1) == () and mgr_a.stats().chunks_done == 0
    pool.close()
