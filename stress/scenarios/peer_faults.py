"""``peer-faults``: ``sender-lifecycle`` with two decode peer processes, one of which is
really SIGKILLed (then restarted and re-added) and/or SIGSTOPped (then continued) over and
over during the run, while the other keeps serving.

``decode-told`` judges the rooms of a session only away from its faults (a room opened before
a fault ended and purged less than ``TOLD_GRACE_S`` before it began is not judged); what a
peer learnt is fetched right before it is killed.

``--peer-kill`` / ``--peer-stop`` choose the faults (neither given: both, alternating). A
killed peer surfaces as ``nixlRemoteDisconnectError`` and fails every room of its session at
once; a stopped peer is never detected by NIXL, so its rooms fail at our transfer deadline
(``TransferTimeoutError``). Reported besides the invariants: the worst time from a kill to
the last of that session's rooms concluding, per kill.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sender.driver import RoomOutcome
from sender.poll import KVPoll
from stress.framework import Monitor, ScenarioMetrics, StressConfig, register
from stress.scenarios._sender_rig import (
    ROOMS_CONCLUDED,
    SENDER_INVARIANTS,
    TRANSFER_TIMEOUT_S,
    SenderRig,
    peer_start_bound,
    sender_rig,
)

PEER_PAGES = 512
SESSIONS = ("decode-a", "decode-b")
FAULT_EVERY_S = 1.5
KILL_TO_FAILED_LIMIT_S = 1.0


class PeerFaults:
    name = "peer-faults"
    description = "sender-lifecycle with decode peers SIGKILLed/restarted and SIGSTOPped"
    default_duration = 20.0
    invariants = SENDER_INVARIANTS

    def run(self, config: StressConfig, monitor: Monitor) -> ScenarioMetrics:
        kinds = [k for k, on in (("kill", config.peer_kill), ("stop", config.peer_stop)) if on]
        kinds = kinds or ["kill", "stop"]
        kills: list[float] = []
        kill_to_failed: list[float] = []

        def on_outcome(o: RoomOutcome) -> None:
            # The first kill after this room started, if the room was still running then.
            started = o.concluded_at - o.latency_s
            for at in kills:
                if started < at < o.concluded_at and o.status is KVPoll.Failed:
                    kill_to_failed.append(o.concluded_at - at)
                    break

        with sender_rig(config, SESSIONS, PEER_PAGES, monitor=monitor) as rig:
            monitor.restart_clock()  # the duration counts from here, not from peer start-up
            faults = {"kill": 0, "stop": 0, "restart_failures": 0}
            monitor.spawn(rig.scheduler(monitor, on_outcome), "scheduler")
            monitor.spawn(rig.reaper(monitor, 1000), "reaper")
            injector = monitor.spawn(
                self._faulter(rig, monitor, config, kinds, kills, faults), "peer-faulter"
            )
            injector.join(monitor.time_left() + 2 * monitor.watchdog_s)
            monitor.stop.set()
            monitor.join_all(timeout=monitor.watchdog_s)
            rig.check_end(monitor)
            worst = max(kill_to_failed, default=0.0)
            if worst > KILL_TO_FAILED_LIMIT_S:
                monitor.violation(
                    ROOMS_CONCLUDED, f"a room took {worst:.2f} s to fail after its peer died"
                )
            return ScenarioMetrics(
                extra={
                    **rig.stats.to_json(),
                    "peer_kills": faults["kill"],
                    "peer_stops": faults["stop"],
                    "restart_failures": faults["restart_failures"],
                    "kill_to_failed_ms_max": round(worst * 1e3, 1),
                    "faults_injected": rig.injector.stats().faults,
                }
            )

    @staticmethod
    def _faulter(
        rig: SenderRig,
        monitor: Monitor,
        config: StressConfig,
        kinds: list[str],
        kills: list[float],
        faults: dict[str, int],
    ) -> Callable[[], None]:
        # A fault every ~1.5 s; short (--quick) runs still get at least two.
        every = min(FAULT_EVERY_S, monitor.duration_s / 3)

        def run() -> None:
            rng = config.rng(2000)
            counters = monitor.counters()
            n = 0
            while monitor.running() and monitor.time_left() > every:
                time.sleep(every * (0.5 + rng.random()))
                if not monitor.running():
                    break
                kind = kinds[n % len(kinds)]
                n += 1
                sid = SESSIONS[rng.randrange(len(SESSIONS))]
                peer = rig.peers[sid]
                # decode-told: rooms living around a fault of their session are not judged;
                # what the peer learnt so far is fetched before a kill (the new process
                # knows nothing).
                window = rig.notices.fault(sid, time.monotonic())
                if kind == "kill":
                    rig.harvest_notices(sid)
                    peer.kill()
                    kills.append(time.monotonic())
                    rig.audit.peer_reset(sid, kills[-1])  # its pages are gone with it
                    faults["kill"] += 1
                    time.sleep(0.2)
                    # The scheduler waits on peer_lock for its page reads meanwhile: a long
                    # step, bounded by the peer's own start timeout.
                    bound = peer_start_bound(monitor)
                    with monitor.long_step(f"restart {sid}", bound), rig.peer_lock:
                        rig.tx.remove_peer(sid)
                        try:
                            peer.restart()
                            rig.tx.add_peer(sid, peer.metadata)
                        except Exception:  # counted; the session then stays down
                            faults["restart_failures"] += 1
                else:
                    peer.stop()
                    faults["stop"] += 1
                    time.sleep(TRANSFER_TIMEOUT_S + 0.3)
                    peer.cont()
                rig.notices.fault_end(window, time.monotonic())
                counters.faults += 1
                counters.ops += 1

        return run


register(PeerFaults())
