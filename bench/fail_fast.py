"""``fail-fast``: how soon a room fails once its decode peer dies (SIGKILL) or hangs (SIGSTOP).

The stress suite checks that a faulted peer's rooms conclude Failed, bounded by progress
(``peer-faults``' ``rooms-concluded``, ``two-hosts``' ``fault-to-failed``); how fast is a
timing goal, measured here on a quiet machine and reported, never asserted.

One decode peer process (:class:`~stress.harness.peer.PeerProcess`) and one manager (2
workers, ``transfer_timeout_s`` :data:`TRANSFER_TIMEOUT_S`). A round: :data:`ROOMS` two-page
rooms each send their first page (a chunk that lands), the peer is signalled, then each room
sends its last page; the scheduler polls every room until it concludes. Latency: from the
signal to the room's ``Failed`` (``time.monotonic`` on the polling loop). After a kill the
peer is restarted and re-added (untimed), after a stop it is continued. Kinds alternate.
"""

from __future__ import annotations

import statistics
import subprocess
import time
from typing import TYPE_CHECKING

import numpy as np

from bench._harness import BenchResult, Cell, Goal, JSONValue, Ratio, pending_result
from sender import _nixl
from sender.poll import KVPoll

if TYPE_CHECKING:
    from sender.manager import KVManager
    from sender.transport import NixlTransport
    from stress.harness.peer import PeerProcess

NAME = "fail-fast"
TITLE = "A room's fault -> Failed latency: decode peer SIGKILLed or SIGSTOPped"
TRANSFER_TIMEOUT_S = 0.5
ROOMS = 4
PAGE_BYTES = 4096
GOALS_S = {"kill": 2 * TRANSFER_TIMEOUT_S, "stop": TRANSFER_TIMEOUT_S + 0.1}
"""A killed peer's rooms Failed within two transfer deadlines; a hung peer's within the
deadline + 100 ms (the goals ``two-hosts`` reports per phase)."""
GOAL_TEXT = {"kill": "2 transfer deadlines", "stop": "1 transfer deadline + 100 ms"}
CONCLUDE_BOUND_S = 30.0
"""A hang detector, not a goal: a room not concluded by then counts as unconcluded."""
SESSION = "decode"


def _round(
    mgr: KVManager, peer: PeerProcess, tx: NixlTransport, kind: str, base: int
) -> list[float | None]:
    """One round of ``kind``; each room's signal -> Failed seconds (``None``: not Failed)."""
    from sender.manager import make_transfer_info
    from sender.nixl_sender import NixlKVSender

    rooms = []
    for i in range(ROOMS):
        info = make_transfer_info(SESSION, [2 * i, 2 * i + 1])
        s = NixlKVSender(mgr, base + i, [SESSION], [info])
        s.init(2)
        s.send(np.asarray([2 * i], dtype=np.int64))
        rooms.append(s)
    signalled = time.monotonic()
    if kind == "kill":
        peer.kill()
    else:
        peer.stop()
    for i, s in enumerate(rooms):
        s.send(np.asarray([2 * i + 1], dtype=np.int64))
    took: list[float | None] = [None] * ROOMS
    left = set(range(ROOMS))
    end = time.monotonic() + CONCLUDE_BOUND_S
    while left and time.monotonic() < end:
        for i in sorted(left):
            status = rooms[i].poll()
            if status in (KVPoll.Success, KVPoll.Failed):
                left.discard(i)
                took[i] = time.monotonic() - signalled if status is KVPoll.Failed else None
        time.sleep(0.0002)
    for i in left:
        rooms[i].abort()
    if kind == "kill":
        peer.restart()
        tx.remove_peer(SESSION)
        tx.add_peer(SESSION, peer.metadata)
    else:
        peer.cont()
    mgr.wait_drained(None, CONCLUDE_BOUND_S)
    return took


def measure(rounds: int) -> BenchResult:
    """``rounds`` rounds of each kind, alternating (tests use one)."""
    if not _nixl.AVAILABLE:
        return pending_result(NAME, TITLE, f"NIXL not importable: {_nixl.IMPORT_ERROR!r}")
    import torch

    from sender.manager import KVManager
    from sender.transport import NixlTransport
    from stress.harness.peer import PeerProcess

    kv = torch.randint(0, 256, (2 * ROOMS, PAGE_BYTES), dtype=torch.uint8)
    took: dict[str, list[float | None]] = {"kill": [], "stop": []}
    peer = PeerProcess(2 * ROOMS, PAGE_BYTES, name="bench-fail-fast", stderr=subprocess.DEVNULL)
    try:
        with NixlTransport("bench-fail-fast") as tx:
            tx.register_region("kv", kv, PAGE_BYTES)
            tx.add_peer(SESSION, peer.metadata)
            with KVManager(tx, kv, num_workers=2, transfer_timeout_s=TRANSFER_TIMEOUT_S) as mgr:
                for r in range(rounds):
                    for j, kind in enumerate(("kill", "stop")):
                        took[kind] += _round(mgr, peer, tx, kind, (2 * r + j) * ROOMS)
    finally:
        peer.close()
    return _result(took, rounds)


def _result(took: dict[str, list[float | None]], rounds: int) -> BenchResult:
    columns = ["fault", "rooms", "not Failed", "p50 ms", "max ms", "goal ms", "goal"]
    rows: list[dict[str, Cell]] = []
    goals: list[Goal] = []
    ratios: list[Ratio] = []
    samples: dict[str, list[float]] = {}
    for kind, values in took.items():
        failed = [v for v in values if v is not None]
        worst = max(failed, default=None)
        met = None if worst is None else worst <= GOALS_S[kind] and len(failed) == len(values)
        rows.append(
            {
                "fault": kind,
                "rooms": len(values),
                "not Failed": len(values) - len(failed),
                "p50 ms": None if not failed else round(statistics.median(failed) * 1e3, 1),
                "max ms": None if worst is None else round(worst * 1e3, 1),
                "goal ms": round(GOALS_S[kind] * 1e3, 1),
                "goal": {True: "yes", False: "NO", None: "-"}[met],
            }
        )
        samples[f"{kind} ms"] = [round(v * 1e3, 2) for v in failed]
        ratios.append(
            Ratio(
                f"{kind}: worst / transfer deadline",
                None if worst is None else round(worst / TRANSFER_TIMEOUT_S, 3),
                f"the goal: <= {GOALS_S[kind] / TRANSFER_TIMEOUT_S:g}",
            )
        )
        goals.append(
            Goal(
                f"{kind}: every room in flight Failed within {GOAL_TEXT[kind]} "
                f"({GOALS_S[kind] * 1e3:.0f} ms) of the signal",
                met,
                "no room measured" if worst is None
                else f"worst {worst * 1e3:.1f} ms over {len(values)} rooms, "
                f"{len(values) - len(failed)} not Failed",
            )
        )
    params: dict[str, JSONValue] = {
        "rounds": rounds,
        "rooms_per_round": ROOMS,
        "transfer_timeout_s": TRANSFER_TIMEOUT_S,
        "workers": 2,
    }
    return BenchResult(
        name=NAME,
        title=TITLE,
        columns=columns,
        rows=rows,
        ratios=ratios,
        goals=goals,
        notes=[
            f"{rounds} round(s) per fault, alternating; {ROOMS} two-page rooms in flight "
            "each (first page landed, last sent after the signal); latency: signal -> the "
            "polling loop sees Failed. Run on a quiet machine: the stress suite only checks "
            "that these rooms conclude, bounded by progress",
        ],
        params=params,
        samples=samples,
    )


def run(quick: bool) -> BenchResult:
    """``--quick``: 2 rounds of each fault; full: 8."""
    return measure(2 if quick else 8)
