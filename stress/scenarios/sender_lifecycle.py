"""``sender-lifecycle``: an engine's scheduler drives NixlKVSenders against a real decode
peer process over NIXL while transfer workers move the bytes, an injector wrapping the real
transport raises real NIXL error classes at random posts and polls (``--fault-rate``), and
another thread purges random rooms (an engine aborting requests from elsewhere).

The scheduler polls every room, calls ``failure_exception()`` on ``Failed`` and ``clear()``
on ``Success`` (after verifying the room's bytes at the peer), exactly as an engine does.
Checked: no exception escaped; ``failure_exception()`` raised only what its contract allows;
every room concluded; every verifiable ``Success`` room's bytes are right; nothing is left for
a concluded room, at its conclusion and again after the manager closed and every transfer
drained (no late worker resurrected it); no slot, key or transfer handle leaked; every chunk
ended exactly once; the decode page audit (every decode page holds the bytes of the last
room verified on it, or of a room given it later); every room failed or cleared before
``Success`` is known as failed at the decode peer (``decode-told``, room notices; latency in
``extra["decode_told"]``); lock order (debug locks); no deadlock; no thread left.
"""

from __future__ import annotations

from stress.framework import Monitor, ScenarioMetrics, StressConfig, register
from stress.scenarios._sender_rig import SENDER_INVARIANTS, sender_rig

PEER_PAGES = 1024


class SenderLifecycle:
    name = "sender-lifecycle"
    description = "scheduler + workers + injected NIXL faults + foreign purges, real peer"
    default_duration = 20.0
    invariants = SENDER_INVARIANTS

    def run(self, config: StressConfig, monitor: Monitor) -> ScenarioMetrics:
        with sender_rig(config, ("decode-0",), PEER_PAGES, monitor=monitor) as rig:
            monitor.restart_clock()  # the duration counts from here, not from peer start-up
            scheduler = monitor.spawn(rig.scheduler(monitor), "scheduler")
            monitor.spawn(rig.reaper(monitor, 1000), "reaper")
            scheduler.join(monitor.time_left() + monitor.watchdog_s)
            monitor.stop.set()
            monitor.join_all(timeout=monitor.watchdog_s)
            rig.check_end(monitor)
            lock = rig.mgr.staging.stats().lock
            return ScenarioMetrics(
                lock={
                    "name": lock.name,
                    "kind": lock.kind,
                    "read": lock.read_acquisitions,
                    "write": lock.write_acquisitions,
                    "contended": lock.contended,
                },
                extra={**rig.stats.to_json(), "faults_injected": rig.injector.stats().faults},
            )


register(SenderLifecycle())
