"""``KVManager.fail_session`` leaves no staging key of the failed session, over real NIXL.

Sequential (inline mode: ``num_workers=0``, every post and poll on this thread): rooms of two
decode sessions stage their chunks through a real staging slot pool and send them over UCX on
loopback, so the staging context holds keys of both sessions, recorded by the manager itself.
Then one session fails. None of its keys may remain, in any room, through any view (the
snapshot, ``room_requests``, the lock-free ``is_requested``, the counters); the other
session's keys and every room stay as they were; the unconcluded room of that session is
failed. A ``fail_session`` that forgets ``staging.purge_session`` fails this test.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.poll import KVPoll
from sender.transport import NixlTransport
from staging.buffers import StagingBufferPool

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(60)]

PAGES = 32
PAGE_BYTES = 1024
DEAD, ALIVE = "decode-a", "decode-b"


@dataclass
class Rig:
    tx: NixlTransport
    kv: torch.Tensor
    dst: torch.Tensor
    pool: StagingBufferPool


@pytest.fixture
def rig(nixl_required: None) -> Iterator[Rig]:
    kv = torch.randint(
        0, 256, (PAGES, PAGE_BYTES), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)
    )
    dst = torch.zeros((PAGES, PAGE_BYTES), dtype=torch.uint8)
    pool = StagingBufferPool(4, 4, PAGE_BYTES)
    try:
        with NixlTransport("prefill-fs") as tx, NixlTransport("decode-fs") as rx:
            tx.register_region("kv", kv, PAGE_BYTES)
            tx.register_region("staging", pool.tensor, PAGE_BYTES)
            rx.register_region("kv", dst, PAGE_BYTES)
            # Two decode sessions (two TP ranks, say) served by one receiving agent.
            tx.add_peer(DEAD, rx.metadata())
            tx.add_peer(ALIVE, rx.metadata())
            yield Rig(tx, kv, dst, pool)
    finally:
        pool.close()


def _poll_until(sender: NixlKVSender, want: KVPoll, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while (state := sender.poll()) is not want:
        assert time.monotonic() < deadline, f"room {sender.bootstrap_room}: {state!r}"
        time.sleep(0.001)


def _sender(mgr: KVManager, room: int, sessions: list[str], pages: int, dst0: int) -> NixlKVSender:
    infos = [
        make_transfer_info(s, range(dst0 + i * pages, dst0 + (i + 1) * pages))
        for i, s in enumerate(sessions)
    ]
    sender = NixlKVSender(mgr, room, sessions, infos)
    sender.init(pages)
    return sender


def test_fail_session_drops_every_staging_key_of_that_session(rig: Rig) -> None:
    mgr = KVManager(rig.tx, rig.kv, num_workers=0, staging_pool=rig.pool)
    try:
        both = _sender(mgr, 1, [DEAD, ALIVE], 4, dst0=0)  # two chunks, concludes
        both.send([0, 1])
        both.send([2, 3])
        _poll_until(both, KVPoll.Success)
        dead_only = _sender(mgr, 2, [DEAD], 2, dst0=8)  # concludes
        dead_only.send([4, 5])
        _poll_until(dead_only, KVPoll.Success)
        alive_only = _sender(mgr, 3, [ALIVE], 2, dst0=10)  # concludes
        alive_only.send([6, 7])
        _poll_until(alive_only, KVPoll.Success)
        pending = _sender(mgr, 4, [DEAD, ALIVE], 4, dst0=12)  # first chunk only: unconcluded
        pending.send([8, 9])
        _poll_until(pending, KVPoll.Transferring)
        assert torch.equal(rig.dst[[0, 1, 2, 3]], rig.kv[[0, 1, 2, 3]])  # bytes did move

        ctx = mgr.staging
        before = ctx.snapshot().prefetch_requested
        assert {s for _, _, s in before} == {DEAD, ALIVE}
        assert {r for r, _, s in before if s == DEAD} == {1, 2, 4}
        kept = frozenset(k for k in before if k[2] != DEAD)
        assert kept and kept != before

        assert mgr.fail_session(DEAD, "peer process died") == frozenset({4})

        snap = ctx.snapshot()
        assert snap.prefetch_requested == kept
        assert snap.open_rooms == frozenset({1, 2, 3, 4})  # rooms stay open (sender fails)
        for room, chunk, session in before:
            assert ctx.is_requested(room, chunk, session) is (session != DEAD)
            assert (chunk, session) in ctx.room_requests(room) or session == DEAD
        assert ctx.stats().requested_keys == len(kept)
        assert mgr.status(4) is KVPoll.Failed
        assert (mgr.status(1), mgr.status(2), mgr.status(3)) == (KVPoll.Success,) * 3
        assert ctx.purge_session(DEAD) == frozenset()  # nothing of it is indexed either

        for sender in (both, dead_only, alive_only):
            sender.clear()
        with pytest.raises(RuntimeError, match="decode peer"):
            pending.failure_exception()
        assert ctx.snapshot().prefetch_requested == frozenset()
        assert mgr.stats().open_rooms == 0
    finally:
        mgr.close()
