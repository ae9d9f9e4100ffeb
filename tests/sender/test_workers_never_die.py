"""Workers never die (docs/THREADING.md, "Workers never die"): any error while a worker
handles a chunk or a transport error is counted and the worker goes on."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from sender.errors import TRANSPORT_ERRORS, KVTransferError
from sender.manager import KVManager
from sender.poll import KVPoll
from staging.context import StagingContext
from tests.fixtures_nixl import requires_nixl
from tests.polling import conclude, wait_until
from tests.sender._crowded_staging import long_reader
from tests.sender._scripted import Rig, ScriptedTransport, sender

pytestmark = [pytest.mark.nixl, requires_nixl]


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
