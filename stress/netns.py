"""A two-host test topology on one machine: a network namespace joined by a veth pair.

The prefill sender stays in this process's namespace ("host"); a decode peer runs inside a
namespace of its own ("peer"), reachable only over a veth pair whose two ends carry the two
addresses of a private ``/30`` taken from ``10.213.0.0/16``. With UCX restricted to TCP on
both sides (:meth:`TwoHostLink.sender_env`, :meth:`TwoHostLink.peer_env`) every byte crosses
the link, which the harness can shape (``tc ... tbf``; ``netem`` is not available on these
kernels), cut (:meth:`TwoHostLink.partition`: the peer's end goes down, packets in flight
are silently dropped) and restore (:meth:`TwoHostLink.heal`).

Traffic never leaves the link: the peer's namespace has no route but the ``/30``, and the
host side gets a *guard* route, ``blackhole <subnet>/30``, so that while the host's end has
no connected route (it is down, or being set up) packets for the peer are dropped here
instead of following the default route out of the machine. (Measured before the guard: with
the host's end down, the sender's retransmissions went to the default gateway.)

Every name carries the creating process's pid (namespace ``nxstg2h-<pid>-<n>``, interfaces
``nxs<pid hex>h<n>`` / ``...p<n>``, guard routes with ``proto 213``), so that
:func:`cleanup_stale` removes what a dead process left behind without touching a live run's
topology. :meth:`TwoHostLink.close` always removes everything it made; use the context
manager :func:`two_host_link`.

Creating a namespace needs root (``CAP_NET_ADMIN`` and ``CAP_SYS_ADMIN``) and the ``ip`` and
``tc`` commands. :func:`unavailable_reason` says why a topology cannot be made here (tests
skip with that reason; they never pass without it).

Thread-safety: a :class:`TwoHostLink` is used from one thread at a time; the module
functions are safe from any thread (they run ``ip``/``tc`` commands and take a file lock
while choosing a subnet).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any

__all__ = [
    "GUARD_METRIC",
    "child_env",
    "GUARD_PROTO",
    "NETNS_PREFIX",
    "SUBNET_POOL",
    "LinkCounters",
    "NetnsError",
    "TwoHostLink",
    "cleanup_stale",
    "unavailable_reason",
    "two_host_link",
]

NETNS_PREFIX = "nxstg2h"
"""Namespace names are ``f"{NETNS_PREFIX}-{pid}-{n}"``."""
_IF_PREFIX = "nxs"
SUBNET_POOL = ipaddress.IPv4Network("10.213.0.0/16")
"""Where the per-link ``/30`` subnets come from (private; only ever assigned inside our
namespaces and to our own veth ends)."""
GUARD_PROTO = 213
"""``proto`` of our guard routes (how :func:`cleanup_stale` finds them)."""
GUARD_METRIC = 4242
_NS_RE = re.compile(rf"^{NETNS_PREFIX}-(\d+)-(\d+)$")
_IF_RE = re.compile(rf"^{_IF_PREFIX}([0-9a-f]{{1,7}})([hp])(\d{{1,4}})$")
_CMD_TIMEOUT_S = 20.0
_LOCK_NAME = f"{NETNS_PREFIX}.lock"

_seq_lock = threading.Lock()
_seq = 0
_reason_lock = threading.Lock()
_reason_cache: dict[int, str | None] = {}  # pid -> reason (a forked child probes again)


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed (the message has the command and its stderr)."""


def _run(args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(
            list(args),
            capture_output=True,
            text=True,
            timeout=_CMD_TIMEOUT_S,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(args)}: {exc}") from exc
    if check and proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip()
        raise NetnsError(f"{' '.join(args)}: exit {proc.returncode}: {err}")
    return proc


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _next_seq() -> int:
    global _seq
    with _seq_lock:
        _seq += 1
        return _seq


# --------------------------------------------------------------------------- availability


def unavailable_reason() -> str | None:
    """Why a two-host topology cannot be made here, or ``None`` when it can.

    Checks, in order: root (``os.geteuid() == 0``), the ``ip`` and ``tc`` commands, then
    really builds and removes a probe topology (namespace, veth pair, addresses, a ``tbf``
    qdisc). The answer is cached per process.

    Thread-safety: safe from any thread.
    """
    pid = os.getpid()
    with _reason_lock:
        if pid in _reason_cache:
            return _reason_cache[pid]
        reason = _probe()
        _reason_cache[pid] = reason
        return reason


def _probe() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        euid = os.geteuid() if hasattr(os, "geteuid") else "?"
        return f"network namespaces need root (euid is {euid})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command (iproute2) is not installed"
    try:
        cleanup_stale()
        link = TwoHostLink.create()
    except (NetnsError, OSError) as exc:
        return f"cannot create a network namespace with a veth pair here: {exc}"
    try:
        _run(["ip", "netns", "exec", link.netns, "true"])
        link.shape(100_000_000)
    except NetnsError as exc:
        return f"cannot run in a namespace or shape a veth with tc tbf here: {exc}"
    finally:
        link.close()
    return None


# --------------------------------------------------------------------------- the link


@dataclass(frozen=True)
class LinkCounters:
    """Byte and packet counters of the host's end of the link (``/sys/class/net``)."""

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int
    tx_dropped: int

    def minus(self, earlier: LinkCounters) -> LinkCounters:
        """The counters' growth since ``earlier``."""
        return LinkCounters(
            self.tx_bytes - earlier.tx_bytes,
            self.rx_bytes - earlier.rx_bytes,
            self.tx_packets - earlier.tx_packets,
            self.rx_packets - earlier.rx_packets,
            self.tx_dropped - earlier.tx_dropped,
        )


@dataclass
class TwoHostLink:
    """One namespace, one veth pair, two addresses, one guard route.

    Make one with :meth:`create` (or :func:`two_host_link`); a child process that should use
    (not own) a link made by its parent rebuilds it with :meth:`from_json` (``owner`` False:
    its ``close`` removes nothing).

    Attributes:
        netns: The peer's namespace.
        host_if: The veth end in this process's namespace (address ``host_addr``).
        peer_if: The veth end inside ``netns`` (address ``peer_addr``).
        subnet: The ``/30`` of the two addresses.
        owner: Whether :meth:`close` tears the topology down.
    """

    netns: str
    host_if: str
    peer_if: str
    host_addr: str
    peer_addr: str
    subnet: str
    owner: bool = True
    rate_bit: int | None = None
    partitioned: bool = False
    closed: bool = False

    # ------------------------------------------------------------------ creation

    @classmethod
    def create(cls) -> TwoHostLink:
        """Build a new topology with unique names and a free ``/30``.

        Partial work is undone when a step fails.

        Raises:
            NetnsError: A command failed (e.g. not permitted).
        """
        pid = os.getpid()
        seq = _next_seq()
        netns = f"{NETNS_PREFIX}-{pid}-{seq}"
        host_if = f"{_IF_PREFIX}{pid:x}h{seq}"
        peer_if = f"{_IF_PREFIX}{pid:x}p{seq}"
        with _subnet_lock():
            net = _free_subnet(pid, seq)
            host_addr, peer_addr = (str(a) for a in net.hosts())
            link = cls(netns, host_if, peer_if, host_addr, peer_addr, str(net))
            try:
                link._build()
            except BaseException:
                link.close()
                raise
        return link

    def _build(self) -> None:
        prefix = ipaddress.IPv4Network(self.subnet).prefixlen
        # Guard first: from now on nothing for the subnet can follow the default route.
        _run(
            [
                "ip",
                "route",
                "add",
                "blackhole",
                self.subnet,
                "metric",
                str(GUARD_METRIC),
                "proto",
                str(GUARD_PROTO),
            ]
        )
        _run(["ip", "netns", "add", self.netns])
        _run(["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.peer_if])
        _run(["ip", "link", "set", self.peer_if, "netns", self.netns])
        _disable_ipv6(self.host_if, None)
        _disable_ipv6(self.peer_if, self.netns)
        _run(["ip", "addr", "add", f"{self.host_addr}/{prefix}", "dev", self.host_if])
        _run(
            [
                "ip",
                "-n",
                self.netns,
                "addr",
                "add",
                f"{self.peer_addr}/{prefix}",
                "dev",
                self.peer_if,
            ]
        )
        _run(["ip", "-n", self.netns, "link", "set", "lo", "up"])
        _run(["ip", "-n", self.netns, "link", "set", self.peer_if, "up"])
        _run(["ip", "link", "set", self.host_if, "up"])
        self._wait_carrier(True, 5.0)

    # ------------------------------------------------------------------ (de)serialisation

    def to_json(self) -> str:
        """The link's names and addresses, for a child process (:meth:`from_json`)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TwoHostLink:
        """A handle on a link made by another process; it does not own it (``close`` is a
        no-op there).

        Raises:
            ValueError: Not a link description.
        """
        data: dict[str, Any] = json.loads(text)
        fields = {"netns", "host_if", "peer_if", "host_addr", "peer_addr", "subnet"}
        if not isinstance(data, dict) or not fields <= set(data):
            raise ValueError("not a TwoHostLink description")
        if not _NS_RE.match(str(data["netns"])):
            raise ValueError(f"not one of our namespaces: {data['netns']!r}")
        return cls(**{k: data[k] for k in fields}, owner=False, rate_bit=data.get("rate_bit"))

    # ------------------------------------------------------------------ environment

    def sender_env(self) -> dict[str, str]:
        """Environment for the sender's process: UCX over TCP on the host's veth end only.

        UCX reads it when NIXL creates its first agent, so it must be set before the
        process starts (a process cannot switch its own UCX transports afterwards).
        """
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.host_if}

    def peer_env(self) -> dict[str, str]:
        """Environment for the decode peer in the namespace: UCX over TCP on its veth end."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.peer_if}

    def exec_prefix(self) -> list[str]:
        """Command prefix that runs a program inside the peer's namespace."""
        return ["ip", "netns", "exec", self.netns]

    # ------------------------------------------------------------------ shaping

    def shape(self, rate_bit: int, *, latency_ms: float = 20.0) -> None:
        """Limit both directions of the link to ``rate_bit`` bits/s with a token bucket.

        The bucket holds about 1 ms at that rate (at least 128 KiB, two GSO packets), so a
        transfer of a few MiB is timed at the rate, not at the burst; the queue holds about
        ``latency_ms``.

        Raises:
            NetnsError: ``tc`` failed.
            ValueError: ``rate_bit`` < 1 Mbit/s.
        """
        if rate_bit < 1_000_000:
            raise ValueError(f"rate must be >= 1 Mbit/s, got {rate_bit}")
        burst = max(128 * 1024, rate_bit // 8 // 1000)
        args = [
            "root",
            "tbf",
            "rate",
            f"{rate_bit}bit",
            "burst",
            str(burst),
            "latency",
            f"{latency_ms:g}ms",
        ]
        _run(["tc", "qdisc", "replace", "dev", self.host_if, *args])
        _run(["tc", "-n", self.netns, "qdisc", "replace", "dev", self.peer_if, *args])
        self.rate_bit = rate_bit

    def unshape(self) -> None:
        """Remove the shaping (both directions). Idempotent.

        Raises:
            NetnsError: ``tc`` failed for another reason than "no qdisc".
        """
        for cmd in (
            ["tc", "qdisc", "del", "dev", self.host_if, "root"],
            ["tc", "-n", self.netns, "qdisc", "del", "dev", self.peer_if, "root"],
        ):
            proc = _run(cmd, check=False)
            err = proc.stderr.lower()
            if proc.returncode != 0 and "no such file" not in err and "cannot" not in err:
                raise NetnsError(f"{' '.join(cmd)}: {proc.stderr.strip()}")
        self.rate_bit = None

    def qdisc_sent_bytes(self) -> int | None:
        """Bytes the host end's root qdisc sent (``tc -s``), or ``None`` when unshaped.

        Raises:
            NetnsError: ``tc`` failed.
        """
        out = _run(["tc", "-s", "qdisc", "show", "dev", self.host_if]).stdout
        if "tbf" not in out:
            return None
        m = re.search(r"Sent (\d+) bytes", out)
        return int(m.group(1)) if m else None

    # ------------------------------------------------------------------ faults

    def partition(self) -> None:
        """Cut the link: the peer's end goes down. The host's end stays up (its route with
        it), so packets for the peer are still sent into the veth and silently dropped, like
        a switch that stopped forwarding. Nothing is refused locally.

        Raises:
            NetnsError: ``ip`` failed.
        """
        _run(["ip", "-n", self.netns, "link", "set", self.peer_if, "down"])
        self.partitioned = True
        self._wait_carrier(False, 5.0)

    def heal(self, timeout_s: float = 5.0) -> None:
        """Restore the link after :meth:`partition` and wait until it carries again.

        The neighbour (ARP) entries of both ends are flushed: address resolution failed
        during the partition, and a ``FAILED`` entry makes the first connection after the
        heal fail with "no route to host" (measured: 40 ms after the heal) until it is
        resolved again. TCP connections that were open resume by themselves (at their next
        retransmission).

        Raises:
            NetnsError: ``ip`` failed or the carrier did not come back in time.
        """
        _run(["ip", "-n", self.netns, "link", "set", self.peer_if, "up"])
        self.partitioned = False
        self._wait_carrier(True, timeout_s)
        _run(["ip", "neigh", "flush", "dev", self.host_if], check=False)
        _run(["ip", "-n", self.netns, "neigh", "flush", "dev", self.peer_if], check=False)

    def _wait_carrier(self, up: bool, timeout_s: float) -> None:
        path = f"/sys/class/net/{self.host_if}/carrier"
        end = time.monotonic() + timeout_s
        while True:
            try:
                with open(path, encoding="ascii") as f:
                    state = f.read().strip() == "1"
            except OSError:  # reading carrier of a down interface fails with EINVAL
                state = False
            if state == up:
                return
            if time.monotonic() >= end:
                raise NetnsError(
                    f"{self.host_if}: carrier not {'up' if up else 'down'} after {timeout_s:g} s"
                )
            time.sleep(0.005)

    # ------------------------------------------------------------------ observation

    def counters(self) -> LinkCounters:
        """The host end's interface counters (what really crossed the link).

        Raises:
            NetnsError: The interface is gone.
        """
        base = f"/sys/class/net/{self.host_if}/statistics"
        values: dict[str, int] = {}
        try:
            for name in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets", "tx_dropped"):
                with open(f"{base}/{name}", encoding="ascii") as f:
                    values[name] = int(f.read())
        except OSError as exc:
            raise NetnsError(f"cannot read counters of {self.host_if}: {exc}") from exc
        return LinkCounters(**values)

    def pids_inside(self) -> list[int]:
        """Processes running inside the peer's namespace.

        Raises:
            NetnsError: ``ip`` failed.
        """
        out = _run(["ip", "netns", "pids", self.netns], check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    # ------------------------------------------------------------------ teardown

    def close(self) -> list[str]:
        """Tear everything down (owner only): processes left inside the namespace are
        SIGKILLed (only our own children can be in it), then the namespace, the host's
        veth end and the guard route are removed. Idempotent; never raises.

        Returns:
            What could not be removed (empty when all went).
        """
        if self.closed or not self.owner:
            self.closed = True
            return []
        self.closed = True
        problems: list[str] = []
        if _netns_exists(self.netns):
            for pid in self.pids_inside():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            proc = _run(["ip", "netns", "del", self.netns], check=False)
            if proc.returncode != 0:
                problems.append(f"netns {self.netns}: {proc.stderr.strip()}")
        # Deleting the namespace deletes its veth end, and the pair with it (asynchronously).
        end = time.monotonic() + 2.0
        while os.path.exists(f"/sys/class/net/{self.host_if}") and time.monotonic() < end:
            time.sleep(0.01)
        if os.path.exists(f"/sys/class/net/{self.host_if}"):
            proc = _run(["ip", "link", "del", self.host_if], check=False)
            if proc.returncode != 0 and os.path.exists(f"/sys/class/net/{self.host_if}"):
                problems.append(f"link {self.host_if}: {proc.stderr.strip()}")
        proc = _run(
            [
                "ip",
                "route",
                "del",
                "blackhole",
                self.subnet,
                "metric",
                str(GUARD_METRIC),
                "proto",
                str(GUARD_PROTO),
            ],
            check=False,
        )
        if proc.returncode != 0 and _guard_routes().count(self.subnet):
            problems.append(f"guard route {self.subnet}: {proc.stderr.strip()}")
        return problems

    def __enter__(self) -> TwoHostLink:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@contextlib.contextmanager
def two_host_link(rate_bit: int | None = None) -> Iterator[TwoHostLink]:
    """A new :class:`TwoHostLink` (shaped to ``rate_bit`` when given), always torn down on
    exit, also when the body raises. Stale topologies of dead processes are removed first.

    Raises:
        NetnsError: The topology cannot be made (see :func:`unavailable_reason`).
    """
    cleanup_stale()
    link = TwoHostLink.create()
    try:
        if rate_bit is not None:
            link.shape(rate_bit)
        yield link
    finally:
        link.close()


def child_env(link: TwoHostLink, *, path: Sequence[str] = ()) -> dict[str, str]:
    """Environment of a sender child process over ``link``: this process's environment plus
    :meth:`TwoHostLink.sender_env` (UCX over TCP on the host's veth end), NIXL's log level at
    WARN, unbuffered output, and ``path`` + the directory holding :mod:`stress` in front of
    ``PYTHONPATH``.

    Thread-safety: safe from any thread (reads ``os.environ``).
    """
    env = dict(os.environ)
    env.update(link.sender_env())
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    env["PYTHONUNBUFFERED"] = "1"
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parts = [*path, here, env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in parts if p))
    return env


# --------------------------------------------------------------------------- helpers


def _disable_ipv6(ifname: str, netns: str | None) -> None:
    """No IPv6 on the link (no link-local chatter, UCX sticks to the IPv4 addresses).
    Skipped where the kernel has no IPv6."""
    path = f"/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6"
    if netns is None:
        with contextlib.suppress(OSError), open(path, "w", encoding="ascii") as f:
            f.write("1")
        return
    _run(
        ["ip", "netns", "exec", netns, "sh", "-c", f"[ ! -e {path} ] || echo 1 > {path}"],
        check=False,
    )


def _netns_exists(name: str) -> bool:
    return name in _list_netns()


def _list_netns() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _guard_routes() -> list[str]:
    """Subnets of our guard routes (``proto 213``, inside :data:`SUBNET_POOL`)."""
    out = _run(["ip", "-4", "route", "show", "proto", str(GUARD_PROTO)], check=False).stdout
    found: list[str] = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "blackhole":
            with contextlib.suppress(ValueError):
                net = ipaddress.IPv4Network(parts[1], strict=False)
                if net.subnet_of(SUBNET_POOL):
                    found.append(str(net))
    return found


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this namespace has an address or a route in."""
    nets: list[ipaddress.IPv4Network] = []
    addrs = _run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    for m in re.finditer(r"\binet (\d+\.\d+\.\d+\.\d+/\d+)", addrs):
        nets.append(ipaddress.IPv4Interface(m.group(1)).network)
    routes = _run(["ip", "-4", "route", "show", "table", "all"], check=False).stdout
    for line in routes.splitlines():
        for token in line.split()[:2]:
            if token == "default":
                break
            with contextlib.suppress(ValueError):
                nets.append(ipaddress.IPv4Network(token, strict=False))
                break
    return nets


def _free_subnet(pid: int, seq: int) -> ipaddress.IPv4Network:
    """A ``/30`` of :data:`SUBNET_POOL` that overlaps nothing here (call under the lock).

    Raises:
        NetnsError: The pool overlaps a network this machine really uses, or is full.
    """
    used = _used_networks()
    for net in used:
        if net.prefixlen < SUBNET_POOL.prefixlen and net.overlaps(SUBNET_POOL):
            raise NetnsError(f"{SUBNET_POOL} is inside {net}, which this host uses")
    blocks = 1 << (30 - SUBNET_POOL.prefixlen)
    start = (pid * 31 + seq) % blocks
    base = int(SUBNET_POOL.network_address)
    for i in range(blocks):
        cand = ipaddress.IPv4Network((base + ((start + i) % blocks) * 4, 30))
        if not any(cand.overlaps(n) for n in used):
            return cand
    raise NetnsError(f"no free /30 left in {SUBNET_POOL}")


@contextlib.contextmanager
def _subnet_lock() -> Iterator[None]:
    """A machine-wide lock (a file lock) while a subnet is chosen and taken."""
    path = os.path.join(tempfile.gettempdir(), _LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def cleanup_stale(owner_pids: Mapping[int, bool] | None = None) -> list[str]:
    """Remove topologies whose creating process is gone: our namespaces (killing what still
    runs inside them), our veth ends, and guard routes left without a veth. A live process's
    topology is never touched. ``owner_pids`` overrides the liveness check (tests).

    Thread-safety: safe from any thread.

    Returns:
        What was removed.
    """

    def dead(pid: int) -> bool:
        if owner_pids is not None and pid in owner_pids:
            return not owner_pids[pid]
        return not _pid_alive(pid)

    removed: list[str] = []
    if shutil.which("ip") is None:
        return removed
    with _subnet_lock():
        for name in _list_netns():
            m = _NS_RE.match(name)
            if m and dead(int(m.group(1))):
                out = _run(["ip", "netns", "pids", name], check=False).stdout
                for pid in (int(p) for p in out.split() if p.isdigit()):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                if _run(["ip", "netns", "del", name], check=False).returncode == 0:
                    removed.append(f"netns {name}")
        links = _run(["ip", "-o", "link", "show"], check=False).stdout
        live_ifs: set[str] = set()
        for m in re.finditer(r"^\d+:\s+([^:@\s]+)", links, re.MULTILINE):
            ifname = m.group(1)
            im = _IF_RE.match(ifname)
            if im is None:
                continue
            gone = dead(int(im.group(1), 16))
            if gone and _run(["ip", "link", "del", ifname], check=False).returncode == 0:
                removed.append(f"link {ifname}")
                continue
            live_ifs.add(ifname)
        addrs = _run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
        owned: set[str] = set()
        for line in addrs.splitlines():
            parts = line.split()
            if len(parts) >= 4 and parts[1] in live_ifs:
                with contextlib.suppress(ValueError):
                    owned.add(str(ipaddress.IPv4Interface(parts[3]).network))
        for subnet in _guard_routes():
            if subnet not in owned:
                proc = _run(
                    [
                        "ip",
                        "route",
                        "del",
                        "blackhole",
                        subnet,
                        "metric",
                        str(GUARD_METRIC),
                        "proto",
                        str(GUARD_PROTO),
                    ],
                    check=False,
                )
                if proc.returncode == 0:
                    removed.append(f"guard route {subnet}")
    return removed
