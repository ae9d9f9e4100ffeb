"""A write in flight when its peer is removed is not over: the contract (THREADING.md,
"Removed peers"): ``remove_peer`` fails the session's writes at once but *keeps* every write
NIXL may still move bytes for, and the manager counts it as draining -- its room's decode
pages stay out of reuse -- until NIXL settles it.

Why: releasing a posted write does not stop it. Over TCP (two hosts) a write that a
partition held up lands once the link heals, also when its handle was released and its peer
removed before (measured: 20 ms and 0.5 s after the heal). Before the fix ``remove_peer``
released such writes and the manager counted their chunks drained at once, so the driver
handed their decode pages to new rooms while the old bytes were still on their way:
two-hosts' ``evict`` phase (seed 5003, phases ``evict,kill`` x 4, beside four CPU hogs)
reported ``cross-room overwrite: decode page 442 ... holds the bytes room 1846 gen 1847
(Failed) sent it (chunk 5), but room 2111 was given the page after it and verified``, with
the peer's landing log showing 2111's write at 499.526 and 1846's at 499.631.

Two checks:

* loopback, a really stopped peer (SIGSTOP: NIXL keeps the write in progress): after
  ``remove_peer`` the room fails at once (``PeerNotFoundError``), its opening stays
  draining while the peer is stopped, and drains once the peer resumes and NIXL completes
  the write (with its bytes at the peer). Fails on e58a33f: drained at once.
* two hosts (root, netns; SKIP elsewhere), the fault itself: a partition holds the write up,
  the peer is removed (an engine's health check) and added again after the heal. The room's
  opening must not drain before its bytes landed, and once it drained nothing of it lands
  any more (a new room's bytes on the page stay).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from sender.errors import TRANSPORT_ERRORS, PeerNotFoundError
from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.poll import KVPoll
from staging.buffers import StagingBufferPool
from tests.fixtures_nixl import PAGE_BYTES, SenderPool, requires_nixl
from tests.polling import conclude, wait_until

pytestmark = [requires_nixl, pytest.mark.nixl]

HELD_S = 1.0
"""How long a kept write is watched not draining while its peer cannot complete it. Not a
bound that a slow machine can miss: while the peer is stopped (or the link cut) NIXL cannot
complete the write, so the opening stays draining however long this is."""


def _warm(mgr: KVManager, session: str, room: int, src: int, dst: int) -> None:
    """One room that succeeds (its first write sets up the connection)."""
    s = NixlKVSender(mgr, room, [session], [make_transfer_info(session, [dst])])
    s.init(1)
    s.send([src])
    assert conclude(s, 60) is KVPoll.Success, mgr.exceptions.get(room)
    s.clear()
    assert mgr.wait_drained(s.handle, 60)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_a_removed_peers_write_in_flight_drains_only_once_nixl_settles_it(
    sender_pool: SenderPool, peer_factory: Callable[..., Any], staged: bool
) -> None:
    peer = peer_factory()
    tx = sender_pool.transport
    tx.add_peer("d", peer.metadata)
    pool = None
    if staged:
        pool = StagingBufferPool(2, 1, PAGE_BYTES)
        tx.register_region("staging", pool.tensor, PAGE_BYTES)
    # A deadline far past the checks: only the removal may fail the room.
    mgr = KVManager(
        tx, sender_pool.pool, num_workers=1, staging_pool=pool, transfer_timeout_s=600.0
    )
    try:
        _warm(mgr, "d", 1, 3, 0)
        peer.stop()
        room = NixlKVSender(mgr, 2, ["d"], [make_transfer_info("d", [9])])
        room.init(1)
        room.send([5])
        assert wait_until(lambda: mgr.stats().transfers_inflight == 1, 60), mgr.stats()
        assert room.poll() is KVPoll.Transferring
        assert tx.remove_peer("d")
        assert wait_until(lambda: room.poll() is KVPoll.Failed, 60), mgr.stats()
        with pytest.raises(Exception) as failed:
            room.failure_exception()  # purges the room: its write is draining now
        # NIXL still has the write: it may land whenever the peer runs again.
        assert not mgr.wait_drained(room.handle, HELD_S), (
            "the room's opening drained while its write was still in progress at NIXL"
        )
        assert mgr.draining(room.handle) == 1
        assert isinstance(failed.value, PeerNotFoundError), repr(failed.value)
        assert isinstance(failed.value, TRANSPORT_ERRORS)
        assert tx.stats().transfers_kept_at_removal == 1
        if pool is not None:  # held, or retired (not reused, no longer counted as in use)
            st = pool.stats()
            assert st.in_use + st.retired == 1, f"the kept write's slot was given back: {st}"
        peer.cont()
        assert mgr.wait_drained(room.handle, 60), "the settled write never ended"
        assert peer.page_digest([9]) == sender_pool.digests([5])
        if pool is not None:
            assert pool.stats().in_use == 0
        assert wait_until(lambda: tx.stats().live_transfers == 0, 60), tx.stats()
        # The session can be added again and used (the kept agent reference went or stays
        # shared, never removed under the new entry).
        tx.add_peer("d", peer.metadata)
        _warm(mgr, "d", 3, 6, 10)
        assert peer.page_digest([10]) == sender_pool.digests([6])
    finally:
        peer.cont()
        mgr.close()
        if pool is not None:
            pool.close()


# --------------------------------------------------------------------------- two hosts

_CHILD = "import sys; from tests.sender.test_removed_peers import _child; sys.exit(_child())"


def _child() -> int:
    """Sender child over the link (UCX over TCP on the veth; the parent cuts and heals the
    link on request: ``CUT``/``HEAL`` lines on stdout, a line on stdin when done). Prints
    one ``RESULT {json}`` line."""
    import numpy as np
    import torch

    from sender.transport import NixlTransport
    from stress.harness.peer import PeerProcess
    from stress.netns import TwoHostLink

    link = TwoHostLink.from_json(sys.argv[1])
    kv = torch.randint(0, 256, (16, PAGE_BYTES), dtype=torch.uint8)
    out: dict[str, Any] = {}

    def ask(what: str) -> None:
        print(what, flush=True)
        sys.stdin.readline()

    with NixlTransport("removed-write-sender") as tx:
        tx.register_region("kv", kv, PAGE_BYTES)
        peer = PeerProcess(
            16, PAGE_BYTES, name="removed-write", netns=link.netns, host=link.peer_addr,
            env=link.peer_env(), stderr=subprocess.DEVNULL, rpc_timeout_s=10.0,
        )  # fmt: skip
        try:
            tx.add_peer("d", peer.metadata)
            with KVManager(tx, kv, num_workers=1, transfer_timeout_s=600.0) as mgr:
                _warm(mgr, "d", 1, 1, 1)
                ask("CUT")
                room = NixlKVSender(mgr, 2, ["d"], [make_transfer_info("d", [9])])
                room.init(1)
                room.send([5])
                assert wait_until(lambda: mgr.stats().transfers_inflight == 1, 60)
                tx.remove_peer("d")  # the engine's health check
                assert wait_until(lambda: room.poll() is KVPoll.Failed, 60)
                room.clear()
                out["drained_while_cut"] = mgr.wait_drained(room.handle, HELD_S)
                ask("HEAL")
                for _ in range(200):  # the link is back: add the same peer again
                    try:
                        tx.add_peer("d", peer.metadata)
                        break
                    except Exception:
                        time.sleep(0.05)
                out["drained"] = mgr.wait_drained(room.handle, 60)
                want = np.frombuffer(kv[5].numpy().tobytes(), np.uint8)
                got = np.frombuffer(peer.read_pages([9]), np.uint8)
                out["landed_when_drained"] = bool((got == want).all())
                # The page goes to a new room, as a driver does once the old one drained:
                # nothing of the old room may land on it any more.
                _warm(mgr, "d", 3, 6, 9)
                time.sleep(HELD_S)  # room for a late landing to show (none may)
                got = np.frombuffer(peer.read_pages([9]), np.uint8)
                out["new_room_bytes_stay"] = bool(
                    (got == np.frombuffer(kv[6].numpy().tobytes(), np.uint8)).all()
                )
        finally:
            peer.close()
    print("RESULT " + json.dumps(out), flush=True)
    return 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_write_held_up_by_a_partition_keeps_its_pages_until_it_landed() -> None:
    from stress import netns

    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"two-host topology not available here: {reason}")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with netns.two_host_link(1_000_000_000) as link:
        env = netns.child_env(link, path=[root])
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, link.to_json()],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None
        result: dict[str, Any] | None = None
        try:
            for line in proc.stdout:
                if line.startswith("CUT"):
                    link.partition()
                elif line.startswith("HEAL"):
                    link.heal()
                elif line.startswith("RESULT "):
                    result = json.loads(line[len("RESULT ") :])
                    continue
                else:
                    continue
                proc.stdin.write("\n")
                proc.stdin.flush()
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    print(result)
    assert result is not None
    assert result["drained_while_cut"] is False, (
        "the room drained while the partition held its write up (it lands after the heal)"
    )
    assert result["drained"] and result["landed_when_drained"], result
    assert result["new_room_bytes_stay"], "a late write of the old room landed on the page"
