"""Prometheus metrics of a sender (the optional ``metrics`` extra: ``prometheus-client``).

* :class:`SenderCollector`: at each scrape, reads the ``stats()`` of a manager, transport,
  staging context (and its lock) and slot pool, each optional; never calls into NIXL.
* :class:`LatencyHistograms`: a :class:`~sender.events.ManagerEvents` listener (room and
  chunk latency by outcome, rooms by outcome and reason code).

Names, labels, meanings and usage: docs/METRICS.md. Without ``prometheus_client``, importing
this module raises :class:`ModuleNotFoundError` naming the extra.
"""

from __future__ import annotations

import itertools
import math
import re
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from staging._version import install_extra_hint

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
except ModuleNotFoundError as _exc:  # the core install and the sender extra lack it
    raise ModuleNotFoundError(
        "sender.metrics needs the 'metrics' extra (no module 'prometheus_client'): "
        + install_extra_hint("metrics"),
        name="prometheus_client",
    ) from _exc

from sender.events import CHUNK_OUTCOMES, ROOM_CODES, ROOM_OUTCOMES

__all__ = [
    "CHUNK_BUCKETS_S", "NAMESPACE", "ROOM_BUCKETS_S", "LatencyHistograms", "SenderCollector",
]

NAMESPACE = "nixl_staging"
"""Prefix of every metric name."""

ROOM_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
"""Room latency buckets (seconds): a healthy room takes ms, a failed one up to a deadline."""

CHUNK_BUCKETS_S: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
"""Chunk latency buckets (seconds): from a small write's tens of µs to a transfer deadline."""

_LABEL_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_OTHER = "other"


class _HasStats(Protocol):
    def stats(self) -> Any: ...


def _check_labels(labels: Mapping[str, str] | None, reserved: Iterable[str]) -> dict[str, str]:
    out = dict(labels or {})
    taken = set(reserved)
    for name, value in out.items():
        if not isinstance(name, str) or not _LABEL_RE.fullmatch(name) or name.startswith("__"):
            raise ValueError(f"bad Prometheus label name {name!r}")
        if name in taken:
            raise ValueError(f"label {name!r} is one of this module's own labels {sorted(taken)}")
        if not isinstance(value, str):
            raise TypeError(f"label {name!r}: value must be a str, got {type(value).__name__}")
    return out


def _number(stats: object, field: str) -> float | None:
    """``stats.field`` as a number, or ``None`` when absent (a field not there yet)."""
    value = getattr(stats, field, None)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


class _Families:
    """Builds the metric families of one scrape, with the collector's constant labels."""

    def __init__(self, namespace: str, const: Mapping[str, str]) -> None:
        self._ns = namespace
        self._const = dict(const)
        self.out: dict[str, Metric] = {}

    def add(self, kind: str, name: str, doc: str, value: float | None, **labels: str) -> None:
        """One sample of ``kind`` (``"counter"``/``"gauge"``) ``name`` (a counter's without
        ``_total``); ``None`` adds nothing."""
        if value is None:
            return
        full = f"{self._ns}_{name}"
        fam = self.out.get(full)
        if fam is None:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            fam = self.out[full] = cls(full, doc, labels=[*self._const, *labels])
        fam.add_metric([*self._const.values(), *labels.values()], value)  # type: ignore[attr-defined]


_Row = tuple[str, str, str, str, Mapping[str, str]]
"""``(kind, name, stats field, doc, labels)``: one sample of a scrape (:meth:`_Families.add`),
its value the source's ``stats()`` field."""


def _by(
    kind: str, name: str, doc: str, label: str, fields: Sequence[tuple[str, str]]
) -> tuple[_Row, ...]:
    """The rows of one family whose samples differ by ``label``: ``(label value, field)``."""
    return tuple((kind, name, field, doc, {label: value}) for value, field in fields)


def _add_rows(f: _Families, st: Any, rows: Sequence[_Row], **labels: str) -> None:
    """Add ``rows`` read from ``st`` (``None``: nothing); ``labels`` come first."""
    if st is None:
        return
    for kind, name, field, doc, own in rows:
        f.add(kind, name, doc, _number(st, field), **labels, **own)


_LATE_WRITES = "writes for a purged or reopened room, refused"

_MANAGER_ROOM_ROWS: tuple[_Row, ...] = (
    ("gauge", "rooms_open", "open_rooms", "rooms open now (opened, not yet purged)", {}),
    ("counter", "rooms_opened", "rooms_opened", "rooms opened", {}),
    *_by("counter", "rooms_concluded",
         "rooms concluded, by outcome (success, failed, cleared before concluding)", "outcome",
         (("success", "rooms_succeeded"), ("failed", "rooms_failed"),
          ("cleared", "rooms_cleared"))),
)  # fmt: skip
"""A manager's rows before ``rooms_failed`` by code; :data:`_MANAGER_ROWS` after it."""

_MANAGER_ROWS: tuple[_Row, ...] = (
    ("counter", "room_purges", "purges", "room purges (clear, abort, failure_exception)", {}),
    ("counter", "sessions_failed", "sessions_failed",
     "decode sessions failed as a whole (peer dead or hung)", {}),
    ("counter", "chunks_submitted", "chunks_submitted", "chunks submitted", {}),
    *_by("counter", "chunks_ended",
         "chunks ended, by outcome (done + failed + skipped + drained = submitted)", "outcome",
         [(outcome, f"chunks_{outcome}") for outcome in CHUNK_OUTCOMES]),
    ("counter", "chunks_released_by_transport", "chunks_released_by_transport",
     "chunks whose transfer the transport released (peer removed)", {}),
    ("gauge", "transfers_in_flight", "transfers_inflight",
     "chunk transfers posted for open rooms, not yet ended", {}),
    ("gauge", "transfers_draining", "transfers_draining",
     "chunk transfers posted for purged rooms, not yet ended (their pages are not free)", {}),
    ("counter", "transfers_abandoned", "transfers_abandoned",
     "hung transfers given up at close", {}),
    ("counter", "late_writes_refused", "refused_late_writes", _LATE_WRITES,
     {"component": "manager"}),
    ("counter", "worker_errors", "worker_errors", "unexpected errors in transfer workers", {}),
    *_by("counter", "room_notices", "room notices to decode sessions, by result", "result",
         (("sent", "notices_sent"), ("failed", "notices_failed"),
          ("withheld", "notices_withheld"), ("skipped_dead", "notices_skipped_dead"))),
    ("counter", "posted_bytes", "bytes_posted",
     "payload bytes of posted chunks (every posted write, counted at its end)", {}),
)  # fmt: skip

_TRANSPORT_ROWS: tuple[_Row, ...] = (
    ("counter", "transport_transfers_started", "transfers_started",
     "transfers posted to NIXL", {}),
    *_by("counter", "transport_transfers_ended", "transfers ended, by outcome", "outcome",
         (("done", "transfers_done"), ("failed", "transfers_failed"),
          ("timed_out", "transfers_timed_out"))),
    ("counter", "transport_transfers_released", "transfers_released",
     "transfer handles released", {}),
    ("gauge", "transport_transfers_live", "live_transfers",
     "transfer handles not yet released", {}),
    ("counter", "transport_release_refused", "release_refused",
     "handle releases NIXL refused (active, cannot cancel; retried at close)", {}),
    ("gauge", "transport_peers", "peers", "decode peers added", {}),
    ("gauge", "transport_regions", "regions", "memory regions registered", {}),
)  # fmt: skip

_STAGING_ROWS: tuple[_Row, ...] = (
    ("gauge", "context_rooms_open", "open_rooms", "staging rooms open", {}),
    ("gauge", "context_rooms_prefetched", "prefetched_rooms", "staging rooms prefetched", {}),
    ("gauge", "context_prefetch_keys", "requested_keys", "prefetch keys requested", {}),
    ("counter", "context_rooms_opened", "rooms_opened", "staging rooms opened", {}),
    ("counter", "context_purges", "purges", "staging room purges", {}),
    ("counter", "context_session_purges", "session_purges", "staging session purges", {}),
    ("counter", "late_writes_refused", "refused_late_writes", _LATE_WRITES,
     {"component": "staging"}),
)  # fmt: skip

_LOCK_ROWS: tuple[_Row, ...] = (
    *_by("counter", "lock_acquisitions", "lock acquisitions, by lock and mode", "mode",
         (("read", "read_acquisitions"), ("write", "write_acquisitions"))),
    ("counter", "lock_contended", "contended",
     "acquisitions that found the lock busy (measured for mutexes, and for RW "
     "locks in debug mode; 0 otherwise)", {}),
    ("counter", "lock_timeouts", "timeouts", "lock waits that timed out", {}),
)  # fmt: skip
"""Added per lock, labelled ``lock`` (first) by its name."""

_POOL_ROWS: tuple[_Row, ...] = (
    ("gauge", "pool_slots", "num_slots", "staging slots in the pool", {}),
    ("gauge", "pool_slots_in_use", "in_use", "staging slots leased now", {}),
    ("gauge", "pool_slots_free", "free", "staging slots free now", {}),
    ("gauge", "pool_owners", "owners", "owners holding staging slots now", {}),
    ("counter", "pool_acquisitions", "acquired", "staging slots leased", {}),
    ("counter", "pool_releases", "released", "staging slots returned", {}),
    ("counter", "pool_exhausted", "exhausted", "lease attempts that found no free slot", {}),
)


class SenderCollector:
    """A Prometheus collector over the ``stats()`` of a sender's parts (each optional).

    Args:
        manager: A ``KVManager``, or ``None``.
        transport: A ``NixlTransport``, or ``None``.
        staging: A ``StagingContext`` (its lock's stats too), or ``None``.
        pool: A ``StagingBufferPool``, or ``None``.
        locks: More locks of the model (anything whose ``stats()`` is a ``LockStats``).
        labels: Constant labels added to every sample (e.g. ``{"engine": "prefill-0"}``).
        namespace: Metric name prefix.

    Thread-safety: ``collect()`` may run on any thread, also beside another ``collect()``.
    ``_lock`` guards the scrape-error counts only.

    Raises:
        TypeError: A source has no callable ``stats``; a label value is not a ``str``.
        ValueError: A bad label name, or one of this module's own label names.
    """

    _OWN_LABELS = ("outcome", "code", "result", "component", "lock", "mode", "source")

    def __init__(
        self, manager: _HasStats | None = None, transport: _HasStats | None = None,
        staging: _HasStats | None = None, pool: _HasStats | None = None, *,
        locks: Sequence[_HasStats] = (), labels: Mapping[str, str] | None = None,
        namespace: str = NAMESPACE,
    ) -> None:
        sources = {"manager": manager, "transport": transport, "staging": staging, "pool": pool}
        sources.update((f"lock[{i}]", lock) for i, lock in enumerate(locks))
        for what, source in sources.items():
            if source is not None and not callable(getattr(source, "stats", None)):
                raise TypeError(f"{what}: {type(source).__name__} has no callable stats()")
        if not _LABEL_RE.fullmatch(namespace):
            raise ValueError(f"bad metric namespace {namespace!r}")
        self._sources = sources  # manager, transport, staging, pool, then lock[i]
        self._labels = _check_labels(labels, self._OWN_LABELS)
        self._namespace = namespace
        self._lock = threading.Lock()  # guards _scrape_errors
        self._scrape_errors: dict[str, int] = {}

    @classmethod
    def from_manager(
        cls, manager: Any, *, labels: Mapping[str, str] | None = None, namespace: str = NAMESPACE
    ) -> SenderCollector:
        """A collector over ``manager`` and its ``transport``, ``staging`` and
        ``staging_pool``.

        Raises:
            TypeError, ValueError: as the constructor.
        """
        parts = (getattr(manager, name, None) for name in ("transport", "staging", "staging_pool"))
        return cls(manager, *parts, labels=labels, namespace=namespace)

    def scrape_errors(self) -> dict[str, int]:
        """``stats()`` calls that raised during scrapes, by source. Thread-safe; raises nothing."""
        with self._lock:
            return dict(self._scrape_errors)

    def _stats(self, what: str) -> Any:
        source = self._sources[what]
        if source is None:
            return None
        try:
            return source.stats()
        except Exception:  # a closed/broken source is left out of this scrape, counted
            with self._lock:
                self._scrape_errors[what] = self._scrape_errors.get(what, 0) + 1
            return None

    def collect(self) -> Iterator[Metric]:
        """The metric families of one scrape. Raises: nothing from the sources (a failing
        ``stats()`` is left out and counted, :meth:`scrape_errors`)."""
        f = _Families(self._namespace, self._labels)
        manager = self._stats("manager")
        _add_rows(f, manager, _MANAGER_ROOM_ROWS)
        by_code = getattr(manager, "rooms_failed_by_code", None)
        if isinstance(by_code, Mapping):
            doc = "failed rooms, by reason code (the room-notice codes of sender.notices)"
            for code, count in sorted(by_code.items()):
                if isinstance(count, int) and not isinstance(count, bool):
                    f.add("counter", "rooms_failed", doc, float(count), code=str(code))
        _add_rows(f, manager, _MANAGER_ROWS)
        _add_rows(f, self._stats("transport"), _TRANSPORT_ROWS)
        staging = self._stats("staging")
        _add_rows(f, staging, _STAGING_ROWS)
        lock_stats = [getattr(staging, "lock", None)] if staging is not None else []
        lock_stats += [self._stats(what) for what in self._sources if what.startswith("lock[")]
        for st in lock_stats:
            _add_rows(f, st, _LOCK_ROWS, lock=str(getattr(st, "name", "?")))
        _add_rows(f, self._stats("pool"), _POOL_ROWS)
        errors = self.scrape_errors()
        doc = "stats() calls that raised during a scrape (that source was left out)"
        f.add("counter", "scrape_errors", doc, 0.0, source="none")  # the family always exists
        for source, n in sorted(errors.items()):
            f.add("counter", "scrape_errors", doc, float(n), source=source)
        yield from f.out.values()


def _check_buckets(buckets: Sequence[float], what: str) -> tuple[float, ...]:
    out = tuple(float(b) for b in buckets)
    if not out or any(not (b > 0 and math.isfinite(b)) for b in out):
        raise ValueError(f"{what}: want finite bucket bounds > 0, got {buckets!r}")
    if any(a >= b for a, b in itertools.pairwise(out)):
        raise ValueError(f"{what}: bucket bounds must increase, got {buckets!r}")
    return out


class LatencyHistograms:
    """A :class:`~sender.events.ManagerEvents` listener feeding room and chunk latency
    histograms, rooms by outcome and code, and chunk bytes (docs/METRICS.md). An unknown
    outcome or code counts as ``"other"``; a non-finite latency is not observed.

    Args:
        registry: Where the metrics are registered (``None``: prometheus_client's default
            ``REGISTRY``). Two instances cannot share one registry.
        room_buckets: Room latency bucket bounds, seconds (increasing, > 0).
        chunk_buckets: Chunk latency bucket bounds, seconds.
        labels: Constant labels added to every sample.
        namespace: Metric name prefix.

    Thread-safety: both methods are safe from any threads at once; no lock of the sender.

    Raises:
        ValueError: Bad buckets or label names, or the names are already registered in
            ``registry``.
        TypeError: A label value is not a ``str``.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, *,
        room_buckets: Sequence[float] = ROOM_BUCKETS_S,
        chunk_buckets: Sequence[float] = CHUNK_BUCKETS_S,
        labels: Mapping[str, str] | None = None, namespace: str = NAMESPACE,
    ) -> None:
        reg = REGISTRY if registry is None else registry
        const = _check_labels(labels, ("outcome", "code"))
        self._const = tuple(const.values())

        def metric(cls: Any, name: str, doc: str, *own: str, **kw: Any) -> Any:
            return cls(f"{namespace}_{name}", doc, (*const, *own), registry=reg, **kw)

        self.room_seconds: Histogram = metric(
            Histogram, "room_duration_seconds",
            "room latency, from its opening to its conclusion, by outcome", "outcome",
            buckets=_check_buckets(room_buckets, "room_buckets"),
        )
        self.chunk_seconds: Histogram = metric(
            Histogram, "chunk_duration_seconds",
            "chunk latency, from its start to its end, by outcome", "outcome",
            buckets=_check_buckets(chunk_buckets, "chunk_buckets"),
        )
        self.room_outcomes: Counter = metric(
            Counter, "room_outcomes",
            "rooms concluded, by outcome and reason code (ok for a success)", "outcome", "code",
        )
        self.chunk_bytes: Counter = metric(
            Counter, "chunk_bytes", "chunk payload bytes, by how the chunk ended", "outcome"
        )

    def room_concluded(
        self, room: int, generation: int, outcome: str, code: str, seconds: float
    ) -> None:
        """Count and time one room conclusion. Thread-safe; raises nothing for any values."""
        outcome = outcome if outcome in ROOM_OUTCOMES else _OTHER
        code = code if code in ROOM_CODES else _OTHER
        self.room_outcomes.labels(*self._const, outcome, code).inc()
        if math.isfinite(seconds):
            self.room_seconds.labels(*self._const, outcome).observe(max(0.0, seconds))

    def chunk_ended(self, session_id: str, outcome: str, seconds: float, nbytes: int) -> None:
        """Count and time one chunk end. Thread-safe; raises nothing for any values."""
        outcome = outcome if outcome in CHUNK_OUTCOMES else _OTHER
        if nbytes > 0:
            self.chunk_bytes.labels(*self._const, outcome).inc(nbytes)
        if math.isfinite(seconds):
            self.chunk_seconds.labels(*self._const, outcome).observe(max(0.0, seconds))
