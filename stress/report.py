"""Text tables, the replay command and the JSON document of a stress run."""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path

from stress.environment import environment
from stress.framework import JSONValue, ScenarioResult, StressConfig
from stress.invariants import DESCRIPTIONS
from stress.native_stderr import CLASSES, NativeLines
from stress.sender_log import level_of

MEANINGS = {c.name: c.meaning for c in CLASSES}


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


RATE_NOTE = (
    "rates are per second of 'run s', the run window: from the scenario's start of work "
    "(after its set-up, e.g. peer start-up) until its run returned (its own end checks "
    "included); 'wall s' adds the set-up and the framework's final joins"
)


def _row(r: ScenarioResult) -> tuple[str, ...]:
    if r.skipped is not None and r.ok:
        return (r.name, *("-" for _ in range(11)), "SKIP")
    return (
        r.name,
        f"{r.rooms:,}",
        f"{r.ops:,}",
        f"{r.faults:,}",
        f"{r.violations:,}",
        f"{r.rate_base_s:.1f}",
        f"{r.elapsed_s:.1f}",
        f"{r.rooms_per_s:,.0f}",
        f"{r.ops_per_s:,.0f}",
        _ms(r.latency_p50_ms),
        _ms(r.latency_p99_ms),
        _contention(r),
        r.status,
    )


def summary_table(results: Sequence[ScenarioResult]) -> str:
    """Per scenario: rooms, ops, faults, violations, the run window and wall time, rates
    (per second of the run window, said below the table), lifecycle latency, contention and
    the result (``PASS``, ``FAIL``, ``SKIP``; each skip's reason below the table)."""
    header = (
        "scenario", "rooms", "ops", "faults", "violations", "run s", "wall s", "rooms/s",
        "ops/s", "p50 ms", "p99 ms", "lock contended/acq", "result",
    )  # fmt: skip
    lines = [_table(header, [_row(r) for r in results]), RATE_NOTE]
    lines += [f"SKIP {r.name}: {r.skipped}" for r in results if r.skipped is not None]
    return "\n".join(lines)


def native_table(results: Sequence[ScenarioResult]) -> str:
    """The NIXL/UCX lines native code wrote to fd 2 during each scenario, counted by class
    (one row per class seen, one count column per scenario; ``-`` = not captured), with
    what each class means, or ``""`` when none was seen. They are expected where peers are
    killed on purpose; an invariant, not these lines, says whether a run failed."""
    captured = [r for r in results if r.native is not None]
    names: list[str] = []
    for r in captured:
        assert r.native is not None
        names += [n for n in r.native.counts if n not in names]
    if not names:
        if captured:
            return "native stderr: no NIXL/UCX line on fd 2"
        return ""
    order = [c.name for c in CLASSES]
    names.sort(key=lambda n: order.index(n) if n in order else len(order))
    header = ("native stderr line", *(r.name for r in results), "meaning")
    rows = [
        (
            name,
            *("-" if r.native is None else f"{r.native.counts.get(name, 0):,}" for r in results),
            MEANINGS.get(name, ""),
        )
        for name in names
    ]
    total = sum(r.native.total for r in captured if r.native is not None)
    text = _table(header, rows, left=(0, -1))
    return (
        f"NIXL/UCX lines on fd 2 (counted, not printed; --native-stderr show prints them): "
        f"{total:,}\n{text}"
    )


def sender_log_table(results: Sequence[ScenarioResult]) -> str:
    """The library's own log records during each scenario, counted by kind (logger, level,
    format string; one count column per scenario, ``-`` = not captured), then the first line
    of each ``ERROR`` kind, or ``""`` when nothing was captured. A stress run fails rooms on
    purpose: these are expected; an invariant, not these lines, says whether a run failed."""
    captured = [r for r in results if r.sender_log is not None]
    if not captured:
        return ""
    kinds: list[str] = []
    for r in captured:
        assert r.sender_log is not None
        kinds += [k for k in r.sender_log.counts if k not in kinds]
    if not kinds:
        return "sender log: no record from the sender or staging loggers"
    width = 100
    header = ("sender log record (logger level: format)", *(r.name for r in results))
    rows = [
        (
            kind if len(kind) <= width else kind[: width - 1] + "…",
            *(
                "-" if r.sender_log is None else f"{r.sender_log.counts.get(kind, 0):,}"
                for r in results
            ),
        )
        for kind in kinds
    ]
    total = sum(r.sender_log.total for r in captured if r.sender_log is not None)
    lines = [
        f"sender log records (counted, not printed; --sender-log show prints them): {total:,}",
        _table(header, rows, left=(0,)),
    ]
    for kind in kinds:
        level = level_of(kind)
        if level not in ("ERROR", "CRITICAL"):
            continue
        for r in captured:
            assert r.sender_log is not None
            first = r.sender_log.examples.get(kind)
            if first:
                lines.append(f"{level} in {r.name}: {first[0]}")
                break
    return "\n".join(lines)


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
    details: list[str] = []
    for r in results:
        for inv in r.invariants:
            details += [f"  [{r.name}] {inv.name}: {example}" for example in inv.examples]
            for i, tb in enumerate(inv.tracebacks):
                details.append(f"  [{r.name}] {inv.name}: traceback {i + 1}:")
                details += ["      " + line for line in tb.splitlines()]
    if details:
        table += "\nfirst violations:\n" + "\n".join(details)
    return table


_FLAGS = {
    "threads": "--threads",
    "rooms": "--rooms",
    "chunks": "--chunks",
    "fault_rate": "--fault-rate",
    "peer_kill": "--peer-kill",
    "peer_stop": "--peer-stop",
    "duration": "--duration",
    "switch_interval": "--switch-interval",
    "lock": "--lock",
    "quick": "--quick",
    "watchdog_s": "--watchdog",
    "plant_bug": "--plant-bug",
}
"""The CLI option of each :class:`StressConfig` field (``seed`` is always given)."""


def replay_argv(config: StressConfig, scenarios: Sequence[str]) -> list[str]:
    """The ``python -m stress`` arguments that run ``scenarios`` again with ``config``: the
    seed, and every option whose value differs from the default. The seed fixes each
    worker's plan (its random choices), not the thread schedule."""
    default = StressConfig()
    argv = [*scenarios, "--seed", str(config.seed)]
    for f in fields(StressConfig):
        if f.name == "seed":
            continue
        value = getattr(config, f.name)
        if value == getattr(default, f.name):
            continue
        flag = _FLAGS[f.name]  # a new field without a flag fails here, in the tests
        if isinstance(value, bool):
            argv.append(flag)
        else:
            argv += [flag, repr(value) if isinstance(value, float) else str(value)]
    return argv


def replay_command(config: StressConfig, scenarios: Sequence[str]) -> str:
    """:func:`replay_argv` as one shell command line (``python -m stress ...``)."""
    return shlex.join(["python", "-m", "stress", *replay_argv(config, scenarios)])


def _summed(spans: Sequence[NativeLines | None]) -> dict[str, JSONValue]:
    """The counts of several scenarios' counted lines added up, by kind."""
    total: dict[str, JSONValue] = {}
    for lines in spans:
        for kind, n in (lines.counts if lines is not None else {}).items():
            before = total.get(kind, 0)
            total[kind] = (before if isinstance(before, int) else 0) + n
    return total


def document(
    config: StressConfig,
    results: Sequence[ScenarioResult],
    env: Mapping[str, str] | None = None,
) -> dict[str, JSONValue]:
    """The whole run as one JSON-ready dict; ``"environment"`` holds ``env`` (default: read
    now by :func:`stress.environment.environment`: nixl-staging, Python, torch, nixl
    versions and the machine). Raises nothing."""
    totals: dict[str, JSONValue] = {}
    for r in results:
        for inv in r.invariants:
            before = totals.get(inv.name, 0)
            totals[inv.name] = (before if isinstance(before, int) else 0) + inv.violations
    failed = [r.name for r in results if not r.ok]
    native = _summed([r.native for r in results])
    sender_log = _summed([r.sender_log for r in results])
    return {
        "seed": config.seed,
        "ok": all(r.ok for r in results),
        "environment": dict(environment() if env is None else env),
        "skipped": {r.name: r.skipped for r in results if r.skipped is not None},
        "replay": replay_command(config, failed) if failed else None,
        "config": config.to_json(),
        "scenarios": [r.to_json() for r in results],
        "invariants": totals,
        "native_stderr": native,
        "sender_log": sender_log,
    }


def write_json(
    path: str | Path,
    config: StressConfig,
    results: Sequence[ScenarioResult],
    env: Mapping[str, str] | None = None,
) -> None:
    """Write :func:`document` to ``path`` (indented, trailing newline). Raises ``OSError``
    when ``path`` cannot be written."""
    text = json.dumps(document(config, results, env), indent=2, sort_keys=False)
    Path(path).write_text(text + "\n", encoding="utf-8")
