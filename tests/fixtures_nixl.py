"""Fixtures for tests that use real NIXL agents and decode-peer processes.

* ``sender_pool`` — a :class:`NixlTransport` with a random uint8 pool registered as ``"kv"``.
* ``decode_peer`` — an in-process :class:`DecodePeer` (its pump thread stops on close).
* ``peer_factory`` / ``peer_process`` — :class:`PeerProcess` children, always reaped.
* ``nixl_required`` — skips when NIXL cannot be imported here.

Everything is closed/reaped at teardown, even when the test failed or timed out.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from sender import _nixl

NUM_PAGES = 256
PAGE_BYTES = 4096

requires_nixl = pytest.mark.skipif(
    not _nixl.AVAILABLE, reason=f"NIXL not importable: {_nixl.IMPORT_ERROR!r}"
)


@dataclass
class SenderPool:
    """A sender transport plus the random pool registered on it as region ``"kv"``."""

    transport: Any  # sender.transport.NixlTransport
    pool: torch.Tensor
    page_bytes: int

    @property
    def num_pages(self) -> int:
        return int(self.pool.shape[0])

    def page_bytes_of(self, pages: Any) -> bytes:
        """The bytes of ``pages`` (in order), as a peer should hold them after a write."""
        idx = torch.as_tensor(np.asarray(pages, dtype=np.int64))
        return bytes(self.pool[idx].numpy().tobytes())

    def digests(self, pages: Any) -> list[str]:
        """Digests of ``pages`` in the format of ``DecodePeer.page_digest``."""
        from stress.harness.peer import page_digest_bytes

        return [page_digest_bytes(self.pool[int(p)].numpy().tobytes()) for p in pages]


def make_sender_pool(
    num_pages: int = NUM_PAGES, page_bytes: int = PAGE_BYTES, *, seed: int = 1234, **kw: Any
) -> SenderPool:
    """Build a :class:`SenderPool` (the caller closes ``.transport``)."""
    from sender.transport import NixlTransport

    gen = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 256, (num_pages, page_bytes), dtype=torch.uint8, generator=gen)
    transport = NixlTransport(**kw)
    try:
        transport.register_region("kv", pool, page_bytes)
    except BaseException:
        transport.close()
        raise
    return SenderPool(transport, pool, page_bytes)


@pytest.fixture
def nixl_required() -> None:
    """Skip the test when NIXL is not importable."""
    if not _nixl.AVAILABLE:
        pytest.skip(f"NIXL not importable: {_nixl.IMPORT_ERROR!r}")


@pytest.fixture
def sender_pool(nixl_required: None) -> Iterator[SenderPool]:
    """A NixlTransport with a random ``NUM_PAGES x PAGE_BYTES`` pool registered as "kv"."""
    sp = make_sender_pool()
    try:
        yield sp
    finally:
        sp.transport.close()
        gc.collect()


@pytest.fixture
def decode_peer(nixl_required: None) -> Iterator[Any]:
    """An in-process DecodePeer with ``NUM_PAGES x PAGE_BYTES`` pages, closed at teardown."""
    from stress.harness.peer import DecodePeer

    peer = DecodePeer("decode-inproc", NUM_PAGES, PAGE_BYTES)
    try:
        yield peer
    finally:
        peer.close()


@pytest.fixture
def peer_factory(nixl_required: None) -> Iterator[Callable[..., Any]]:
    """``make(num_pages=NUM_PAGES, page_bytes=PAGE_BYTES, **kw) -> PeerProcess``.

    Every process made is reaped at teardown (``close()`` escalates to SIGKILL).
    """
    from stress.harness.peer import PeerProcess

    made: list[PeerProcess] = []

    def make(num_pages: int = NUM_PAGES, page_bytes: int = PAGE_BYTES, **kw: Any) -> Any:
        kw.setdefault("start_timeout_s", 60.0)
        proc = PeerProcess(num_pages, page_bytes, **kw)
        made.append(proc)
        return proc

    try:
        yield make
    finally:
        for proc in made:
            proc.close()


@pytest.fixture
def peer_process(peer_factory: Callable[..., Any]) -> Any:
    """A started PeerProcess with ``NUM_PAGES x PAGE_BYTES`` pages."""
    return peer_factory()
