"""Benchmark ``instructions``: the sender's bookkeeping for a fixed room, counted in instructions.

Wall and CPU times move by tens of percent on a shared 2-core machine; an instruction count
does not (callgrind simulates the program, whatever else runs). This benchmark runs
:mod:`bench._callgrind_child` under ``valgrind --tool=callgrind`` on the real interpreter
and reports the instructions (``Ir``) the sender executes per room on the no-op transport
(:class:`bench._noop.NoopTransport`), next to the same room on a bare ``threading.Lock`` +
dicts (:class:`bench._bare_room.BareRooms`), so that a regression of a few percent shows.

The room: 8 chunks x 16 pages to 1 decode session (``transfer-share``'s room), inline
manager, library defaults (mutex room lock, default staging context), debug locks off.

What is counted, and how only the room's work is: the child imports, sets up and warms up
with callgrind's instrumentation off (``--instr-atstart=no``: ~10x faster than counting
torch's import); the parent then switches it on (``callgrind_control -i on PID``) and lets
the child run its windows. Collection is off (``--collect-atstart=no``) except inside
``closure_fcn`` (``--toggle-collect``), the C function of ``_ctypes`` that calls a Python
callback: each window is one call of a ctypes callback, so only the windows are counted,
and ``--dump-after=closure_fcn`` writes each window's count to a file of its own. A window
that does nothing (``empty``) measures the callback's own cost, subtracted from the others.
This was chosen over subtracting a whole run that does no room: that subtracts two counts of
hundreds of millions (imports, set-up) to find about a million per room, and the set-up's
own run-to-run variation would show in the difference.

Every count is taken with ``PYTHONHASHSEED=0``, a fixed environment (:func:`child_env`) and
the cyclic GC disabled inside the windows (a collection belongs to no room). Runs of one
checkout then count exactly alike, beside CPU hogs too; a checkout at another path counts
up to ~0.2 % differently (memory layout), so compare two trees at the same path. The full
preset runs the child twice *at the same time* (each beside the other, on 2 cores) and
reports the spread between the two; ``--quick`` skips this benchmark (a run takes a minute
or more: ``make bench-instructions``).

Skipped with a clear message where valgrind or ``callgrind_control`` is missing, off Linux,
or when ``sys.executable`` is not an ELF binary (a shell shim, e.g. pyenv's: valgrind would
count the shell).
"""

from __future__ import annotations

import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench._callgrind_child import (
    BASE_CHUNKS,
    CHUNK_GROWTH,
    IN_FLIGHT,
    SESSION_GROWTH,
    STEPS,
    WINDOW_NAMES,
)
from bench._harness import (
    BenchResult,
    Cell,
    Goal,
    JSONValue,
    Ratio,
    Table,
    loglog_exponent,
    pending_result,
    skipped_result,
)

NAME = "instructions"
TITLE = "Instructions per room of the sender's bookkeeping (callgrind, no-op transport)"

CHUNKS = BASE_CHUNKS
PAGES = 16
GROWTH_TOL = 0.02
"""Counts repeat exactly: an exponent above 1 (chunks, sessions) or 0 (rooms in flight) by
more than this is growth, not noise."""
CURVES: dict[str, tuple[tuple[int, str], ...]] = {
    "chunks": ((BASE_CHUNKS, "sender"), *((c, f"chunks {c}") for c in CHUNK_GROWTH)),
    "sessions": ((1, "sender"), *((n, f"sessions {n}") for n in SESSION_GROWTH)),
    "rooms in flight": ((1, "sender"), *((b, f"in flight {b}") for b in IN_FLIGHT)),
}
"""Curve -> (size, window) points: the base room's window is every curve's first point."""

Window = tuple[str, int, int]
"""One counted window: (name, rooms, instructions)."""
TOGGLE = "closure_fcn"
"""The C function (``_ctypes``) whose activations are counted: a ctypes callback's entry."""
REFERENCE = "reference"
READY_TIMEOUT_S = 900.0
"""Bound on the child's uninstrumented start (imports torch under valgrind: ~30-60 s)."""
RUN_TIMEOUT_S = 900.0
"""Bound on the instrumented windows."""
_TOTALS = re.compile(rb"^(?:totals|summary):\s*(\d+)", re.MULTILINE)


@dataclass(frozen=True)
class Preset:
    """Effort: ``rooms`` per window, ``runs`` child processes (run at the same time)."""

    rooms: int
    runs: int


FULL = Preset(rooms=32, runs=2)


class CallgrindError(RuntimeError):
    """A callgrind run did not produce the counts (the message says why)."""


@dataclass(frozen=True)
class Tools:
    """The programs a run needs."""

    valgrind: str
    control: str
    python: str


def find_tools() -> Tools | str:
    """The tools, or why this benchmark cannot run here."""
    if not sys.platform.startswith("linux"):
        return f"callgrind counts are taken on Linux only (this is {sys.platform})"
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        return "valgrind not found on PATH (install valgrind; 3.19 is tested)"
    control = shutil.which("callgrind_control")
    if control is None:
        return "callgrind_control not found on PATH (it comes with valgrind)"
    python = sys.executable
    real = os.path.realpath(python)
    try:
        with open(real, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        return f"cannot read the interpreter {real}: {exc}"
    if magic != b"\x7fELF":
        return (
            f"sys.executable {python} ({real}) is not an ELF binary (a shim?): run with the "
            "real interpreter, `python -c 'import sys; print(sys.executable)'`"
        )
    return Tools(valgrind, control, python)


def parse_totals(text: bytes) -> int:
    """The total event count of one callgrind output file.

    Raises:
        CallgrindError: the file has no ``totals:``/``summary:`` line.
    """
    found = _TOTALS.search(text)
    if found is None:
        raise CallgrindError("callgrind output without a totals line")
    return int(found.group(1))


def read_dumps(out_file: Path, count: int) -> list[int]:
    """Counts of the ``count`` dumps ``--dump-after`` wrote next to ``out_file`` (``.1``,
    ``.2``, ... in window order).

    Raises:
        CallgrindError: a dump is missing or unreadable.
    """
    counts = []
    for i in range(1, count + 1):
        path = out_file.with_name(f"{out_file.name}.{i}")
        try:
            counts.append(parse_totals(path.read_bytes()))
        except OSError as exc:
            raise CallgrindError(f"dump {i} of {count} missing: {exc}") from exc
    return counts


def parse_windows(line: str) -> list[tuple[str, int]]:
    """The child's ``WINDOWS name:rooms,...`` line as (name, rooms) pairs.

    Raises:
        CallgrindError: not such a line, or not the windows this module reports.
    """
    if not line.startswith("WINDOWS "):
        raise CallgrindError(f"unexpected line from the child: {line!r}")
    try:
        plan = [(name, int(n)) for name, n in (w.rsplit(":", 1) for w in line[8:].split(","))]
    except ValueError as exc:
        raise CallgrindError(f"malformed windows line {line!r}") from exc
    if tuple(name for name, _ in plan) != WINDOW_NAMES or min(n for _, n in plan) < 1:
        raise CallgrindError(f"unexpected windows from the child: {line!r}")
    return plan


def _read_line(proc: subprocess.Popen[bytes], deadline: float, what: str) -> str:
    """One line of the child's stdout, waiting at most until ``deadline``.

    Raises:
        CallgrindError: the child exited or the deadline passed first.
    """
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CallgrindError(f"no {what} line from the child in time")
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            raise CallgrindError(f"the child exited before its {what} line ({buf!r})")
        buf += chunk
    return buf.split(b"\n", 1)[0].decode(errors="replace").strip()


def child_env(root: str) -> dict[str, str]:
    """The child's whole environment: fixed, so that the count does not depend on the
    caller's shell (``PATH`` is kept: valgrind finds its tools through it).

    What sits in the child's memory moves the count a little: a caller's environment moved
    it by 0.14 %, and so does the checkout's path (in ``sys.path`` and every module's
    ``__file__``: a copy of the tree at a longer path counted 0.16 % fewer, a path with the
    same length but other characters 0.19 % more; measured). Runs of one checkout with this
    environment count exactly alike; compare two trees at the same path.
    """
    return {
        "PATH": os.environ.get("PATH", os.defpath),
        "PYTHONPATH": root,
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "NIXL_LOG_LEVEL": "WARN",
        "OMP_NUM_THREADS": "1",
        "LC_ALL": "C",
    }


def run_child(tools: Tools, rooms: int, workdir: Path) -> list[Window]:
    """One callgrind run of the child: each window's name, rooms and instructions.

    Raises:
        CallgrindError: valgrind, callgrind_control or the child failed (with valgrind's
            last lines).
    """
    out_file = workdir / "callgrind.out"
    log = workdir / "valgrind.log"
    root = str(Path(__file__).resolve().parent.parent)
    env = child_env(root)
    cmd = [
        tools.valgrind,
        "--tool=callgrind",
        f"--callgrind-out-file={out_file}",
        f"--log-file={log}",
        "--instr-atstart=no",
        "--collect-atstart=no",
        f"--toggle-collect={TOGGLE}",
        f"--dump-after={TOGGLE}",
        tools.python,
        "-m",
        "bench._callgrind_child",
        "--rooms",
        str(rooms),
        "--pages",
        str(PAGES),
    ]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=root,
    )
    try:
        assert proc.stdin is not None
        line = _read_line(proc, time.monotonic() + READY_TIMEOUT_S, "READY")
        if line != "READY":
            raise CallgrindError(f"unexpected line from the child: {line!r}")
        control = subprocess.run(
            [tools.control, "-i", "on", str(proc.pid)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if control.returncode != 0:
            raise CallgrindError(
                f"callgrind_control -i on failed ({control.returncode}): "
                f"{(control.stdout + control.stderr).strip()[-400:]}"
            )
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        line = _read_line(proc, time.monotonic() + RUN_TIMEOUT_S, "WINDOWS")
        plan = parse_windows(line)
        code = proc.wait(timeout=RUN_TIMEOUT_S)
        if code != 0:
            raise CallgrindError(f"the child exited with {code}")
        counts = read_dumps(out_file, len(plan))
        return [(name, n, count) for (name, n), count in zip(plan, counts, strict=True)]
    except (CallgrindError, subprocess.TimeoutExpired, OSError) as exc:
        tail = log.read_text(errors="replace")[-1500:] if log.exists() else "(no valgrind log)"
        raise CallgrindError(f"{exc}; valgrind log ends:\n{tail}") from exc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def measure(preset: Preset) -> BenchResult:
    """Run the benchmark with an explicit preset (``runs`` children at the same time)."""
    tools = find_tools()
    if isinstance(tools, str):
        return pending_result(NAME, TITLE, tools)
    with tempfile.TemporaryDirectory(prefix="bench-callgrind-") as tmp:
        dirs = [Path(tmp) / f"run{i + 1}" for i in range(preset.runs)]
        for d in dirs:
            d.mkdir()
        with ThreadPoolExecutor(max_workers=preset.runs) as pool:
            futures = [pool.submit(run_child, tools, preset.rooms, d) for d in dirs]
            windows = [f.result() for f in futures]
    return report(preset, windows)


def per_room(run: Sequence[Window]) -> dict[str, float]:
    """Instructions per room of each window, the empty window's count subtracted."""
    empty = next(count for name, _, count in run if name == "empty")
    return {name: (count - empty) / n for name, n, count in run if name != "empty"}


def _sends_per_room(curve: str, size: int) -> int:
    """Chunk sends (chunks x sessions) of a room at ``size`` on ``curve``."""
    if curve == "chunks":
        return size
    if curve == "sessions":
        return CHUNKS * size
    return CHUNKS


def report(preset: Preset, raw_runs: Sequence[Sequence[Window]]) -> BenchResult:
    """The result of ``runs`` child runs' windows (public for the smoke test)."""
    runs = [per_room(r) for r in raw_runs]
    rooms_of = {name: n for name, n, _ in raw_runs[0]}
    what = {
        "sender": "room: make_transfer_info, NixlKVSender, init, 8 sends, poll, clear",
        "sender again": "the same rooms again, same process (drift within a run)",
        REFERENCE: "the same room on a bare threading.Lock + dicts (bench._bare_room)",
        "open": "make_transfer_info + NixlKVSender",
        "init": "init",
        "send": f"{CHUNKS} sends",
        "poll": "poll until Success",
        "clear": "clear",
    }
    run_cols = [f"run {i + 1}" for i in range(len(runs))]
    columns = ["window", "rooms", *run_cols, "spread %", "per chunk", f"/{REFERENCE}", "what"]
    rows: list[dict[str, Cell]] = []
    spreads: dict[str, float] = {}
    for name in WINDOW_NAMES[1:]:
        values = [r[name] for r in runs]
        mean = sum(values) / len(values)
        spreads[name] = 100 * (max(values) - min(values)) / mean if mean else 0.0
    for name, text in what.items():
        values = [r[name] for r in runs]
        row: dict[str, Cell] = {"window": name, "rooms": rooms_of[name]}
        row.update({col: round(v) for col, v in zip(run_cols, values, strict=True)})
        row.update(
            {
                "spread %": f"{spreads[name]:.4f}",
                "per chunk": round(values[0] / CHUNKS),
                f"/{REFERENCE}": values[0] / runs[0][REFERENCE],
                "what": text,
            }
        )
        rows.append(row)

    first = runs[0]
    growth_rows: list[dict[str, Cell]] = []
    flagged: list[str] = []
    exponents: dict[str, JSONValue] = {}
    for curve, points in CURVES.items():
        sizes = [size for size, _ in points]
        costs = [first[window] for _, window in points]
        fit = loglog_exponent(sizes, costs)
        last = loglog_exponent(sizes[-2:], costs[-2:])
        limit = 0.0 if curve == "rooms in flight" else 1.0
        over = [
            f"{label} {v:.3f}"
            for label, v in (("exponent", fit), ("last step", last))
            if v is not None and v > limit + GROWTH_TOL
        ]
        if over:
            flagged.append(f"{curve}: " + ", ".join(over))
        per_send = [
            cost / _sends_per_room(curve, size) for size, cost in zip(sizes, costs, strict=True)
        ]
        growth_rows.append(
            {
                "curve": curve,
                "sizes": " / ".join(f"{s:,}" for s in sizes),
                "Ir per room": " / ".join(f"{c:,.0f}" for c in costs),
                "Ir per chunk send": " / ".join(f"{c:,.0f}" for c in per_send),
                "exponent": fit,
                "last step": last,
                "flag": "; ".join(over) if over else "-",
            }
        )
        exponents[curve] = {"fit": fit, "last_step": last, "sizes": list(sizes)}

    steps = sum(first[s] for s in STEPS)
    sender = first["sender"]
    ratios = [
        Ratio("sender/reference", sender / first[REFERENCE], "instructions per room"),
        Ratio("sender again/sender", first["sender again"] / sender, "drift within a run"),
        Ratio("steps/sender", steps / sender, f"{rooms_of['open']} rooms in flight vs one"),
    ]
    if len(runs) > 1:
        ratios.append(Ratio("run 2/run 1 sender", runs[1]["sender"] / sender, "repeatability"))
    worst = max(spreads.values())
    goals = [
        Goal(
            "report only: instructions per room of the sender's bookkeeping (no target; a "
            "regression of a few percent shows)",
            None,
            f"sender {sender:,.0f} Ir/room ({sender / CHUNKS:,.0f} per chunk) = "
            f"{sender / first[REFERENCE]:.2f}x the Lock + dicts reference; largest spread "
            f"between runs {worst:.4f} % over all {len(spreads)} windows",
        ),
        Goal(
            f"no-op bookkeeping per room at most linear in chunks and sessions and flat in "
            f"rooms in flight, in instructions (exponent and last step <= 1 or 0 + "
            f"{GROWTH_TOL:g}: counts repeat exactly)",
            not flagged,
            "; ".join(flagged)
            if flagged
            else "nothing flagged: "
            + ", ".join(
                f"{r['curve']} {r['exponent']:.3f}"
                for r in growth_rows
                if isinstance(r["exponent"], float)
            ),
        ),
    ]
    notes = [
        f"instructions (callgrind Ir) per room, the empty window ({raw_runs[0][0][2]:,} Ir: "
        f"the ctypes callback itself) subtracted; room = {CHUNKS} chunks x {PAGES} pages to 1 "
        "session unless the window says otherwise, no-op transport, inline manager",
        f"counted only inside {TOGGLE} (a ctypes callback per window), instrumentation "
        "switched on after the set-up (callgrind_control -i on), PYTHONHASHSEED=0, a fixed "
        "environment, GC off in the windows; step windows run their rooms in flight together "
        "(open all, then init all, ...)",
        "growth: rooms one after the other (chunks, sessions: as many chunk sends per window "
        "as the sender window) or a whole batch in flight in one window; per chunk send = "
        "per room / (chunks x sessions)",
        f"{len(runs)} child runs at the same time; spread % = (max - min) / mean over runs; "
        "a checkout at another path counts up to ~0.2 % differently (compare trees at one "
        "path)",
    ]
    params: dict[str, JSONValue] = {
        "rooms_per_window": preset.rooms,
        "runs": preset.runs,
        "chunks": CHUNKS,
        "pages_per_chunk": PAGES,
        "toggle": TOGGLE,
    }
    samples = {name: [r[name] for r in runs] for name in WINDOW_NAMES[1:]}
    raw: list[JSONValue] = [[[name, n, c] for name, n, c in r] for r in raw_runs]
    return BenchResult(
        name=NAME,
        title=TITLE,
        columns=columns,
        rows=rows,
        ratios=ratios,
        goals=goals,
        notes=notes,
        params=params,
        samples=samples,
        extra={"windows": raw, "exponents": exponents},
        ratios_title="ratios (of run 1's counts; counts have no rounds)",
        tables=[
            Table(
                "growth in instructions (run 1)",
                [
                    "curve",
                    "sizes",
                    "Ir per room",
                    "Ir per chunk send",
                    "exponent",
                    "last step",
                    "flag",
                ],
                growth_rows,
            )
        ],
    )


def run(quick: bool) -> BenchResult:
    """The full preset (2 runs at once, ~1-2 min); ``--quick`` skips it."""
    if quick:
        return skipped_result(
            NAME,
            TITLE,
            "not part of --quick (a callgrind run takes a minute or more): run "
            "`python -m bench instructions` or `make bench-instructions`",
        )
    return measure(FULL)
