"""The decode peer's control channel (``stress.harness.peer``) against hostile or broken clients.

Frames are bounded per command and read incrementally; every bad frame gets an
``{"ok": false, "error": ...}`` reply; the server keeps serving (or closes that one
connection) and closes in bounded time with idle connections open. Limits: docs/PROTOCOL.md.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from stress.harness.peer import DecodePeer, PeerProcess, PeerServer
from tests.fixtures_nixl import requires_nixl

pytestmark = [pytest.mark.nixl, requires_nixl]

U32 = struct.Struct(">I")
HOST = "127.0.0.1"


def _frame(head: bytes, body: bytes = b"", *, total: int | None = None,
           hlen: int | None = None) -> bytes:
    """A raw frame; ``total``/``hlen`` override the two length fields."""
    n = 4 + len(head) + len(body) if total is None else total
    return U32.pack(n) + U32.pack(len(head) if hlen is None else hlen) + head + body


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _reply(sock: socket.socket) -> dict[str, Any] | None:
    """One reply frame's header, or None at EOF (the server closed without answering)."""
    prefix = _recv_exact(sock, 8)
    if prefix is None:
        return None
    total, hlen = U32.unpack(prefix[:4])[0], U32.unpack(prefix[4:])[0]
    assert total <= 1 << 20, f"reply of {total} bytes"
    rest = _recv_exact(sock, total - 4)
    assert rest is not None, "reply cut short"
    header: dict[str, Any] = json.loads(rest[:hlen])
    return header


def _ask(sock: socket.socket, raw: bytes) -> dict[str, Any] | None:
    sock.sendall(raw)
    return _reply(sock)


def _at_eof(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture
def served(nixl_required: None) -> Iterator[tuple[DecodePeer, PeerServer]]:
    """An in-process DecodePeer (4096 pages: page headers may be ~25 KB) behind a server."""
    peer = DecodePeer("decode-channel", 4096, 64)
    server = PeerServer(peer, io_timeout_s=5.0)
    try:
        yield peer, server
    finally:
        server.close()
        peer.close()


# Frames that are read whole: each gets an error reply and the connection stays usable.
DEEP = b"[" * 12_000 + b"]" * 12_000  # RecursionError in json.loads, within the size limit
BAD_FRAMES: list[tuple[str, bytes, str]] = [
    ("deep nesting", _frame(DEEP), "RecursionError"),
    ("deep nesting in pages",
     _frame(b'{"cmd":"digest","pages":' + b"[" * 6000 + b"]" * 6000 + b"}"), "RecursionError"),
    ("bad json", _frame(b"{not json"), "JSONDecodeError"),
    ("not utf-8", _frame(b'{"cmd":"\xff\xfe"}'), "UnicodeDecodeError"),
    ("not an object", _frame(b"[1, 2]"), "not an object"),
    ("no cmd", _frame(b"{}"), "unknown command"),
    ("cmd not a string", _frame(_json({"cmd": 5})), "unknown command"),
    ("unknown cmd", _frame(_json({"cmd": "format"})), "unknown command"),
    ("int past the digit limit",
     _frame(b'{"cmd":"digest","pages":[' + b"7" * 5000 + b"]}"), "ValueError"),
    ("request with a body", _frame(_json({"cmd": "ping"}), b"x" * 16), "body"),
    ("header too long for its command",
     _frame(_json({"cmd": "ping", "pad": "x" * 1000})), "exceeds the limit"),
    ("header length past the frame", _frame(_json({"cmd": "ping"}), hlen=1000), "exceeds"),
    ("more pages than the pool", _frame(_json({"cmd": "digest", "pages": [0] * 5000})),
     "more than"),
]


@pytest.mark.timeout(30)
def test_every_bad_frame_gets_an_error_reply_and_the_connection_survives(
    served: tuple[DecodePeer, PeerServer],
    thread_excepthook: list[threading.ExceptHookArgs],
    caplog: pytest.LogCaptureFixture,
) -> None:
    peer, server = served
    ping = _frame(_json({"cmd": "ping"}))
    with socket.create_connection((HOST, server.port), timeout=5) as sock:
        for name, raw, error in BAD_FRAMES:
            reply = _ask(sock, raw)
            assert reply is not None, f"{name}: connection closed without a reply"
            assert reply.get("ok") is False and error in str(reply.get("error")), (name, reply)
            after = _ask(sock, ping)
            assert after is not None and after.get("ok") is True, f"{name}: then {after}"
    # Frames whose length is refused: an error reply, then that connection is closed.
    for name, raw in [("frame shorter than its length field", U32.pack(2) + b"xx"),
                      ("frame over the limit", U32.pack(30_000_000))]:
        with socket.create_connection((HOST, server.port), timeout=5) as sock:
            reply = _ask(sock, raw)
            assert reply is not None and reply.get("ok") is False, (name, reply)
            assert _at_eof(sock), f"{name}: connection left open"
    # A frame that never completes: answered and closed after the I/O timeout, not held.
    quick = PeerServer(peer, io_timeout_s=0.5)
    try:
        with socket.create_connection((HOST, quick.port), timeout=10) as sock:
            reply = _ask(sock, U32.pack(100) + U32.pack(20) + b'{"cmd"')
            # The reply names the I/O timeout (0.5 s) as the reason: it fired, nothing held.
            assert reply is not None and "not complete in time" in str(reply.get("error"))
            assert _at_eof(sock)
    finally:
        quick.close()
    with socket.create_connection((HOST, server.port), timeout=5) as sock:
        after = _ask(sock, ping)
        assert after is not None and after.get("ok") is True  # still serving
    assert not thread_excepthook, [a.exc_value for a in thread_excepthook]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.timeout(60)
def test_close_is_bounded_with_idle_connections(
    served: tuple[DecodePeer, PeerServer], fast_switch: None
) -> None:
    """close() with 8 idle connections and one half-sent frame wakes them instead of waiting
    for their I/O timeout (it was ~1 s per idle connection: 8-9 s): with a 600 s timeout
    here, every connection thread has ended once ``close(timeout_s=30)`` returns (30 s: the
    join bound, far over a busy machine's delays and far under the timeout it must not
    wait for), and every client sees EOF. No elapsed-time assertion."""
    peer, _ = served
    others = set(threading.enumerate())  # the fixture's own server threads
    server = PeerServer(peer, io_timeout_s=600.0)
    clients = [socket.create_connection((HOST, server.port), timeout=10) for _ in range(8)]
    try:
        for sock in clients:  # each one served once, so its thread is up and idle in recv
            reply = _ask(sock, _frame(_json({"cmd": "ping"})))
            assert reply is not None and reply["ok"] is True
        half = socket.create_connection((HOST, server.port), timeout=10)
        clients.append(half)
        half.sendall(U32.pack(64) + b"\x00\x00")
        time.sleep(0.1)
        server.close(timeout_s=30.0)
        alive = [t.name for t in set(threading.enumerate()) - others if t.name.startswith("peer-")]
        assert not alive, f"server threads alive after close(): {alive}"
        assert all(_at_eof(sock) for sock in clients)
    finally:
        server.close()
        for sock in clients:
            sock.close()


@pytest.mark.timeout(30)
def test_connections_over_the_limit_are_refused_with_a_reply(nixl_required: None) -> None:
    with DecodePeer("decode-limit", 8, 64) as peer:
        server = PeerServer(peer, max_connections=2)
        try:
            held = [socket.create_connection((HOST, server.port), timeout=5) for _ in range(2)]
            for sock in held:
                assert (_ask(sock, _frame(_json({"cmd": "ping"}))) or {}).get("ok") is True
            with socket.create_connection((HOST, server.port), timeout=5) as extra:
                reply = _reply(extra)
                assert reply == {"ok": False, "error": "too many connections"}
                assert _at_eof(extra)
            held.pop().close()
            time.sleep(0.2)  # the server notices the close and frees the slot
            with socket.create_connection((HOST, server.port), timeout=5) as again:
                assert (_ask(again, _frame(_json({"cmd": "ping"}))) or {}).get("ok") is True
            for sock in held:
                sock.close()
        finally:
            server.close()


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    pytest.skip("no /proc/<pid>/status here")


@pytest.mark.timeout(60)
def test_peer_process_refuses_a_2gib_header_before_allocating_and_closes_promptly(
    peer_process: PeerProcess,
) -> None:
    """A 4-byte header announcing 2 GiB is answered at once, with no allocation (RSS of the
    peer process checked); afterwards 8 idle connections do not delay ``close()``: the
    child exits on SIGTERM (status 0), not by the SIGKILL fallback."""
    pid = peer_process.pid
    before = _rss_mib(pid)
    with socket.create_connection((HOST, peer_process.port), timeout=5) as sock:
        sock.sendall(U32.pack(1 << 31))
        try:
            reply = _reply(sock)
        except TimeoutError:
            reply = None
        time.sleep(0.3)
        grown = _rss_mib(pid) - before
        assert grown < 64, f"peer RSS grew by {grown:.0f} MiB for one 4-byte header"
        assert reply is not None and reply.get("ok") is False, f"reply: {reply}"
        assert "exceeds the limit" in str(reply.get("error"))
        assert _at_eof(sock)
    assert peer_process.ping(5)

    idle = [socket.create_connection((HOST, peer_process.port), timeout=5) for _ in range(8)]
    try:
        for sock in idle:
            assert (_ask(sock, _frame(_json({"cmd": "ping"}))) or {}).get("ok") is True
        proc = peer_process._proc
        assert proc is not None
        peer_process._term_grace = 30.0  # judged by who ended it, not by how long it took
        peer_process.close()
        # Status 0: it exited on SIGTERM by itself (idle connections woken), not by the
        # SIGKILL that follows the grace period.
        assert proc.returncode == 0, f"peer ended with {proc.returncode}"
    finally:
        for sock in idle:
            sock.close()
