"""Making a transport's NIXL agent: the UCX backend creation that failed under load, and the
confinement of the harness's agents to the network devices they should use.

The cause (reproduced, see ``sender.transport._make_agent`` and ``stress.ucx_env``): an
agent with ``UCX_NET_DEVICES`` unset uses every network device of its namespace, a veth of
another process's two-host run included — for its own self-connection and for its messages
to other agents. When that veth is torn down while the agent is made, creation fails with a
bare ``NIXL_ERR_BACKEND``; when it is torn down later, the agents' connection over it hangs.

Faults here are real: UCX really fails (its ``UCX_NET_DEVICES`` names a device that does not
exist for the attempts meant to fail), network interfaces really come and go (root only:
dummy interfaces, or veth pairs inside a namespace of our own).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sender import _nixl
from sender.errors import AgentSetupError
from stress import netns
from stress.ucx_env import LOOPBACK_DEVICES, confine_to_loopback, loopback_env
from tests.fixtures_nixl import requires_nixl

ROOT = Path(__file__).resolve().parents[2]
ABSENT_DEVICE = "nxsabsent0"  # no such interface: UCX finds no network device to use


def _root() -> None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and the ip command (network interfaces are made and removed)")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture
def agent_factory(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., list[str]]]:
    """``plan(*steps)``: the n-th backend-bearing binding agent ``NixlTransport`` makes
    (one per attempt) runs ``steps[n]``
    first (a callable; ``None``: nothing) — e.g. point ``UCX_NET_DEVICES`` at a device that
    does not exist, so that UCX really fails that attempt. Returns the log of attempts."""
    bindings = _nixl.require()
    real = bindings.nixlAgent
    made: list[str] = []
    steps: list[Callable[[], None] | None] = []

    def factory(name: str, config: Any) -> Any:
        if not config.useProgThread:  # the wrapper's own inert agent: never gets a backend
            return real(name, config)
        step = steps[len(made)] if len(made) < len(steps) else None
        made.append(name)
        if step is not None:
            step()
        return real(name, config)

    def plan(*what: Callable[[], None] | None) -> list[str]:
        made.clear()  # agents made before (e.g. by other fixtures) do not count
        steps[:] = list(what)
        return made

    monkeypatch.setattr(bindings, "nixlAgent", factory)
    yield plan


def _fail_next(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    return lambda: monkeypatch.setenv("UCX_NET_DEVICES", ABSENT_DEVICE)


def _heal(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    return lambda: monkeypatch.setenv("UCX_NET_DEVICES", LOOPBACK_DEVICES)


# --------------------------------------------------------------------------- the environment


def test_the_harness_confines_its_agents_to_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/conftest.py ran ``confine_to_loopback``: every agent of this process and of the
    peer processes it starts uses lo, unless the user named devices."""
    assert os.environ["UCX_NET_DEVICES"] == os.environ.get("UCX_NET_DEVICES") != ""
    monkeypatch.delenv("UCX_NET_DEVICES")
    assert loopback_env({})["UCX_NET_DEVICES"] == "lo"
    assert loopback_env({"UCX_NET_DEVICES": "eth1"})["UCX_NET_DEVICES"] == "eth1"
    assert "UCX_NET_DEVICES" not in os.environ  # loopback_env leaves the environment alone
    assert confine_to_loopback() == "lo" and os.environ["UCX_NET_DEVICES"] == "lo"
    monkeypatch.setenv("UCX_NET_DEVICES", "eth1")
    assert confine_to_loopback() == "eth1"  # the user's choice is kept
    for entry in ("stress/__main__.py", "bench/__main__.py"):
        text = (ROOT / entry).read_text()
        assert text.index("confine_to_loopback()") < text.index("main()"), entry


# --------------------------------------------------------------------------- retry and cause


@requires_nixl
@pytest.mark.nixl
@pytest.mark.timeout(60)
def test_a_failed_backend_creation_is_retried_and_the_agent_works(
    decode_peer: Any,
    agent_factory: Callable[..., list[str]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Attempt 1 really fails in UCX (no usable network device), attempt 2 runs with lo:
    the transport is made, logs the failed attempt, and moves real bytes."""
    import torch

    from sender.transport import NixlTransport

    made = agent_factory(_fail_next(monkeypatch), _heal(monkeypatch))
    caplog.set_level(logging.WARNING, logger="sender.transport")
    with NixlTransport("retried") as tr:
        assert len(made) == 2
        pool = torch.arange(8 * 4096, dtype=torch.int64).to(torch.uint8).reshape(8, 4096)
        tr.register_region("kv", pool, 4096)
        tr.add_peer("d", decode_peer.metadata())
        xfer = tr.write_pages("d", [1, 5], [2, 3])
        xfer.wait(10)
        xfer.release()
        assert decode_peer.read_pages([2, 3]) == bytes(pool[[1, 5]].numpy().tobytes())
    warned = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(warned) == 1 and "attempt 1: NIXL_ERR_BACKEND" in warned[0], warned


@requires_nixl
@pytest.mark.nixl
@pytest.mark.timeout(60)
def test_a_persistent_backend_failure_names_its_cause(
    agent_factory: Callable[..., list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing changes between attempts: one blind retry, then AgentSetupError naming the
    attempts, the UCX environment and what to check — never a bare nixlBackendError."""
    from sender.transport import NixlTransport

    made = agent_factory()
    monkeypatch.setenv("UCX_NET_DEVICES", ABSENT_DEVICE)
    with pytest.raises(AgentSetupError) as info:
        NixlTransport("doomed")
    exc = info.value
    assert len(made) == 2 and len(exc.attempts) == 2 and not exc.interfaces_changed
    assert isinstance(exc, RuntimeError)
    assert isinstance(exc.__cause__, _nixl.require().nixlBackendError)
    text = str(exc)
    for part in (
        "attempt 1: NIXL_ERR_BACKEND, no network interface appeared or vanished",
        "attempt 2: NIXL_ERR_BACKEND",
        "not the transient one",
        f"UCX_NET_DEVICES={ABSENT_DEVICE!r}",
        "UCX prints its own reason on this process's stderr",
    ):
        assert part in text, (part, text)


def _changes_named(note: str) -> set[str]:
    """The ``+name``/``-name`` tokens of an attempt's note (empty when it names none)."""
    head = "network interfaces changed meanwhile: "
    if head not in note:
        return set()
    return set(note.split(head, 1)[1].split())


@requires_nixl
@pytest.mark.nixl
@pytest.mark.timeout(60)
def test_interfaces_changing_during_creation_are_named_and_retried_to_the_bound(
    agent_factory: Callable[..., list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each attempt really fails and a network interface really appears or vanishes during
    it (a veth pair, down and without addresses, so no agent can use it): that is the
    transient cause, retried up to AGENT_ATTEMPTS, and the error names the interfaces."""
    _root()
    from sender.transport import AGENT_ATTEMPTS

    name = f"nxsat{os.getpid() % 100000}"
    flips = [0]

    # Someone else's interface changes at the same time, one that sorts before ours (as a
    # two-hosts run's veths did beside this test: 'nxs5808h19' < 'nxsat...').
    other = f"nxs0{os.getpid() % 100000}"

    def flip() -> None:
        monkeypatch.setenv("UCX_NET_DEVICES", ABSENT_DEVICE)
        if flips[0] % 2 == 0:
            _ip("link", "add", name, "type", "veth", "peer", "name", f"{name}p")
            if flips[0] == 0:
                _ip("link", "add", other, "type", "veth", "peer", "name", f"{other}p")
        else:
            _ip("link", "del", name)
            if flips[0] == 1:
                _ip("link", "del", other)
        flips[0] += 1

    made = agent_factory(*([flip] * AGENT_ATTEMPTS))
    try:
        from sender.transport import NixlTransport

        with pytest.raises(AgentSetupError) as info:
            NixlTransport("churned")
    finally:
        for left in (name, other):
            subprocess.run(["ip", "link", "del", left], capture_output=True, check=False)
    exc = info.value
    assert len(made) == AGENT_ATTEMPTS == len(exc.attempts) and exc.interfaces_changed
    # Other interfaces may come and go meanwhile on a shared machine (a two-hosts run beside
    # this test makes and deletes its veths): ours must be among the changes named.
    assert {f"+{name}", f"+{name}p"} <= _changes_named(exc.attempts[0]), exc.attempts[0]
    assert {f"-{name}", f"-{name}p"} <= _changes_named(exc.attempts[1]), exc.attempts[1]
    assert "vanished while the agent was made" in str(exc)


# --------------------------------------------------------------------------- confinement

_PROBE = r"""
import socket, sys
from sender.transport import NixlTransport, decode_metadata
if sys.argv[1] == "confine":
    from stress.ucx_env import confine_to_loopback
    confine_to_loopback()
with NixlTransport() as tr:
    blob = decode_metadata(tr.metadata()).agent_blob
print("PUBLISHED", " ".join(a for a in sys.argv[2:] if socket.inet_aton(a) in blob))
"""


def _in_netns(link: netns.TwoHostLink | None, *args: str, env: dict[str, str]) -> str:
    """Run ``python -c ARGS`` inside ``link``'s namespace (``None``: this one)."""
    prefix = [] if link is None else link.exec_prefix()
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", *args],
        env={**env, "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "WARN"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _published(out: str) -> list[str]:
    line = next(x for x in out.splitlines() if x.startswith("PUBLISHED"))
    return line.split()[1:]


@pytest.mark.slow
@requires_nixl
@pytest.mark.nixl
@pytest.mark.timeout(120)
def test_a_confined_agent_publishes_no_address_but_loopback() -> None:
    """In a namespace that has a veth (a two-host topology's peer end), an agent made after
    ``confine_to_loopback`` publishes none of the veth's address in its UCX worker address;
    the same agent unconfined does (so the check sees a leak: it can fail)."""
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no network namespace here: {reason}")
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    with netns.two_host_link() as link:
        confined = _in_netns(link, _PROBE, "confine", link.peer_addr, env=env)
        unconfined = _in_netns(link, _PROBE, "plain", link.peer_addr, env=env)
    assert _published(confined) == [], confined
    assert _published(unconfined) == [link.peer_addr], unconfined


@pytest.mark.slow
@requires_nixl
@pytest.mark.nixl
@pytest.mark.timeout(120)
def test_a_two_host_sender_publishes_its_own_veth_only() -> None:
    """With two topologies up (two two-host runs side by side), a sender agent made with
    its link's environment publishes its own veth's address and not the other's; an
    unconfined agent publishes both (the interference of two runs, seen here)."""
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no network namespace here: {reason}")
    with netns.two_host_link() as mine, netns.two_host_link() as other:
        addrs = (mine.host_addr, other.host_addr)
        confined = _in_netns(None, _PROBE, "plain", *addrs, env=netns.child_env(mine))
        plain = {k: v for k, v in netns.child_env(mine).items() if k != "UCX_NET_DEVICES"}
        unconfined = _in_netns(None, _PROBE, "plain", *addrs, env=plain)
    assert _published(confined) == [mine.host_addr], confined
    assert _published(unconfined) == list(addrs), unconfined


_CREATOR = r"""
import logging, sys
from sender.errors import AgentSetupError
from sender.transport import NixlTransport
retries = []
class Count(logging.Handler):
    def emit(self, record):
        retries.append(record.getMessage())
logging.getLogger("sender.transport").addHandler(Count(logging.WARNING))
ok = named = bare = 0
for _ in range(int(sys.argv[1])):
    try:
        NixlTransport().close()
        ok += 1
    except AgentSetupError as exc:
        named += 1
        print("NAMED", exc, flush=True)
    except Exception as exc:
        bare += 1
        print("BARE", type(exc).__name__, exc, flush=True)
for text in retries:
    print("RETRIED", text, flush=True)
print("COUNTS", ok, named, bare, flush=True)
"""


def _churn(link: netns.TwoHostLink, stop: threading.Event, counter: list[int]) -> None:
    """Veth pairs made, addressed, brought up and deleted inside the link's namespace."""
    ns = link.netns
    i = 0
    while not stop.is_set():
        a, b = f"ca{i % 3}", f"cb{i % 3}"
        net = f"10.216.{i % 3}"
        for args in (
            ("link", "add", a, "type", "veth", "peer", "name", b),
            ("addr", "add", f"{net}.1/30", "dev", a),
            ("addr", "add", f"{net}.2/30", "dev", b),
            ("link", "set", a, "up"),
            ("link", "set", b, "up"),
        ):
            subprocess.run(["ip", "-n", ns, *args], capture_output=True, check=False, timeout=20)
        stop.wait(0.05)
        subprocess.run(
            ["ip", "-n", ns, "link", "del", a], capture_output=True, check=False, timeout=20
        )
        counter[0] += 1
        i += 1


@requires_nixl
@pytest.mark.nixl
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_agent_creation_beside_interface_churn_under_load() -> None:
    """Processes make agents (bounded: CREATIONS each) in a namespace whose veth pairs come
    and go every ~50 ms, beside CPU-bound processes. Confined agents (the harness's way)
    never fail; unconfined ones either succeed (retried) or fail with AgentSetupError
    naming the cause — never a bare error. Counts are printed (not asserted: how often the
    churn hits the window is chance)."""
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no network namespace here: {reason}")
    creations = 12
    base = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)
    ]
    stop = threading.Event()
    churned = [0]
    try:
        with netns.two_host_link() as link:
            churn = threading.Thread(target=_churn, args=(link, stop, churned), daemon=True)
            churn.start()
            procs = {
                kind: subprocess.Popen(
                    [*link.exec_prefix(), sys.executable, "-c", _CREATOR, str(creations)],
                    env={**(loopback_env(base) if kind == "confined" else base),
                         "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "WARN"},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
                for kind in ("confined", "unconfined")
            }  # fmt: skip
            outs = {kind: p.communicate(timeout=200)[0] for kind, p in procs.items()}
            stop.set()
            churn.join(30)
            assert not churn.is_alive()
    finally:
        stop.set()
        for h in hogs:
            h.kill()
            h.wait(10)
    counts = {}
    for kind, out in outs.items():
        line = next(x for x in out.splitlines() if x.startswith("COUNTS"))
        counts[kind] = tuple(int(v) for v in line.split()[1:])
        print(kind, "ok/named/bare:", counts[kind], "churn cycles:", churned[0])
        for x in out.splitlines():
            if x.startswith(("NAMED", "BARE", "RETRIED")):
                print("  ", x[:300])
    assert churned[0] > 0
    assert counts["confined"] == (creations, 0, 0), outs["confined"]
    ok, named, bare = counts["unconfined"]
    assert bare == 0 and ok + named == creations, outs["unconfined"]
    assert all("network interfaces changed" in x or "NIXL_ERR_BACKEND" in x
               for x in outs["unconfined"].splitlines() if x.startswith("NAMED"))  # fmt: skip


def test_net_interfaces_are_seen() -> None:
    """The change detector reads real interfaces (lo at least)."""
    from sender.transport import _interface_change, _net_interfaces

    now = _net_interfaces()
    assert any(name == "lo" for _, name in now) or not hasattr(socket, "if_nameindex")
    assert _interface_change(now, now) == ""
    earlier = frozenset({(10_000_001, "x0")}) | now
    assert _interface_change(earlier, now) == "-x0"
    assert _interface_change(now, earlier) == "+x0"
