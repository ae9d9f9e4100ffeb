"""Two hosts on one machine: the harness (``stress.netns``), the decode peer behind a shaped
veth link in its own network namespace, and the faults over that link.

Needs root, ``ip`` and ``tc`` (CI has them): where a namespace cannot be made, every test
that needs one SKIPS with the reason (``stress.netns.unavailable_reason``); none passes
without having run. The fault run is one child
process (``stress.scenarios.two_hosts.run_two_hosts``, quick plan: stop, partition, evict,
kill, restart at 1 Gbit/s), shared by the tests below through a module fixture; its seed is
printed (``TWO_HOSTS_SEED=N`` replays the room plans).
"""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from stress import netns
from stress.netns import TwoHostLink, cleanup_stale, two_host_link
from tests.fixtures_nixl import requires_nixl

pytestmark = pytest.mark.timeout(60)


def _need_netns() -> None:
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"two-host topology not available here: {reason}")


def _sh(*args: str) -> str:
    return subprocess.run(list(args), capture_output=True, text=True, check=False).stdout


def _gone(link: TwoHostLink) -> list[str]:
    """What of ``link`` is still there (empty when all of it went)."""
    left = []
    if link.netns in _sh("ip", "netns", "list"):
        left.append(link.netns)
    if os.path.exists(f"/sys/class/net/{link.host_if}"):
        left.append(link.host_if)
    if link.subnet in _sh("ip", "-4", "route", "show", "proto", str(netns.GUARD_PROTO)):
        left.append(f"guard {link.subnet}")
    return left


@pytest.fixture
def link() -> Iterator[TwoHostLink]:
    _need_netns()
    with two_host_link() as made:
        yield made
    assert not _gone(made)


# --------------------------------------------------------------------------- the harness


def test_link_is_unique_addressed_shaped_cut_healed_and_torn_down(link: TwoHostLink) -> None:
    other = TwoHostLink.create()
    try:
        assert len({link.netns, other.netns}) == 2
        assert len({link.host_if, other.host_if, link.peer_if, other.peer_if}) == 4
        a, b = ipaddress.IPv4Network(link.subnet), ipaddress.IPv4Network(other.subnet)
        assert not a.overlaps(b) and a.subnet_of(netns.SUBNET_POOL)
        # The peer's address lives in its namespace only; the peer has no other route.
        assert link.peer_addr in _sh("ip", "-n", link.netns, "-4", "addr", "show", link.peer_if)
        assert link.peer_addr not in _sh("ip", "-4", "addr", "show")
        routes = _sh("ip", "-n", link.netns, "-4", "route", "show")
        assert "default" not in routes and link.subnet in routes
        assert f"dev {link.host_if}" in _sh("ip", "route", "get", link.peer_addr)
        link.shape(200_000_000)
        assert "rate 200Mbit" in _sh("tc", "qdisc", "show", "dev", link.host_if)
        assert link.qdisc_sent_bytes() == 0
        link.unshape()
        assert link.qdisc_sent_bytes() is None
        link.partition()
        assert _sh("cat", f"/sys/class/net/{link.host_if}/operstate").strip() != "up"
        # Cut, the host still routes the peer into the veth (dropped there), never elsewhere.
        assert f"dev {link.host_if}" in _sh("ip", "route", "get", link.peer_addr)
        link.heal()
        assert _sh("cat", f"/sys/class/net/{link.host_if}/carrier").strip() == "1"
        assert other.close() == [] and other.close() == []
        assert not _gone(other)
    finally:
        other.close()


def test_guard_route_keeps_peer_traffic_off_the_default_route(link: TwoHostLink) -> None:
    """With the host's end down its connected route goes; without the guard the peer's
    address would follow the default route out of the machine (seen before the guard)."""
    subprocess.run(["ip", "link", "set", link.host_if, "down"], check=True)
    try:
        got = subprocess.run(
            ["ip", "route", "get", link.peer_addr], capture_output=True, text=True, check=False
        )
        assert got.returncode != 0 or "blackhole" in got.stdout, got.stdout
        assert " via " not in got.stdout
    finally:
        subprocess.run(["ip", "link", "set", link.host_if, "up"], check=True)


def test_link_is_torn_down_when_the_body_raises() -> None:
    _need_netns()
    seen: list[TwoHostLink] = []
    with pytest.raises(RuntimeError, match="boom"), two_host_link(100_000_000) as made:
        seen.append(made)
        made.partition()
        raise RuntimeError("boom")
    assert seen and not _gone(seen[0])


def test_cleanup_stale_removes_only_dead_owners_topologies() -> None:
    _need_netns()
    made = TwoHostLink.create()
    try:
        me = os.getpid()
        assert not any(made.netns in r for r in cleanup_stale({me: True}))  # alive: kept
        assert _gone(made)  # still there
        removed = cleanup_stale({me: False})  # pretend we died without tearing down
        # (Deleting the namespace deletes its veth end, and the pair with it.)
        assert f"netns {made.netns}" in removed and f"guard route {made.subnet}" in removed
        assert not _gone(made)
    finally:
        assert made.close() == []  # idempotent after an outside removal


def test_unavailable_reason_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    reason = netns._probe()
    assert reason is not None and "root" in reason
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "tc" else "/x")
    reason = netns._probe()
    assert reason is not None and "'tc'" in reason


def test_link_json_round_trip_does_not_own() -> None:
    made = TwoHostLink(
        "nxstg2h-1-1", "nxs1h1", "nxs1p1", "10.213.0.1", "10.213.0.2", "10.213.0.0/30"
    )
    copy = TwoHostLink.from_json(made.to_json())
    assert (copy.netns, copy.peer_addr, copy.owner) == (made.netns, made.peer_addr, False)
    assert copy.close() == []  # not the owner: removes nothing, runs no command
    with pytest.raises(ValueError):
        TwoHostLink.from_json(
            '{"netns": "prod", "host_if": "a", "peer_if": "b", '
            '"host_addr": "1", "peer_addr": "2", "subnet": "3"}'
        )


# --------------------------------------------------------------------------- the peer


def test_peer_cli_listens_elsewhere_only_with_allow_host(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from stress.harness.peer import main

    for args, match in [
        (("--listen", "10.213.0.2:0"), "only 127.0.0.1"),
        (("--listen", "10.213.0.2:0", "--allow-host", "10.213.0.9"), "only 127.0.0.1"),
        (("--listen", "10.213.0.2:0", "--allow-host", "nope"), "not an IPv4 address"),
    ]:
        with pytest.raises(SystemExit) as info:
            main(["--pages", "4", "--page-bytes", "4096", *args])
        err = capsys.readouterr().err
        assert info.value.code == 2 and match in err and "Traceback" not in err, err


def test_peer_process_refuses_unreachable_addresses() -> None:
    from stress.harness.peer import PeerError, PeerProcess

    with pytest.raises(PeerError, match="cannot be reached"):
        PeerProcess(4, 4096, netns="nxstg2h-1-1")  # 127.0.0.1 is the namespace's own
    with pytest.raises(PeerError, match="IPv4"):
        PeerProcess(4, 4096, host="localhost")


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(90)
def test_peer_in_namespace_serves_over_the_link(link: TwoHostLink) -> None:
    """A peer process inside the namespace, reached on its address; the child is our own
    child (signals reach it) and its control channel crosses the veth."""
    from stress.harness.peer import PeerProcess

    before = link.counters()
    with PeerProcess(8, 4096, netns=link.netns, host=link.peer_addr, env=link.peer_env()) as p:
        assert p.ping(5.0)
        with open(f"/proc/{p.pid}/comm", encoding="ascii") as f:
            assert f.read().strip().startswith("python")
        assert p.pid in link.pids_inside()
        assert len(p.metadata) > 100
        assert p.page_digest([0]) == p.page_digest([1])  # zeroed pool
    assert link.counters().minus(before).tx_bytes > len(p.metadata) // 4
    assert link.pids_inside() == []


# --------------------------------------------------------------------------- faults


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    """One quick run of every fault over the link (~15-25 s)."""
    _need_netns()
    from stress.scenarios.two_hosts import Plan, run_two_hosts

    seed = int(os.environ.get("TWO_HOSTS_SEED", random.randrange(1 << 16)))
    print(f"two-hosts seed: {seed}")
    steps: list[tuple[str | None, float | None, float]] = []
    dumps: list[Callable[[], None]] = []

    def progress(rooms: int, ops: int, faults: int) -> None:
        if rooms and len(dumps) == 1:  # once, mid-run: as a stall of the parent would
            dumps.pop()()

    result = run_two_hosts(
        Plan.quick(seed=seed),
        timeout_s=240,
        on_step=lambda what, deadline: steps.append((what, deadline, time.monotonic())),
        on_progress=progress,
        on_child=dumps.append,
    )
    assert "skipped" not in result, result
    result["steps_seen"] = steps
    return result


def _phase(run: dict[str, Any], kind: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [p for p in run["phases"] if p["kind"] == kind]
    assert len(found) == 1, [p["kind"] for p in run["phases"]]
    return found[0]


def _violations(run: dict[str, Any]) -> dict[str, list[str]]:
    return {i["name"]: i["examples"] for i in run["invariants"] if i["violations"]}


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(300)
def test_faults_run_cleanly_over_the_link(run: dict[str, Any]) -> None:
    assert not run.get("error"), run.get("error")
    assert not _violations(run), (_violations(run), run.get("stderr_tail", "")[-2000:])
    base = _phase(run, "baseline")
    assert base["verified"] == base["rooms"] > 0
    # The room bytes crossed the veth and its tbf qdisc: nothing went by another way.
    assert base["veth_tx_bytes"] >= base["payload_bytes"] > 0
    assert base["qdisc_sent_bytes"] >= base["payload_bytes"]
    assert not any(run["link"]["netns"] in line for line in _sh("ip", "netns").splitlines())


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["stop", "partition", "evict", "kill", "restart"])
def test_fault_figures(run: dict[str, Any], kind: str) -> None:
    ph = _phase(run, kind)
    # The fault struck while chunks were posted; every room in flight then concluded within
    # failed together (at most one per worker of its own chunk, the rest with the session:
    # no clock; the latency and its goal are figures, measured on a quiet machine by
    # `python -m bench fail-fast`). A graceful restart may let them finish.
    assert ph["transfers_in_flight_at_fault"] and ph["in_flight"] >= 1, ph
    if kind != "restart":  # the fault took effect: a room failed of it, in flight or after
        assert ph["in_flight_failed"] + ph["opened_after_failed"] >= 1, ph
    assert ph["in_flight_own_failures"] <= ph["own_failures_allowed"], ph
    # Judged by the sender's clock: the manager told the rig of every room's conclusion.
    assert ph["judged_by_the_scheduler"] == 0, ph
    # Rooms opened after the fault failed (once evicted, every one); none succeeded while a
    # hung peer or a cut link was on.
    if kind == "evict":
        assert ph["opened_after_eviction"] >= 1, ph
    if kind in ("stop", "partition"):
        assert ph["opened_after_failed"] == ph["opened_after"]
        # NIXL kept the hung writes; the manager kept their slots, never more.
        held = ph["held_while_fault_on"]
        assert held["slots_held"] <= held["transfers_held"]
    # Nothing leaked, nothing corrupted, no page reused while its room drained; then new
    # rooms succeeded over the same transport.
    assert (ph["leaks"], ph["corruption"], ph["verify_failures"], ph["early_reuse"]) == (
        0,
        0,
        0,
        0,
    ), ph
    assert ph["recovered"] and ph["first_success_after_repair_ms"] is not None, ph


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(300)
def test_the_end_of_the_child_is_declared_to_the_watchdog(run: dict[str, Any]) -> None:
    """No room completes while the child closes its rig, joins its threads, reports and
    exits, and the parent waits for that exit and tears the topology down: each of these is
    a long step the parent's watchdog sees, the last one bounded by the exit's own wait (a
    run at load 11 was reported stuck there, 'no progress for 10 s', with every phase
    passed)."""
    from stress.scenarios.two_hosts import CHILD_EXIT_TIMEOUT_S

    # The parent learns the child's steps from its progress lines (every 0.5 s), so a quick
    # close is not seen; the last step, named in the child's final line, always is.
    steps = run["steps_seen"]
    what, deadline, seen_at = steps[-1]
    assert what == "the result, the exit and the teardown", steps[-3:]
    assert deadline is not None and deadline - seen_at >= CHILD_EXIT_TIMEOUT_S, steps[-1]


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(300)
def test_a_stall_gets_the_childs_stacks(run: dict[str, Any]) -> None:
    """The parent's watchdog sees only the parent's threads; the function ``on_child`` gives
    (a stall hook) makes the sender child write its own stacks, and they come back."""
    stacks = run.get("child_stacks", "")
    assert "child_main" in stacks and "Thread 0x" in stacks, stacks[-2000:]


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(300)
def test_what_ucx_does_on_a_partition(run: dict[str, Any]) -> None:
    """Pinned (NIXL 1.5.1, UCX over TCP): a write posted into a partition gets no error; only
    our deadline ends it, NIXL still has it in progress then, and after the heal NIXL
    completes it and its bytes land."""
    canary = _phase(run, "partition")["canary"]
    assert canary["outcome"] == "TransferTimeoutError", canary
    assert canary["in_progress_after_deadline"] is True, canary
    assert canary["settled_after_repair_ms"] is not None, canary
    assert canary["landed_after_repair_ms"] is not None, canary
    assert "no error from NIXL/UCX" in run["partition_behaviour"]


@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(120)
def test_bench_two_hosts_tiny() -> None:
    _need_netns()
    from bench import two_hosts as bench

    result = bench.measure(bench.Preset(rates_bit=(500_000_000,), sizes=(1 << 20,), rounds=2))
    assert result.status == "ok", result.notes
    (row,) = result.rows
    assert row["link"] == "500 Mbit/s" and row["link GB/s"] == 0.0625
    share = row["of link"]
    assert isinstance(share, float) and 0.2 < share < 1.3, row  # shaped: not the raw veth
    wire = row["wire/payload"]
    assert isinstance(wire, float) and wire >= 1.0, row  # the bytes crossed the veth
    assert result.goals and result.goals[0].met is None  # 1 Gbit/s not measured here
    assert result.render()
