"""`NixlTransport`: the only module that talks to NIXL (through :mod:`sender._nixl`).

One transport = one NIXL agent with the UCX backend, created with
``NIXL_THREAD_SYNC_STRICT``: NIXL's default sync mode (NONE) crashes with SIGSEGV when a few
threads share an agent; STRICT serialises the agent's calls internally.

Progress thread
---------------
NIXL's progress thread is kept (without one, a receiving agent must call
``get_new_notifs()`` continuously or incoming transfers stall) but given a delay: the
wrapper is built with ``enable_prog_thread=False`` and no backend, its public ``agent``
attribute is replaced by a binding agent built from our ``nixlAgentConfig`` (``pthrDelay`` =
``progress_delay_us``, default 100 µs), and the UCX backend is created on that one. NIXL
1.5.1's wrapper hard-codes ``pthrDelay=0``, a full core per idle agent. Why 100 µs, and the
idle-CPU and latency figures: docs/PERFORMANCE.md, "The transport's progress thread".

Handle lifetime
---------------
NIXL does not guard transfer handles: ``check_xfer_state`` on a released handle returns a
bogus ``"DONE"`` and releasing twice crashes the process. :class:`Transfer` owns its handle
behind a per-transfer lock: release happens at most once, and ``poll()`` after release raises
:class:`~sender.errors.TransferReleasedError` without touching NIXL.

Lock order (never acquire against it): ``NixlTransport._admin_lock`` →
``Transfer._lock`` → ``NixlTransport._lock``. ``_lock`` is held only for bookkeeping, never
across a NIXL call; ``Transfer._lock`` is held across that transfer's own NIXL calls.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from sender import _nixl
from sender.errors import (
    PARAM_ERRORS,
    AgentSetupError,
    PeerNotFoundError,
    RegionRetiredError,
    TransferFailedError,
    TransferReleasedError,
    TransferTimeoutError,
    TransportClosedError,
    TransportParamError,
    as_param_error,
    classify,
    status_name,
)
from sender.pages import CheckedPages, as_pages, scan_pages
from staging.validate import bounded_wait, check_seconds

if TYPE_CHECKING:  # torch is imported lazily: a CPU-only peer process need not pay ~2 s for it
    import torch

__all__ = [
    "AGENT_ATTEMPTS",
    "AGENT_RETRY_PAUSE_S",
    "DEFAULT_PROGRESS_DELAY_US",
    "DEFAULT_TIMEOUT_S",
    "NixlTransport",
    "PageIndices",
    "PeerMetadata",
    "RegionInfo",
    "Transfer",
    "TransferState",
    "TransportStats",
    "decode_metadata",
]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_PROGRESS_DELAY_US = 100

# The binding's statuses of a posted or polled transfer (errors are raised as exceptions).
_NIXL_DONE: Any = None if _nixl.bindings is None else _nixl.bindings.NIXL_SUCCESS
_NIXL_PROC: Any = None if _nixl.bindings is None else _nixl.bindings.NIXL_IN_PROG

TransferState = Literal["DONE", "PROC"]
PageIndices = Sequence[int] | npt.NDArray[np.integer[Any]] | CheckedPages

_MAGIC = b"NXSTG\x01"
_HEADER_LEN = struct.Struct(">I")
_MAX_HEADER = 1 << 20
_ADDR_LIMIT = 1 << 63  # region end (base_addr + nbytes) must fit a signed 64-bit descriptor
_DEVICE_LIMIT = 1 << 31
# How long close() keeps retired regions' memory alive after dropping the agent. On one host
# UCX writes by CMA (the sender's process_vm_writev), so a sender that has not yet noticed the
# disconnect can land bytes after close(): measured up to ~1 ms later (docs/PROTOCOL.md).
_RETIRED_GRACE_S = 0.25
# How long close() keeps progressing the agent after the last send_notif before it removes
# the peers. A notification is queued in UCX when send_notif returns and goes out only as
# the agent's worker is progressed (get_new_notifs does; with nothing else polling, as after
# a KVManager.close, the notices sat queued), and tearing the agent down cancels what is
# still queued: the decode side never learns, and UCX prints "UCX AM send failed with status
# -16 (Request canceled)" on stderr. Measured (50 queued notices, load 10-17 on 2 cores):
# closing at once canceled all 50 in 3/3 runs; after 100 ms of sleep, in 3/5; after ~100 ms
# of get_new_notifs every 1 ms, in 0/6. Best effort: a bound, not a delivery guarantee.
_NOTIF_FLUSH_S = 0.25
_NOTIF_FLUSH_POLL_S = 0.001


# --------------------------------------------------------------------------- metadata


@dataclass(frozen=True)
class RegionInfo:
    """One registered memory region as published in metadata.

    Attributes:
        name: Region name ("kv", "staging", ...).
        base_addr: Address of page 0 in the owner's address space (or device).
        nbytes: Region size in bytes (``num_pages * page_bytes``).
        page_bytes: Size of one page.
        num_pages: Number of pages.
        mem_type: NIXL memory type, ``"DRAM"`` or ``"VRAM"``.
        device_id: CUDA device index for VRAM, 0 for DRAM.
    """

    name: str
    base_addr: int
    nbytes: int
    page_bytes: int
    num_pages: int
    mem_type: str
    device_id: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "base_addr": self.base_addr,
            "nbytes": self.nbytes,
            "page_bytes": self.page_bytes,
            "num_pages": self.num_pages,
            "mem_type": self.mem_type,
            "device_id": self.device_id,
        }

    @classmethod
    def from_json(cls, obj: Any) -> RegionInfo:
        if not isinstance(obj, dict):
            raise TransportParamError("bad region entry in metadata")
        try:
            name = obj["name"]
            ints = [obj[k] for k in ("base_addr", "nbytes", "page_bytes", "num_pages", "device_id")]
            mem_type = obj["mem_type"]
        except KeyError as exc:
            raise TransportParamError(f"region entry lacks {exc}") from None
        if not isinstance(name, str) or not isinstance(mem_type, str):
            raise TransportParamError("bad region entry in metadata")
        if any(type(v) is not int or v < 0 for v in ints):
            raise TransportParamError(f"bad integer field in region {name!r}")
        base, nbytes, page_bytes, num_pages, device_id = ints
        if page_bytes <= 0 or num_pages <= 0 or nbytes != page_bytes * num_pages:
            raise TransportParamError(f"inconsistent sizes in region {name!r}")
        if base + nbytes >= _ADDR_LIMIT or device_id >= _DEVICE_LIMIT:
            # Descriptors are int64 rows: a larger address would overflow or wrap.
            raise TransportParamError(f"address or device id out of range in region {name!r}")
        if mem_type not in ("DRAM", "VRAM"):
            raise TransportParamError(f"unsupported mem type {mem_type!r} in region {name!r}")
        return cls(name, base, nbytes, page_bytes, num_pages, mem_type, device_id)


@dataclass(frozen=True)
class PeerMetadata:
    """Decoded result of :meth:`NixlTransport.metadata`.

    Attributes:
        agent_name: The NIXL agent name of the publishing transport.
        regions: Registered regions by name.
        agent_blob: NIXL's own agent metadata (``get_agent_metadata()``).
    """

    agent_name: str
    regions: dict[str, RegionInfo]
    agent_blob: bytes


def _encode_metadata(agent_name: str, regions: Sequence[RegionInfo], blob: bytes) -> bytes:
    header = json.dumps(
        {"agent": agent_name, "regions": [r.to_json() for r in regions]},
        separators=(",", ":"),
    ).encode()
    return _MAGIC + _HEADER_LEN.pack(len(header)) + header + blob


def decode_metadata(data: bytes) -> PeerMetadata:
    """Decode the bytes produced by :meth:`NixlTransport.metadata`.

    Format: ``b"NXSTG\\x01"``, a big-endian u32 header length, a UTF-8 JSON header
    ``{"agent": str, "regions": [RegionInfo...]}``, then NIXL's agent metadata blob.

    Thread-safety: pure function, safe from any thread.

    Raises:
        TransportParamError: The bytes are not metadata of this format.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TransportParamError(f"metadata must be bytes, got {type(data).__name__}")
    data = bytes(data)
    off = len(_MAGIC)
    if data[:off] != _MAGIC or len(data) < off + _HEADER_LEN.size:
        raise TransportParamError("not nixl-staging metadata (bad magic)")
    (hlen,) = _HEADER_LEN.unpack_from(data, off)
    off += _HEADER_LEN.size
    if hlen > _MAX_HEADER or len(data) < off + hlen:
        raise TransportParamError("truncated metadata header")
    try:
        header = json.loads(data[off : off + hlen].decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError and an int literal past Python's digit limit;
        # RecursionError a header nested too deep.
        raise TransportParamError(f"bad metadata header: {type(exc).__name__}") from None
    blob = data[off + hlen :]
    if not isinstance(header, dict) or not isinstance(header.get("agent"), str):
        raise TransportParamError("bad metadata header: no agent name")
    raw_regions = header.get("regions")
    if not isinstance(raw_regions, list):
        raise TransportParamError("bad metadata header: no region list")
    regions: dict[str, RegionInfo] = {}
    for raw in raw_regions:
        info = RegionInfo.from_json(raw)
        if info.name in regions:
            raise TransportParamError(f"bad metadata header: region {info.name!r} twice")
        regions[info.name] = info
    if not blob:
        raise TransportParamError("metadata has no NIXL agent blob")
    return PeerMetadata(header["agent"], regions, blob)


# --------------------------------------------------------------------------- stats


@dataclass(frozen=True)
class TransportStats:
    """Snapshot of a transport's counters (see :meth:`NixlTransport.stats`).

    ``transfers_started`` counts successfully posted transfers; each of them ends up in at
    most one of ``done``/``failed``/``timed_out`` (or none, when released while pending).
    """

    transfers_started: int
    transfers_done: int
    transfers_failed: int
    transfers_timed_out: int
    transfers_released: int
    live_transfers: int
    peers: int
    regions: int
    release_refused: int = 0
    """Handles NIXL refused to release (active, cannot cancel). Kept referenced and retried
    by :meth:`NixlTransport.close`; never released twice."""
    transfers_kept_at_removal: int = 0
    """Transfers that :meth:`NixlTransport.remove_peer` kept (failed, not released) because
    NIXL still had them in progress: their bytes may still land."""


# --------------------------------------------------------------------------- internals


@dataclass(eq=False)
class _LocalRegion:
    info: RegionInfo
    memory: object  # the tensor/array, kept referenced while registered
    reg_descs: Any  # NIXL registration list, needed to deregister
    prepped: Any = None  # NIXL prepared list, one descriptor per page (None: not prepared)
    # Its binding handle (what ``makeXferReq`` takes), or None; set once.
    prepped_id: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.prepped_id = None if self.prepped is None else int(self.prepped._handle)


@dataclass(eq=False)
class _Peer:
    session_id: str
    agent_name: str
    regions: dict[str, RegionInfo]
    transfers: set[Transfer] = field(default_factory=set)
    # NIXL prepared lists of the peer's regions, one descriptor per page, by region name.
    prepped: dict[str, Any] = field(default_factory=dict)
    # Set (under the transport's _lock) when remove_peer kept some of its transfers because
    # NIXL may still move their bytes: the entry, its prepared lists and its reference to
    # the remote agent stay until the last of them is released (NixlTransport._reap...).
    retired: bool = False
    # Their binding handles (what ``makeXferReq`` takes), by region name; set once.
    prepped_ids: dict[str, int] = field(default_factory=dict)
    # Set once NIXL reported this peer's agent disconnected; cleared when a later write to
    # it completes (the peer is reachable again, e.g. a healed partition: NIXL's UCX
    # endpoint reconnected without remove_peer/add_peer). A peer added again (remove_peer +
    # add_peer, e.g. a restarted process) is a new entry. A bool write is atomic: written
    # and read without _lock.
    disconnected: bool = False

    def __post_init__(self) -> None:
        self.prepped_ids = {k: int(h._handle) for k, h in self.prepped.items() if h is not None}


def _descs(
    base: int, page_bytes: int, starts: npt.NDArray[np.int64], counts: npt.NDArray[np.int64] | int,
    device_id: int,
) -> npt.NDArray[np.uint64]:
    """Nx3 ``(address, length, device)`` rows for NIXL, built without Python-level loops.

    Arithmetic is int64 (validated indices keep ``base + index * page_bytes`` far below
    2**63) and the result is reinterpreted as the uint64 NIXL expects.
    """
    rows = np.empty((starts.shape[0], 3), dtype=np.int64)
    np.multiply(starts, page_bytes, out=rows[:, 0])
    rows[:, 0] += base
    if isinstance(counts, int):
        rows[:, 1] = counts * page_bytes
    else:
        np.multiply(counts, page_bytes, out=rows[:, 1])
    rows[:, 2] = device_id
    return rows.view(np.uint64)


# --------------------------------------------------------------------------- Transfer


class Transfer:
    """One posted WRITE of many pages to one peer; owns its NIXL handle.

    Created only by :meth:`NixlTransport.write_pages`. All methods are thread-safe: a
    per-transfer lock serialises ``poll``/``release`` on the same transfer (different
    transfers never block each other here). ``release()`` is idempotent.
    """

    REPORTS_DONE_AT_POST = True
    """Its ``done`` says whether the write completed inside its post (a class attribute:
    wrappers that forward attributes through ``__getattr__`` do not inherit it)."""

    __slots__ = (
        "__weakref__",
        "_done",
        "_failure",
        "_handle",
        "_kept",
        "_lock",
        "_num_pages",
        "_ops",
        "_page_bytes",
        "_peer",
        "_released",
        "_src_region",
        "_start",
        "_timed_out",
        "_timeout_s",
        "_transport",
    )

    def __init__(
        self,
        transport: NixlTransport,
        ops: Any,
        peer: _Peer,
        src_region: str,
        num_pages: int,
        page_bytes: int,
        timeout_s: float,
    ) -> None:
        # Immutable after construction (kept few: this runs once per write).
        self._transport = transport
        self._peer = peer  # the peer entry this transfer was added to
        self._src_region = src_region
        self._num_pages = num_pages
        self._page_bytes = page_bytes
        self._timeout_s = timeout_s
        self._start = time.monotonic()  # the deadline is _start + _timeout_s
        # _lock guards every field below; held across this transfer's own NIXL calls only.
        self._lock = threading.Lock()
        # The binding agent this transfer's handle belongs to (``makeXferReq``,
        # ``postXferReq``, ``getXferStatus``, ``releaseXferReq`` on plain int handles: the
        # wrapper's per-call objects cost ~3 us a write). Guarded by _lock; None once released.
        self._ops: Any = ops
        self._handle: int | None = None  # guarded by _lock; None before post/after release
        self._failure: BaseException | None = None  # guarded by _lock
        # Guarded by _lock. _timed_out: the failure is our deadline, not NIXL's. _kept: its
        # peer was removed while NIXL still had it in progress (failed by us, not NIXL).
        self._done = self._timed_out = self._released = self._kept = False

    # -- read-only properties (plain reads of immutable or monotonic fields) --
    @property
    def session_id(self) -> str:
        """Destination session id."""
        return self._peer.session_id

    @property
    def src_region(self) -> str:
        """Name of the local source region."""
        return self._src_region

    @property
    def num_pages(self) -> int:
        """Number of pages moved by this transfer."""
        return self._num_pages

    @property
    def nbytes(self) -> int:
        """Number of bytes moved by this transfer."""
        return self._num_pages * self._page_bytes

    @property
    def timeout_s(self) -> float:
        """Deadline in seconds after the start (``inf`` = none)."""
        return self._timeout_s

    @property
    def started_at(self) -> float:
        """``time.monotonic()`` when the transfer was created (its deadline counts from here)."""
        return self._start

    @property
    def done(self) -> bool:
        """True once a poll (or the post itself) observed ``"DONE"``. Never calls NIXL."""
        return self._done

    @property
    def released(self) -> bool:
        """True once the handle was released (by us, ``remove_peer`` or ``close``)."""
        return self._released

    @property
    def failure(self) -> BaseException | None:
        """The error this transfer failed with, if any."""
        return self._failure

    @property
    def peer_removed(self) -> bool:
        """True once the peer entry this transfer was posted to was removed
        (:meth:`NixlTransport.remove_peer`; a peer added again under the same session id is
        a new entry). Never calls NIXL."""
        return self._peer.retired

    def __repr__(self) -> str:
        state = (
            "released" if self._released else "done" if self._done
            else "failed" if self._failure else "pending"
        )
        return (
            f"<Transfer session={self.session_id!r} pages={self._num_pages} "
            f"bytes={self.nbytes} {state}>"
        )

    def poll(self) -> TransferState:
        """Check progress once: ``"DONE"`` or ``"PROC"``.

        After ``"DONE"`` was seen the answer is cached (no NIXL call). A failure is remembered
        and raised again by later polls.

        Thread-safety: safe from any thread; serialised with ``release()`` on this transfer.

        Raises:
            TransferReleasedError: The transfer was released (NIXL is not touched).
            TransferTimeoutError: Still in progress at the deadline (the handle stays live;
                release it, usually after ``remove_peer``).
            TransferFailedError: NIXL reported a non-exception error status.
            TransportParamError: NIXL reported a parameter error for this handle.
            Exception: A NIXL transport error (a member of ``TRANSPORT_ERRORS``), e.g.
                ``nixlRemoteDisconnectError`` when the peer died.
        """
        # mutant-site: poll-with
        with self._lock:
            if self._released:
                raise TransferReleasedError(f"poll() on a released transfer: {self!r}")
            if self._done:
                return "DONE"
            if self._failure is not None:
                raise self._failure
            try:
                status = self._ops.getXferStatus(self._handle)
            except Exception as exc:
                converted = self._fail_locked(exc, timed_out=False)
                if converted is exc:
                    raise
                raise converted from exc
            if status == _NIXL_DONE:
                self._done = True
                if self._peer.disconnected:  # it completed: the peer is reachable again
                    self._peer.disconnected = False
                self._transport._on_done()
                return "DONE"
            if status != _NIXL_PROC:
                err = TransferFailedError(f"NIXL transfer status {status!r} for {self!r}")
                self._fail_locked(err, timed_out=False)
                raise err
            if time.monotonic() - self._start >= self._timeout_s:
                err2 = TransferTimeoutError(self._peer.session_id, self._timeout_s)
                # mutant-site: poll-set-timed-out
                self._timed_out = True
                self._fail_locked(err2, timed_out=True)
                raise err2
            return "PROC"

    def wait(self, timeout_s: float | None = None, interval_s: float | None = None) -> None:
        """Poll until ``"DONE"``.

        By default the pause between polls adapts (:func:`poll_pauses`): for the first
        millisecond polls only yield the GIL (a write of up to a few MiB is seen done at
        once), then pauses grow from 20 µs to 1 ms, so a long write costs little CPU and a
        short one little latency. ``interval_s`` fixes the pause instead.

        Thread-safety: safe from any thread (each poll takes the transfer's lock briefly).

        Raises:
            TypeError, ValueError: ``timeout_s`` not ``None`` or a number >= 0 (``inf`` =
                no limit; NaN refused), ``interval_s`` not ``None`` or a finite number >= 0.
            TimeoutError: ``timeout_s`` elapsed first (the transfer itself is not failed by
                this; its own deadline still applies).
            TransferTimeoutError, TransferReleasedError, TransferFailedError: as ``poll()``.
            Exception: a NIXL transport error, as ``poll()``.
        """
        if timeout_s is not None:
            check_seconds(timeout_s, "timeout_s", allow_zero=True, allow_inf=True)
        if interval_s is not None:
            check_seconds(interval_s, "interval_s", allow_zero=True)
        if self._done and not self._released:  # seen done at the post (the common case)
            return
        end = None if timeout_s is None else time.monotonic() + float(timeout_s)
        pauses = poll_pauses() if interval_s is None else itertools.repeat(float(interval_s))
        while self.poll() != "DONE":
            if end is not None and time.monotonic() >= end:
                raise TimeoutError(f"wait({timeout_s}) elapsed for {self!r}")
            pause_between_polls(next(pauses))

    def settled(self) -> bool:
        """``True`` once this write can no longer move bytes, as far as NIXL can tell: it
        is done, released, or failed with an error NIXL reported. A transfer that failed
        only by *our* doing -- its deadline (:class:`TransferTimeoutError`), its peer's
        removal (:meth:`NixlTransport.remove_peer` keeps it, failed with
        :class:`PeerNotFoundError`) or its source region's deregistration
        (:class:`RegionRetiredError`) -- is not settled while NIXL still reports it in
        progress: its peer may be hung or cut off and come back, and the write may then
        still land. So this asks NIXL again (``check_xfer_state``): ``"DONE"`` or an error
        means settled. Never raises.

        Thread-safety: safe from any thread; serialised with ``poll()``/``release()``.
        """
        with self._lock:
            if self._released or self._done:
                return True
            if self._failure is None:
                return False
            # mutant-site: settled
            if not (self._timed_out or self._kept):
                return True
            return not self._in_progress_at_nixl_locked()

    def release(self) -> None:
        """Release the NIXL handle (at most once).

        Idempotent: later calls (from any thread) are no-ops and never touch NIXL.
        Releasing a handle that is still ``"PROC"`` cancels it as far as NIXL can: **data
        may still land** in the peer's buffer afterwards. If NIXL refuses the release, the
        error is logged and the transport keeps the handle (counted in
        ``stats().release_refused``) and retries it once at :meth:`NixlTransport.close`; this
        object counts as released either way, so a second release is impossible.

        Thread-safety: safe from any thread; blocks while a ``poll()`` of this transfer runs.
        """
        with self._lock:
            if self._released:
                return
            self._released = True
            ops, handle = self._ops, self._handle
            self._ops = self._handle = None
            error: Exception | None = None
            if handle is not None:
                try:
                    ops.releaseXferReq(handle)
                except Exception as exc:
                    error = exc
            tx = self._transport
            peer = self._peer
            with tx._lock:  # one round trip for the transport's bookkeeping
                if self in tx._live:
                    tx._n_released += 1
                tx._forget_locked(self)
                if error is not None and handle is not None:
                    tx._refused_handles.append(handle)
                    tx._n_release_refused += 1
                reap = (peer.retired and not peer.transfers) or bool(tx._retiring)
        if error is not None:
            logger.warning("releasing %r failed (%s); retried at close()", self, error)
        if reap:  # the last kept transfer of a removed peer: drop what it kept loaded
            tx._try_reap_retired()

    def _keep_if_unsettled(self, failure: BaseException) -> bool:
        """``remove_peer``/``deregister_region``: keep this transfer (``True``) when NIXL
        may still move its bytes -- posted, and neither done nor failed as NIXL answers now
        -- failing it with ``failure`` unless it already failed by its deadline; ``False``
        when it can be released now. Caller holds the transport's ``_admin_lock`` (not
        ``_lock``)."""
        with self._lock:
            if self._released or self._done or self._handle is None:
                return False
            if self._failure is not None and not self._timed_out:
                return False
            # A status check also sends a completed write's notification, as poll() does.
            # mutant-site: keep-if-unsettled
            if not self._in_progress_at_nixl_locked():
                return False
            self._kept = True
            if self._failure is None:
                self._failure = failure
                self._transport._on_failed(timed_out=False)
            return True

    # -- internal, called by NixlTransport / poll with self._lock held --
    def _in_progress_at_nixl_locked(self) -> bool:
        """Whether NIXL answers ``"PROC"`` for the handle now (an error: it failed it, so
        nothing of it moves any more)."""
        try:
            status = self._ops.getXferStatus(self._handle)
        except Exception:
            return False
        return bool(status == _NIXL_PROC)

    def _fail_locked(self, exc: BaseException, *, timed_out: bool) -> BaseException:
        param = as_param_error(exc, f"NIXL rejected transfer {self!r}")
        failure = param if param is not None else exc
        if _is_disconnect(exc):
            self._peer.disconnected = True
        self._failure = failure
        self._transport._on_failed(timed_out=timed_out)
        return failure


# --------------------------------------------------------------------------- transport


class NixlTransport:
    """One NIXL agent (UCX) with named page-structured memory regions and peers.

    Typical use (sender side)::

        with NixlTransport("prefill-0") as tr:
            tr.register_region("kv", kv_pool, page_bytes)
            tr.add_peer("decode-0", peer_metadata)
            xfer = tr.write_pages("decode-0", [3, 4, 9], [0, 1, 2], notif=b"room-7")
            xfer.wait()
            xfer.release()

    Every public method is thread-safe unless its docstring says otherwise.

    Args:
        name: NIXL agent name; must be unique among connected agents. Default: a fresh
            ``nixl-<pid>-<random>`` name.
        default_timeout_s: Deadline of a transfer when ``write_pages`` gets none;
            ``math.inf`` disables deadlines (a hung peer is then never detected).
        progress_delay_us: Sleep between iterations of NIXL's progress thread (µs, > 0).

    Network devices: the agent uses whatever UCX picks from the process's environment when
    it is constructed (``UCX_NET_DEVICES``, ``UCX_TLS``; unset: every device UCX finds). The
    transport sets none of them. On a host whose interfaces come and go (containers' or
    test topologies' veths), set ``UCX_NET_DEVICES`` to the device(s) you mean: an agent
    that also uses a device torn down while it is made fails to be made (retried, see
    below), and one that ranks it best sends over it. The test suite, the stress suite and
    the benchmarks confine their loopback agents to ``lo`` (``stress.ucx_env``).

    Construction retries the one transient failure known (a network interface UCX found
    vanished while the backend was made: up to ``AGENT_ATTEMPTS`` attempts, each logged as a
    warning) and otherwise fails with :class:`~sender.errors.AgentSetupError` naming the
    cause, never with a bare NIXL backend error.

    Raises:
        ImportError: NIXL is not importable.
        TransportParamError: Bad arguments.
        AgentSetupError: NIXL has no UCX plugin, or the UCX backend could not be created
            (a ``RuntimeError``).
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        default_timeout_s: float = DEFAULT_TIMEOUT_S,
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
    ) -> None:
        """Make a :class:`NixlTransport`: every argument and what it raises are in the
        class docstring (``help(NixlTransport)``)."""
        bindings = _nixl.require()
        if name is None:
            name = f"nixl-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        if not isinstance(name, str) or not name:
            raise TransportParamError("name must be a non-empty str")
        _check_timeout(default_timeout_s, "default_timeout_s")
        if type(progress_delay_us) is not int or progress_delay_us <= 0:
            raise TransportParamError("progress_delay_us must be a positive int")
        self._name = name
        self._default_timeout_s = float(default_timeout_s)
        self._agent: Any = _make_agent(bindings, name, progress_delay_us)
        # Transfers call the binding agent under the wrapper directly (plain int handles:
        # the wrapper's per-call objects cost ~3 us a write, a fifth of a 64 KiB write).
        self._xfer_agent: Any = self._agent.agent
        self._write_op: Any = bindings.NIXL_WRITE

        # _admin_lock serialises membership changes (regions, peers, close) including their
        # NIXL calls. Order: _admin_lock -> Transfer._lock -> _lock.
        self._admin_lock = threading.Lock()
        # _lock guards the bookkeeping below; never held across a NIXL call.
        self._lock = threading.Lock()
        self._closed = False  # guarded by _lock
        self._regions: dict[str, _LocalRegion] = {}  # guarded by _lock
        self._peers: dict[str, _Peer] = {}  # guarded by _lock
        self._remote_refs: dict[str, int] = {}  # guarded by _lock; agent name -> sessions
        self._live: set[Transfer] = set()  # guarded by _lock; transfers not yet released
        # Removed peers that still have kept transfers (remove_peer); each holds one
        # reference in _remote_refs until reaped. Guarded by _lock.
        self._retired_peers: list[_Peer] = []
        self._n_kept = 0  # guarded by _lock
        self._n_started = 0  # guarded by _lock
        self._n_done = 0  # guarded by _lock
        self._n_failed = 0  # guarded by _lock
        self._n_timed_out = 0  # guarded by _lock
        self._n_released = 0  # guarded by _lock
        # NIXL handles whose release NIXL refused (still valid on NIXL's side), retried
        # once by close(). Guarded by _lock.
        self._refused_handles: list[int] = []
        self._n_release_refused = 0  # guarded by _lock
        # monotonic time of the last send_notif that NIXL accepted; close() progresses the
        # agent until _NOTIF_FLUSH_S after it. Guarded by _lock.
        self._last_notif_at: float | None = None
        # Deregistered regions whose memory is kept alive until close(): a remote sender may
        # still hold their old metadata and write into them. Guarded by _lock.
        self._retired: list[_LocalRegion] = []
        # _retiring: deregistered regions still registered with NIXL because a kept transfer
        # reads them; dropped by _reap_retired_admin once none does. Guarded by _lock.
        self._retiring: list[_LocalRegion] = []

    # ------------------------------------------------------------------ properties

    @property
    def name(self) -> str:
        """The NIXL agent name."""
        return self._name

    @property
    def default_timeout_s(self) -> float:
        """Deadline given to transfers that were not given one."""
        return self._default_timeout_s

    @property
    def closed(self) -> bool:
        """True once :meth:`close` started."""
        return self._closed

    def __repr__(self) -> str:
        return f"<NixlTransport {self._name!r}{' closed' if self._closed else ''}>"

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ memory

    def register_region(
        self, name: str, tensor: torch.Tensor | npt.NDArray[Any], page_bytes: int
    ) -> RegionInfo:
        """Register a contiguous tensor as region ``name`` of pages of ``page_bytes`` bytes.

        CPU tensors (and numpy arrays) are registered as DRAM, CUDA tensors as VRAM of their
        device. The memory is kept referenced until :meth:`close`, also after
        :meth:`deregister_region` (a remote sender may still write into it). Peers that
        already hold this transport's metadata must fetch it again to see the new region.

        Thread-safety: safe from any thread; serialised with other membership changes.

        Raises:
            TransportParamError: Bad name/page size, non-contiguous or empty tensor, size not
                a multiple of ``page_bytes``, unsupported device, name already registered, or
                NIXL rejected the registration.
            TransportClosedError: The transport is closed.
        """
        if not isinstance(name, str) or not name:
            raise TransportParamError("region name must be a non-empty str")
        if type(page_bytes) is not int or page_bytes <= 0:
            raise TransportParamError(f"page_bytes must be a positive int, got {page_bytes!r}")
        base_addr, nbytes, mem_type, device_id = _memory_of(name, tensor)
        if nbytes == 0 or nbytes % page_bytes:
            raise TransportParamError(
                f"region {name!r}: {nbytes} bytes is not a positive multiple of {page_bytes}"
            )
        info = RegionInfo(
            name, base_addr, nbytes, page_bytes, nbytes // page_bytes, mem_type, device_id
        )
        with self._admin_lock:
            with self._lock:
                self._check_open()
                if name in self._regions:
                    raise TransportParamError(f"region {name!r} is already registered")
                agent = self._agent
            rows = np.array([[info.base_addr, nbytes, device_id]], dtype=np.uint64)
            try:
                reg = agent.register_memory(rows, mem_type, ["UCX"])
            except PARAM_ERRORS as exc:
                raise TransportParamError(
                    f"NIXL rejected region {name!r}", status_name(exc)
                ) from exc
            prepped = _prep_pages(agent, "NIXL_INIT_AGENT", info, f"local region {name!r}")
            with self._lock:
                self._regions[name] = _LocalRegion(info, tensor, reg, prepped)
        return info

    def deregister_region(self, name: str) -> bool:
        """Retire region ``name``; returns False if it was not registered.

        The region leaves :meth:`regions` and every later :meth:`metadata` at once, new
        writes from it are refused, and live transfers reading from it are released --
        except those NIXL may still move bytes for (posted, neither done nor failed by
        NIXL: a hung or cut-off peer's), which are *kept*, as :meth:`remove_peer` keeps
        them: failed with :class:`RegionRetiredError`, still answering
        :meth:`Transfer.settled` from NIXL, released by their owner once settled (or by
        :meth:`close`). NIXL's registration of the region (and its prepared list) is
        dropped once no kept transfer reads it any more. **Its memory is not released**:
        the transport keeps the tensor referenced until :meth:`close` (and briefly after,
        see docs/PROTOCOL.md), because a remote sender that loaded the old metadata can
        still WRITE into it — NIXL 1.5.1 does not refuse such a write after
        ``deregister_memory`` (measured over UCX CMA and TCP: the bytes land), and nothing
        tells the receiver when every sender has dropped the metadata. The caller must not
        reuse that memory (nor register it again) before :meth:`close` either. Registering a
        new region under the same name is fine: it gets new memory, and senders see it only
        after fetching the metadata again.

        Thread-safety: safe from any thread; serialised with other membership changes.

        Raises:
            Nothing for NIXL failures (logged); the region is retired regardless.
        """
        with self._admin_lock:
            with self._lock:
                region = self._regions.pop(name, None)
                if region is None:
                    return False
                self._retired.append(region)  # memory stays alive until close()
                users = [t for t in self._live if t.src_region == name]
            for t in users:  # waits for posts in progress from this region to return
                # mutant-site: deregister-region
                if not t._keep_if_unsettled(RegionRetiredError(name)):
                    t.release()
            with self._lock:
                self._retiring.append(region)
            self._reap_retired_admin()
        return True

    def regions(self) -> dict[str, RegionInfo]:
        """Snapshot of the registered local regions.

        Thread-safety: safe from any thread.
        """
        with self._lock:
            return {k: r.info for k, r in self._regions.items()}

    # ------------------------------------------------------------------ peers

    def metadata(self) -> bytes:
        """This transport's metadata: NIXL agent metadata plus every region's layout.

        Decode with :func:`decode_metadata`; hand to the other side's :meth:`add_peer`.

        Thread-safety: safe from any thread; consistent with concurrent region changes.

        Raises:
            TransportClosedError: The transport is closed.
        """
        with self._admin_lock:
            with self._lock:
                self._check_open()
                agent = self._agent
                infos = [r.info for r in self._regions.values()]
            blob = agent.get_agent_metadata()
        return _encode_metadata(self._name, infos, bytes(blob))

    def add_peer(self, session_id: str, metadata: bytes) -> PeerMetadata:
        """Load a peer's metadata (from its :meth:`metadata`) under ``session_id``.

        Several sessions may name the same remote agent; NIXL forgets that agent only when
        the last of them is removed.

        Thread-safety: safe from any thread; serialised with other membership changes.

        Raises:
            TransportParamError: Bad session id, malformed metadata, session already added
                (remove it first), or NIXL rejected the metadata.
            TransportClosedError: The transport is closed.
        """
        if not isinstance(session_id, str) or not session_id:
            raise TransportParamError("session_id must be a non-empty str")
        meta = decode_metadata(metadata)
        if meta.agent_name == self._name:
            raise TransportParamError("a transport cannot add itself as a peer")
        with self._admin_lock:
            with self._lock:
                self._check_open()
                if session_id in self._peers:
                    raise TransportParamError(f"session {session_id!r} is already added")
                agent = self._agent
            try:
                loaded = agent.add_remote_agent(meta.agent_blob)
            except PARAM_ERRORS as exc:
                raise TransportParamError(
                    f"NIXL rejected metadata for session {session_id!r}", status_name(exc)
                ) from exc
            loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded_name != meta.agent_name:
                with self._lock:
                    in_use = loaded_name in self._remote_refs
                if not in_use:  # we loaded it just now: unload it again
                    try:
                        agent.remove_remote_agent(loaded_name)
                    except Exception as exc:
                        logger.warning("unloading remote agent %r failed: %s", loaded_name, exc)
                raise TransportParamError(
                    f"metadata names agent {meta.agent_name!r} but NIXL loaded {loaded_name!r}"
                )
            prepped = {
                rname: _prep_pages(agent, loaded_name, rinfo, f"region {rname!r} of {session_id!r}")
                for rname, rinfo in meta.regions.items()
            }
            with self._lock:
                self._peers[session_id] = _Peer(
                    session_id, loaded_name, dict(meta.regions), prepped=prepped
                )
                self._remote_refs[loaded_name] = self._remote_refs.get(loaded_name, 0) + 1
            self._reap_retired_admin()
        return meta

    def remove_peer(self, session_id: str) -> bool:
        """Forget a session: from now on writes to it raise :class:`PeerNotFoundError`.

        Its live transfers are released, except those NIXL may still move bytes for
        (posted, neither done nor failed by NIXL: a hung or cut-off peer's): releasing one
        does not stop it, and over TCP its bytes land once the link heals, so it is *kept*
        instead -- failed with :class:`PeerNotFoundError` (its ``poll()`` raises that, or
        the deadline's error it already had), still answering :meth:`Transfer.settled`
        from NIXL, and released by its owner once settled (or by :meth:`close`). The
        peer's NIXL remote agent and prepared lists stay loaded until the last kept
        transfer is released; then they go (the agent only when no other session uses it),
        at that release or at the next ``add_peer``/``remove_peer``/``close``. The session
        id may be added again at once.

        Idempotent: returns False if the session is unknown (already removed).

        Thread-safety: safe from any thread; waits for concurrent polls of that peer's
        transfers to return.

        Raises:
            Nothing for NIXL failures (logged).
        """
        with self._admin_lock:
            with self._lock:
                peer = self._peers.pop(session_id, None)
                if peer is None:
                    return False
                transfers = list(peer.transfers)
            kept = 0
            for t in transfers:  # waits for posts in progress to this peer to return
                if t._keep_if_unsettled(PeerNotFoundError(session_id)):
                    kept += 1
                else:
                    t.release()
            with self._lock:
                self._n_kept += kept
                peer.retired = True
                self._retired_peers.append(peer)
            self._reap_retired_admin()
        return True

    def _try_reap_retired(self) -> None:
        """From ``Transfer.release()`` (no lock held): reap now unless a membership change
        runs, which reaps at its end."""
        if self._admin_lock.acquire(blocking=False):
            try:
                self._reap_retired_admin()
            finally:
                self._admin_lock.release()

    def _reap_retired_admin(self) -> None:
        """Drop the removed peers none of whose transfers is live any more: their prepared
        lists, then their reference to the remote agent (NIXL forgets the agent with the
        last). Caller holds ``_admin_lock``."""
        with self._lock:
            done = [p for p in self._retired_peers if not p.transfers]
            used = {t.src_region for t in self._live}
            regions = [r for r in self._retiring if r.info.name not in used]
            if not done and not regions:
                return
            self._retired_peers = [p for p in self._retired_peers if p.transfers]
            self._retiring = [r for r in self._retiring if r.info.name in used]
            last = {p.agent_name for p in done if self._drop_remote_ref_locked(p.agent_name)}
            agent = self._agent
        if agent is None:  # closed meanwhile: close() removed everything
            return
        for region in regions:  # no live transfer reads it any more
            _release_prepped(agent, region.prepped)
            try:
                agent.deregister_memory(region.reg_descs, ["UCX"])
            except Exception as exc:
                logger.warning("deregistering region %r failed: %s", region.info.name, exc)
        for peer in done:
            for handle in peer.prepped.values():
                _release_prepped(agent, handle)
        for name in sorted(last):
            try:
                agent.remove_remote_agent(name)
            except Exception as exc:
                logger.warning("removing remote agent %r failed: %s", name, exc)

    def has_peer(self, session_id: str) -> bool:
        """True if ``session_id`` is currently added.

        Thread-safety: safe from any thread.
        """
        with self._lock:
            return session_id in self._peers

    def peer_regions(self, session_id: str) -> dict[str, RegionInfo]:
        """The regions a peer published.

        Thread-safety: safe from any thread.

        Raises:
            PeerNotFoundError: Unknown session.
        """
        with self._lock:
            peer = self._peers.get(session_id)
            if peer is None:
                raise PeerNotFoundError(session_id)
            return dict(peer.regions)

    def peer_disconnected(self, session_id: str) -> bool:
        """``True`` once NIXL reported the peer of ``session_id`` disconnected (a transfer to
        it, or a notification, raised ``nixlRemoteDisconnectError``) since it was added,
        until a later write to it completes (it is reachable again); ``False`` for an
        unknown session. Its writes and notifications would fail the same
        way (each with an error line in NIXL's log): the manager skips notices to it.

        Thread-safety: safe from any thread; takes no lock (one dict read, one bool read).
        """
        peer = self._peers.get(session_id)
        # mutant-site: peer-disconnected
        return peer is not None and peer.disconnected

    def peer_agent_name(self, session_id: str) -> str:
        """The NIXL agent name of a peer (the key of its messages in :meth:`get_notifs`).

        Thread-safety: safe from any thread.

        Raises:
            PeerNotFoundError: Unknown session.
        """
        with self._lock:
            peer = self._peers.get(session_id)
            if peer is None:
                raise PeerNotFoundError(session_id)
            return peer.agent_name

    # ------------------------------------------------------------------ transfers

    def write_pages(
        self,
        session_id: str,
        src_pages: PageIndices,
        dst_pages: PageIndices,
        notif: bytes | None = None,
        *,
        src_region: str = "kv",
        dst_region: str = "kv",
        timeout_s: float | None = None,
        coalesce: bool = True,
    ) -> Transfer:
        """Post ONE transfer writing local pages ``src_pages[i]`` to remote ``dst_pages[i]``.

        Indices are validated before NIXL is touched (NIXL would wrap an index of 2**32 or
        more to a small one unchecked). ``src_pages``/``dst_pages`` may be
        :class:`~sender.pages.CheckedPages` (checked once when built): given both, with a
        distinct destination, only their bounds are compared with the regions. With
        ``coalesce`` runs of pages that are consecutive on both sides become one descriptor.

        ``notif`` (if given) reaches the peer's ``get_notifs()`` after the data landed, but
        NIXL 1.5.1 sends it only from a status check on this side: from the post itself when
        the write completes inside it, else from the first :meth:`Transfer.poll` (or the
        check inside :meth:`Transfer.release`) that finds it complete — never from NIXL's
        progress thread alone. So a pending transfer that nobody polls does not notify even
        after its data landed, and a transfer already reported as failed (e.g.
        :class:`TransferTimeoutError`) still sends its notification when it is released, or
        its peer removed, after the data landed. A per-transfer notification means "these
        bytes landed", never "the room succeeded" (docs/PROTOCOL.md;
        tests/sender/test_receiver_lifetime.py pins both behaviours).

        Thread-safety: safe from any thread, concurrently with everything else; a concurrent
        ``remove_peer``/``close`` either sees and releases this transfer or makes this call
        raise.

        Raises:
            TransportParamError: Bad or out-of-range indices (bool indices included), length
                mismatch, no pages, duplicate destination pages, unknown region, page sizes
                differing between the two regions, bad ``notif``/``timeout_s``, or a NIXL
                parameter error.
            PeerNotFoundError: Unknown session (also a member of ``TRANSPORT_ERRORS``).
            TransportClosedError: The transport is closed.
            TransferFailedError: NIXL answered ``"ERR"`` when posting.
            Exception: A NIXL transport error (a member of ``TRANSPORT_ERRORS``), e.g.
                ``nixlRemoteDisconnectError`` for a dead peer.
        """
        if notif is not None:
            if not isinstance(notif, bytes):
                raise TransportParamError(
                    f"notif must be bytes or None, got {type(notif).__name__}"
                )
            if not notif:
                raise TransportParamError(
                    "notif must be non-empty (use None for no notification)"
                )
        if timeout_s is None:
            timeout = self._default_timeout_s  # validated by __init__
        else:
            _check_timeout(timeout_s, "timeout_s")
            timeout = float(timeout_s)
        # Two CheckedPages (destination checked distinct) were checked when built: only
        # their bounds are compared with the regions below (sender/pages.py).
        src_checked = dst_checked = None
        if (
            type(src_pages) is CheckedPages
            and type(dst_pages) is CheckedPages
            and dst_pages.unique
        ):
            src_checked, dst_checked = src_pages, dst_pages
            src = dst = _NO_PAGES  # int64 arrays are made only on the rare paths needing them
            n, n_dst = len(src_pages), len(dst_pages)
        else:
            src = as_pages(src_pages, "src_pages")
            dst = as_pages(dst_pages, "dst_pages")
            n, n_dst = len(src), len(dst)
        if n != n_dst:
            raise TransportParamError(
                f"src_pages and dst_pages differ in length ({n} vs {n_dst})"
            )
        if n == 0:
            raise TransportParamError("no pages to write")

        # Look-ups without the lock (a dict read is atomic); all three are checked again
        # under _lock below, before anything is posted.
        if self._closed:
            raise TransportClosedError(f"transport {self._name!r} is closed")
        local = self._regions.get(src_region)
        peer = self._peers.get(session_id)
        remote = None if peer is None else peer.regions.get(dst_region)
        if local is None or peer is None or remote is None:
            # close() sets _closed before it empties the tables: a look-up that failed
            # because of a concurrent close() is reported as the close.
            if self._closed:
                raise TransportClosedError(f"transport {self._name!r} is closed")
            if local is None:
                raise TransportParamError(f"no local region {src_region!r}")
            if peer is None:
                raise PeerNotFoundError(session_id)
            raise TransportParamError(f"session {session_id!r} has no region {dst_region!r}")
        li = local.info
        if li.page_bytes != remote.page_bytes:
            raise TransportParamError(
                f"page size differs: local {src_region!r} {li.page_bytes} B, "
                f"remote {dst_region!r} {remote.page_bytes} B"
            )
        src_idx: list[int] | npt.NDArray[np.int32]
        dst_idx: list[int] | npt.NDArray[np.int32]
        if src_checked is not None and dst_checked is not None:
            # mutant-site: write-pages-if-1
            if src_checked.max_page >= li.num_pages or dst_checked.max_page >= remote.num_pages:
                # A slice may be within range although its parent's bound is not: look.
                src = src_checked.indices.astype(np.int64)
                dst = dst_checked.indices.astype(np.int64)
                _check_pages(src, li.num_pages, "src_pages", src_region, unique=False)
                _check_pages(dst, remote.num_pages, "dst_pages", dst_region, unique=False)
            src_idx, dst_idx = src_checked.indices, dst_checked.indices
        elif n <= _SMALL_WRITE:
            # Python lists beat numpy's per-call overhead on a few pages, and NIXL takes them
            # as indices as cheaply as an int32 array (measured: 1.75 vs 1.54 us for 4).
            src_list: list[int] = src.tolist()
            dst_list: list[int] = dst.tolist()
            if min(src_list) < 0 or max(src_list) >= li.num_pages:
                _check_range_list(src_list, li.num_pages, "src_pages", src_region)
            if min(dst_list) < 0 or max(dst_list) >= remote.num_pages:
                _check_range_list(dst_list, remote.num_pages, "dst_pages", dst_region)
            if n > 1 and len(set(dst_list)) != n:
                raise TransportParamError("dst_pages contains duplicates")
            src_idx, dst_idx = src_list, dst_list
        else:
            # Few numpy calls (each costs 1-4 us here, more than the Python around them).
            _check_pages(src, li.num_pages, "src_pages", src_region, unique=False)
            _check_pages(dst, remote.num_pages, "dst_pages", dst_region, unique=True)

        local_prepped = local.prepped_id
        remote_prepped = peer.prepped_ids.get(dst_region)
        if local_prepped is not None and remote_prepped is not None:
            if n > _SMALL_WRITE and src_checked is None:  # in range (checked above)
                src_idx, dst_idx = src.astype(np.int32), dst.astype(np.int32)
        else:
            local_prepped = remote_prepped = None
            if src_checked is not None and dst_checked is not None:
                src = src_checked.indices.astype(np.int64)
                dst = dst_checked.indices.astype(np.int64)
            src_rows, dst_rows = _rows_for(li, remote, src, dst, coalesce)
        ops = self._xfer_agent
        xfer = Transfer(self, ops, peer, src_region, n, li.page_bytes, timeout)
        with xfer._lock:  # fresh lock: nobody else can hold it yet
            with self._lock:
                # Re-check under the lock: a concurrent remove_peer/close/deregister either
                # already happened (we raise) or will find this transfer in _live and
                # release it after we let go of xfer._lock.
                self._check_open()
                # mutant-site: write-pages-if-2
                if self._peers.get(session_id) is not peer:
                    raise PeerNotFoundError(session_id)
                if self._regions.get(src_region) is not local:
                    raise TransportParamError(f"local region {src_region!r} was deregistered")
                self._live.add(xfer)
                peer.transfers.add(xfer)
            msg = notif or b""
            try:
                if local_prepped is not None:
                    # Prepared once per region/peer; NIXL merges runs of adjacent pages
                    # unless told not to. The lists stay valid here: remove_peer,
                    # deregister_region and close release them only after releasing this
                    # transfer, which waits for us (we hold its lock).
                    handle = ops.makeXferReq(
                        self._write_op, local_prepped, src_idx, remote_prepped, dst_idx,
                        msg, [], not coalesce,
                    )
                else:
                    bindings = _nixl.require()
                    handle = ops.createXferReq(
                        self._write_op,
                        bindings.nixlXferDList(_mem_seg(bindings, li.mem_type), src_rows),
                        bindings.nixlXferDList(_mem_seg(bindings, remote.mem_type), dst_rows),
                        peer.agent_name,
                        msg,
                        [],
                    )
                xfer._handle = handle
                status = ops.postXferReq(handle, msg)
                done = status == _NIXL_DONE  # binding enums: each comparison ~0.35 us
                if not done and status != _NIXL_PROC:
                    raise TransferFailedError(
                        f"NIXL answered {status!r} posting a write to {session_id!r}"
                    )
            except Exception as exc:
                self._abort_post_locked(xfer, exc)
                param = as_param_error(exc, f"NIXL rejected a write to session {session_id!r}")
                if param is not None:
                    raise param from exc
                raise
            xfer._done = done
            if done and peer.disconnected:  # it completed: the peer is reachable again
                peer.disconnected = False
            with self._lock:  # one round trip for both counters
                self._n_started += 1
                if done:
                    self._n_done += 1
        return xfer

    def _abort_post_locked(self, xfer: Transfer, exc: BaseException) -> None:
        """Undo a failed post; caller holds ``xfer._lock``."""
        handle, ops = xfer._handle, xfer._ops
        xfer._handle = xfer._ops = None
        xfer._released = True
        xfer._failure = exc
        if _is_disconnect(exc):
            xfer._peer.disconnected = True
        if handle is not None:
            try:
                ops.releaseXferReq(handle)
            except Exception as rel_exc:
                logger.warning("releasing a failed transfer's handle failed: %s", rel_exc)
        with self._lock:
            self._forget_locked(xfer)
            if classify(exc):
                self._n_failed += 1

    def send_notif(self, session_id: str, message: bytes) -> None:
        """Send a standalone NIXL notification (not bound to a transfer) to a peer.

        Thread-safety: safe from any thread.

        Raises:
            TransportParamError: ``message`` is not non-empty bytes.
            PeerNotFoundError: unknown session.
            TransportClosedError: the transport is closed.
            Exception: a NIXL transport error (e.g. the peer is gone).
        """
        if not isinstance(message, bytes) or not message:
            raise TransportParamError("a notification is non-empty bytes")
        with self._lock:
            self._check_open()
            peer = self._peers.get(session_id)
            agent = self._agent
        if peer is None:
            raise PeerNotFoundError(session_id)
        try:
            agent.send_notif(peer.agent_name, message)
        except Exception as exc:
            if _is_disconnect(exc):
                peer.disconnected = True
            raise
        sent_at = time.monotonic()
        with self._lock:
            self._last_notif_at = sent_at

    def get_notifs(self) -> dict[str, list[bytes]]:
        """New notifications since the last call: remote agent name -> messages, in order.

        Each message is returned once (to whichever thread calls first).

        Thread-safety: safe from any thread.

        Raises:
            TransportClosedError: The transport is closed.
        """
        with self._lock:
            self._check_open()
            agent = self._agent
        try:
            notifs: dict[str, list[bytes]] = agent.get_new_notifs()
        except AttributeError:
            if self._closed:  # close() ran between our check and the call
                raise TransportClosedError(f"transport {self._name!r} is closed") from None
            raise
        return {str(k): [bytes(m) for m in v] for k, v in notifs.items() if v}

    def live_transfers(self) -> list[Transfer]:
        """Snapshot of the transfers not yet released.

        Thread-safety: safe from any thread.
        """
        with self._lock:
            return list(self._live)

    def stats(self) -> TransportStats:
        """Snapshot of the counters.

        Thread-safety: safe from any thread; the fields are mutually consistent.
        """
        with self._lock:
            return TransportStats(
                transfers_started=self._n_started,
                transfers_done=self._n_done,
                transfers_failed=self._n_failed,
                transfers_timed_out=self._n_timed_out,
                transfers_released=self._n_released,
                live_transfers=len(self._live),
                peers=len(self._peers),
                regions=len(self._regions),
                release_refused=self._n_release_refused,
                transfers_kept_at_removal=self._n_kept,
            )

    # ------------------------------------------------------------------ close

    def close(self) -> None:
        """Release every live transfer, remove every peer, deregister every region and drop
        the NIXL agent (its progress thread stops when the agent is destroyed).

        Memory of regions retired by :meth:`deregister_region` is released last, about
        0.25 s after the agent was dropped (a same-host sender may land a write ~1 ms after
        close; docs/PROTOCOL.md), so close() then takes that long. Live regions' memory is
        the caller's again when close() returns.

        Idempotent. Afterwards ``write_pages``/``add_peer``/``metadata``/``get_notifs``
        raise :class:`TransportClosedError`; polls of released transfers raise
        :class:`TransferReleasedError`.

        Notifications sent shortly before: a ``send_notif`` only queues its message in UCX,
        which sends it as the agent is progressed. When one was sent less than 0.25 s before,
        close first progresses the agent (``get_new_notifs`` every 1 ms; notifications that
        arrive then are dropped) until 0.25 s after it, so that the queued ones leave rather
        than being canceled (UCX would print "AM send failed ... Request canceled" on stderr,
        and the peer would never get them). Best effort, bounded by those 0.25 s.

        Thread-safety: safe from any thread; waits for in-flight polls/posts to return.

        Raises:
            Nothing for NIXL failures (logged).
        """
        with self._admin_lock:
            # mutant-site: close
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                transfers = list(self._live)
                remote_agents = list(self._remote_refs)
                regions = [*self._regions.values(), *self._retiring]
                peers = [*self._peers.values(), *self._retired_peers]
                prepped = [h for p in peers for h in p.prepped.values()]
                prepped += [r.prepped for r in regions]
                agent = self._agent
                last_notif = self._last_notif_at
            if last_notif is not None:
                _flush_notifs(agent, last_notif + _NOTIF_FLUSH_S)
            for t in transfers:
                t.release()
            for handle in prepped:  # no post is in progress any more (released above)
                _release_prepped(agent, handle)
            with self._lock:
                refused, self._refused_handles = self._refused_handles, []
            for handle in refused:  # one retry each; a handle is never released twice
                try:
                    self._xfer_agent.releaseXferReq(handle)
                except Exception as exc:
                    logger.error("NIXL refused again to release a transfer handle: %s", exc)
                    leaked = getattr(agent, "_leaked_xfer_handles", None)
                    if isinstance(leaked, list):  # the wrapper frees these when it is destroyed
                        leaked.append(handle)
            for remote in remote_agents:
                try:
                    agent.remove_remote_agent(remote)
                except Exception as exc:
                    logger.warning("removing remote agent %r failed: %s", remote, exc)
            for region in regions:
                try:
                    agent.deregister_memory(region.reg_descs, ["UCX"])
                except Exception as exc:
                    logger.warning("deregistering region %r failed: %s", region.info.name, exc)
            with self._lock:
                self._peers.clear()
                self._retired_peers.clear()
                self._remote_refs.clear()
                self._regions.clear()
                self._retiring.clear()
                self._agent = None
                self._xfer_agent = None  # the binding agent must go with the wrapper
                retired, self._retired = self._retired, []
        # Drop the binding agent now, so that a stray reference to the wrapper (a traceback
        # frame, a test local) cannot keep its progress thread alive. When a release failed
        # the wrapper keeps the handle for its own cleanup in __del__, which needs the agent.
        if not getattr(agent, "_leaked_xfer_handles", None):
            agent.agent = None
            if retired:
                # The agent is gone: over TCP nothing can land any more, but a same-host
                # sender writes by CMA until it notices the disconnect (measured: ~1 ms).
                time.sleep(_RETIRED_GRACE_S)
        elif retired:
            # The wrapper keeps the agent alive for its own cleanup: tie the memory to it.
            agent.nixl_staging_retired_memory = [r.memory for r in retired]
        del retired  # the retired regions' memory is freed here (unless tied to the agent)

    # ------------------------------------------------------------------ callbacks

    def _check_open(self) -> None:
        """Caller holds ``_lock``."""
        if self._closed:
            raise TransportClosedError(f"transport {self._name!r} is closed")

    def _drop_remote_ref_locked(self, agent_name: str) -> bool:
        left = self._remote_refs.get(agent_name, 1) - 1
        if left <= 0:
            self._remote_refs.pop(agent_name, None)
            return True
        self._remote_refs[agent_name] = left
        return False

    def _forget_locked(self, xfer: Transfer) -> None:
        self._live.discard(xfer)
        xfer._peer.transfers.discard(xfer)  # the entry it was added to, even if since removed

    def _on_done(self) -> None:
        with self._lock:
            self._n_done += 1

    def _on_failed(self, *, timed_out: bool) -> None:
        with self._lock:
            if timed_out:
                self._n_timed_out += 1
            else:
                self._n_failed += 1


# --------------------------------------------------------------------------- helpers


def _memory_of(name: str, mem: torch.Tensor | npt.NDArray[Any]) -> tuple[int, int, str, int]:
    """(base address, nbytes, NIXL mem type, device id) of a contiguous tensor or array."""
    if isinstance(mem, np.ndarray):
        if not mem.flags.c_contiguous:
            raise TransportParamError(f"region {name!r}: array must be C-contiguous")
        return int(mem.ctypes.data), int(mem.nbytes), "DRAM", 0
    torch_mod = sys.modules.get("torch")  # a tensor can only exist if torch is imported
    if torch_mod is None or not isinstance(mem, torch_mod.Tensor):
        raise TransportParamError(
            f"region {name!r}: expected a torch.Tensor or numpy array, got {type(mem).__name__}"
        )
    if not mem.is_contiguous():
        raise TransportParamError(f"region {name!r}: tensor must be contiguous")
    nbytes = mem.numel() * mem.element_size()
    if mem.device.type == "cpu":
        return mem.data_ptr(), nbytes, "DRAM", 0
    if mem.device.type == "cuda":
        return mem.data_ptr(), nbytes, "VRAM", mem.device.index or 0
    raise TransportParamError(f"region {name!r}: unsupported device {mem.device}")


def _flush_notifs(agent: Any, until: float) -> None:
    """Progress ``agent`` (``get_new_notifs``, received messages dropped) every
    :data:`_NOTIF_FLUSH_POLL_S` until monotonic time ``until``, so that notifications it
    queued are sent before it is torn down. Raises: nothing (a NIXL error ends it, logged)."""
    while time.monotonic() < until:
        try:
            agent.get_new_notifs()
        except Exception as exc:
            logger.debug("progressing queued notifications before close: %s", exc)
            return
        time.sleep(_NOTIF_FLUSH_POLL_S)


def _check_timeout(value: float, what: str) -> None:
    """A deadline in seconds: a number > 0, ``inf`` for none; not NaN, not a huge int.
    Raises TransportParamError."""
    try:
        check_seconds(value, what, allow_inf=True)
    except (TypeError, ValueError) as exc:
        raise TransportParamError(str(exc)) from None


POLL_SPIN_S = 1e-3
"""For this long after the first poll, polls follow each other with only a ``sched_yield``
between them (no sleep: a sleep costs 30-130 us here even for 0 s): a write of up to a few
MiB completes within it and is seen done at once, as raw NIXL's busy poll sees it."""
POLL_PAUSE_MIN_S = 20e-6
POLL_PAUSE_MAX_S = 1e-3
POLL_PAUSE_FRACTION = 1 / 16
"""After the spin, each pause is this fraction of the time polled so far (clamped to
:data:`POLL_PAUSE_MIN_S`..:data:`POLL_PAUSE_MAX_S`): a write is seen done at most ~6 %
(plus one sleep's overshoot) after it completed, and a long one costs one poll per ms."""


def poll_pauses(spin_s: float = POLL_SPIN_S) -> Iterator[float]:
    """Pauses between polls of one transfer: ``0.0`` (poll again at once, see
    :func:`pause_between_polls`) for ``spin_s``, then pauses of
    :data:`POLL_PAUSE_FRACTION` of the time elapsed since the first pause, clamped to
    :data:`POLL_PAUSE_MIN_S`..:data:`POLL_PAUSE_MAX_S`."""
    start = time.monotonic()
    spin_until = start + spin_s
    while True:
        now = time.monotonic()
        if now < spin_until:
            yield 0.0
        else:
            yield min(POLL_PAUSE_MAX_S, max(POLL_PAUSE_MIN_S, (now - start) * POLL_PAUSE_FRACTION))


def pause_between_polls(pause_s: float) -> None:
    """Sleep ``pause_s``; for ``0`` only yield the CPU and the GIL (``os.sched_yield``):
    ``time.sleep(0)`` costs 30-90 us on these VMs, longer than a 1 MiB write."""
    if pause_s > 0:
        time.sleep(bounded_wait(pause_s))
    else:
        os.sched_yield()


_MAX_PREPPED_PAGES = 1 << 22
"""Regions with more pages are not prepared (descriptors built per write instead)."""


def _prep_pages(agent: Any, agent_name: str, info: RegionInfo, what: str) -> Any:
    """A NIXL prepared descriptor list of ``info``'s pages (one descriptor per page, in page
    order), for ``make_prepped_xfer`` by page index; ``None`` when NIXL cannot prepare it
    (the transport then builds descriptors per write). Never raises."""
    if info.num_pages > _MAX_PREPPED_PAGES:
        return None
    rows = _descs(
        info.base_addr,
        info.page_bytes,
        np.arange(info.num_pages, dtype=np.int64),
        1,
        info.device_id,
    )
    try:
        return agent.prep_xfer_dlist(agent_name, rows, info.mem_type, ["UCX"])
    except Exception as exc:
        logger.warning("could not prepare descriptors of %s (%s): built per write", what, exc)
        return None


def _release_prepped(agent: Any, handle: Any) -> None:
    """Release a prepared descriptor list (``None`` is fine). Never raises."""
    if handle is None or agent is None:
        return
    try:
        agent.release_dlist_handle(handle)
    except Exception as exc:
        logger.warning("releasing a prepared descriptor list failed: %s", exc)


def _rows_for(
    li: RegionInfo,
    remote: RegionInfo,
    src: npt.NDArray[np.int64],
    dst: npt.NDArray[np.int64],
    coalesce: bool,
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """Descriptor rows of one write (the unprepared path): with ``coalesce``, runs of
    pages consecutive on both sides become one descriptor."""
    n = int(src.shape[0])
    runs = (src[1:] - src[:-1] != 1) | (dst[1:] - dst[:-1] != 1) if coalesce and n > 1 else None
    if runs is not None and not bool(runs.any()):
        # One run on both sides: a single descriptor each.
        return (
            _descs(li.base_addr, li.page_bytes, src[:1], n, li.device_id),
            _descs(remote.base_addr, remote.page_bytes, dst[:1], n, remote.device_id),
        )
    if runs is not None:
        starts = np.concatenate((np.zeros(1, dtype=np.int64), np.flatnonzero(runs) + 1))
        counts = np.append(starts[1:], n) - starts
        return (
            _descs(li.base_addr, li.page_bytes, src[starts], counts, li.device_id),
            _descs(remote.base_addr, remote.page_bytes, dst[starts], counts, remote.device_id),
        )
    return (
        _descs(li.base_addr, li.page_bytes, src, 1, li.device_id),
        _descs(remote.base_addr, remote.page_bytes, dst, 1, remote.device_id),
    )


_SMALL_WRITE = 16
"""Writes of at most this many pages are validated with Python lists (cheaper)."""


def _check_range_list(values: list[int], num_pages: int, what: str, region: str) -> None:
    _check_bounds(min(values), max(values), num_pages, what, region)


def _check_bounds(lo: int, hi: int, num_pages: int, what: str, region: str) -> None:
    if lo < 0 or hi >= num_pages:
        bad = lo if lo < 0 else hi
        raise TransportParamError(
            f"{what}: page {bad} out of range for region {region!r} ({num_pages} pages)"
        )


_NO_PAGES: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)


def _check_pages(
    pages: npt.NDArray[np.int64], num_pages: int, what: str, region: str, *, unique: bool
) -> None:
    """Raise :class:`TransportParamError` unless every index of ``pages`` (1-D int64, more
    than a few) is in ``range(num_pages)`` and, with ``unique``, no index repeats (the
    scan is :func:`sender.pages.scan_pages`, shared with :class:`CheckedPages`)."""
    lo, hi, repeats = scan_pages(pages, unique=unique)
    if lo < 0 or hi >= num_pages:
        _check_bounds(lo, hi, num_pages, what, region)
    if repeats:
        raise TransportParamError(f"{what} contains duplicates")


def _is_disconnect(exc: BaseException) -> bool:
    """``exc`` is NIXL's "remote agent disconnected" error."""
    cls = None if _nixl.bindings is None else getattr(
        _nixl.bindings, "nixlRemoteDisconnectError", None
    )
    return cls is not None and isinstance(exc, cls)


def _mem_seg(bindings: Any, mem_type: str) -> Any:
    return bindings.DRAM_SEG if mem_type == "DRAM" else bindings.VRAM_SEG


AGENT_ATTEMPTS = 3
"""Attempts at creating an agent's UCX backend when an attempt saw the network interfaces
change (the transient cause; see :func:`_make_agent`). A failure with no change seen is
retried once (a change can come and go between two looks) and then reported."""
AGENT_RETRY_PAUSE_S = 0.05
"""Pause before attempt ``n + 1`` is ``n`` times this (a torn-down device is gone by then)."""


def _net_interfaces() -> frozenset[tuple[int, str]]:
    """The network interfaces of this process's namespace, as ``(index, name)`` pairs (a
    device that is removed and made again gets a new index). Empty where unknown."""
    try:
        return frozenset(socket.if_nameindex())
    except OSError:
        return frozenset()


def _interface_change(before: frozenset[tuple[int, str]], after: frozenset[tuple[int, str]]) -> str:
    """``"+new -gone"`` names of what changed between two :func:`_net_interfaces` looks."""
    gone = sorted(name for _, name in before - after)
    new = sorted(name for _, name in after - before)
    return " ".join([*(f"-{n}" for n in gone), *(f"+{n}" for n in new)])


def _ucx_env() -> str:
    """The UCX variables that decide which devices and transports a new agent uses."""
    keys = ("UCX_NET_DEVICES", "UCX_TLS")
    return ", ".join(f"{k}={os.environ[k]!r}" if k in os.environ else f"{k} unset" for k in keys)


def _make_agent(bindings: Any, name: str, progress_delay_us: int) -> Any:
    """Build the wrapper agent around a binding agent whose progress thread sleeps, and
    create its UCX backend.

    Why creating the backend can fail under load (reproduced: 4 processes creating agents
    beside two concurrent two-host stress runs and 3 CPU hogs; 1 of 120 failed, always
    right after a veth of the other runs was deleted): ``createBackend`` makes a UCX context
    over every network device UCX finds (``UCX_NET_DEVICES`` unset means all of them),
    then connects the agent to itself (NIXL's "intra-agent transfer setup") over the device
    it ranks best, a veth rather than ``lo``. When that device vanishes in between, UCX logs
    "failed to get interface index ... No such device" and ``connect(...) failed:
    Connection refused``, and NIXL raises a bare ``nixlBackendError``. A busy machine makes
    the window between the two steps long. So an attempt that fails with
    ``nixlBackendError`` is retried (new binding agent, same name, up to
    :data:`AGENT_ATTEMPTS`) while the set of network interfaces changed during it; a
    failure without such a change is retried once, then reported: the caller gets
    :class:`AgentSetupError` naming every attempt, the interfaces that changed, and the UCX
    environment — never a bare backend error. Agents confined to one device
    (``UCX_NET_DEVICES=lo``, as the tests and the stress suite run them) are not exposed.

    Raises:
        AgentSetupError: No UCX plugin, or the backend could not be created (see above).
    """
    strict = _nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    # The wrapper's own binding agent: no progress thread, no backend -> cheap, inert.
    wrapper = _nixl.nixl_agent(
        name,
        _nixl.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=[],
            sync_mode=strict,
        ),
    )
    if "UCX" not in wrapper.get_plugin_list():
        raise AgentSetupError("NIXL has no UCX plugin on this machine")
    config = bindings.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.syncMode = strict.value
    config.pthrDelay = progress_delay_us
    config.lthrDelay = 100_000
    config.captureTelemetry = False
    inert = wrapper.agent
    backend_error: Any = getattr(bindings, "nixlBackendError", None)
    notes: list[str] = []
    changed_any = False
    for attempt in range(1, AGENT_ATTEMPTS + 1):
        before = _net_interfaces()
        wrapper.agent = bindings.nixlAgent(name, config)
        try:
            wrapper.create_backend("UCX")
        except Exception as exc:
            if backend_error is None or not isinstance(exc, backend_error):
                raise
            wrapper.agent = inert  # the failed binding agent goes
            change = _interface_change(before, _net_interfaces())
            changed_any = changed_any or bool(change)
            seen = (
                f"network interfaces changed meanwhile: {change}"
                if change
                else "no network interface appeared or vanished meanwhile"
            )
            notes.append(f"attempt {attempt}: {status_name(exc)}, {seen}")
            if attempt < AGENT_ATTEMPTS and (change or attempt == 1):
                logger.warning(
                    "creating the UCX backend of NIXL agent %r failed (%s); retrying",
                    name,
                    notes[-1],
                )
                time.sleep(AGENT_RETRY_PAUSE_S * attempt)
                continue
            if changed_any:
                cause = (
                    "a network interface UCX had found vanished while the agent was made "
                    "(e.g. another process's veth torn down): confine UCX to the devices you "
                    "mean with UCX_NET_DEVICES"
                )
            else:
                cause = (
                    "the failure repeated with no interface change, so it is not the "
                    "transient one: check UCX_NET_DEVICES (a device that does not exist or "
                    "has no address) and UCX_TLS (no usable transport)"
                )
            raise AgentSetupError(
                f"could not create the UCX backend of NIXL agent {name!r} "
                f"({'; '.join(notes)}): {cause}. UCX prints its own reason on this "
                f"process's stderr; {_ucx_env()}",
                tuple(notes),
                changed_any,
            ) from exc
        break
    del inert
    return wrapper
