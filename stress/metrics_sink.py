"""``python -m stress --metrics PATH``: the sender scenarios' metrics, scraped at the end.

One Prometheus registry per process run: a :class:`sender.metrics.LatencyHistograms`
listener that every sender scenario's managers report to (rooms by outcome and reason code,
room and chunk latency histograms, across every manager of every scenario), plus a
:class:`sender.metrics.SenderCollector` over the manager made last (one collector: the
metric names of two would clash in one registry). At the end the
CLI writes the text exposition (what a ``/metrics`` endpoint serves) to PATH. Needs the
optional ``metrics`` extra (``prometheus-client``); without it the CLI says so and writes
nothing.

Thread-safety: :func:`listener` and :func:`watch` may be called from any thread (one plain
lock around the module's state).
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_state: dict[str, Any] = {}  # guarded by _lock: registry, histograms, collector


def enable() -> str | None:
    """Start collecting; ``None``, or why it cannot (the extra is missing)."""
    try:
        from prometheus_client import CollectorRegistry

        from sender.metrics import LatencyHistograms
    except ModuleNotFoundError as exc:
        return f"--metrics needs the 'metrics' extra (no module {exc.name!r})"
    with _lock:
        if "registry" not in _state:
            registry = CollectorRegistry()
            _state["registry"] = registry
            _state["histograms"] = LatencyHistograms(registry)
    return None


def listener() -> Any:
    """The shared :class:`~sender.events.ManagerEvents` listener, or ``None`` when off."""
    with _lock:
        return _state.get("histograms")


def watch(scenario: str, manager: Any) -> None:
    """Scrape ``manager``'s counters from now on, in place of the previous manager."""
    with _lock:
        registry = _state.get("registry")
        if registry is None:
            return
        from sender.metrics import SenderCollector

        old = _state.pop("collector", None)
        if old is not None:
            registry.unregister(old)
        collector = SenderCollector.from_manager(manager, labels={"scenario": scenario})
        registry.register(collector)
        _state["collector"] = collector


def exposition() -> bytes | None:
    """The text exposition of everything collected, or ``None`` when off."""
    with _lock:
        registry = _state.get("registry")
    if registry is None:
        return None
    from prometheus_client import generate_latest

    data: bytes = generate_latest(registry)
    return data
