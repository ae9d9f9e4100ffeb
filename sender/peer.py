"""The decode side: a KV pool that remote senders write into, in-process or as a process.

* :class:`DecodePeer` — a uint8 ``[num_pages, page_bytes]`` pool registered as region
  ``"kv"`` on its own :class:`~sender.transport.NixlTransport`, plus a notification pump
  thread that collects incoming notifications into a thread-safe store.
* ``python -m sender.peer --listen 127.0.0.1:PORT --pages N --page-bytes B`` runs a
  DecodePeer behind a tiny loopback TCP control channel (PORT 0 picks a free port). The first
  line on stdout is ``LISTENING 127.0.0.1:<port>``; afterwards stdout is redirected to stderr.
* :class:`PeerProcess` — the client used by tests, the stress suite and benchmarks: starts
  such a process, fetches its metadata, queries it, and can SIGKILL/SIGSTOP/SIGCONT/restart it.
  ``close()`` always reaps the process.

Control channel (our own protocol, loopback only). Every message in both directions is one
frame: a big-endian u32 ``frame_len``, then a big-endian u32 ``header_len``, a UTF-8 JSON
header and ``frame_len - 4 - header_len`` bytes of raw body. Requests are
``{"cmd": <name>, ...}``; replies are ``{"ok": true, ...}`` or ``{"ok": false, "error": str}``.
Commands: ``ping``, ``metadata`` (body = metadata), ``notifs`` (hex-encoded messages),
``clear_notifs``, ``digest`` (``pages``), ``read`` (``pages``; body = page bytes), ``zero``
(``pages`` or null for all), ``shutdown``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from sender import _nixl
from sender.errors import TransportClosedError, TransportParamError
from sender.transport import DEFAULT_PROGRESS_DELAY_US, NixlTransport, PageIndices

if TYPE_CHECKING:  # imported lazily: a CPU peer process starts ~2 s faster without torch
    import torch

__all__ = [
    "DecodePeer",
    "PeerError",
    "PeerProcess",
    "PeerServer",
    "main",
]

logger = logging.getLogger(__name__)

DEFAULT_NOTIF_INTERVAL_S = 0.001
DEFAULT_NOTIF_IDLE_INTERVAL_S = 0.01
_IDLE_AFTER_S = 0.1
_FRAME = struct.Struct(">I")
_MAX_FRAME = 1 << 31
_HOST = "127.0.0.1"


class PeerError(RuntimeError):
    """A peer process failed to start, answered with an error, or did not answer in time."""


# --------------------------------------------------------------------------- DecodePeer


class DecodePeer:
    """A decode-side KV pool on its own NIXL transport, with a notification pump.

    Args:
        name: NIXL agent name (unique among connected agents).
        num_pages: Pages in the pool.
        page_bytes: Bytes per page.
        device: Torch device of the pool (``"cpu"`` or a CUDA device).
        notif_interval_s: Pump period while notifications arrive or someone waits.
        notif_idle_interval_s: Pump period after 0.1 s without notifications or waiters.
        progress_delay_us: Passed to :class:`NixlTransport`.

    All methods are thread-safe.

    Raises:
        TransportParamError: Bad sizes.
        ImportError: NIXL is unavailable.
    """

    def __init__(
        self,
        name: str,
        num_pages: int,
        page_bytes: int,
        *,
        device: str = "cpu",
        notif_interval_s: float = DEFAULT_NOTIF_INTERVAL_S,
        notif_idle_interval_s: float = DEFAULT_NOTIF_IDLE_INTERVAL_S,
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
    ) -> None:
        if type(num_pages) is not int or num_pages <= 0:
            raise TransportParamError(f"num_pages must be a positive int, got {num_pages!r}")
        if type(page_bytes) is not int or page_bytes <= 0:
            raise TransportParamError(f"page_bytes must be a positive int, got {page_bytes!r}")
        if not 0 < notif_interval_s <= notif_idle_interval_s:
            raise TransportParamError("need 0 < notif_interval_s <= notif_idle_interval_s")
        self._num_pages = num_pages
        self._page_bytes = page_bytes
        self._interval = float(notif_interval_s)
        self._idle_interval = float(notif_idle_interval_s)
        self._device = str(device)
        # A CPU pool is a numpy array (no torch import needed); other devices use torch.
        self._pool_np: npt.NDArray[np.uint8] | None = None
        self._pool_t: torch.Tensor | None = None
        self._transport = NixlTransport(name, progress_delay_us=progress_delay_us)
        try:
            if self._device == "cpu":
                self._pool_np = np.zeros((num_pages, page_bytes), dtype=np.uint8)
                self._transport.register_region("kv", self._pool_np, page_bytes)
            else:
                import torch

                self._pool_t = torch.zeros(
                    (num_pages, page_bytes), dtype=torch.uint8, device=self._device
                )
                self._transport.register_region("kv", self._pool_t, page_bytes)
            self._metadata = self._transport.metadata()
        except BaseException:
            self._transport.close()
            raise
        # _cond guards _notifs, _seen and _closed.
        self._cond = threading.Condition(threading.Lock())
        self._notifs: dict[str, list[bytes]] = {}  # guarded by _cond
        self._seen: set[bytes] = set()  # guarded by _cond
        self._closed = False  # guarded by _cond
        self._waiters = 0  # guarded by _cond; threads inside wait_notif()
        self._stop = threading.Event()
        self._pump = threading.Thread(
            target=self._pump_loop, name=f"decode-peer-pump[{name}]", daemon=True
        )
        self._pump.start()

    # ------------------------------------------------------------------ properties

    @property
    def name(self) -> str:
        """NIXL agent name (the key of this peer's messages on the other side)."""
        return self._transport.name

    @property
    def num_pages(self) -> int:
        """Pages in the pool."""
        return self._num_pages

    @property
    def page_bytes(self) -> int:
        """Bytes per page."""
        return self._page_bytes

    @property
    def pool(self) -> torch.Tensor:
        """The registered KV pool as a tensor (uint8 ``[num_pages, page_bytes]``).

        For a CPU pool this is a zero-copy view of the registered numpy array (imports torch).
        """
        if self._pool_t is None:
            import torch

            assert self._pool_np is not None
            self._pool_t = torch.from_numpy(self._pool_np)
        return self._pool_t

    @property
    def transport(self) -> NixlTransport:
        """The peer's own transport (tests use it for stats)."""
        return self._transport

    def metadata(self) -> bytes:
        """Metadata to pass to a sender's ``NixlTransport.add_peer``.

        Thread-safety: safe from any thread (immutable after construction).
        """
        return self._metadata

    # ------------------------------------------------------------------ notifications

    def _pump_loop(self) -> None:
        # Adaptive interval: fast (_interval) while notifications arrive or someone waits in
        # wait_notif(), backing off to _idle_interval after _IDLE_AFTER_S of silence. Each
        # wake-up costs ~20-40 us of Python; at 1 ms forever the pump alone would cost ~4 %
        # of a core, at 10 ms ~1 %.
        interval = self._interval
        last_activity = time.monotonic()
        while not self._stop.wait(interval):
            try:
                got = self._transport.get_notifs()
            except TransportClosedError:
                return
            except Exception as exc:  # keep pumping; NIXL hiccups must not kill the thread
                logger.warning("notification pump of %s: %s", self.name, exc)
                continue
            now = time.monotonic()
            with self._cond:
                if got:
                    for agent, msgs in got.items():
                        self._notifs.setdefault(agent, []).extend(msgs)
                        self._seen.update(msgs)
                    self._cond.notify_all()
                busy = bool(got) or self._waiters > 0
            if busy:
                last_activity = now
                interval = self._interval
            elif now - last_activity > _IDLE_AFTER_S:
                interval = min(interval * 2, self._idle_interval)

    def notifs(self) -> dict[str, list[bytes]]:
        """All notifications collected so far (sender agent name -> messages, in order).

        Thread-safety: safe from any thread; returns a copy.
        """
        with self._cond:
            return {k: list(v) for k, v in self._notifs.items()}

    def clear_notifs(self) -> None:
        """Forget all collected notifications.

        Thread-safety: safe from any thread.
        """
        with self._cond:
            self._notifs.clear()
            self._seen.clear()

    def wait_notif(self, msg: bytes, timeout_s: float) -> bool:
        """Wait until notification ``msg`` has been collected; False on timeout or close.

        Thread-safety: safe from any thread.
        """
        with self._cond:
            self._waiters += 1
            try:
                self._cond.wait_for(lambda: msg in self._seen or self._closed, timeout_s)
                return msg in self._seen
            finally:
                self._waiters -= 1

    # ------------------------------------------------------------------ pages

    def _indices(self, pages: PageIndices) -> npt.NDArray[np.int64]:
        arr = np.asarray(pages)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise TransportParamError("pages must be a 1-D sequence of ints")
        arr = arr.astype(np.int64)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= self._num_pages):
            raise TransportParamError(f"page index out of range ({self._num_pages} pages)")
        return arr

    def _rows(self, pages: PageIndices) -> npt.NDArray[np.uint8]:
        idx = self._indices(pages)
        if self._pool_np is not None:
            return self._pool_np[idx]
        assert self._pool_t is not None
        import torch

        rows: npt.NDArray[np.uint8] = (
            self._pool_t[torch.from_numpy(idx).to(self._pool_t.device)].cpu().numpy()
        )
        return rows

    def read_pages(self, pages: PageIndices) -> bytes:
        """Bytes of the given pages, concatenated in the given order.

        Thread-safety: safe from any thread (reads may race with incoming writes).

        Raises:
            TransportParamError: Bad or out-of-range page indices.
        """
        return self._rows(pages).tobytes()

    def page_digest(self, pages: PageIndices) -> list[str]:
        """blake2b-128 hex digest of each page, in the given order.

        Thread-safety: safe from any thread.

        Raises:
            TransportParamError: Bad or out-of-range page indices.
        """
        return [page_digest_bytes(row.tobytes()) for row in self._rows(pages)]

    def zero_pages(self, pages: PageIndices | None = None) -> None:
        """Zero the given pages (all when ``None``).

        Thread-safety: safe from any thread.

        Raises:
            TransportParamError: Bad or out-of-range page indices.
        """
        if self._pool_np is not None:
            if pages is None:
                self._pool_np.fill(0)
            else:
                self._pool_np[self._indices(pages)] = 0
            return
        assert self._pool_t is not None
        if pages is None:
            self._pool_t.zero_()
        else:
            import torch

            idx = torch.from_numpy(self._indices(pages)).to(self._pool_t.device)
            self._pool_t[idx] = 0

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop and join the pump thread, then close the transport. Idempotent.

        Thread-safety: safe from any thread (not from the pump thread itself).
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._stop.set()
        self._pump.join(timeout=10.0)
        self._transport.close()

    def __enter__(self) -> DecodePeer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def page_digest_bytes(data: bytes) -> str:
    """The digest :meth:`DecodePeer.page_digest` uses for one page's bytes."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


# --------------------------------------------------------------------------- framing


def _send_frame(sock: socket.socket, header: dict[str, Any], body: bytes = b"") -> None:
    head = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_FRAME.pack(_FRAME.size + len(head) + len(body)) + _FRAME.pack(len(head)))
    sock.sendall(head)
    if body:
        sock.sendall(body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed mid-frame")
        got += k
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> tuple[dict[str, Any], bytes] | None:
    """Read one frame; None on a clean EOF before its first byte."""
    first = sock.recv(_FRAME.size)
    if not first:
        return None
    if len(first) < _FRAME.size:
        first += _recv_exact(sock, _FRAME.size - len(first))
    (total,) = _FRAME.unpack(first)
    if total < _FRAME.size or total > _MAX_FRAME:
        raise ConnectionError(f"bad frame length {total}")
    payload = _recv_exact(sock, total)
    (hlen,) = _FRAME.unpack_from(payload)
    if hlen > total - _FRAME.size:
        raise ConnectionError("bad header length")
    header = json.loads(payload[_FRAME.size : _FRAME.size + hlen].decode())
    if not isinstance(header, dict):
        raise ConnectionError("frame header is not an object")
    return header, payload[_FRAME.size + hlen :]


# --------------------------------------------------------------------------- server


class PeerServer:
    """Serves one :class:`DecodePeer` over the loopback control channel.

    An accept thread hands each connection to its own daemon thread; all are joined (with a
    bound) by :meth:`close`. Binds to 127.0.0.1 only.

    Thread-safety: ``close``/``wait``/``shutdown_requested`` are safe from any thread.
    """

    def __init__(self, peer: DecodePeer, port: int = 0, io_timeout_s: float = 30.0) -> None:
        self._peer = peer
        self._io_timeout = io_timeout_s
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((_HOST, port))
        self._sock.listen(16)
        self._sock.settimeout(0.2)
        self.port: int = self._sock.getsockname()[1]
        self.shutdown_requested = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._workers: set[threading.Thread] = set()  # guarded by _lock
        self._acceptor = threading.Thread(target=self._accept_loop, name="peer-accept", daemon=True)
        self._acceptor.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), name="peer-conn", daemon=True)
            with self._lock:
                self._workers = {w for w in self._workers if w.is_alive()}
                self._workers.add(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self._io_timeout)
            while not self._stop.is_set():
                try:
                    frame = _recv_frame(conn)
                except (OSError, ValueError):
                    return
                if frame is None:
                    return
                header, body = frame
                try:
                    reply, out = self._handle(header, body)
                except Exception as exc:
                    reply, out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, b""
                try:
                    _send_frame(conn, reply, out)
                except OSError:
                    return

    def _handle(self, req: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        cmd = req.get("cmd")
        peer = self._peer
        if cmd == "ping":
            return {"ok": True, "pid": os.getpid(), "name": peer.name}, b""
        if cmd == "metadata":
            return {"ok": True, "name": peer.name}, peer.metadata()
        if cmd == "notifs":
            hexed = {k: [m.hex() for m in v] for k, v in peer.notifs().items()}
            return {"ok": True, "notifs": hexed}, b""
        if cmd == "clear_notifs":
            peer.clear_notifs()
            return {"ok": True}, b""
        if cmd == "digest":
            return {"ok": True, "digests": peer.page_digest(_pages_arg(req))}, b""
        if cmd == "read":
            return {"ok": True}, peer.read_pages(_pages_arg(req))
        if cmd == "zero":
            pages = req.get("pages")
            peer.zero_pages(None if pages is None else _pages_arg(req))
            return {"ok": True}, b""
        if cmd == "shutdown":
            self.shutdown_requested.set()
            return {"ok": True}, b""
        raise ValueError(f"unknown command {cmd!r}")

    def close(self) -> None:
        """Stop accepting, close the socket and join all threads (bounded)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        self._acceptor.join(timeout=5.0)
        with self._lock:
            workers = list(self._workers)
        for w in workers:
            w.join(timeout=1.0)


def _pages_arg(req: dict[str, Any]) -> list[int]:
    pages = req.get("pages")
    if not isinstance(pages, list) or not all(type(p) is int for p in pages):
        raise TransportParamError("'pages' must be a list of ints")
    return pages


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m sender.peer``; returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m sender.peer", description="Run a decode peer.")
    ap.add_argument("--listen", default=f"{_HOST}:0", help="127.0.0.1:PORT (0 = any free port)")
    ap.add_argument("--pages", type=int, required=True)
    ap.add_argument("--page-bytes", type=int, required=True)
    ap.add_argument("--name", default=None, help="NIXL agent name (default: unique)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    args = ap.parse_args(argv)
    host, _, port_s = args.listen.rpartition(":")
    if host != _HOST:
        ap.error("only 127.0.0.1 may be used")
    name = args.name or f"decode-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    peer = DecodePeer(name, args.pages, args.page_bytes, device=args.device)
    try:
        server = PeerServer(peer, int(port_s))
        try:
            sys.stdout.write(f"LISTENING {_HOST}:{server.port}\n")
            sys.stdout.flush()
            # From now on nothing may write to the pipe the parent stopped reading.
            os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
            while not stop.is_set() and not server.shutdown_requested.is_set():
                stop.wait(0.2)
                if args.parent_pid and os.getppid() != args.parent_pid:
                    break  # orphaned: the parent died without reaping us
        finally:
            server.close()
    finally:
        peer.close()
    return 0


# --------------------------------------------------------------------------- client


class PeerProcess:
    """A :class:`DecodePeer` in a child process, controlled over the loopback channel.

    Starting costs ~1-3 s (the child imports torch and NIXL). ``close()`` always reaps the
    child: SIGCONT+SIGTERM, SIGKILL after ``term_grace_s``, then wait.

    Args:
        num_pages: Pages in the peer's pool.
        page_bytes: Bytes per page.
        name: Prefix of the peer's NIXL agent name (a unique suffix is added per start).
        device: Torch device of the peer's pool.
        start_timeout_s: Bound on the wait for the ``LISTENING`` line and the metadata.
        rpc_timeout_s: Bound on every socket operation of a request.
        stderr: Where the child's stderr goes (``None`` = inherit).

    Not thread-safe for lifecycle methods (``kill``/``stop``/``cont``/``restart``/``close``);
    query methods open a connection per call and may be used from several threads.

    Raises:
        PeerError: The child did not start in time (it is reaped first).
    """

    def __init__(
        self,
        num_pages: int,
        page_bytes: int,
        *,
        name: str = "decode",
        device: str = "cpu",
        start_timeout_s: float = 60.0,
        rpc_timeout_s: float = 10.0,
        term_grace_s: float = 3.0,
        stderr: int | IO[Any] | None = None,
    ) -> None:
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self._prefix = name
        self._device = device
        self._start_timeout = start_timeout_s
        self._rpc_timeout = rpc_timeout_s
        self._term_grace = term_grace_s
        self._stderr = stderr
        self._proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.agent_name = ""
        self.metadata = b""
        self._start()

    # ------------------------------------------------------------------ lifecycle

    def _start(self) -> None:
        agent_name = f"{self._prefix}-{uuid.uuid4().hex[:10]}"
        env = dict(os.environ)
        env["NIXL_LOG_LEVEL"] = "WARN"
        if _nixl.BACKEND_MODULE:  # skip nixl's CUDA probe (it imports torch: ~2 s)
            env[_nixl.BACKEND_ENV] = _nixl.BACKEND_MODULE
        env["PYTHONUNBUFFERED"] = "1"
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        cmd = [
            sys.executable, "-m", "sender.peer",
            "--listen", f"{_HOST}:0",
            "--pages", str(self.num_pages),
            "--page-bytes", str(self.page_bytes),
            "--name", agent_name,
            "--device", self._device,
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._stderr, env=env
        )
        self._proc = proc
        try:
            self.port = self._read_listening(proc, time.monotonic() + self._start_timeout)
            self.agent_name = agent_name
            _, self.metadata = self._call({"cmd": "metadata"}, timeout_s=self._start_timeout)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _read_listening(proc: subprocess.Popen[bytes], deadline: float) -> int:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        buf = b""
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PeerError("peer did not print LISTENING in time")
                ready, _, _ = select.select([fd], [], [], remaining)
                if not ready:
                    continue
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise PeerError(f"peer exited before listening (status {proc.wait(5)})")
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.startswith(b"LISTENING "):
                        return int(line.rsplit(b":", 1)[1])
        finally:
            proc.stdout.close()

    @property
    def pid(self) -> int:
        """Process id of the current child (0 when none)."""
        return self._proc.pid if self._proc is not None else 0

    @property
    def alive(self) -> bool:
        """True while the child has not exited."""
        return self._proc is not None and self._proc.poll() is None

    def _signal(self, sig: signal.Signals) -> None:
        if self._proc is None:
            raise PeerError("no peer process")
        with contextlib.suppress(ProcessLookupError):
            self._proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL the child and reap it."""
        self._signal(signal.SIGKILL)
        assert self._proc is not None
        self._proc.wait(timeout=10.0)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP the child and return once it is actually stopped (it hangs; NIXL never
        notices). Signal delivery is asynchronous: without the wait, a transfer posted right
        after ``stop()`` can still complete.

        Raises:
            PeerError: The child did not stop within ``timeout_s``.
        """
        self._signal(signal.SIGSTOP)
        if not self._wait_state(lambda st: st in ("T", "t"), timeout_s):
            raise PeerError(f"peer {self.pid} did not stop within {timeout_s} s")

    def cont(self, timeout_s: float = 5.0) -> None:
        """SIGCONT the child and return once it is no longer stopped.

        Raises:
            PeerError: The child is still stopped after ``timeout_s``.
        """
        self._signal(signal.SIGCONT)
        if not self._wait_state(lambda st: st not in ("T", "t"), timeout_s):
            raise PeerError(f"peer {self.pid} did not continue within {timeout_s} s")

    def _wait_state(self, ok: Callable[[str], bool], timeout_s: float) -> bool:
        """Wait until the child's scheduler state (``/proc/PID/stat``) satisfies ``ok``.

        True at once when the child is gone or ``/proc`` is unreadable (non-Linux).
        """
        end = time.monotonic() + timeout_s
        while True:
            try:
                with open(f"/proc/{self.pid}/stat", encoding="ascii") as f:
                    state = f.read().rpartition(")")[2].split()[0]
            except (OSError, IndexError):
                return True
            if ok(state) or state in ("Z", "X"):
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.001)

    def restart(self) -> None:
        """Reap the current child and start a new one (new agent name, new metadata).

        Raises:
            PeerError: The new child did not start in time.
        """
        self.close()
        self._start()

    def close(self) -> None:
        """Reap the child: SIGCONT+SIGTERM, SIGKILL after the grace period, wait. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT)
                    proc.terminate()
                try:
                    proc.wait(timeout=self._term_grace)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            proc.wait(timeout=30.0)
        finally:
            if proc.stdout is not None:
                proc.stdout.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ queries

    def _call(
        self, req: dict[str, Any], timeout_s: float | None = None
    ) -> tuple[dict[str, Any], bytes]:
        timeout = self._rpc_timeout if timeout_s is None else timeout_s
        if self._proc is None:
            raise PeerError("no peer process")
        try:
            with socket.create_connection((_HOST, self.port), timeout=timeout) as sock:
                sock.settimeout(timeout)
                _send_frame(sock, req)
                frame = _recv_frame(sock)
        except (OSError, ValueError) as exc:
            raise PeerError(f"peer request {req.get('cmd')!r} failed: {exc}") from exc
        if frame is None:
            raise PeerError(f"peer closed the connection on {req.get('cmd')!r}")
        header, body = frame
        if not header.get("ok"):
            raise PeerError(f"peer refused {req.get('cmd')!r}: {header.get('error')}")
        return header, body

    def ping(self, timeout_s: float | None = None) -> bool:
        """True if the child answers within the timeout."""
        try:
            self._call({"cmd": "ping"}, timeout_s)
        except PeerError:
            return False
        return True

    def notifs(self) -> dict[str, list[bytes]]:
        """All notifications the child has collected (sender agent name -> messages).

        Raises:
            PeerError: No answer in time, or the child is gone.
        """
        header, _ = self._call({"cmd": "notifs"})
        raw = header.get("notifs", {})
        return {str(k): [bytes.fromhex(m) for m in v] for k, v in raw.items()}

    def wait_notif(self, msg: bytes, timeout_s: float, interval_s: float = 0.005) -> bool:
        """Poll the child until it has collected ``msg``; False on timeout.

        Raises:
            PeerError: The child stopped answering.
        """
        end = time.monotonic() + timeout_s
        while True:
            if any(msg in v for v in self.notifs().values()):
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(interval_s)

    def clear_notifs(self) -> None:
        """Forget the child's collected notifications.

        Raises:
            PeerError: No answer in time.
        """
        self._call({"cmd": "clear_notifs"})

    def page_digest(self, pages: Sequence[int] | np.ndarray[Any, Any]) -> list[str]:
        """Digests of the child's pages (see :meth:`DecodePeer.page_digest`).

        Raises:
            PeerError: Bad pages or no answer in time.
        """
        header, _ = self._call({"cmd": "digest", "pages": [int(p) for p in pages]})
        digests: list[str] = header["digests"]
        return digests

    def read_pages(self, pages: Sequence[int] | np.ndarray[Any, Any]) -> bytes:
        """Raw bytes of the child's pages, concatenated.

        Raises:
            PeerError: Bad pages or no answer in time.
        """
        _, body = self._call({"cmd": "read", "pages": [int(p) for p in pages]})
        return body

    def zero_pages(self, pages: Sequence[int] | np.ndarray[Any, Any] | None = None) -> None:
        """Zero the child's pages (all when ``None``).

        Raises:
            PeerError: Bad pages or no answer in time.
        """
        arg = None if pages is None else [int(p) for p in pages]
        self._call({"cmd": "zero", "pages": arg})


if __name__ == "__main__":
    sys.exit(main())
