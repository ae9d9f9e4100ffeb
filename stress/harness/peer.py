"""The decode side: a KV pool that remote senders write into, in-process or as a process.

* :class:`DecodePeer` — a uint8 ``[num_pages, page_bytes]`` pool registered as region
  ``"kv"`` on its own :class:`~sender.transport.NixlTransport`, plus a notification pump
  thread that collects incoming per-transfer notifications into a thread-safe store and
  learns room notices (:mod:`sender.notices`: which openings the prefill side failed or
  cleared; the decode-side contract is in docs/PROTOCOL.md).
* ``python -m stress.harness.peer --listen 127.0.0.1:PORT --pages N --page-bytes B`` runs a
  DecodePeer behind a tiny loopback TCP control channel (PORT 0 picks a free port). The first
  line on stdout is ``LISTENING 127.0.0.1:<port>``; afterwards stdout is redirected to stderr.
  Another local address (e.g. the peer's own address inside a network namespace of a test
  topology, ``stress.netns``) needs the explicit opt-in ``--allow-host ADDR``.
* :class:`PeerProcess` — the client used by tests, the stress suite and benchmarks: starts
  such a process, fetches its metadata, queries it, and can SIGKILL/SIGSTOP/SIGCONT/restart it.
  It can start the child inside a network namespace (``netns``) with extra environment
  (e.g. ``UCX_TLS=tcp``) and reach it on that namespace's address. ``close()`` always reaps
  the process.

Control channel (our own protocol; loopback unless ``--allow-host``). Every message in both
directions is one frame: a big-endian u32 ``frame_len``, then a big-endian u32
``header_len``, a UTF-8 JSON header and ``frame_len - 4 - header_len`` bytes of raw body.
Requests are
``{"cmd": <name>, ...}``; replies are ``{"ok": true, ...}`` or ``{"ok": false, "error": str}``.
Commands: ``ping``, ``metadata`` (body = metadata), ``notifs`` (hex-encoded per-transfer
messages), ``clear_notifs``, ``digest`` (``pages``), ``read`` (``pages``; body = page bytes),
``zero`` (``pages`` or null for all), ``room_notices`` (``since``, ``limit``: a page of the
room-notice history), ``assign_pages`` (``room``, ``gen``, ``pages``), ``release_pages``
(``room``, ``gen``), ``free_pages``, ``shutdown``. Frames are bounded per command and read
incrementally; every bad frame is answered with an error reply (limits and rules:
docs/PROTOCOL.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, NamedTuple

from stress.harness._peer_args import HOST as _HOST
from stress.harness._peer_args import is_ipv4 as _is_ipv4
from stress.harness._peer_args import parse_args

if __name__ == "__main__":
    # `python -m stress.harness.peer`: the arguments are checked before numpy, NIXL and torch load
    # (2-4 s), so --help and bad arguments answer at once; main() parses them again.
    parse_args(sys.argv[1:])

import numpy as np
import numpy.typing as npt

from sender import _nixl
from sender.errors import TransportClosedError, TransportParamError
from sender.notices import NoticeError, decode_notice, is_notice
from sender.transport import (
    DEFAULT_PROGRESS_DELAY_US,
    NixlTransport,
    PageIndices,
)
from stress.harness.landings import Landing, LandingLog

if TYPE_CHECKING:  # imported lazily: a CPU peer process starts ~2 s faster without torch
    import torch

__all__ = [
    "DEFAULT_MAX_FAILED_ROOMS",
    "DecodePeer",
    "FrameError",
    "LearntRoom",
    "MetadataBytes",
    "NoticePage",
    "NoticeRecord",
    "NoticeStats",
    "PeerError",
    "PeerProcess",
    "PeerStartError",
    "PeerServer",
    "main",
]

logger = logging.getLogger(__name__)

DEFAULT_NOTIF_INTERVAL_S = 0.001
DEFAULT_NOTIF_IDLE_INTERVAL_S = 0.01
_IDLE_AFTER_S = 0.1
_FRAME = struct.Struct(">I")
# Control-channel limits (docs/PROTOCOL.md). Requests carry no body; their header is a small
# JSON object, plus a list of page indices for the page commands (see _request_limits).
_SMALL_HEADER = 256
_SMALL_COMMANDS = (
    "ping",
    "metadata",
    "notifs",
    "clear_notifs",
    "shutdown",
    "room_notices",
    "release_pages",
    "free_pages",
    "landings",
)
_PAGE_COMMANDS = ("digest", "read", "zero", "assign_pages")
# Replies, read by PeerProcess from its own child: a header of notifications or digests, a
# body of the metadata or of exactly the pages asked for.
_MAX_REPLY_HEADER = 64 << 20
_MAX_METADATA = 1 << 20

DEFAULT_MAX_FAILED_ROOMS = 65536
"""Room notices a :class:`DecodePeer` keeps (oldest dropped first, counted)."""
MAX_NOTICES_PER_REPLY = 1024
"""Most notice records one ``room_notices`` reply carries (a reply stays under ~300 KB)."""
_MAX_SENDER_NAME = 128
"""A notice's sender agent name is kept clipped to this many characters."""


class PeerError(RuntimeError):
    """A peer process failed to start, answered with an error, or did not answer in time."""


class PeerStartError(PeerError):
    """A :class:`PeerProcess` child did not start: it exited, or did not listen or answer in
    time. The message carries its exit status and the last lines it wrote on stderr before
    that (kept whatever ``stderr`` the caller gave, ``DEVNULL`` included).

    Attributes:
        status: The child's exit status (negative: killed by that signal; by us when it did
            not start in time), or ``None`` if it could not be reaped.
        stderr_tail: Its last stderr lines from before it listened ("" when none).
    """

    def __init__(self, message: str, status: int | None, stderr_tail: str) -> None:
        super().__init__(message)
        self.status = status
        self.stderr_tail = stderr_tail


class LearntRoom(NamedTuple):
    """What a decode peer learnt about one opening ``(room, gen)`` from a room notice:
    ``outcome`` (``"failed"`` or ``"cleared"``), ``code`` (why, :data:`sender.notices.CODES`)
    and ``learnt_at``, the ``time.monotonic()`` of the peer's notification pump when it
    collected the notice (system-wide on Linux: comparable with another process's
    ``time.monotonic()`` on the same host, not across hosts)."""

    outcome: str
    code: str
    learnt_at: float


class NoticeRecord(NamedTuple):
    """One entry of a peer's notice history: ``seq`` numbers entries 1, 2, ... in the order
    they were learnt (no gaps; the oldest are dropped past the cap); ``sender`` is the NIXL
    agent name of the prefill side that sent it (clipped to 128 characters)."""

    seq: int
    room: int
    gen: int
    outcome: str
    code: str
    learnt_at: float
    sender: str

    @property
    def learnt(self) -> LearntRoom:
        """The ``(outcome, code, learnt_at)`` part."""
        return LearntRoom(self.outcome, self.code, self.learnt_at)


@dataclass(frozen=True, slots=True)
class NoticeStats:
    """Room-notice counters of a decode peer.

    Attributes:
        learnt: notices learnt (one per opening; duplicates not counted here).
        duplicates: notices for an opening already known (e.g. two sessions of one room on
            this peer); the first one is kept.
        refused: messages claiming to be room notices (``NXSTG-ROOM/``) that were malformed
            or of another version: counted and dropped.
        dropped: learnt notices dropped from the history past its cap (oldest first).
        held: notices held now (at most the cap).
        assigned_rooms: openings with pages assigned (:meth:`DecodePeer.assign_pages`).
        assignments_dropped: assignments dropped past the cap (oldest first).
        pages_freed: pages freed by notices so far (counted once per freeing).
        free_pages: pages marked free now.
    """

    learnt: int = 0
    duplicates: int = 0
    refused: int = 0
    dropped: int = 0
    held: int = 0
    assigned_rooms: int = 0
    assignments_dropped: int = 0
    pages_freed: int = 0
    free_pages: int = 0


@dataclass(frozen=True, slots=True)
class NoticePage:
    """One page of a peer's notice history (:meth:`PeerProcess.room_notices`): the records
    with ``seq > since`` (at most the asked limit), ``next`` (the ``since`` of the next page),
    ``more`` (more records are held past this page), ``first`` (the oldest ``seq`` still
    held; records between ``since`` and it were dropped) and the peer's counters."""

    records: tuple[NoticeRecord, ...]
    next: int
    more: bool
    first: int
    stats: NoticeStats


# --------------------------------------------------------------------------- DecodePeer


class DecodePeer:
    """A decode-side KV pool on its own NIXL transport, with a notification pump.

    The pump separates two kinds of notification (docs/PROTOCOL.md):

    * per-transfer notifications (``write_pages(..., notif=...)``): collected as they are
      (:meth:`notifs`, :meth:`wait_notif`). They mean "these bytes landed", never "the room
      succeeded".
    * room notices (:mod:`sender.notices`, ``NXSTG-ROOM/1 ...``): the prefill side failed or
      cleared that opening ``(room, gen)`` before ``Success`` and every posted write of it has
      ended. Learnt into :meth:`failed_rooms` / :meth:`room_notices` (a history capped at
      ``max_failed_rooms``, oldest dropped and counted); pages the decode side assigned to
      that opening (:meth:`assign_pages`) are marked free at once (:meth:`free_pages`).
      Malformed notices and other versions are counted (``notice_stats().refused``) and
      dropped; they never reach :meth:`notifs` and never stop the pump.

    When the two disagree the room notice wins: an opening known as failed stays failed,
    whatever per-transfer notifications of it arrive before or after.

    Args:
        name: NIXL agent name (unique among connected agents).
        num_pages: Pages in the pool.
        page_bytes: Bytes per page.
        device: Torch device of the pool (``"cpu"`` or a CUDA device).
        notif_interval_s: Pump period while notifications arrive or someone waits.
        notif_idle_interval_s: Pump period after 0.1 s without notifications or waiters.
        progress_delay_us: Passed to :class:`NixlTransport`.
        max_failed_rooms: Room notices kept (and page assignments kept), oldest dropped.

    All methods are thread-safe.

    Raises:
        TransportParamError: Bad sizes.
        ImportError: NIXL is unavailable.
    """

    def __init__(
        self,
        name: str,
        num_pages: int,
        page_bytes: int,
        *,
        device: str = "cpu",
        notif_interval_s: float = DEFAULT_NOTIF_INTERVAL_S,
        notif_idle_interval_s: float = DEFAULT_NOTIF_IDLE_INTERVAL_S,
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
        max_failed_rooms: int = DEFAULT_MAX_FAILED_ROOMS,
    ) -> None:
        """Make a :class:`DecodePeer`: every argument and what it raises are in the
        class docstring (``help(DecodePeer)``)."""
        if type(max_failed_rooms) is not int or max_failed_rooms <= 0:
            raise TransportParamError(
                f"max_failed_rooms must be a positive int, got {max_failed_rooms!r}"
            )
        if type(num_pages) is not int or num_pages <= 0:
            raise TransportParamError(f"num_pages must be a positive int, got {num_pages!r}")
        if type(page_bytes) is not int or page_bytes <= 0:
            raise TransportParamError(f"page_bytes must be a positive int, got {page_bytes!r}")
        if not 0 < notif_interval_s <= notif_idle_interval_s:
            raise TransportParamError("need 0 < notif_interval_s <= notif_idle_interval_s")
        self._num_pages = num_pages
        self._page_bytes = page_bytes
        self._interval = float(notif_interval_s)
        self._idle_interval = float(notif_idle_interval_s)
        self._device = str(device)
        # A CPU pool is a numpy array (no torch import needed); other devices use torch.
        self._pool_np: npt.NDArray[np.uint8] | None = None
        self._pool_t: torch.Tensor | None = None
        self._transport = NixlTransport(name, progress_delay_us=progress_delay_us)
        try:
            if self._device == "cpu":
                self._pool_np = np.zeros((num_pages, page_bytes), dtype=np.uint8)
                self._transport.register_region("kv", self._pool_np, page_bytes)
            else:
                import torch

                self._pool_t = torch.zeros(
                    (num_pages, page_bytes), dtype=torch.uint8, device=self._device
                )
                self._transport.register_region("kv", self._pool_t, page_bytes)
            self._metadata = self._transport.metadata()
        except BaseException:
            self._transport.close()
            raise
        # _cond guards _notifs, _seen, _closed and the room-notice state below.
        self._cond = threading.Condition(threading.Lock())
        self._notifs: dict[str, list[bytes]] = {}  # guarded by _cond
        self._seen: set[bytes] = set()  # guarded by _cond
        self._closed = False  # guarded by _cond
        self._waiters = 0  # guarded by _cond; threads inside wait_notif()/wait_room_failed()
        # Room notices (guarded by _cond): the history in learning order (seq 1, 2, ... with
        # no gaps; the oldest dropped past the cap) and the same records by opening.
        self._max_failed = max_failed_rooms
        self._history: deque[NoticeRecord] = deque()
        self._failed: dict[tuple[int, int], NoticeRecord] = {}
        self._seq = 0
        # Pages the decode side handed to an opening, until a notice frees them (or the
        # decode side releases them); pages marked free. Guarded by _cond.
        self._assigned: dict[tuple[int, int], tuple[int, ...]] = {}
        self._free: set[int] = set()
        self._counts = dict.fromkeys(
            ("learnt", "duplicates", "refused", "dropped", "assignments_dropped", "pages_freed"),
            0,
        )  # guarded by _cond
        self._stop = threading.Event()
        self._pump = threading.Thread(
            target=self._pump_loop, name=f"decode-peer-pump[{name}]", daemon=True
        )
        self._pump.start()

    # ------------------------------------------------------------------ properties

    @property
    def name(self) -> str:
        """NIXL agent name (the key of this peer's messages on the other side)."""
        return self._transport.name

    @property
    def num_pages(self) -> int:
        """Pages in the pool."""
        return self._num_pages

    @property
    def page_bytes(self) -> int:
        """Bytes per page."""
        return self._page_bytes

    @property
    def pool(self) -> torch.Tensor:
        """The registered KV pool as a tensor (uint8 ``[num_pages, page_bytes]``).

        For a CPU pool this is a zero-copy view of the registered numpy array (imports torch).
        """
        if self._pool_t is None:
            import torch

            assert self._pool_np is not None
            self._pool_t = torch.from_numpy(self._pool_np)
        return self._pool_t

    def pool_array(self) -> npt.NDArray[np.uint8] | None:
        """The registered CPU pool as its numpy array (no torch import); ``None`` for a
        device pool."""
        return self._pool_np

    @property
    def transport(self) -> NixlTransport:
        """The peer's own transport (tests use it for stats)."""
        return self._transport

    def metadata(self) -> bytes:
        """Metadata to pass to a sender's ``NixlTransport.add_peer``.

        Thread-safety: safe from any thread (reads ``_closed`` under ``_cond``).

        Raises:
            TransportClosedError: the peer is closed: its agent and pool are gone, and a
                sender given the old metadata would write into deregistered memory.
        """
        with self._cond:
            if self._closed:
                raise TransportClosedError(
                    f"decode peer {self.name!r} is closed: its metadata is stale "
                    "(its agent and KV pool are gone)"
                )
        return self._metadata

    # ------------------------------------------------------------------ notifications

    def _pump_loop(self) -> None:
        # Adaptive interval: fast (_interval) while notifications arrive or someone waits in
        # wait_notif(), backing off to _idle_interval after _IDLE_AFTER_S of silence. Each
        # wake-up costs ~20-40 us of Python; at 1 ms forever the pump alone would cost ~4 %
        # of a core, at 10 ms ~1 %.
        interval = self._interval
        last_activity = time.monotonic()
        while not self._stop.wait(interval):
            try:
                got = self._transport.get_notifs()
            except TransportClosedError:
                return
            except Exception as exc:  # keep pumping; NIXL hiccups must not kill the thread
                logger.warning("notification pump of %s: %s", self.name, exc)
                continue
            now = time.monotonic()
            with self._cond:
                if got:
                    for agent, msgs in got.items():
                        plain = [m for m in msgs if not is_notice(m)]
                        if len(plain) < len(msgs):
                            for m in msgs:
                                if is_notice(m):
                                    self._learn_locked(agent, m, now)
                        if plain:
                            self._notifs.setdefault(agent, []).extend(plain)
                            self._seen.update(plain)
                    self._cond.notify_all()
                busy = bool(got) or self._waiters > 0
            if busy:
                last_activity = now
                interval = self._interval
            elif now - last_activity > _IDLE_AFTER_S:
                interval = min(interval * 2, self._idle_interval)

    def _learn_locked(self, agent: str, message: bytes, now: float) -> None:
        """Learn one room notice (caller holds ``_cond``). Never raises: a malformed
        notice, one of another version, or anything unexpected is counted and dropped."""
        try:
            notice = decode_notice(message)
        except NoticeError:
            self._counts["refused"] += 1
            return
        except Exception:  # never let a bad message stop the pump
            self._counts["refused"] += 1
            logger.warning("room notice from %s refused: %r", agent, message[:64])
            return
        key = (notice.room, notice.gen)
        # mutant-site: learn-locked
        if key in self._failed:
            self._counts["duplicates"] += 1
            return
        self._seq += 1
        record = NoticeRecord(
            self._seq,
            notice.room,
            notice.gen,
            notice.outcome,
            notice.code,
            now,
            str(agent)[:_MAX_SENDER_NAME],
        )
        self._history.append(record)
        self._failed[key] = record
        self._counts["learnt"] += 1
        while len(self._history) > self._max_failed:
            old = self._history.popleft()
            del self._failed[(old.room, old.gen)]
            self._counts["dropped"] += 1
        pages = self._assigned.pop(key, None)
        if pages:
            self._free.update(pages)
            self._counts["pages_freed"] += len(pages)

    def failed_rooms(self) -> dict[tuple[int, int], LearntRoom]:
        """Openings known as failed or cleared from room notices:
        ``(room, gen) -> (outcome, code, learnt_at)``, oldest first (at most
        ``max_failed_rooms``; older ones were dropped, see :meth:`notice_stats`).

        Thread-safety: safe from any thread; returns a copy.

        Raises:
            Nothing.
        """
        with self._cond:
            return {key: rec.learnt for key, rec in self._failed.items()}

    def room_failed(self, room: int, gen: int) -> LearntRoom | None:
        """What a room notice said about opening ``(room, gen)``, or ``None`` (no notice
        learnt, or dropped from the history).

        Thread-safety: safe from any thread.

        Raises:
            Nothing.
        """
        with self._cond:
            rec = self._failed.get((room, gen))
            return None if rec is None else rec.learnt

    def room_notices(
        self, since: int = 0, limit: int = MAX_NOTICES_PER_REPLY
    ) -> tuple[tuple[NoticeRecord, ...], bool, int]:
        """Notice records with ``seq > since``, oldest first, at most ``limit``; also
        whether more are held past them and the oldest ``seq`` still held (``0`` when none).

        Thread-safety: safe from any thread.

        Raises:
            TransportParamError: ``since`` not an int >= 0 or ``limit`` not an int >= 1.
        """
        if type(since) is not int or since < 0:
            raise TransportParamError(f"since must be an int >= 0, got {since!r}")
        if type(limit) is not int or limit < 1:
            raise TransportParamError(f"limit must be an int >= 1, got {limit!r}")
        with self._cond:
            if not self._history:
                return (), False, 0
            first = self._history[0].seq
            start = max(0, since + 1 - first)
            out = tuple(itertools.islice(self._history, start, start + limit))
            more = start + limit < len(self._history)
            return out, more, first

    def wait_room_failed(self, room: int, gen: int, timeout_s: float) -> LearntRoom | None:
        """Wait until a room notice for ``(room, gen)`` was learnt; ``None`` on timeout or
        close.

        Thread-safety: safe from any thread.

        Raises:
            Nothing.
        """
        key = (room, gen)
        with self._cond:
            self._waiters += 1
            try:
                self._cond.wait_for(lambda: key in self._failed or self._closed, timeout_s)
                rec = self._failed.get(key)
                return None if rec is None else rec.learnt
            finally:
                self._waiters -= 1

    def notice_stats(self) -> NoticeStats:
        """Room-notice counters (one consistent snapshot).

        Thread-safety: safe from any thread.

        Raises:
            Nothing.
        """
        with self._cond:
            return NoticeStats(
                held=len(self._history),
                assigned_rooms=len(self._assigned),
                free_pages=len(self._free),
                **self._counts,
            )

    # ------------------------------------------------------------------ page ledger

    def assign_pages(self, room: int, gen: int, pages: PageIndices) -> bool:
        """The decode side hands ``pages`` to opening ``(room, gen)`` of a prefill sender
        (its destination pages). They leave :meth:`free_pages`; a room notice for that
        opening marks them free again. Returns ``False`` when a notice for it was already
        learnt: the pages are then marked free at once (the room will not complete).

        A second call for the same opening replaces its pages. At most
        ``max_failed_rooms`` openings are tracked (the oldest assignment is dropped and
        counted in ``notice_stats().assignments_dropped``). Optional: a decode side that
        does not call it just reads :meth:`failed_rooms`.

        Thread-safety: safe from any thread.

        Raises:
            TransportParamError: bad ``room``/``gen`` (not ints >= 0) or bad page indices.
        """
        key = _opening(room, gen)
        idx = tuple(int(p) for p in self._indices(pages))
        # mutant-site: assign-pages
        with self._cond:
            if key in self._failed:
                self._free.update(idx)
                self._counts["pages_freed"] += len(idx)
                return False
            self._assigned.pop(key, None)
            self._assigned[key] = idx
            self._free.difference_update(idx)
            while len(self._assigned) > self._max_failed:
                del self._assigned[next(iter(self._assigned))]
                self._counts["assignments_dropped"] += 1
            return True

    def release_pages(self, room: int, gen: int) -> tuple[int, ...]:
        """The decode side is done with opening ``(room, gen)`` (e.g. it completed): forget
        its assignment and mark its pages free. Returns them (empty when none was assigned
        or a notice already freed them).

        Thread-safety: safe from any thread.

        Raises:
            TransportParamError: bad ``room``/``gen``.
        """
        key = _opening(room, gen)
        with self._cond:
            pages = self._assigned.pop(key, ())
            self._free.update(pages)
            return pages

    def free_pages(self) -> list[int]:
        """Pages marked free (by a room notice or :meth:`release_pages`) and not assigned
        again since, sorted.

        Thread-safety: safe from any thread.

        Raises:
            Nothing.
        """
        with self._cond:
            return sorted(self._free)

    def notifs(self) -> dict[str, list[bytes]]:
        """All per-transfer notifications collected so far (sender agent name -> messages,
        in order). Room notices are not among them (see :meth:`failed_rooms`).

        Thread-safety: safe from any thread; returns a copy.
        """
        with self._cond:
            return {k: list(v) for k, v in self._notifs.items()}

    def clear_notifs(self) -> None:
        """Forget all collected notifications.

        Thread-safety: safe from any thread.
        """
        with self._cond:
            self._notifs.clear()
            self._seen.clear()

    def wait_notif(self, msg: bytes, timeout_s: float) -> bool:
        """Wait until notification ``msg`` has been collected; False on timeout or close.

        Thread-safety: safe from any thread.
        """
        with self._cond:
            self._waiters += 1
            try:
                self._cond.wait_for(lambda: msg in self._seen or self._closed, timeout_s)
                return msg in self._seen
            finally:
                self._waiters -= 1

    # ------------------------------------------------------------------ pages

    def _indices(self, pages: PageIndices) -> npt.NDArray[np.int64]:
        arr = np.asarray(pages)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise TransportParamError("pages must be a 1-D sequence of ints")
        arr = arr.astype(np.int64)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= self._num_pages):
            raise TransportParamError(f"page index out of range ({self._num_pages} pages)")
        return arr

    def _rows(self, pages: PageIndices) -> npt.NDArray[np.uint8]:
        idx = self._indices(pages)
        if self._pool_np is not None:
            return self._pool_np[idx]
        assert self._pool_t is not None
        import torch

        rows: npt.NDArray[np.uint8] = (
            self._pool_t[torch.from_numpy(idx).to(self._pool_t.device)].cpu().numpy()
        )
        return rows

    def read_pages(self, pages: PageIndices) -> bytes:
        """Bytes of the given pages, concatenated in the given order.

        Thread-safety: safe from any thread (reads may race with incoming writes).

        Raises:
            TransportParamError: Bad or out-of-range page indices.
        """
        return self._rows(pages).tobytes()

    def page_digest(self, pages: PageIndices) -> list[str]:
        """blake2b-128 hex digest of each page, in the given order.

        Thread-safety: safe from any thread.

        Raises:
            TransportParamError: Bad or out-of-range page indices.
        """
        return [page_digest_bytes(row.tobytes()) for row in self._rows(pages)]

    def zero_pages(self, pages: PageIndices | None = None) -> None:
        """Zero the given pages (all when ``None``).

        Thread-safety: safe from any thread.

        Raises:
            TransportParamError: Bad or out-of-range page indices.
        """
        if self._pool_np is not None:
            if pages is None:
                self._pool_np.fill(0)
            else:
                self._pool_np[self._indices(pages)] = 0
            return
        assert self._pool_t is not None
        if pages is None:
            self._pool_t.zero_()
        else:
            import torch

            idx = torch.from_numpy(self._indices(pages)).to(self._pool_t.device)
            self._pool_t[idx] = 0

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop and join the pump thread, then close the transport. Idempotent.

        Thread-safety: safe from any thread (not from the pump thread itself).
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._stop.set()
        self._pump.join(timeout=10.0)
        self._transport.close()

    def __enter__(self) -> DecodePeer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _opening(room: object, gen: object) -> tuple[int, int]:
    """``(room, gen)`` checked: both exact ints >= 0."""
    if type(room) is not int or room < 0 or type(gen) is not int or gen < 0:
        raise TransportParamError(f"room and gen must be ints >= 0, got {room!r}, {gen!r}")
    return room, gen


def page_digest_bytes(data: bytes) -> str:
    """The digest :meth:`DecodePeer.page_digest` uses for one page's bytes."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


# --------------------------------------------------------------------------- framing


class FrameError(ValueError):
    """A control-channel frame broke the format or a limit (docs/PROTOCOL.md).

    ``fatal`` is True when the frame's length itself was refused or the frame did not arrive
    in time: the stream cannot be resynchronised, so the server closes the connection after
    its error reply. Otherwise the whole frame was consumed and the connection stays usable.
    """

    def __init__(self, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


@dataclass(frozen=True)
class _Frame:
    header: dict[str, Any]
    body: bytes
    header_len: int


def _request_limits(num_pages: int) -> dict[str, tuple[int, int]]:
    """Per command, the largest request header and body (bytes) a peer of ``num_pages``
    pages accepts. Requests carry no body; a header is ``{"cmd": ...}`` plus, for the page
    commands, a list of page indices (each at most ``len(str(num_pages))`` digits and a
    ``", "`` separator)."""
    pages_header = _SMALL_HEADER + num_pages * (len(str(num_pages)) + 2)
    limits = dict.fromkeys(_SMALL_COMMANDS, (_SMALL_HEADER, 0))
    limits.update(dict.fromkeys(_PAGE_COMMANDS, (pages_header, 0)))
    return limits


def _send_frame(sock: socket.socket, header: dict[str, Any], body: bytes = b"") -> None:
    head = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_FRAME.pack(_FRAME.size + len(head) + len(body)) + _FRAME.pack(len(head)))
    sock.sendall(head)
    if body:
        sock.sendall(body)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytearray:
    """Read exactly ``n`` bytes (``n`` is already bounded by the caller's limits)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FrameError("frame not complete in time", fatal=True)
            sock.settimeout(remaining)
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            raise FrameError("frame not complete in time", fatal=True) from None
        if k == 0:
            raise ConnectionError("connection closed mid-frame")
        got += k
    return buf


def _read_frame(
    sock: socket.socket, max_header: int, max_body: int, timeout_s: float | None
) -> _Frame | None:
    """Read one frame, refusing lengths over the limits before allocating anything.

    Waits for the first byte as long as the socket's own timeout allows (``TimeoutError``
    propagates); the rest of the frame must follow within ``timeout_s``. Returns None on a
    clean EOF before the first byte.

    Raises:
        FrameError: A length over a limit (fatal), a frame not complete in time (fatal), or
            a bad header: inconsistent length, not UTF-8, not JSON, nested too deep, not an
            object (not fatal: the frame was consumed).
        ConnectionError: The connection closed mid-frame.
        OSError: Any other socket error.
    """
    first = sock.recv(_FRAME.size)
    if not first:
        return None
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    prefix = first + _recv_exact(sock, _FRAME.size - len(first), deadline)
    (total,) = _FRAME.unpack(prefix)
    limit = _FRAME.size + max_header + max_body
    if total < _FRAME.size:
        raise FrameError(f"frame length {total} is shorter than its header length", fatal=True)
    if total > limit:
        raise FrameError(f"frame of {total} bytes exceeds the limit of {limit}", fatal=True)
    payload = _recv_exact(sock, total, deadline)
    (hlen,) = _FRAME.unpack_from(payload)
    if hlen > total - _FRAME.size:
        raise FrameError(f"header length {hlen} exceeds the frame ({total} bytes)")
    if hlen > max_header:
        raise FrameError(f"header of {hlen} bytes exceeds the limit of {max_header}")
    if total - _FRAME.size - hlen > max_body:
        raise FrameError(
            f"body of {total - _FRAME.size - hlen} bytes exceeds the limit of {max_body}"
        )
    try:
        header = json.loads(payload[_FRAME.size : _FRAME.size + hlen].decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError: bad JSON or an int literal past Python's digit limit; RecursionError:
        # nested too deep.
        raise FrameError(f"bad header: {type(exc).__name__}: {_clip(str(exc))}") from None
    if not isinstance(header, dict):
        raise FrameError(f"frame header is a JSON {type(header).__name__}, not an object")
    return _Frame(header, bytes(payload[_FRAME.size + hlen :]), hlen)


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- server


class PeerServer:
    """Serves one :class:`DecodePeer` over the loopback control channel.

    An accept thread hands each connection to its own daemon thread. Every frame is checked
    against the per-command limits of docs/PROTOCOL.md before anything is allocated for it,
    and every bad frame gets an ``{"ok": false, "error": ...}`` reply: the connection stays
    open after a frame that was read whole, and is closed after one whose length was
    refused. Binds to ``host`` (127.0.0.1 unless the caller opts in to another address).

    Args:
        peer: The decode peer to serve.
        port: TCP port (0 = any free port; see ``port``).
        host: Local IPv4 address to bind (default 127.0.0.1; ``main`` allows another one
            only with ``--allow-host``).
        io_timeout_s: How long an idle connection may wait for its next frame, and how long
            the rest of a frame may take after its first byte.
        max_connections: Connections served at once; more get an error reply and are closed.

    Thread-safety: ``close``/``shutdown_requested`` are safe from any thread.

    Raises:
        OSError: The port cannot be bound.
    """

    def __init__(
        self,
        peer: DecodePeer,
        port: int = 0,
        io_timeout_s: float = 30.0,
        max_connections: int = 64,
        host: str = _HOST,
    ) -> None:
        self._peer = peer
        self._io_timeout = io_timeout_s
        self._max_connections = max_connections
        self._limits = _request_limits(peer.num_pages)
        self._max_header = max(h for h, _ in self._limits.values())
        self._max_body = max(b for _, b in self._limits.values())
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except BaseException:
            self._sock.close()
            raise
        self.host = host
        self._sock.listen(16)
        self._sock.settimeout(0.2)
        self.port: int = self._sock.getsockname()[1]
        self.shutdown_requested = threading.Event()
        self.landings: LandingLog | None = None  # set once, before requests (main())
        self._stop = threading.Event()
        # _lock guards _closing, _conns and _workers. A connection leaves _conns (under the
        # lock) before its socket is closed, so close() never shuts down a reused fd.
        self._lock = threading.Lock()
        self._closing = False
        self._conns: set[socket.socket] = set()
        self._workers: set[threading.Thread] = set()
        self._acceptor = threading.Thread(target=self._accept_loop, name="peer-accept", daemon=True)
        self._acceptor.start()

    def _accept_loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    conn, _ = self._sock.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return  # close() shut the listening socket down
                with self._lock:
                    closing = self._closing
                    full = len(self._conns) >= self._max_connections
                    if not closing and not full:
                        self._conns.add(conn)
                        self._workers = {w for w in self._workers if w.is_alive()}
                        t = threading.Thread(
                            target=self._serve, args=(conn,), name="peer-conn", daemon=True
                        )
                        self._workers.add(t)
                        t.start()  # under the lock: close() never sees an unstarted worker
                if closing:
                    conn.close()
                    return
                if full:
                    with conn:
                        conn.settimeout(1.0)
                        self._reply(conn, {"ok": False, "error": "too many connections"})
        except Exception:  # a bug here must not end the thread silently
            logger.exception("peer control channel: accept loop failed")

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._serve_conn(conn)
        except Exception:  # a bug here must not end the thread silently
            logger.exception("peer control channel: connection failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _serve_conn(self, conn: socket.socket) -> None:
        while not self._stop.is_set():
            conn.settimeout(self._io_timeout)
            try:
                frame = _read_frame(conn, self._max_header, self._max_body, self._io_timeout)
            except FrameError as bad:
                if not self._reply(conn, {"ok": False, "error": str(bad)}) or bad.fatal:
                    return
                continue
            except OSError:  # EOF mid-frame, idle timeout, reset, or close() shut it down
                return
            if frame is None:
                return
            reply, out = self._dispatch(frame)
            if not self._reply(conn, reply, out):
                return

    def _reply(self, conn: socket.socket, header: dict[str, Any], body: bytes = b"") -> bool:
        try:
            _send_frame(conn, header, body)
        except OSError:
            return False
        return True

    def _dispatch(self, frame: _Frame) -> tuple[dict[str, Any], bytes]:
        cmd = frame.header.get("cmd")
        limits = self._limits.get(cmd) if isinstance(cmd, str) else None
        if limits is None:
            return {"ok": False, "error": f"unknown command {_clip(repr(cmd), 60)}"}, b""
        max_header, max_body = limits
        if frame.header_len > max_header:
            error = f"header of {frame.header_len} bytes exceeds the limit of {max_header}"
            return {"ok": False, "error": f"{cmd}: {error}"}, b""
        if len(frame.body) > max_body:
            error = f"body of {len(frame.body)} bytes exceeds the limit of {max_body}"
            return {"ok": False, "error": f"{cmd}: {error}"}, b""
        try:
            return self._handle(frame.header, frame.body)
        except Exception as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {_clip(str(exc))}"}, b""

    def _handle(self, req: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        cmd = req.get("cmd")
        peer = self._peer
        if cmd == "ping":
            return {"ok": True, "pid": os.getpid(), "name": peer.name}, b""
        if cmd == "metadata":
            return {"ok": True, "name": peer.name}, peer.metadata()
        if cmd == "notifs":
            hexed = {k: [m.hex() for m in v] for k, v in peer.notifs().items()}
            return {"ok": True, "notifs": hexed}, b""
        if cmd == "clear_notifs":
            peer.clear_notifs()
            return {"ok": True}, b""
        if cmd == "digest":
            return {"ok": True, "digests": peer.page_digest(_pages_arg(req, peer))}, b""
        if cmd == "read":
            return {"ok": True}, peer.read_pages(_pages_arg(req, peer))
        if cmd == "zero":
            pages = req.get("pages")
            peer.zero_pages(None if pages is None else _pages_arg(req, peer))
            return {"ok": True}, b""
        if cmd == "room_notices":
            since = req.get("since", 0)
            limit = req.get("limit", MAX_NOTICES_PER_REPLY)
            if type(limit) is not int or not 1 <= limit <= MAX_NOTICES_PER_REPLY:
                raise TransportParamError(
                    f"'limit' must be an int in 1..{MAX_NOTICES_PER_REPLY}, got {limit!r}"
                )
            records, more, first = peer.room_notices(since, limit)
            return {
                "ok": True,
                "notices": [list(r) for r in records],
                "next": records[-1].seq if records else max(since, first - 1, 0),
                "more": more,
                "first": first,
                "stats": dataclasses.asdict(peer.notice_stats()),
            }, b""
        if cmd == "assign_pages":
            room, gen = _opening(req.get("room"), req.get("gen"))
            assigned = peer.assign_pages(room, gen, _pages_arg(req, peer))
            return {"ok": True, "assigned": assigned}, b""
        if cmd == "release_pages":
            released = peer.release_pages(*_opening(req.get("room"), req.get("gen")))
            return {"ok": True, "pages": list(released)}, b""
        if cmd == "free_pages":
            return {"ok": True, "pages": peer.free_pages()}, b""
        if cmd == "landings":
            if self.landings is None:
                raise ValueError("this peer does not watch stamps (--watch-stamps)")
            since = req.get("since", 0)
            if type(since) is not int:
                raise TransportParamError(f"'since' must be an int, got {since!r}")
            got = self.landings.records(since)
            return {
                "ok": True,
                "landings": [list(r) for r in got],
                "scans": self.landings.scans,
            }, b""
        if cmd == "shutdown":
            self.shutdown_requested.set()
            return {"ok": True}, b""
        raise ValueError(f"unknown command {_clip(repr(cmd), 60)}")

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop accepting, shut every open connection down and join all threads.

        Bounded: idle connections are woken by the shutdown, so this takes about the time
        of the slowest request in progress, at most ``timeout_s`` in all. Idempotent.

        Thread-safety: safe from any thread (not from a connection thread).

        Raises:
            Nothing (socket errors while shutting down are ignored).
        """
        self._stop.set()
        with self._lock:
            self._closing = True
            workers = list(self._workers)
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)  # wakes a recv() blocked on it
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
        with contextlib.suppress(OSError):
            self._sock.close()
        deadline = time.monotonic() + timeout_s
        self._acceptor.join(timeout=max(0.0, deadline - time.monotonic()))
        for w in workers:
            w.join(timeout=max(0.0, deadline - time.monotonic()))


def _pages_arg(req: dict[str, Any], peer: DecodePeer) -> list[int]:
    pages = req.get("pages")
    if not isinstance(pages, list) or not all(type(p) is int for p in pages):
        raise TransportParamError("'pages' must be a list of ints")
    if len(pages) > peer.num_pages:
        raise TransportParamError(f"'pages' lists more than the pool's {peer.num_pages} pages")
    return pages


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m stress.harness.peer``; returns the exit status.

    Raises:
        SystemExit: ``--help`` (status 0) or bad arguments (status 2, one line on stderr).
    """
    ap, args = parse_args(argv)
    host, port_s = args.host, str(args.port)
    if args.device != "cpu":
        import torch

        try:
            torch.empty(1, device=args.device)
        except (RuntimeError, AssertionError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            ap.error(f"--device {args.device!r} is not usable here: {first}")
    name = args.name or f"decode-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    peer = DecodePeer(name, args.pages, args.page_bytes, device=args.device)
    watch: LandingLog | None = None
    try:
        arr = peer.pool_array()
        if args.watch_stamps is not None and arr is not None:  # a CPU pool (device: no log)
            watch = LandingLog(arr, args.watch_stamps)
        try:
            server = PeerServer(peer, int(port_s), host=host)
            server.landings = watch
        except OSError as exc:  # e.g. ADDR is not an address of this namespace
            print(
                f"python -m stress.harness.peer: cannot listen on {host}:{port_s}: {exc}",
                file=sys.stderr,
            )
            return 2
        try:
            sys.stdout.write(f"LISTENING {host}:{server.port}\n")
            sys.stdout.flush()
            if args.stderr_fd is not None:  # the start-up log is done: the caller's stderr
                sys.stderr.flush()
                os.dup2(args.stderr_fd, sys.stderr.fileno())
                os.close(args.stderr_fd)
            # From now on nothing may write to the pipe the parent stopped reading.
            os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
            while not stop.is_set() and not server.shutdown_requested.is_set():
                stop.wait(0.2)
                if args.parent_pid and os.getppid() != args.parent_pid:
                    break  # orphaned: the parent died without reaping us
        finally:
            server.close()
    finally:
        if watch is not None:
            watch.close()
        peer.close()
    return 0


# --------------------------------------------------------------------------- client

_START_LOG_LINES = 20
_START_LOG_CHARS = 4000
"""A failed start is reported with at most this many of the child's last stderr lines
(and characters)."""


def _check_stderr(stderr: object) -> None:
    """Raise ``ValueError`` unless ``stderr`` is a kind :class:`PeerProcess` takes."""
    if stderr is None or stderr == subprocess.DEVNULL:
        return
    if type(stderr) is int and stderr >= 0:
        return
    fileno = getattr(stderr, "fileno", None)
    if fileno is not None:
        try:
            fileno()
            return
        except (OSError, ValueError):  # io.UnsupportedOperation is both
            pass
    raise ValueError(
        "stderr must be None, subprocess.DEVNULL, a file descriptor or a file with a "
        f"fileno(), got {stderr!r}"
    )


def _open_stderr(stderr: int | IO[Any] | None) -> int:
    """A new descriptor (ours to close) of where the child's stderr goes once it listens."""
    if stderr is None:
        return os.dup(2)
    if stderr == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_WRONLY)
    if isinstance(stderr, int):
        return os.dup(stderr)
    stderr.flush()
    return os.dup(stderr.fileno())


def _log_tail(log: IO[bytes]) -> str:
    """The last lines of a child's start-up log (bounded), indented; "" when empty."""
    log.seek(0, os.SEEK_END)
    size = log.tell()
    log.seek(max(0, size - _START_LOG_CHARS))
    text = log.read().decode("utf-8", "replace")
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    return "\n".join(f"  {line}" for line in lines[-_START_LOG_LINES:])


def _copy_log(log: IO[bytes], fd: int, stderr: int | IO[Any] | None) -> None:
    """Copy the child's start-up log to where its stderr goes now. Never raises."""
    if stderr == subprocess.DEVNULL:
        return
    try:
        log.seek(0)
        while chunk := log.read(1 << 16):
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
    except OSError:
        pass


class MetadataBytes(bytes):
    """A peer's metadata bytes that can also be called: ``PeerProcess.metadata`` is read as
    an attribute by existing callers and called as ``peer.metadata()`` like
    :meth:`DecodePeer.metadata`, so one spelling works on both kinds of peer. Calling it
    returns the same bytes (a plain ``bytes``). Thread-safety: immutable. Raises: nothing."""

    __slots__ = ()

    def __call__(self) -> bytes:
        return bytes(self)


_REAP_WAIT_S = 30.0
"""How long :meth:`PeerProcess.close` waits for a child it sent SIGKILL to."""


class PeerProcess:
    """A :class:`DecodePeer` in a child process, controlled over its TCP control channel.

    ``metadata`` holds the child's metadata once started (fetched again by ``restart``):
    ``peer.metadata()``, as for an in-process :class:`DecodePeer`, or ``peer.metadata``
    (bytes; the older spelling, kept) -- both give the bytes for ``NixlTransport.add_peer``.

    Starting costs ~1-3 s (the child imports torch and NIXL). ``close()`` always reaps the
    child: SIGCONT+SIGTERM, SIGKILL after ``term_grace_s``, then wait.

    Args:
        num_pages: Pages in the peer's pool.
        page_bytes: Bytes per page.
        name: Prefix of the peer's NIXL agent name (a unique suffix is added per start).
        device: Torch device of the peer's pool.
        start_timeout_s: Bound on the wait for the ``LISTENING`` line and the metadata.
        rpc_timeout_s: Bound on every socket operation of a request.
        stderr: Where the child's stderr goes once it listens: ``None`` (inherit),
            ``subprocess.DEVNULL``, a file descriptor or a file object with a ``fileno()``.
            Until then it goes to a start-up log of ours, copied there afterwards (so nothing
            is lost): a child that fails to start is reported with its last lines.
        netns: Start the child inside this network namespace (``ip netns exec NETNS ...``,
            which needs the privileges to enter it; the child is still our direct child, so
            signals reach it). ``None``: this process's namespace.
        host: Address of the control channel: the child listens on it (``--allow-host`` when
            it is not 127.0.0.1) and we connect to it. With ``netns`` it must be an address
            of that namespace reachable from this one (127.0.0.1 would be the namespace's
            own loopback, which we cannot reach).
        env: Extra environment of the child (e.g. ``{"UCX_TLS": "tcp"}``); wins over ours.
        watch_stamps_s: Start the child with ``--watch-stamps`` (its log of stamped writes
            that landed, :meth:`landings`); ``None``: off.

    Not thread-safe for lifecycle methods (``kill``/``stop``/``cont``/``restart``/``close``);
    query methods open a connection per call and may be used from several threads.

    Raises:
        PeerStartError: The child exited before listening, or did not listen or send its
            metadata within ``start_timeout_s`` (it is reaped first); the message has its
            exit status and its last stderr lines.
        PeerError: Bad ``host``/``netns``.
        ValueError: ``stderr`` is none of the kinds above.
    """

    def __init__(
        self,
        num_pages: int,
        page_bytes: int,
        *,
        name: str = "decode",
        device: str = "cpu",
        start_timeout_s: float = 60.0,
        rpc_timeout_s: float = 10.0,
        term_grace_s: float = 3.0,
        stderr: int | IO[Any] | None = None,
        netns: str | None = None,
        host: str = _HOST,
        env: Mapping[str, str] | None = None,
        watch_stamps_s: float | None = None,
    ) -> None:
        """Make a :class:`PeerProcess`: every argument and what it raises are in the
        class docstring (``help(PeerProcess)``)."""
        if not _is_ipv4(host):
            raise PeerError(f"host must be an IPv4 address, got {host!r}")
        if netns is not None and host == _HOST:
            raise PeerError(f"a peer in netns {netns!r} cannot be reached on {_HOST}")
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self._prefix = name
        self._device = device
        self._start_timeout = start_timeout_s
        self._rpc_timeout = rpc_timeout_s
        self._term_grace = term_grace_s
        _check_stderr(stderr)
        self._stderr = stderr
        self.netns = netns
        self.host = host
        self._extra_env = dict(env or {})
        self._watch = watch_stamps_s
        self._proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.agent_name = ""
        self.metadata = MetadataBytes()
        self._start()

    # ------------------------------------------------------------------ lifecycle

    def _start(self) -> None:
        agent_name = f"{self._prefix}-{uuid.uuid4().hex[:10]}"
        env = dict(os.environ)
        env["NIXL_LOG_LEVEL"] = "WARN"
        if _nixl.BACKEND_MODULE:  # skip nixl's CUDA probe (it imports torch: ~2 s)
            env[_nixl.BACKEND_ENV] = _nixl.BACKEND_MODULE
        env["PYTHONUNBUFFERED"] = "1"
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env.update(self._extra_env)
        prefix = [] if self.netns is None else ["ip", "netns", "exec", self.netns]
        allow = [] if self.host == _HOST else ["--allow-host", self.host]
        # The child's stderr goes to our start-up log until it listens, then to `later`
        # (the caller's choice, a descriptor the child inherits and switches to).
        with tempfile.TemporaryFile() as log:
            later = _open_stderr(self._stderr)
            cmd = [
                *prefix, sys.executable, "-m", "stress.harness.peer",
                "--listen", f"{self.host}:0", *allow,
                "--pages", str(self.num_pages),
                "--page-bytes", str(self.page_bytes),
                "--name", agent_name,
                "--device", self._device,
                "--parent-pid", str(os.getpid()),
                "--stderr-fd", str(later),
                *([] if self._watch is None else ["--watch-stamps", str(self._watch)]),
            ]  # fmt: skip
            try:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    env=env,
                    pass_fds=(later,),
                )
                self._proc = proc
                try:
                    deadline = time.monotonic() + self._start_timeout
                    self.port = self._read_listening(proc, deadline)
                    self.agent_name = agent_name
                    _, blob = self._call({"cmd": "metadata"}, timeout_s=self._start_timeout)
                    self.metadata = MetadataBytes(blob)
                except PeerError as exc:
                    self.close()
                    tail = _log_tail(log)
                    status = proc.returncode
                    head = f"{exc} (exit status {status})"
                    raise PeerStartError(
                        f"{head}; its last stderr lines:\n{tail}"
                        if tail
                        else f"{head}; it wrote nothing on stderr",
                        status,
                        tail,
                    ) from exc
                except BaseException:
                    self.close()
                    raise
            finally:
                _copy_log(log, later, self._stderr)
                os.close(later)

    @staticmethod
    def _read_listening(proc: subprocess.Popen[bytes], deadline: float) -> int:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        buf = b""
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PeerError("peer did not print LISTENING in time (killed)")
                ready, _, _ = select.select([fd], [], [], remaining)
                if not ready:
                    continue
                chunk = os.read(fd, 4096)
                if not chunk:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(5)
                    raise PeerError("peer exited before listening")
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.startswith(b"LISTENING "):
                        return int(line.rsplit(b":", 1)[1])
        finally:
            proc.stdout.close()

    @property
    def pid(self) -> int:
        """Process id of the current child (0 when none)."""
        return self._proc.pid if self._proc is not None else 0

    @property
    def alive(self) -> bool:
        """True while the child has not exited."""
        return self._proc is not None and self._proc.poll() is None

    def _signal(self, sig: signal.Signals) -> None:
        if self._proc is None:
            raise PeerError("no peer process")
        with contextlib.suppress(ProcessLookupError):
            self._proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL the child and reap it."""
        self._signal(signal.SIGKILL)
        assert self._proc is not None
        self._proc.wait(timeout=10.0)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP the child and return once it is actually stopped (it hangs; NIXL never
        notices). Signal delivery is asynchronous: without the wait, a transfer posted right
        after ``stop()`` can still complete.

        Raises:
            PeerError: The child did not stop within ``timeout_s``.
        """
        self._signal(signal.SIGSTOP)
        if not self._wait_state(lambda st: st in ("T", "t"), timeout_s):
            raise PeerError(f"peer {self.pid} did not stop within {timeout_s} s")

    def cont(self, timeout_s: float = 5.0) -> None:
        """SIGCONT the child and return once it is no longer stopped.

        Raises:
            PeerError: The child is still stopped after ``timeout_s``.
        """
        self._signal(signal.SIGCONT)
        if not self._wait_state(lambda st: st not in ("T", "t"), timeout_s):
            raise PeerError(f"peer {self.pid} did not continue within {timeout_s} s")

    def _wait_state(self, ok: Callable[[str], bool], timeout_s: float) -> bool:
        """Wait until the child's scheduler state (``/proc/PID/stat``) satisfies ``ok``.

        True at once when the child is gone or ``/proc`` is unreadable (non-Linux).
        """
        end = time.monotonic() + timeout_s
        while True:
            try:
                with open(f"/proc/{self.pid}/stat", encoding="ascii") as f:
                    state = f.read().rpartition(")")[2].split()[0]
            except (OSError, IndexError):
                return True
            if ok(state) or state in ("Z", "X"):
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.001)

    def restart(self) -> None:
        """Reap the current child and start a new one (new agent name, new metadata).

        Raises:
            PeerError: The new child did not start in time.
        """
        self.close()
        self._start()

    def close(self) -> None:
        """Reap the child: SIGCONT+SIGTERM, SIGKILL after the grace period, wait. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT)
                    proc.terminate()
                try:
                    proc.wait(timeout=self._term_grace)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            proc.wait(timeout=_REAP_WAIT_S)
        finally:
            if proc.stdout is not None:
                proc.stdout.close()

    @property
    def close_timeout_s(self) -> float:
        """The most :meth:`close` waits for the child: its SIGTERM grace, then the reap
        after SIGKILL (for a watchdog's allowance; ``close`` raises
        ``subprocess.TimeoutExpired`` past it)."""
        return self._term_grace + _REAP_WAIT_S

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ queries

    def _call(
        self, req: dict[str, Any], timeout_s: float | None = None
    ) -> tuple[dict[str, Any], bytes]:
        timeout = self._rpc_timeout if timeout_s is None else timeout_s
        if self._proc is None:
            raise PeerError("no peer process")
        cmd = req.get("cmd")
        if cmd == "read":  # bound the reply: exactly the pages asked for
            max_body = len(req.get("pages") or ()) * self.page_bytes
        else:
            max_body = _MAX_METADATA if cmd == "metadata" else 0
        try:
            with socket.create_connection((self.host, self.port), timeout=timeout) as sock:
                sock.settimeout(timeout)
                _send_frame(sock, req)
                frame = _read_frame(sock, _MAX_REPLY_HEADER, max_body, timeout)
        except (OSError, ValueError) as exc:  # FrameError is a ValueError
            raise PeerError(f"peer request {cmd!r} failed: {exc}") from exc
        if frame is None:
            raise PeerError(f"peer closed the connection on {cmd!r}")
        header, body = frame.header, frame.body
        if not header.get("ok"):
            raise PeerError(f"peer refused {req.get('cmd')!r}: {header.get('error')}")
        return header, body

    def ping(self, timeout_s: float | None = None) -> bool:
        """True if the child answers within the timeout."""
        try:
            self._call({"cmd": "ping"}, timeout_s)
        except PeerError:
            return False
        return True

    def notifs(self) -> dict[str, list[bytes]]:
        """All notifications the child has collected (sender agent name -> messages).

        Raises:
            PeerError: No answer in time, or the child is gone.
        """
        header, _ = self._call({"cmd": "notifs"})
        raw = header.get("notifs", {})
        return {str(k): [bytes.fromhex(m) for m in v] for k, v in raw.items()}

    def wait_notif(self, msg: bytes, timeout_s: float, interval_s: float = 0.005) -> bool:
        """Poll the child until it has collected ``msg``; False on timeout.

        Raises:
            PeerError: The child stopped answering.
        """
        end = time.monotonic() + timeout_s
        while True:
            if any(msg in v for v in self.notifs().values()):
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(interval_s)

    def clear_notifs(self) -> None:
        """Forget the child's collected notifications.

        Raises:
            PeerError: No answer in time.
        """
        self._call({"cmd": "clear_notifs"})

    def page_digest(self, pages: Sequence[int] | np.ndarray[Any, Any]) -> list[str]:
        """Digests of the child's pages (see :meth:`DecodePeer.page_digest`).

        Raises:
            PeerError: Bad pages or no answer in time.
        """
        header, _ = self._call({"cmd": "digest", "pages": [int(p) for p in pages]})
        digests: list[str] = header["digests"]
        return digests

    def read_pages(self, pages: Sequence[int] | np.ndarray[Any, Any]) -> bytes:
        """Raw bytes of the child's pages, concatenated.

        Raises:
            PeerError: Bad pages or no answer in time.
        """
        _, body = self._call({"cmd": "read", "pages": [int(p) for p in pages]})
        return body

    def zero_pages(self, pages: Sequence[int] | np.ndarray[Any, Any] | None = None) -> None:
        """Zero the child's pages (all when ``None``).

        Raises:
            PeerError: Bad pages or no answer in time.
        """
        arg = None if pages is None else [int(p) for p in pages]
        self._call({"cmd": "zero", "pages": arg})

    # ------------------------------------------------------------------ room notices

    def room_notices(self, since: int = 0, limit: int = MAX_NOTICES_PER_REPLY) -> NoticePage:
        """One page of the child's room-notice history: records with ``seq > since``, at
        most ``limit`` (<= :data:`MAX_NOTICES_PER_REPLY`). Page on with ``since=page.next``
        while ``page.more``.

        Raises:
            PeerError: Bad arguments, a malformed reply, or no answer in time.
        """
        header, _ = self._call({"cmd": "room_notices", "since": since, "limit": limit})
        try:
            records = tuple(
                NoticeRecord(
                    int(seq), int(room), int(gen), str(out), str(code), float(at), str(sender)
                )
                for seq, room, gen, out, code, at, sender in header["notices"]
            )
            stats = NoticeStats(**{k: int(v) for k, v in header["stats"].items()})
            return NoticePage(
                records, int(header["next"]), bool(header["more"]), int(header["first"]), stats
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PeerError(f"malformed room_notices reply: {exc!r}") from None

    def failed_rooms(self, max_pages: int = 128) -> dict[tuple[int, int], LearntRoom]:
        """Every opening the child knows as failed or cleared from room notices
        (``(room, gen) -> (outcome, code, learnt_at)``; ``learnt_at`` is the child's
        ``time.monotonic()``, comparable with ours on the same host). Pages through the
        history, at most ``max_pages`` requests.

        Raises:
            PeerError: No answer in time, or the child is gone.
        """
        out: dict[tuple[int, int], LearntRoom] = {}
        since = 0
        for _ in range(max_pages):
            page = self.room_notices(since)
            for rec in page.records:
                out[(rec.room, rec.gen)] = rec.learnt
            since = page.next
            if not page.more:
                break
        return out

    def notice_stats(self) -> NoticeStats:
        """The child's room-notice counters.

        Raises:
            PeerError: No answer in time.
        """
        return self.room_notices(0, 1).stats

    def wait_room_failed(
        self, room: int, gen: int, timeout_s: float, interval_s: float = 0.005
    ) -> LearntRoom | None:
        """Poll the child until it learnt a room notice for ``(room, gen)``; ``None`` on
        timeout.

        Raises:
            PeerError: The child stopped answering.
        """
        end = time.monotonic() + timeout_s
        while True:
            learnt = self.failed_rooms().get((room, gen))
            if learnt is not None or time.monotonic() >= end:
                return learnt
            time.sleep(interval_s)

    def assign_pages(
        self, room: int, gen: int, pages: Sequence[int] | np.ndarray[Any, Any]
    ) -> bool:
        """:meth:`DecodePeer.assign_pages` in the child.

        Raises:
            PeerError: Bad arguments or no answer in time.
        """
        header, _ = self._call(
            {"cmd": "assign_pages", "room": room, "gen": gen, "pages": [int(p) for p in pages]}
        )
        return bool(header.get("assigned"))

    def release_pages(self, room: int, gen: int) -> tuple[int, ...]:
        """:meth:`DecodePeer.release_pages` in the child.

        Raises:
            PeerError: Bad arguments or no answer in time.
        """
        header, _ = self._call({"cmd": "release_pages", "room": room, "gen": gen})
        return tuple(int(p) for p in header.get("pages", ()))

    def free_pages(self) -> list[int]:
        """:meth:`DecodePeer.free_pages` in the child.

        Raises:
            PeerError: No answer in time.
        """
        header, _ = self._call({"cmd": "free_pages"})
        return [int(p) for p in header.get("pages", ())]

    def landings(self, since: int = 0) -> list[Landing]:
        """The child's log of stamped writes that landed (``--watch-stamps``), ``seq > since``.

        Raises:
            PeerError: The request failed, or the child does not watch stamps.
        """
        header, _ = self._call({"cmd": "landings", "since": since})
        return [Landing(*r) for r in header.get("landings", [])]


if __name__ == "__main__":
    sys.exit(main())
