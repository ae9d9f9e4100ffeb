"""NixlKVSender and KVManager over real in-process NIXL agents (UCX on loopback).

A "decode" transport with a registered KV pool receives; the prefill transport sends.
Faults are injected by wrapping the real transport (``stress.harness.faults``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from sender import _nixl
from sender.errors import TRANSPORT_ERRORS, KVTransferError
from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.poll import KVPoll
from sender.transport import NixlTransport
from staging import RoomAlreadyOpenError
from staging.buffers import StagingBufferPool
from stress.harness.faults import FaultInjectingTransport, nixl_error
from tests.fixtures_nixl import requires_nixl
from tests.polling import conclude
from tests.sender._sessions import SessionsRig, one_session_sender

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(60)]

PAGES = 64
PAGE_BYTES = 1024
SESSION = "decode-0"


@dataclass
class Rig:
    tx: NixlTransport
    rx: NixlTransport
    kv: torch.Tensor
    dst: torch.Tensor
    pool: StagingBufferPool


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    torch.manual_seed(0)
    kv = torch.randint(0, 256, (PAGES, PAGE_BYTES), dtype=torch.uint8)
    dst = torch.zeros((PAGES, PAGE_BYTES), dtype=torch.uint8)
    pool = StagingBufferPool(4, 8, PAGE_BYTES)
    with NixlTransport("prefill-test") as tx, NixlTransport("decode-test") as rx:
        tx.register_region("kv", kv, PAGE_BYTES)
        tx.register_region("staging", pool.tensor, PAGE_BYTES)
        rx.register_region("kv", dst, PAGE_BYTES)
        tx.add_peer(SESSION, rx.metadata())
        yield Rig(tx, rx, kv, dst, pool)
        pool.close()


def _mgr(rig: Rig, transport: object = None, **kw: object) -> KVManager:
    return KVManager(transport or rig.tx, rig.kv, **kw)  # type: ignore[arg-type]


def _sender(mgr: KVManager, room: int, n: int = 8, start_dst: int = 0) -> NixlKVSender:
    info = make_transfer_info(SESSION, list(range(start_dst, start_dst + n)))
    s = NixlKVSender(mgr, room, [SESSION], [info])
    s.init(n)
    return s


def _wait(s: NixlKVSender, timeout_s: float = 10.0) -> KVPoll:

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = s.poll()
        if st in (KVPoll.Success, KVPoll.Failed):
            return st
        time.sleep(0.001)
    raise AssertionError(f"room {s.bootstrap_room} did not conclude: {s.poll()!r}")


def _assert_no_trace(mgr: KVManager, room: int) -> None:
    assert mgr.footprint(room) == ()
    for table in (
        mgr.request_status,
        mgr.transfer_infos,
        mgr.req_to_decode_prefix_len,
        mgr.exceptions,
        mgr.failure_records,
    ):
        assert room not in table
    assert room not in mgr.staging.prefetched_rooms
    assert all(k[0] != room for k in mgr.staging.prefetch_requested)


@pytest.mark.parametrize("workers", [2, 0])
@pytest.mark.parametrize("staged", [False, True])
def test_room_succeeds_and_bytes_land(rig: Rig, workers: int, staged: bool) -> None:
    mgr = _mgr(rig, num_workers=workers, staging_pool=rig.pool if staged else None)
    try:
        rig.dst.zero_()
        src = [5, 9, 1, 33, 2, 40, 41, 42]
        s = _sender(mgr, 7, len(src), start_dst=10)
        s.send(src[:3])
        s.send(src[3:])
        assert _wait(s) is KVPoll.Success
        assert torch.equal(rig.dst[10:18], rig.kv[src])
        if staged:
            assert mgr.staging.is_prefetched(7)
            assert mgr.staging.room_requests(7) == {(0, SESSION), (1, SESSION)}
        s.clear()
        _assert_no_trace(mgr, 7)
        assert rig.pool.stats().in_use == 0
    finally:
        mgr.close()


def test_decode_prefix_pages_are_not_sent(rig: Rig) -> None:
    with _mgr(rig) as mgr:
        rig.dst.zero_()
        info = make_transfer_info(SESSION, list(range(4)), decode_prefix_len=2)
        s = NixlKVSender(mgr, 3, [SESSION], [info])
        s.init(4)
        s.send([10, 11, 12, 13])
        assert _wait(s) is KVPoll.Success
        assert mgr.req_to_decode_prefix_len[3] == 2
        assert not rig.dst[0:2].any()
        assert torch.equal(rig.dst[2:4], rig.kv[[12, 13]])
        s.clear()


def test_tp_slice_goes_through_staging(rig: Rig) -> None:
    """Two decode TP ranks each get their half of every page (gathered into a slot)."""
    half = PAGE_BYTES // 2
    pool = StagingBufferPool(2, 8, half)
    with NixlTransport("decode-tp") as rx:
        dst = torch.zeros((PAGES, half), dtype=torch.uint8)
        rx.register_region("kv", dst, half)
        with NixlTransport("prefill-tp") as tx:
            tx.register_region("kv", rig.kv, PAGE_BYTES)
            tx.register_region("staging", pool.tensor, half)
            tx.add_peer("rank0", rx.metadata())
            tx.add_peer("rank1", rx.metadata())
            with KVManager(tx, rig.kv, staging_pool=pool) as mgr:
                infos = [
                    make_transfer_info("rank0", [0, 1, 2], byte_range=(0, half)),
                    make_transfer_info("rank1", [3, 4, 5], byte_range=(half, half)),
                ]
                s = NixlKVSender(mgr, 1, ["rank0", "rank1"], infos)
                s.init(3)
                s.send([7, 8, 9])
                assert _wait(s) is KVPoll.Success
                assert torch.equal(dst[0:3], rig.kv[[7, 8, 9], :half])
                assert torch.equal(dst[3:6], rig.kv[[7, 8, 9], half:])
                s.clear()
                assert pool.stats().in_use == 0
    pool.close()


# ----------------------------------------------------------------- failure_exception


def _room_in_every_table(mgr: KVManager, room: int, exc: BaseException | None) -> NixlKVSender:
    s = _sender(mgr, room)
    mgr.staging.request_prefetch(s.handle, 0, SESSION)
    mgr.staging.mark_prefetched(s.handle)
    if exc is not None:
        mgr.record_failure(s.handle, exc, "boom reason")
    return s


def test_failure_exception_raises_stored_object_and_leaves_no_trace(rig: Rig) -> None:
    with _mgr(rig) as mgr:
        stored = nixl_error("nixlBackendError")
        s = _room_in_every_table(mgr, 1, stored)
        other = _room_in_every_table(mgr, 2, None)
        other_before = (mgr.footprint(2), mgr.staging.room_requests(2))
        assert s.poll() is KVPoll.Failed
        with pytest.raises(type(stored)) as info:
            s.failure_exception()
        assert info.value is stored
        assert s.conclude_state is KVPoll.Failed and s._send_failed
        _assert_no_trace(mgr, 1)
        assert (mgr.footprint(2), mgr.staging.room_requests(2)) == other_before
        assert mgr.staging.is_prefetched(2)
        other.clear()


def test_failure_exception_precedence(rig: Rig) -> None:
    with _mgr(rig) as mgr:
        # 1. _send_error wins over a stored exception.
        s = _room_in_every_table(mgr, 1, ValueError("stored"))
        send_error = nixl_error("nixlRemoteDisconnectError")
        s._send_error = send_error
        with pytest.raises(type(send_error)) as info:
            s.failure_exception()
        assert info.value is send_error
        # 2. Reason only -> KVTransferError(room, reason), a RuntimeError.
        s = _room_in_every_table(mgr, 2, None)
        mgr.record_failure(s.handle, None, "decode said no")
        with pytest.raises(KVTransferError) as kinfo:
            s.failure_exception()
        assert isinstance(kinfo.value, RuntimeError)
        assert (kinfo.value.room, kinfo.value.reason) == (2, "decode said no")
        assert not kinfo.value.is_from_another_rank
        # 3. Nothing recorded -> from another rank.
        s = _room_in_every_table(mgr, 3, None)
        with pytest.raises(KVTransferError) as kinfo:
            s.failure_exception()
        assert kinfo.value.is_from_another_rank
        for room in (1, 2, 3):
            _assert_no_trace(mgr, room)


def test_failure_exception_twice_is_clean(rig: Rig) -> None:
    with _mgr(rig) as mgr:
        stored = nixl_error("nixlBackendError")
        s = _room_in_every_table(mgr, 1, stored)
        other = _room_in_every_table(mgr, 2, None)
        with pytest.raises(type(stored)):
            s.failure_exception()
        before = (mgr.stats(), mgr.staging.snapshot(), dict(mgr.request_status))
        with pytest.raises(KVTransferError, match="already reported"):
            s.failure_exception()
        after = (mgr.stats(), mgr.staging.snapshot(), dict(mgr.request_status))
        assert before == after
        other.clear()


# ----------------------------------------------------------------- injected transport errors


@pytest.mark.parametrize("workers", [2, 0])
@pytest.mark.parametrize("point", ["write", "poll"])
def test_injected_transport_error_fails_room_without_raising(
    rig: Rig, workers: int, point: str
) -> None:
    faulty = FaultInjectingTransport(rig.tx, rate=1.0, seed=1, points=[point])  # type: ignore[list-item]
    with _mgr(rig, faulty, num_workers=workers) as mgr:
        s = _sender(mgr, 5)
        s.send(list(range(8)))  # never raises
        assert _wait(s) is KVPoll.Failed
        stored = mgr.exceptions.get(5) or s._send_error
        assert stored is not None and type(stored).__name__.startswith("nixl")
        s.send(list(range(8)))  # a no-op after failure
        with pytest.raises(type(stored)):
            s.failure_exception()
        _assert_no_trace(mgr, 5)
        assert rig.tx.stats().live_transfers == 0


def test_error_mid_room_fails_room(rig: Rig) -> None:
    faulty = FaultInjectingTransport(rig.tx, fail_writes=[3])
    with _mgr(rig, faulty, num_workers=1) as mgr:
        s = _sender(mgr, 5)
        for i in range(4):
            s.send([2 * i, 2 * i + 1])
        assert _wait(s) is KVPoll.Failed
        assert "failed" in mgr.failure_records[5]
        with pytest.raises(TRANSPORT_ERRORS):
            s.failure_exception()
        # The room's earlier writes may still be in flight (the worker does not wait on
        # one chunk before it posts the next): they drain, then nothing is left.
        assert mgr.wait_drained(s.handle, 30)
        _assert_no_trace(mgr, 5)


def test_remote_disconnect_fails_every_room_of_that_session(rig: Rig) -> None:
    faulty = FaultInjectingTransport(rig.tx, fail_writes=[1], classes=["nixlRemoteDisconnectError"])
    with _mgr(rig, faulty, num_workers=1) as mgr:
        waiting = _sender(mgr, 1)  # not sent yet: fails through fail_session
        s = _sender(mgr, 2)
        s.send(list(range(8)))
        assert _wait(s) is KVPoll.Failed
        assert _wait(waiting) is KVPoll.Failed
        with pytest.raises(TRANSPORT_ERRORS):
            s.failure_exception()
        with pytest.raises(KVTransferError, match="decode peer"):
            waiting.failure_exception()
        assert mgr.stats().open_rooms == 0


# ----------------------------------------------------------------- threads


@pytest.mark.usefixtures("fast_switch")
def test_clear_from_worker_and_scheduler_at_once(rig: Rig) -> None:
    """1000 rounds: a worker thread and the scheduler clear the same room concurrently."""
    with _mgr(rig, num_workers=0) as mgr:
        errors: list[BaseException] = []
        for room in range(1000):
            s = _room_in_every_table(mgr, room, nixl_error("nixlBackendError"))
            barrier = threading.Barrier(2, timeout=5)

            def clear_it(sender: NixlKVSender = s, b: threading.Barrier = barrier) -> None:
                try:
                    b.wait()
                    sender.clear()
                except BaseException as exc:
                    errors.append(exc)

            t = threading.Thread(target=clear_it, daemon=True)
            t.start()
            clear_it()
            t.join(5)
            assert not t.is_alive()
            assert mgr.footprint(room) == ()
        assert errors == []
        st = mgr.stats()
        assert (st.open_rooms, st.purges, st.transfers_inflight) == (0, 1000, 0)
        assert mgr.staging.stats().open_rooms == 0
        assert mgr.staging.stats().requested_keys == 0


def test_worker_finishing_after_clear_leaves_nothing(rig: Rig) -> None:
    """A transfer posted, then the room cleared before the worker sees it done."""
    gate = threading.Event()

    class SlowPoll:
        def __init__(self, inner: NixlTransport) -> None:
            self.inner = inner

        def write_pages(self, *a: object, **k: object) -> object:
            xfer = self.inner.write_pages(*a, **k)  # type: ignore[arg-type]

            class Gated:
                def poll(self) -> str:
                    gate.wait(5)
                    return xfer.poll()

                def release(self) -> object:
                    return xfer.release()

            return Gated()

    with KVManager(SlowPoll(rig.tx), rig.kv, num_workers=1, staging_pool=rig.pool) as mgr:  # type: ignore[arg-type]
        s = _sender(mgr, 9)
        s.send(list(range(8)))
        import time

        deadline = time.monotonic() + 5
        while mgr.stats().transfers_inflight == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert mgr.stats().transfers_inflight == 1
        purge = mgr.purge_room(s.handle)
        s.clear()
        # Posted writes cannot be cancelled: the chunk drains, its slot stays leased.
        assert purge.was_open and purge.draining == 1
        assert mgr.draining(s.handle) == 1 and "draining" in mgr.footprint(9)
        assert rig.pool.stats().in_use == 1
        gate.set()
        assert mgr.wait_drained(s.handle, 5)
        assert mgr.stats().chunks_drained == 1
        _assert_no_trace(mgr, 9)
        assert rig.pool.stats().in_use == 0
        assert rig.tx.stats().live_transfers == 0
        assert mgr.stats().chunks_done == 0


# ----------------------------------------------------------------- bad input


def test_bad_input_is_rejected_without_state_change(rig: Rig) -> None:
    with _mgr(rig) as mgr:
        for room, exc in [(-1, ValueError), (True, TypeError), ("3", TypeError)]:
            with pytest.raises(exc):
                NixlKVSender(mgr, room, [SESSION])  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            NixlKVSender(mgr, 1, [])
        with pytest.raises(ValueError):
            NixlKVSender(mgr, 1, [SESSION, SESSION])
        with pytest.raises(ValueError, match="session"):
            NixlKVSender(mgr, 1, [SESSION], [make_transfer_info("other", [0])])
        assert mgr.stats().open_rooms == 0

        s = NixlKVSender(mgr, 1, [SESSION], [make_transfer_info(SESSION, range(8))])
        with pytest.raises(RoomAlreadyOpenError):
            NixlKVSender(mgr, 1, [SESSION])
        with pytest.raises(RuntimeError, match="before init"):
            s.send([0, 1])
        with pytest.raises(ValueError):
            s.init(9)  # more pages than the destination has
        s.init(8)
        with pytest.raises(ValueError, match="already"):
            s.init(8)
        snapshot = (dict(mgr.request_status), mgr.stats())
        for bad, exc in [
            ([PAGES], ValueError),  # out of the KV pool
            ([-1], ValueError),
            ([True, False], TypeError),
            ([[1, 2]], ValueError),
            ([0.5], TypeError),
            (list(range(9)), ValueError),  # past num_kv_indices
        ]:
            with pytest.raises(exc):
                s.send(bad)  # type: ignore[arg-type]
        assert (dict(mgr.request_status), mgr.stats()) == snapshot
        assert s.poll() is KVPoll.WaitingForInput
        s.clear()
        _assert_no_trace(mgr, 1)


def test_status_only_moves_forward_and_failed_is_sticky(rig: Rig) -> None:
    with _mgr(rig) as mgr:
        s = NixlKVSender(mgr, 1, [SESSION])
        assert s.poll() is KVPoll.Bootstrapping
        mgr.add_transfer_info(s.handle, make_transfer_info(SESSION, range(4)))
        assert s.poll() is KVPoll.WaitingForInput
        mgr.record_failure(s.handle, None, "x")
        s.init(4)
        s.send([0, 1, 2, 3])  # refused: room failed
        assert s.poll() is KVPoll.Failed
        assert mgr.stats().chunks_submitted == 0
        s.clear()


def test_late_writes_after_purge_are_refused(rig: Rig) -> None:
    with _mgr(rig) as mgr:
        s = _sender(mgr, 4)
        handle = s.handle
        s.clear()
        assert mgr.record_failure(handle, RuntimeError("late"), "late") is False
        assert mgr.add_transfer_info(handle, make_transfer_info(SESSION, [0])) is False
        assert mgr.staging.request_prefetch(handle, 0, SESSION) is False
        _assert_no_trace(mgr, 4)
        assert mgr.stats().refused_late_writes >= 1
        # Reopen: the old handle never writes into the new room.
        s2 = _sender(mgr, 4)
        assert mgr.record_failure(handle, RuntimeError("late"), "late") is False
        assert s2.poll() is KVPoll.WaitingForInput
        s2.clear()


def test_nixl_is_really_used() -> None:
    assert _nixl.AVAILABLE
    assert np.dtype(np.int64).itemsize == 8


@requires_nixl
@pytest.mark.timeout(30)
@pytest.mark.parametrize("workers", [0, 1])
def test_room_with_a_chunk_inside_the_decode_prefix_is_marked_prefetched(
    sessions_rig: SessionsRig, workers: int
) -> None:
    """With a pool, a room whose first chunk lies wholly inside the decode prefix (nothing
    to stage) is still marked prefetched once its other chunks are. On 3a76f2e it never
    was (the chunk was never counted toward the room's prefetches).

    Found by the audit of issue 25 (section 1, a suspicion settled by a fix, at 3a76f2e).
    """
    pool = sessions_rig.with_pool(2, 4)
    with KVManager(sessions_rig.tx, sessions_rig.kv, num_workers=workers, staging_pool=pool) as mgr:
        s = one_session_sender(mgr, 1, [0, 1, 2, 3], decode_prefix_len=2)
        s.send([10, 11])  # all in the prefix
        s.send([12, 13])
        assert conclude(s, 10.0) is KVPoll.Success
        assert 1 in mgr.staging.prefetched_rooms
        s.clear()
