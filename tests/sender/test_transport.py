"""NixlTransport with real NIXL agents: data integrity, handle guards, threads, idle CPU,
input validation and lifecycle. Peer-failure tests live in tests/e2e/test_peer_faults.py."""

from __future__ import annotations

import contextlib
import gc
import random
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from sender import _nixl
from sender.errors import (
    TRANSPORT_ERRORS,
    KVTransferError,
    PeerNotFoundError,
    RegionRetiredError,
    TransferFailedError,
    TransferReleasedError,
    TransferTimeoutError,
    TransportClosedError,
    TransportParamError,
    as_param_error,
    classify,
)
from sender.transport import NixlTransport, decode_metadata
from stress.harness.faults import nixl_error
from tests.fixtures_nixl import NUM_PAGES, PAGE_BYTES, SenderPool, requires_nixl
from tests.sender._sessions import A, SessionsRig

pytestmark = [pytest.mark.nixl, requires_nixl]


def _connect(sp: SenderPool, peer: Any, session: str = "peer") -> None:
    md = peer.metadata() if callable(peer.metadata) else peer.metadata
    sp.transport.add_peer(session, md)


def _random_pairs(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    src = rng.choice(NUM_PAGES, n, replace=False)
    dst = rng.choice(NUM_PAGES, n, replace=False)
    return src, dst


# --------------------------------------------------------------------------- errors module


@pytest.mark.timeout(10)
def test_error_classes() -> None:
    b = _nixl.bindings
    assert b is not None
    for cls in (b.nixlRemoteDisconnectError, b.nixlBackendError, b.nixlCancelledError,
                b.nixlNotFoundError):
        assert cls in TRANSPORT_ERRORS
        assert not issubclass(cls, RuntimeError)  # why `except RuntimeError` is wrong
        assert classify(cls("NIXL_ERR_X"))
    for ours in (TransferTimeoutError("s", 1.0), TransferFailedError("x"), PeerNotFoundError("s"),
                 TransportClosedError("x")):
        assert classify(ours)
    assert not classify(TransferReleasedError("x"))
    assert not classify(TransportParamError("x"))
    assert not classify(b.nixlInvalidParamError("NIXL_ERR_INVALID_PARAM"))
    conv = as_param_error(b.nixlInvalidParamError("NIXL_ERR_INVALID_PARAM"), "bad descs")
    assert isinstance(conv, TransportParamError) and isinstance(conv, ValueError)
    assert "NIXL_ERR_INVALID_PARAM" in str(conv) and conv.status == "NIXL_ERR_INVALID_PARAM"
    assert as_param_error(b.nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT"), "x") is None
    err = KVTransferError(7, "peer died")
    assert str(err) == "KV transfer failed for room 7: peer died"
    assert isinstance(err, RuntimeError) and not err.is_from_another_rank
    t = TransferTimeoutError("sess", 0.5)
    assert t.session_id == "sess" and t.timeout_s == 0.5


# --------------------------------------------------------------------------- data


@pytest.mark.timeout(30)
@pytest.mark.parametrize("coalesce", [True, False])
def test_in_process_random_pages(sender_pool: SenderPool, decode_peer: Any, coalesce: bool) -> None:
    _connect(sender_pool, decode_peer)
    rng = np.random.default_rng(7)
    for round_ in range(3):
        src, dst = _random_pairs(rng, 100)
        if round_ == 2:  # a run consecutive on both sides (one descriptor) amid scattered pages
            run_dst = np.arange(30, 60)
            rest = rng.choice(np.setdiff1d(np.arange(NUM_PAGES), run_dst), 70, replace=False)
            dst = np.concatenate([rest[:10], run_dst, rest[10:]])
            src = np.concatenate([src[:10], np.arange(200, 230), src[10:70]])
        msg = f"round-{round_}-{coalesce}".encode()
        xfer = sender_pool.transport.write_pages(
            "peer", src, dst, msg, coalesce=coalesce, timeout_s=10
        )
        assert xfer.num_pages == len(src) and xfer.nbytes == len(src) * PAGE_BYTES
        xfer.wait(timeout_s=10)
        assert xfer.done and xfer.poll() == "DONE"
        xfer.release()
        assert xfer.released
        got = decode_peer.pool[torch.from_numpy(dst)]
        want = sender_pool.pool[torch.from_numpy(src)]
        assert torch.equal(got, want), f"round {round_}: bytes differ"
        assert decode_peer.wait_notif(msg, 5.0)
    assert decode_peer.notifs()[sender_pool.transport.name][-1] == msg
    st = sender_pool.transport.stats()
    assert (st.transfers_started, st.transfers_done, st.live_transfers) == (3, 3, 0)


@pytest.mark.timeout(30)
def test_python_int_lists_and_numpy_scalars(sender_pool: SenderPool, decode_peer: Any) -> None:
    _connect(sender_pool, decode_peer)
    src = [5, 6, 7, np.int32(100)]
    dst = [np.uint16(0), 1, 2, 255]
    x = sender_pool.transport.write_pages("peer", src, dst)
    x.wait(10)
    x.release()
    assert decode_peer.read_pages(dst) == sender_pool.page_bytes_of([int(s) for s in src])


@pytest.mark.timeout(60)
def test_cross_process_random_pages(sender_pool: SenderPool, peer_process: Any) -> None:
    _connect(sender_pool, peer_process)
    rng = np.random.default_rng(11)
    src, dst = _random_pairs(rng, 200)
    x = sender_pool.transport.write_pages("peer", src, dst, b"xproc", timeout_s=10)
    x.wait(10)
    x.release()
    assert peer_process.page_digest(dst) == sender_pool.digests(src)
    assert peer_process.read_pages(dst[:16]) == sender_pool.page_bytes_of(src[:16])
    assert peer_process.wait_notif(b"xproc", 5.0)
    # Pages that were not written stay zero.
    untouched = sorted(set(range(NUM_PAGES)) - set(dst.tolist()))[:8]
    assert peer_process.read_pages(untouched) == bytes(8 * PAGE_BYTES)
    # A second write overwrites; zeroing from the client works.
    peer_process.zero_pages(dst[:4])
    assert peer_process.read_pages(dst[:4]) == bytes(4 * PAGE_BYTES)


@pytest.mark.timeout(30)
def test_small_writes_one_after_another(sender_pool: SenderPool, decode_peer: Any) -> None:
    """100 single-page writes, each waited for and released, land byte-exact. Their latency
    is printed, not asserted (speed is measured by ``python -m bench throughput``)."""
    _connect(sender_pool, decode_peer)
    lat = []
    for i in range(100):
        t0 = time.perf_counter()
        x = sender_pool.transport.write_pages("peer", [i], [i])
        x.wait(5)
        lat.append(time.perf_counter() - t0)
        x.release()
    print(f"4 KiB write + wait: median {np.median(lat) * 1e3:.3f} ms")
    assert decode_peer.read_pages(list(range(100))) == sender_pool.page_bytes_of(range(100))
    assert sender_pool.transport.stats().live_transfers == 0


# --------------------------------------------------------------------------- handle guards


@pytest.mark.timeout(30)
def test_handle_guards(sender_pool: SenderPool, decode_peer: Any) -> None:
    _connect(sender_pool, decode_peer)
    tr = sender_pool.transport
    x = tr.write_pages("peer", [1, 2], [3, 4])
    x.wait(5)
    x.release()
    assert x.released
    x.release()  # double release: no-op, no second NIXL call (NIXL itself would SIGSEGV)
    assert tr.stats().transfers_released == 1
    with pytest.raises(TransferReleasedError):
        x.poll()
    with pytest.raises(TransferReleasedError):
        x.wait(1)
    # Releasing while still pending is allowed (data may still land).
    y = tr.write_pages("peer", list(range(64)), list(range(64)))
    y.release()
    y.release()
    st = tr.stats()
    assert st.live_transfers == 0 and st.transfers_released == 2


@pytest.mark.timeout(30)
def test_poll_release_race_four_threads(
    sender_pool: SenderPool,
    decode_peer: Any,
    thread_excepthook: list[threading.ExceptHookArgs],
) -> None:
    """4 threads post, poll and release transfers, including each other's, for 2 s.

    With NIXL's default sync mode (NIXL_THREAD_SYNC_NONE) this crashes the process with
    SIGSEGV; NixlTransport uses NIXL_THREAD_SYNC_STRICT plus a per-transfer lock, which also
    makes poll-vs-release of the same handle and double release impossible.
    """
    _connect(sender_pool, decode_peer)
    tr = sender_pool.transport
    shared: list[Any] = []
    shared_lock = threading.Lock()
    stop = threading.Event()
    barrier = threading.Barrier(4)
    counts = [0] * 4

    def worker(k: int) -> None:
        rng = random.Random(k)
        barrier.wait()
        while not stop.is_set():
            op = rng.random()
            if op < 0.35:
                n = rng.randint(1, 8)
                start = rng.randrange(0, NUM_PAGES - n)
                x = tr.write_pages("peer", range(start, start + n), range(start, start + n))
                with shared_lock:
                    shared.append(x)
            else:
                with shared_lock:
                    x = rng.choice(shared) if shared else None
                if x is None:
                    continue
                if op < 0.75:
                    with contextlib.suppress(TransferReleasedError):
                        x.poll()
                else:
                    x.release()
                    x.release()
                    with shared_lock, contextlib.suppress(ValueError):
                        shared.remove(x)
            counts[k] += 1

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert not thread_excepthook, [a.exc_value for a in thread_excepthook]
    assert all(c > 10 for c in counts), counts
    for x in shared:
        x.release()
    st = tr.stats()
    assert st.live_transfers == 0
    assert st.transfers_failed == 0 and st.transfers_timed_out == 0


# --------------------------------------------------------------------------- idle CPU


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_idle_cpu_below_5_percent(nixl_required: None) -> None:
    """A transport with a registered pool, idle for 2 s, costs < 5 % of one core.

    (NIXL's stock config spins its progress thread: 100 % of a core per agent.)
    """
    gc.collect()
    pool = torch.zeros((1024, 16384), dtype=torch.uint8)
    with NixlTransport() as tr:
        tr.register_region("kv", pool, 16384)
        time.sleep(0.2)  # let start-up work settle
        c0, w0 = time.process_time(), time.monotonic()
        time.sleep(2.0)
        cpu = (time.process_time() - c0) / (time.monotonic() - w0)
    assert cpu < 0.05, f"idle transport used {cpu:.1%} of a core"


# --------------------------------------------------------------------------- bad input


class _NoNixlAgent:
    """Stands in for the NIXL agent: any transfer-creating call fails the test."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.calls.append(name)
        raise AssertionError(f"NIXL touched: {name}")


_BAD_WRITES: list[tuple[str, Any, Any, dict[str, Any]]] = [
    ("src out of range", [0, NUM_PAGES], [0, 1], {}),
    ("dst out of range", [0, 1], [0, NUM_PAGES + 5], {}),
    ("negative", [-1], [0], {}),
    ("length mismatch", [0, 1, 2], [0, 1], {}),
    ("bool index", [True], [0], {}),
    ("bool amid ints", [0, False], [0, 1], {}),
    ("bool array", np.array([True, False]), [0, 1], {}),
    ("numpy bool scalar", [0], [np.bool_(True)], {}),
    ("float", [1.0], [0], {}),
    ("float array", np.array([1.0]), [0], {}),
    ("2-D array", np.zeros((2, 2), dtype=np.int64), [0, 1], {}),
    ("string", "01", [0, 1], {}),
    ("no pages", [], [], {}),
    ("duplicate destination", [0, 1], [5, 5], {}),
    ("overflow", [2**70], [0], {}),
    ("uint64 overflow", np.array([2**63], dtype=np.uint64), [0], {}),
    ("unknown src region", [0], [0], {"src_region": "nope"}),
    ("unknown dst region", [0], [0], {"dst_region": "nope"}),
    ("zero timeout", [0], [0], {"timeout_s": 0}),
    ("nan timeout", [0], [0], {"timeout_s": float("nan")}),
    ("str notif", [0], [0], {"notif": "str"}),
    ("empty notif", [0], [0], {"notif": b""}),
]


@pytest.mark.timeout(30)
def test_bad_input_never_reaches_nixl(sender_pool: SenderPool, decode_peer: Any) -> None:
    """Every malformed write raises TransportParamError before any NIXL call."""
    tr = sender_pool.transport
    _connect(sender_pool, decode_peer)
    # Both the wrapper and the binding agent that transfers go through directly.
    real, real_ops = tr._agent, tr._xfer_agent
    spy, ops_spy = _NoNixlAgent(real), _NoNixlAgent(real_ops)
    tr._agent, tr._xfer_agent = spy, ops_spy
    try:
        for what, src, dst, kw in _BAD_WRITES:
            with pytest.raises(TransportParamError):
                tr.write_pages("peer", src, dst, **kw)
                pytest.fail(f"no error for {what}")
    finally:
        tr._agent, tr._xfer_agent = real, real_ops
    assert spy.calls == [] and ops_spy.calls == []
    st = tr.stats()
    assert st.transfers_started == 0 and st.live_transfers == 0
    # The transport is still usable afterwards.
    x = tr.write_pages("peer", [0], [0])
    x.wait(5)
    x.release()


@pytest.mark.timeout(30)
def test_unknown_session_and_page_size_mismatch(sender_pool: SenderPool, decode_peer: Any) -> None:
    tr = sender_pool.transport
    with pytest.raises(PeerNotFoundError) as ei:
        tr.write_pages("nobody", [0], [0])
    assert classify(ei.value) and ei.value.session_id == "nobody"
    _connect(sender_pool, decode_peer)
    staging = torch.zeros((8, 2 * PAGE_BYTES), dtype=torch.uint8)
    tr.register_region("staging", staging, 2 * PAGE_BYTES)
    with pytest.raises(TransportParamError, match="page size"):
        tr.write_pages("peer", [0], [0], src_region="staging")
    with pytest.raises(TransportParamError):
        tr.register_region("staging", staging, PAGE_BYTES)  # name taken
    with pytest.raises(TransportParamError):
        tr.register_region("odd", torch.zeros(100, dtype=torch.uint8), 64)  # not a multiple
    with pytest.raises(TransportParamError):
        tr.register_region("nc", torch.zeros((4, 8), dtype=torch.uint8).t(), 4)  # strided
    assert tr.stats().transfers_started == 0


# --------------------------------------------------------------------------- peers & metadata


@pytest.mark.timeout(30)
def test_metadata_and_peer_bookkeeping(sender_pool: SenderPool, decode_peer: Any) -> None:
    tr = sender_pool.transport
    meta = decode_metadata(decode_peer.metadata())
    assert meta.agent_name == decode_peer.name
    kv = meta.regions["kv"]
    assert (kv.num_pages, kv.page_bytes, kv.mem_type) == (NUM_PAGES, PAGE_BYTES, "DRAM")
    assert kv.base_addr == decode_peer.pool.data_ptr()
    for bad in (b"", b"garbage", decode_peer.metadata()[:12]):
        with pytest.raises(TransportParamError):
            tr.add_peer("x", bad)
    with pytest.raises(TransportParamError):
        tr.add_peer("self", tr.metadata())
    assert not tr.has_peer("a")
    tr.add_peer("a", decode_peer.metadata())
    tr.add_peer("b", decode_peer.metadata())  # two sessions, one remote agent
    with pytest.raises(TransportParamError):
        tr.add_peer("a", decode_peer.metadata())
    assert tr.peer_agent_name("a") == decode_peer.name
    assert tr.remove_peer("a") is True
    assert tr.remove_peer("a") is False  # idempotent
    with pytest.raises(PeerNotFoundError):
        tr.write_pages("a", [0], [0])
    # "b" still works: NIXL forgets the remote agent only with its last session.
    x = tr.write_pages("b", [3], [4])
    x.wait(5)
    x.release()
    assert tr.stats().peers == 1
    # remove_peer releases that peer's live transfers.
    y = tr.write_pages("b", [5], [6])
    tr.remove_peer("b")
    assert y.released
    with pytest.raises(TransferReleasedError):
        y.poll()


@pytest.mark.timeout(30)
def test_deregister_region_releases_its_transfers(
    sender_pool: SenderPool, decode_peer: Any
) -> None:
    tr = sender_pool.transport
    _connect(sender_pool, decode_peer)
    x = tr.write_pages("peer", [0, 1], [0, 1])
    assert tr.deregister_region("kv") is True
    assert tr.deregister_region("kv") is False
    if not x.released:  # NIXL still had it: kept (it may still read the region) until settled
        with pytest.raises(RegionRetiredError):
            x.poll()
        deadline = time.monotonic() + 10
        while not x.settled() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert x.settled()
        x.release()
    assert x.released
    with pytest.raises(TransportParamError):
        tr.write_pages("peer", [0], [0])
    assert "kv" not in tr.regions()
    assert tr.stats().live_transfers == 0


@pytest.mark.timeout(30)
def test_close_releases_everything(decode_peer: Any) -> None:
    pool = torch.arange(64 * 1024, dtype=torch.int32).view(64, -1)  # 4 KiB rows, not uint8
    tr = NixlTransport(default_timeout_s=5.0)
    tr.register_region("kv", pool, PAGE_BYTES)
    tr.add_peer("p", decode_peer.metadata())
    xs = [tr.write_pages("p", [i], [i]) for i in range(8)]
    assert tr.stats().live_transfers == 8
    tr.close()
    tr.close()  # idempotent
    assert tr.closed
    assert all(x.released for x in xs)
    with pytest.raises(TransferReleasedError):
        xs[0].poll()
    for call in (
        lambda: tr.write_pages("p", [0], [0]),
        lambda: tr.metadata(),
        lambda: tr.get_notifs(),
        lambda: tr.add_peer("q", decode_peer.metadata()),
        lambda: tr.register_region("kv2", pool, PAGE_BYTES),
    ):
        with pytest.raises(TransportClosedError):
            call()
    assert classify(TransportClosedError("x"))
    st = tr.stats()
    assert (st.live_transfers, st.peers, st.regions) == (0, 0, 0)


@pytest.mark.timeout(30)
def test_transport_context_manager_and_names(nixl_required: None) -> None:
    with NixlTransport("ctx-agent") as tr:
        assert tr.name == "ctx-agent"
        assert tr.get_notifs() == {}
        assert decode_metadata(tr.metadata()).regions == {}
    assert tr.closed
    with pytest.raises(TransportParamError):
        NixlTransport("")
    with pytest.raises(TransportParamError):
        NixlTransport(progress_delay_us=0)
    with pytest.raises(TransportParamError):
        NixlTransport(default_timeout_s=-1)


class _RefusingAgent:
    """Wraps the real NIXL binding agent; its first ``releaseXferReq`` is refused the way
    NIXL refuses to release an active transfer it cannot cancel (the handle stays valid)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.refusals = 0
        self.released: list[Any] = []

    def releaseXferReq(self, handle: Any) -> None:
        if self.refusals == 0:
            self.refusals += 1
            raise _nixl.bindings.nixlBackendError("NIXL_ERR_BACKEND")  # type: ignore[union-attr]
        self.released.append(handle)
        self._inner.releaseXferReq(handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.mark.timeout(30)
def test_refused_release_is_kept_and_retried_at_close(decode_peer: Any) -> None:
    """A release NIXL refuses is not lost: the transport keeps the handle, counts it and
    releases it once at close()."""
    tr = NixlTransport(default_timeout_s=5.0)
    pool = torch.zeros((NUM_PAGES, PAGE_BYTES), dtype=torch.uint8)
    tr.register_region("kv", pool, PAGE_BYTES)
    tr.add_peer("p", decode_peer.metadata())
    refusing = _RefusingAgent(tr._xfer_agent)
    tr._xfer_agent = refusing
    x = tr.write_pages("p", [1, 2], [1, 2])
    x.wait(5)
    x.release()  # refused by NIXL
    assert x.released  # counts as released for us: never released twice
    assert tr.stats().release_refused == 1
    gc.collect()  # nothing may release it behind our back
    assert refusing.released == []
    x.release()
    assert refusing.released == []
    tr.close()
    assert refusing.released != [] and len(refusing.released) == 1  # retried once at close


@pytest.mark.timeout(30)
def test_peer_disconnected_cleared_once_a_write_completes(sessions_rig: SessionsRig) -> None:
    """A disconnect reported by NIXL (the real agent's ``send_notif`` raising NIXL's own
    ``nixlRemoteDisconnectError`` once), then a write to the same peer completes: the peer
    is reachable, the flag is cleared (notices to it are sent again). On 3a76f2e it stayed
    set for as long as the session was added.

    Found by the audit of issue 25 (section 1, a suspicion settled by a fix, at 3a76f2e).
    """
    if _nixl.bindings is None or not hasattr(_nixl.bindings, "nixlRemoteDisconnectError"):
        pytest.skip("NIXL has no nixlRemoteDisconnectError")
    agent = sessions_rig.tx._agent
    real_send = agent.send_notif
    calls = [0]

    def flaky(name: Any, msg: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise nixl_error("nixlRemoteDisconnectError")
        return real_send(name, msg)

    agent.send_notif = flaky
    try:
        with pytest.raises(Exception, match="DISCONNECT"):
            sessions_rig.tx.send_notif(A, b"hello")
        assert sessions_rig.tx.peer_disconnected(A)
        t = sessions_rig.tx.write_pages(A, [1], [1])
        t.wait(10.0)
        t.release()
        assert not sessions_rig.tx.peer_disconnected(A)
        sessions_rig.tx.send_notif(A, b"hello again")
    finally:
        agent.send_notif = real_send


@pytest.mark.timeout(60)
def test_write_pages_racing_close_raises_transport_closed(
    sender_pool: SenderPool, decode_peer: Any
) -> None:
    """``close()`` running between ``write_pages``' lock-free look-ups: the write is refused
    as a closed transport, never as a missing region or peer. The interleaving is forced: the
    region table's ``get`` runs ``close()`` (on the writer's thread, which holds no lock
    there) before answering. At 668dd63 this raised ``TransportParamError("no local
    region")``.

    Found beside the audit of issue 16, under load (at 668dd63).
    """
    tx = sender_pool.transport
    tx.add_peer("d", decode_peer.metadata())

    class ClosingDict(dict):  # type: ignore[type-arg]
        def get(self, key: Any, default: Any = None) -> Any:
            tx.close()
            return super().get(key, default)

    tx._regions = ClosingDict(tx._regions)
    with pytest.raises(TransportClosedError):
        tx.write_pages("d", [0], [0])
    assert tx.stats().live_transfers == 0


@pytest.mark.timeout(120)
def test_write_pages_racing_close_only_ever_raises_transport_closed(
    sender_pool: SenderPool, decode_peer: Any
) -> None:
    """The same race left to the scheduler (switch interval 1e-6, 4 writers, close at a
    random moment, 20 rounds): every write either returns a transfer that close() releases
    or raises ``TransportClosedError``; nothing is left live.

    Found beside the audit of issue 16, under load (at 668dd63).
    """
    import random
    import sys

    from tests.fixtures_nixl import make_sender_pool

    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    tx0 = sender_pool.transport
    tx0.close()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(20):
            sp = make_sender_pool(64)
            tx = sp.transport
            tx.add_peer("d", decode_peer.metadata())
            wrong: list[BaseException] = []
            got: list[Any] = []
            start = threading.Barrier(5)

            def writer(
                tx: Any = tx,
                got: list[Any] = got,
                wrong: list[BaseException] = wrong,
                start: threading.Barrier = start,
            ) -> None:
                start.wait(10)
                for i in range(200):
                    try:
                        got.append(tx.write_pages("d", [i % 64], [i % 64]))
                    except TransportClosedError:
                        return
                    except BaseException as exc:
                        wrong.append(exc)
                        return

            threads = [threading.Thread(target=writer, daemon=True) for _ in range(4)]
            for t in threads:
                t.start()
            start.wait(10)
            time.sleep(rng.random() * 0.002)
            tx.close()
            for t in threads:
                t.join(30)
            assert not any(t.is_alive() for t in threads)
            assert wrong == [], f"seed {seed}: {wrong[:3]}"
            assert tx.stats().live_transfers == 0
            assert all(x.released for x in got)
    finally:
        sys.setswitchinterval(old)
