"""A sender transport against decode peers that die (SIGKILL) or hang (SIGSTOP).

Peers run as child processes (``PeerProcess``) and are always reaped. NIXL reports a killed
peer as ``nixlRemoteDisconnectError`` (a member of ``TRANSPORT_ERRORS``); a hung peer is never
detected by NIXL, so our per-transfer deadline must fire.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from sender.errors import TRANSPORT_ERRORS, TransferReleasedError, TransferTimeoutError
from stress.harness.peer import PeerError, PeerProcess
from tests.fixtures_nixl import NUM_PAGES, SenderPool, requires_nixl
from tests.polling import wait_until

pytestmark = [pytest.mark.nixl, requires_nixl]

KILL_DEADLINE_S = 30.0
"""Transfer deadline in the kill tests. How long NIXL takes to report a dead peer is printed,
not asserted (40-130 ms on an idle machine): what is checked is that NIXL reports it (a
disconnect, not our deadline's TransferTimeoutError), so before this deadline — a bound
that holds on a busy machine."""


def _add(sp: SenderPool, peer: PeerProcess, session: str = "peer") -> None:
    sp.transport.add_peer(session, peer.metadata)


def _warm(sp: SenderPool, session: str = "peer") -> None:
    """One small transfer so that the UCX connection to the peer exists."""
    x = sp.transport.write_pages(session, [0], [0], b"warm", timeout_s=10)
    x.wait(10)
    x.release()


def _post_pending(sp: SenderPool, timeout_s: float, session: str = "peer") -> Any:
    """Post multi-page writes to a *stopped* peer until one stays in flight ("PROC").

    A stopped peer does not make every transfer hang: CMA writes land in a stopped process,
    and the first notification after connecting was seen to complete ("DONE") while the
    peer was stopped; later transfers stay "PROC" until the peer continues or dies.
    """
    for attempt in range(5):
        x = sp.transport.write_pages(
            session, np.arange(NUM_PAGES), np.arange(NUM_PAGES)[::-1].copy(),
            f"pending-{attempt}".encode(), timeout_s=timeout_s,
        )
        time.sleep(0.05)
        if x.poll() == "PROC":
            return x
        x.release()
    pytest.fail("no transfer stayed in flight to a stopped peer")


def _expect_transport_error(
    sp: SenderPool, pages: int, session: str = "peer", timeout_s: float = 10
) -> tuple[BaseException, Any]:
    """Write + poll until a TRANSPORT_ERRORS member is raised (by write or poll)."""
    xfer = None
    try:
        xfer = sp.transport.write_pages(
            session, np.arange(pages), np.arange(pages), b"doomed", timeout_s=timeout_s
        )
        xfer.wait()  # bounded by the transfer's own deadline (timeout_s)
    except TRANSPORT_ERRORS as exc:
        return exc, xfer
    raise AssertionError("transfer to a dead peer completed")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("connected", [True, False], ids=["warm", "cold"])
def test_peer_killed_before_transfer(
    sender_pool: SenderPool, peer_process: PeerProcess, connected: bool
) -> None:
    _add(sender_pool, peer_process)
    if connected:
        _warm(sender_pool)
    peer_process.kill()
    t0 = time.monotonic()
    exc, xfer = _expect_transport_error(sender_pool, NUM_PAGES, timeout_s=KILL_DEADLINE_S)
    print(f"{type(exc).__name__} after {time.monotonic() - t0:.3f} s")
    # Detected by NIXL (the peer is gone), not by our deadline: a disconnect or not-found.
    assert not isinstance(exc, TransferTimeoutError), exc
    if xfer is not None:  # the error came from poll(): the handle is still ours to release
        assert xfer.failure is exc
        xfer.release()
        xfer.release()
        with pytest.raises(TransferReleasedError):
            xfer.poll()
    assert sender_pool.transport.remove_peer("peer")
    st = sender_pool.transport.stats()
    assert st.live_transfers == 0 and st.transfers_failed >= 1


@pytest.mark.timeout(60)
def test_peer_killed_during_transfer(sender_pool: SenderPool, peer_process: PeerProcess) -> None:
    """Deterministic "in flight": the peer is stopped so the transfer stays PROC, then killed."""
    _add(sender_pool, peer_process)
    _warm(sender_pool)
    peer_process.stop()
    xfer = _post_pending(sender_pool, timeout_s=KILL_DEADLINE_S)
    peer_process.kill()
    t0 = time.monotonic()
    with pytest.raises(TRANSPORT_ERRORS) as ei:
        xfer.wait()  # bounded by the transfer's own deadline
    print(f"{type(ei.value).__name__} after {time.monotonic() - t0:.3f} s")
    assert not isinstance(ei.value, TransferTimeoutError), ei.value  # NIXL saw the death
    with pytest.raises(TRANSPORT_ERRORS):  # the failure is sticky, NIXL not asked again
        xfer.poll()
    xfer.release()
    xfer.release()
    sender_pool.transport.remove_peer("peer")
    assert sender_pool.transport.stats().live_transfers == 0


@pytest.mark.timeout(60)
def test_peer_killed_while_sender_streams(
    sender_pool: SenderPool,
    peer_process: PeerProcess,
    thread_excepthook: list[threading.ExceptHookArgs],
) -> None:
    """Kill the peer at an arbitrary moment while multi-page writes stream to it."""
    _add(sender_pool, peer_process)
    _warm(sender_pool)
    tr = sender_pool.transport
    killed_at: list[float] = []
    errors: list[tuple[float, BaseException]] = []
    done = 0

    def killer() -> None:
        time.sleep(0.3)
        peer_process.kill()
        killed_at.append(time.monotonic())

    k = threading.Thread(target=killer, daemon=True)
    k.start()
    rng = np.random.default_rng(3)
    end = time.monotonic() + 10
    while time.monotonic() < end and not errors:
        dst = rng.permutation(NUM_PAGES)[:128]
        xfer = None
        try:
            xfer = tr.write_pages("peer", np.arange(128), dst, timeout_s=KILL_DEADLINE_S)
            xfer.wait()  # bounded by the transfer's own deadline
            done += 1
        except TRANSPORT_ERRORS as exc:
            errors.append((time.monotonic(), exc))
        finally:
            if xfer is not None:
                xfer.release()
    k.join(10)
    assert not k.is_alive() and killed_at, "killer did not run"
    assert errors, "no error after the peer was killed"
    assert done > 0
    seen_at, first = errors[0]
    print(f"{type(first).__name__} {seen_at - killed_at[0]:.3f} s after the kill")
    assert not isinstance(first, TransferTimeoutError), first  # NIXL saw it, not our deadline
    assert not thread_excepthook
    tr.remove_peer("peer")
    assert tr.stats().live_transfers == 0


@pytest.mark.timeout(60)
def test_peer_stopped_times_out_then_cont_is_harmless(
    sender_pool: SenderPool, peer_process: PeerProcess
) -> None:
    _add(sender_pool, peer_process)
    _warm(sender_pool)
    tr = sender_pool.transport
    peer_process.stop()
    deadline = 0.3
    xfer = _post_pending(sender_pool, timeout_s=deadline)
    with pytest.raises(TransferTimeoutError) as ei:
        xfer.wait(timeout_s=5)
    # Never early (one clock, so this holds on any machine); never late is the wait's own
    # bound (5 s: it would have raised TimeoutError, not TransferTimeoutError).
    assert time.monotonic() - xfer.started_at >= deadline
    assert ei.value.session_id == "peer" and ei.value.timeout_s == deadline
    assert tr.stats().transfers_timed_out == 1
    # remove_peer keeps the still-PROC write (releasing it would not stop its bytes): it
    # stays failed by its deadline and unsettled until NIXL completes it.
    assert tr.remove_peer("peer")
    assert not xfer.released and not xfer.settled()
    assert tr.stats().transfers_kept_at_removal == 1
    with pytest.raises(TransferTimeoutError):
        xfer.poll()
    assert tr.remove_peer("peer") is False
    peer_process.cont()
    assert peer_process.ping()
    assert wait_until(xfer.settled, 10), "the kept write never settled after SIGCONT"
    xfer.release()
    xfer.release()  # no-op
    with pytest.raises(TransferReleasedError):
        xfer.poll()
    # The sender survives the peer waking up and can talk to it again.
    tr.add_peer("peer", peer_process.metadata)
    x = tr.write_pages("peer", [5, 6], [7, 8], b"after-cont", timeout_s=10)
    x.wait(10)
    x.release()
    assert peer_process.page_digest([7, 8]) == sender_pool.digests([5, 6])
    assert peer_process.wait_notif(b"after-cont", 5)
    assert tr.stats().live_transfers == 0


@pytest.mark.timeout(90)
def test_restart_gives_new_metadata_and_close_reaps_a_stopped_peer(
    sender_pool: SenderPool, peer_process: PeerProcess
) -> None:
    tr = sender_pool.transport
    _add(sender_pool, peer_process)
    _warm(sender_pool)
    old_meta, old_pid = peer_process.metadata, peer_process.pid
    peer_process.restart()
    assert peer_process.pid != old_pid and peer_process.metadata != old_meta
    tr.remove_peer("peer")
    _add(sender_pool, peer_process)
    x = tr.write_pages("peer", [1, 2, 3], [9, 10, 11], timeout_s=10)
    x.wait(10)
    x.release()
    assert peer_process.page_digest([9, 10, 11]) == sender_pool.digests([1, 2, 3])
    # close() reaps even a SIGSTOPped child, and is idempotent.
    proc = peer_process._proc
    assert proc is not None
    peer_process.stop()
    peer_process.close()
    peer_process.close()
    assert proc.returncode is not None and not peer_process.alive
    with pytest.raises(PeerError):
        peer_process.notifs()


@pytest.mark.timeout(60)
def test_peer_process_start_failure_is_reaped(peer_factory: Callable[..., Any]) -> None:
    with pytest.raises(PeerError):
        peer_factory(num_pages=0)  # the child rejects the size and exits
