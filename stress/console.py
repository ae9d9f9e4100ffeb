"""One terminal shared by a status line (the progress line, redrawn in place) and the text
other code prints meanwhile.

:class:`Console` owns the status line: text written through it (:meth:`Console.write`, or a
:class:`ConsoleStream` installed as ``sys.stdout``/``sys.stderr``) first erases the status
line, then is written, then the status line is drawn again below it; nothing breaks into the
middle of the status line and the status line is never lost under other output.

Thread-safety: every method may be called from any thread; ``_lock`` serialises all writes
to the terminal (held only across ``write``/``flush`` calls on the streams, never across
anything else).
"""

from __future__ import annotations

import io
import threading
from typing import IO

_ERASE = "\r\x1b[K"


class Console:
    """A status line on ``stream`` (a terminal) plus whole lines printed above it.

    Args:
        stream: Where the status line is drawn (stderr's terminal).
    """

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lock = threading.Lock()  # guards _status, _midline and all writes
        self._status: str | None = None  # the status line on screen, or None
        self._midline = False  # the last text written did not end its line

    @property
    def stream(self) -> IO[str]:
        """The terminal stream the status line is drawn on."""
        return self._stream

    def status(self, text: str) -> None:
        """Draw (or redraw) the status line as ``text``. Raises: nothing but the stream's
        own errors."""
        with self._lock:
            if self._midline:  # never draw over a line someone else left unfinished
                self._stream.write("\n")
                self._midline = False
            self._status = text
            self._stream.write("\r" + text + "\x1b[K")
            self._stream.flush()

    def end_status(self) -> None:
        """Leave the status line as it is on screen and end it (a newline); later text is
        printed below it. Raises: only the stream's own errors."""
        with self._lock:
            if self._status is not None:
                self._stream.write("\r" + self._status + "\x1b[K\n")
                self._stream.flush()
                self._status = None

    def write(self, text: str, target: IO[str] | None = None) -> None:
        """Write ``text`` to ``target`` (default: the console's own stream) above the status
        line: the status line is erased first and drawn again after ``text`` if ``text``
        ended its line (else once the next status is drawn, below it). Raises: only the
        streams' own errors."""
        if not text:
            return
        out = self._stream if target is None else target
        with self._lock:
            shown = self._status is not None and not self._midline
            if shown:
                self._stream.write(_ERASE)
                self._stream.flush()
            out.write(text)
            out.flush()
            self._midline = not text.endswith("\n")
            if self._status is not None and not self._midline:
                self._stream.write(self._status + "\x1b[K")
                self._stream.flush()

    def line(self, text: str) -> None:
        """Print ``text`` as one whole line above the status line. Raises: only the
        streams' own errors."""
        self.write(text if text.endswith("\n") else text + "\n")


class ConsoleStream(io.TextIOBase):
    """A text stream whose writes go through a :class:`Console` to ``target`` (install it as
    ``sys.stdout``/``sys.stderr`` while a status line is shown). ``fileno()`` and
    ``isatty()`` are the target's, so ``faulthandler`` still writes to the right place."""

    def __init__(self, console: Console, target: IO[str]) -> None:
        super().__init__()
        self._console = console
        self._target = target

    @property
    def target(self) -> IO[str]:
        """The stream written to."""
        return self._target

    def write(self, text: str) -> int:
        self._console.write(text, self._target)
        return len(text)

    def flush(self) -> None:
        self._target.flush()

    def fileno(self) -> int:
        return self._target.fileno()

    def isatty(self) -> bool:
        return self._target.isatty()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._target, "encoding", "utf-8")
