"""``staging-race``: N threads race every StagingContext operation on R shared rooms.

Workers pick, per step (from ``config.rng(i)``): ``request_prefetch``, ``request_prefetches``,
``cancel_prefetch``, ``mark_prefetched``, ``purge_room`` (+ reopen), ``open_room``, point
reads, or (with probability ``--fault-rate``) ``purge_session`` -- a simulated decode-peer
death. Each worker keeps the last few :class:`~staging.RoomHandle` objects it saw per room and
keeps writing with them after the room was purged and reopened: stale handles are in play
all the time.

How "resurrection" is made visible: a write made through a handle of generation ``g`` uses
chunk index ``g * chunks + c`` (a *tagged* key), so every tagged key names the generation its
writer believed in. A purge of generation ``g`` must return tagged keys of ``g`` only, an open
room must hold tagged keys of its own generation only, and a write through a handle whose
generation was already purged (``dead``) must be refused.

Checks: per operation (stale acceptance, purge contents); continuously from the coordinator
thread (``snapshot()``/``stats()`` are each self-consistent); at quiescent epochs (workers
parked on a barrier every ``EPOCH_S``: stats agree with the snapshot, every room's keys and
generation agree, and the lock-free point reads ``is_open``/``is_prefetched``/``is_requested``
answer exactly what the snapshot says, through the room id and through its handle, for every
key of the snapshot, for every absent key of the room's key space, for the keys that were
there at the previous epoch and are gone now, for closed and never-opened rooms and for the
previous epoch's now-stale handles: ``point-reads``); and at the end (purge every room, then
nothing is left). Meanwhile two probe threads run tiny recorded programs on a room of their
own, contending for the same lock, and every round's history must be linearizable
(:mod:`stress.linearizability`).

The context has ``--lock``'s kind (rw or mutex: nothing here depends on which) and is in
lock debug mode on even seeds only (:func:`debug_locks`): odd seeds race the library's default
configuration (debug off). ``tests/staging/test_races.py``
runs the scenario with each kind in each mode.

Test-only planted bugs (``config.plant_bug``), each of which must fail the run:
``"resurrect"`` swaps in a context that re-opens a purged room for a late writer
(``no-resurrection``); ``"racy-request"`` makes ``request_prefetch`` a check-then-act
(``linearizable``); ``"reentry"`` makes workers re-acquire the held staging lock now and then
(``lock-order``; such a run is always in debug mode); ``"deadlock"`` makes worker 0 keep the
write lock forever (``no-deadlock``, ``no-thread-left``).
"""

from __future__ import annotations

import functools
import random
import threading
import time
from dataclasses import asdict
from typing import NamedTuple

from staging import RoomAlreadyOpenError, RoomHandle, RoomPurge, StagingContext
from staging.context import PrefetchKey, StagingSnapshot
from stress.framework import (
    JSONValue,
    Monitor,
    ScenarioMetrics,
    StressConfig,
    WorkerCounters,
    register,
)
from stress.invariants import (
    COUNTERS_CONSISTENT,
    LINEARIZABLE,
    LOCK_ORDER,
    NO_DEADLOCK,
    NO_ESCAPED_EXCEPTION,
    NO_LEAK,
    NO_RESURRECTION,
    NO_THREAD_LEFT,
    describe,
)
from stress.linearizability import Op, ThreadRecorder, first_violation

SESSIONS = ("d0", "d1", "d2", "d3")
HANDLES_KEPT = 3
EPOCH_S = 0.25
CHECK_EVERY_S = 0.02
PROBE_THREADS = 2
PROBE_SEED_OFFSET = 1000  # probe thread k draws from Random(seed + 1000 + k)
PROBE_SESSIONS = ("p0", "p1")  # never used by the workers
PROBE_OPS = (
    "request", "request", "requests", "cancel", "mark", "purge", "open", "purge_session",
    "is_requested", "is_prefetched", "is_open", "room_requests",
)  # fmt: skip
PROBE_REFS = ("id", "handle", "stale", "mine")
PLANTED_BUGS = ("resurrect", "racy-request", "reentry", "deadlock")
NEVER_OPENED = 2  # room ids past the probe room that no thread ever opens: point reads say no

POINT_READS = describe(
    "point-reads", "lock-free point reads agree with the snapshot at quiescent points"
)

Ref = int | RoomHandle


class _ResurrectingContext(StagingContext):
    """PLANTED BUG (test-only): a late write through a stale handle re-opens the room.

    This is the upstream failure mode the room lifecycle exists to prevent; the scenario must
    report it under ``no-resurrection``.
    """

    def request_prefetch(self, room: Ref, chunk_idx: int, session_id: str) -> bool:
        ok = super().request_prefetch(room, chunk_idx, session_id)
        if ok or not isinstance(room, RoomHandle) or self.is_open(room.room):
            return ok
        try:
            fresh = self.open_room(room.room)
        except RoomAlreadyOpenError:
            return False
        return super().request_prefetch(fresh, chunk_idx, session_id)


class _RacyContext(StagingContext):
    """PLANTED BUG (test-only): ``request_prefetch`` as a check-then-act across two lock
    acquisitions, so two threads can both report the same key newly recorded. Only the
    ``linearizable`` probe can see this one."""

    def request_prefetch(self, room: Ref, chunk_idx: int, session_id: str) -> bool:
        if not self.is_open(room) or self.is_requested(room, chunk_idx, session_id):
            return False
        time.sleep(0)  # yield between the check and the act
        self.request_prefetches(room, (chunk_idx,), session_id)
        return True


def debug_locks(config: StressConfig) -> bool:
    """Whether a run builds its context in lock debug mode: on even seeds (re-entry and
    lock-order checks, ``lock-order``), and always for the planted ``reentry``; odd seeds run
    the library's own default, debug off. The lock kind is ``--lock``'s, whichever it is."""
    return config.seed % 2 == 0 or config.plant_bug == "reentry"


class _Shared:
    """State shared by the workers and the coordinator of one run."""

    def __init__(self, config: StressConfig, monitor: Monitor) -> None:
        factory: type[StagingContext] = StagingContext
        if config.plant_bug == "resurrect":
            factory = _ResurrectingContext
        elif config.plant_bug == "racy-request":
            factory = _RacyContext
        # A lock wait twice the watchdog period is a deadlock: it raises instead of hanging the
        # run (the watchdog has reported the stall by then).
        self.debug = debug_locks(config)
        self.ctx = factory(lock=config.lock, debug=self.debug, lock_timeout=2 * config.watchdog_s)
        self.config = config
        self.monitor = monitor
        self.rooms = config.rooms
        self.chunks = config.chunks
        # generation -> token of the purge that closed it. setdefault is atomic under the GIL,
        # so "two purges both closed generation g" is detected exactly.
        self.dead: dict[int, object] = {}
        # generation -> perf_counter() at open, for the room-lifecycle latency.
        self.open_times: dict[int, float] = {}
        self.pause = threading.Event()
        self.finished = threading.Event()
        # Parties: the workers, the two probe threads and the coordinator.
        self.barrier = threading.Barrier(
            config.threads + PROBE_THREADS + 1, timeout=config.watchdog_s
        )

    def tag(self, generation: int, chunk: int) -> int:
        """The chunk index a writer with a handle of ``generation`` uses."""
        return generation * self.chunks + chunk

    def generation_of(self, chunk_idx: int) -> int | None:
        """The generation a tagged chunk index names, or ``None`` for an untagged one."""
        return chunk_idx // self.chunks if chunk_idx >= self.chunks else None

    def opened(self, handle: RoomHandle) -> None:
        """Record the open time of a new generation."""
        self.open_times[handle.generation] = time.perf_counter()

    def check_purge(self, purge: RoomPurge, ref: Ref, token: object) -> bool:
        """Check one ``purge_room`` result; ``True`` if it closed a generation."""
        mon = self.monitor
        if not purge.was_open:
            if purge.requests or purge.was_prefetched:
                mon.violation(NO_RESURRECTION, f"no-op purge returned state: {purge}")
            return False
        gen = purge.generation
        if gen is None:
            mon.violation(NO_RESURRECTION, f"purge closed a room without a generation: {purge}")
            return True
        if self.dead.setdefault(gen, token) is not token:
            mon.violation(NO_RESURRECTION, f"generation {gen} of room {purge.room} purged twice")
        if isinstance(ref, RoomHandle) and ref.generation != gen:
            mon.violation(NO_RESURRECTION, f"purge via {ref} closed generation {gen}")
        foreign = sorted(
            (c, s) for c, s in purge.requests if self.generation_of(c) not in (None, gen)
        )
        if foreign:
            mon.violation(
                NO_RESURRECTION,
                f"purge of room {purge.room} gen {gen} returned other generations' keys "
                f"{foreign[:3]}",
            )
        started = self.open_times.pop(gen, None)
        if started is not None:
            mon.latency(time.perf_counter() - started)
        return True


class _Draw(NamedTuple):
    """Every random choice of one step, drawn up front in a fixed order, so that a worker's
    plan (the sequence of draws) depends on the seed only, never on what its operations
    returned: ``--seed`` replays the same plan, whatever the interleaving."""

    room: int
    fault: float
    ref: float
    pick: float
    op: float
    chunk: int
    session: str
    sub: float
    batch: int
    bug: float

    @classmethod
    def take(cls, rng: random.Random, rooms: int, chunks: int) -> _Draw:
        """Draw one step's choices from ``rng``."""
        return cls(
            room=rng.randrange(rooms),
            fault=rng.random(),
            ref=rng.random(),
            pick=rng.random(),
            op=rng.random(),
            chunk=rng.randrange(chunks),
            session=rng.choice(SESSIONS),
            sub=rng.random(),
            batch=1 + rng.randrange(4),
            bug=rng.random(),
        )


class _Worker:
    """One racing thread; its random plan comes from ``Random(seed + index)``."""

    def __init__(self, shared: _Shared, index: int) -> None:
        self.shared = shared
        self.ctx = shared.ctx
        self.index = index
        self.rng = shared.config.rng(index)
        self.counters: WorkerCounters = shared.monitor.counters()
        self.handles: dict[int, list[RoomHandle]] = {}
        self.stale_attempts = 0

    # -- loop --------------------------------------------------------------------------

    def run(self) -> None:
        """Step until the coordinator says finished; park at each epoch barrier."""
        shared = self.shared
        while not shared.finished.is_set():
            if shared.pause.is_set():
                try:
                    shared.barrier.wait()  # arrive: the coordinator checks a quiescent state
                    shared.barrier.wait()  # resume
                except threading.BrokenBarrierError:
                    return
                continue
            d = _Draw.take(self.rng, shared.rooms, shared.chunks)
            try:
                self.step(d)
            except Exception as exc:  # counted; the worker keeps racing
                shared.monitor.exception(exc, f"worker-{self.index}")
            else:
                self.counters.ops += 1  # failed steps are no progress (for the watchdog)

    def remember(self, handle: RoomHandle) -> None:
        kept = self.handles.setdefault(handle.room, [])
        if handle not in kept:
            kept.append(handle)
            del kept[:-HANDLES_KEPT]

    def pick_ref(self, d: _Draw) -> Ref:
        """A kept (maybe stale) handle, a fresh handle, or the bare room id."""
        kept = self.handles.get(d.room)
        if kept and d.ref < 0.55:
            return kept[int(d.pick * len(kept))]
        if d.ref < 0.75:
            handle = self.ctx.handle(d.room)
            if handle is not None:
                self.remember(handle)
                return handle
        return d.room

    # -- one step ----------------------------------------------------------------------

    def step(self, d: _Draw) -> None:
        shared, ctx = self.shared, self.ctx
        if shared.config.plant_bug is not None:
            self.planted(shared.config.plant_bug, d)
        if d.fault < shared.config.fault_rate:
            ctx.purge_session(d.session)
            self.counters.faults += 1
            return
        ref = self.pick_ref(d)
        if d.op < 0.34:
            self.request(ref, d)
        elif d.op < 0.44:
            self.request_many(ref, d)
        elif d.op < 0.54:
            self.cancel(ref, d)
        elif d.op < 0.64:
            self.mark(ref)
        elif d.op < 0.72:
            self.purge(ref, d)
        elif d.op < 0.80:
            self.open(d.room)
        elif d.op < 0.94:
            self.read(ref, d)
        else:
            handle = ctx.handle(d.room)
            if handle is not None:
                self.remember(handle)

    def planted(self, bug: str, d: _Draw) -> None:
        """Test-only deliberate bugs (see the module docstring)."""
        if bug == "reentry" and d.bug < 0.001:
            with self.ctx.lock.write():
                self.ctx.snapshot()  # re-entry: debug locks raise LockReentryError
        elif bug == "deadlock" and self.index == 0 and self.counters.ops == 200:
            with self.ctx.lock.write():
                threading.Event().wait()  # never released: a real deadlock

    def _chunk(self, ref: Ref, chunk: int) -> int:
        """Writes through a handle use the chunk index tagged with its generation."""
        return self.shared.tag(ref.generation, chunk) if isinstance(ref, RoomHandle) else chunk

    def _dead_before(self, ref: Ref) -> bool:
        dead = isinstance(ref, RoomHandle) and ref.generation in self.shared.dead
        if dead:
            self.stale_attempts += 1
        return dead

    def _accepted_stale(self, what: str, ref: Ref) -> None:
        self.shared.monitor.violation(
            NO_RESURRECTION, f"{what} accepted through {ref} after its generation was purged"
        )

    def request(self, ref: Ref, d: _Draw) -> None:
        dead = self._dead_before(ref)
        if self.ctx.request_prefetch(ref, self._chunk(ref, d.chunk), d.session) and dead:
            self._accepted_stale("request_prefetch", ref)

    def request_many(self, ref: Ref, d: _Draw) -> None:
        n = self.shared.chunks
        chunks = [self._chunk(ref, (d.chunk + k) % n) for k in range(d.batch)]
        dead = self._dead_before(ref)
        added = self.ctx.request_prefetches(ref, chunks, d.session)
        if not added <= set(chunks):
            self.shared.monitor.violation(
                COUNTERS_CONSISTENT, f"request_prefetches added {added} not in {chunks}"
            )
        if added and dead:
            self._accepted_stale("request_prefetches", ref)

    def cancel(self, ref: Ref, d: _Draw) -> None:
        dead = self._dead_before(ref)
        if self.ctx.cancel_prefetch(ref, self._chunk(ref, d.chunk), d.session) and dead:
            self._accepted_stale("cancel_prefetch", ref)

    def mark(self, ref: Ref) -> None:
        dead = self._dead_before(ref)
        if self.ctx.mark_prefetched(ref) and dead:
            self._accepted_stale("mark_prefetched", ref)

    def purge(self, ref: Ref, d: _Draw) -> None:
        self._dead_before(ref)  # a stale purge that closes anything is caught by check_purge
        result = self.ctx.purge_room(ref)
        if self.shared.check_purge(result, ref, object()):
            self.counters.rooms += 1
            if d.sub < 0.75:
                self.open(d.room)

    def open(self, room: int) -> None:
        try:
            handle = self.ctx.open_room(room)
        except RoomAlreadyOpenError:
            return  # another worker reopened it first: expected
        self.shared.opened(handle)
        self.remember(handle)

    def read(self, ref: Ref, d: _Draw) -> None:
        ctx, mon = self.ctx, self.shared.monitor
        dead = self._dead_before(ref)
        if d.sub < 0.3:
            seen = ctx.is_requested(ref, self._chunk(ref, d.chunk), d.session)
        elif d.sub < 0.5:
            seen = ctx.is_prefetched(ref)
        elif d.sub < 0.7:
            seen = ctx.is_open(ref)
        else:
            keys = ctx.room_requests(ref)
            seen = bool(keys)
            gens = {self.shared.generation_of(c) for c, _ in keys} - {None}
            if len(gens) > 1:
                mon.violation(NO_RESURRECTION, f"room {ref} holds keys of generations {gens}")
            if isinstance(ref, RoomHandle) and gens - {ref.generation}:
                mon.violation(NO_RESURRECTION, f"room_requests({ref}) saw generations {gens}")
        if seen and dead:
            self._accepted_stale("a read", ref)


class _Prober:
    """Two threads run tiny random programs on a probe room while the workers race.

    The probe room (id ``rooms``) is outside the workers' range and its sessions are never
    theirs, so only the probe threads change it -- but they contend for the same lock with
    everyone. Each round both threads start together, each runs 1-4 recorded operations
    (through the bare id, the round's handle, the previous round's now-stale handle, or a
    handle it opened itself), and then probe 0 checks the round's history against the
    sequential model (``linearizable``) and purges and reopens the room for the next round.
    The round barrier's action decides, for both threads at once, whether to run a round,
    park at the coordinator's epoch barrier, or stop.
    """

    def __init__(self, shared: _Shared) -> None:
        self.shared = shared
        self.ctx = shared.ctx
        self.room = shared.rooms
        self.rngs = [shared.config.rng(PROBE_SEED_OFFSET + k) for k in range(PROBE_THREADS)]
        self.recorders = [ThreadRecorder(k) for k in range(PROBE_THREADS)]
        self.counters = [shared.monitor.counters() for _ in range(PROBE_THREADS)]
        timeout = shared.config.watchdog_s
        self.start = threading.Barrier(PROBE_THREADS, action=self._decide, timeout=timeout)
        self.end = threading.Barrier(PROBE_THREADS, timeout=timeout)
        self.decision = "run"
        self.rounds = 0
        self.setup: Op
        self.handle: RoomHandle
        self.stale: RoomHandle
        self._reopen()
        self.stale = self.handle

    def _decide(self) -> None:
        shared = self.shared
        if shared.finished.is_set():
            self.decision = "stop"
        elif shared.pause.is_set():
            self.decision = "park"
        else:
            self.decision = "run"

    def _reopen(self) -> None:
        """Close whatever generation is open and open the next round's (recorded)."""
        self.ctx.purge_room(self.room)
        rec = ThreadRecorder(-1)
        got = rec.call("open", (self.room,), lambda: self.ctx.open_room(self.room))
        if not isinstance(got, RoomHandle):
            raise RuntimeError(f"probe room {self.room} could not be reopened: {got}")
        self.setup, self.handle = rec.ops[0], got

    def run(self, k: int) -> None:
        """Probe thread ``k``: rounds until told to stop."""
        shared = self.shared
        try:
            while True:
                self.start.wait()
                if self.decision == "stop":
                    return
                if self.decision == "park":
                    shared.barrier.wait()
                    shared.barrier.wait()
                    continue
                self.play(k)
                self.end.wait()
                if k == 0:
                    self.check_and_reset()
        except threading.BrokenBarrierError:
            return
        finally:
            self.start.abort()  # never leave the partner waiting
            self.end.abort()

    def play(self, k: int) -> None:
        """Run this round's 1-4 recorded operations of probe thread ``k``."""
        rng, rec = self.rngs[k], self.recorders[k]
        mine = self.handle
        for _ in range(1 + rng.randrange(4)):
            name = rng.choice(PROBE_OPS)
            which = rng.choice(PROBE_REFS)
            chunk = rng.randrange(2)
            session = rng.choice(PROBE_SESSIONS)
            ref: Ref = self.room
            if which == "handle":
                ref = self.handle
            elif which == "stale":
                ref = self.stale
            elif which == "mine":
                ref = mine
            got = self._call(rec, name, ref, chunk, session)
            if isinstance(got, RoomHandle):
                mine = got
            self.counters[k].ops += 1

    def _call(self, rec: ThreadRecorder, name: str, ref: Ref, chunk: int, session: str) -> object:
        ctx, room = self.ctx, self.room
        if name == "request":
            return rec.call(
                name, (ref, chunk, session), lambda: ctx.request_prefetch(ref, chunk, session)
            )
        if name == "requests":
            chunks = (chunk, 1 - chunk)
            return rec.call(
                name, (ref, chunks, session), lambda: ctx.request_prefetches(ref, chunks, session)
            )
        if name == "cancel":
            return rec.call(
                name, (ref, chunk, session), lambda: ctx.cancel_prefetch(ref, chunk, session)
            )
        if name == "mark":
            return rec.call(name, (ref,), lambda: ctx.mark_prefetched(ref))
        if name == "purge":
            return rec.call(name, (ref,), lambda: ctx.purge_room(ref))
        if name == "open":
            return rec.call(name, (room,), lambda: ctx.open_room(room))
        if name == "purge_session":
            return rec.call(name, (session,), lambda: ctx.purge_session(session))
        if name == "is_requested":
            return rec.call(
                name, (ref, chunk, session), lambda: ctx.is_requested(ref, chunk, session)
            )
        if name == "is_prefetched":
            return rec.call(name, (ref,), lambda: ctx.is_prefetched(ref))
        if name == "is_open":
            return rec.call(name, (ref,), lambda: ctx.is_open(ref))
        return rec.call(name, (ref,), lambda: ctx.room_requests(ref))

    def check_and_reset(self) -> None:
        """Probe 0, between rounds: check the round's history, then start a fresh room."""
        history = [self.setup]
        for rec in self.recorders:
            history.extend(rec.ops)
            rec.ops.clear()
        bad = first_violation(history)
        if bad is not None:
            self.shared.monitor.violation(LINEARIZABLE, bad.describe().replace("\n", " |"))
        self.rounds += 1
        self.stale = self.handle
        self._reopen()


class _Coordinator:
    """Runs in the scenario's thread: continuous checks, quiescent epochs, the end."""

    def __init__(self, shared: _Shared) -> None:
        self.shared = shared
        self.ctx = shared.ctx
        self.monitor = shared.monitor
        self.epochs = 0
        self.checks = 0
        self.point_reads = 0
        # What the previous quiescent epoch saw: its keys (room, chunk, session) and the
        # handle of each open room. Keys gone since and handles purged since must read False.
        self.last_keys: frozenset[PrefetchKey] = frozenset()
        self.last_handles: dict[int, RoomHandle] = {}

    def drive(self) -> None:
        """Check continuously, park the workers every ``EPOCH_S``, until the deadline."""
        shared, mon = self.shared, self.monitor
        next_epoch = time.monotonic() + EPOCH_S
        try:
            while mon.running():
                time.sleep(min(CHECK_EVERY_S, max(0.0, mon.time_left())))
                self.check_running()
                if time.monotonic() >= next_epoch and mon.running():
                    shared.pause.set()
                    shared.barrier.wait()  # every worker parked
                    try:
                        self.check_quiescent()
                    finally:
                        shared.pause.clear()
                        shared.barrier.wait()  # let them go
                    self.epochs += 1
                    next_epoch = time.monotonic() + EPOCH_S
        except threading.BrokenBarrierError:
            mon.deadlock(
                f"workers did not reach the epoch barrier within {shared.config.watchdog_s:g} s"
            )
        except Exception as exc:  # e.g. LockTimeoutError: counted, then the run winds down
            mon.exception(exc, "coordinator")
        finally:
            shared.finished.set()
            shared.pause.clear()
            shared.barrier.abort()

    def check_running(self) -> None:
        """Checks that hold at any instant: each snapshot/stats call is self-consistent."""
        self.checks += 1
        snap = self.ctx.snapshot()
        st = self.ctx.stats()
        mon = self.monitor
        if not snap.prefetched_rooms <= snap.open_rooms:
            mon.violation(
                NO_RESURRECTION,
                f"closed rooms prefetched: {sorted(snap.prefetched_rooms - snap.open_rooms)}",
            )
        closed_keys = {k for k in snap.prefetch_requested if k[0] not in snap.open_rooms}
        if closed_keys:
            mon.violation(NO_RESURRECTION, f"keys of closed rooms: {sorted(closed_keys)[:3]}")
        if (
            st.rooms_opened - st.purges != st.open_rooms
            or min(st.open_rooms, st.prefetched_rooms, st.requested_keys) < 0
            or st.prefetched_rooms > st.open_rooms
        ):
            mon.violation(COUNTERS_CONSISTENT, f"stats inconsistent: {st}")

    def check_quiescent(self) -> None:
        """With every worker parked: counters equal collections, keys match generations."""
        ctx, mon, shared = self.ctx, self.monitor, self.shared
        snap = ctx.snapshot()
        st = ctx.stats()
        expect = (len(snap.open_rooms), len(snap.prefetched_rooms), len(snap.prefetch_requested))
        got = (st.open_rooms, st.prefetched_rooms, st.requested_keys)
        if got != expect:
            mon.violation(
                COUNTERS_CONSISTENT,
                f"stats (open, prefetched, keys)={got} but snapshot has {expect}",
            )
        by_room: dict[int, set[tuple[int, str]]] = {}
        for room, chunk, session in snap.prefetch_requested:
            by_room.setdefault(room, set()).add((chunk, session))
        handles: dict[int, RoomHandle] = {}
        for room in snap.open_rooms:
            handle = ctx.handle(room)
            if handle is None:
                mon.violation(COUNTERS_CONSISTENT, f"room {room} in snapshot but has no handle")
                continue
            handles[room] = handle
            if handle.generation in shared.dead:
                mon.violation(NO_RESURRECTION, f"room {room} open with purged gen {handle}")
            keys = by_room.get(room, set())
            if ctx.room_requests(handle) != keys:
                mon.violation(COUNTERS_CONSISTENT, f"room_requests({room}) != snapshot keys")
            if ctx.is_prefetched(handle) != (room in snap.prefetched_rooms):
                mon.violation(COUNTERS_CONSISTENT, f"is_prefetched({room}) != snapshot")
            foreign = {
                g
                for c, _ in keys
                if (g := shared.generation_of(c)) not in (None, handle.generation)
            }
            if foreign:
                mon.violation(
                    NO_RESURRECTION,
                    f"room {room} gen {handle.generation} holds keys of generations {foreign}",
                )
        self.check_point_reads(snap, by_room, handles)

    def check_point_reads(
        self,
        snap: StagingSnapshot,
        by_room: dict[int, set[tuple[int, str]]],
        handles: dict[int, RoomHandle],
    ) -> None:
        """With every thread parked: each lock-free point read answers what ``snap`` says.

        For every open room, through its id and its handle: ``is_open`` is True,
        ``is_prefetched`` matches, ``is_requested`` is True for each of its keys and False for
        every other key of its key space (plain and generation-tagged chunk indices, every
        session). Keys of the previous epoch that are gone read False, and so does every read
        through a handle the previous epoch saw open and that has been purged since, and
        every read of a closed or never-opened room.
        """
        ctx, mon, shared = self.ctx, self.monitor, self.shared
        sessions = SESSIONS + PROBE_SESSIONS
        reads = 0

        def bad(what: str) -> None:
            mon.violation(POINT_READS, what)

        for room, handle in handles.items():
            keys = by_room.get(room, set())
            prefetched = room in snap.prefetched_rooms
            space = {
                (chunk, session)
                for c in range(shared.chunks)
                for chunk in (c, shared.tag(handle.generation, c))
                for session in sessions
            }
            for ref in (room, handle):
                reads += 2
                if not ctx.is_open(ref):
                    bad(f"is_open({ref}) is False for an open room")
                if ctx.is_prefetched(ref) != prefetched:
                    bad(f"is_prefetched({ref}) != {prefetched} (snapshot)")
                for chunk, session in keys | space:
                    reads += 1
                    if ctx.is_requested(ref, chunk, session) != ((chunk, session) in keys):
                        bad(
                            f"is_requested({ref}, {chunk}, {session!r}) != "
                            f"{(chunk, session) in keys} (snapshot)"
                        )
        gone = self.last_keys - snap.prefetch_requested
        for room, chunk, session in gone:
            reads += 1
            if ctx.is_requested(room, chunk, session):
                bad(f"is_requested({room}, {chunk}, {session!r}) is True for a key gone")
        for room, old in self.last_handles.items():
            if handles.get(room) == old:
                continue
            reads += 3
            if ctx.is_open(old) or ctx.is_prefetched(old):
                bad(f"a purged handle {old} reads as open or prefetched")
            if any(ctx.is_requested(old, c, s) for c, s in by_room.get(room, ())):
                bad(f"a purged handle {old} sees keys of the room's new generation")
        closed = [r for r in range(shared.rooms + 1 + NEVER_OPENED) if r not in handles]
        for room in closed:
            reads += 2 + len(sessions)
            if ctx.is_open(room) or ctx.is_prefetched(room):
                bad(f"closed room {room} reads as open or prefetched")
            if any(ctx.is_requested(room, 0, s) for s in sessions):
                bad(f"closed room {room} reads as holding a key")
        self.point_reads += reads
        self.last_keys = snap.prefetch_requested
        self.last_handles = handles

    def finish(self) -> None:
        """After the join: one last quiescent check, purge everything, nothing is left."""
        ctx, mon, shared = self.ctx, self.monitor, self.shared
        self.check_quiescent()
        for room in range(shared.rooms):
            shared.check_purge(ctx.purge_room(room), room, object())
        ctx.purge_room(shared.rooms)  # the probe room
        snap = ctx.snapshot()
        st = ctx.stats()
        left = (st.open_rooms, st.prefetched_rooms, st.requested_keys)
        if left != (0, 0, 0):
            mon.violation(NO_LEAK, f"after the final purge stats (open, prefetched, keys)={left}")
        if snap.open_rooms or snap.prefetched_rooms or snap.prefetch_requested:
            mon.violation(NO_LEAK, f"after the final purge the snapshot is not empty: {snap}")
        for session in SESSIONS:
            rooms = ctx.purge_session(session)
            if rooms:
                mon.violation(NO_LEAK, f"session index still lists {session} in rooms {rooms}")


class StagingRace:
    """The ``staging-race`` scenario (see the module docstring)."""

    name = "staging-race"
    description = "threads race every StagingContext op on shared rooms, stale handles in play"
    default_duration = 15.0
    invariants = (
        NO_ESCAPED_EXCEPTION,
        NO_RESURRECTION,
        NO_LEAK,
        COUNTERS_CONSISTENT,
        LINEARIZABLE,
        NO_DEADLOCK,
        NO_THREAD_LEFT,
        LOCK_ORDER,
        POINT_READS,
    )

    def run(self, config: StressConfig, monitor: Monitor) -> ScenarioMetrics:
        """Open every room, race ``config.threads`` workers until the deadline, check."""
        if config.plant_bug is not None and config.plant_bug not in PLANTED_BUGS:
            raise ValueError(f"staging-race knows planted bugs {PLANTED_BUGS}")
        shared = _Shared(config, monitor)
        for room in range(config.rooms):
            shared.opened(shared.ctx.open_room(room))
        workers = [_Worker(shared, i) for i in range(config.threads)]
        for worker in workers:
            monitor.spawn(worker.run, f"worker-{worker.index}")
        prober = _Prober(shared)
        for k in range(PROBE_THREADS):
            monitor.spawn(functools.partial(prober.run, k), f"probe-{k}")
        coordinator = _Coordinator(shared)
        coordinator.drive()
        extra: dict[str, JSONValue] = {
            "lock_kind": shared.ctx.lock_kind,
            "debug_locks": shared.debug,
            "epochs": coordinator.epochs,
            "quiescent_point_reads": coordinator.point_reads,
            "continuous_checks": coordinator.checks,
            "stale_handle_ops": sum(w.stale_attempts for w in workers),
            "linearizability_rounds": prober.rounds,
            "planted_bug": config.plant_bug,
        }
        if monitor.join_all(timeout=config.watchdog_s):
            # A worker is stuck (maybe holding the lock): skip what would block on it.
            return ScenarioMetrics(lock=None, extra=extra)
        coordinator.finish()
        st = shared.ctx.stats()
        lock: dict[str, JSONValue] = dict(asdict(st.lock))
        lock["acquisitions"] = st.lock.read_acquisitions + st.lock.write_acquisitions
        extra.update(
            rooms_opened=st.rooms_opened,
            purges=st.purges,
            session_purges=st.session_purges,
            refused_late_writes=st.refused_late_writes,
        )
        return ScenarioMetrics(lock=lock, extra=extra)


SCENARIO = register(StagingRace())
