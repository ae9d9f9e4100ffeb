"""DPOR (``frontrun``) over ``NixlTransport.write_pages`` against ``remove_peer``,
``deregister_region`` and ``close`` from another thread, with NIXL's binding stubbed.

The guarantees (``docs/THREADING.md``, the transport): ``write_pages`` is safe concurrently
with everything -- a concurrent ``remove_peer``/``close`` either releases the new transfer
(``remove_peer`` keeps one NIXL still has in progress, failed, for its owner to release) or
makes the call raise; every transfer it returns is released exactly once (by whoever comes
first: the caller, ``remove_peer``, ``deregister_region`` or ``close``); no write is posted to
a peer once ``remove_peer`` has returned, or from a region once ``deregister_region`` has, or
at all once ``close`` has; and the call raises only what it documents.

The transport is real (a real agent, a real registered region, a real peer added from a
decode peer's metadata); only the binding calls a write makes (``makeXferReq``,
``postXferReq``, ``getXferStatus``, ``releaseXferReq``) and the clean-up calls of the
membership changes go to an in-memory stand-in, because the explorer must schedule every step
and real NIXL calls release the GIL into C++. The stand-in counts, per handle, its posts and
releases, and each post made after thread X's membership change had returned.

Thread W writes (and keeps what it got: releasing it is left to the membership change, or to
the ``close()`` the invariant makes at the end); thread X removes the peer, deregisters the
region, or closes the transport, then sets the stand-in's fence. Every interleaving with at most one
preemption. The planted violation (the write's re-check under the lock removed, so a write
that looked the peer up before ``remove_peer`` posts to it after) is in ``make mutants``
(``transport-write-skips-recheck``), where this exploration kills it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, ClassVar

import frontrun
import pytest
import torch

from sender.errors import (
    PeerNotFoundError,
    TransferReleasedError,
    TransportClosedError,
    TransportParamError,
)
from sender.transport import NixlTransport, Transfer
from tests.fixtures_nixl import requires_nixl

pytestmark = [pytest.mark.nixl, requires_nixl, pytest.mark.timeout(400)]

PAGE_BYTES = 4096
SESSION = "d0"
DOCUMENTED = (PeerNotFoundError, TransportClosedError, TransportParamError)


class StubBinding:
    """The binding agent a transfer talks to: handles are ints; posts complete at once (or
    stay in progress); posts after ``fence`` was set are counted as late."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.posts: dict[int, int] = {}
        self.releases: dict[int, int] = {}
        self.fence = False
        self.late_posts = 0

    def makeXferReq(self, *args: Any) -> int:
        handle = next(self._ids)
        self.posts[handle] = 0
        self.releases[handle] = 0
        return handle

    def createXferReq(self, *args: Any) -> int:
        return self.makeXferReq()

    def postXferReq(self, handle: int, msg: bytes) -> Any:
        self.posts[handle] += 1
        if self.fence:
            self.late_posts += 1
        return _PROC

    def getXferStatus(self, handle: int) -> Any:
        return _PROC

    def releaseXferReq(self, handle: int) -> None:
        self.releases[handle] += 1


class StubWrapper:
    """The wrapper agent the membership changes talk to (clean-up calls only)."""

    agent: Any = None
    _leaked_xfer_handles: ClassVar[list[Any]] = []

    def release_dlist_handle(self, handle: Any) -> None:
        pass

    def remove_remote_agent(self, name: str) -> None:
        pass

    def deregister_memory(self, descs: Any, backends: Any) -> None:
        pass


_PROC: Any = None


@pytest.fixture(scope="module")
def peer_metadata() -> Iterator[bytes]:
    from sender import _nixl
    from stress.harness.peer import DecodePeer

    global _PROC
    assert _nixl.bindings is not None
    _PROC = _nixl.bindings.NIXL_IN_PROG
    peer = DecodePeer("dpor-transport-peer", 16, PAGE_BYTES)
    try:
        yield peer.metadata()
    finally:
        peer.close()


class Rig:
    """A real transport with its binding stubbed; ``action`` is what thread X does."""

    action = "remove_peer"
    metadata: bytes = b""

    def __init__(self) -> None:
        self.tx = NixlTransport()
        self.kv = torch.zeros((16, PAGE_BYTES), dtype=torch.uint8)
        self.tx.register_region("kv", self.kv, PAGE_BYTES)
        self.tx.add_peer(SESSION, self.metadata)
        self.real_agent = self.tx._agent
        self.stub = StubBinding()
        self.tx._xfer_agent = self.stub
        self.tx._agent = StubWrapper()
        self.got: list[Transfer] = []
        self.errors: list[BaseException] = []

    def write(self) -> None:
        try:
            xfer = self.tx.write_pages(SESSION, [1, 2], [3, 4], b"room=1;chunk=0;last=1")
        except DOCUMENTED:
            return
        except BaseException as exc:
            self.errors.append(exc)
            return
        self.got.append(xfer)  # not released here: whoever owns the membership change must

    def change(self) -> None:
        try:
            if self.action == "remove_peer":
                self.tx.remove_peer(SESSION)
            elif self.action == "deregister_region":
                self.tx.deregister_region("kv")
            else:
                self.tx.close()
        except BaseException as exc:
            self.errors.append(exc)
        self.stub.fence = True

    def holds(self) -> bool:
        try:
            assert not self.errors, f"raised: {self.errors!r}"
            assert self.stub.late_posts == 0, (
                f"{self.stub.late_posts} write(s) posted after {self.action}() returned"
            )
            self.tx.close()
            made = self.stub.releases
            assert all(n == 1 for n in made.values()), f"releases per handle: {made}"
            assert all(n <= 1 for n in self.stub.posts.values()), self.stub.posts
            assert all(x.released for x in self.got)
            assert self.tx.stats().live_transfers == 0
            return True
        finally:
            self.tx._agent = self.real_agent  # so that it is destroyed as usual


def _explore(action: str, metadata: bytes) -> Any:
    rig = type(f"Rig_{action}", (Rig,), {"action": action, "metadata": metadata})
    result = frontrun.explore(
        setup=rig,
        workers=[Rig.write, Rig.change],
        invariant=Rig.holds,
        preemption_bound=1,
        stop_on_first=True,
        detect_io=False,
        reproduce_on_failure=3,
        deadlock_timeout=10.0,
        timeout_per_run=20.0,
    )
    print(f"write vs {action}: {result.num_explored} interleavings, holds={result.property_holds}")
    assert result.num_explored > 0, "frontrun explored nothing (skipped or misconfigured)"
    return result


@pytest.mark.usefixtures("frontrun_enabled")
@pytest.mark.parametrize("action", ["remove_peer", "deregister_region", "close"])
def test_write_pages_against_a_membership_change_one_preemption(
    action: str, peer_metadata: bytes
) -> None:
    result = _explore(action, peer_metadata)
    assert result.property_holds is True, result.explanation


# ------------------------------------------------------- poll against release, every point


class PollRig(Rig):
    """A transfer already posted (still in progress); thread P polls it once, thread R
    releases it (``action``: the transfer's own ``release()``), or removes its peer
    (``remove_peer``, which *keeps* a transfer NIXL still has in progress: failed with
    ``PeerNotFoundError``, not released). The contract (``Transfer.poll``: "serialised with
    ``release()``"; "Raises: TransferReleasedError: the transfer was released (NIXL is not
    touched)"; ``remove_peer``: the kept transfer is released by its owner or ``close()``):
    the poll answers ``"PROC"`` or raises ``TransferReleasedError`` (``release``), resp.
    ``PeerNotFoundError`` (``remove_peer``), nothing else; ``remove_peer`` leaves the handle
    unreleased, and it is released exactly once in all (``close()`` at the end)."""

    def __init__(self) -> None:
        super().__init__()
        self.xfer = self.tx.write_pages(SESSION, [1, 2], [3, 4], b"room=1;chunk=0;last=1")
        self.polled: list[object] = []

    def poll(self) -> None:
        try:
            self.polled.append(self.xfer.poll())
        except BaseException as exc:
            self.polled.append(exc)

    def release(self) -> None:
        if self.action == "remove_peer":
            self.tx.remove_peer(SESSION)
        else:
            self.xfer.release()

    def judge(self) -> str | None:
        kept = self.action == "remove_peer"
        try:
            (got,) = self.polled
            error = PeerNotFoundError if kept else TransferReleasedError
            if not (got == "PROC" or isinstance(got, error)):
                return f"poll() gave {got!r}"
            before = self.stub.releases.get(1, 0)
            if before != (0 if kept else 1) or self.xfer.released is not (not kept):
                return f"releases per handle before close(): {self.stub.releases}"
        finally:
            self.tx.close()
            self.tx._agent = self.real_agent
        if self.stub.releases != {1: 1}:
            return f"releases per handle: {self.stub.releases}"
        return None


@pytest.mark.slow
@pytest.mark.parametrize("action", ["release", "remove_peer"])
def test_poll_against_release_at_every_preemption_point(action: str, peer_metadata: bytes) -> None:
    """Deterministic, real threads (``tests/interleave.py``): the poller is stopped at every
    line and return of the library's code it passes while the release runs; a poll that looked
    at the transfer's state outside its lock is caught whatever the machine's load."""
    from tests.interleave import explore

    rig = type(f"PollRig_{action}", (PollRig,), {"action": action, "metadata": peer_metadata})
    result = explore(rig, PollRig.poll, PollRig.release, PollRig.judge, block_s=0.5)
    print(f"poll vs {action}: {result.schedules} schedules, {result.blocked} blocked")
    assert result.schedules >= 3
    assert not result.failures, result.failures


@pytest.mark.slow
@pytest.mark.parametrize("action", ["remove_peer", "deregister_region", "close"])
def test_membership_change_against_write_pages_at_every_preemption_point(
    action: str, peer_metadata: bytes
) -> None:
    """The exploration above with the roles of the threads turned and the schedule fixed
    (``tests/interleave.py``): the membership change is stopped at every line and return of
    the library's code it passes while a write runs to its end. A change made in two critical
    sections (list the live transfers, then refuse new writes) lets a write register in
    between that nobody releases: caught here whatever the machine's load."""
    from tests.interleave import explore, from_asserts

    rig = type(f"Rig_{action}", (Rig,), {"action": action, "metadata": peer_metadata})
    result = explore(rig, Rig.change, Rig.write, from_asserts(Rig.holds), block_s=0.5)
    print(f"{action} vs write: {result.schedules} schedules, {result.blocked} blocked")
    assert result.schedules >= 3
    assert not result.failures, result.failures[:3]
