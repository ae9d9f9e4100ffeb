"""``sender-audit``: the sender's failure paths one fault kind at a time, each ending with a
full drain, the leak checks and the decode page audit.

Phases (each with its own KVManager over the same transport and decode peer process, the
reference scheduler driving rooms and a reaper purging random rooms from another thread).
Everywhere the driver reuses destination pages most-recently-freed first and the decode side
keeps a ``Success`` room's pages 0.3 s (it decodes from them), and the page audit judges
every page again right before it is handed to the next room:

``abort-in-flight``
    every write of a room the scheduler will abort is delayed 0.1 s (the fault injector's
    delay mode: a slow network); the scheduler aborts it while they are in flight: its pages
    must not go to another room before those writes drained.
``starved-pool``
    the manager stages through a pool of 2 slots; some writes are delayed so chunks hold
    their slot, workers queue for one, and the scheduler aborts rooms while they wait.
``transport-release``
    another thread removes the peer from the transport and adds it again, over and over,
    while transfers are in flight (the transport releases them).
``lock-timeout``
    the staging context has ``lock_timeout=10 ms`` and holds 40k keys of other rooms; a reader
    thread calls ``snapshot()`` (tens of ms under the read lock) again and again. The 10 ms is
    the sender's setting under test (every timed wait inside it must survive the timeout), not
    a bound of the check: the reference driver tries a refused ``footprint()`` again until its
    own deadline (``lock-timeout:footprint_retries`` counts them), since a lock held by a
    descheduled thread for many periods is not stuck. A lock held for good is a deadlock: the
    scheduler and the reader stop making progress (a timed-out ``snapshot()`` counts as none)
    and the watchdog reports ``no-deadlock``. ``--plant-bug lock-hold`` plants exactly that (a
    thread takes the staging lock for writing and keeps it until the run is stopped, at most
    :data:`PLANT_HOLD_PERIODS` watchdog periods).
``inline-progress``
    ``num_workers=0``: transfers run inline; a second thread calls ``mgr.progress(handle)`` on
    the same rooms the scheduler polls. Some infos arrive after ``init()``, some too short.
``late-info``
    transfer infos arrive after ``init()`` from a bootstrap thread; some have one destination
    page too few (the room must fail cleanly, the info must be refused).
``close-race``
    ``KVManager.close()`` while the scheduler and two opener threads are still opening rooms;
    no room may be open once ``close()`` returned; repeated with a fresh manager.

Checked, besides the sender invariants (see ``_sender_rig``): ``close-atomic``. The phases to
run can be narrowed with the environment variable ``STRESS_SENDER_AUDIT_PHASES`` (comma
separated names). Each phase runs ``max(1 s, duration / phases)``.

Test-only ``--plant-bug quarantine``: the driver reuses a failed room's destination pages at
once (the old fixed quarantine, here 0 s) instead of waiting for its transfers to drain, and
in every phase the writes of the rooms it aborts are delayed 0.25 s: the page audit must
report cross-room overwrites (``abort-in-flight`` alone shows it in a couple of seconds on
an idle machine). Whether a given aborted room's late write is seen by the page audit is a
race the planted bug loses or wins by timing: it lands 0.4 s after its post; if the next
room on its pages was verified by then, the audit sees the overwrite when the pages are
reused; if not (on a loaded machine that room is slower), the next room's own verification
fails instead (``bytes-verified``). Measured with 3 CPU hogs (load 11-15 on 2 cores): 0 to
6 audit findings per 3-s phase, 1 run in 4-7 with none. So under this plant the phase is
bound by work, not time: it goes on past its duration until the audit reported an
overwrite, at most :data:`PLANT_MAX_S` (an audit that cannot see overwrites still ends
with none, so the check can fail).

``--plant-bug no-notices``: the managers send no room notice; ``decode-told`` must report
the rooms failed or cleared before ``Success`` that the decode peer never learnt about.

``--plant-bug slow-network`` plants nothing in our code: the delayed writes outlive the
transfer deadline (0.7 s > 0.5 s), as a hung peer's would when it resumes. The manager keeps
such a chunk *hung* (room failed, slot and pages held) until the write settles, so the page
audit must still report nothing (a deadline counted as "drained" let 3-4 corrupt pages
through); ``rooms-concluded`` may report rooms the slow writes kept from being admitted.
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sender.errors import TRANSPORT_ERRORS
from sender.manager import KVManager, TransferInfo
from staging.context import RoomHandle, StagingContext
from staging.errors import LockTimeoutError
from stress.framework import JSONValue, Monitor, ScenarioMetrics, StressConfig, register
from stress.harness.driver import BootstrapFn, RoomOutcome, SchedulerDriver, deliver_transfer_info
from stress.invariants import DECODE_PAGE_AUDIT, FAILURE_CONTRACT, describe
from stress.scenarios._sender_rig import (
    PLANT_NO_NOTICES,
    ROOMS_CONCLUDED,
    SENDER_INVARIANTS,
    SenderRig,
    sender_rig,
)

CLOSE_ATOMIC = describe(
    "close-atomic", "no room is open once KVManager.close() returned; open_room after it raises"
)

PHASES: dict[str, str] = {
    "abort-in-flight": "aborts while the room's (delayed) writes are in flight",
    "starved-pool": "2 staging slots, delayed writes, aborts while workers wait for a slot",
    "transport-release": "remove_peer/add_peer again with transfers in flight",
    "lock-timeout": "StagingContext(lock_timeout=10 ms) + a long snapshot() reader",
    "inline-progress": "num_workers=0 and a second thread calling progress() on the rooms",
    "late-info": "transfer infos after init() from a bootstrap thread, some too short",
    "close-race": "KVManager.close() racing open_room",
}
PHASES_ENV = "STRESS_SENDER_AUDIT_PHASES"
PLANT_LOCK_HOLD = "lock-hold"
PLANTED_BUGS = ("quarantine", "slow-network", PLANT_NO_NOTICES, PLANT_LOCK_HOLD)

SESSION = "decode-0"
PEER_PAGES = 512
DECODE_HOLD_S = 0.3  # the decode side uses a Success room's pages this long
MIN_PHASE_S = 1.0
CLOSE_RACE_DEADLINE_S = 3.0  # the close-race scheduler's own deadline


def scheduler_join_s(monitor: Monitor, deadline_s: float | None = None) -> float:
    """How long a phase waits for its scheduler once admission stopped: the driver's own
    deadline (``deadline_s``; by default the rig's, ``max(5 s, watchdog / 2)``), past which
    it returns by itself, plus one watchdog period for its last step (a fixed 2 s margin was
    once all a loaded machine got). A scheduler still running then is stuck, not slow."""
    own = max(5.0, monitor.watchdog_s / 2) if deadline_s is None else deadline_s
    return own + monitor.watchdog_s

STARVED_REGION = "staging-starved"
STARVED_SLOTS = 2
STARVED_SLOT_TIMEOUT_S = 0.5
DELAY_RATE = 0.1  # of the other rooms' writes; every write of a room to be aborted is delayed
DELAY_S = 0.1  # well under the transfer deadline (0.5 s): a delayed write always drains
ABORT_RATE = 0.15  # of the rooms, after a random number of their chunks
ABORT_LAG_S = 0.003  # after that chunk was sent: it is then queued, waiting or in flight

RELEASE_EVERY_S = (0.15, 0.4)

LOCK_TIMEOUT_S = 0.01
PLANT_HOLD_AFTER_S = 0.2  # the planted holder takes the lock this long into the phase
PLANT_HOLD_PERIODS = 3.0  # and gives it back once the run is stopped, or after this many periods
FILL_ROOMS = 2000
FILL_KEYS = 20
FILL_BASE = 1 << 40

OPENER_BASE = 1 << 41
OPENERS = 2
CLOSE_AFTER_S = (0.05, 0.25)

SLOW_NETWORK_DELAY_S = 0.7  # > the transfer deadline (0.5 s)
PLANT_DELAY_S = 0.4  # longer than a room lives: lands while the next room's pages decode
PLANT_MAX_S = 30.0
"""Under ``--plant-bug quarantine`` the ``abort-in-flight`` phase runs past its duration
until the page audit has reported an overwrite, for at most this long (see the module
docstring)."""
PLANT_ABORT_RATE = 0.3
PLANT_WORKERS = 8


def selected_phases() -> list[str]:
    """The phases to run: all, or those named in ``STRESS_SENDER_AUDIT_PHASES``.

    Raises:
        ValueError: an unknown phase name.
    """
    text = os.environ.get(PHASES_ENV, "").strip()
    if not text:
        return list(PHASES)
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in PHASES]
    if bad:
        raise ValueError(f"{PHASES_ENV}: unknown phases {bad}; known: {list(PHASES)}")
    return names


ExtraThread = Callable[[Callable[[], bool], SchedulerDriver], Callable[[], None]]
"""``make(running, driver) -> thread body`` of a phase's extra thread."""


class _Doomed:
    """The rooms the scheduler will abort (from ``SchedulerDriver.on_admit``), and which
    writes the fault injector delays: every write of such a room, and ``others`` of the rest.
    Thread-safe (the set is guarded by ``_lock``; workers call :meth:`select`)."""

    def __init__(self, seed: int, others: float) -> None:
        self._lock = threading.Lock()
        self._rooms: set[int] = set()
        self._rng = random.Random(seed)
        self.others = others

    def admit(self, handle: RoomHandle, will_abort: bool) -> None:
        if will_abort:
            with self._lock:
                self._rooms.add(handle.room)

    def select(self, notif: bytes | None) -> bool:
        """Delay this write? (The manager's notification starts with ``room=N;``.)"""
        if notif is None or not notif.startswith(b"room="):
            return False
        room = int(notif[5:].split(b";", 1)[0])
        with self._lock:
            return room in self._rooms or self._rng.random() < self.others


class _Run:
    """One scenario run: the rig, the monitor and what the phases share."""

    def __init__(self, config: StressConfig, monitor: Monitor, rig: SenderRig) -> None:
        self.config = config
        self.monitor = monitor
        self.rig = rig
        self.planted = config.plant_bug == "quarantine"
        # Not a bug planted in our code: the network holds the aborted rooms' writes past the
        # transfer deadline (NIXL may still complete a write whose handle was released).
        self.delay_s = SLOW_NETWORK_DELAY_S if config.plant_bug == "slow-network" else DELAY_S
        self.rng = random.Random(config.seed * 31 + 5)
        self.extra: dict[str, JSONValue] = {}
        self.doomed = _Doomed(config.seed + 91, 0.0 if self.planted else DELAY_RATE)
        # A worker polls its delayed write to the end: with the planted bug's longer delays,
        # more workers keep the other rooms fast (they must outlive nothing).
        slow = self.planted or config.plant_bug == "slow-network"
        self.workers = max(config.threads, PLANT_WORKERS) if slow else config.threads

    # ------------------------------------------------------------------ common

    def overrides(self, **more: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"reuse": "lifo", "decode_hold_s": DECODE_HOLD_S, **more}
        if self.planted:
            out.update(
                release_rule="quarantine",
                quarantine_s=0.0,
                abort_rate=max(PLANT_ABORT_RATE, float(out.get("abort_rate", 0.0))),
                abort_lag_s=ABORT_LAG_S,
            )
        return out

    def drive(
        self,
        name: str,
        index: int,
        seconds: float,
        *,
        overrides: Mapping[str, Any],
        extras: Sequence[tuple[str, ExtraThread]] = (),
        after_scheduler: Sequence[tuple[str, ExtraThread]] = (),
        bootstrap: BootstrapFn | None = None,
        on_outcome: Callable[[RoomOutcome], None] | None = None,
        until: Callable[[], bool] | None = None,
        max_seconds: float = 0.0,
    ) -> SchedulerDriver:
        """Run the scheduler, a reaper and the ``extras`` for ``seconds`` (and, with
        ``until``, on until ``until()`` holds, for ``max_seconds`` in all at most); then
        stop admitting and wait for the active rooms to conclude by themselves. Threads in
        ``after_scheduler`` keep running until the scheduler is done (e.g. the bootstrap
        thread the waiting rooms need)."""
        mon, rig = self.monitor, self.rig
        start = time.monotonic()
        end = start + seconds
        hard_end = start + max(seconds, max_seconds)
        sched_done = threading.Event()

        def running() -> bool:
            if mon.stop.is_set():
                return False
            now = time.monotonic()
            if now < end:
                return True
            return until is not None and now < hard_end and not until()

        def until_scheduler_done() -> bool:
            return not mon.stop.is_set() and not sched_done.is_set()

        driver = rig.new_driver(bootstrap, monitor=mon, audit_reuse=True)
        driver.on_admit = self.doomed.admit
        sched = mon.spawn(
            rig.scheduler(mon, on_outcome, driver=driver, running=running, overrides=overrides),
            f"{name}:scheduler",
        )
        others = [mon.spawn(rig.reaper(mon, 1000 + index, running), f"{name}:reaper")]
        others += [mon.spawn(make(running, driver), f"{name}:{t}") for t, make in extras]
        helpers = [
            mon.spawn(make(until_scheduler_done, driver), f"{name}:{t}")
            for t, make in after_scheduler
        ]
        while running():
            mon.stop.wait(0.05)
        driver.stop_admitting()
        join_s = scheduler_join_s(mon)
        sched.join(join_s)
        if sched.is_alive():
            mon.violation(
                ROOMS_CONCLUDED,
                f"{name}: rooms still not concluded {join_s:g} s after admission stopped",
            )
            driver.stop()
            sched.join(mon.watchdog_s)
        sched_done.set()
        for t in others + helpers:
            t.join(mon.watchdog_s)
        return driver

    def finish(self, name: str, before: dict[str, Any]) -> None:
        """Close the phase's manager, drain, check for leaks, audit the pages, report."""
        rig = self.rig
        st = rig.mgr.stats()
        rig.finish_manager(self.monitor)
        rig.audit_pages(self.monitor)
        now = dataclasses.asdict(rig.stats)
        phase: dict[str, JSONValue] = {
            k: now[k] - before[k]
            for k in ("succeeded", "failed", "verified", "reaped", "refused_opens")
        }
        told, told_before = now["told"], before["told"]
        for k in ("judged", "learnt", "missing", "excluded_fault", "notices_sent"):
            phase[f"told_{k}"] = int(told.get(k, 0)) - int(told_before.get(k, 0))
        latency = rig.notices.summary(before["told_mark"])
        for k in ("latency_ms", "idle_latency_ms", "delivery_ms"):
            phase[f"told_{k}"] = latency[k]
        if name != "close-race":  # its managers were finished cycle by cycle
            phase["worker_errors"] = st.worker_errors
            phase["chunks_done"] = st.chunks_done
            phase["chunks_failed"] = st.chunks_failed
            phase["chunks_skipped"] = st.chunks_skipped
        self.extra[name] = phase

    # ------------------------------------------------------------------ phases

    def _audit_found(self) -> bool:
        return any(r.name == DECODE_PAGE_AUDIT and r.violations for r in self.monitor.reports())

    def abort_in_flight(self, name: str, index: int, seconds: float) -> None:
        rig = self.rig
        rig.make_manager(num_workers=self.workers)
        if not self.planted:
            rig.injector.set_delay(1.0, self.delay_s, self.doomed.select)
        try:
            self.drive(
                name,
                index,
                seconds,
                overrides=self.overrides(abort_rate=ABORT_RATE, abort_lag_s=ABORT_LAG_S),
                # The plant's overwrite is caught by work done, not time (module docstring).
                until=self._audit_found if self.planted else None,
                max_seconds=PLANT_MAX_S,
            )
        finally:
            if not self.planted:
                rig.injector.set_delay(0.0, 0.0)

    def starved_pool(self, name: str, index: int, seconds: float) -> None:
        rig = self.rig
        rig.make_manager(
            num_workers=self.workers, region=STARVED_REGION, slot_timeout_s=STARVED_SLOT_TIMEOUT_S
        )
        if not self.planted:
            rig.injector.set_delay(1.0, self.delay_s, self.doomed.select)
        starved = rig.pools[STARVED_REGION]
        timeouts = starved.stats().exhausted
        try:
            self.drive(
                name,
                index,
                seconds,
                overrides=self.overrides(abort_rate=ABORT_RATE, abort_lag_s=ABORT_LAG_S),
            )
        finally:
            if not self.planted:
                rig.injector.set_delay(0.0, 0.0)
        self.extra[f"{name}:slot_timeouts"] = starved.stats().exhausted - timeouts

    def transport_release(self, name: str, index: int, seconds: float) -> None:
        rig, mon = self.rig, self.monitor
        rig.make_manager(num_workers=self.workers)
        releases = [0]

        def releaser(running: Callable[[], bool], driver: SchedulerDriver) -> Callable[[], None]:
            def run() -> None:
                rng = self.config.rng(3000 + index)
                counters = mon.counters()
                while running():
                    time.sleep(rng.uniform(*RELEASE_EVERY_S))
                    sid = rng.choice(rig.sessions)
                    # decode-told: a notice sent while the peer is removed is lost (counted
                    # in notices_failed); rooms around it are not judged.
                    window = rig.notices.fault(sid, time.monotonic())
                    rig.tx.remove_peer(sid)
                    time.sleep(rng.random() * 0.005)
                    rig.tx.add_peer(sid, rig.peers[sid].metadata)
                    rig.notices.fault_end(window, time.monotonic())
                    releases[0] += 1
                    counters.faults += 1
                    counters.ops += 1

            return run

        self.drive(
            name, index, seconds, overrides=self.overrides(), extras=[("releaser", releaser)]
        )
        self.extra[f"{name}:peer_removals"] = releases[0]

    def lock_timeout(self, name: str, index: int, seconds: float) -> None:
        rig, mon = self.rig, self.monitor
        staging = StagingContext(lock=self.config.lock, lock_timeout=LOCK_TIMEOUT_S, debug=True)
        fillers = []
        for i in range(FILL_ROOMS):
            handle = staging.open_room(FILL_BASE + i)
            staging.request_prefetches(handle, range(FILL_KEYS), "filler")
            fillers.append(handle)
        rig.make_manager(num_workers=self.workers, staging=staging)
        reads = [0, 0]

        def reader(running: Callable[[], bool], driver: SchedulerDriver) -> Callable[[], None]:
            def run() -> None:
                rng = self.config.rng(3500 + index)
                counters = mon.counters()
                while running():
                    try:
                        staging.snapshot()
                        reads[0] += 1
                        counters.ops += 1  # a read done; a timed-out one is no progress
                    except LockTimeoutError:  # a reader may time out too: documented
                        reads[1] += 1
                    time.sleep(rng.random() * 0.03)

            return run

        def holder(running: Callable[[], bool], driver: SchedulerDriver) -> Callable[[], None]:
            def run() -> None:  # the planted deadlock: the lock taken and never given back
                mon.stop.wait(PLANT_HOLD_AFTER_S)
                staging.lock.acquire_write_untimed()
                try:
                    mon.stop.wait(PLANT_HOLD_PERIODS * mon.watchdog_s)
                finally:
                    staging.lock.release_write()

            return run

        extras: list[tuple[str, ExtraThread]] = [("reader", reader)]
        if self.config.plant_bug == PLANT_LOCK_HOLD:
            extras.append(("planted-holder", holder))
        driver = self.drive(name, index, seconds, overrides=self.overrides(), extras=extras)
        self.extra[f"{name}:footprint_retries"] = driver.footprint_retries
        for handle in fillers:  # nobody else holds the lock now
            staging.purge_room(handle)
        self.extra[f"{name}:snapshots"] = reads[0]
        self.extra[f"{name}:snapshot_timeouts"] = reads[1]

    def inline_progress(self, name: str, index: int, seconds: float) -> None:
        rig, mon = self.rig, self.monitor
        mgr = rig.make_manager(num_workers=0, slot_timeout_s=0.2)
        polls = [0]

        def poller(running: Callable[[], bool], driver: SchedulerDriver) -> Callable[[], None]:
            def run() -> None:
                counters = mon.counters()
                while running():
                    for handle in driver.live_handles():
                        try:
                            mgr.progress(handle)
                        except TRANSPORT_ERRORS as exc:  # as the sender's own poll() does
                            mgr.record_failure(handle, exc, f"progress (2nd thread): {exc!r}")
                        polls[0] += 1
                    counters.ops += 1
                    time.sleep(0)

            return run

        self.drive(
            name,
            index,
            seconds,
            overrides=self.overrides(late_info_rate=0.2, short_info_rate=0.5),
            extras=[("poller", poller)],
        )
        self.extra[f"{name}:second_thread_polls"] = polls[0]

    def late_info(self, name: str, index: int, seconds: float) -> None:
        rig, mon = self.rig, self.monitor
        rig.make_manager(num_workers=self.workers)
        lock = threading.Lock()
        # Guarded by lock: (due, handle, info, too few pages, init() had returned).
        waiting: deque[tuple[float, RoomHandle, TransferInfo, bool, bool]] = deque()
        delivered = [0, 0]
        rng = random.Random(self.config.seed + 77)

        def hand_over(handle: RoomHandle, info: TransferInfo, short: bool, init_done: bool) -> None:
            # Scheduler thread; the bootstrap thread adds it a little later (or at once).
            due = time.monotonic() + rng.choice((0.0, rng.random() * 0.002))
            with lock:
                waiting.append((due, handle, info, short, init_done))

        def bootstrap(running: Callable[[], bool], driver: SchedulerDriver) -> Callable[[], None]:
            def run() -> None:
                counters = mon.counters()
                while True:
                    with lock:
                        item = waiting[0] if waiting else None
                        if item is not None and item[0] <= time.monotonic():
                            waiting.popleft()
                        else:
                            item = None
                    if item is None:
                        if not running():
                            return
                        time.sleep(0.0005)
                        continue
                    _, handle, info, short, init_done = item
                    problem = deliver_transfer_info(rig.mgr, handle, info, short, init_done)
                    if problem is not None:
                        mon.violation(FAILURE_CONTRACT, problem)
                    delivered[int(short)] += 1
                    counters.ops += 1

            return run

        self.drive(
            name,
            index,
            seconds,
            overrides=self.overrides(late_info_rate=0.6, short_info_rate=0.3),
            after_scheduler=[("bootstrap", bootstrap)],
            bootstrap=hand_over,
        )
        self.extra[f"{name}:late_infos"] = delivered[0]
        self.extra[f"{name}:short_infos"] = delivered[1]

    def close_race(self, name: str, index: int, seconds: float) -> None:
        end = time.monotonic() + seconds
        cycles = 0
        while not self.monitor.stop.is_set() and time.monotonic() < end:
            self._close_cycle(name, index, cycles)
            cycles += 1
        self.rig.make_manager()  # what finish() closes: an idle one
        self.extra[f"{name}:cycles"] = cycles

    def _opener(
        self, mgr: KVManager, first_room: int, closing: threading.Event, closed: threading.Event
    ) -> Callable[[], None]:
        """Opens rooms as fast as it can (purging them in batches until ``close()`` starts)
        until ``open_room`` raises; one that succeeds after ``close()`` returned is a
        violation."""
        mon = self.monitor

        def run() -> None:
            counters = mon.counters()
            mine: list[RoomHandle] = []
            room = first_room
            while not mon.stop.is_set():
                after_close = closed.is_set()
                try:
                    handle = mgr.open_room(room, [SESSION])
                except RuntimeError:  # closed: what open_room must say now
                    return
                room += 1
                counters.ops += 1
                if after_close:
                    mon.violation(
                        CLOSE_ATOMIC, f"open_room({handle.room}) succeeded after close() returned"
                    )
                    return
                mine.append(handle)
                if len(mine) >= 8 and not closing.is_set():
                    for h in mine:
                        mgr.purge_room(h)
                    mine.clear()

        return run

    def _close_cycle(self, name: str, index: int, cycle: int) -> None:
        rig, mon = self.rig, self.monitor
        mgr = rig.make_manager(num_workers=self.workers)
        closing = threading.Event()
        closed = threading.Event()
        base = OPENER_BASE + (index * 1000 + cycle) * 100_000

        def running() -> bool:
            return not mon.stop.is_set() and not closed.is_set()

        driver = rig.new_driver(monitor=mon, audit_reuse=True)
        driver.on_admit = self.doomed.admit
        sched = mon.spawn(
            rig.scheduler(
                mon,
                driver=driver,
                running=running,
                overrides=self.overrides(deadline_s=CLOSE_RACE_DEADLINE_S),
            ),
            f"{name}:scheduler-{cycle}",
        )
        threads = [
            mon.spawn(
                self._opener(mgr, base + k * 50_000, closing, closed), f"{name}:opener-{cycle}-{k}"
            )
            for k in range(OPENERS)
        ]
        time.sleep(self.rng.uniform(*CLOSE_AFTER_S))
        closing.set()
        try:
            mgr.close()
        except Exception as exc:
            mon.exception(exc, "KVManager.close")
        left = mgr.stats().open_rooms
        closed.set()
        if left:
            mon.violation(CLOSE_ATOMIC, f"{left} rooms open right after close() returned")
        sched.join(scheduler_join_s(mon, CLOSE_RACE_DEADLINE_S))
        if sched.is_alive():
            mon.violation(ROOMS_CONCLUDED, f"{name}: scheduler stuck after close()")
            driver.stop()
            sched.join(mon.watchdog_s)
        for t in threads:
            t.join(mon.watchdog_s)
        left = mgr.stats().open_rooms
        if left:
            mon.violation(CLOSE_ATOMIC, f"{left} rooms open after close() and the scheduler")
        rig.finish_manager(mon)


class SenderAudit:
    """The ``sender-audit`` scenario (see the module docstring)."""

    name = "sender-audit"
    description = "sender fault kinds one phase each + drain, leak checks and decode page audit"
    default_duration = 30.0
    invariants = (*SENDER_INVARIANTS, CLOSE_ATOMIC)

    def run(self, config: StressConfig, monitor: Monitor) -> ScenarioMetrics:
        if config.plant_bug is not None and config.plant_bug not in PLANTED_BUGS:
            raise ValueError(f"sender-audit knows planted bugs {PLANTED_BUGS}")
        phases = selected_phases()
        seconds = max(MIN_PHASE_S, monitor.duration_s / len(phases))
        with sender_rig(
            config,
            (SESSION,),
            PEER_PAGES,
            extra_pools={STARVED_REGION: STARVED_SLOTS},
            monitor=monitor,
        ) as rig:
            monitor.restart_clock()
            run = _Run(config, monitor, rig)
            if run.planted:
                rig.injector.set_delay(1.0, PLANT_DELAY_S, run.doomed.select)
            steps: dict[str, Callable[[str, int, float], None]] = {
                "abort-in-flight": run.abort_in_flight,
                "starved-pool": run.starved_pool,
                "transport-release": run.transport_release,
                "lock-timeout": run.lock_timeout,
                "inline-progress": run.inline_progress,
                "late-info": run.late_info,
                "close-race": run.close_race,
            }
            rig.mgr.close()  # the rig's default manager is not used: each phase makes its own
            for index, phase in enumerate(phases):
                if monitor.stop.is_set():
                    break
                before = dataclasses.asdict(rig.stats)
                before["told_mark"] = rig.notices.mark()
                t0 = time.monotonic()
                rig.phase = phase  # names the group of this phase's room latencies
                steps[phase](phase, index, seconds)
                run.finish(phase, before)
                run.extra[f"{phase}:wall_s"] = round(time.monotonic() - t0, 2)
            delays = rig.injector.stats()
            return ScenarioMetrics(
                extra={
                    **rig.stats.to_json(),
                    "phases": list(phases),
                    "phase_s": seconds,
                    "planted_bug": config.plant_bug,
                    "faults_injected": delays.faults,
                    "writes_delayed": delays.delayed,
                    "delayed_posted_after_release": delays.posted_after_release,
                    "per_phase": run.extra,
                }
            )


register(SenderAudit())
