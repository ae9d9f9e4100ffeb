"""Workers never die (docs/THREADING.md, "Workers never die"): any error while a worker
handles a chunk or a transport error is counted and the worker goes on."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from sender.errors import TRANSPORT_ERRORS, KVTransferError, TransferTimeoutError
from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.poll import KVPoll
from staging.context import StagingContext
from tests.fixtures_nixl import SenderPool, requires_nixl
from tests.polling import conclude, wait_until

pytestmark = [pytest.mark.nixl, requires_nixl]


SCRIPTED_SESSION = "decode-0"


class ScriptedTransfer:
    """A real transfer whose answers follow the script of its :class:`ScriptedTransport`."""

    def __init__(self, inner: Any, owner: ScriptedTransport, write_no: int) -> None:
        self.inner = inner
        self.write_no = write_no
        self._owner = owner

    @property
    def held(self) -> bool:
        return self.write_no in self._owner.hold and not self._owner.unheld.is_set()

    @property
    def done(self) -> bool:
        return bool(self.inner.done) and not self.held

    def poll(self) -> str:
        state: str = self.inner.poll()  # raises TransferReleasedError once released
        if self.held:
            if time.monotonic() >= self.inner.started_at + self.inner.timeout_s:
                raise TransferTimeoutError(self.inner.session_id, self.inner.timeout_s)
            return "PROC"
        if state == "DONE" and self.write_no in self._owner.meet:
            # Only one thread came (the barrier breaks): that is what a fixed sender does.
            with contextlib.suppress(threading.BrokenBarrierError):
                self._owner.barrier.wait()
        return state

    def wait(self, timeout_s: float | None = None, interval_s: float = 0.0002) -> None:
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while self.poll() != "DONE":
            if end is not None and time.monotonic() >= end:
                raise TimeoutError(f"wait({timeout_s}) elapsed")
            time.sleep(interval_s)

    def release(self) -> None:
        self.inner.release()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class ScriptedTransport:
    """A real transport whose transfers are held or met by write number (1-based).

    Thread-safe: the write counter is under ``_lock`` (never held while calling NIXL).
    """

    def __init__(self, inner: Any, *, hold: Sequence[int] = (), meet: Sequence[int] = ()) -> None:
        self.inner = inner
        self.hold = frozenset(hold)
        self.meet = frozenset(meet)
        self.unheld = threading.Event()
        self.barrier = threading.Barrier(2, timeout=0.5)
        self._lock = threading.Lock()
        self._writes = 0
        self.transfers: list[ScriptedTransfer] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __enter__(self) -> ScriptedTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        """End every hold, so that workers polling a held transfer can stop."""
        self.unheld.set()

    def write_pages(
        self,
        session_id: str,
        src_pages: Any,
        dst_pages: Any,
        notif: bytes | None = None,
        **kw: Any,
    ) -> ScriptedTransfer:
        with self._lock:
            self._writes += 1
            write_no = self._writes
        xfer = ScriptedTransfer(
            self.inner.write_pages(session_id, src_pages, dst_pages, notif, **kw), self, write_no
        )
        with self._lock:
            self.transfers.append(xfer)
        return xfer


@dataclass
class Rig:
    """The sender transport + pool (``sp``) and an in-process decode peer added as
    SCRIPTED_SESSION."""

    sp: SenderPool
    peer: Any  # stress.harness.peer.DecodePeer

    @property
    def tx(self) -> Any:
        return self.sp.transport

    @property
    def kv(self) -> torch.Tensor:
        return self.sp.pool


@pytest.fixture
def rig(sender_pool: SenderPool, decode_peer: Any) -> Rig:
    sender_pool.transport.add_peer(SCRIPTED_SESSION, decode_peer.metadata())
    return Rig(sender_pool, decode_peer)


FILLER_KEYS = 200_000


@pytest.fixture(scope="module")
def crowded_staging() -> StagingContext:
    """A staging context with a small lock timeout and 200k keys of filler rooms (ids >=
    1_000_000): its ``snapshot()`` holds the read lock ~0.1 s, 20x the lock timeout."""
    ctx = StagingContext(lock_timeout=0.005)
    per_room = 64
    for i in range(FILLER_KEYS // per_room):
        ctx.request_prefetches(ctx.open_room(1_000_000 + i), range(per_room), "filler")
    return ctx


@contextlib.contextmanager
def long_reader(ctx: StagingContext) -> Iterator[list[int]]:
    """A daemon thread calling ``ctx.snapshot()`` back to back until the block ends."""
    stop = threading.Event()
    count = [0]
    errors: list[BaseException] = []

    def run() -> None:
        try:
            while not stop.is_set():
                ctx.snapshot()
                count[0] += 1
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, name="long-reader", daemon=True)
    t.start()
    while count[0] == 0 and not errors and t.is_alive():  # one done: the next one runs
        time.sleep(0.001)
    try:
        yield count
    finally:
        stop.set()
        t.join(10)
        assert not t.is_alive(), "the long reader did not stop"
    assert errors == [], errors


def sender(
    mgr: KVManager, room: int, dst: Sequence[int], session: str = SCRIPTED_SESSION
) -> NixlKVSender:
    s = NixlKVSender(mgr, room, [session], [make_transfer_info(session, dst)])
    s.init(len(dst))
    return s


def worker_threads(mgr: KVManager) -> list[threading.Thread]:
    return list(getattr(mgr, "_workers", ()))


class _FailingSessionPurge(StagingContext):
    """A staging context whose first ``purge_session`` raises (any unexpected error)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def purge_session(self, session_id: str) -> frozenset[int]:
        if self.armed:
            self.armed = False
            raise RuntimeError("planted: purge_session failed")
        return super().purge_session(session_id)


@pytest.mark.timeout(40)
@pytest.mark.usefixtures("fast_switch")
def test_worker_survives_fail_session_under_lock_timeout_and_long_reader(
    rig: Rig, crowded_staging: StagingContext, thread_excepthook: list[Any]
) -> None:
    """Three rooms, one per session, each with a chunk to a hung peer: each times out, which
    fails the session (``fail_session`` -> ``staging.purge_session``) while a long reader
    holds the staging context (``lock_timeout=0.005``). The one worker must survive every
    time, and a room of a healthy session must still be processed. At 8343a9b the
    LockTimeoutError escaped the except-handler and killed the worker: later rooms hung.

    Found by the audit of issue 9 (defect d4, at 8343a9b).
    """
    meta = rig.peer.metadata()
    hung = ["hung-a", "hung-b", "hung-c"]
    for sid in [*hung, "healthy"]:
        rig.tx.add_peer(sid, meta)
    script = ScriptedTransport(rig.tx, hold=[1, 2, 3])
    with (
        KVManager(
            script, rig.kv, num_workers=1, staging=crowded_staging, transfer_timeout_s=0.3
        ) as mgr,
        script,
    ):
        rooms = [sender(mgr, 10 + i, [i], sid) for i, sid in enumerate(hung)]
        healthy = sender(mgr, 20, [30, 31], "healthy")
        with long_reader(crowded_staging) as snapshots:
            for r in rooms:
                r.send([50 + r.bootstrap_room])
                st = conclude(r, 5)
                assert st is KVPoll.Failed, f"room {r.bootstrap_room} {st!r}: worker dead?"
                # fail_session follows record_failure: let it run before the next room.
                time.sleep(0.1)
            healthy.send([60, 61])
            st = conclude(healthy, 5)
            reads = snapshots[0]
        assert reads > 0
        assert thread_excepthook == [], [a.exc_value for a in thread_excepthook]
        assert st is KVPoll.Success, f"healthy room {st!r}: the worker died"
        assert all(t.is_alive() for t in worker_threads(mgr))
        assert rig.peer.read_pages([30, 31]) == rig.sp.page_bytes_of([60, 61])
        healthy.clear()
        for r in rooms:
            with pytest.raises((KVTransferError, *TRANSPORT_ERRORS)):
                r.failure_exception()
        script.unheld.set()
        assert mgr.wait_drained(timeout_s=5.0)
        assert mgr.stats().open_rooms == 0


@pytest.mark.timeout(30)
def test_worker_survives_any_error_while_handling_a_transport_error(
    rig: Rig, thread_excepthook: list[Any]
) -> None:
    """The same path made deterministic: the session purge after a timeout raises an
    unexpected error. The worker goes on (the error is counted) and serves the next room.

    Found by the audit of issue 9 (defect d4, at 8343a9b).
    """
    rig.tx.add_peer("hung", rig.peer.metadata())
    script = ScriptedTransport(rig.tx, hold=[1])
    ctx = _FailingSessionPurge()
    with (
        KVManager(script, rig.kv, num_workers=1, staging=ctx, transfer_timeout_s=0.2) as mgr,
        script,
    ):
        doomed = sender(mgr, 1, [0], "hung")
        later = sender(mgr, 2, [5, 6])
        doomed.send([70])
        assert conclude(doomed, 5) is KVPoll.Failed
        assert wait_until(lambda: not ctx.armed, 5)
        later.send([71, 72])
        st = conclude(later, 5)
        assert thread_excepthook == [], [a.exc_value for a in thread_excepthook]
        assert st is KVPoll.Success, f"next room {st!r}: the worker died"
        assert all(t.is_alive() for t in worker_threads(mgr))
        assert mgr.stats().worker_errors >= 1
        later.clear()
        with pytest.raises((KVTransferError, *TRANSPORT_ERRORS)):
            doomed.failure_exception()
        script.unheld.set()
        assert mgr.wait_drained(timeout_s=5.0)
