"""Bad input to the sender, manager, transport and decode peer (issue: adoptable by an
engine, section 4): each gets a clear TypeError/ValueError (TransportParamError for
metadata), before any state changes. Real NIXL agents on loopback."""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from sender.errors import (
    KVTransferError,
    TransportParamError,
)
from sender.manager import KVManager, TransferInfo, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.notices import MAX_NOTICE_BYTES, RoomNotice, decode_notice
from sender.poll import KVPoll
from sender.transport import NixlTransport, decode_metadata
from staging.buffers import StagingBufferPool
from staging.context import StagingContext
from tests import polling
from tests.fixtures_nixl import NUM_PAGES, PAGE_BYTES, SenderPool, requires_nixl
from tests.polling import conclude
from tests.sender._scripted import SCRIPTED_SESSION, Rig
from tests.sender._sessions import SESSIONS_PAGE_BYTES, A, SessionsRig, one_session_sender
from tests.sender._stub_transport import StubTransport, _stub_manager

pytestmark = [pytest.mark.nixl, requires_nixl, pytest.mark.timeout(60)]

SESSION = "d0"


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[NixlTransport, NixlTransport, torch.Tensor]]:
    kv = torch.randint(0, 256, (NUM_PAGES, PAGE_BYTES), dtype=torch.uint8)
    dst = torch.zeros((NUM_PAGES, PAGE_BYTES), dtype=torch.uint8)
    with NixlTransport("bad-input-tx") as tx, NixlTransport("bad-input-rx") as rx:
        tx.register_region("kv", kv, PAGE_BYTES)
        rx.register_region("kv", dst, PAGE_BYTES)
        tx.add_peer(SESSION, rx.metadata())
        yield tx, rx, kv


@pytest.fixture
def mgr(pair: tuple[NixlTransport, NixlTransport, torch.Tensor]) -> Iterator[KVManager]:
    tx, _, kv = pair
    with KVManager(tx, kv, num_workers=1) as m:
        yield m


def _wait(s: NixlKVSender, timeout_s: float = 10.0) -> KVPoll:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = s.poll()
        if st in (KVPoll.Success, KVPoll.Failed):
            return st
        time.sleep(0.001)
    raise AssertionError("room did not conclude")


def test_float_and_bool_destination_pages_are_refused() -> None:
    for pages in ([1.7, 2.2], [True, False], torch.tensor([1.0, 2.0]).numpy()):
        with pytest.raises(TypeError, match="dst_pages must hold ints"):
            make_transfer_info(SESSION, pages)  # type: ignore[arg-type]
    assert list(make_transfer_info(SESSION, [3, 4]).dst_pages) == [3, 4]


def test_infos_not_made_by_make_transfer_info_are_checked_again(mgr: KVManager) -> None:
    """add_transfer_info takes an info made by make_transfer_info as it is (no second
    check), but one built directly or copied with dataclasses.replace is checked again."""
    import dataclasses

    import numpy as np

    from sender.manager import TransferInfo

    good = make_transfer_info(SESSION, [1, 2, 3])
    forged = [
        dataclasses.replace(good, dst_pages=np.array([-1, 2, 3])),
        TransferInfo(SESSION, np.array([1.5, 2.0])),  # type: ignore[arg-type]
        dataclasses.replace(good, decode_prefix_len=-1),
    ]
    for i, info in enumerate(forged):
        s = NixlKVSender(mgr, 100 + i, [SESSION])
        with pytest.raises((TypeError, ValueError)):
            s.kv_mgr.add_transfer_info(s._handle, info)
        s.clear()
    s = NixlKVSender(mgr, 110, [SESSION], [good])
    s.init(3)
    s.send([4, 5, 6])
    assert _wait(s) is KVPoll.Success
    s.clear()


def test_a_str_as_session_ids_is_refused(mgr: KVManager) -> None:
    for bad in ("ab", "decode-0", b"d0"):
        with pytest.raises(TypeError, match="sequence of session id strings"):
            NixlKVSender(mgr, 1, bad)  # type: ignore[arg-type]
    assert mgr.stats().open_rooms == 0 and mgr.footprint(1) == ()


def test_failure_exception_on_a_success_room_says_so(mgr: KVManager) -> None:
    s = NixlKVSender(mgr, 2, [SESSION], [make_transfer_info(SESSION, range(2))])
    s.init(2)
    s.send([0, 1])
    assert _wait(s) is KVPoll.Success
    with pytest.raises(KVTransferError, match="succeeded") as info:
        s.failure_exception()
    assert not info.value.is_from_another_rank
    assert s.poll() is KVPoll.Success  # what poll() reported is not rewritten
    assert mgr.wait_drained(None, 5) and mgr.footprint(2) == ()


def test_failure_exception_after_an_early_clear_says_so(mgr: KVManager) -> None:
    s = NixlKVSender(mgr, 3, [SESSION], [make_transfer_info(SESSION, range(2))])
    s.clear()
    with pytest.raises(KVTransferError, match="cleared before") as info:
        s.failure_exception()
    assert not info.value.is_from_another_rank


def test_an_empty_chunk_is_refused_unless_it_is_the_last(mgr: KVManager) -> None:
    s = NixlKVSender(mgr, 4, [SESSION], [make_transfer_info(SESSION, range(2))])
    s.init(2)
    with pytest.raises(ValueError, match="empty chunk"):
        s.send([])
    assert mgr.stats().chunks_submitted == 0  # no chunk index used up, nothing queued
    s.send([0, 1])
    assert _wait(s) is KVPoll.Success
    s.clear()
    empty = NixlKVSender(mgr, 5, [SESSION], [make_transfer_info(SESSION, range(2))])
    empty.init(0)
    empty.send([])  # a room of 0 pages: the empty chunk is its last
    assert _wait(empty) is KVPoll.Success
    empty.clear()


@pytest.mark.parametrize(
    ("kw", "exc"),
    [
        ({"transfer_timeout_s": 0}, ValueError),
        ({"transfer_timeout_s": math.nan}, ValueError),
        ({"transfer_timeout_s": 10**400}, ValueError),
        ({"transfer_timeout_s": "5"}, TypeError),
        ({"slot_timeout_s": -1}, ValueError),
        ({"poll_interval_s": True}, TypeError),
    ],
)
def test_manager_arguments_are_named_in_errors(
    pair: tuple[NixlTransport, NixlTransport, torch.Tensor], kw: dict[str, Any], exc: type
) -> None:
    tx, _, kv = pair
    with pytest.raises(exc, match=next(iter(kw))):
        KVManager(tx, kv, num_workers=0, **kw)


SETTINGS = (
    "transfer_timeout_s",
    "slot_timeout_s",
    "session_slots",
    "poll_interval_s",
    "kv_region",
    "staging_region",
    "fail_session_on_disconnect",
)


@pytest.mark.parametrize("name", SETTINGS)
def test_manager_settings_are_read_only(mgr: KVManager, name: str) -> None:
    """The pipeline and workers keep the settings the manager was built with, so assigning
    one afterwards would do nothing: it raises instead (a stress plant once set
    ``fail_session_on_disconnect`` on a built manager and tested nothing)."""
    before = getattr(mgr, name)
    with pytest.raises(AttributeError):
        setattr(mgr, name, before)
    assert getattr(mgr, name) == before


def _metadata(header: bytes, blob: bytes = b"x") -> bytes:
    return b"NXSTG\x01" + struct.pack(">I", len(header)) + header + blob


def _region(**over: Any) -> dict[str, Any]:
    r = {"name": "kv", "base_addr": 4096, "nbytes": 8192, "page_bytes": 4096,
         "num_pages": 2, "mem_type": "DRAM", "device_id": 0}
    r.update(over)
    return r


def test_hostile_metadata_gives_transport_param_errors() -> None:
    deep = b'{"agent":"a","regions":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    huge = b'{"agent":"a","regions":[],"n":' + b"9" * 5000 + b"}"
    two = json.dumps({"agent": "a", "regions": [_region(), _region()]}).encode()
    for header, match in [
        (deep, "bad metadata header"),
        (huge, "bad metadata header"),
        (two, "twice"),
        (json.dumps({"agent": "a", "regions": [_region(base_addr=2**63)]}).encode(), "range"),
        (json.dumps({"agent": "a", "regions": [_region(base_addr=2**63 - 4096)]}).encode(),
         "range"),
        (json.dumps({"agent": "a", "regions": [_region(device_id=2**63)]}).encode(), "range"),
    ]:
        with pytest.raises(TransportParamError, match=match):
            decode_metadata(_metadata(header))
    ok = json.dumps({"agent": "a", "regions": [_region()]}).encode()
    assert decode_metadata(_metadata(ok)).regions["kv"].num_pages == 2


def test_add_peer_with_a_mismatched_agent_name_unloads_the_agent(
    pair: tuple[NixlTransport, NixlTransport, torch.Tensor],
) -> None:
    _, rx, _ = pair
    real = decode_metadata(rx.metadata())
    lying = json.dumps(
        {"agent": "someone-else", "regions": [r.to_json() for r in real.regions.values()]}
    ).encode()
    with NixlTransport("bad-input-tx2") as tx2:
        with pytest.raises(TransportParamError, match="NIXL loaded"):
            tx2.add_peer("s", _metadata(lying, real.agent_blob))
        # The remote agent NIXL loaded for the failed call is unloaded again.
        assert not tx2._agent.check_remote_metadata(real.agent_name)
        tx2.add_peer("s", rx.metadata())
        assert tx2._agent.check_remote_metadata(real.agent_name)
        assert tx2.has_peer("s")


def test_write_and_wait_arguments(pair: tuple[NixlTransport, NixlTransport, torch.Tensor]) -> None:
    tx, _, _ = pair
    with pytest.raises(TransportParamError, match="too large"):
        tx.write_pages(SESSION, [0], [0], timeout_s=10**400)
    x = tx.write_pages(SESSION, [0], [0])
    try:
        with pytest.raises(ValueError, match="timeout_s"):
            x.wait(timeout_s=math.nan)
        with pytest.raises(ValueError, match="interval_s"):
            x.wait(5, interval_s=-1)
        with pytest.raises(TypeError, match="timeout_s"):
            x.wait(timeout_s="1")  # type: ignore[arg-type]
        x.wait(5)
    finally:
        x.release()


def _peer_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run ``python -m stress.harness.peer``'s entry point in-process (argument errors exit before
    anything starts); returns (exit status, stdout, stderr)."""
    from stress.harness.peer import main

    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def test_peer_cli_bad_arguments_give_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for args, match in [
        (("--pages", "0", "--page-bytes", "4096"), "--pages: must be >= 1"),
        (("--pages", "4", "--page-bytes", "x"), "--page-bytes: not an integer"),
        (("--pages", "4", "--page-bytes", "4096", "--listen", "127.0.0.1:x"), "bad port"),
    ]:
        code, _, err = _peer_cli(capsys, *args)
        assert code == 2 and "Traceback" not in err and match in err, err
    if not torch.cuda.is_available():
        code, _, err = _peer_cli(capsys, "--pages", "4", "--page-bytes", "4096", "--device", "cuda")
        assert code == 2 and "--device 'cuda' is not usable here" in err, err
    code, out, _ = _peer_cli(capsys, "--help")
    help_text = " ".join(out.split())
    assert code == 0
    assert "LISTENING 127.0.0.1:<port>" in help_text and "(default: cpu)" in help_text


def test_integer_like_room_ids_are_accepted_as_plain_ints(mgr: KVManager) -> None:
    """THREADING.md, "Key types": KVManager and NixlKVSender take what ``operator.index``
    takes (``numpy.int64``), as StagingContext does, and use the plain ``int``; never a
    ``bool``, never 2**63 or more."""
    import numpy as np

    s = NixlKVSender(mgr, np.int64(120), [SESSION], [make_transfer_info(SESSION, range(2))])
    assert s.handle.room == 120 and type(s.handle.room) is int
    assert mgr.status(np.int64(120)) is not None and mgr.footprint(np.int32(120))
    s.init(np.int64(2))
    s.send([7, 8])
    assert _wait(s) is KVPoll.Success
    s.clear()
    for bad, exc in ((True, TypeError), (np.uint64(2**63), ValueError)):
        with pytest.raises(exc):
            NixlKVSender(mgr, bad, [SESSION])


def conclude_fast(s: NixlKVSender, timeout_s: float) -> KVPoll:
    return polling.conclude(s, timeout_s, interval_s=0.0005)


def threads_named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


def _manager(sp: SenderPool, **kw: Any) -> KVManager:
    return KVManager(sp.transport, sp.pool, **kw)


NP_NUM_PAGES = 64


NP_PAGE_BYTES = 1024


@pytest.fixture(scope="module")
def numpy_pair() -> Iterator[tuple[NixlTransport, NixlTransport, Any]]:
    kv = torch.randint(0, 256, (NP_NUM_PAGES, NP_PAGE_BYTES), dtype=torch.uint8)
    dst = torch.zeros((NP_NUM_PAGES, NP_PAGE_BYTES), dtype=torch.uint8)
    with NixlTransport("new-user-tx") as tx, NixlTransport("new-user-rx") as rx:
        tx.register_region("kv", kv, NP_PAGE_BYTES)
        rx.register_region("kv", dst, NP_PAGE_BYTES)
        tx.add_peer(SESSION, rx.metadata())
        yield tx, rx, kv


@pytest.fixture
def numpy_mgr(numpy_pair: tuple[NixlTransport, NixlTransport, Any]) -> Iterator[KVManager]:
    tx, _, kv = numpy_pair
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


@pytest.mark.timeout(30)
@pytest.mark.parametrize("workers", [0, 1])
def test_short_info_after_init_is_refused_and_fails_the_room(rig: Rig, workers: int) -> None:
    """``init(8)`` first, then the bootstrap thread brings an info with 4 destination pages.
    It must be refused (ValueError, nothing stored), the room Failed and reported with a
    KVTransferError, nothing left. At 8343a9b the info was accepted.

    Found by the audit of issue 9 (defect d8, at 8343a9b).
    """
    with KVManager(rig.tx, rig.kv, num_workers=workers) as mgr:
        s = NixlKVSender(mgr, 8, [SCRIPTED_SESSION])
        s.init(8)
        with pytest.raises(ValueError):
            mgr.add_transfer_info(s.handle, make_transfer_info(SCRIPTED_SESSION, range(4)))
        assert 8 not in mgr.transfer_infos
        assert mgr.status(8) is KVPoll.Failed
        assert s.poll() is KVPoll.Failed
        with pytest.raises(KVTransferError):
            s.failure_exception()
        assert mgr.footprint(8) == ()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("workers", [0, 1])
def test_send_after_a_short_info_fails_cleanly(rig: Rig, workers: int) -> None:
    """The scheduler goes on after the bootstrap thread's short info (whatever it did with
    the error): ``send`` must not raise, nothing may be posted, the room must conclude
    Failed and report a KVTransferError. At 8343a9b inline ``send`` raised (the room stayed
    Transferring); with workers it failed as an internal worker error.

    Found by the audit of issue 9 (defect d8, at 8343a9b).
    """
    with KVManager(rig.tx, rig.kv, num_workers=workers) as mgr:
        s = NixlKVSender(mgr, 9, [SCRIPTED_SESSION])
        s.init(8)
        with contextlib.suppress(ValueError):  # the bootstrap thread logs it; we go on
            mgr.add_transfer_info(s.handle, make_transfer_info(SCRIPTED_SESSION, range(4)))
        started = rig.tx.stats().transfers_started
        s.send(np.arange(8))
        assert conclude(s, 5) is KVPoll.Failed
        with pytest.raises(KVTransferError):
            s.failure_exception()
        assert rig.tx.stats().transfers_started == started
        assert mgr.stats().worker_errors == 0
        assert mgr.footprint(9) == ()
        assert mgr.stats().open_rooms == 0


@pytest.mark.timeout(30)
def test_room_id_bound_refused_at_entry_naming_it(sessions_rig: SessionsRig) -> None:
    """A room id >= 2**63 is refused at entry (nothing opened); a 4,300-digit one too, with
    a message that can be formatted. On 3a76f2e both were accepted (the room then never
    concluded, or its notice was over the decode side's limit).

    Found by the audit of issue 25 (section 1, defect 2, at 3a76f2e).
    """
    with KVManager(sessions_rig.tx, sessions_rig.kv, num_workers=0) as mgr:
        with pytest.raises(ValueError, match=r"room must be < 2\*\*63, got 9223372036854775808"):
            mgr.open_room(2**63, [A])
        with pytest.raises(ValueError, match=r"an int of \d+ bits"):
            NixlKVSender(mgr, 10**4300, [A], [make_transfer_info(A, [0])])
        with pytest.raises(ValueError, match="room"):
            StagingContext().open_room(10**480)
        assert mgr.stats().rooms_opened == 0
        # The largest id works end to end, and its notice decodes at the decode side.
        s = one_session_sender(mgr, 2**63 - 1, [0, 1])
        s.send([3, 4])
        assert conclude(s, 10.0) is KVPoll.Success
        s.clear()
    big = RoomNotice(2**63 - 1, 2**63 - 1, "failed", "peer-failed").encode()
    assert len(big) <= MAX_NOTICE_BYTES
    assert decode_notice(big).room == 2**63 - 1


@pytest.mark.timeout(30)
def test_chunk_index_bound(sessions_rig: SessionsRig) -> None:
    """Found by the audit of issue 25 (section 1, defect 2, at 3a76f2e)."""
    with KVManager(sessions_rig.tx, sessions_rig.kv, num_workers=0) as mgr:
        s = one_session_sender(mgr, 1, [0, 1])
        with pytest.raises(ValueError, match="chunk_idx"):
            mgr.submit_chunk(s.handle, 2**63, 0, np.array([3, 4]), True)
        assert mgr.stats().chunks_submitted == 0
        s.clear()


@pytest.mark.timeout(30)
def test_chunk_larger_than_a_slot_is_a_value_error_at_send(sessions_rig: SessionsRig) -> None:
    """On 3a76f2e the send was accepted and the room failed as an internal error.

    Found by the audit of issue 25 (section 1, defect 5, at 3a76f2e).
    """
    pool = sessions_rig.with_pool(2, 2)
    with KVManager(sessions_rig.tx, sessions_rig.kv, num_workers=0, staging_pool=pool) as mgr:
        s = one_session_sender(mgr, 1, [0, 1, 2, 3])
        with pytest.raises(ValueError, match="a staging slot holds 2"):
            s.send([10, 11, 12, 13])
        st = mgr.stats()
        assert st.chunks_submitted == 0 and st.rooms_failed == 0 and st.worker_errors == 0
        assert mgr.handle_status(s.handle) is KVPoll.WaitingForInput
        s.send([10, 11])  # the sender's state did not move either
        s.send([12, 13])
        assert conclude(s, 10.0) is KVPoll.Success
        assert torch.equal(sessions_rig.dst[0:4], sessions_rig.kv[10:14])
        s.clear()
        # A chunk whose pages past the decode prefix fit a slot is fine.
        p = one_session_sender(mgr, 2, [0, 1, 2, 3], decode_prefix_len=2)
        p.send([10, 11, 12, 13])
        assert conclude(p, 10.0) is KVPoll.Success
        p.clear()


@pytest.mark.timeout(30)
def test_pool_of_another_page_size_is_refused(sessions_rig: SessionsRig) -> None:
    """A pool with larger pages than the KV pool's: refused at construction. A pool with
    smaller pages: a session that would stage whole pages into it is refused when its info
    is added (nothing changes). On 3a76f2e both were accepted and the room failed as an
    internal error at its first send.

    Found by the audit of issue 25 (section 1, defect 5, at 3a76f2e).
    """
    big = StagingBufferPool(1, 4, 2 * SESSIONS_PAGE_BYTES)
    made: list[KVManager] = []
    try:
        with pytest.raises(ValueError, match="page_bytes"):
            made.append(
                KVManager(sessions_rig.tx, sessions_rig.kv, num_workers=0, staging_pool=big)
            )
    finally:
        for m in made:  # accepted (the old code): closed, so that no thread leaks
            m.close()
    half = sessions_rig.with_pool(1, 4, SESSIONS_PAGE_BYTES // 2)
    with KVManager(sessions_rig.tx, sessions_rig.kv, num_workers=0, staging_pool=half) as mgr:
        h = mgr.open_room(1, [A])
        with pytest.raises(ValueError, match="page_bytes is 2048"):
            mgr.add_transfer_info(h, make_transfer_info(A, [0, 1]))
        assert mgr.handle_status(h) is KVPoll.Bootstrapping
        assert mgr.transfer_infos == {}
        with pytest.raises(ValueError, match="ends past a KV page"):
            mgr.add_transfer_info(
                h,
                make_transfer_info(
                    A, [0, 1], byte_range=(SESSIONS_PAGE_BYTES - 1, SESSIONS_PAGE_BYTES // 2)
                ),
            )
        assert mgr.add_transfer_info(
            h, make_transfer_info(A, [0, 1], byte_range=(0, SESSIONS_PAGE_BYTES // 2))
        )
        mgr.purge_room(h)
        assert mgr.stats().rooms_failed == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("timeout_s", "exc"), [(-1.0, ValueError), (math.nan, ValueError), ("1", TypeError)]
)
def test_bad_close_timeout_changes_nothing(
    sender_pool: SenderPool, timeout_s: Any, exc: type[Exception]
) -> None:
    """A bad ``close`` timeout raises before anything changes: rooms stay open, workers run.

    Found by the audit of issue 16, under load (defect 2, at 668dd63).
    """
    mgr = _manager(sender_pool, num_workers=1)
    try:
        handle = mgr.open_room(7, ["d0"])
        with pytest.raises(exc):
            mgr.close(timeout_s)
        assert mgr.is_open(handle)
        assert all(w.is_alive() for w in mgr._workers)
        mgr.open_room(8, ["d0"])  # not closing
    finally:
        mgr.close()


@pytest.mark.timeout(60)
def test_poll_interval_past_the_deadline_is_refused(sender_pool: SenderPool) -> None:
    """``poll_interval_s=1e10`` is refused by the constructor, before any thread starts. At
    668dd63 it was accepted; ``time.sleep(1e10)`` then overflowed in a worker, which
    abandoned its posted chunk.

    Found by the audit of issue 16, under load (defect 2, at 668dd63).
    """
    before = len(threads_named("kv-"))
    with pytest.raises(ValueError, match="poll_interval_s"):
        _manager(sender_pool, num_workers=1, poll_interval_s=1e10, transfer_timeout_s=30)
    assert len(threads_named("kv-")) == before
    _manager(sender_pool, num_workers=0, poll_interval_s=30.0, transfer_timeout_s=30).close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "pages", [[5, 6, 5, 7], [5, 5], [9, 1, 4, 1], np.array([3, 2, 3], dtype=np.int32)]
)
def test_repeated_destination_pages_are_refused(pages: Any) -> None:
    """A repeat anywhere in a session's destination pages is a ValueError when the info is
    made, whatever the chunking later. At 668dd63 ``make_transfer_info`` accepted it: sent
    in two chunks, the room reported Success with decode page 5 holding the wrong page.

    Found by the audit of issue 16, under load (defect 3, at 668dd63).
    """
    with pytest.raises(ValueError, match="repeats page"):
        make_transfer_info("d", pages)


@pytest.mark.timeout(120)
def test_unaddressable_destination_page_is_refused() -> None:
    """Found by the audit of issue 16, under load (defect 3, at 668dd63)."""
    with pytest.raises(ValueError, match="2\\*\\*31"):
        make_transfer_info("d", [1, 2**31])


@pytest.mark.timeout(60)
def test_a_built_info_with_repeats_is_refused_and_changes_nothing(
    sender_pool: SenderPool,
) -> None:
    """An info built directly (bypassing ``make_transfer_info``) is checked when added: a
    repeat is a ValueError and the room is unchanged.

    Found by the audit of issue 16, under load (defect 3, at 668dd63).
    """
    with _manager(sender_pool, num_workers=0) as mgr:
        handle = mgr.open_room(3, ["d"])
        arr = np.array([5, 6, 5, 7], dtype=np.int64)
        with pytest.raises(ValueError, match="repeats page"):
            mgr.add_transfer_info(handle, TransferInfo("d", arr))
        assert mgr.status(3) is KVPoll.Bootstrapping
        assert 3 not in mgr.transfer_infos


@pytest.mark.timeout(60)
def test_two_chunks_never_write_one_decode_page_twice(
    sender_pool: SenderPool, decode_peer: Any
) -> None:
    """The audit's reproduction: ``[5, 6, 5, 7]`` in two chunks. It cannot get past the
    info any more; the same room with distinct pages lands byte-exact.

    Found by the audit of issue 16, under load (defect 3, at 668dd63).
    """
    tx = sender_pool.transport
    tx.add_peer("d", decode_peer.metadata())
    with pytest.raises(ValueError):
        make_transfer_info("d", [5, 6, 5, 7])
    with _manager(sender_pool, num_workers=0) as mgr:
        s = NixlKVSender(mgr, 4, ["d"], [make_transfer_info("d", [5, 6, 8, 7])])
        s.init(4)
        s.send([0, 1])
        s.send([2, 3])
        assert conclude_fast(s, 30) is KVPoll.Success
        assert decode_peer.read_pages([5, 6, 8, 7]) == sender_pool.page_bytes_of([0, 1, 2, 3])
        s.clear()


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(60)
def test_the_sender_takes_numpy_integers(numpy_mgr: KVManager) -> None:
    """Found by issue 25, section 2 (what a new user trips on)."""
    info = make_transfer_info(SESSION, np.arange(4, dtype=np.uint16))
    s = NixlKVSender(numpy_mgr, np.int64(4), [SESSION], [info])
    assert type(s.bootstrap_room) is int and s.bootstrap_room == 4
    s.init(np.int64(4), aux_index=np.int32(0))
    assert type(s.num_kv_indices) is int and type(s.aux_index) is int
    s.send(np.array([1, 2], dtype=np.uint32))
    s.send([np.int64(3), np.uint8(4)])
    assert _conclude(s) is KVPoll.Success
    assert numpy_mgr.status(np.int64(4)) is KVPoll.Success
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
    numpy_mgr: KVManager, pages: Any, message: str
) -> None:
    """Found by issue 25, section 2 (what a new user trips on)."""
    s = NixlKVSender(numpy_mgr, 7, [SESSION], [make_transfer_info(SESSION, range(8))])
    s.init(4)
    with pytest.raises(ValueError, match=message):
        s.send(pages)
    assert numpy_mgr.stats().chunks_submitted == 0  # refused before any state change
    s.clear()


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(60)
def test_too_many_pages_says_would_be(numpy_mgr: KVManager) -> None:
    """Found by issue 25, section 2 (what a new user trips on)."""
    s = NixlKVSender(numpy_mgr, 8, [SESSION], [make_transfer_info(SESSION, range(8, 12))])
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
def test_refused_sender_leaves_nothing_behind(numpy_mgr: KVManager) -> None:
    """An info for a session the sender does not name is a ValueError before the room
    opens: no room opened, cleared or noticed, and the id is free.

    Found by issue 25, section 2 (what a new user trips on).
    """
    before = numpy_mgr.stats()
    bad = make_transfer_info("someone-else", range(4))
    with pytest.raises(ValueError, match="'someone-else' is not a session of room 9"):
        NixlKVSender(numpy_mgr, 9, [SESSION], [bad])
    with pytest.raises(TypeError, match="TransferInfo"):
        NixlKVSender(numpy_mgr, 9, [SESSION], ["not an info"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="reach page 99"):
        NixlKVSender(numpy_mgr, 9, [SESSION], [make_transfer_info(SESSION, [1, 99])])
    after = numpy_mgr.stats()
    assert (after.rooms_opened, after.rooms_cleared, after.purges, after.notices_queued) == (
        before.rooms_opened,
        before.rooms_cleared,
        before.purges,
        before.notices_queued,
    )
    assert numpy_mgr.footprint(9) == ()
    s = NixlKVSender(numpy_mgr, 9, [SESSION], [make_transfer_info(SESSION, range(4))])  # id free
    s.clear()


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(60)
def test_bad_configuration_is_refused_at_construction(
    numpy_pair: tuple[NixlTransport, NixlTransport, Any],
) -> None:
    """Found by issue 25, section 2 (what a new user trips on)."""
    tx, _, kv = numpy_pair
    with pytest.raises(ValueError, match=r"kv_region 'nope' is not registered .*\['kv'\]"):
        KVManager(tx, kv, kv_region="nope")
    with pytest.raises(ValueError, match=r"kv_pool is \[32, 1024\] .* region 'kv' has 64 pages"):
        KVManager(tx, kv[:32])
    other = torch.zeros((NP_NUM_PAGES, NP_PAGE_BYTES), dtype=torch.uint8)
    with pytest.raises(ValueError, match="not the tensor registered as region 'kv'"):
        KVManager(tx, other)
    from staging.buffers import StagingBufferPool

    pool = StagingBufferPool(num_slots=2, slot_pages=4, page_bytes=NP_PAGE_BYTES)
    with pytest.raises(ValueError, match="staging_region 'staging' is not registered"):
        KVManager(tx, kv, staging_pool=pool)
    closed = NixlTransport("new-user-closed")
    closed.register_region("kv", other, NP_PAGE_BYTES)
    closed.close()
    with pytest.raises(ValueError, match="new-user-closed' closed> is closed"):
        KVManager(closed, other)


def _handle_methods() -> list[str]:
    """Every public ``KVManager`` method that takes a room handle (found, so new ones join)."""
    return sorted(
        name
        for name, fn in inspect.getmembers(KVManager, inspect.isfunction)
        if not name.startswith("_") and "handle" in inspect.signature(fn).parameters
    )


_FILLER: dict[str, Any] = {
    "info": make_transfer_info("d0", range(1)), "num_kv_indices": 1, "chunk_idx": 0,
    "start": 0, "kv_indices": np.array([0]), "is_last": True, "exc": None, "reason": "r",
    "timeout_s": 0.01,
}


@pytest.mark.parametrize("bad", ["7", (7, 1), 7], ids=["str", "plain-tuple", "int"])
@pytest.mark.parametrize("method", _handle_methods())
def test_a_non_handle_is_refused_with_type_error_and_changes_nothing(method: str, bad: Any) -> None:
    """Each method taking a handle refuses anything but a ``RoomHandle`` (a plain tuple equal
    to one included) with a ``TypeError`` naming it, before any state changes."""
    mgr = _stub_manager(StubTransport())
    handle = mgr.open_room(7, ["d0"])
    fn = getattr(mgr, method)
    params = list(inspect.signature(fn).parameters)[1:]
    before = mgr.stats()
    with pytest.raises(TypeError, match="RoomHandle"):
        fn(bad, *(_FILLER[p] for p in params))
    assert mgr.stats() == before
    assert mgr.handle_status(handle) is KVPoll.Bootstrapping
