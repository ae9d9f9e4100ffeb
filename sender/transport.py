"""`NixlTransport`: the only module that talks to NIXL (through :mod:`sender._nixl`).

One transport = one NIXL agent with the UCX backend, made with ``NIXL_THREAD_SYNC_STRICT``
(the default sync mode crashes when threads share an agent). NIXL's progress thread is kept
but sleeps ``progress_delay_us`` between rounds (docs/PERFORMANCE.md, "The transport's
progress thread"). NIXL does not guard transfer handles (a released one polls ``"DONE"``, a
double release crashes): :class:`Transfer` owns its handle and releases it at most once.

Lock order: ``NixlTransport._admin_lock`` → ``Transfer._lock`` → ``NixlTransport._lock``.
``_lock`` is bookkeeping only, never held across a NIXL call; ``Transfer._lock`` is held
across that transfer's own NIXL calls. See docs/THREADING.md, "The transport".
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
from dataclasses import asdict, dataclass, field
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

if TYPE_CHECKING:  # torch is imported lazily (costly for a CPU-only peer process)
    import torch

__all__ = [
    "AGENT_ATTEMPTS", "AGENT_RETRY_PAUSE_S", "DEFAULT_PROGRESS_DELAY_US", "DEFAULT_TIMEOUT_S",
    "NixlTransport", "PageIndices", "PeerMetadata", "RegionInfo", "Transfer", "TransferState",
    "TransportStats", "decode_metadata",
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
# close() keeps retired regions' memory this long after dropping the agent: a same-host
# sender writing by CMA can still land bytes just after close() (docs/PROTOCOL.md, 1.).
_RETIRED_GRACE_S = 0.25
# close() progresses the agent this long after the last send_notif: UCX sends a queued
# notification only as the agent is progressed, and tearing it down cancels what is queued.
_NOTIF_FLUSH_S = 0.25
_NOTIF_FLUSH_POLL_S = 0.001
_COUNTERS = (  # TransportStats' counter fields
    "transfers_started", "transfers_done", "transfers_failed", "transfers_timed_out",
    "transfers_released", "release_refused", "transfers_kept_at_removal",
)


@dataclass(frozen=True)
class RegionInfo:
    """One registered memory region as published in metadata: ``base_addr`` is page 0 in
    the owner's address space (or device), ``mem_type`` ``"DRAM"`` or ``"VRAM"``,
    ``device_id`` the CUDA device (0 for DRAM)."""

    name: str
    base_addr: int
    nbytes: int
    page_bytes: int
    num_pages: int
    mem_type: str
    device_id: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # every field, in declaration order (docs/PROTOCOL.md)

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
            raise TransportParamError(f"address or device id out of range in region {name!r}")
        if mem_type not in ("DRAM", "VRAM"):
            raise TransportParamError(f"unsupported mem type {mem_type!r} in region {name!r}")
        return cls(name, base, nbytes, page_bytes, num_pages, mem_type, device_id)


@dataclass(frozen=True)
class PeerMetadata:
    """Decoded :meth:`NixlTransport.metadata`; ``agent_blob`` is NIXL's own part."""

    agent_name: str
    regions: dict[str, RegionInfo]
    agent_blob: bytes


def decode_metadata(data: bytes) -> PeerMetadata:
    """Decode the bytes produced by :meth:`NixlTransport.metadata`. Pure: any thread.

    Format: ``b"NXSTG\\x01"``, a big-endian u32 header length, a UTF-8 JSON header
    ``{"agent": str, "regions": [RegionInfo...]}``, then NIXL's agent metadata blob.

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


@dataclass(frozen=True)
class TransportStats:
    """Snapshot of a transport's counters. Each started (posted) transfer ends in at most
    one of ``done``/``failed``/``timed_out``."""

    transfers_started: int
    transfers_done: int
    transfers_failed: int
    transfers_timed_out: int
    transfers_released: int
    live_transfers: int
    peers: int
    regions: int
    release_refused: int = 0
    """Handles NIXL refused to release; retried once by :meth:`NixlTransport.close`."""
    transfers_kept_at_removal: int = 0
    """Transfers :meth:`NixlTransport.remove_peer` kept because NIXL had them in progress."""


@dataclass(eq=False)
class _LocalRegion:
    info: RegionInfo
    memory: object  # the tensor/array, kept referenced while registered
    reg_descs: Any  # NIXL registration list, needed to deregister
    prepped: Any = None  # NIXL prepared list, one descriptor per page (None: not prepared)


@dataclass(eq=False)
class _Peer:
    session_id: str
    agent_name: str
    regions: dict[str, RegionInfo]
    transfers: set[Transfer] = field(default_factory=set)
    prepped: dict[str, Any] = field(default_factory=dict)  # by region name, as _LocalRegion's
    # Set under the transport's _lock by remove_peer; the entry stays (in _retired_peers)
    # until its last kept transfer is released.
    retired: bool = False
    # NIXL reported the peer disconnected; cleared when a later write completes. Read and
    # written without _lock (a bool write is atomic).
    disconnected: bool = False


def _descs(
    base: int, page_bytes: int, starts: npt.NDArray[np.int64], counts: npt.NDArray[np.int64] | int,
    device_id: int,
) -> npt.NDArray[np.uint64]:
    """Nx3 ``(address, length, device)`` rows for NIXL: int64 arithmetic (validated
    indices keep it below 2**63), viewed as uint64."""
    rows = np.empty((starts.shape[0], 3), dtype=np.int64)
    rows[:, 0] = starts * page_bytes + base
    rows[:, 1] = counts * page_bytes
    rows[:, 2] = device_id
    return rows.view(np.uint64)


class Transfer:
    """One posted WRITE of many pages to one peer; owns its NIXL handle.

    Made only by :meth:`NixlTransport.write_pages`. Thread-safe: ``_lock`` guards the
    mutable fields and serialises ``poll``/``release``/``settled`` on this transfer.
    """

    REPORTS_DONE_AT_POST = True
    """``done`` says whether the write completed inside its post (a class attribute, so
    wrappers forwarding through ``__getattr__`` do not inherit it)."""

    __slots__ = (
        "__weakref__", "_done", "_failure", "_handle", "_kept", "_lock", "_num_pages", "_ops",
        "_page_bytes", "_peer", "_released", "_src_region", "_start", "_timed_out", "_timeout_s",
        "_transport",
    )

    def __init__(
        self, transport: NixlTransport, ops: Any, peer: _Peer, src_region: str, num_pages: int,
        page_bytes: int, timeout_s: float,
    ) -> None:
        self._transport = transport
        self._peer = peer  # the peer entry this transfer was added to
        self._src_region = src_region
        self._num_pages = num_pages
        self._page_bytes = page_bytes
        self._timeout_s = timeout_s
        self._start = time.monotonic()  # the deadline is _start + _timeout_s
        # _lock guards every field below; held across this transfer's own NIXL calls only.
        self._lock = threading.Lock()
        self._ops: Any = ops  # the binding agent (plain int handles); None once released
        self._handle: int | None = None  # None before post/after release
        self._failure: BaseException | None = None
        # _timed_out: failed by our deadline. _kept: failed by remove_peer/deregister_region
        # while NIXL still had it in progress.
        self._done = self._timed_out = self._released = self._kept = False

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
        """``time.monotonic()`` at creation (the deadline counts from here)."""
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
        """True once its peer entry was removed (a peer added again is a new entry)."""
        return self._peer.retired

    def __repr__(self) -> str:
        state = "released" if self._released else "done" if self._done else (
            "failed" if self._failure else "pending"
        )
        pages = f"pages={self._num_pages} bytes={self.nbytes}"
        return f"<Transfer session={self.session_id!r} {pages} {state}>"

    def poll(self) -> TransferState:
        """Check progress once: ``"DONE"`` or ``"PROC"``; ``"DONE"`` and failures are cached.

        Thread-safety: safe from any thread; serialised with ``release()`` on this transfer.

        Raises:
            TransferReleasedError: The transfer was released (NIXL is not touched).
            TransferTimeoutError: Still in progress at the deadline (the handle stays live).
            TransferFailedError: NIXL reported an error status.
            TransportParamError: NIXL reported a parameter error for this handle.
            Exception: A NIXL transport error (``TRANSPORT_ERRORS``), e.g.
                ``nixlRemoteDisconnectError``.
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
                if self._peer.disconnected:  # reachable again
                    self._peer.disconnected = False
                self._transport._count("transfers_done")
                return "DONE"
            if status != _NIXL_PROC:
                err = TransferFailedError(f"NIXL transfer status {status!r} for {self!r}")
                raise self._fail_locked(err, timed_out=False)
            if time.monotonic() - self._start >= self._timeout_s:
                # mutant-site: poll-set-timed-out
                self._timed_out = True
                late = TransferTimeoutError(self._peer.session_id, self._timeout_s)
                raise self._fail_locked(late, timed_out=True)
            return "PROC"

    def wait(self, timeout_s: float | None = None, interval_s: float | None = None) -> None:
        """Poll until ``"DONE"``, pausing as :func:`poll_pauses` says (``interval_s``: a
        fixed pause instead).

        Thread-safety: safe from any thread (each poll takes the transfer's lock briefly).

        Raises:
            TypeError, ValueError: ``timeout_s`` not ``None`` or a number >= 0 (``inf`` =
                no limit), ``interval_s`` not ``None`` or a finite number >= 0.
            TimeoutError: ``timeout_s`` elapsed first (the transfer is not failed by this).
            Any error of ``poll()``.
        """
        if timeout_s is not None:
            check_seconds(timeout_s, "timeout_s", allow_zero=True, allow_inf=True)
        if interval_s is not None:
            check_seconds(interval_s, "interval_s", allow_zero=True)
        end = None if timeout_s is None else time.monotonic() + float(timeout_s)
        pauses = poll_pauses() if interval_s is None else itertools.repeat(float(interval_s))
        while self.poll() != "DONE":
            if end is not None and time.monotonic() >= end:
                raise TimeoutError(f"wait({timeout_s}) elapsed for {self!r}")
            pause_between_polls(next(pauses))

    def settled(self) -> bool:
        """``True`` once this write can move no more bytes: done, released, failed by NIXL,
        or failed by us (deadline, removal) and no longer in progress at NIXL (asked here).

        Thread-safety: safe from any thread; serialised with ``poll()``/``release()``.

        Raises:
            Nothing.
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
        """Release the NIXL handle, at most once. A write in progress may still land
        **data** afterwards. Never raises: a refused release is logged and retried by ``close()``.

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
            reap = self._transport._note_released(self, None if error is None else handle)
        if error is not None:
            logger.warning("releasing %r failed (%s); retried at close()", self, error)
        if reap:  # the last kept transfer of a removed peer or retiring region
            self._transport._try_reap_retired()

    def _keep_if_unsettled(self, failure: BaseException) -> bool:
        """Keep (``True``, failing it with ``failure`` unless already failed) a transfer NIXL
        still has in progress; ``False``: release it. Caller holds ``_admin_lock``."""
        with self._lock:
            if self._released or self._done or self._handle is None:
                return False
            if self._failure is not None and not self._timed_out:
                return False
            # The status check also sends a completed write's notification (NIXL 1.5.1).
            # mutant-site: keep-if-unsettled
            if not self._in_progress_at_nixl_locked():
                return False
            self._kept = True
            if self._failure is None:
                self._failure = failure
                self._transport._count("transfers_failed")
            return True

    def _in_progress_at_nixl_locked(self) -> bool:
        """NIXL answers ``"PROC"`` for the handle now (an error counts as not)."""
        try:
            status = self._ops.getXferStatus(self._handle)
        except Exception:
            return False
        return bool(status == _NIXL_PROC)

    def _fail_locked(self, exc: BaseException, *, timed_out: bool) -> BaseException:
        param = as_param_error(exc, f"NIXL rejected transfer {self!r}")
        failure = param if param is not None else exc
        _note_disconnect(self._peer, exc)
        self._failure = failure
        self._transport._count("transfers_timed_out" if timed_out else "transfers_failed")
        return failure


class NixlTransport:
    """One NIXL agent (UCX) with named page-structured memory regions and peers.

    Typical use (sender side)::

        with NixlTransport("prefill-0") as tr:
            tr.register_region("kv", kv_pool, page_bytes)
            tr.add_peer("decode-0", peer_metadata)
            xfer = tr.write_pages("decode-0", [3, 4, 9], [0, 1, 2], notif=b"room-7")
            xfer.wait()
            xfer.release()

    Every public method is thread-safe. The agent uses the devices UCX picks from
    ``UCX_NET_DEVICES``/``UCX_TLS`` (unset: all; docs/ADOPTING.md).

    Args:
        name: NIXL agent name; must be unique among connected agents. Default: a fresh
            ``nixl-<pid>-<random>`` name.
        default_timeout_s: Deadline of a transfer when ``write_pages`` gets none;
            ``math.inf`` disables deadlines (a hung peer is then never detected).
        progress_delay_us: Sleep between iterations of NIXL's progress thread (µs, > 0).

    Raises:
        ImportError: NIXL is not importable.
        TransportParamError: Bad arguments.
        AgentSetupError: NIXL has no UCX plugin, or the UCX backend could not be created
            (after retrying the one known transient failure; a ``RuntimeError``).
    """

    def __init__(
        self, name: str | None = None, *, default_timeout_s: float = DEFAULT_TIMEOUT_S,
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
        # Transfers call the binding agent directly: plain int handles, no wrapper objects.
        self._xfer_agent: Any = self._agent.agent
        self._write_op: Any = bindings.NIXL_WRITE

        # _admin_lock serialises membership changes (regions, peers, close) across their
        # NIXL calls. Order: _admin_lock -> Transfer._lock -> _lock.
        self._admin_lock = threading.Lock()
        # _lock guards every field below; never held across a NIXL call.
        self._lock = threading.Lock()
        self._closed = False
        self._regions: dict[str, _LocalRegion] = {}
        self._peers: dict[str, _Peer] = {}
        self._remote_refs: dict[str, int] = {}  # agent name -> sessions using it
        self._live: set[Transfer] = set()  # transfers not yet released
        # Removed peers with kept transfers; each holds a _remote_refs reference until reaped.
        self._retired_peers: list[_Peer] = []
        self._counts = dict.fromkeys(_COUNTERS, 0)  # TransportStats' counters, by field name
        self._refused_handles: list[int] = []  # releases NIXL refused; retried by close()
        self._last_notif_at: float | None = None  # monotonic time of the last send_notif
        # Deregistered regions: memory kept alive until close() (stale remote writes).
        self._retired: list[_LocalRegion] = []
        # Deregistered regions still registered with NIXL while a kept transfer reads them.
        self._retiring: list[_LocalRegion] = []

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
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def register_region(
        self, name: str, tensor: torch.Tensor | npt.NDArray[Any], page_bytes: int
    ) -> RegionInfo:
        """Register a contiguous tensor as region ``name`` of pages of ``page_bytes`` bytes.

        CPU tensors and numpy arrays are DRAM, CUDA tensors VRAM. The memory stays
        referenced until :meth:`close`. Peers see the region after fetching metadata again.

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

        It leaves :meth:`regions` and :meth:`metadata` at once and new writes from it are
        refused. Its live transfers are released, except those NIXL still has in progress:
        those are kept as :meth:`remove_peer` keeps them (failed with
        :class:`RegionRetiredError`). **Its memory stays referenced until** :meth:`close`
        (a stale remote write can still land in it); the caller must not reuse it before
        then either (docs/PROTOCOL.md, section 1).

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
            for t in users:  # waits for posts in progress from this region
                # mutant-site: deregister-region
                if not t._keep_if_unsettled(RegionRetiredError(name)):
                    t.release()
            with self._lock:
                self._retiring.append(region)
            self._reap_retired_admin()
        return True

    def regions(self) -> dict[str, RegionInfo]:
        """Snapshot of the registered local regions. Safe from any thread; never raises."""
        with self._lock:
            return {k: r.info for k, r in self._regions.items()}

    def metadata(self) -> bytes:
        """This transport's metadata (NIXL agent metadata plus every region's layout), for
        the other side's :meth:`add_peer`.

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
        regions = [i.to_json() for i in infos]
        header = json.dumps({"agent": self._name, "regions": regions}, separators=(",", ":"))
        encoded = header.encode()
        return _MAGIC + _HEADER_LEN.pack(len(encoded)) + encoded + bytes(blob)

    def add_peer(self, session_id: str, metadata: bytes) -> PeerMetadata:
        """Load a peer's metadata (from its :meth:`metadata`) under ``session_id``.

        Sessions may share a remote agent; NIXL forgets it when the last one is removed.

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
                    what = f"unloading remote agent {loaded_name!r}"
                    _quietly(what, agent, "remove_remote_agent", loaded_name)
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
        """Forget a session: later writes to it raise :class:`PeerNotFoundError`. Returns
        False if it is unknown. The session id may be added again at once.

        Its live transfers are released, except those NIXL still has in progress (releasing
        does not stop them): those are *kept*, failed with :class:`PeerNotFoundError`, for
        their owner to release once :meth:`Transfer.settled`. The peer's remote agent and
        prepared lists stay loaded until the last kept one is released (docs/THREADING.md,
        "Removed peers").

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
            for t in transfers:  # waits for posts in progress to this peer
                if t._keep_if_unsettled(PeerNotFoundError(session_id)):
                    kept += 1
                else:
                    t.release()
            with self._lock:
                self._counts["transfers_kept_at_removal"] += kept
                peer.retired = True
                self._retired_peers.append(peer)
            self._reap_retired_admin()
        return True

    def _try_reap_retired(self) -> None:
        """Reap now unless a membership change runs (it reaps at its end). No lock held."""
        if self._admin_lock.acquire(blocking=False):
            try:
                self._reap_retired_admin()
            finally:
                self._admin_lock.release()

    def _reap_retired_admin(self) -> None:
        """Drop retired peers and regions no live transfer uses any more. Caller holds
        ``_admin_lock``."""
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
        for region in regions:
            _release_prepped(agent, region.prepped)
            _deregister(agent, region)
        for peer in done:
            for handle in peer.prepped.values():
                _release_prepped(agent, handle)
        for name in sorted(last):
            _quietly(f"removing remote agent {name!r}", agent, "remove_remote_agent", name)

    def has_peer(self, session_id: str) -> bool:
        """True if ``session_id`` is currently added. Safe from any thread; never raises."""
        with self._lock:
            return session_id in self._peers

    def peer_regions(self, session_id: str) -> dict[str, RegionInfo]:
        """The regions a peer published. Safe from any thread.

        Raises:
            PeerNotFoundError: Unknown session.
        """
        with self._lock:
            peer = self._peers.get(session_id)
            if peer is None:
                raise PeerNotFoundError(session_id)
            return dict(peer.regions)

    def peer_disconnected(self, session_id: str) -> bool:
        """``True`` once NIXL reported the peer disconnected (``nixlRemoteDisconnectError``),
        until a later write to it completes; ``False`` for an unknown session.

        Thread-safety: safe from any thread; takes no lock (one dict read, one bool read).
        Never raises.
        """
        peer = self._peers.get(session_id)
        # mutant-site: peer-disconnected
        return peer is not None and peer.disconnected

    def peer_agent_name(self, session_id: str) -> str:
        """The NIXL agent name of a peer (its key in :meth:`get_notifs`). Safe from any thread.

        Raises:
            PeerNotFoundError: Unknown session.
        """
        with self._lock:
            peer = self._peers.get(session_id)
            if peer is None:
                raise PeerNotFoundError(session_id)
            return peer.agent_name

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

        Indices are validated before NIXL sees them (NIXL wraps large ones unchecked); two
        :class:`~sender.pages.CheckedPages` (distinct destination) are only bound-checked.
        With ``coalesce``, runs consecutive on both sides become one descriptor.

        ``notif`` reaches the peer's ``get_notifs()`` after the data landed, but NIXL 1.5.1
        sends it only from a status check on this side (the post, a :meth:`Transfer.poll`,
        the check in :meth:`Transfer.release`) — never from NIXL's progress thread alone;
        a transfer already failed still notifies once its data landed (docs/PROTOCOL.md, 2.).

        Thread-safety: safe from any thread; a concurrent ``remove_peer``/``close`` either
        sees and releases this transfer or makes this call raise.

        Raises:
            TransportParamError: Bad or out-of-range indices (bools included), length
                mismatch, no pages, duplicate destination pages, unknown region, differing
                page sizes, bad ``notif``/``timeout_s``, or a NIXL parameter error.
            PeerNotFoundError: Unknown session (also in ``TRANSPORT_ERRORS``).
            TransportClosedError: The transport is closed.
            TransferFailedError: NIXL answered ``"ERR"`` when posting.
            Exception: A NIXL transport error (``TRANSPORT_ERRORS``), e.g.
                ``nixlRemoteDisconnectError``.
        """
        if notif is not None and not isinstance(notif, bytes):
            raise TransportParamError(f"notif must be bytes or None, got {type(notif).__name__}")
        if notif == b"":
            raise TransportParamError("notif must be non-empty (use None for no notification)")
        if timeout_s is not None:
            _check_timeout(timeout_s, "timeout_s")
        timeout = self._default_timeout_s if timeout_s is None else float(timeout_s)
        src, dst = as_pages(src_pages, "src_pages"), as_pages(dst_pages, "dst_pages")
        n, n_dst = len(src), len(dst)
        if n != n_dst:
            raise TransportParamError(f"src_pages and dst_pages differ in length ({n} vs {n_dst})")
        if n == 0:
            raise TransportParamError("no pages to write")

        # Look-ups without the lock (a dict read is atomic); checked again under _lock below.
        self._check_open()
        local = self._regions.get(src_region)
        peer = self._peers.get(session_id)
        remote = None if peer is None else peer.regions.get(dst_region)
        if local is None or peer is None or remote is None:
            self._check_open()  # close() sets _closed before it empties the tables
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
        # Two CheckedPages (distinct destination) within both regions by their bounds are
        # not looked at; a slice may be in range although its parent's bound is not.
        # mutant-site: write-pages-if-1
        if not (
            type(src_pages) is CheckedPages and type(dst_pages) is CheckedPages
            and dst_pages.unique and src_pages.max_page < li.num_pages
            and dst_pages.max_page < remote.num_pages
        ):
            _check_pages(src, li.num_pages, "src_pages", src_region, unique=False)
            _check_pages(dst, remote.num_pages, "dst_pages", dst_region, unique=True)
        local_prepped, remote_prepped = local.prepped, peer.prepped[dst_region]
        prepped = local_prepped is not None and remote_prepped is not None
        if not prepped:
            src_rows, dst_rows = _rows_for(li, remote, src, dst, coalesce)
        ops = self._xfer_agent
        xfer = Transfer(self, ops, peer, src_region, n, li.page_bytes, timeout)
        with xfer._lock:  # fresh lock: nobody else can hold it yet
            with self._lock:
                # A concurrent remove_peer/close/deregister either happened (we raise) or
                # will find this transfer in _live and release it after xfer._lock.
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
                if prepped:
                    # The prepared lists stay valid: they are released only after this
                    # transfer, whose lock we hold.
                    handle = ops.makeXferReq(
                        self._write_op, local_prepped._handle, src.astype(np.int32),
                        remote_prepped._handle, dst.astype(np.int32), msg, [], not coalesce,
                    )
                else:
                    b = _nixl.require()
                    seg = {"DRAM": b.DRAM_SEG, "VRAM": b.VRAM_SEG}
                    handle = ops.createXferReq(
                        self._write_op, b.nixlXferDList(seg[li.mem_type], src_rows),
                        b.nixlXferDList(seg[remote.mem_type], dst_rows), peer.agent_name, msg, [],
                    )
                xfer._handle = handle
                status = ops.postXferReq(handle, msg)
                done = status == _NIXL_DONE
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
            if done and peer.disconnected:  # reachable again
                peer.disconnected = False
            with self._lock:
                self._counts["transfers_started"] += 1
                self._counts["transfers_done"] += done
        return xfer

    def _abort_post_locked(self, xfer: Transfer, exc: BaseException) -> None:
        """Undo a failed post; caller holds ``xfer._lock``."""
        handle, ops = xfer._handle, xfer._ops
        xfer._handle = xfer._ops = None
        xfer._released = True
        xfer._failure = exc
        _note_disconnect(xfer._peer, exc)
        if handle is not None:
            _quietly("releasing a failed transfer's handle", ops, "releaseXferReq", handle)
        with self._lock:
            self._forget_locked(xfer)
            self._counts["transfers_failed"] += classify(exc)

    def send_notif(self, session_id: str, message: bytes) -> None:
        """Send a standalone NIXL notification to a peer. Safe from any thread.

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
            _note_disconnect(peer, exc)
            raise
        sent_at = time.monotonic()
        with self._lock:
            self._last_notif_at = sent_at

    def get_notifs(self) -> dict[str, list[bytes]]:
        """New notifications since the last call: remote agent name -> messages, in order.

        Thread-safety: safe from any thread; each message goes to one caller.

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
        """Snapshot of the transfers not yet released. Safe from any thread; never raises."""
        with self._lock:
            return list(self._live)

    def stats(self) -> TransportStats:
        """Snapshot of the counters, mutually consistent. Safe from any thread; never raises."""
        with self._lock:
            return TransportStats(
                live_transfers=len(self._live), peers=len(self._peers),
                regions=len(self._regions), **self._counts,
            )

    def close(self) -> None:
        """Release every live transfer, remove every peer, deregister every region and drop
        the NIXL agent. Idempotent; afterwards most methods raise
        :class:`TransportClosedError`.

        Retired regions' memory is freed ~0.25 s after the agent goes (docs/PROTOCOL.md,
        1.). After a recent ``send_notif``, the agent is first progressed (incoming
        notifications dropped) for up to 0.25 s so that queued notifications leave rather
        than being canceled (best effort).

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
            for handle in prepped:  # no post in progress any more (released above)
                _release_prepped(agent, handle)
            with self._lock:
                refused, self._refused_handles = self._refused_handles, []
            for handle in refused:  # one retry each; a handle is never released twice
                try:
                    self._xfer_agent.releaseXferReq(handle)
                except Exception as exc:
                    logger.error("NIXL refused again to release a transfer handle: %s", exc)
                    leaked = getattr(agent, "_leaked_xfer_handles", None)
                    if isinstance(leaked, list):  # the wrapper frees these when destroyed
                        leaked.append(handle)
            for name in remote_agents:
                _quietly(f"removing remote agent {name!r}", agent, "remove_remote_agent", name)
            for region in regions:
                _deregister(agent, region)
            with self._lock:
                self._peers.clear()
                self._retired_peers.clear()
                self._remote_refs.clear()
                self._regions.clear()
                self._retiring.clear()
                self._agent = None
                self._xfer_agent = None  # the binding agent must go with the wrapper
                retired, self._retired = self._retired, []
        # Drop the binding agent now, so a stray reference to the wrapper cannot keep its
        # progress thread alive; unless the wrapper's __del__ needs it for leaked handles.
        if not getattr(agent, "_leaked_xfer_handles", None):
            agent.agent = None
            if retired:
                time.sleep(_RETIRED_GRACE_S)  # a same-host CMA write may still land
        elif retired:
            # The wrapper keeps the agent alive: tie the memory to it.
            agent.nixl_staging_retired_memory = [r.memory for r in retired]
        del retired  # frees the retired regions' memory (unless tied to the agent)

    def _check_open(self) -> None:
        """Raise :class:`TransportClosedError` once closed (one bool read: lock optional)."""
        if self._closed:
            raise TransportClosedError(f"transport {self._name!r} is closed")

    def _drop_remote_ref_locked(self, agent_name: str) -> bool:
        left = self._remote_refs.get(agent_name, 1) - 1
        if left <= 0:
            self._remote_refs.pop(agent_name, None)
            return True
        self._remote_refs[agent_name] = left
        return False

    def _note_released(self, xfer: Transfer, refused: int | None) -> bool:
        """Forget a just released ``xfer`` (``refused``: its handle, which NIXL would not
        release, for close() to retry); whether a retired peer or region may be reaped now."""
        with self._lock:
            if xfer in self._live:
                self._counts["transfers_released"] += 1
            self._forget_locked(xfer)
            if refused is not None:
                self._refused_handles.append(refused)
                self._counts["release_refused"] += 1
            return (xfer._peer.retired and not xfer._peer.transfers) or bool(self._retiring)

    def _forget_locked(self, xfer: Transfer) -> None:
        self._live.discard(xfer)
        xfer._peer.transfers.discard(xfer)  # the entry it was added to, even if since removed

    def _count(self, counter: str) -> None:
        with self._lock:
            self._counts[counter] += 1


def _memory_of(name: str, mem: torch.Tensor | npt.NDArray[Any]) -> tuple[int, int, str, int]:
    """(base address, nbytes, NIXL mem type, device id) of a contiguous tensor or array."""
    if isinstance(mem, np.ndarray):
        if not mem.flags.c_contiguous:
            raise TransportParamError(f"region {name!r}: array must be C-contiguous")
        return int(mem.ctypes.data), int(mem.nbytes), "DRAM", 0
    torch_mod = sys.modules.get("torch")  # no torch imported: no tensor
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
    """Progress ``agent`` (``get_new_notifs``, messages dropped) until monotonic ``until``,
    so its queued notifications leave. Never raises (a NIXL error ends it, logged)."""
    while time.monotonic() < until:
        try:
            agent.get_new_notifs()
        except Exception as exc:
            logger.debug("progressing queued notifications before close: %s", exc)
            return
        time.sleep(_NOTIF_FLUSH_POLL_S)


def _check_timeout(value: float, what: str) -> None:
    """A deadline: a number > 0 or ``inf``. Raises TransportParamError."""
    try:
        check_seconds(value, what, allow_inf=True)
    except (TypeError, ValueError) as exc:
        raise TransportParamError(str(exc)) from None


POLL_SPIN_S = 1e-3
"""For this long after the first poll, polls are separated only by a ``sched_yield``."""
POLL_PAUSE_MIN_S = 20e-6
POLL_PAUSE_MAX_S = 1e-3
POLL_PAUSE_FRACTION = 1 / 16
"""After the spin, each pause is this fraction of the time polled so far (clamped)."""


def poll_pauses(spin_s: float = POLL_SPIN_S) -> Iterator[float]:
    """Pauses between polls of one transfer: ``0.0`` for ``spin_s``, then
    :data:`POLL_PAUSE_FRACTION` of the time elapsed, clamped to
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
    """Sleep ``pause_s``; for ``0`` only ``os.sched_yield`` (``time.sleep(0)`` is slower
    than a 1 MiB write)."""
    if pause_s > 0:
        time.sleep(bounded_wait(pause_s))
    else:
        os.sched_yield()


_MAX_PREPPED_PAGES = 1 << 22
"""Regions with more pages are not prepared (descriptors built per write instead)."""


def _prep_pages(agent: Any, agent_name: str, info: RegionInfo, what: str) -> Any:
    """A NIXL prepared list of ``info``'s pages, one descriptor per page; ``None`` when NIXL
    cannot prepare it (descriptors are then built per write). Never raises."""
    if info.num_pages > _MAX_PREPPED_PAGES:
        return None
    pages = np.arange(info.num_pages, dtype=np.int64)
    rows = _descs(info.base_addr, info.page_bytes, pages, 1, info.device_id)
    try:
        return agent.prep_xfer_dlist(agent_name, rows, info.mem_type, ["UCX"])
    except Exception as exc:
        logger.warning("could not prepare descriptors of %s (%s): built per write", what, exc)
        return None


def _quietly(what: str, agent: Any, method: str, *args: Any) -> None:
    """``agent.method(*args)``, a NIXL clean-up step: a failure is logged, never raised."""
    try:
        getattr(agent, method)(*args)
    except Exception as exc:
        logger.warning("%s failed: %s", what, exc)


def _release_prepped(agent: Any, handle: Any) -> None:
    """Release a prepared descriptor list (``None`` is fine). Never raises."""
    if handle is not None and agent is not None:
        _quietly("releasing a prepared descriptor list", agent, "release_dlist_handle", handle)


def _deregister(agent: Any, region: _LocalRegion) -> None:
    what = f"deregistering region {region.info.name!r}"
    _quietly(what, agent, "deregister_memory", region.reg_descs, ["UCX"])


def _rows_for(
    li: RegionInfo, remote: RegionInfo, src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64],
    coalesce: bool,
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """Descriptor rows of one unprepared write; ``coalesce`` merges runs consecutive on
    both sides."""
    counts: npt.NDArray[np.int64] | int = 1
    if coalesce and src.shape[0] > 1:
        runs = (src[1:] - src[:-1] != 1) | (dst[1:] - dst[:-1] != 1)
        starts = np.concatenate((np.zeros(1, dtype=np.int64), np.flatnonzero(runs) + 1))
        counts = np.append(starts[1:], src.shape[0]) - starts
        src, dst = src[starts], dst[starts]
    return (
        _descs(li.base_addr, li.page_bytes, src, counts, li.device_id),
        _descs(remote.base_addr, remote.page_bytes, dst, counts, remote.device_id),
    )


def _check_pages(
    pages: npt.NDArray[np.int64], num_pages: int, what: str, region: str, *, unique: bool
) -> None:
    """Raise :class:`TransportParamError` unless every page is in ``range(num_pages)`` and,
    with ``unique``, none repeats."""
    lo, hi, repeats = scan_pages(pages, unique=unique)
    if lo < 0 or hi >= num_pages:
        raise TransportParamError(
            f"{what}: page {lo if lo < 0 else hi} out of range for region {region!r} "
            f"({num_pages} pages)"
        )
    if repeats:
        raise TransportParamError(f"{what} contains duplicates")


def _note_disconnect(peer: _Peer, exc: BaseException) -> None:
    """Mark ``peer`` disconnected if ``exc`` is NIXL's "remote agent disconnected" error."""
    cls = getattr(_nixl.bindings, "nixlRemoteDisconnectError", None)
    if cls is not None and isinstance(exc, cls):
        peer.disconnected = True


AGENT_ATTEMPTS = 3
"""Attempts at creating an agent's UCX backend while attempts see the network interfaces
change (:func:`_make_agent`); a failure with no change seen is retried once."""
AGENT_RETRY_PAUSE_S = 0.05
"""Pause before attempt ``n + 1`` is ``n`` times this."""


def _net_interfaces() -> frozenset[tuple[int, str]]:
    """This namespace's network interfaces as ``(index, name)``; empty where unknown."""
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
    """The wrapper agent around a binding agent whose progress thread sleeps, with its UCX
    backend. ``createBackend`` fails (bare ``nixlBackendError``) when a device UCX found
    vanishes meanwhile: retried while the interfaces change, else once.
    Raises AgentSetupError (naming the attempts, interface changes and UCX environment)."""
    strict = _nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    # The wrapper's own binding agent (no progress thread, no backend) is replaced below.
    inert_config = _nixl.nixl_agent_config(
        enable_prog_thread=False, enable_listen_thread=False, backends=[], sync_mode=strict
    )
    wrapper = _nixl.nixl_agent(name, inert_config)
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
            break
        except Exception as exc:
            if backend_error is None or not isinstance(exc, backend_error):
                raise
            wrapper.agent = inert  # the failed binding agent goes
            change = _interface_change(before, _net_interfaces())
            changed_any = changed_any or bool(change)
            seen = (
                f"network interfaces changed meanwhile: {change}"
                if change else "no network interface appeared or vanished meanwhile"
            )
            notes.append(f"attempt {attempt}: {status_name(exc)}, {seen}")
            if attempt == AGENT_ATTEMPTS or not (change or attempt == 1):
                cause = (
                    "a network interface UCX had found vanished while the agent was made (e.g. "
                    "another process's veth torn down): confine UCX to the devices you mean "
                    "with UCX_NET_DEVICES"
                    if changed_any
                    else "the failure repeated with no interface change, so it is not the "
                    "transient one: check UCX_NET_DEVICES (a device that does not exist or has "
                    "no address) and UCX_TLS (no usable transport)"
                )
                raise AgentSetupError(
                    f"could not create the UCX backend of NIXL agent {name!r} "
                    f"({'; '.join(notes)}): {cause}. UCX prints its own reason on this "
                    f"process's stderr; {_ucx_env()}",
                    tuple(notes), changed_any,
                ) from exc
            logger.warning(
                "creating the UCX backend of NIXL agent %r failed (%s); retrying", name, notes[-1]
            )
            time.sleep(AGENT_RETRY_PAUSE_S * attempt)
    del inert
    return wrapper
