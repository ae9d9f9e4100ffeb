"""Text tables and the JSON document of a stress run."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from stress.framework import JSONValue, ScenarioResult, StressConfig
from stress.invariants import DESCRIPTIONS


def _table(
    header: Sequence[str], rows: Sequence[Sequence[str]], *, left: Sequence[int] = (0,)
) -> str:
    """Columns padded to width: those in ``left`` left-aligned, the others right-aligned."""
    widths = [len(h) for h in header]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    aligned_left = {i % len(widths) for i in left}

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i in aligned_left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _contention(result: ScenarioResult) -> str:
    lock = result.lock
    if not lock:
        return "-"
    contended = lock.get("contended")
    acquisitions = lock.get("acquisitions")
    if acquisitions is None:  # else sum whichever per-mode counters the scenario gave
        parts = [lock.get(k) for k in ("read_acquisitions", "write_acquisitions", "read", "write")]
        acquisitions = sum(p for p in parts if isinstance(p, int))
    if not isinstance(contended, int) or not isinstance(acquisitions, int) or not acquisitions:
        return "-"
    return f"{contended:,}/{acquisitions:,} ({100.0 * contended / acquisitions:.1f}%)"


def summary_table(results: Sequence[ScenarioResult]) -> str:
    """Per scenario: rooms, ops, faults, violations, rates, lifecycle latency, contention."""
    header = (
        "scenario", "rooms", "ops", "faults", "violations", "rooms/s", "ops/s",
        "p50 ms", "p99 ms", "lock contended/acq", "result",
    )  # fmt: skip
    rows = [
        (
            r.name,
            f"{r.rooms:,}",
            f"{r.ops:,}",
            f"{r.faults:,}",
            f"{r.violations:,}",
            f"{r.rooms_per_s:,.0f}",
            f"{r.ops_per_s:,.0f}",
            _ms(r.latency_p50_ms),
            _ms(r.latency_p99_ms),
            _contention(r),
            "PASS" if r.ok else "FAIL",
        )
        for r in results
    ]
    return _table(header, rows)


def invariant_table(results: Sequence[ScenarioResult]) -> str:
    """One row per invariant name, one violation-count column per scenario (- = n/a)."""
    names: list[str] = []
    for r in results:
        for inv in r.invariants:
            if inv.name not in names:
                names.append(inv.name)
    counts = {(r.name, inv.name): inv.violations for r in results for inv in r.invariants}
    header = ("invariant", *(r.name for r in results), "meaning")
    rows = [
        (
            name,
            *(str(counts[(r.name, name)]) if (r.name, name) in counts else "-" for r in results),
            DESCRIPTIONS.get(name, ""),
        )
        for name in names
    ]
    table = _table(header, rows, left=(0, -1))
    details = [
        f"  [{r.name}] {inv.name}: {example}"
        for r in results
        for inv in r.invariants
        for example in inv.examples
    ]
    if details:
        table += "\nfirst violations:\n" + "\n".join(details)
    return table


def document(config: StressConfig, results: Sequence[ScenarioResult]) -> dict[str, JSONValue]:
    """The whole run as one JSON-ready dict."""
    totals: dict[str, JSONValue] = {}
    for r in results:
        for inv in r.invariants:
            before = totals.get(inv.name, 0)
            totals[inv.name] = (before if isinstance(before, int) else 0) + inv.violations
    return {
        "seed": config.seed,
        "ok": all(r.ok for r in results),
        "config": config.to_json(),
        "scenarios": [r.to_json() for r in results],
        "invariants": totals,
    }


def write_json(path: str | Path, config: StressConfig, results: Sequence[ScenarioResult]) -> None:
    """Write :func:`document` to ``path`` (indented, trailing newline)."""
    text = json.dumps(document(config, results), indent=2, sort_keys=False)
    Path(path).write_text(text + "\n", encoding="utf-8")
