"""``two-hosts``: the sender and a decode peer on two "hosts" joined by a shaped veth link,
with peer and network faults over that link.

The decode peer runs in a network namespace of its own (:mod:`stress.netns`); UCX is
restricted to TCP on the veth on both sides, so every byte (and the peer's control channel)
crosses the link, which is shaped with ``tc tbf``. The sender cannot switch its own UCX
transports once NIXL is loaded, so the whole run happens in a child process started with the
link's environment; this process owns the topology (made and always torn down here) and
relays the child's progress and findings to the stress monitor.

Per fault, each in a *phase* with its own manager (the transport, i.e. the sender's NIXL
agent, lives for the whole run):

* ``stop`` — SIGSTOP the peer (hung: NIXL never notices), SIGCONT it later.
* ``partition`` — the peer's end of the link goes down mid-transfer, then up (heal).
* ``evict`` — the same partition, but the scheduler acts on the first failed room like an
  engine's health check: it removes the session's peer (``remove_peer``) so that rooms
  opened later fail at once; after the heal it adds the peer back (same metadata).
* ``kill`` — SIGKILL the peer, then restart it under the same session id (``remove_peer``
  + ``add_peer`` with the new process's metadata).
* ``restart`` — replace the peer process (SIGTERM, new process) under the same session id
  while rooms flow.

Rooms flow (``SchedulerDriver`` over the rig's manager, pages reused LIFO: as soon as the
drain rule allows) before, during and after the fault; the fault strikes while chunks are
posted. Measured per fault (the report and ``--json`` give every figure), and checked as
invariants:

* ``fault-to-failed``: for a hung peer or a cut link (``stop``, ``partition``, ``evict``),
  the rooms in flight at the fault fail together, judged by what the sender said, not by
  the clock: at most :func:`own_failures_allowed` of them (one per worker, the first wave of
  timed-out chunks) fail of their own chunk; every other one that failed did so with its
  decode session as a whole (code ``peer-failed``: a deadline is session-fatal). A dead peer
  reports the disconnect on each chunk itself, so its rooms are not judged so. The time
  from the fault to each room's ``Failed`` is a figure (``fault_to_failed_ms_max``, with
  its goal: 1 s after a kill/restart, the transfer deadline + 100 ms for a hung peer or a
  partition, ``goal_met`` per phase, never judged);
  ``python -m bench fail-fast`` measures it on a quiet machine;
* ``fail-fast``: rooms opened after the fault fail, never succeed while a hung peer or a cut
  link is on, and never with code ``internal`` (a hung peer is not our error); none is left
  open when the fault window ends (its traffic is joined); their lives are figures
  (``opened_after_ms_max``);
* ``recovered``: once the fault is repaired, a streak of new rooms succeeds (verified)
  without a new transport;
* ``no-early-reuse``: a failed room's decode pages are handed to a new room only once
  nothing of it drains (``mgr.draining(handle) == 0``);
* ``no-leak``: while the fault is on, no room table or staging key is left and slots are
  held only by hung transfers; after the repair, ``wait_drained`` and the manager's close,
  nothing (tables, staging keys, slots, live transfer handles); ``decode-page-audit`` (no
  cross-room overwrite at the decode side, judged at every page reuse and per phase),
  ``bytes-verified``;
* ``over-the-link``: the room bytes crossed the veth (interface counters, and the tbf
  qdisc's);
* ``decode-told``: every room failed or cleared before ``Success`` is known as failed at the
  peer (a room notice over the link), except around a fault of the peer (a killed or
  replaced peer's history is fetched just before). At each link rate a *notices* round (the
  scheduler aborts about half of the rooms, some with chunks in flight) measures the latency
  from the purge to the peer learning it (``notices`` rows of ``phases``, and
  ``decode_told`` in the result).

Besides, a *canary* write (to decode pages no room uses) is posted right after a stop or a
partition with the transfer deadline and kept, as the manager keeps a hung chunk (and
``remove_peer`` keeps it in ``evict``): what NIXL/UCX say about it (error or silence),
whether NIXL still has it after our deadline, and when it completes and its bytes land after
the repair are measured, not assumed.

The harness reads decode pages over the peer's control channel, which shares the link: it
stops reading while a fault is on (a read in progress finishes first).

Attribution: rooms send *stamped* source pages of their own (:mod:`stress.harness.stamps`: the bytes
name the opening, the chunk and the intended decode page), and the decode peer logs every
stamped write that lands on its pages (:mod:`stress.harness.landings`, every
:data:`WATCH_STAMPS_S`). A ``decode-page-audit`` finding therefore names the write that put
the bytes there (stale: a room given the page before the verified one; misdirected: bytes
meant for another page) and quotes the page's landing log; a Success room whose bytes differ
gets the same detail in its phase's ``verify_failed_detail``. (Before, rooms sampled one
shared KV pool, so a digest named a prefill page that many rooms had sent, and the audit
pinned it on the last one in the page's history.)
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any, Final

import numpy as np

from sender.poll import KVPoll
from staging.context import RoomHandle
from stress.framework import JSONValue, Monitor, ScenarioMetrics, StressConfig, register
from stress.harness.driver import RoomOutcome, SchedulerDriver
from stress.harness.peer import PeerError, PeerProcess, page_digest_bytes
from stress.harness.stamps import StampedSources, read_stamp
from stress.invariants import DECODE_PAGE_AUDIT, NO_LEAK, describe
from stress.native_stderr import NativeLines, count_lines
from stress.netns import (
    TwoHostLink,
    child_env,
    cleanup_stale,
    two_host_link,
    unavailable_reason,
)
from stress.scenarios._sender_rig import (
    BYTES_VERIFIED,
    PAGE_BYTES,
    PEER_START_TIMEOUT_S,
    PLANT_NO_NOTICES,
    SENDER_INVARIANTS,
    TRANSFER_TIMEOUT_S,
    SenderRig,
    close_bound,
    final_checks_bound,
    peer_start_bound,
)

FAULT_TO_FAILED = describe(
    "fault-to-failed",
    "the rooms in flight at a hung peer or a cut link failed together: at most one per "
    "worker of its own chunk, every other failed one with its session as a whole "
    "(peer-failed), as the manager told it (no clock)",
)
FAIL_FAST = describe(
    "fail-fast",
    "rooms opened after a fault failed, never succeeded while a hung peer or a cut link was "
    "on, never with code internal, none left open at the end of the fault window",
)
RECOVERED = describe(
    "recovered",
    "after the repair (restart/cont/heal) new rooms succeed, same transport: a streak of "
    "verified rooms among the first rooms concluded after it (a bound in rooms, not seconds)",
)
NO_EARLY_REUSE = describe(
    "no-early-reuse", "a failed room's decode pages were reused only once nothing of it drained"
)
OVER_THE_LINK = describe("over-the-link", "the room bytes crossed the veth link (counters)")

INVARIANTS = (
    *SENDER_INVARIANTS,
    FAULT_TO_FAILED,
    FAIL_FAST,
    RECOVERED,
    NO_EARLY_REUSE,
    OVER_THE_LINK,
)

SESSION = "decode-netns"
PEER_PAGES = 512
CANARY_PAGES = 8
ROOM_PAGES = PEER_PAGES - CANARY_PAGES  # the driver hands out only these; the rest: canary
ROOM_DEADLINE_S = 30.0
"""The driver's deadline per traffic run (``deadline_s``): it gives up after this long,
aborting the rooms left (so a traffic thread ends within it, plus the aborts)."""
KILL_GOAL_S = 1.0
"""Goal (reported per phase as ``goal_met``, never judged): a room in flight when its peer
dies (or is replaced) fails within 1 s."""
HUNG_GOAL_SLACK_S = 0.1
"""Goal (reported, never judged): a room in flight when its peer hangs or the link is cut
fails within the transfer deadline + 100 ms of the fault."""


def own_failures_allowed(workers: int) -> int:
    """``fault-to-failed``: how many rooms in flight at a fault may fail of their own chunk
    (not ``peer-failed``): the first wave of failed chunks, one per worker (each fails its
    room before ``fail_session`` fails the rest). A sender without ``fail_session`` fails
    every one of them by its own chunk."""
    return workers


KINDS = ("stop", "partition", "evict", "kill", "restart")
CANARY_WATCH_S = 2.5
BUSY_ROOMS_LOOKED_AT = 32
"""Before a fault: the latest admitted rooms looked at for one the sender has not concluded
(the driver keeps at most ``rooms`` of them open)."""
ADD_PEER_ATTEMPTS = 40
ADD_PEER_PAUSE_S = 0.05
PLANTED_BUGS = (
    "quarantine",
    "no-fail-session",
    "leak-slot",
    "no-repair",
    "no-tcp",
    PLANT_NO_NOTICES,
)
"""Test only, each makes one check fire. ``quarantine``: the driver reuses a failed room's
pages at once (``release_rule="quarantine"``, 0 s) while its transfers may still drain
(``no-early-reuse``). ``no-fail-session``: the managers are built with
``fail_session_on_disconnect=False``: a hung peer's or cut link's rooms in flight then each
fail at their own chunk's deadline, not together with their session (``fault-to-failed``).
``leak-slot``: a staging slot is leased
during each fault and never returned (``no-leak``). ``no-repair``: the fault is never
repaired (``recovered``). ``no-tcp``: UCX may use shared memory/CMA (``UCX_TLS`` unset on
both sides; the net devices stay restricted): the bytes bypass the link
(``over-the-link``). ``no-notices``: the managers send no room notice (``decode-told``)."""
WATCH_STAMPS_S = 0.01
"""The decode peer scans its page headers this often and logs every stamped write that
landed (:mod:`stress.harness.landings`; ~1-2 % of a core on these machines): a page audit finding
quotes the page's log, so it names the writes that really landed there and when (two
landings on one page within a period show as the last)."""
NOTICE_ROOMS = 32
"""Rooms of the room-notice round at each link rate (about half of them aborted)."""
NOTICE_ABORT_RATE = 0.5
_CHILD_ENTRY = (
    "import sys; from stress.scenarios.two_hosts import child_main; "
    "sys.exit(child_main(sys.argv[1:]))"
)
CHILD_EXIT_TIMEOUT_S = 30.0
"""How long :func:`run_two_hosts` waits for the sender child to exit once its result is in
(then it is killed)."""
_JOIN_TIMEOUT_S = 10.0
"""The child's bound on joining its run's threads at the end."""
_RESULT_TAG = "TWO-HOSTS-RESULT "
_PROGRESS_TAG = "TWO-HOSTS-PROGRESS "


@dataclass(frozen=True)
class Plan:
    """What the child runs (JSON between the two processes).

    Attributes:
        seed: Seed of the room plans.
        kinds: The faults, in order (one phase each).
        rates_bit: Link rate per cycle (the phases run once per rate).
        lead_s: Traffic before the fault.
        after_s: Traffic after the fault (>= the transfer deadline + margin for hung faults).
        recover_rooms: Consecutive verified successes that count as recovered.
        recover_budget_rooms: The recovery's bound, in rooms, not seconds: the streak must
            come among the first this many rooms concluded after the repair (a fixed 6 s
            was missed at load 12, with no room concluded at all; CPU pressure 97 %).
        recover_timeout_s: A guard, not the bound: traffic of the baseline, the notice round
            and a recovery stops admitting rooms after this long whatever it reached (below
            :data:`ROOM_DEADLINE_S`, when the driver aborts) (a recovery cut short
            by it is reported with the rooms it got; no room at all is a stall, which the
            watchdog reports first).
        rooms: Rooms per driver batch (``max_active`` is half of it).
        threads: Transfer workers of the manager.
        plant_bug: Test only: one of :data:`PLANTED_BUGS`.
    """

    seed: int = 0
    kinds: tuple[str, ...] = KINDS
    rates_bit: tuple[int, ...] = (1_000_000_000,)
    lead_s: float = 0.3
    after_s: float = 0.9
    recover_rooms: int = 8
    recover_budget_rooms: int = 200
    recover_timeout_s: float = 20.0
    rooms: int = 16
    threads: int = 2
    plant_bug: str | None = None

    @classmethod
    def quick(cls, seed: int = 0, plant_bug: str | None = None) -> Plan:
        """The ``--quick`` preset (and the CI test's): every fault once at 1 Gbit/s."""
        return cls(seed=seed, plant_bug=plant_bug)

    @classmethod
    def full(cls, seed: int = 0, plant_bug: str | None = None) -> Plan:
        """The full preset: every fault at 1 and at 10 Gbit/s, longer windows."""
        return cls(
            seed=seed,
            rates_bit=(1_000_000_000, 10_000_000_000),
            lead_s=0.8,
            after_s=1.2,
            recover_rooms=16,
            rooms=24,
            plant_bug=plant_bug,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        data["kinds"] = tuple(data["kinds"])
        data["rates_bit"] = tuple(data["rates_bit"])
        return cls(**data)


# =========================================================================== parent side


class TwoHosts:
    name = "two-hosts"
    description = (
        "decode peer in its own netns behind a shaped veth (UCX over TCP): kill, stop, "
        "partition/heal, restart"
    )
    default_duration = 30.0
    invariants = INVARIANTS
    host_network = True
    """It changes this host's network (namespaces, veths, ``tc``): it runs only when named
    or with ``--two-hosts`` (``stress.cli``), never in a plain ``python -m stress``."""

    def run(self, config: StressConfig, monitor: Monitor) -> ScenarioMetrics:
        """Run the plan (``--quick``: every fault once at 1 Gbit/s; else at 1 and 10 Gbit/s
        with longer windows) in a sender child over a new topology; print the per-fault
        table; count the child's violations here. Where no namespace can be made, report
        ``skipped`` with the reason (printed on stderr) and check nothing.

        Thread-safety: called by the framework on one thread. Raises: nothing (a failed
        child is counted under ``no-escaped-exception``).
        """
        reason = unavailable_reason()
        if reason is not None:
            print(f"note: two-hosts skipped: {reason}", file=sys.stderr, flush=True)
            return ScenarioMetrics(extra={"skipped": reason}, skipped=reason)
        maker = Plan.quick if config.quick else Plan.full
        bug = config.plant_bug if config.plant_bug in PLANTED_BUGS else None
        plan = maker(seed=config.seed, plant_bug=bug)
        counters = monitor.counters()
        traffic = threading.Event()

        def progress(rooms: int, ops: int, faults: int) -> None:
            if rooms and not traffic.is_set():
                # The run window (the rates' time base) starts with the first rooms done,
                # not with the topology and the peer's start-up.
                traffic.set()
                monitor.restart_clock()
            counters.rooms, counters.ops, counters.faults = rooms, ops, faults

        relay: dict[str, Any] = {"key": None, "token": None}

        def step(what: str | None, deadline: float | None) -> None:
            # The child's declared long steps (and its start-up) become ours, same bound:
            # one clock (CLOCK_MONOTONIC) for both processes.
            if (what, deadline) == relay["key"]:
                return
            relay["key"] = (what, deadline)
            if relay["token"] is not None:
                monitor.end_step(relay["token"])
                relay["token"] = None
            if what is not None and deadline is not None:
                left = deadline - time.monotonic()
                if left > 0:
                    relay["token"] = monitor.begin_step(what, left)

        limit = max(120.0, 6 * monitor.duration_s)
        result = run_two_hosts(
            plan, timeout_s=limit, on_progress=progress, on_step=step, on_child=monitor.on_stall
        )
        step(None, None)
        relay_violations(result, monitor)
        child_native = result.get("native_stderr") or {}
        monitor.native_lines(
            NativeLines(
                {str(k): int(v) for k, v in child_native.get("counts", {}).items()},
                {str(k): tuple(v) for k, v in child_native.get("examples", {}).items()},
            )
        )
        print(format_phases(result), flush=True)
        return ScenarioMetrics(extra=summary(result))


def relay_violations(result: dict[str, Any], monitor: Monitor) -> None:
    """Count the child's invariant violations in ``monitor`` (examples first)."""
    for inv in result.get("invariants", []):
        examples = list(inv.get("examples", []))
        for i in range(int(inv.get("violations", 0))):
            detail = examples[i] if i < len(examples) else "(see the first examples)"
            monitor.violation(str(inv["name"]), detail)
    if result.get("error"):
        monitor.violation("no-escaped-exception", f"two-hosts child: {result['error']}")


FAULT_TABLE_LEGEND: Final = tuple(
    """\
  in flight: rooms the sender had not concluded at the fault = failed + ok (+ other: neither);
    ok: its bytes were through before the fault. fault->Failed ms: the slowest of them, fault to
    Failed (sender's clock). goal ms / goal: its goal (kill, restart 1 s; stop, partition, evict
    the 0.5 s deadline + 100 ms) and whether every one met it (a report; the run fails past a
    wider limit). opened after: rooms opened after the fault; their max ms: the longest of their
    lives (evict: of those opened after the eviction). leaks, corrupt, early reuse: findings.
    recovered: a streak of verified rooms after the repair; 1st ok ms: repair to the first one.
    canary: what NIXL said of a write posted into a stop/partition/evict, and when its bytes
    landed after the repair. Every column: README, "Stress and benchmark jobs" (two-hosts).
""".splitlines()
)
"""Printed under the fault table by :func:`format_phases`: what each column means."""


def format_phases(result: dict[str, Any]) -> str:
    """The per-fault figures as a text table (what ``python -m stress two-hosts`` prints;
    ``--json`` has every figure)."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "NO"
        if isinstance(v, float):
            return f"{v:.0f}" if abs(v) >= 10 else f"{v:.1f}"
        return str(v)

    skip = ("baseline", "notices")
    phases = [ph for ph in result.get("phases", []) if ph.get("kind") not in skip]
    # "in flight" = "failed" + "ok" (+ "other"): every room in flight at the fault is in
    # exactly one column. "ok": it succeeded, its bytes were through before the fault.
    with_other = any(_in_flight_split(ph)[2] for ph in phases)
    head = [
        "fault",
        "rate",
        "in flight",
        "failed",
        "ok",
        *(["other"] if with_other else []),
        "fault->Failed ms",
        "goal ms",
        "goal",
        "opened after",
        "their max ms",
        "leaks",
        "corrupt",
        "early reuse",
        "recovered",
        "1st ok ms",
        "canary",
    ]
    rows = [head]
    for ph in phases:
        failed, ok, other = _in_flight_split(ph)
        c = ph.get("canary") or {}
        canary = "-"
        if c:
            landed = cell(c.get("landed_after_repair_ms"))
            canary = f"{c.get('outcome', c.get('post'))}, landed +{landed} ms"
        after_max = (
            ph.get("opened_after_eviction_ms_max")
            if ph["kind"] == "evict"
            else ph.get("opened_after_ms_max")
        )
        rows.append(
            [
                ph["kind"],
                f"{ph.get('rate_bit', 0) / 1e9:g}G",
                cell(ph["in_flight"]),
                cell(failed),
                cell(ok),
                *([cell(other)] if with_other else []),
                cell(ph["fault_to_failed_ms_max"]),
                cell(ph["goal_ms"]),
                cell(ph["goal_met"]),
                cell(ph["opened_after"]),
                cell(after_max),
                cell(ph["leaks"]),
                cell(ph["corruption"]),
                cell(ph["early_reuse"]),
                cell(ph["recovered"]),
                cell(ph["first_success_after_repair_ms"]),
                canary,
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if phases:
        lines.extend(FAULT_TABLE_LEGEND)
    for ph in result.get("phases", []):
        if ph.get("kind") == "notices":
            lat, idle, dlv = ph["latency_ms"], ph["idle_latency_ms"], ph["delivery_ms"]
            lines.append(
                f"room notices at {ph.get('rate_bit', 0) / 1e9:g}G: {ph['learnt']}/{ph['judged']} "
                f"failed rooms known at the peer; purge->learnt p50 {cell(lat['p50'])} / p99 "
                f"{cell(lat['p99'])} ms (nothing in flight: p50 {cell(idle['p50'])} / p99 "
                f"{cell(idle['p99'])} ms); send->learnt p50 {cell(dlv['p50'])} / p99 "
                f"{cell(dlv['p99'])} ms"
            )
    for ph in result.get("phases", []):
        for text in ph.get("verify_failed_detail") or ():
            lines.append(f"{ph.get('kind')}: bytes differ: {text}")
    if result.get("partition_behaviour"):
        lines.append(f"partition: {result['partition_behaviour']}")
    if result.get("skipped"):
        lines = [f"two-hosts skipped: {result['skipped']}"]
    return "\n".join(lines)


def _in_flight_split(ph: dict[str, Any]) -> tuple[int, int, int]:
    """``(failed, succeeded, other)`` of a phase's rooms in flight at the fault; ``other``
    is whatever neither failed nor succeeded (none expected), so the three add up to
    ``in_flight``."""
    total = int(ph.get("in_flight", 0))
    failed = int(ph.get("in_flight_failed", 0))
    ok = int(ph.get("in_flight_succeeded", 0))
    return failed, ok, total - failed - ok


def summary(result: dict[str, Any]) -> dict[str, JSONValue]:
    """The scenario's report: per fault, the measured figures (see :func:`run_child`)."""
    out: dict[str, JSONValue] = {
        "link": result.get("link"),
        "partition_behaviour": result.get("partition_behaviour"),
        "phases": result.get("phases", []),
        "decode_told": result.get("decode_told"),
    }
    if "skipped" in result:
        out["skipped"] = result["skipped"]
    return out


def run_two_hosts(
    plan: Plan,
    *,
    timeout_s: float = 120.0,
    on_progress: Callable[[int, int, int], None] | None = None,
    stderr: IO[str] | None = None,
    on_step: Callable[[str | None, float | None], None] | None = None,
    on_child: Callable[[Callable[[], None]], None] | None = None,
) -> dict[str, Any]:
    """Make the two-host topology, run ``plan`` in a sender child process over it, tear the
    topology down (always), and return the child's result.

    ``on_child(dump)`` is given, once the child runs, a function that makes the child write
    every thread's stack (SIGUSR1, ``faulthandler``); what it wrote is printed on stderr
    and returned as ``"child_stacks"`` (for a watchdog: a stall's cause is in the child).

    ``on_step(what, deadline)`` is told the long step in progress (``None``: none) for a
    watchdog: first the child's start-up (bounded by ``timeout_s``, after which the child is
    killed), then whatever long step the child declares (peer start-up, repairs, drains),
    with its deadline on ``time.monotonic()``'s clock.

    Where the topology cannot be made, returns ``{"skipped": reason}``. When the child dies,
    hangs (killed after ``timeout_s``) or returns nothing, the result has ``"error"``.

    Thread-safety: one call at a time per process is the intended use (each call makes its
    own uniquely named topology).
    """
    reason = unavailable_reason()
    if reason is not None:
        return {"skipped": reason}
    with (
        two_host_link() as link,
        tempfile.TemporaryFile("w+", encoding="utf-8") as err,
        tempfile.NamedTemporaryFile("w+", encoding="utf-8", suffix=".stacks") as stacks,
    ):
        cmd = [
            sys.executable,
            "-c",
            _CHILD_ENTRY,
            "--link",
            link.to_json(),
            "--plan",
            plan.to_json(),
            "--stacks",
            stacks.name,
        ]
        env = child_env(link)
        if plan.plant_bug == "no-tcp":
            env.pop("UCX_TLS", None)
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
            text=True,
        )
        result: dict[str, Any] | None = None
        killer = threading.Timer(timeout_s, proc.kill)
        killer.daemon = True
        killer.start()
        if on_step is not None:
            on_step("sender child start-up", time.monotonic() + timeout_s)
        if on_child is not None:
            on_child(lambda: proc.send_signal(signal.SIGUSR1) if proc.poll() is None else None)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(_PROGRESS_TAG):
                    fields = line.split(maxsplit=5)
                    if on_progress is not None:
                        rooms, ops, faults = (int(x) for x in fields[1:4])
                        on_progress(rooms, ops, faults)
                    if on_step is not None and len(fields) >= 6:
                        on_step(fields[5].strip(), float(fields[4]))
                    elif on_step is not None and len(fields) == 5:  # "-": no step now
                        on_step(None, None)
                elif line.startswith(_RESULT_TAG):
                    result = json.loads(line[len(_RESULT_TAG) :])
            status = proc.wait(timeout=CHILD_EXIT_TIMEOUT_S)
        finally:
            killer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            if proc.stdout is not None:
                proc.stdout.close()
        err.seek(0)
        child_err = err.read()
        tail = child_err[-4000:]
        if stderr is not None and tail:
            stderr.write(tail)
        left = link.pids_inside()
        stacks.seek(0)
        child_stacks = stacks.read()
    if result is None:
        result = {"error": f"child exited with status {status} and no result; stderr tail:\n{tail}"}
    elif status != 0 and not result.get("error"):
        result["error"] = f"child exited with status {status}"
    if left:
        result.setdefault("error", f"processes left in the namespace: {left}")
    result["stderr_tail"] = tail
    if child_stacks:
        result["child_stacks"] = child_stacks
        print(f"[two-hosts] the sender child's stacks:\n{child_stacks}", file=sys.stderr)
    counted = count_lines(child_err)  # the child's NIXL/UCX lines (its own stderr file)
    result["native_stderr"] = {
        "counts": dict(counted.counts),
        "examples": {k: list(v) for k, v in counted.examples.items()},
    }
    cleanup_stale()  # the child's own names, if it made any and died
    return result


# =========================================================================== child side


class NetnsRig(SenderRig):
    """A :class:`SenderRig` whose decode peers run in the link's namespace (UCX over TCP),
    reached on the namespace's address. The rig's transport, pools, injector (no faults) and
    managers are the base class's."""

    def __init__(
        self,
        config: StressConfig,
        sessions: tuple[str, ...],
        peer_pages: int,
        link: TwoHostLink,
        peer_env: dict[str, str] | None = None,
    ) -> None:
        self.link = link
        super().__init__(config, (), peer_pages)  # no loopback peers
        self.sessions = sessions
        try:
            for sid in sessions:
                peer = PeerProcess(
                    peer_pages,
                    PAGE_BYTES,
                    name=sid,
                    rpc_timeout_s=2.0,
                    start_timeout_s=PEER_START_TIMEOUT_S,
                    stderr=subprocess.DEVNULL,
                    netns=link.netns,
                    host=link.peer_addr,
                    env=link.peer_env() if peer_env is None else peer_env,
                    watch_stamps_s=WATCH_STAMPS_S,
                )
                self._stack.callback(peer.close)
                self.peers[sid] = peer
                self.tx.add_peer(sid, peer.metadata)
        except BaseException:
            self.close()
            raise


@dataclass
class _Track:
    """What one phase saw (scheduler thread writes, fault thread reads after joins)."""

    handles: dict[int, RoomHandle] = field(default_factory=dict)
    outcomes: list[RoomOutcome] = field(default_factory=list)
    last_user: dict[int, tuple[int, KVPoll | None]] = field(default_factory=dict)
    early_reuse: list[str] = field(default_factory=list)
    # Per Success room whose bytes differed at the peer: what its pages held (their stamps)
    # and the peer's log of what landed on them (bytes-verified says only "differ").
    verify_detail: list[str] = field(default_factory=list)
    streak: int = 0


class _Child:
    """The run inside the sender child (one instance per child process)."""

    def __init__(self, link: TwoHostLink, plan: Plan) -> None:
        self.link = link
        self.plan = plan
        self.config = StressConfig(
            threads=plan.threads,
            rooms=plan.rooms,
            chunks=8,
            fault_rate=0.0,
            seed=plan.seed,
            switch_interval=1e-4,
            lock="mutex",
            quick=True,
            watchdog_s=10.0,
            plant_bug=plan.plant_bug,
        )
        self.monitor = Monitor("two-hosts", INVARIANTS, duration_s=3600.0, watchdog_s=10.0)
        self.control_down = threading.Event()  # the harness does not read pages now
        # Held by every page read; the fault thread takes it after setting control_down, so
        # no read is left half-way (blocked for the RPC timeout) when the fault hits.
        self._rpc_gate = threading.Lock()
        self.add_peer_retries = 0
        self.track = _Track()
        self.phases: list[dict[str, JSONValue]] = []
        self.done_rooms = 0
        self.faults = 0
        # kind -> [faults injected, faults that found a room in flight]: ``fault-to-failed``
        # judges the rooms in flight at a fault, so each kind must find one at least once.
        self.in_flight_at: dict[str, list[int]] = {}
        self._stop_progress = threading.Event()
        self._rig: NetnsRig | None = None
        self._on_failed: Callable[[], None] | None = None
        # When the phase's old peer process was gone (reaped): kill/restart phases only.
        # Fault thread; read by the same thread after the fault window's joins.
        self._dead_at: float | None = None

    # ------------------------------------------------------------------ entry

    def run(self) -> dict[str, Any]:
        printer = threading.Thread(target=self._progress_loop, name="progress", daemon=True)
        printer.start()
        old_switch = sys.getswitchinterval()
        sys.setswitchinterval(self.config.switch_interval)
        out: dict[str, Any] = {
            "link": {
                "netns": self.link.netns,
                "subnet": self.link.subnet,
                "host_if": self.link.host_if,
            }
        }
        try:
            peer_env = self.link.peer_env()
            if self.plan.plant_bug == "no-tcp":
                peer_env.pop("UCX_TLS")
            with self.monitor.long_step(
                "start the decode peer in its namespace", peer_start_bound(self.monitor)
            ):
                rig = NetnsRig(self.config, (SESSION,), PEER_PAGES, self.link, peer_env)
            try:
                self._rig = rig
                rig.audit.read = self._read
                rig.audit.explain = self._landings_text
                self._phases(rig)
            finally:
                self._rig = None
                out["decode_told"] = rig.notices.summary()
                with rig.peer_lock:
                    peers = list(rig.peers.values())
                with self.monitor.long_step("close the rig", close_bound(self.monitor, peers)):
                    rig.close()
        except Exception as exc:
            self.monitor.exception(exc, "two-hosts child")
            import traceback

            out["error"] = traceback.format_exc()[-3000:]
        finally:
            self.monitor.stop.set()
            with self.monitor.long_step(
                "join the run's threads", _JOIN_TIMEOUT_S + self.monitor.watchdog_s
            ):
                self.monitor.join_all(timeout=_JOIN_TIMEOUT_S)
            sys.setswitchinterval(old_switch)
            self._stop_progress.set()
            printer.join(5)
        out["phases"] = self.phases
        out["partition_behaviour"] = _partition_behaviour(self.phases)
        out["invariants"] = [
            {"name": r.name, "violations": r.violations, "examples": list(r.examples)}
            for r in self.monitor.reports()
        ]
        return out

    def _progress_loop(self) -> None:
        while not self._stop_progress.wait(0.5):
            print(self._progress_line(), flush=True)

    def _progress_line(self) -> str:
        """``TAG rooms ops faults DEADLINE WHAT``: the latest-ending long step this child
        declared (``time.monotonic()`` deadline; ``-`` when none), for the parent's
        watchdog."""
        head = f"{_PROGRESS_TAG}{self.done_rooms} {self.done_rooms * 8} {self.faults}"
        steps = self.monitor.open_steps()
        if not steps:
            return f"{head} -"
        what, _, deadline = max(steps, key=lambda st: st[2])
        return f"{head} {deadline:.3f} {' '.join(what.split())}"

    def _phases(self, rig: NetnsRig) -> None:
        first = True
        for rate in self.plan.rates_bit:
            self.link.shape(rate)
            if first:
                self._baseline(rig)
                first = False
            self.phases.append(self._notice_round(rig, rate))
            for kind in self.plan.kinds:
                if kind not in KINDS:
                    raise ValueError(f"unknown fault kind {kind!r}")
                self.phases.append(self._phase(rig, kind, rate))
        self._judge_in_flight_coverage()

    def _judge_in_flight_coverage(self) -> None:
        """``fault-to-failed`` judged nothing of a kind none of whose faults found a room in
        flight: a vacuous check, reported as a violation."""
        for kind, (faults, found) in self.in_flight_at.items():
            if not found:
                self.monitor.violation(
                    FAULT_TO_FAILED, f"{kind}: no room was in flight at any of its {faults} faults"
                )

    # ------------------------------------------------------------------ scheduler plumbing

    def _digest(self, session_id: str, pages: Sequence[int]) -> list[str]:
        with self._rpc_gate:
            if self.control_down.is_set() or self._rig is None:
                raise PeerError("the harness reads no pages while the fault is on")
            return self._rig.digest(session_id, pages)

    def _read(self, session_id: str, pages: Sequence[int]) -> bytes:
        """The pages' bytes at the peer (the page audit reads a violating page's stamp)."""
        with self._rpc_gate:
            if self.control_down.is_set() or self._rig is None:
                raise PeerError("the harness reads no pages while the fault is on")
            rig = self._rig
            with rig.peer_lock:
                peer = rig.peers[session_id]
            return peer.read_pages(list(pages))

    def _verify_detail(self, o: RoomOutcome) -> str:
        """What the pages of a Success room whose bytes differed hold: each page's stamp and
        the peer's log of the writes that landed on it. Never raises (a diagnostic)."""
        try:
            data = self._read(o.session_id, list(o.dst_pages))
            got = self._digest(o.session_id, list(o.dst_pages))
        except Exception as exc:  # the peer went away meanwhile
            return f"room {o.room} gen {o.generation}: pages unreadable ({exc!r})"
        parts: list[str] = []
        for i, page in enumerate(o.dst_pages):
            if i < len(o.sent_digests) and got[i] == o.sent_digests[i]:
                continue
            stamp = read_stamp(data[i * PAGE_BYTES : (i + 1) * PAGE_BYTES])
            try:
                log = self._landings_text(o.session_id, page)
            except Exception as exc:  # a diagnostic only
                log = f"landings unreadable ({exc!r})"
            parts.append(f"page {page} (chunk {i}) holds {stamp or 'no stamp'}; {log}")
        return f"room {o.room} gen {o.generation} (admitted {o.started_at:.3f}): " + (
            " | ".join(parts) if parts else "every page matches now (the bytes landed late)"
        )

    def _landings_text(self, session_id: str, page: int) -> str:
        """The peer's log of the stamped writes that landed on ``page`` (its current process
        only: a killed one took its log along), for a page audit finding."""
        with self._rpc_gate:
            if self.control_down.is_set() or self._rig is None:
                return ""
            rig = self._rig
            with rig.peer_lock:
                peer = rig.peers[session_id]
            got = [r for r in peer.landings() if r.page == page]
        if not got:
            return f"no stamped write landed on page {page} in the peer's current process"
        shown = "; ".join(
            f"{r.at:.3f}: "
            + (
                "no stamp (zeroed)"
                if r.room < 0
                else f"room {r.room} gen {r.generation} chunk {r.chunk} (for page {r.dst_page})"
            )
            for r in got[-8:]
        )
        return f"landed on page {page} ({len(got)} in the current process, last 8): {shown}"

    def _cut_control(self) -> None:
        """Stop reading pages at the peer (its control channel shares the link) and wait for
        a read in progress to finish."""
        self.control_down.set()
        with self._rpc_gate:
            pass

    def _add_peer(self, rig: NetnsRig, metadata: bytes) -> None:
        """``add_peer`` as an engine would: retried for a while (a connection attempt right
        after a repair may be refused)."""
        for attempt in range(ADD_PEER_ATTEMPTS):
            try:
                rig.tx.add_peer(SESSION, metadata)
                return
            except Exception:
                if attempt == ADD_PEER_ATTEMPTS - 1:
                    raise
                self.add_peer_retries += 1
                time.sleep(ADD_PEER_PAUSE_S)

    def _driver(self, rig: NetnsRig) -> SchedulerDriver:
        track = self.track
        mgr = rig.mgr
        monitor = self.monitor
        # Stamped sources: each room's bytes name its opening, chunk and intended decode page,
        # so whatever the page audit finds names its writer (rooms sharing prefill pages made
        # a digest name only a prefill page). Fresh per phase: a phase ends fully drained.
        # The canary's source pages stay out.
        sources = StampedSources(rig.kv, range(CANARY_PAGES, rig.kv.shape[0]))
        driver = SchedulerDriver(mgr, {SESSION: ROOM_PAGES}, self._digest, sources=sources)

        def on_admit(handle: RoomHandle, _abort: bool) -> None:
            track.handles[handle.room] = handle

        def on_conclude(o: RoomOutcome) -> None:
            rig.audit.record(o)
            track.outcomes.append(o)
            self.done_rooms += 1
            for p in o.dst_pages:
                track.last_user[p] = (o.room, o.status)
            if o.status is KVPoll.Success and o.verified:
                track.streak += 1
            else:
                track.streak = 0
            if o.status is KVPoll.Success and o.verified is False:
                track.verify_detail.append(self._verify_detail(o))
            if o.status is KVPoll.Failed and self._on_failed is not None:
                self._on_failed()

        def before_reuse(session_id: str, pages: Sequence[int]) -> None:
            for p in pages:
                prev = track.last_user.get(p)
                if prev is None or prev[1] is KVPoll.Success:
                    continue
                handle = track.handles.get(prev[0])
                if handle is not None and mgr.draining(handle) > 0:
                    text = (
                        f"decode page {p} handed to a new room while failed room "
                        f"{prev[0]} still drains ({mgr.draining(handle)} transfers)"
                    )
                    track.early_reuse.append(text)
                    monitor.violation(NO_EARLY_REUSE, text)
            for text in rig.audit.check_pages(self._digest, session_id, pages):
                monitor.violation(DECODE_PAGE_AUDIT, text)

        driver.on_admit = on_admit
        driver.on_conclude = on_conclude
        driver.before_reuse = before_reuse
        return driver

    def _traffic(
        self,
        rig: NetnsRig,
        driver: SchedulerDriver,
        running: Callable[[], bool],
        **more: Any,
    ) -> threading.Thread:
        overrides: dict[str, Any] = {"deadline_s": ROOM_DEADLINE_S, "reuse": "lifo", **more}
        if self.plan.plant_bug == "quarantine":
            overrides.update(release_rule="quarantine", quarantine_s=0.0)
        return self.monitor.spawn(
            rig.scheduler(self.monitor, driver=driver, running=running, overrides=overrides),
            "scheduler",
        )

    def _join(self, thread: threading.Thread, what: str) -> None:
        """Join a traffic thread: its driver gives up after :data:`ROOM_DEADLINE_S`
        (aborting what is left); one watchdog period more for the aborts."""
        bound = ROOM_DEADLINE_S + self.monitor.watchdog_s
        thread.join(bound)
        if thread.is_alive():
            self.monitor.deadlock(f"{what}: the scheduler did not stop within {bound:g} s")
            raise RuntimeError(f"{what}: scheduler stuck")

    # ------------------------------------------------------------------ baseline

    def _baseline(self, rig: NetnsRig) -> None:
        """Healthy rooms over the link: every one succeeds, and the bytes are on the veth."""
        self.track = _Track()
        before = self.link.counters()
        qdisc_before = self.link.qdisc_sent_bytes() or 0
        driver = self._driver(rig)
        want = self.plan.recover_rooms * 2
        end = time.monotonic() + self.plan.recover_timeout_s
        t = self._traffic(
            rig, driver, lambda: len(self.track.outcomes) < want and time.monotonic() < end
        )
        self._join(t, "baseline")
        grown = self.link.counters().minus(before)
        qdisc = (self.link.qdisc_sent_bytes() or 0) - qdisc_before
        ok = [o for o in self.track.outcomes if o.status is KVPoll.Success and o.verified]
        payload = len(ok) * self.config.chunks * PAGE_BYTES
        if len(ok) < want:
            self.monitor.violation(RECOVERED, f"baseline: only {len(ok)}/{want} rooms succeeded")
        if grown.tx_bytes < payload or qdisc < payload:
            self.monitor.violation(
                OVER_THE_LINK,
                f"{payload} bytes of verified rooms but only {grown.tx_bytes} left by "
                f"{self.link.host_if} ({qdisc} through its qdisc)",
            )
        self.phases.append(
            {
                "kind": "baseline",
                "rooms": len(self.track.outcomes),
                "verified": len(ok),
                "payload_bytes": payload,
                "veth_tx_bytes": grown.tx_bytes,
                "qdisc_sent_bytes": qdisc,
                "veth_rx_bytes": grown.rx_bytes,
            }
        )
        self._check_quiet(rig, "baseline")
        self._next_manager(rig)

    # ------------------------------------------------------------------ room notices

    def _notice_round(self, rig: NetnsRig, rate: int) -> dict[str, JSONValue]:
        """Rooms over the healthy link, about half of them aborted by the scheduler (some
        with chunks in flight); the manager's close, drain and ``decode-told`` check follow:
        every aborted room must be known as failed at the peer. Returns the figures."""
        self.track = _Track()
        driver = self._driver(rig)
        mark, before = rig.notices.mark(), dict(rig.notices.counts)
        end = time.monotonic() + self.plan.recover_timeout_s
        t = self._traffic(
            rig,
            driver,
            lambda: len(self.track.outcomes) < NOTICE_ROOMS and time.monotonic() < end,
            abort_rate=NOTICE_ABORT_RATE,
            abort_lag_s=0.0,
        )
        self._join(t, "notices")
        self._next_manager(rig)
        told = rig.notices.summary(mark)
        counts = {k: int(rig.notices.counts[k]) - int(before[k]) for k in before}
        return {
            "kind": "notices",
            "rate_bit": rate,
            "rooms": len(self.track.outcomes),
            "failed": sum(o.status is KVPoll.Failed for o in self.track.outcomes),
            **{k: counts[k] for k in ("judged", "learnt", "missing", "notices_sent")},
            "latency_ms": told["latency_ms"],
            "idle_latency_ms": told["idle_latency_ms"],
            "delivery_ms": told["delivery_ms"],
            "goal_met": told["goal_met"],
        }

    # ------------------------------------------------------------------ one fault

    def _next_manager(self, rig: NetnsRig) -> None:
        """Close the phase's manager with the rig's end checks (drain, nothing left, chunks
        counted once), judge the decode pages, and start a fresh manager on the same
        transport."""
        with self.monitor.long_step("drain and end checks", final_checks_bound(self.monitor, 1)):
            rig.finish_manager(self.monitor)
            rig.audit_pages(self.monitor)
            self._check_landings(rig)
        rig.make_manager()

    def _check_landings(self, rig: NetnsRig) -> None:
        """``decode-page-audit``, the order of what landed: the peer's landing log of its
        current process against the pages' histories (:meth:`PageAudit.late_landings`).
        A peer that cannot answer now (down) is skipped: the final bytes are still judged."""
        # One control-channel read (the peer's 2 s RPC timeout) and the check, on top of
        # what final_checks_bound allows the drain and the other reads.
        with self.monitor.long_step("the landing log", 2.0 + self.monitor.watchdog_s):
            try:
                with rig.peer_lock:
                    peer = rig.peers[SESSION]
                landings = peer.landings()
            except Exception:  # the peer is down (a failed restart): nothing to read
                return
            found = rig.audit.late_landings(SESSION, landings)
        for text in found:
            self.monitor.violation(DECODE_PAGE_AUDIT, text)

    def _phase(self, rig: NetnsRig, kind: str, rate: int) -> dict[str, JSONValue]:
        before = {r.name: r.violations for r in self.monitor.reports()}
        self.track = _Track()
        track = self.track
        peer = rig.peers[SESSION]
        canary_src = np.arange(CANARY_PAGES, dtype=np.int64)
        canary_dst = np.arange(ROOM_PAGES, PEER_PAGES, dtype=np.int64)
        with rig.peer_lock:
            peer.zero_pages(canary_dst.tolist())
        driver = self._driver(rig)
        evicted_at: list[float] = []
        in_fault = threading.Event()

        def evict() -> None:  # scheduler thread, as soon as a room concluded Failed
            if in_fault.is_set() and not evicted_at:
                # The engine's health check: the session is gone until the link heals.
                rig.tx.remove_peer(SESSION)
                evicted_at.append(time.monotonic())

        self._on_failed = evict if kind == "evict" else None
        phase_over = threading.Event()
        retries_before = self.add_peer_retries
        link_before = self.link.counters()
        t = self._traffic(rig, driver, lambda: not phase_over.is_set())
        time.sleep(self.plan.lead_s)
        canary: dict[str, JSONValue] = {}
        # decode-told: rooms living around the fault are not judged; a killed or replaced
        # peer's notices are fetched first (the new process knows nothing).
        if kind in ("kill", "restart"):
            rig.harvest_notices(SESSION)
        window = rig.notices.fault(SESSION, time.monotonic())
        self._cut_control()
        # Strike while chunks are posted and not done: rooms are then really in flight
        # (not just waiting for the scheduler to notice that they are complete).
        # Bounded by the watchdog's period, not a fixed second: traffic is flowing, so a
        # loaded machine only makes the wait longer.
        busy = self._wait_busy(rig, track, self.monitor.watchdog_s / 2)
        fault_at, fault_on = self._inject(rig, kind)
        # Only now may a failure evict the peer: a room that failed (its deadline missed on
        # a loaded machine) while the partition was being made evicted it before the fault,
        # and then no room was in flight at the fault ('evict: evicted -18.6 ms after it').
        in_fault.set()
        self.faults += 1
        canary_xfer = None
        if kind in ("stop", "partition", "evict"):
            canary_xfer, canary = self._post_canary(rig, canary_src, canary_dst)
        if kind == "restart":
            # The replacement is up: the control channel works again.
            self.control_down.clear()
        time.sleep(max(0.0, fault_at + self.plan.after_s - time.monotonic()))
        phase_over.set()
        self._join(t, f"{kind}: fault window")
        fault_window_end = time.monotonic()
        if self.plan.plant_bug == "leak-slot":
            rig.pool.acquire(("planted-leak", kind), timeout=5.0)
        # Every room of the fault window concluded; only hung transfers may be held.
        held = self._held_during_fault(rig, f"{kind} (fault still on)")
        repaired_at = self._repair(rig, kind)
        rig.notices.fault_end(window, repaired_at)
        self.control_down.clear()
        if canary_xfer is not None:
            with self.monitor.long_step(
                "watch the canary write", CANARY_WATCH_S + self.monitor.watchdog_s
            ):
                canary.update(
                    self._watch_canary(rig, canary_xfer, canary_src, canary_dst, repaired_at)
                )
        # Recovery: new rooms over the same transport until a streak of verified successes.
        phase_over.clear()
        in_fault.clear()
        track.streak = 0
        n_before = len(track.outcomes)
        want, budget = self.plan.recover_rooms, self.plan.recover_budget_rooms
        end = time.monotonic() + self.plan.recover_timeout_s
        t = self._traffic(
            rig,
            driver,
            lambda: track.streak < want
            and len(track.outcomes) - n_before < budget
            and time.monotonic() < end,
        )
        self._join(t, f"{kind}: recovery")
        self._on_failed = None
        recovery = track.outcomes[n_before:]
        self._check_quiet(rig, f"{kind} (after the recovery)")
        link_grown = self.link.counters().minus(link_before)
        figures = self._figures(
            kind,
            fault_at,
            fault_window_end,
            repaired_at,
            evicted_at[0] if evicted_at else None,
            recovery,
            self._dead_at if kind in ("kill", "restart") else None,
            fault_on=fault_on,
        )
        self._next_manager(rig)
        after = {r.name: r.violations for r in self.monitor.reports()}
        figures.update(
            {
                "rate_bit": rate,
                "transfers_in_flight_at_fault": busy,
                "held_while_fault_on": held,
                "add_peer_retries": self.add_peer_retries - retries_before,
                "canary": canary,
                "veth_tx_bytes": link_grown.tx_bytes,
                "veth_tx_dropped": link_grown.tx_dropped,
                "violations": {
                    k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)
                },
                "leaks": after.get(NO_LEAK, 0) - before.get(NO_LEAK, 0),
                "corruption": after.get(DECODE_PAGE_AUDIT, 0) - before.get(DECODE_PAGE_AUDIT, 0),
                "verify_failures": after.get(BYTES_VERIFIED, 0) - before.get(BYTES_VERIFIED, 0),
                "early_reuse": len(track.early_reuse),
                "verify_failed_detail": list(track.verify_detail),
            }
        )
        return figures

    @staticmethod
    def _wait_busy(rig: NetnsRig, track: _Track, timeout_s: float) -> bool:
        """Wait (up to ``timeout_s``) until chunks are in flight *and* a room admitted lately
        is not concluded by the sender: a room that missed its deadline on a loaded machine
        before the fault failed its whole session (a deadline is session-fatal), and its
        chunks, still in flight, made the moment look busy with no room left to be in
        flight at the fault ('partition: no room was in flight at the fault')."""
        end = time.monotonic() + timeout_s

        def busy() -> bool:
            if rig.mgr.stats().transfers_inflight == 0:
                return False
            lately = list(track.handles.values())[-BUSY_ROOMS_LOOKED_AT:]
            return any(rig.conclusions.at(h.room, h.generation) is None for h in lately)

        while not busy():
            if time.monotonic() >= end:
                return False
            time.sleep(0.0005)
        return True

    def _inject(self, rig: NetnsRig, kind: str) -> tuple[float, float]:
        """Strike: ``(began, on)``, when the fault began (the signal sent, the link's cut
        begun) and when it was surely on (the call returned). Making a partition (an ``ip``
        process, then the wait for the carrier) took over a transfer deadline on a loaded
        machine. Rooms in flight are judged from ``began`` (timed after the call, the chunks
        it caught had hung and failed their session before "the fault", and the rooms parked
        behind their slots failed of their own); rooms opened after it from ``on`` (one
        opened during the call may still succeed)."""
        peer = rig.peers[SESSION]
        if kind in ("stop", "partition", "evict"):
            began = time.monotonic()
            if kind == "stop":
                peer.stop()  # returns once the process is stopped
            else:
                self.link.partition()  # returns once the carrier is down
            return began, time.monotonic()
        if kind == "kill":
            # The fault is the signal, not the end of the reap: rooms whose bytes were all
            # through may conclude (Success) while kill() waits for the process to go, and
            # taking the time after that wait left none "in flight at the fault" (seen once
            # in `make stress` at 1G: in flight 0, a fault-to-failed violation).
            signalled_at = time.monotonic()
            peer.kill()
            self._dead_at = time.monotonic()
            rig.audit.peer_reset(SESSION, self._dead_at)
            return signalled_at, signalled_at
        # restart: the old process goes away (SIGTERM: it closes its agent) and a new one
        # comes up; then the session, same id, is pointed at the new metadata.
        at = time.monotonic()
        rig.audit.peer_reset(SESSION, at)
        bound = self._restart_bound()
        with self.monitor.long_step("replace the decode peer", bound), rig.peer_lock:
            peer.close()  # SIGTERM (SIGKILL after its grace): its agent closes, it exits
            self._dead_at = time.monotonic()
            peer.restart()  # a new process
            rig.tx.remove_peer(SESSION)
            self._add_peer(rig, peer.metadata)
        return at, at

    def _repair(self, rig: NetnsRig, kind: str) -> float:
        peer = rig.peers[SESSION]
        if self.plan.plant_bug == "no-repair":
            return time.monotonic()
        if kind == "stop":
            peer.cont()
        elif kind in ("partition", "evict"):
            self.link.heal()
            if kind == "evict" and not rig.tx.has_peer(SESSION):
                self._add_peer(rig, peer.metadata)
        elif kind == "kill":
            bound = self._restart_bound()
            with self.monitor.long_step("restart the decode peer", bound), rig.peer_lock:
                rig.tx.remove_peer(SESSION)
                peer.restart()
                self._add_peer(rig, peer.metadata)
        return time.monotonic()

    def _restart_bound(self) -> float:
        """A peer restart: its start (:func:`peer_start_bound`) and ``_add_peer``'s
        retries (:data:`ADD_PEER_ATTEMPTS` x :data:`ADD_PEER_PAUSE_S`)."""
        return peer_start_bound(self.monitor) + ADD_PEER_ATTEMPTS * ADD_PEER_PAUSE_S

    # ------------------------------------------------------------------ canary

    def _post_canary(
        self, rig: NetnsRig, src: np.ndarray[Any, Any], dst: np.ndarray[Any, Any]
    ) -> tuple[Any, dict[str, JSONValue]]:
        """A write posted into the fault with the transfer deadline: what NIXL/UCX says
        about it, and whether NIXL still has it in progress after our deadline. The handle
        is kept (as the manager keeps a hung chunk) and watched after the repair."""
        t0 = time.monotonic()
        try:
            x = rig.tx.write_pages(SESSION, src, dst, timeout_s=TRANSFER_TIMEOUT_S)
        except Exception as exc:
            return None, {"post": f"{type(exc).__name__}: {exc}"}
        outcome = "DONE"
        try:
            x.wait(TRANSFER_TIMEOUT_S * 4)
        except Exception as exc:
            outcome = type(exc).__name__
        ended = time.monotonic() - t0
        return x, {
            "outcome": outcome,
            "outcome_after_ms": round(ended * 1e3, 1),
            "in_progress_after_deadline": not x.settled(),
        }

    def _watch_canary(
        self,
        rig: NetnsRig,
        xfer: Any,
        src: np.ndarray[Any, Any],
        dst: np.ndarray[Any, Any],
        repaired_at: float,
    ) -> dict[str, JSONValue]:
        """After the repair: when NIXL reports the canary settled (it is never released
        before: ``remove_peer`` keeps a write NIXL still has in progress), and when its bytes
        land at the peer."""
        want = [page_digest_bytes(rig.kv[int(p)].numpy().tobytes()) for p in src]
        end = repaired_at + CANARY_WATCH_S
        settled_ms: float | None = None
        landed_ms: float | None = None
        was_released = bool(xfer.released)
        while time.monotonic() < end and (settled_ms is None or landed_ms is None):
            now_ms = round((time.monotonic() - repaired_at) * 1e3, 1)
            if settled_ms is None and xfer.settled():
                settled_ms = now_ms
            if landed_ms is None:
                try:
                    if rig.digest(SESSION, dst.tolist()) == want:
                        landed_ms = now_ms
                except PeerError:
                    pass
            time.sleep(0.01)
        xfer.release()
        return {
            "released_before_repair": was_released,
            "settled_after_repair_ms": settled_ms,
            "landed_after_repair_ms": landed_ms,
        }

    # ------------------------------------------------------------------ checks & figures

    def _check_quiet(self, rig: NetnsRig, what: str) -> None:
        """Every room concluded: after ``wait_drained`` nothing may be held anywhere
        (tables, staging keys, slots, live transfer handles)."""
        mgr = rig.mgr
        with self.monitor.long_step(f"{what}: drain", 5.0 + self.monitor.watchdog_s):
            drained = mgr.wait_drained(None, 5.0)
        if not drained:
            self.monitor.violation(NO_LEAK, f"{what}: {mgr.draining()} transfers still draining")
        st = mgr.stats()
        if st.open_rooms or st.transfers_inflight or st.transfers_draining:
            self.monitor.violation(NO_LEAK, f"{what}: manager {st}")
        self._check_tables(rig, what)
        ps = rig.pool.stats()
        if ps.in_use or ps.owners:
            self.monitor.violation(NO_LEAK, f"{what}: {ps.in_use} staging slots leased")
        live = rig.tx.stats().live_transfers
        if live:
            self.monitor.violation(NO_LEAK, f"{what}: {live} live transfer handles")
        for room in self.track.handles:
            left = mgr.footprint(room)
            if left:
                self.monitor.violation(NO_LEAK, f"{what}: room {room} still in {left}")

    def _check_tables(self, rig: NetnsRig, what: str) -> None:
        mgr = rig.mgr
        if mgr.stats().open_rooms:
            self.monitor.violation(NO_LEAK, f"{what}: {mgr.stats().open_rooms} rooms open")
        snap = mgr.staging.snapshot()
        if snap.open_rooms or snap.prefetched_rooms or snap.prefetch_requested:
            self.monitor.violation(NO_LEAK, f"{what}: staging keys left")

    def _held_during_fault(self, rig: NetnsRig, what: str) -> dict[str, JSONValue]:
        """While the fault is still on, every room concluded: no table or staging key may be
        left; transfers NIXL still has in progress (hung past their deadline) are kept,
        with their slots (never more slots than such transfers)."""
        mgr = rig.mgr
        mgr.wait_drained(None, 0.2)
        self._check_tables(rig, what)
        draining = mgr.draining()
        slots = rig.pool.stats().in_use
        if slots > draining:
            self.monitor.violation(
                NO_LEAK, f"{what}: {slots} staging slots leased, only {draining} transfers hung"
            )
        return {
            "transfers_held": draining,
            "slots_held": slots,
            "live_handles": rig.tx.stats().live_transfers,
        }

    def _slow_calls(self, start: float, end: float) -> str:
        """What NIXL was slow at in ``[start, end]`` (a finding's diagnostic)."""
        rig = self._rig
        return "" if rig is None else rig.nixl_calls.describe(start, end)

    def _sender_concluded(self, o: RoomOutcome) -> float | None:
        """When the sender concluded ``o`` (the manager's event; ``None``: it told nothing,
        e.g. of an opening the harness refused)."""
        rig = self._rig
        at = None if rig is None else rig.conclusions.at(o.room, o.generation)
        return None if at is None else min(at, o.concluded_at)

    def _figures(
        self,
        kind: str,
        fault_at: float,
        window_end: float,
        repaired_at: float,
        evicted_at: float | None,
        recovery: Sequence[RoomOutcome],
        dead_at: float | None = None,
        *,
        fault_on: float | None = None,
    ) -> dict[str, JSONValue]:
        hung = kind in ("stop", "partition", "evict")
        goal = TRANSFER_TIMEOUT_S + HUNG_GOAL_SLACK_S if hung else KILL_GOAL_S
        allowed = own_failures_allowed(self.plan.threads)
        # Every time below is the sender's (when the manager concluded the room), not the
        # scheduler's, which does work of the harness between its polls (bytes checks and
        # page audits over the peer's control channel; the gap is driver_lag_ms_max). Times
        # are figures; what is judged is what the sender said (codes) and order.
        window = [o for o in self.track.outcomes if o.started_at < window_end]
        sender_at = {id(o): self._sender_concluded(o) for o in window}
        untold = sum(at is None for at in sender_at.values())
        ended = {
            id(o): o.concluded_at if (at := sender_at[id(o)]) is None else at for o in window
        }
        in_flight = [o for o in window if o.started_at < fault_at < ended[id(o)]]
        # Opened while the fault was being made (fault_on: surely on): neither.
        after = [o for o in window if o.started_at >= (fault_at if fault_on is None else fault_on)]
        failed_at = [ended[id(o)] - fault_at for o in in_flight if o.status is KVPoll.Failed]
        detected = min(
            (
                ended[id(o)]
                for o in window
                if o.status is KVPoll.Failed and ended[id(o)] > fault_at
            ),
            default=None,
        )
        driver_lag = max((o.concluded_at - ended[id(o)] for o in window), default=math.nan)
        rig = self._rig
        # A hung peer or a cut link: a chunk's deadline is session-fatal, so the first wave
        # fails the rest with the session. A dead peer reports the disconnect on each chunk
        # itself, within milliseconds: most rooms then fail of their own (not judged).
        own = [
            o
            for o in (in_flight if hung else [])
            if o.status is KVPoll.Failed
            and (None if rig is None else rig.conclusions.code(o.room, o.generation))
            != "peer-failed"
        ]
        if len(own) > allowed:
            codes = sorted(
                {str(None if rig is None else rig.conclusions.code(o.room, o.generation))
                 for o in own}
            )
            self.monitor.violation(
                FAULT_TO_FAILED,
                f"{kind}: {len(own)} of the {len(in_flight)} rooms in flight at the fault failed "
                f"of their own chunk (codes {codes}), not with their session (allowed "
                f"{allowed}, one per worker): rooms {sorted(o.room for o in own)}, the last "
                f"{(max(ended[id(o)] for o in own) - fault_at) * 1e3:.0f} ms after the fault; "
                f"{self._slow_calls(fault_at, max(ended[id(o)] for o in own))}",
            )
        # A fault that found no room in flight judged nothing here (rooms end in a few ms on
        # a fast link, and making a partition took longer on a loaded machine); each kind
        # must find one in some phase of the run (checked after the phases).
        tally = self.in_flight_at.setdefault(kind, [0, 0])
        tally[0] += 1
        tally[1] += bool(in_flight)
        # Rooms opened after the fault: each fails while a hung peer or a cut link is on
        # (none is left open: the window's traffic was joined). Their lives are figures.
        after_lat: list[float] = []
        after_evicted_lat: list[float] = []
        for o in after:
            evicted = evicted_at is not None and o.started_at >= evicted_at
            (after_evicted_lat if evicted else after_lat).append(ended[id(o)] - o.started_at)
            if o.status is KVPoll.Success and hung:
                self.monitor.violation(
                    FAIL_FAST,
                    f"{kind}: room {o.room} opened after the fault succeeded while it was on",
                )
            # A hung peer's or cut link's room fails of its peer, never as our own error.
            code = None if rig is None else rig.conclusions.code(o.room, o.generation)
            if hung and code == "internal":
                self.monitor.violation(
                    FAIL_FAST,
                    f"{kind}: room {o.room} opened after the fault failed with code 'internal' "
                    "(its peer hangs: not an internal error)",
                )
        first_ok = next(
            (o.concluded_at for o in recovery if o.status is KVPoll.Success and o.verified), None
        )
        streak_ok = self.track.streak >= self.plan.recover_rooms
        if not streak_ok:
            budget = self.plan.recover_budget_rooms
            within = (
                f"among the first {budget} rooms concluded after the repair"
                if len(recovery) >= budget
                else f"within the guard of {self.plan.recover_timeout_s:g} s of the repair"
            )
            self.monitor.violation(
                RECOVERED,
                f"{kind}: no streak of {self.plan.recover_rooms} verified rooms {within} "
                f"({sum(o.status is KVPoll.Success for o in recovery)}/{len(recovery)} ok)",
            )

        def ms(v: float | None) -> float | None:
            return None if v is None or math.isnan(v) else round(v * 1e3, 1)

        return {
            "kind": kind,
            "goal_ms": ms(goal),
            "goal_met": bool(in_flight)
            and all(ended[id(o)] - fault_at <= goal for o in in_flight),
            "own_failures_allowed": allowed,
            "in_flight_own_failures": len(own),
            "in_flight": len(in_flight),
            "in_flight_failed": len(failed_at),
            "in_flight_succeeded": sum(o.status is KVPoll.Success for o in in_flight),
            "in_flight_other": sum(
                o.status not in (KVPoll.Success, KVPoll.Failed) for o in in_flight
            ),
            "fault_to_failed_ms_max": ms(max(failed_at, default=math.nan)),
            "fault_to_failed_ms_min": ms(min(failed_at, default=math.nan)),
            "detected_after_ms": ms(None if detected is None else detected - fault_at),
            "driver_lag_ms_max": ms(driver_lag),
            "judged_by_the_scheduler": untold,
            "evicted_after_ms": ms(None if evicted_at is None else evicted_at - fault_at),
            "opened_after": len(after),
            "opened_after_failed": sum(o.status is KVPoll.Failed for o in after),
            "opened_after_ms_max": ms(max(after_lat, default=math.nan)),
            "opened_after_eviction": len(after_evicted_lat),
            "opened_after_eviction_ms_max": ms(max(after_evicted_lat, default=math.nan)),
            "errors": _error_counts(window),
            "old_process_gone_after_ms": ms(None if dead_at is None else dead_at - fault_at),
            "repair_ms": ms(repaired_at - window_end),
            "recovery_rooms": len(recovery),
            "recovery_failed": sum(o.status is KVPoll.Failed for o in recovery),
            "first_success_after_repair_ms": ms(
                None if first_ok is None else first_ok - repaired_at
            ),
            "recovered": streak_ok,
        }


def _error_counts(outcomes: Sequence[RoomOutcome]) -> dict[str, JSONValue]:
    counts: dict[str, int] = {}
    for o in outcomes:
        if o.status is KVPoll.Failed:
            key = o.error or "none"
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def _partition_behaviour(phases: Sequence[dict[str, JSONValue]]) -> str | None:
    """One line: what NIXL/UCX did with the canary write posted into the partition."""
    for ph in phases:
        c = ph.get("canary")
        if ph.get("kind") != "partition" or not isinstance(c, dict):
            continue
        if "post" in c:
            return f"posting into the partition raised {c['post']}"
        landed = c.get("landed_after_repair_ms")
        return (
            f"a write posted into the partition: no error from NIXL/UCX; {c.get('outcome')} "
            f"(our deadline) after {c.get('outcome_after_ms')} ms, still in progress in NIXL "
            f"after it: {c.get('in_progress_after_deadline')}; after the heal NIXL reported it "
            f"done {c.get('settled_after_repair_ms')} ms later and its bytes "
            + (f"landed {landed} ms after the heal" if landed is not None else "did not land")
        )
    return None


def child_main(argv: Sequence[str]) -> int:
    """Entry point of the sender child (started by :func:`run_two_hosts`)."""
    ap = argparse.ArgumentParser(prog="two-hosts child")
    ap.add_argument("--link", required=True)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--stacks", help="on SIGUSR1, write every thread's stack to this file")
    args = ap.parse_args(list(argv))
    if args.stacks:
        stacks = open(args.stacks, "w", encoding="utf-8")  # noqa: SIM115 (kept to the exit)

        def dump_stacks(signum: int, frame: object) -> None:
            # A Python-level handler: the main thread runs it between bytecodes, holding the
            # GIL, so no other thread changes its frames while they are read. faulthandler's
            # own handler (faulthandler.register) reads them from the signal, unguarded, and
            # crashed this process now and then (SIGSEGV) while workers ran Python code.
            faulthandler.dump_traceback(stacks, all_threads=True)
            stacks.flush()

        signal.signal(signal.SIGUSR1, dump_stacks)
    link = TwoHostLink.from_json(args.link)
    plan = Plan.from_json(args.plan)
    if plan.plant_bug is not None and plan.plant_bug not in PLANTED_BUGS:
        ap.error(f"unknown planted bug {plan.plant_bug!r}")
    child = _Child(link, plan)
    result = child.run()
    # Never ended: this process exits. The parent keeps the step (the last progress line
    # names it) while it reads the result, waits for the exit (CHILD_EXIT_TIMEOUT_S: the
    # interpreter's shutdown drops NIXL agents) and tears the topology down.
    child.monitor.begin_step(
        "the result, the exit and the teardown", CHILD_EXIT_TIMEOUT_S + child.monitor.watchdog_s
    )
    sys.stdout.write(child._progress_line() + "\n")
    sys.stdout.write(_RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


register(TwoHosts())

__all__ = [
    "INVARIANTS",
    "KINDS",
    "NetnsRig",
    "Plan",
    "TwoHosts",
    "child_main",
    "relay_violations",
    "run_two_hosts",
    "summary",
]
