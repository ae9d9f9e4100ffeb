"""The program ``instructions`` runs under ``valgrind --tool=callgrind`` (not run by hand).

``python -m bench._callgrind_child [--rooms N] [--pages P]``

Sets up an inline :class:`sender.manager.KVManager` on :class:`bench._noop.NoopTransport`
(library defaults otherwise: mutex room lock, default staging context, debug locks off) and
the :class:`bench._bare_room.BareRooms` reference, warms both up at every shape the windows
use (the interpreter's adaptive bytecode and every lazy cache reach their steady state),
prints ``READY`` and waits for one line on stdin. The parent switches callgrind's
instrumentation on in between (``callgrind_control -i on``), so the imports and the set-up
are never instrumented (they run ~10x faster so).

Then each window of :func:`windows` runs inside its own call of a ctypes callback: the
parent runs valgrind with ``--collect-atstart=no --toggle-collect=closure_fcn
--dump-after=closure_fcn``, so instructions are counted only while a window runs
(``closure_fcn`` is the C function of ``_ctypes`` that calls a Python callback, entered by
nothing else here) and each window's count is dumped to a file of its own, in order. The
cyclic GC is collected before and disabled during every window (a collection's cost belongs
to no room). Prints ``WINDOWS name:rooms,name:rooms,...`` and exits.

Windows (a room: chunks of P pages, 8 chunks to 1 session unless named): ``empty`` (the
callback alone: subtracted from the others); ``sender`` and ``sender again`` (N rooms one
after the other: make_transfer_info, NixlKVSender, init, the sends, poll until Success,
clear); ``reference`` (the same N rooms on BareRooms); the sender's steps for N rooms in
flight, one window each (``open``: make_transfer_info + NixlKVSender, ``init``, ``send``,
``poll``, ``clear``); and the growth curves: ``chunks 32``/``128`` and ``sessions 2``/``4``/
``8`` (rooms one after the other, as many chunk sends as the ``sender`` window) and ``in
flight 32``/``128`` (a whole batch in flight in one window).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from sender.nixl_sender import NixlKVSender

    PageArray = npt.NDArray[np.int64]

BASE_CHUNKS = 8
STEPS = ("open", "init", "send", "poll", "clear")
CHUNK_GROWTH = (32, 128)
SESSION_GROWTH = (2, 4, 8)
IN_FLIGHT = (32, 128)
KV_PAGES = 4096
PAGE_BYTES = 64
"""The no-op transport moves nothing: a small pool is enough (the manager checks page
indices against its page count only)."""
SESSION_PREFIX = "decode-"
WARMUP_ROOMS = 32
FIRST_ROOM = 1_000_000


@dataclass(frozen=True)
class Window:
    """One counted window: ``kind`` of work on rooms of ``chunks`` x ``sessions``.

    Kinds: ``empty`` (nothing), ``rooms`` (rooms one after the other through the sender),
    ``reference`` (the same on BareRooms), a step of :data:`STEPS` (that step for a batch
    in flight), ``batch`` (a whole batch in flight: open all, init all, send, poll, clear).
    """

    name: str
    kind: str
    chunks: int = BASE_CHUNKS
    sessions: int = 1
    batch: int = 0
    """Rooms in flight (``batch`` and step kinds); 0: the window's rooms one by one."""

    def rooms(self, base: int) -> int:
        """Rooms this window runs: ``base`` for the base room, else as many chunk sends as
        ``base`` base rooms (at least 2), or the batch."""
        if self.kind == "empty":
            return 1  # divides nothing: its count is subtracted, not reported per room
        if self.batch:
            return self.batch
        return max(2, base * BASE_CHUNKS // (self.chunks * self.sessions))


def windows(base_rooms: int) -> tuple[Window, ...]:
    """Every window, in the order they run (steps run in this order on one batch)."""
    return (
        Window("empty", "empty"),
        Window("sender", "rooms"),
        Window("sender again", "rooms"),
        Window("reference", "reference"),
        *(Window(step, step, batch=base_rooms) for step in STEPS),
        *(Window(f"chunks {c}", "rooms", chunks=c) for c in CHUNK_GROWTH),
        *(Window(f"sessions {n}", "rooms", sessions=n) for n in SESSION_GROWTH),
        *(Window(f"in flight {b}", "batch", batch=b) for b in IN_FLIGHT),
    )


WINDOW_NAMES = tuple(w.name for w in windows(1))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench._callgrind_child")
    parser.add_argument("--rooms", type=int, default=32, help="rooms of the base windows")
    parser.add_argument("--pages", type=int, default=16, help="pages per chunk")
    return parser


class _Work:
    """The rooms of every window, on one manager and one reference."""

    def __init__(self, pages: int) -> None:
        import torch

        from bench._bare_room import BareRooms
        from bench._noop import NoopTransport
        from sender.manager import KVManager

        if max(CHUNK_GROWTH) * pages > KV_PAGES:
            raise SystemExit(f"{max(CHUNK_GROWTH)} chunks x {pages} pages exceed {KV_PAGES}")
        self.pages = pages
        kv = torch.zeros((KV_PAGES, PAGE_BYTES), dtype=torch.uint8)
        self.mgr = KVManager(NoopTransport(), kv, num_workers=0, debug=False)
        self.ref = BareRooms(NoopTransport())
        # Room ids above CPython's small-int cache and of one width: every window's ids
        # are allocated ints whose notification text has the same length.
        self.next_room = FIRST_ROOM
        self.batch: list[NixlKVSender] = []
        self._shapes: dict[tuple[int, int], tuple[list[str], PageArray, list[PageArray]]] = {}

    def shape(self, chunks: int, sessions: int) -> tuple[list[str], PageArray, list[PageArray]]:
        """Sessions, destination pages and per-chunk source pages of a room (made once)."""
        import numpy as np

        key = (chunks, sessions)
        if key not in self._shapes:
            p = self.pages
            self._shapes[key] = (
                [f"{SESSION_PREFIX}{i}" for i in range(sessions)],
                np.arange(chunks * p, dtype=np.int64),
                [np.arange(c * p, (c + 1) * p, dtype=np.int64) for c in range(chunks)],
            )
        return self._shapes[key]

    def _room_id(self) -> int:
        room = self.next_room
        self.next_room += 1
        return room

    def sender_rooms(self, n: int, chunks: int, sessions: int) -> None:
        from sender.manager import make_transfer_info
        from sender.nixl_sender import NixlKVSender
        from sender.poll import KVPoll

        sids, dst, srcs = self.shape(chunks, sessions)
        for _ in range(n):
            infos = [make_transfer_info(sid, dst) for sid in sids]
            snd = NixlKVSender(self.mgr, self._room_id(), sids, infos)
            snd.init(chunks * self.pages)
            for chunk in srcs:
                snd.send(chunk)
            while snd.poll() is not KVPoll.Success:
                pass
            snd.clear()

    def reference_rooms(self, n: int, chunks: int, sessions: int) -> None:
        sids, dst, srcs = self.shape(chunks, sessions)
        ref, pages, last = self.ref, self.pages, chunks - 1
        for _ in range(n):
            room = self._room_id()
            ref.open(room, {sid: dst for sid in sids})
            ref.init(room, chunks * pages)
            for c, chunk in enumerate(srcs):
                ref.send(room, c, c * pages, chunk, c == last)
            while not ref.poll(room):
                pass
            ref.clear(room)

    def step(self, name: str, n: int, chunks: int, sessions: int) -> None:
        """One step of the sender for ``n`` rooms in flight (``open`` makes the batch)."""
        from sender.manager import make_transfer_info
        from sender.nixl_sender import NixlKVSender
        from sender.poll import KVPoll

        sids, dst, srcs = self.shape(chunks, sessions)
        senders = self.batch
        if name == "open":
            self.batch = [
                NixlKVSender(
                    self.mgr,
                    self._room_id(),
                    sids,
                    [make_transfer_info(sid, dst) for sid in sids],
                )
                for _ in range(n)
            ]
        elif name == "init":
            for snd in senders:
                snd.init(chunks * self.pages)
        elif name == "send":
            for chunk in srcs:
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

    def run(self, window: Window, rooms: int) -> None:
        """The work of ``window`` (``rooms`` rooms)."""
        c, s = window.chunks, window.sessions
        if window.kind == "empty":
            return
        if window.kind == "rooms":
            self.sender_rooms(rooms, c, s)
        elif window.kind == "reference":
            self.reference_rooms(rooms, c, s)
        elif window.kind == "batch":
            for step in STEPS:
                self.step(step, rooms, c, s)
        else:
            self.step(window.kind, rooms, c, s)

    def warm_up(self, plan: Sequence[tuple[Window, int]]) -> None:
        """Every kind of work at every shape and batch size, before anything is counted."""
        self.sender_rooms(WARMUP_ROOMS, BASE_CHUNKS, 1)
        self.reference_rooms(WARMUP_ROOMS, BASE_CHUNKS, 1)
        for _ in range(2):
            for window, rooms in plan:
                if window.kind in ("rooms", "reference"):
                    self.run(window, min(rooms, 4))
                elif window.kind == "batch" or window.kind == STEPS[0]:
                    for step in STEPS:
                        self.step(step, rooms, window.chunks, window.sessions)


def main(argv: Sequence[str] | None = None) -> int:
    """Set up, warm up, wait for the parent's line, run the windows (module docstring)."""
    args = _parser().parse_args(argv)
    if min(args.rooms, args.pages) < 1:
        raise SystemExit("--rooms and --pages must be >= 1")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    work = _Work(args.pages)
    plan = [(w, w.rooms(args.rooms)) for w in windows(args.rooms)]
    work.warm_up(plan)
    callback = ctypes.CFUNCTYPE(None)
    # Made before the windows: building a callback allocates a libffi closure.
    calls = [callback(functools.partial(work.run, w, rooms)) for w, rooms in plan]
    print("READY", flush=True)
    sys.stdin.readline()
    for call in calls:
        gc.collect()
        gc.disable()
        try:
            call()
        finally:
            gc.enable()
    print("WINDOWS " + ",".join(f"{w.name}:{rooms}" for w, rooms in plan), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
