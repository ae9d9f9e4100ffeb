"""A reference scheduler loop: drives many :class:`NixlKVSender` rooms the way an engine does.

Per step the loop admits new rooms (up to ``max_active``), sends each active room its next
chunk, polls every room, and concludes it: on ``Success`` it verifies the bytes at the decode
peer (optional) and calls ``clear()``; on ``Failed`` it calls ``failure_exception()`` and
judges what was raised (see :func:`judge_failure`). Used by the end-to-end tests, the stress
suite and the benchmarks; it is also the usage example of the sender API.

Destination pages of a concluded room go back to the free pool by the **drain rule**: once the
room's purge has returned (``clear()``/``failure_exception()``) *and*
``mgr.draining(handle) == 0`` (checked every step). NIXL cannot cancel a posted write, so a
failed room's pages are not safe to hand to another room while one of its transfers may still
land. A manager without ``draining`` (older versions) falls back to holding a failed room's
pages back for ``quarantine_s``; ``release_rule="quarantine"`` forces that old rule (tests use
it to show that the page audit of the stress suite catches what it lets through).
"""

from __future__ import annotations

import hashlib
import random
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from sender.errors import TRANSPORT_ERRORS, KVTransferError
from sender.manager import KVManager, TransferInfo, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.poll import KVPoll
from staging.context import RoomHandle
from staging.errors import LockTimeoutError
from stress.harness.stamps import StampedSources

DigestFn = Callable[[str, Sequence[int]], list[str]]
"""``digest(session_id, dst_pages) -> hex digest per page`` at the decode peer."""

BootstrapFn = Callable[[RoomHandle, TransferInfo, bool, bool], None]
"""``bootstrap(handle, info, too_few_pages, init_done)``: hand a room's transfer info to the
bootstrap thread, which adds it with :func:`deliver_transfer_info` (``init_done``: ``init()``
had returned before the hand-over; else the two race)."""

SenderFactory = Callable[[KVManager, int, Sequence[str], Sequence[TransferInfo]], NixlKVSender]
"""How the driver makes a sender: ``factory(mgr, room, session_ids, transfer_infos)``."""

CONTRACT_PREFIX = "contract: "
"""Prefix of the entries of :attr:`DriverResult.escaped` that are broken sender contracts
(an exception of a type the contract does not allow, a room that should have failed), as
opposed to exceptions that escaped a call that must not raise."""

RELEASE_RULES = ("drain", "quarantine")
REUSE_ORDERS = ("fifo", "lifo")

# What a concluded (purged) room may still show in its footprint until the manager drained:
# "draining" while draining(handle) > 0, and "staging_pool" while a worker that picked up one
# of its chunks before the purge still holds the slot (it returns it when it skips the chunk
# at the post gate, or when the chunk's transfer ends).


def page_digests(pages: torch.Tensor) -> list[str]:
    """blake2b-128 hex digest of each row of a 2-D uint8 tensor (the peer's digest)."""
    data = pages.contiguous().numpy()
    return [hashlib.blake2b(row.tobytes(), digest_size=16).hexdigest() for row in data]


def judge_failure(
    raised: BaseException,
    stored: BaseException | None,
    send_error: BaseException | None,
) -> str | None:
    """Is ``raised`` something ``failure_exception()`` may raise? ``None`` if yes, else why not.

    Allowed: the room's stored exception object (``stored``, read just before the call), the
    sender's own ``send`` error object, any :class:`KVTransferError`, or a known transport
    error (a member of ``TRANSPORT_ERRORS``). Anything else (``KeyError``,
    ``AttributeError``, another opening's exception object, ...) is a broken contract.
    Pure function; thread-safe.
    """
    if raised is stored or raised is send_error:
        return None
    if isinstance(raised, (KVTransferError, *TRANSPORT_ERRORS)):
        return None
    return (
        f"failure_exception() raised {type(raised).__name__}: {raised!r}, which is neither the "
        f"room's stored exception ({stored!r}) nor a KVTransferError nor a transport error"
    )


def deliver_transfer_info(
    mgr: KVManager,
    handle: RoomHandle,
    info: TransferInfo,
    too_few_pages: bool,
    init_done: bool = True,
) -> str | None:
    """Add ``info`` for an opening (what a bootstrap thread does) and judge the manager's
    answer; ``None`` if it kept the contract, else why not.

    The contract: a full info is accepted (``True``), or refused (``False``) because the room
    is gone. An info with fewer destination pages than ``num_kv_indices``, added after
    ``init()`` (``init_done``), is refused with ``ValueError`` *and* the room is failed (or
    already gone), never accepted. When it may have come first (``init_done`` false) it may
    be accepted: ``init()`` must then refuse the count (the scheduler checks that).
    Thread-safe (any thread, as ``add_transfer_info``).

    Raises:
        Exception: whatever ``add_transfer_info`` raised that the contract does not allow
            (the caller counts it as escaped).
    """
    try:
        accepted = mgr.add_transfer_info(handle, info)
    except ValueError as exc:
        if not too_few_pages:
            raise
        by_handle = getattr(mgr, "handle_status", None)
        if by_handle is not None:
            status = by_handle(handle)
        else:  # an older manager: status by id, of this opening only while it is open
            status = mgr.status(handle.room) if mgr.is_open(handle) else None
        if status is not None and status is not KVPoll.Failed:
            return (
                f"room {handle.room}: too few destination pages refused ({exc}) but the room "
                f"is left {status!r}, not Failed"
            )
        return None
    if too_few_pages and accepted and init_done:
        return (
            f"room {handle.room}: add_transfer_info after init accepted "
            f"{info.dst_pages.size} destination pages, fewer than the room sends"
        )
    return None


@dataclass(frozen=True, slots=True)
class DriverConfig:
    """What to run.

    Attributes:
        rooms: how many rooms to run in total.
        chunks: chunks per room (``send`` calls).
        pages_per_chunk: KV pages per chunk.
        max_active: rooms in flight at once.
        room_base: id of the first room (ids are consecutive).
        seed: seed of the room plans (source pages, session choice) and of the chaos below.
        deadline_s: the run gives up (aborting what is left) after this long.
        quarantine_s: only for ``release_rule="quarantine"`` (or a manager without
            ``draining``): a failed room's destination pages are held back this long.
        verify: check every ``Success`` room's bytes at the peer (needs ``digest``).
        release_rule: ``"drain"`` (pages of a concluded room are reused once its purge
            returned and ``mgr.draining(handle) == 0``) or ``"quarantine"`` (the old fixed
            delay; unsafe, kept to show the audit catches it).
        abort_rate: fraction of rooms the scheduler gives up (``abort()``) after a random
            number of its chunks were sent, while they are queued or in flight.
        abort_lag_s: how long after sending that chunk the abort comes (a worker has then
            usually posted it: the abort finds it in flight).
        late_info_rate: fraction of rooms whose transfer info is not passed to the sender but
            added after ``init()`` (by the bootstrap callback, else inline).
        short_info_rate: fraction of those late infos that carry one destination page too
            few: the manager must refuse the info and fail the room.
        reuse: ``"fifo"`` hands out the longest-free destination pages first; ``"lifo"`` the
            most recently freed ones (a page is reused as soon as it is safe: the strictest
            test of the release rule).
        decode_hold_s: how long the decode side keeps a ``Success`` room's pages (it decodes
            from them) before they are free again; a write that lands on them meanwhile
            corrupts a request being decoded.
    """

    rooms: int
    chunks: int = 8
    pages_per_chunk: int = 1
    max_active: int = 16
    room_base: int = 0
    seed: int = 0
    deadline_s: float = 120.0
    quarantine_s: float = 1.0
    verify: bool = True
    release_rule: str = "drain"
    abort_rate: float = 0.0
    abort_lag_s: float = 0.0
    late_info_rate: float = 0.0
    short_info_rate: float = 0.0
    reuse: str = "fifo"
    decode_hold_s: float = 0.0


@dataclass(frozen=True, slots=True)
class RoomOutcome:
    """How one room ended.

    ``footprint``: what the manager still held for the room at its conclusion, less what a
    purged room may hold until the manager drained (``"draining"`` while ``draining`` > 0,
    ``"staging_pool"`` while a worker still holds a slot for it). ``started_at``: when it was
    admitted (``time.monotonic()``); ``dst_pages``/``src_pages``: its decode destination and
    prefill source pages, in room order (what the page audit of the stress suite needs).
    ``generation``: the opening's generation. ``sent_digests``: with stamped sources
    (``SchedulerDriver(sources=...)``), the digest of each stamped page the room sent, in
    room order (what each of its decode pages holds once it succeeded); empty otherwise.
    """

    room: int
    session_id: str
    status: KVPoll | None
    latency_s: float
    error: str | None
    verified: bool | None
    footprint: tuple[str, ...]
    concluded_at: float
    started_at: float = 0.0
    dst_pages: tuple[int, ...] = ()
    src_pages: tuple[int, ...] = ()
    draining: int = 0
    short_info: bool = False
    generation: int = -1
    sent_digests: tuple[str, ...] = ()
    reason: str = ""
    """A failed room's ``failure_exception()`` message (clipped to 300 characters)."""


@dataclass(frozen=True, slots=True)
class DriverResult:
    """The outcome of :meth:`SchedulerDriver.run`.

    ``escaped``: exceptions that escaped a call that must not raise, and broken sender
    contracts (prefixed :data:`CONTRACT_PREFIX`). ``refused``: rooms whose opening was refused
    (``LockTimeoutError``; the manager was closed: admission then stops; or ``init()`` refused
    the count because a too-short transfer info came first).
    ``held_rooms``: concluded rooms whose pages were still held back (draining) at return.
    """

    outcomes: tuple[RoomOutcome, ...]
    wall_s: float
    unconcluded: int
    escaped: tuple[str, ...]
    refused: int = 0
    held_rooms: int = 0

    @property
    def succeeded(self) -> int:
        return sum(o.status is KVPoll.Success for o in self.outcomes)

    @property
    def failed(self) -> int:
        return sum(o.status is KVPoll.Failed for o in self.outcomes)

    @property
    def verify_failures(self) -> int:
        return sum(o.verified is False for o in self.outcomes)

    @property
    def leaked_rooms(self) -> int:
        return sum(bool(o.footprint) for o in self.outcomes)

    @property
    def rooms_per_s(self) -> float:
        return len(self.outcomes) / self.wall_s if self.wall_s > 0 else 0.0

    def latency_quantiles(self) -> tuple[float, float]:
        """(p50, p99) room latency in seconds (0 when no room finished)."""
        lat = sorted(o.latency_s for o in self.outcomes)
        if not lat:
            return 0.0, 0.0
        if len(lat) == 1:
            return lat[0], lat[0]
        q = statistics.quantiles(lat, n=100, method="inclusive")
        return statistics.median(lat), q[98]


@dataclass(slots=True)
class _Active:
    sender: NixlKVSender
    session_id: str
    src: np.ndarray
    dst: np.ndarray
    started: float
    chunks_sent: int = 0
    awaiting_info: bool = False
    short_info: bool = False
    abort_after: int | None = None  # abort once this many chunks were sent
    sent_at: float = 0.0  # when the last chunk was sent
    expected: list[str] | None = None  # digests of the stamped source pages


@dataclass(slots=True)
class _Held:
    """Destination pages of a concluded room, not yet safe to reuse."""

    handle: RoomHandle
    pages: np.ndarray
    release_at: float | None  # quarantine rule: when; None: drain rule
    src: np.ndarray | None = None  # stamped source pages, released with them


@dataclass(slots=True)
class _DstPool:
    free: deque[int]
    held: deque[_Held] = field(default_factory=deque)


class SchedulerDriver:
    """Runs rooms through a manager like an engine's scheduler thread.

    Args:
        mgr: the manager (its transport has the sessions as peers).
        sessions: session id -> number of destination pages its peer has.
        digest: how to read page digests at a peer (``None`` disables verification).
        bootstrap: where late transfer infos go (``DriverConfig.late_info_rate``); ``None``
            adds them inline right after ``init()``.
        sender_factory: how to make a sender (default :class:`NixlKVSender`).
        sources: give each room source pages of its own, stamped with its opening and
            chunk (:class:`~stress.harness.stamps.StampedSources`): the bytes found at a decode page
            then name their writer, and each room is verified against its own stamped
            digests. Its pages return with the room's destination pages (the drain rule).
            ``None``: rooms sample the shared KV pool.

    The free/held destination pages persist across ``run`` calls, so pages of a room still
    draining when one run returns are not handed out by the next.

    Observers (optional attributes, called on the scheduler thread): ``progress(done,
    total)``; ``on_admit(handle, will_abort)`` when a room is opened (``will_abort``: the
    scheduler will give it up, see ``abort_rate``); ``on_conclude(outcome)`` as soon as a room
    concluded; ``before_reuse(session,
    pages)`` right before destination pages are handed to a new room (a check of what the
    previous rooms left there, e.g. the stress suite's page audit). What they raise
    propagates out of ``run``.

    Thread-safety: one ``run`` at a time, on the calling (scheduler) thread. ``stop()``,
    ``stop_admitting()`` and ``live_handles()`` may be called from any thread.
    """

    def __init__(
        self,
        mgr: KVManager,
        sessions: Mapping[str, int],
        digest: DigestFn | None = None,
        *,
        bootstrap: BootstrapFn | None = None,
        sender_factory: SenderFactory = NixlKVSender,
        sources: StampedSources | None = None,
    ) -> None:
        if not sessions:
            raise ValueError("at least one session is needed")
        self.sources = sources
        self.mgr = mgr
        self.sessions = dict(sessions)
        self.digest = digest
        self.bootstrap = bootstrap
        self.sender_factory = sender_factory
        self._stop = threading.Event()
        self._no_admit = threading.Event()
        self._src_digests = page_digests(mgr.kv_pool) if digest is not None else []
        self.progress: Callable[[int, int], None] | None = None
        # Observers (scheduler thread): every outcome as soon as its room concluded, and the
        # destination pages of a session right before they are handed to a new room.
        self.on_admit: Callable[[RoomHandle, bool], None] | None = None
        self.on_conclude: Callable[[RoomOutcome], None] | None = None
        self.before_reuse: Callable[[str, Sequence[int]], None] | None = None
        # Scheduler thread only.
        self._pools = {sid: _DstPool(deque(range(n))) for sid, n in self.sessions.items()}
        # Guarded by _live_lock: the handles of the rooms being driven now.
        self._live_lock = threading.Lock()
        self._live: dict[int, RoomHandle] = {}
        # Scheduler thread only: the running run's deadline (time.monotonic()), and how often
        # footprint() was refused with LockTimeoutError and tried again (all runs).
        self._deadline = float("inf")
        self.footprint_retries = 0

    def stop(self) -> None:
        """Ask a running ``run`` to abort what is left and return. Thread-safe."""
        self._stop.set()

    def stop_admitting(self) -> None:
        """Ask a running ``run`` (and later ones) to open no new room, let the active ones
        conclude by themselves (or at the deadline), and return. Thread-safe."""
        self._no_admit.set()

    def live_handles(self) -> list[RoomHandle]:
        """Handles of the rooms admitted and not yet concluded (a snapshot). Thread-safe:
        another thread may poll them (e.g. ``mgr.progress(handle)``)."""
        with self._live_lock:
            return list(self._live.values())

    def held_rooms(self) -> int:
        """Concluded rooms whose destination pages are still held back. Scheduler thread."""
        return sum(len(p.held) for p in self._pools.values())

    def run(self, cfg: DriverConfig) -> DriverResult:
        """Run ``cfg.rooms`` rooms; never raises for a failed room (it is an outcome).

        Raises:
            ValueError: a room needs more destination pages than a session has, or a bad
                config.
        """
        need = cfg.chunks * cfg.pages_per_chunk
        if (
            cfg.rooms < 0
            or cfg.chunks < 1
            or cfg.pages_per_chunk < 1
            or cfg.max_active < 1
            or cfg.release_rule not in RELEASE_RULES
            or cfg.reuse not in REUSE_ORDERS
            or not all(
                0.0 <= r <= 1.0 for r in (cfg.abort_rate, cfg.late_info_rate, cfg.short_info_rate)
            )
            or not cfg.decode_hold_s >= 0
            or not cfg.abort_lag_s >= 0
        ):
            raise ValueError(f"bad driver config: {cfg}")
        for sid, n in self.sessions.items():
            if need > n:
                raise ValueError(f"a room needs {need} pages; session {sid!r} has {n}")
        rng = random.Random(cfg.seed)
        chaos = random.Random(cfg.seed * 7919 + 17)  # separate: room plans stay as they were
        pools = self._pools
        session_ids = sorted(self.sessions)
        kv_pages = self.mgr.kv_pool.shape[0]
        outcomes: list[RoomOutcome] = []
        escaped: list[str] = []
        active: list[_Active] = []
        next_room = 0
        refused = 0
        admitting = True
        t0 = time.monotonic()
        deadline = t0 + cfg.deadline_s
        self._deadline = deadline
        while ((admitting and next_room < cfg.rooms) or active) and not self._stop.is_set():
            if time.monotonic() > deadline:
                break
            if self._no_admit.is_set():
                admitting = False
            moved = self._release_held(escaped)
            while admitting and next_room < cfg.rooms and len(active) < cfg.max_active:
                sid = session_ids[rng.randrange(len(session_ids))]
                pool = pools[sid]
                if len(pool.free) < need:
                    break
                if self.sources is not None and self.sources.available() < need:
                    break
                take = pool.free.pop if cfg.reuse == "lifo" else pool.free.popleft
                dst = np.array([take() for _ in range(need)], dtype=np.int64)
                if self.before_reuse is not None:
                    self.before_reuse(sid, dst.tolist())
                if self.sources is not None:
                    src = self.sources.take(need)
                else:
                    src = np.array(rng.sample(range(kv_pages), need), dtype=np.int64)
                room = cfg.room_base + next_room
                next_room += 1
                late = cfg.late_info_rate > 0 and chaos.random() < cfg.late_info_rate
                short = late and cfg.short_info_rate > 0 and chaos.random() < cfg.short_info_rate
                abort_after = (
                    chaos.randint(1, cfg.chunks)
                    if cfg.abort_rate > 0 and chaos.random() < cfg.abort_rate
                    else None
                )
                started = time.monotonic()
                try:
                    infos = [] if late else [make_transfer_info(sid, dst)]
                    sender = self.sender_factory(self.mgr, room, [sid], infos)
                except LockTimeoutError:  # a documented refusal under lock_timeout
                    refused += 1
                    self._unused(pool, dst, src)
                    continue
                except RuntimeError as exc:
                    self._unused(pool, dst, src)
                    if "closed" in str(exc).lower():  # the manager was closed: stop admitting
                        refused += 1
                        admitting = False
                        break
                    escaped.append(f"room {room} setup: {exc!r}")
                    continue
                except Exception as exc:  # bad config or a programming error: recorded
                    escaped.append(f"room {room} setup: {exc!r}")
                    self._unused(pool, dst, src)
                    continue
                expected: list[str] | None = None
                if self.sources is not None:  # before any chunk of the room is sent
                    handle0 = sender.handle
                    expected = self.sources.stamp(
                        room, handle0.generation, src.tolist(), dst.tolist()
                    )
                # A late info goes to the bootstrap thread before or after init(): whichever
                # comes first, too few destination pages must be refused cleanly.
                info_first = late and chaos.random() < 0.5
                if info_first:
                    info = make_transfer_info(sid, dst[: need - 1] if short else dst)
                    self._hand_over(sender.handle, info, short, False, escaped)
                try:
                    sender.init(need)
                except ValueError as exc:
                    if not (short and info_first):  # else: the short info came first: refused
                        escaped.append(f"room {room} init({need}): {exc!r}")
                    else:
                        refused += 1
                    sender.clear()
                    self._hold(pool, sender.handle, dst, None, src)
                    continue
                except Exception as exc:  # init must accept a count its infos can hold
                    escaped.append(f"room {room} init({need}): {exc!r}")
                    sender.clear()
                    self._hold(pool, sender.handle, dst, None, src)
                    continue
                with self._live_lock:
                    self._live[room] = sender.handle
                if self.on_admit is not None:
                    self.on_admit(sender.handle, abort_after is not None)
                active.append(
                    _Active(
                        sender,
                        sid,
                        src,
                        dst,
                        started,
                        awaiting_info=late,
                        short_info=short,
                        abort_after=abort_after,
                        expected=expected,
                    )
                )
                if late and not info_first:
                    info = make_transfer_info(sid, dst[: need - 1] if short else dst)
                    self._hand_over(sender.handle, info, short, True, escaped)
                moved = True
            still: list[_Active] = []
            for a in active:
                try:
                    if a.awaiting_info and self.mgr.ready(a.sender.handle):
                        a.awaiting_info = False
                    if (
                        a.abort_after is not None
                        and a.chunks_sent >= a.abort_after
                        and time.monotonic() - a.sent_at >= cfg.abort_lag_s
                    ):
                        a.abort_after = None  # a step (or the lag) after that chunk
                        a.sender.abort()
                    if not a.awaiting_info and a.chunks_sent < cfg.chunks:
                        lo = a.chunks_sent * cfg.pages_per_chunk
                        a.sender.send(a.src[lo : lo + cfg.pages_per_chunk])
                        a.chunks_sent += 1
                        a.sent_at = time.monotonic()
                        moved = True
                    status = a.sender.poll()
                except Exception as exc:  # the contract says this never happens
                    escaped.append(f"room {a.sender.bootstrap_room}: {exc!r}")
                    status = KVPoll.Failed
                if status in (KVPoll.Success, KVPoll.Failed):
                    outcomes.append(self._conclude(a, status, pools[a.session_id], cfg, escaped))
                    if self.on_conclude is not None:
                        self.on_conclude(outcomes[-1])
                    moved = True
                    if self.progress is not None:
                        self.progress(len(outcomes), cfg.rooms)
                else:
                    still.append(a)
            active = still
            if not moved:
                time.sleep(0.0005)
        unconcluded = len(active) + (cfg.rooms - next_room if admitting else 0)
        for a in active:  # deadline or stop: give the rest up, still without leaking
            a.sender.abort()
            outcomes.append(self._conclude(a, KVPoll.Failed, pools[a.session_id], cfg, escaped))
            if self.on_conclude is not None:
                self.on_conclude(outcomes[-1])
        self._release_held(escaped)
        return DriverResult(
            tuple(outcomes),
            time.monotonic() - t0,
            unconcluded,
            tuple(escaped),
            refused,
            self.held_rooms(),
        )

    def wait_pages(self, timeout_s: float) -> bool:
        """Poll the held pages until every one is back in the free pool (``True``) or
        ``timeout_s`` passed. Scheduler thread (between runs)."""
        end = time.monotonic() + timeout_s
        scratch: list[str] = []
        while True:
            self._release_held(scratch)
            if not self.held_rooms():
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.002)

    # ------------------------------------------------------------------ helpers

    def _hand_over(
        self,
        handle: RoomHandle,
        info: TransferInfo,
        short: bool,
        init_done: bool,
        escaped: list[str],
    ) -> None:
        if self.bootstrap is not None:
            self.bootstrap(handle, info, short, init_done)
            return
        try:
            problem = deliver_transfer_info(self.mgr, handle, info, short, init_done)
        except Exception as exc:
            escaped.append(f"room {handle.room} add_transfer_info: {exc!r}")
            return
        if problem is not None:
            escaped.append(CONTRACT_PREFIX + problem)

    def _draining(self, handle: RoomHandle, escaped: list[str], *, poll: bool = False) -> int:
        """``mgr.draining(handle)``, or 0 for a manager without it. With ``poll`` and an
        inline manager (no workers: nobody else polls a purged room's transfers once no room
        is being driven), poll them once first (``wait_drained(handle, 0)``)."""
        fn = getattr(self.mgr, "draining", None)
        if fn is None:
            return 0
        try:
            if poll and self.mgr.num_workers == 0 and hasattr(self.mgr, "wait_drained"):
                self.mgr.wait_drained(handle, 0.0)
            return int(fn(handle))
        except Exception as exc:  # documented never to raise
            escaped.append(f"room {handle.room} draining(): {exc!r}")
            return 1

    def _hold(
        self,
        pool: _DstPool,
        handle: RoomHandle,
        pages: np.ndarray,
        release_at: float | None,
        src: np.ndarray | None = None,
    ) -> None:
        # mutant-site: hold
        pool.held.append(_Held(handle, pages, release_at, src))

    def _unused(self, pool: _DstPool, dst: np.ndarray, src: np.ndarray) -> None:
        """Pages taken for a room that never opened (nothing of it was sent)."""
        pool.free.extend(int(p) for p in dst)
        if self.sources is not None:
            self.sources.give_back(src.tolist())

    def _free(self, pool: _DstPool, dst: np.ndarray, src: np.ndarray | None) -> None:
        """A concluded room's pages, safe now: back to the free pools."""
        pool.free.extend(int(p) for p in dst)
        if self.sources is not None and src is not None:
            self.sources.give_back(src.tolist())

    def _release_held(self, escaped: list[str]) -> bool:
        """Move every held page set that is safe now back to its free pool."""
        moved = False
        now = time.monotonic()
        for pool in self._pools.values():
            if not pool.held:
                continue
            keep: deque[_Held] = deque()
            for h in pool.held:
                if h.release_at is not None:
                    safe = h.release_at <= now
                else:
                    safe = self._draining(h.handle, escaped, poll=True) == 0
                if safe:
                    self._free(pool, h.pages, h.src)
                    moved = True
                else:
                    keep.append(h)
            pool.held = keep
        return moved

    def _stored_exception(self, room: int) -> BaseException | None:
        try:
            return self.mgr.exceptions.get(room)
        except Exception:  # a diagnostic read; the judgement then allows less
            return None

    def _footprint(self, room: int, draining: int, escaped: list[str]) -> tuple[str, ...]:
        """What the manager still holds for ``room`` (see :attr:`RoomOutcome.footprint`).

        ``footprint()`` raises ``LockTimeoutError`` when the staging context has a
        ``lock_timeout`` and another thread holds its lock longer (documented). That is no
        fault: a long reader, or a holder descheduled on a busy machine, may hold it for any
        number of ``lock_timeout`` periods. So it is tried again for as long as this run may
        take (until its deadline, ``DriverConfig.deadline_s``, or :meth:`stop`); only a lock
        still held then is reported (in ``escaped``). A lock held for good stops this thread's
        progress, which is what a deadlock is: the stress suite's watchdog reports that."""
        attempts = 0
        while True:
            try:
                held = self.mgr.footprint(room)
                break
            except LockTimeoutError as exc:
                attempts += 1
                if time.monotonic() >= self._deadline or self._stop.is_set():
                    escaped.append(
                        f"room {room} footprint(): {exc!r}: the lock stayed busy until the "
                        f"run's deadline ({attempts} attempts)"
                    )
                    return ()
                self.footprint_retries += 1
        return tuple(
            n for n in held if not (n == "staging_pool" or (n == "draining" and draining > 0))
        )

    def _conclude(
        self, a: _Active, status: KVPoll, pool: _DstPool, cfg: DriverConfig, escaped: list[str]
    ) -> RoomOutcome:
        room = a.sender.bootstrap_room
        handle = a.sender.handle
        verified: bool | None = None
        error: str | None = None
        reason = ""
        if status is KVPoll.Success:
            # Success means every chunk is done: none of the room may still be in flight.
            if "inflight" in self._footprint(room, 0, escaped):
                escaped.append(
                    CONTRACT_PREFIX + f"room {room}: poll() said Success while a chunk of it "
                    "was still in flight"
                )
            if cfg.verify and self.digest is not None:
                try:
                    got = self.digest(a.session_id, a.dst.tolist())
                    want = (
                        a.expected
                        if a.expected is not None
                        else [self._src_digests[p] for p in a.src.tolist()]
                    )
                    verified = got == want
                except Exception as exc:  # the peer may be gone by now
                    error = f"verify: {exc!r}"
                    verified = None
            try:
                a.sender.clear()
            except Exception as exc:  # documented never to raise
                escaped.append(f"room {room} clear(): {exc!r}")
            if a.short_info:
                escaped.append(
                    CONTRACT_PREFIX + f"room {room}: its transfer info had too few destination "
                    "pages, yet it concluded Success"
                )
        else:
            stored = self._stored_exception(room)
            send_error = getattr(a.sender, "_send_error", None)
            try:
                a.sender.failure_exception()
            except Exception as exc:  # by design: this is how the failure is reported
                error = type(exc).__name__
                reason = str(exc)[:300]
                problem = judge_failure(exc, stored, send_error)
                if problem is None and a.short_info and isinstance(exc, TypeError | ValueError):
                    problem = (
                        f"a transfer info with too few destination pages got as far as a "
                        f"transfer: failure_exception() raised {exc!r}"
                    )
                if problem is not None:
                    escaped.append(CONTRACT_PREFIX + f"room {room}: {problem}")
            else:
                escaped.append(CONTRACT_PREFIX + f"room {room}: failure_exception() returned")
        with self._live_lock:
            self._live.pop(room, None)
        draining = self._draining(handle, escaped)  # before the footprint: see RoomOutcome
        footprint = self._footprint(room, draining, escaped)
        if status is KVPoll.Success and cfg.decode_hold_s > 0:
            self._hold(pool, handle, a.dst, time.monotonic() + cfg.decode_hold_s, a.src)
        elif cfg.release_rule == "drain" and hasattr(self.mgr, "draining"):
            if draining == 0:
                self._free(pool, a.dst, a.src)
            else:
                self._hold(pool, handle, a.dst, None, a.src)
        elif status is KVPoll.Success or cfg.quarantine_s <= 0:
            self._free(pool, a.dst, a.src)
        else:
            self._hold(pool, handle, a.dst, time.monotonic() + cfg.quarantine_s, a.src)
        concluded = time.monotonic()
        return RoomOutcome(
            room,
            a.session_id,
            status,
            concluded - a.started,
            error,
            verified,
            footprint,
            concluded,
            a.started,
            tuple(int(p) for p in a.dst),
            tuple(int(p) for p in a.src),
            draining,
            a.short_info,
            handle.generation,
            tuple(a.expected or ()),
            reason,
        )
