"""Self-identifying source pages: the bytes a room sends name the room that sent them.

Rooms of a test run usually send pages of one shared prefill KV pool, so two rooms that send
the same prefill page send the same bytes: a digest found at a decode page then names a
*prefill page*, not the room whose write landed there. :class:`StampedSources` removes that
ambiguity for the reference driver (:class:`~stress.harness.driver.SchedulerDriver`): each room gets
source pages no other live room holds, and before its first chunk is sent the first
:data:`STAMP_BYTES` bytes of each of them are overwritten with a *stamp*::

    magic (8 B) | room (u64) | generation (u64) | chunk (u32) | intended decode page (u32)

(little endian). The rest of the page keeps its own bytes. Whatever lands at a decode page
then says who wrote it and where that write was meant to go (:func:`read_stamp`), and every
room's expected digests are its own (:meth:`StampedSources.stamp` returns them).

A source page goes back to the free set with the room's destination pages, by the same drain
rule (nothing of the room may still read it: a gather or a write in flight), so a page is
never re-stamped while an old write may still carry it.

Thread-safety: one scheduler thread calls :meth:`take`, :meth:`stamp` and :meth:`give_back`
(as the driver does); stamping writes only pages it just handed out, which no worker reads
then. :func:`read_stamp` is a pure function.
"""

from __future__ import annotations

import hashlib
import struct
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:  # a decode peer reads stamps without importing torch
    import torch

STAMP_MAGIC = b"NXSTAMP1"
_LAYOUT = struct.Struct("<8sQQII")
STAMP_BYTES = _LAYOUT.size
"""Bytes at the start of a page that carry the stamp (32)."""


@dataclass(frozen=True, slots=True)
class Stamp:
    """Who sent a page: the opening ``(room, generation)``, its chunk index, and the decode
    page the write was meant for."""

    room: int
    generation: int
    chunk: int
    dst_page: int

    def __str__(self) -> str:
        return (
            f"room {self.room} gen {self.generation} chunk {self.chunk} "
            f"(sent to decode page {self.dst_page})"
        )


def make_stamp(stamp: Stamp) -> bytes:
    """The :data:`STAMP_BYTES` header that names ``stamp``. Pure function.

    Raises:
        struct.error: a field out of range (negative, or too large for its width).
    """
    return _LAYOUT.pack(STAMP_MAGIC, stamp.room, stamp.generation, stamp.chunk, stamp.dst_page)


def read_stamp(page: bytes | bytearray | memoryview) -> Stamp | None:
    """The stamp at the start of ``page``'s bytes, or ``None`` when it carries none (e.g. a
    zeroed page, or a page torn so that its header is not a stamp). Pure function."""
    if len(page) < STAMP_BYTES:
        return None
    magic, room, gen, chunk, dst = _LAYOUT.unpack_from(bytes(page[:STAMP_BYTES]))
    if magic != STAMP_MAGIC:
        return None
    return Stamp(int(room), int(gen), int(chunk), int(dst))


class StampedSources:
    """Exclusive, stamped source pages of ``kv`` for the reference driver.

    Args:
        kv: the prefill KV pool (``[num_pages, page_bytes]`` uint8; pages of at least
            :data:`STAMP_BYTES` bytes).
        pages: the pages it may hand out (default: all); leave out pages something else
            sends (e.g. a canary's).

    Raises:
        ValueError: pages too small for a stamp, or a page index outside ``kv``.
    """

    def __init__(self, kv: torch.Tensor, pages: Iterable[int] | None = None) -> None:
        import torch  # the sender side only: a decode peer reads stamps without torch

        if kv.dim() != 2 or kv.dtype != torch.uint8 or kv.shape[1] < STAMP_BYTES:
            raise ValueError(f"kv must be [pages, >= {STAMP_BYTES}] uint8, got {tuple(kv.shape)}")
        chosen = list(range(kv.shape[0])) if pages is None else [int(p) for p in pages]
        if any(not 0 <= p < kv.shape[0] for p in chosen) or len(set(chosen)) != len(chosen):
            raise ValueError("pages must be distinct indices of kv")
        self._kv = kv
        self._np = kv.numpy()
        # Scheduler thread only: pages no live room holds, longest free first.
        self._free: deque[int] = deque(chosen)
        self.stamped = 0

    def available(self) -> int:
        """How many pages can be taken now. Scheduler thread."""
        return len(self._free)

    def take(self, need: int) -> npt.NDArray[np.int64]:
        """``need`` pages no live room holds (longest free first). Scheduler thread.

        Raises:
            ValueError: fewer than ``need`` pages are free (check :meth:`available`).
        """
        if need > len(self._free):
            raise ValueError(f"{need} source pages asked, {len(self._free)} free")
        return np.array([self._free.popleft() for _ in range(need)], dtype=np.int64)

    def stamp(
        self, room: int, generation: int, src: Sequence[int], dst: Sequence[int]
    ) -> list[str]:
        """Stamp ``src[i]`` as chunk ``i`` of opening ``(room, generation)``, meant for
        decode page ``dst[i]``; returns the blake2b-128 hex digest of each stamped page (what
        the decode page must hold once the room succeeded). Scheduler thread, before the
        room's first chunk is sent.

        Raises:
            ValueError: ``src`` and ``dst`` differ in length.
            struct.error: a field out of range for the stamp.
        """
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source pages for {len(dst)} decode pages")
        digests: list[str] = []
        for i, (s, d) in enumerate(zip(src, dst, strict=True)):
            header = np.frombuffer(make_stamp(Stamp(room, generation, i, int(d))), np.uint8)
            row = self._np[int(s)]
            row[:STAMP_BYTES] = header
            digests.append(hashlib.blake2b(row.tobytes(), digest_size=16).hexdigest())
        self.stamped += len(digests)
        return digests

    def give_back(self, pages: Iterable[int]) -> None:
        """Pages of a room nothing of which is in flight any more. Scheduler thread."""
        self._free.extend(int(p) for p in pages)


__all__ = [
    "STAMP_BYTES",
    "STAMP_MAGIC",
    "Stamp",
    "StampedSources",
    "make_stamp",
    "read_stamp",
]
