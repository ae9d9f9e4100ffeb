"""What a new user trips on (issue 25, section 2): numpy integers at every entry point, bad
configuration refused at construction, errors that name the bad value, and a constructor
that raises leaving nothing behind. Real NIXL agents on loopback, real numpy scalars."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")

from sender.manager import KVManager, make_transfer_info  # noqa: E402
from sender.nixl_sender import NixlKVSender  # noqa: E402
from sender.poll import KVPoll  # noqa: E402
from sender.transport import NixlTransport  # noqa: E402
from staging import CompatStagingContext, StagingContext  # noqa: E402
from tests.fixtures_nixl import requires_nixl  # noqa: E402

SESSION = "d0"
NUM_PAGES = 64
PAGE_BYTES = 1024


# ---------------------------------------------------------------- numpy integers, no NIXL

INTEGER_LIKES = [np.int64(3), np.int32(3), np.uint64(3), np.uint8(3), np.int16(3), np.array(3)]


@pytest.mark.parametrize("value", INTEGER_LIKES, ids=lambda v: type(v).__name__)
def test_every_staging_entry_point_takes_numpy_integers(value: Any) -> None:
    ctx = StagingContext()
    handle = ctx.open_room(value)
    assert type(handle.room) is int and handle.room == 3
    assert ctx.request_prefetches(handle, np.array([10, 11]), "s") == {10, 11}
    assert ctx.request_prefetches(value, np.array([12], dtype=np.uint32), "s") == {12}
    assert ctx.request_prefetch(value, value, "s") is True
    assert ctx.is_requested(value, np.int64(10), "s")
    assert ctx.cancel_prefetch(handle, np.int8(10), "s") is True
    assert ctx.mark_prefetched(value) is True
    assert ctx.is_prefetched(np.uint16(3)) and ctx.is_open(value)
    # Stored as exact ints (numpy's __eq__/__hash__ never run under the lock later).
    assert all(type(c) is int for c, _ in ctx.room_requests(handle))
    assert ctx.purge_room(value).was_open


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (np.bool_(True), TypeError),
        (True, TypeError),
        (np.float64(3.0), TypeError),
        (3.0, TypeError),
        ("3", TypeError),
        (np.int64(-1), ValueError),
    ],
    ids=repr,
)
def test_what_is_not_an_index_is_still_refused(value: Any, error: type[Exception]) -> None:
    from staging.validate import check_index

    with pytest.raises(error, match="room"):
        StagingContext().open_room(value)
    with pytest.raises(error):
        check_index(value, "x")


def test_chunk_arrays_name_the_bad_element_and_its_position() -> None:
    from staging.validate import check_indices

    ctx = StagingContext()
    h = ctx.open_room(1)
    with pytest.raises(ValueError, match=r"-2 \(at position 1\)"):
        ctx.request_prefetches(h, np.array([1, -2]), "s")
    with pytest.raises(TypeError, match=r"float .*at position 0"):
        ctx.request_prefetches(h, np.array([1.0]), "s")
    with pytest.raises(TypeError, match="iterable"):
        ctx.request_prefetches(h, "12", "s")  # type: ignore[arg-type]
    assert ctx.room_requests(h) == frozenset()  # nothing recorded by a refused batch
    assert check_indices(range(3), "x") == (0, 1, 2)
    assert check_indices((np.int64(4), 5), "x") == (4, 5)


def test_compat_and_native_share_one_validator() -> None:
    """CompatStagingContext's leniency is the shared validator's (bools only where the
    compat view of a set must take them)."""
    compat = CompatStagingContext()
    compat.prefetched_rooms.add(np.int64(5))
    assert 5 in compat.prefetched_rooms
    with pytest.raises(TypeError):
        compat.prefetched_rooms.add(np.float64(5))


def test_the_staging_core_does_not_import_numpy() -> None:
    code = (
        "import sys\n"
        "class I:\n"
        "    def __index__(self): return 7\n"
        "import staging\n"
        "ctx = staging.StagingContext()\n"
        "h = ctx.open_room(I())\n"
        "assert ctx.request_prefetches(h, [I()], 's') == {7}\n"
        "assert 'numpy' not in sys.modules, 'numpy imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------- real NIXL


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[NixlTransport, NixlTransport, Any]]:
    kv = torch.randint(0, 256, (NUM_PAGES, PAGE_BYTES), dtype=torch.uint8)
    dst = torch.zeros((NUM_PAGES, PAGE_BYTES), dtype=torch.uint8)
    with NixlTransport("new-user-tx") as tx, NixlTransport("new-user-rx") as rx:
        tx.register_region("kv", kv, PAGE_BYTES)
        rx.register_region("kv", dst, PAGE_BYTES)
        tx.add_peer(SESSION, rx.metadata())
        yield tx, rx, kv


@pytest.fixture
def mgr(pair: tuple[NixlTransport, NixlTransport, Any]) -> Iterator[KVManager]:
    tx, _, kv = pair
    with KVManager(tx, kv, num_workers=1) as m:
        yield m


def _conclude(s: NixlKVSender, timeout_s: float = 20.0) -> KVPoll:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = s.poll()
        if status in (KVPoll.Success, KVPoll.Failed):
            return status
        time.sleep(0.001)
    raise AssertionError("room did not conclude")


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(60)
def test_the_sender_takes_numpy_integers(mgr: KVManager) -> None:
    info = make_transfer_info(SESSION, np.arange(4, dtype=np.uint16))
    s = NixlKVSender(mgr, np.int64(4), [SESSION], [info])
    assert type(s.bootstrap_room) is int and s.bootstrap_room == 4
    s.init(np.int64(4), aux_index=np.int32(0))
    assert type(s.num_kv_indices) is int and type(s.aux_index) is int
    s.send(np.array([1, 2], dtype=np.uint32))
    s.send([np.int64(3), np.uint8(4)])
    assert _conclude(s) is KVPoll.Success
    assert mgr.status(np.int64(4)) is KVPoll.Success
    s.clear()


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("pages", "message"),
    [
        ([64], r"kv_indices out of range \[0, 64\): 64 at position 0"),
        ([-1], r"kv_indices out of range \[0, 64\): -1 at position 0"),
        ([3, 5, 70, 80], r"kv_indices out of range \[0, 64\): 70 at position 2 \(and 1 more\)"),
        (np.uint64([2**32 + 1]), r"out of range \[0, 64\): 4294967297 at position 0"),
        (np.uint64([1, 2**63 + 5]), r"out of range \[0, 64\): 9223372036854775813 at position 1"),
    ],
    ids=["64", "-1", "two-bad", "2**32+1", "2**63+5"],
)
def test_out_of_range_pages_are_named_with_their_position(
    mgr: KVManager, pages: Any, message: str
) -> None:
    s = NixlKVSender(mgr, 7, [SESSION], [make_transfer_info(SESSION, range(8))])
    s.init(4)
    with pytest.raises(ValueError, match=message):
        s.send(pages)
    assert mgr.stats().chunks_submitted == 0  # refused before any state change
    s.clear()


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(60)
def test_too_many_pages_says_would_be(mgr: KVManager) -> None:
    s = NixlKVSender(mgr, 8, [SESSION], [make_transfer_info(SESSION, range(8, 12))])
    s.init(4)
    s.send([0, 1])
    with pytest.raises(ValueError, match=r"3 more pages would make 5 sent \(2 already\)"):
        s.send([2, 3, 4])
    s.send([2, 3])  # 4 of 4: the room's last chunk, not yet polled
    with pytest.raises(ValueError, match=r"would make 6 sent \(4 already\), num_kv_indices is 4"):
        s.send([2, 3])
    assert _conclude(s) is KVPoll.Success
    s.clear()


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(60)
def test_a_refused_sender_leaves_nothing_behind(mgr: KVManager) -> None:
    """An info for a session the sender does not name is a ValueError before the room
    opens: no room opened, cleared or noticed, and the id is free."""
    before = mgr.stats()
    bad = make_transfer_info("someone-else", range(4))
    with pytest.raises(ValueError, match="'someone-else' is not a session of room 9"):
        NixlKVSender(mgr, 9, [SESSION], [bad])
    with pytest.raises(TypeError, match="TransferInfo"):
        NixlKVSender(mgr, 9, [SESSION], ["not an info"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="reach page 99"):
        NixlKVSender(mgr, 9, [SESSION], [make_transfer_info(SESSION, [1, 99])])
    after = mgr.stats()
    assert (after.rooms_opened, after.rooms_cleared, after.purges, after.notices_queued) == (
        before.rooms_opened,
        before.rooms_cleared,
        before.purges,
        before.notices_queued,
    )
    assert mgr.footprint(9) == ()
    s = NixlKVSender(mgr, 9, [SESSION], [make_transfer_info(SESSION, range(4))])  # id free
    s.clear()


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(60)
def test_bad_configuration_is_refused_at_construction(
    pair: tuple[NixlTransport, NixlTransport, Any],
) -> None:
    tx, _, kv = pair
    with pytest.raises(ValueError, match=r"kv_region 'nope' is not registered .*\['kv'\]"):
        KVManager(tx, kv, kv_region="nope")
    with pytest.raises(ValueError, match=r"kv_pool is \[32, 1024\] .* region 'kv' has 64 pages"):
        KVManager(tx, kv[:32])
    other = torch.zeros((NUM_PAGES, PAGE_BYTES), dtype=torch.uint8)
    with pytest.raises(ValueError, match="not the tensor registered as region 'kv'"):
        KVManager(tx, other)
    from staging.buffers import StagingBufferPool

    pool = StagingBufferPool(num_slots=2, slot_pages=4, page_bytes=PAGE_BYTES)
    with pytest.raises(ValueError, match="staging_region 'staging' is not registered"):
        KVManager(tx, kv, staging_pool=pool)
    closed = NixlTransport("new-user-closed")
    closed.register_region("kv", other, PAGE_BYTES)
    closed.close()
    with pytest.raises(ValueError, match="new-user-closed' closed> is closed"):
        KVManager(closed, other)


_SHUTDOWN_SCRIPT = """
import sys, time, torch
from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from stress.harness.peer import DecodePeer
from sender.transport import NixlTransport
n = int(sys.argv[1])
kv = torch.randint(0, 256, (64, 1024), dtype=torch.uint8)
peer = DecodePeer("decode-0", 64, 1024)
tx = NixlTransport("prefill-0")
tx.register_region("kv", kv, page_bytes=1024)
tx.add_peer("decode-0", peer.metadata())
with KVManager(tx, kv, num_workers=2) as mgr:
    for room in range(n):
        s = NixlKVSender(mgr, room, ["decode-0"], [make_transfer_info("decode-0", range(4))])
        s.init(4)
        s.send([10, 11])
        s.abort()  # failed before Success: its decode session gets a "failed" notice
        s.clear()
sent = mgr.stats().notices_sent
tx.close()  # at once, with the notices just sent
deadline = time.monotonic() + 20  # a bound for a loaded machine, not a speed claim
while peer.notice_stats().learnt < sent and time.monotonic() < deadline:
    time.sleep(0.005)
print("sent", sent, "learnt", peer.notice_stats().learnt)
peer.close()
"""


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(120)
def test_close_right_after_notices_sends_them_and_prints_nothing() -> None:
    """``tx.close()`` right after ``KVManager.close()`` sent its room notices: on the old
    code UCX canceled the queued notices ("UCX AM send failed ... Request canceled" on the
    user's stderr, 50 lines in 3 of 3 runs) and the decode side never learnt them."""
    import os

    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN", "UCX_NET_DEVICES": "lo"}
    proc = subprocess.run(
        [sys.executable, "-c", _SHUTDOWN_SCRIPT, "50"],
        capture_output=True, text=True, timeout=100, check=False, env=env,
    )  # fmt: skip
    print(proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == 0
    native = [
        line for line in proc.stderr.splitlines()
        if "UCX" in line or "ucx_utils" in line or "Connection refused" in line
    ]  # fmt: skip
    assert native == [], native[:5]
    assert "sent 50 learnt 50" in proc.stdout
