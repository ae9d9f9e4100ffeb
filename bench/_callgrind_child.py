"""The program ``instructions`` runs under ``valgrind --tool=callgrind`` (not run by hand).

``python -m bench._callgrind_child [--rooms N] [--chunks C] [--pages P] [--sessions S]``

Sets up an inline :class:`sender.manager.KVManager` on :class:`bench._noop.NoopTransport`
(library defaults otherwise: mutex room lock, default staging context, debug locks off) and
the :class:`bench._bare_room.BareRooms` reference, warms both up (the interpreter's adaptive
bytecode and every lazy cache reach their steady state), prints ``READY`` and waits for one
line on stdin. The parent switches callgrind's instrumentation on in between (``callgrind_control
-i on``), so the imports and the set-up are never instrumented (they run ~10x faster so).

Then each *window* of :data:`WINDOWS` runs inside its own call of a ctypes callback: the
parent runs valgrind with ``--collect-atstart=no --toggle-collect=closure_fcn
--dump-after=closure_fcn``, so instructions are counted only while a window runs (``closure_fcn``
is the C function of ``_ctypes`` that calls a Python callback, entered by nothing else here)
and each window's count is dumped to a file of its own, in order. The cyclic GC is collected
before and disabled during every window (a collection's cost belongs to no room). Prints
``WINDOWS name,name,...`` and exits.

Windows: ``empty`` (the callback alone: subtracted from the others), ``sender`` and
``sender again`` (N rooms one after the other: make_transfer_info, NixlKVSender, init, C
sends, poll until Success, clear), ``reference`` (the same N rooms on BareRooms), and the
sender's steps for N rooms in flight, one window each: ``open`` (make_transfer_info +
NixlKVSender), ``init``, ``send``, ``poll``, ``clear``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sender.nixl_sender import NixlKVSender

WINDOWS = (
    "empty",
    "sender",
    "sender again",
    "reference",
    "open",
    "init",
    "send",
    "poll",
    "clear",
)
STEPS = ("open", "init", "send", "poll", "clear")
KV_PAGES = 1024
PAGE_BYTES = 64
"""The no-op transport moves nothing: a small pool is enough (the manager checks page
indices against its page count only)."""
SESSION_PREFIX = "decode-"
WARMUP_ROOMS = 32
FIRST_ROOM = 1_000_000


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench._callgrind_child")
    parser.add_argument("--rooms", type=int, default=50)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--pages", type=int, default=16, help="pages per chunk")
    parser.add_argument("--sessions", type=int, default=1)
    return parser


class _Work:
    """The rooms of every window, on one manager and one reference."""

    def __init__(self, chunks: int, pages: int, sessions: int) -> None:
        import numpy as np
        import torch

        from bench._bare_room import BareRooms
        from bench._noop import NoopTransport
        from sender.manager import KVManager

        if chunks * pages > KV_PAGES:
            raise SystemExit(f"a room of {chunks} x {pages} pages exceeds {KV_PAGES} pages")
        self.chunks, self.pages = chunks, pages
        self.sids = [f"{SESSION_PREFIX}{i}" for i in range(sessions)]
        kv = torch.zeros((KV_PAGES, PAGE_BYTES), dtype=torch.uint8)
        self.mgr = KVManager(NoopTransport(), kv, num_workers=0, debug=False)
        self.ref = BareRooms(NoopTransport())
        room_pages = chunks * pages
        self.dst = np.arange(room_pages, dtype=np.int64)
        self.src = [np.arange(c * pages, (c + 1) * pages, dtype=np.int64) for c in range(chunks)]
        # Room ids above CPython's small-int cache and of one width: every window's ids
        # are allocated ints whose notification text has the same length.
        self.next_room = FIRST_ROOM
        self.batch: list[NixlKVSender] = []

    def _room_id(self) -> int:
        room = self.next_room
        self.next_room += 1
        return room

    def sender_rooms(self, n: int) -> None:
        from sender.manager import make_transfer_info
        from sender.nixl_sender import NixlKVSender
        from sender.poll import KVPoll

        for _ in range(n):
            infos = [make_transfer_info(sid, self.dst) for sid in self.sids]
            snd = NixlKVSender(self.mgr, self._room_id(), self.sids, infos)
            snd.init(self.chunks * self.pages)
            for chunk in self.src:
                snd.send(chunk)
            while snd.poll() is not KVPoll.Success:
                pass
            snd.clear()

    def reference_rooms(self, n: int) -> None:
        ref, pages = self.ref, self.pages
        last = self.chunks - 1
        for _ in range(n):
            room = self._room_id()
            ref.open(room, {sid: self.dst for sid in self.sids})
            ref.init(room, self.chunks * pages)
            for c, chunk in enumerate(self.src):
                ref.send(room, c, c * pages, chunk, c == last)
            while not ref.poll(room):
                pass
            ref.clear(room)

    def step(self, name: str, n: int) -> None:
        """One step of the sender for ``n`` rooms in flight (``open`` makes the batch)."""
        from sender.manager import make_transfer_info
        from sender.nixl_sender import NixlKVSender
        from sender.poll import KVPoll

        senders = self.batch
        if name == "open":
            self.batch = [
                NixlKVSender(
                    self.mgr,
                    self._room_id(),
                    self.sids,
                    [make_transfer_info(sid, self.dst) for sid in self.sids],
                )
                for _ in range(n)
            ]
            return
        if name == "init":
            for snd in senders:
                snd.init(self.chunks * self.pages)
        elif name == "send":
            for chunk in self.src:
                for snd in senders:
                    snd.send(chunk)
        elif name == "poll":
            for snd in senders:
                while snd.poll() is not KVPoll.Success:
                    pass
        elif name == "clear":
            for snd in senders:
                snd.clear()
            self.batch = []
        else:
            raise ValueError(f"unknown step {name!r}")

    def window(self, name: str, n: int) -> Callable[[], None]:
        if name == "empty":
            return lambda: None
        if name in ("sender", "sender again"):
            return lambda: self.sender_rooms(n)
        if name == "reference":
            return lambda: self.reference_rooms(n)
        return lambda: self.step(name, n)


def main(argv: Sequence[str] | None = None) -> int:
    """Set up, warm up, wait for the parent's line, run the windows (module docstring)."""
    args = _parser().parse_args(argv)
    if min(args.rooms, args.chunks, args.pages, args.sessions) < 1:
        raise SystemExit("--rooms, --chunks, --pages and --sessions must be >= 1")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    work = _Work(args.chunks, args.pages, args.sessions)
    work.sender_rooms(WARMUP_ROOMS)
    work.reference_rooms(WARMUP_ROOMS)
    for _ in range(2):
        for name in STEPS:
            work.step(name, min(args.rooms, WARMUP_ROOMS))
    callback = ctypes.CFUNCTYPE(None)
    # Made before the windows: building a callback allocates a libffi closure.
    windows = [(name, callback(work.window(name, args.rooms))) for name in WINDOWS]
    print("READY", flush=True)
    sys.stdin.readline()
    for _, window in windows:
        gc.collect()
        gc.disable()
        try:
            window()
        finally:
            gc.enable()
    print("WINDOWS " + ",".join(name for name, _ in windows), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
