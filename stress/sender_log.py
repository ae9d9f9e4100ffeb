"""The library's own log records during a stress run: counted by kind, not printed.

A stress run fails rooms on purpose (killed and stopped peers, injected transport faults), and
the sender logs one ``WARNING`` per failed room (docs/LOGGING.md): a passing ``make stress``
fails some thousands. Printed, they would bury the report and break the progress line, as the
NIXL lines did (:mod:`stress.native_stderr`). :class:`SenderLog` takes them instead: while it
is started, the ``sender``, ``staging`` and ``stress.harness`` loggers hand their records to
it and stop propagating; it counts them by logger, level and message template
(``record.msg``, the format string before its arguments, so each kind of line is one row) and
keeps the first few formatted lines of each kind as examples.
``--sender-log show`` leaves logging alone.

Thread safety: records arrive from any thread; ``logging.Handler.handle`` calls :meth:`emit`
under the handler's own lock, and :meth:`SenderLog.take` reads and resets the counts under
that same lock.
"""

from __future__ import annotations

import logging
from collections import Counter

from stress.native_stderr import NativeLines

LOGGERS = ("sender", "staging", "stress.harness")
"""The loggers captured: the library's two packages and the harness (the decode peer and the
fault injector log under it)."""

EXAMPLES_PER_KIND = 2
"""Formatted lines kept per kind."""


LogCounts = NativeLines
"""Log records of one stretch of a run: counts and first examples per kind
(``"logger LEVEL: format"``), the same shape as the NIXL/UCX line counts."""


def kind_of(record: logging.LogRecord) -> str:
    """The row a record is counted in: its logger, level and format string."""
    return f"{record.name} {record.levelname}: {record.msg}"


def level_of(kind: str) -> str:
    """The level name of a :func:`kind_of` row (``""`` if it is not one)."""
    _, sep, rest = kind.partition(" ")
    level, colon, _ = rest.partition(": ")
    return level if sep and colon else ""


class SenderLog(logging.Handler):
    """Counts the library's log records while started (see the module docstring).

    Guarded by the handler's lock (``self.lock``, taken by ``handle``): ``_counts`` and
    ``_examples``; mutate only under it.
    """

    def __init__(self) -> None:
        super().__init__(level=logging.NOTSET)
        self._counts: Counter[str] = Counter()
        self._examples: dict[str, list[str]] = {}
        self._saved: list[tuple[logging.Logger, bool]] = []

    @property
    def active(self) -> bool:
        """``True`` between :meth:`start` and :meth:`stop`."""
        return bool(self._saved)

    def start(self) -> None:
        """Take the records of :data:`LOGGERS` (no propagation to the root's handlers, so
        ``logging.lastResort`` prints nothing either). Call once, from the main thread;
        raises nothing."""
        if self._saved:
            return
        for name in LOGGERS:
            lg = logging.getLogger(name)
            self._saved.append((lg, lg.propagate))
            lg.addHandler(self)
            lg.propagate = False

    def stop(self) -> None:
        """Give the loggers back as they were. Idempotent; raises nothing."""
        while self._saved:
            lg, propagate = self._saved.pop()
            lg.removeHandler(self)
            lg.propagate = propagate

    def emit(self, record: logging.LogRecord) -> None:
        """Count ``record`` (called by ``handle`` under the handler's lock)."""
        kind = kind_of(record)
        self._counts[kind] += 1
        kept = self._examples.setdefault(kind, [])
        if len(kept) < EXAMPLES_PER_KIND:
            try:
                kept.append(record.getMessage())
            except Exception as exc:  # a bad format string is still a record: keep why
                kept.append(f"{record.msg!r} (unformattable: {exc!r})")

    def take(self) -> LogCounts:
        """What was counted since the last ``take``, and reset. Thread-safe; raises
        nothing."""
        self.acquire()
        try:
            counts, examples = dict(self._counts), self._examples
            self._counts, self._examples = Counter(), {}
        finally:
            self.release()
        return LogCounts(counts, {k: tuple(v) for k, v in examples.items()})
