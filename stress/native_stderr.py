"""The lines NIXL and UCX write straight to fd 2, counted and labelled instead of mixed into
the report.

NIXL's C++ agent logs errors to stderr (glog lines like ``E1201 22:25:42.26 27610
nixl_agent.cpp:1437] genNotif: ... NIXL_ERR_REMOTE_DISCONNECT ...``) and UCX prints its own
warnings (``... mpool.c:... UCX WARN object ... was not returned to mpool ...``). In a stress
run most of them are expected: peers are killed on purpose, and a sender that talks to a
peer that has just died makes NIXL log it. Python cannot see these lines: they bypass
``sys.stderr``. :class:`NativeStderr` puts a pipe on fd 2 and a reader thread behind it that

* classifies each line by :data:`CLASSES` (first match wins) and counts it, keeping the first
  few of each class as examples, instead of printing it;
* forwards every other line unchanged to the real stderr (through the :class:`Console` when
  a progress line is shown, so the progress line survives: it is erased, the line printed,
  and redrawn).

While it is active, a ``sys.stderr`` that was the process's own (``sys.__stderr__``) is
replaced by a stream on the real stderr (a duplicate of the original fd 2), so Python's own
writes (tracebacks, ``faulthandler`` dumps, a last message before ``os._exit``) do not wait
in the pipe; under a test runner's capture ``sys.stderr`` is left alone. Child processes
that inherit fd 2 (decode peers) write into the pipe and their native lines are counted too.

Thread-safety: ``start``/``stop`` from one thread (the CLI's); the other methods from any
thread. ``_lock`` guards the counts, the examples and the console reference and is never
held across a write to the terminal.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import select
import sys
import threading
import uuid
from dataclasses import dataclass, field
from typing import IO

from stress.console import Console

__all__ = [
    "CLASSES",
    "LineClass",
    "NativeLines",
    "NativeStderr",
    "classify",
    "count_lines",
    "merge",
]


@dataclass(frozen=True)
class LineClass:
    """One kind of native line: a name (the report's label), what it means, and its regex."""

    name: str
    meaning: str
    pattern: re.Pattern[str]


def _cls(name: str, meaning: str, pattern: str) -> LineClass:
    return LineClass(name, meaning, re.compile(pattern))


CLASSES: tuple[LineClass, ...] = (
    _cls(
        "nixl-notif-to-dead-peer",
        "NIXL genNotif: a notification (a room notice) sent to an agent that had already "
        "disconnected (its peer was killed)",
        r"nixl_agent\.cpp:\d+\]\s*genNotif:.*NIXL_ERR_REMOTE_DISCONNECT",
    ),
    _cls(
        "nixl-post-to-dead-peer",
        "NIXL postXferReq: a write posted to an agent that disconnected (its peer was killed) "
        "after the request was made",
        r"nixl_agent\.cpp:\d+\]\s*postXferReq:.*disconnected",
    ),
    _cls(
        "nixl-agent-error",
        "another NIXL agent error or warning (nixl_agent.cpp)",
        r"^[EWF]\d{4} [\d:.]+\s+\d+ nixl_agent\.cpp:\d+\]",
    ),
    _cls(
        "ucx-unexpected-error",
        "NIXL's UCX backend: 'Unexpected UCX error' (a connection to a killed peer broke)",
        r"Unexpected UCX error",
    ),
    _cls(
        "ucx-mpool-not-returned",
        "UCX at agent teardown: request objects not returned to a memory pool (endpoints of "
        "a killed peer)",
        r"was not returned to mpool",
    ),
    _cls(
        "nixl-other",
        "any other glog line of NIXL/UCX native code",
        r"^[IWEF]\d{4} [\d:.]+\s+\d+ \S+\.(cpp|cc|c|h):\d+\]",
    ),
    _cls("ucx-other", "any other UCX log line", r"\bUCX\s+(ERROR|WARN|FATAL|DIAG)\b"),
)
"""The classes, most specific first."""

MAX_EXAMPLES = 3
"""Example lines kept per class (the count is exact)."""


def classify(line: str, classes: tuple[LineClass, ...] = CLASSES) -> str | None:
    """The name of the first class ``line`` matches, or ``None`` (forward it). Pure;
    raises nothing."""
    for c in classes:
        if c.pattern.search(line):
            return c.name
    return None


@dataclass(frozen=True)
class NativeLines:
    """What :class:`NativeStderr` counted over a span: count and first examples per class."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Lines counted over all classes."""
        return sum(self.counts.values())


def count_lines(text: str, classes: tuple[LineClass, ...] = CLASSES) -> NativeLines:
    """Classify the lines of ``text`` (e.g. a child process's own stderr, read from a file)
    like :class:`NativeStderr` does; unclassified lines are not counted. Pure; raises
    nothing."""
    counts: dict[str, int] = {}
    examples: dict[str, list[str]] = {}
    for line in text.splitlines():
        name = classify(line, classes)
        if name is not None:
            counts[name] = counts.get(name, 0) + 1
            kept = examples.setdefault(name, [])
            if len(kept) < MAX_EXAMPLES:
                kept.append(line)
    return NativeLines(counts, {k: tuple(v) for k, v in examples.items()})


def merge(a: NativeLines | None, b: NativeLines | None) -> NativeLines | None:
    """``a`` and ``b`` added up (examples: ``a``'s first, up to :data:`MAX_EXAMPLES`);
    ``None`` only when both are. Pure; raises nothing."""
    if a is None or b is None:
        return a if b is None else b
    counts = dict(a.counts)
    examples = {k: list(v) for k, v in a.examples.items()}
    for name, n in b.counts.items():
        counts[name] = counts.get(name, 0) + n
    for name, lines in b.examples.items():
        kept = examples.setdefault(name, [])
        kept += list(lines)[: max(0, MAX_EXAMPLES - len(kept))]
    return NativeLines(counts, {k: tuple(v) for k, v in examples.items()})


class NativeStderr:
    """fd 2 through a pipe and a classifying reader thread (see the module docstring).

    Args:
        classes: The line classes (first match wins).
        show: Also forward classified lines, each prefixed ``[native:<class>]``.
    """

    def __init__(self, classes: tuple[LineClass, ...] = CLASSES, *, show: bool = False) -> None:
        self._classes = classes
        self._show = show
        self._lock = threading.Lock()  # guards _counts, _examples, _console
        self._counts: dict[str, int] = {}
        self._examples: dict[str, list[str]] = {}
        self._console: Console | None = None
        self._marker = f"<<nixl-staging-native-sync-{uuid.uuid4().hex}>>"
        self._synced = threading.Condition(threading.Lock())  # guards _seen_syncs
        self._seen_syncs = 0
        self._syncs = 0
        self._saved_fd: int | None = None
        self._read_fd: int | None = None
        self._stderr: IO[str] | None = None  # Python's stderr while active (real stderr)
        self._old_stderr: IO[str] | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def active(self) -> bool:
        """``True`` between :meth:`start` and :meth:`stop`."""
        return self._thread is not None

    @property
    def stderr(self) -> IO[str]:
        """The real stderr as a text stream (``sys.stderr`` while active)."""
        return self._stderr if self._stderr is not None else sys.stderr

    def start(self) -> None:
        """Put the pipe on fd 2 and start the reader. Idempotent while active.

        Raises:
            OSError: the pipe or the fd duplication failed (nothing changed then).
        """
        if self._thread is not None:
            return
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        saved = os.dup(2)
        try:
            read_fd, write_fd = os.pipe()
        except OSError:
            os.close(saved)
            raise
        with contextlib.suppress(OSError, AttributeError):  # Linux: room for bursts
            fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, 1 << 20)
        os.set_inheritable(saved, False)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._saved_fd, self._read_fd = saved, read_fd
        self._stderr = open(  # noqa: SIM115 (closed in stop())
            saved, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False
        )
        self._old_stderr = None
        if sys.stderr is sys.__stderr__:
            self._old_stderr = sys.stderr
            sys.stderr = self._stderr
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="native-stderr", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Read what is left (bounded by ``timeout_s``), put the real stderr back on fd 2 and
        ``sys.stderr``, and end the reader. Idempotent. Raises: nothing."""
        thread = self._thread
        if thread is None:
            return
        self.sync(timeout_s / 2)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        if self._old_stderr is not None and sys.stderr is self._stderr:
            sys.stderr = self._old_stderr
        assert self._saved_fd is not None and self._read_fd is not None
        os.dup2(self._saved_fd, 2)  # the pipe's write end stays with live children only
        self._stopping.set()
        thread.join(timeout_s)
        self._thread = None
        if not thread.is_alive():
            os.close(self._read_fd)
        if self._stderr is not None:
            with contextlib.suppress(Exception):
                self._stderr.close()
        os.close(self._saved_fd)
        self._saved_fd = self._read_fd = None
        self._stderr = None

    def __enter__(self) -> NativeStderr:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ use

    def attach(self, console: Console | None) -> None:
        """Forward lines through ``console`` (a progress line is shown), or straight to the
        real stderr (``None``). Thread-safe; raises nothing."""
        with self._lock:
            self._console = console

    def sync(self, timeout_s: float = 1.0) -> bool:
        """Wait until every byte this process wrote to fd 2 before the call has been read
        (a marker line goes through the pipe). ``False`` if it did not come back in time or
        the capture is not active. Raises: nothing."""
        if self._thread is None:
            return False
        with self._synced:
            self._syncs += 1
            want = self._syncs
        try:
            os.write(2, f"{self._marker}\n".encode())
        except OSError:
            return False
        with self._synced:
            return self._synced.wait_for(lambda: self._seen_syncs >= want, timeout_s)

    def take(self) -> NativeLines:
        """What was counted since the last :meth:`take` (then reset). Thread-safe; raises
        nothing."""
        with self._lock:
            counts, examples = self._counts, self._examples
            self._counts, self._examples = {}, {}
        return NativeLines(dict(counts), {k: tuple(v) for k, v in examples.items()})

    # ------------------------------------------------------------------ the reader

    def _run(self) -> None:
        assert self._read_fd is not None
        fd = self._read_fd
        pending = b""
        while True:
            try:
                ready, _, _ = select.select([fd], [], [], 0.05)
            except (OSError, ValueError):
                break
            if not ready:
                if self._stopping.is_set():
                    break
                continue
            try:
                data = os.read(fd, 1 << 16)
            except OSError:
                break
            if not data:
                break
            pending += data
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                self._line(raw)
        if pending:
            self._line(pending)

    def _line(self, raw: bytes) -> None:
        try:
            text = raw.decode("utf-8", errors="backslashreplace").rstrip("\r")
            if self._marker in text:  # may end another writer's unfinished line
                text = text.replace(self._marker, "")
                with self._synced:
                    self._seen_syncs += 1
                    self._synced.notify_all()
                if not text:
                    return
            name = classify(text, self._classes)
            if name is not None:
                with self._lock:
                    self._counts[name] = self._counts.get(name, 0) + 1
                    kept = self._examples.setdefault(name, [])
                    if len(kept) < MAX_EXAMPLES:
                        kept.append(text)
                if not self._show:
                    return
                text = f"[native:{name}] {text}"
            self._emit(text)
        except Exception:  # never lose a line, never kill the reader (writers would block)
            self._raw(raw + b"\n")

    def _emit(self, text: str) -> None:
        with self._lock:
            console = self._console
        if console is not None:
            console.line(text)
        else:
            self._raw((text + "\n").encode("utf-8", errors="backslashreplace"))

    def _raw(self, data: bytes) -> None:
        fd = self._saved_fd
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.write(fd, data)
