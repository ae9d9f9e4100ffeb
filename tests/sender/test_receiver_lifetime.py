"""The receiving side over real NIXL: memory lifetime after ``deregister_region`` and the
notification semantics of NIXL 1.5.1 that a decode side must be built around.

See docs/PROTOCOL.md ("Receiving-side memory lifetime", "Per-transfer notifications").
"""

from __future__ import annotations

import gc
import time
import uuid
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from sender.errors import TRANSPORT_ERRORS, TransferTimeoutError
from sender.transport import NixlTransport, Transfer, decode_metadata
from stress.harness.peer import PeerProcess
from tests.fixtures_nixl import NUM_PAGES, PAGE_BYTES, SenderPool, requires_nixl

pytestmark = [pytest.mark.nixl, requires_nixl]

RX_PAGES = 64  # 256 KiB: large enough for glibc to hand the same block to the next array


def _span(arr: npt.NDArray[Any]) -> tuple[int, int]:
    base = int(arr.ctypes.data)
    return base, base + int(arr.nbytes)


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


@pytest.mark.timeout(60)
def test_stale_write_after_deregister_never_lands_in_new_memory(sender_pool: SenderPool) -> None:
    """A sender holding the receiver's old metadata writes after ``deregister_region``.

    NIXL does not refuse that write (UCX CMA/TCP: the bytes land), so the receiving
    transport must keep the memory alive until close(). Before the fix the transport dropped
    its reference, glibc gave the block to the next array of that size, and the stale write
    landed in it (4 of 4 runs).
    """
    sp = sender_pool
    rx = NixlTransport(f"rx-lifetime-{uuid.uuid4().hex[:8]}")
    try:
        buf = np.zeros((RX_PAGES, PAGE_BYTES), dtype=np.uint8)
        old_span = _span(buf)
        alive = weakref.ref(buf)
        rx.register_region("kv", buf, PAGE_BYTES)
        sp.transport.add_peer("rx", rx.metadata())
        pages = np.arange(RX_PAGES)
        x = sp.transport.write_pages("rx", [0], [0], b"warm", timeout_s=10)
        x.wait(10)
        x.release()
        assert bytes(buf[0]) == sp.page_bytes_of([0])

        assert rx.deregister_region("kv") is True
        assert "kv" not in decode_metadata(rx.metadata()).regions  # no longer published
        del buf  # the receiver's owner lets go, as a decode engine freeing a pool would
        gc.collect()
        fresh = [np.zeros((RX_PAGES, PAGE_BYTES), dtype=np.uint8) for _ in range(8)]

        # The sender still holds the old metadata: NIXL lets it write.
        late = sp.transport.write_pages("rx", pages, pages, b"late", timeout_s=10)
        late.wait(10)
        late.release()

        expected = np.frombuffer(sp.page_bytes_of(pages), dtype=np.uint8).reshape(RX_PAGES, -1)
        hit = [
            f"array {i} at {_span(a)[0]:#x} (old region at {old_span[0]:#x})"
            for i, a in enumerate(fresh)
            if np.array_equal(a, expected) or bool((a == expected).all(axis=1).any())
        ]
        assert not hit, f"stale write landed in newly allocated memory: {hit}"
        assert not [a for a in fresh if _overlaps(_span(a), old_span)], (
            "a new array was given memory of the deregistered region"
        )
        retired = alive()
        assert retired is not None, "deregister_region let the region's memory be freed"
        # Pins NIXL 1.5.1: a write after deregister_memory is not refused, it lands.
        assert np.array_equal(retired, expected), (
            "NIXL behaviour changed: the stale write did not land in the retired memory "
            "(update docs/PROTOCOL.md and NixlTransport.deregister_region)"
        )
        del retired
    finally:
        t0 = time.monotonic()
        rx.close()
        close_s = time.monotonic() - t0
    gc.collect()
    assert alive() is None, "close() did not release the retired region's memory"
    # close() keeps retired memory for the CMA grace period after dropping the agent.
    assert close_s >= 0.2, f"close() released retired memory after only {close_s:.3f} s"
    # After close the sender's write is refused (the agent is gone).
    with pytest.raises(TRANSPORT_ERRORS):
        x = sp.transport.write_pages("rx", [0], [0], b"after-close", timeout_s=5)
        x.wait(5)
    assert sp.transport.remove_peer("rx")


# --------------------------------------------------------------------------- notifications


def _post_unfinished(
    sp: SenderPool, peer: PeerProcess, tag: str, timeout_s: float
) -> tuple[Transfer, npt.NDArray[np.int64], bytes]:
    """Stop the peer and post writes until one is not complete after the post itself.

    Never polls it: a status check is exactly what would send its notification. The first
    notification after connecting was seen to complete while the peer was stopped, hence
    the retries.
    """
    peer.stop()
    dst = np.arange(NUM_PAGES)[::-1].copy()
    for attempt in range(5):
        msg = f"{tag}-{attempt}".encode()
        x = sp.transport.write_pages(
            "peer", np.arange(NUM_PAGES), dst, msg, timeout_s=timeout_s
        )
        if not x.done:
            return x, dst, msg
        x.release()
    pytest.fail("no write stayed in flight to a stopped peer")


def _wait_landed(sp: SenderPool, peer: PeerProcess, dst: npt.NDArray[np.int64]) -> None:
    want = sp.page_bytes_of(np.arange(NUM_PAGES))
    end = time.monotonic() + 10
    while peer.read_pages(dst) != want:
        assert time.monotonic() < end, "the data never landed at the peer"
        time.sleep(0.005)


def _connected(sp: SenderPool, peer: PeerProcess) -> None:
    sp.transport.add_peer("peer", peer.metadata)
    x = sp.transport.write_pages("peer", [0], [0], b"warm", timeout_s=10)
    x.wait(10)
    x.release()
    assert peer.wait_notif(b"warm", 5)
    peer.zero_pages()
    peer.clear_notifs()


def _got(peer: PeerProcess, msg: bytes) -> bool:
    return any(msg in msgs for msgs in peer.notifs().values())


@pytest.mark.timeout(60)
def test_notification_is_sent_only_by_a_status_check_on_the_sender(
    sender_pool: SenderPool, peer_process: PeerProcess
) -> None:
    """NIXL 1.5.1: the data of a pending transfer lands, but its notification is sent only
    when the sender checks the transfer's status — never by the progress thread alone."""
    doc = " ".join((NixlTransport.write_pages.__doc__ or "").split())
    assert "never from NIXL's progress thread alone" in doc, "write_pages docstring is wrong"
    _connected(sender_pool, peer_process)
    x, dst, msg = _post_unfinished(sender_pool, peer_process, "pending", timeout_s=30)
    peer_process.cont()
    _wait_landed(sender_pool, peer_process, dst)
    time.sleep(0.3)  # ~300 rounds of NIXL's progress thread (1 ms delay) on both sides
    assert not _got(peer_process, msg), (
        "NIXL behaviour changed: the notification arrived without a status check "
        "(update the write_pages docstring and docs/PROTOCOL.md)"
    )
    assert x.poll() == "DONE"
    assert peer_process.wait_notif(msg, 5), "no notification after the status check"
    x.release()


@pytest.mark.timeout(60)
def test_timed_out_transfer_still_notifies_done_when_released(
    sender_pool: SenderPool, peer_process: PeerProcess
) -> None:
    """NIXL 1.5.1: a transfer the sender already reported as timed out still sends its
    notification when it is released, or its peer removed, after the data landed. A decode
    side must not take a per-transfer notification as success of a failed room."""
    _connected(sender_pool, peer_process)
    for how in ("release", "remove_peer"):  # remove_peer last: it disconnects the peer
        x, dst, msg = _post_unfinished(sender_pool, peer_process, how, timeout_s=0.2)
        time.sleep(0.25)
        with pytest.raises(TransferTimeoutError):
            x.poll()
        peer_process.cont()
        _wait_landed(sender_pool, peer_process, dst)
        time.sleep(0.2)
        assert not _got(peer_process, msg)  # as above: nothing without a status check
        if how == "release":
            x.release()
        else:
            assert sender_pool.transport.remove_peer("peer")
            assert x.released
        assert peer_process.wait_notif(msg, 5), (
            f"NIXL behaviour changed: a timed-out transfer no longer notifies on {how} "
            "(update the write_pages docstring and docs/PROTOCOL.md)"
        )
        peer_process.zero_pages()
        peer_process.clear_notifs()
