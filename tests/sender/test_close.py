"""``close()`` and ``open_room`` (docs/THREADING.md, "close() and open_room"): no room opened
while close runs survives it, close from any thread (a listener on a worker included) stops
everything, whatever its timeout or ``poll_interval_s``, and no notice is withheld."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.poll import KVPoll
from staging.context import RoomHandle
from tests import polling
from tests.fixtures_nixl import SenderPool, requires_nixl
from tests.polling import wait_until
from tests.sender._listeners import Recorder
from tests.sender._real_wrappers import HeldTransport
from tests.sender._scripted import SCRIPTED_SESSION, Rig
from tests.sender._sessions import A, SessionsRig, one_session_sender
from tests.sender._stub_transport import BOUND_S, StubTransport, _sender, _stub_manager


def _pause_open_room_at_room_lock(
    paused: threading.Event, resume: threading.Event
) -> Callable[[FrameType, str, Any], None]:
    """A profile hook: when the room table's ``open`` (``KVManager.open_room`` itself at
    8343a9b) calls a lock's ``write()`` (the room lock, after the closed check at 8343a9b),
    pause that thread until ``resume`` (<= 3 s)."""
    locks_py = os.path.join("staging", "locks.py")
    opener_files = (os.path.join("sender", "manager.py"), os.path.join("sender", "rooms.py"))

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or paused.is_set() or frame.f_code.co_name != "write":
            return
        caller = frame.f_back
        if (
            frame.f_code.co_filename.endswith(locks_py)
            and caller is not None
            and caller.f_code.co_name in ("open_room", "open")
            and caller.f_code.co_filename.endswith(opener_files)
        ):
            paused.set()
            resume.wait(3.0)

    return hook


# This file's polling cadences; tests/polling.py has the loops.
def wait_until_fast(cond: Callable[[], bool], timeout_s: float, interval_s: float = 0.002) -> bool:
    return polling.wait_until(cond, timeout_s, interval_s)


def _manager(sp: SenderPool, **kw: Any) -> KVManager:
    return KVManager(sp.transport, sp.pool, **kw)


class _SlowReleaseTransport:
    """A real transport whose transfers' ``release()`` blocks ``hold_s`` once ``armed``."""

    def __init__(self, inner: Any, hold_s: float) -> None:
        self.inner = inner
        self.hold_s = hold_s
        self.armed = threading.Event()
        self.releasing = threading.Event()

    def write_pages(self, *args: Any, **kw: Any) -> Any:
        outer = self
        real = self.inner.write_pages(*args, **kw)

        class Slow:
            def poll(self) -> str:
                return "PROC" if not outer.armed.is_set() else str(real.poll())

            def settled(self) -> bool:
                return bool(real.settled())

            def release(self) -> None:
                if outer.armed.is_set():
                    outer.releasing.set()
                    time.sleep(outer.hold_s)
                real.release()

        return Slow()

    def send_notif(self, session_id: str, message: bytes) -> None:
        self.inner.send_notif(session_id, message)


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
with KVManager(tx, kv, num_workers=2) as numpy_mgr:
    for room in range(n):
        s = NixlKVSender(numpy_mgr, room, ["decode-0"], [make_transfer_info("decode-0", range(4))])
        s.init(4)
        s.send([10, 11])
        s.abort()  # failed before Success: its decode session gets a "failed" notice
        s.clear()
sent = numpy_mgr.stats().notices_sent
tx.close()  # at once, with the notices just sent
deadline = time.monotonic() + 20  # a bound for a loaded machine, not a speed claim
while peer.notice_stats().learnt < sent and time.monotonic() < deadline:
    time.sleep(0.005)
print("sent", sent, "learnt", peer.notice_stats().learnt)
peer.close()
"""


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(30)
def test_room_opened_while_close_runs_does_not_survive_close(rig: Rig) -> None:
    """``open_room`` is paused just before it takes the room lock while ``close()`` runs to
    its end. Afterwards no room may be open (open_room raised RuntimeError, or close purged
    the room). At 8343a9b open_room had passed the closed check: the room survived close.

    Found by the audit of issue 9 (defect d7, at 8343a9b).
    """
    mgr = KVManager(rig.tx, rig.kv, num_workers=1)
    paused, resume = threading.Event(), threading.Event()
    result: list[Any] = []

    def opener() -> None:
        sys.setprofile(_pause_open_room_at_room_lock(paused, resume))
        try:
            result.append(mgr.open_room(7, [SCRIPTED_SESSION]))
        except BaseException as exc:
            result.append(exc)
        finally:
            sys.setprofile(None)

    def closer() -> None:
        try:
            mgr.close()
        finally:
            resume.set()

    t_open = threading.Thread(target=opener, daemon=True)
    t_open.start()
    try:
        assert paused.wait(5), "open_room never reached the room lock"
        t_close = threading.Thread(target=closer, daemon=True)
        t_close.start()
        t_close.join(10)
        assert not t_close.is_alive()
    finally:
        resume.set()
        t_open.join(10)
    assert not t_open.is_alive()
    assert len(result) == 1
    got = result[0]
    assert isinstance(got, (RoomHandle, RuntimeError)), repr(got)
    assert mgr.stats().open_rooms == 0, "a room survived close()"
    assert 7 not in mgr.staging.open_rooms
    assert mgr.footprint(7) == ()
    with pytest.raises(RuntimeError):
        mgr.open_room(8, [SCRIPTED_SESSION])
    mgr.close()


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(30)
@pytest.mark.usefixtures("fast_switch")
def test_close_racing_open_room_repeatedly(rig: Rig) -> None:
    """300 rounds of two threads opening rooms in a loop while the main thread closes the
    manager: after close() returns no room is open and every later open_room raises.

    Found by the audit of issue 9 (defect d7, at 8343a9b).
    """
    errors: list[BaseException] = []
    for rnd in range(300):
        mgr = KVManager(rig.tx, rig.kv, num_workers=0)
        go = threading.Barrier(3, timeout=5)

        def opener(base: int, m: KVManager = mgr, b: threading.Barrier = go) -> None:
            try:
                b.wait()
                for i in range(50):
                    m.open_room(base + i, [SCRIPTED_SESSION])
            except RuntimeError:
                pass  # closed
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=opener, args=(k * 100,), daemon=True) for k in (1, 2)]
        for t in threads:
            t.start()
        go.wait()
        mgr.close()
        survivors = mgr.stats().open_rooms
        for t in threads:
            t.join(5)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        assert survivors == mgr.stats().open_rooms == 0, f"round {rnd}: a room survived close"
        assert mgr.staging.open_rooms == frozenset()


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(60)
def test_close_from_a_listener_callback_on_a_worker(sessions_rig: SessionsRig) -> None:
    """A listener that closes the manager when a room concludes (it runs on the worker that
    ended the chunk). On 3a76f2e close() raised "cannot join current thread" half-way and
    left the notifier thread running.

    Found by the audit of issue 25 (section 1, defect 6, at 3a76f2e).
    """
    errors: list[BaseException] = []
    closed = threading.Event()
    box: list[KVManager] = []

    class Closer(Recorder):
        def room_concluded(self, room: int, gen: int, outcome: str, code: str, s: float) -> None:
            if closed.is_set():
                return
            closed.set()
            try:
                box[0].close(timeout_s=5.0)
            except BaseException as exc:
                errors.append(exc)

    mgr = KVManager(sessions_rig.tx, sessions_rig.kv, num_workers=2, events=Closer())
    box.append(mgr)
    try:
        s = one_session_sender(mgr, 1, [0, 1])
        other = one_session_sender(mgr, 2, [2, 3])  # open: close() purges it
        s.send([7, 8])
        assert closed.wait(20), "the room never concluded"
        for w in mgr._workers:
            w.join(10)
        assert [w.name for w in mgr._workers if w.is_alive()] == []
        notifier = mgr.notifier.thread
        assert notifier is not None
        notifier.join(10)
        assert errors == []
        assert not notifier.is_alive()
        assert other.poll() is KVPoll.Failed  # purged by the close
        with pytest.raises(RuntimeError, match="closed"):
            mgr.open_room(3, [A])
    finally:
        mgr.close()


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(60)
def test_long_poll_interval_does_not_fail_close(sessions_rig: SessionsRig) -> None:
    """``poll_interval_s=20`` (legal: below ``transfer_timeout_s``): the worker pauses 20 s
    between polls of its in-flight chunk. ``close(timeout_s=1)`` abandons the chunk; on
    3a76f2e the worker was still asleep when close() stopped joining ("transfer workers did
    not stop"); now close() wakes it.

    Found by the audit of issue 25 (section 1, a suspicion settled by a fix, at 3a76f2e).
    """
    tx = HeldTransport(sessions_rig.tx)
    mgr = KVManager(
        tx,
        sessions_rig.kv,
        num_workers=1,
        poll_interval_s=20.0,  # type: ignore[arg-type]
        transfer_timeout_s=30.0,
    )
    s = one_session_sender(mgr, 1, [0, 1])
    s.send([5, 6])
    assert wait_until(lambda: tx.polls >= 1, 10.0)  # the worker polled it: now it pauses
    try:
        mgr.close(timeout_s=1.0)
    finally:
        tx.go.set()
        for w in mgr._workers:
            w.join(30)
    assert mgr.stats().transfers_abandoned == 1


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout_s", [math.inf, 1e12])
def test_close_with_a_huge_timeout_closes(sender_pool: SenderPool, timeout_s: float) -> None:
    """``close(inf)`` / ``close(1e12)`` close as asked. At 668dd63 they raised (ValueError
    from wait_drained, OverflowError from join) after purging every room and queueing the
    stop sentinels: workers and notifier were left running.

    Found by the audit of issue 16, under load (defect 2, at 668dd63).
    """
    mgr = _manager(sender_pool, num_workers=2)
    handle = mgr.open_room(7, ["d0"])
    mgr.close(timeout_s)
    assert not mgr.is_open(handle)
    assert all(not w.is_alive() for w in mgr._workers)
    assert mgr.notifier.thread is None or not mgr.notifier.thread.is_alive()


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(60)
def test_close_does_not_withhold_the_notice_of_a_chunk_ending_elsewhere(
    sender_pool: SenderPool, decode_peer: Any
) -> None:
    """A purged room's last chunk is being ended by its worker (claimed, its release slow)
    when ``close()``'s timeout expires: nothing was abandoned, so the room's notice must be
    sent, not counted as withheld. At 668dd63 close() counted it withheld and the worker,
    finishing later, found no notice to queue.

    Found beside the audit of issue 16, under load (at 668dd63).
    """
    tx = sender_pool.transport
    tx.add_peer("d", decode_peer.metadata())
    slow = _SlowReleaseTransport(tx, hold_s=0.2)
    mgr = KVManager(slow, sender_pool.pool, num_workers=1)  # type: ignore[arg-type]
    s = NixlKVSender(mgr, 5, ["d"], [make_transfer_info("d", [0])])
    s.init(1)
    s.send([1])
    assert wait_until_fast(lambda: mgr.stats().transfers_inflight == 1, 10)
    s.clear()  # the chunk drains; the notice waits for it
    slow.armed.set()  # the worker sees DONE now and ends the chunk, slowly
    assert slow.releasing.wait(10)
    # The engine's shutdown thread closes the manager while the worker is in that release.
    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        closer = threading.Thread(target=mgr.close, kwargs={"timeout_s": 0.01}, daemon=True)
        closer.start()
        closer.join(30)
    finally:
        sys.setswitchinterval(old)
    assert not closer.is_alive()
    st = mgr.stats()
    assert st.transfers_abandoned == 0
    assert st.notices_withheld == 0, "a notice was withheld although nothing was abandoned"
    assert wait_until_fast(lambda: mgr.stats().notices_sent == 1, 10)
    assert decode_peer.wait_room_failed(5, s.handle.generation, 10) is not None


@pytest.mark.slow
@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(120)
def test_close_right_after_notices_sends_them_and_prints_nothing() -> None:
    """``tx.close()`` right after ``KVManager.close()`` sent its room notices: on the old
    code UCX canceled the queued notices ("UCX AM send failed ... Request canceled" on the
    user's stderr, 50 lines in 3 of 3 runs) and the decode side never learnt them.

    Found by issue 25, section 2 (what a new user trips on).
    """
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


class _UnknowableTransfer:
    """A write with no ``settled()``: ``close()`` cannot ask whether NIXL is done with it, so
    past its wait it abandons it. The moment ``close()`` looks for ``settled`` (it decided the
    chunk is still in flight), ``probe`` runs once: there another thread claims the chunk.
    Its first ``release()`` waits for ``go``: the claim's accounting is not done yet."""

    def __init__(self) -> None:
        self.state = "PROC"
        self.releases = 0
        self.probe: Callable[[], None] | None = None
        self.in_release = threading.Event()
        self.go = threading.Event()
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        probe, self.probe = self.probe, None
        if name == "settled" and probe is not None:
            probe()
        raise AttributeError(name)

    def poll(self) -> str:
        return self.state

    def release(self) -> None:
        with self._lock:
            self.releases += 1
            first = self.releases == 1
        if first:
            self.in_release.set()
            self.go.wait(BOUND_S)


class _UnknowableTransport(StubTransport):
    def write_pages(self, *args: Any, **kw: Any) -> Any:
        self.unknowable = _UnknowableTransfer()
        return self.unknowable


def test_close_never_abandons_a_chunk_another_thread_claimed() -> None:
    """*Chunks once* / ``close()``: each chunk's end is claimed once, and ``close()`` waits
    for chunk ends other threads claimed. ``close(timeout_s=0)`` has found a drained write
    still in flight and is about to abandon it when a poller sees it complete, claims its
    end and is still releasing it: the chunk is not ended a second time (one release, one
    end)."""
    tx = _UnknowableTransport()
    mgr = _stub_manager(tx)
    s = _sender(mgr, 7)
    s.send([0])
    s.clear()  # in flight: the chunk drains
    xfer = tx.unknowable
    poller = threading.Thread(target=mgr.progress, args=(s.handle,), daemon=True)

    def claim_elsewhere() -> None:
        xfer.state = "DONE"
        poller.start()
        assert xfer.in_release.wait(BOUND_S), "the poller never claimed the chunk"
        threading.Timer(0.3, xfer.go.set).start()  # its release then finishes

    xfer.probe = claim_elsewhere
    try:
        mgr.close(timeout_s=0.0)
    finally:
        xfer.go.set()
        if poller.is_alive():
            poller.join(BOUND_S)
    assert not poller.is_alive()
    assert xfer.in_release.is_set(), "close() never asked about settled(): nothing was judged"
    assert xfer.releases == 1, f"released {xfer.releases} times"
    st = mgr.stats()
    ended = st.chunks_done + st.chunks_failed + st.chunks_skipped + st.chunks_drained
    assert ended == st.chunks_submitted == 1, st
