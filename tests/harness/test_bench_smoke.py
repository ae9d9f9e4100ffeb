"""Smoke tests of the benchmark package: tiny sizes, result structure only.

Nothing here asserts anything about speed: benchmarks report, they never judge.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import staging.context as staging_context
import staging.validate as staging_validate
from bench import _callgrind_child as child
from bench import (
    curves,
    instructions,
    isolation,
    lifecycle,
    purge_scaling,
    stress_rooms,
    throughput,
    transfer_share,
)
from bench import lifecycle_profile as prof
from bench._harness import (
    OPEN_GOALS_DOC,
    REPORT_WIDTH,
    BenchResult,
    Goal,
    format_table,
    interleave,
    loglog_exponent,
    median_ratio,
)
from bench._registry import BENCHMARKS, BY_NAME
from bench.cli import main
from sender import _nixl
from tests.fixtures_nixl import requires_nixl

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
NIXL_BENCHES = (
    "transfer-share", "throughput", "curves", "stress-rooms", "isolation", "fail-fast"
)


def _check_table_width(result: BenchResult, width: int = REPORT_WIDTH) -> None:
    """Every line of the result's printed tables (and their titles) fits ``width``."""
    tables = [format_table(t.columns, t.rows) for t in result.layout]
    titles = [t.title for t in result.layout]
    if not result.layout:
        tables.append(format_table(result.columns, result.rows))
    too_wide = [ln for text in (*tables, *titles) for ln in text.splitlines() if len(ln) > width]
    assert not too_wide, too_wide


def _check_structure(result: BenchResult) -> None:
    assert result.status == "ok"
    assert result.columns and result.rows
    for row in result.rows:
        assert set(row) == set(result.columns)
    assert result.ratios
    assert result.goals and all(isinstance(g, Goal) for g in result.goals)
    assert all(g.verdict in {"MET", "NOT MET", "N/A"} for g in result.goals)
    assert result.samples and all(result.samples.values())
    doc = json.loads(json.dumps(result.to_json()))
    assert doc["name"] == result.name
    assert len(doc["rows"]) == len(result.rows)
    assert result.render()


def test_purge_scaling_tiny() -> None:
    preset = purge_scaling.Preset(
        sizes=(20, 200), rounds=2, ours_purges=5, upstream_key_budget=1_000, max_upstream_purges=3
    )
    result = purge_scaling.measure(preset)
    _check_structure(result)
    assert [row["live rooms"] for row in result.rows] == [20, 200]
    assert {g.met for g in result.goals[1:]} == {None}  # 100k rooms not measured
    for variant in purge_scaling.VARIANTS:
        assert len(result.samples[f"{variant} us/purge @200"]) == 2


def test_lifecycle_tiny() -> None:
    result = lifecycle.measure(lifecycle.Preset(threads=(1, 2), lifecycles=8, rounds=2))
    _check_structure(result)
    assert [row["variant"] for row in result.rows] == list(lifecycle.VARIANTS)
    assert len(result.samples) == len(lifecycle.VARIANTS) * 2
    reference = next(r for r in result.rows if r["variant"] == lifecycle.REFERENCE)
    assert reference["/ref t=1"] == 1.0
    shares = result.extra["contended_share"]
    assert isinstance(shares, dict)
    contexts = ("rw", "mutex", "rw-batch", "mutex-batch")
    assert set(shares) == {f"{v} t={t}" for v in contexts for t in (1, 2)}


@pytest.mark.parametrize("variant", lifecycle.VARIANTS)
def test_lifecycle_variants_leave_no_rooms(variant: str) -> None:
    work = lifecycle.make_work(variant)
    work(range(5))
    work(range(5))  # rooms were purged: reopening them must work


def test_lifecycle_profile_tiny_and_restores_validators() -> None:
    assert set(prof.ablation(5, 1)) >= {"rw (shipped)", "no lock", "lock-ref"}
    assert "threading.Lock with" in prof.micro(20, 1)
    assert prof.profile(5)
    what_if = prof.what_if(5, 1)  # empty (and says so) once staging's lock internals change
    assert not what_if or set(what_if) >= {"rw (shipped)", "mutex (shipped)", "lock-ref"}
    assert prof.acquisitions_per_lifecycle(5)[0] > 0
    for name in prof.VALIDATORS:  # the ablation patched them for a cell only
        assert getattr(staging_context, name) is getattr(staging_validate, name)


@pytest.mark.slow  # 23 s at load 12
def test_interleave_shuffles_and_collects() -> None:
    calls: list[str] = []

    def cell(label: str) -> tuple[str, Callable[[], float]]:
        def measure() -> float:
            calls.append(label)
            return 1.0

        return label, measure

    labels = [chr(ord("a") + i) for i in range(6)]
    samples = interleave([cell(x) for x in labels], rounds=20, warmup=1)
    assert samples == {x: [1.0] * 20 for x in labels}
    rounds = [calls[i : i + 6] for i in range(0, len(calls), 6)]
    assert all(sorted(r) == labels for r in rounds)  # every cell once per round
    # No cell always behind the same neighbour (a rotation kept "b" behind "a" always).
    behind_a = {r[r.index("a") + 1] for r in rounds if r[-1] != "a"}
    assert len(behind_a) > 1
    assert len({r[0] for r in rounds}) > 1
    # Reproducible: the same seed gives the same orders.
    again: list[str] = []
    calls, first = again, calls
    interleave([cell(x) for x in labels], rounds=20, warmup=1)
    assert again == first
    assert median_ratio([2.0, 4.0, 6.0], [1.0, 2.0, 0.0]) == 2.0
    assert median_ratio([], []) is None


def test_registry_lists_every_benchmark() -> None:
    assert [spec.name for spec in BENCHMARKS] == [
        "purge-scaling",
        "lifecycle",
        "compat",
        "transfer-share",
        "throughput",
        "curves",
        "instructions",
        "stress-rooms",
        "isolation",
        "fail-fast",
        "two-hosts",
    ]
    for spec in BENCHMARKS:
        assert callable(spec.load())


@pytest.mark.parametrize("name", NIXL_BENCHES)
def test_nixl_benches_report_pending_without_nixl(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_nixl, "AVAILABLE", False)
    result = BY_NAME[name].load()(True)
    assert result.status == "pending"
    assert any("NIXL not importable" in note for note in result.notes)


def test_cli_json_and_unknown_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_nixl, "AVAILABLE", False)  # the three then report pending at once
    out = io.StringIO()
    path = tmp_path / "bench.json"
    assert main(["--quick", *NIXL_BENCHES, "--json", str(path)], out=out) == 0
    text = out.getvalue()
    assert "readerwriterlock" in text and "pending: NIXL not importable" in text
    doc = json.loads(path.read_text(encoding="utf-8"))
    assert doc["mode"] == "quick"
    assert {"python", "torch", "nixl", "readerwriterlock", "cores", "platform"} <= set(
        doc["environment"]
    )
    assert [r["name"] for r in doc["results"]] == list(NIXL_BENCHES)
    with pytest.raises(SystemExit) as exc:
        main(["no-such-bench"], out=io.StringIO())
    assert exc.value.code == 2


# ---------------------------------------------------------------- benchmarks 3-5 (real NIXL)
# Each starts one decode peer process; tiny sizes, structure only.


@pytest.mark.nixl
@requires_nixl
def test_transfer_share_tiny() -> None:
    result = transfer_share.measure(transfer_share.Preset(rounds=1, rooms=1, warmup=0))
    _check_structure(result)
    assert all(g.open_by_design for g in result.goals)  # docs/PERFORMANCE.md "Open goals"
    assert [(row["layout"], row["path"]) for row in result.rows] == [
        (layout, path) for layout in transfer_share.LAYOUTS for path in transfer_share.PATHS
    ]
    assert len(result.samples) == len(result.rows) * len(transfer_share.WAYS)
    assert [g.text.split(" % ")[0] for g in result.goals] == [
        "bookkeeping <= 5",
        "bookkeeping <= 2",
    ]  # issue 19's goal, then its next step
    by_call = result.extra["bookkeeping_us_by_call"]
    assert isinstance(by_call, dict)
    calls = by_call["contiguous/direct"]
    assert isinstance(calls, dict) and set(calls) == set(transfer_share.CALLS)


@pytest.mark.slow
@pytest.mark.nixl
@requires_nixl
def test_throughput_tiny() -> None:
    preset = throughput.Preset(rounds=1, big_ops=1, small_ops=1, warmup=1, tiny_ops=1)
    result = throughput.measure(preset)
    _check_structure(result)
    cases = throughput.make_cases()
    assert throughput.TINY_CASE in {c.name for c in cases}
    units = (throughput.GBPS, throughput.CPU_UNIT)
    assert [(row["case"], row["unit"]) for row in result.rows] == [
        (c.name, unit) for c in cases for unit in units
    ]
    anchors = (
        "ours",
        throughput.CHECKED,
        throughput.PREPPED,
        "re-posted",
        "prepped plain",
        "ours/prepped",
        "checked/prepped",
    )
    assert all(isinstance(row[col], float) for row in result.rows for col in anchors)
    staged = [row["case"] for row in result.rows if row["staged"] is not None]
    assert staged == [c.name for c in cases if c.staged for _ in units]
    cpu_ways = (
        "ours",
        throughput.CHECKED,
        throughput.PREPPED,
        throughput.REPOSTED,
        throughput.PREPPED_PLAIN,
    )
    for case in cases:  # one CPU sample per round for ours and every raw cell
        for way in (*cpu_ways, throughput.RAW, throughput.RAW_TX):
            assert len(result.samples[f"{case.name} | {way} CPU ms/GB"]) == preset.rounds
    # Issue 19's two goals first (64 KiB time, plain index arrays at 1 MiB), then the
    # docs/PERFORMANCE.md's; every goal case measured.
    assert "64 KiB" in result.goals[0].text and "1.25x" in result.goals[0].text
    assert "plain index arrays >= 0.9x" in result.goals[1].text
    assert "1 MiB" in result.goals[1].text
    assert [g.met is not None for g in result.goals] == [True] * 7
    # Open by design, as docs/PERFORMANCE.md "Open goals" lists: the two plain-array goals
    # of issue 19 and plain arrays' CPU per GB; the others are met in the documented runs.
    assert [g.open_by_design for g in result.goals] == [True, True, False, True] + [False] * 3
    # Printed in tables of about 100 characters (was one of ~230), every column but the
    # torch op (a note) in one of them.
    _check_table_width(result)
    shown = {c for part in result.layout for c in part.columns}
    assert shown == set(result.columns) - {"torch op"}
    assert any(n.startswith("torch op") for n in result.notes)


@pytest.mark.nixl
@requires_nixl
def test_stress_rooms_tiny() -> None:
    result = stress_rooms.measure(stress_rooms.Preset(rounds=1, rooms=4, warmup=0))
    _check_structure(result)
    assert [row["variant"] for row in result.rows] == list(stress_rooms.VARIANTS)
    assert set(result.samples) == {f"{v} rooms/s" for v in stress_rooms.VARIANTS}
    reference = next(r for r in result.rows if r["variant"] == stress_rooms.REFERENCE)
    assert reference[f"/{stress_rooms.REFERENCE}"] == 1.0
    assert result.goals[0].met is None  # report only
    # Judged against the library default, as docs/PERFORMANCE.md is.
    assert stress_rooms.REFERENCE == "mutex" and "default (mutex)" in result.goals[0].text


@pytest.mark.slow
@pytest.mark.nixl
@requires_nixl
@pytest.mark.timeout(180)
def test_fail_fast_tiny() -> None:
    """One round of each fault: every room in flight at a kill or a stop ends Failed (the
    latency is a figure and a goal line, never asserted)."""
    from bench import fail_fast

    result = fail_fast.measure(1)
    _check_structure(result)
    assert [row["fault"] for row in result.rows] == ["kill", "stop"]
    for row in result.rows:
        assert row["rooms"] == fail_fast.ROOMS and row["not Failed"] == 0, row
    assert all(g.met is not None for g in result.goals)


@pytest.mark.slow
@pytest.mark.nixl
@requires_nixl
def test_isolation_tiny() -> None:
    """Every cell runs both kinds; the hung peer's rooms stay in flight through a run."""
    result = isolation.measure(isolation.Preset(healthy=1, rooms=4, rounds=1))
    _check_structure(result)
    assert [row["cell"] for row in result.rows] == [label for label, _, _ in isolation.CELLS]
    for row in result.rows:
        assert row["healthy rooms"] == 4
        assert row["failed hung/none"] == "0/0"
        assert row["hung rooms stuck"] == "4/4"  # still Transferring at the run's end
    assert result.goals[0].met is not None
    assert any("seed 33" in note for note in result.notes)


def test_module_entry_point_lists() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--list"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert all(spec.name in proc.stdout for spec in BENCHMARKS)


# ---------------------------------------------------------------- curves


TINY_CURVES = curves.Preset(
    chunks=(1, 2), sessions=(1, 2), rooms=(1, 2), workers=(0, 1), rounds=1, writes=2, warmup=0
)


@pytest.mark.nixl
@requires_nixl
def test_curves_tiny() -> None:
    result = curves.measure(TINY_CURVES)
    _check_structure(result)
    labels = {shape.label(way) for way, shape in curves.cells(TINY_CURVES)}
    assert set(result.samples) == labels
    cpu = result.extra["cpu_us_per_room"]
    assert isinstance(cpu, dict) and set(cpu) == labels
    assert all(isinstance(v, list) and len(v) == TINY_CURVES.rounds for v in cpu.values())
    # One row per distinct point; one exponent row per curve (rooms: one per workers).
    assert {row["curve"] for row in result.rows} == set(curves.AXES)
    (fits,) = result.tables
    assert [(r["curve"], r["workers"]) for r in fits.rows] == list(curves.curve_points(TINY_CURVES))
    assert all(isinstance(r["sender"], float) for r in fits.rows)  # two sizes: a slope
    assert len(result.goals) == 4 and all(g.met is not None for g in result.goals)
    assert "NIXL's own per-call cost" in result.goals[3].text


def test_curves_preset_checks_its_sizes() -> None:
    with pytest.raises(ValueError, match="include 1"):
        curves.Preset(chunks=(1,), sessions=(2, 4), rooms=(1,), workers=(0,), rounds=1, writes=1)
    with pytest.raises(ValueError, match="increasing"):
        curves.Preset(chunks=(8, 1), sessions=(1,), rooms=(1,), workers=(0,), rounds=1, writes=1)


def _synthetic(preset: curves.Preset, cost: Callable[[str, curves.Shape], float]) -> BenchResult:
    """The report of made-up samples: ``cost(way, shape)`` µs per room in every round."""
    samples = {
        shape.label(way): [cost(way, shape)] * preset.rounds for way, shape in curves.cells(preset)
    }
    return curves._report(preset, samples, dict(samples), 0.0, 64)


SYNTH = curves.Preset(
    chunks=(1, 8, 32, 128),
    sessions=(1, 2, 4, 8),
    rooms=(1, 16, 256),
    workers=(0, 2),
    rounds=3,
    writes=8,
)


def _linear(way: str, shape: curves.Shape) -> float:
    """A fixed per-room part plus a part per write; bookkeeping half of NIXL's call."""
    per_write = {"sender": 40.0, "no-op": 5.0, "bare": 20.0, curves.SILENT: 10.0}[way]
    return 30.0 + per_write * shape.chunks * shape.sessions


def test_curves_linear_costs_flag_nothing() -> None:
    result = _synthetic(SYNTH, _linear)
    assert [g.met for g in result.goals] == [True, True, True, True]
    assert [g.open_by_design for g in result.goals] == [False, False, False, True]
    (fits,) = result.tables
    assert all(row["flag"] == "-" for row in fits.rows)
    chunks = next(r for r in fits.rows if r["curve"] == "chunks")
    assert isinstance(chunks["sender"], float) and 0.8 < chunks["sender"] < 1.0


def test_curves_flag_costs_that_grow_faster_than_the_work() -> None:
    """Planted: a sender whose per-chunk cost grows with the room (a poll over every chunk
    still in flight), a session fan-out that grows as sessions squared at the top, a
    per-room cost that grows with the rooms in flight on 2 workers, and bookkeeping dearer
    than NIXL's call. Each is flagged, on its own curve only."""

    def planted(way: str, shape: curves.Shape) -> float:
        base = _linear(way, shape)
        if way == "sender" and shape.sessions == 1 and shape.rooms == 1:
            base += 2.0 * shape.chunks**2  # quadratic in chunks
        if way == "no-op" and shape.sessions == 8:
            base *= 3.0  # the last step only: 4 -> 8 sessions costs 6x
        if way == "sender" and shape.workers == 2:
            base *= shape.rooms**0.3  # grows with rooms in flight
        if way == "no-op" and shape == curves.Shape(curves.BASE_CHUNKS, 1, 1, 0):
            base = 3 * _linear(curves.SILENT, shape)  # bookkeeping 3x NIXL's call
        return base

    result = _synthetic(SYNTH, planted)
    assert [g.met for g in result.goals] == [False, False, False, False]
    chunks, sessions, rooms, per_call = result.goals
    assert "sender" in chunks.detail and "no-op" not in chunks.detail.split("(")[0]
    assert "no-op" in sessions.detail and "last step" in sessions.detail
    assert "w=2: sender" in rooms.detail and "w=0" not in rooms.detail.split("(")[0]
    assert "no-op/call 3.00x" in per_call.detail


def test_loglog_exponent() -> None:
    assert loglog_exponent([1, 2, 4], [3.0, 6.0, 12.0]) == pytest.approx(1.0)
    assert loglog_exponent([1, 10], [5.0, 5.0]) == pytest.approx(0.0)
    assert loglog_exponent([1, 2, 4], [1.0, 4.0, 16.0]) == pytest.approx(2.0)
    assert loglog_exponent([2, 2], [1.0, 3.0]) is None
    with pytest.raises(ValueError):
        loglog_exponent([1, 2], [1.0])


# ---------------------------------------------------------------- instructions


def test_instructions_skipped_in_quick_and_without_valgrind(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    out = io.StringIO()
    assert main(["--quick", "instructions"], out=out) == 0
    assert "skipped: not part of --quick" in out.getvalue()
    monkeypatch.setattr(instructions.shutil, "which", lambda name: None)
    result = instructions.measure(instructions.FULL)
    assert result.status == "pending"
    assert any("valgrind not found on PATH" in n for n in result.notes)
    monkeypatch.undo()
    shim = tmp_path / "python"
    shim.write_text('#!/bin/sh\nexec python3 "$@"\n')
    monkeypatch.setattr(instructions.sys, "executable", str(shim))
    monkeypatch.setattr(instructions.shutil, "which", lambda name: f"/usr/bin/{name}")
    why = instructions.find_tools()
    assert isinstance(why, str) and "not an ELF binary" in why


def test_instructions_reads_window_dumps(tmp_path: Path) -> None:
    out = tmp_path / "callgrind.out"
    for i, n in enumerate((1_000, 33_000), start=1):
        out.with_name(f"callgrind.out.{i}").write_text(
            f"# callgrind format\nevents: Ir\nsummary: {n}\n\nfn=(1) x\n0 {n}\ntotals: {n}\n"
        )
    assert instructions.read_dumps(out, 2) == [1_000, 33_000]
    with pytest.raises(instructions.CallgrindError, match="dump 3 of 3 missing"):
        instructions.read_dumps(out, 3)
    with pytest.raises(instructions.CallgrindError, match="totals"):
        instructions.parse_totals(b"events: Ir\n")


def _windows(per_room: Callable[[str], int]) -> list[instructions.Window]:
    """Made-up child windows: ``per_room(name)`` instructions per room on top of a 1,000
    Ir empty window, with the rooms the child would run at ``--rooms 10``."""
    plan = [(w.name, w.rooms(10)) for w in child.windows(10)]
    return [(name, n, 1_000 + (per_room(name) * n if name != "empty" else 0)) for name, n in plan]


def _linear_ir(name: str) -> int:
    """A fixed per-room part plus a part per chunk send: linear, flat in rooms in flight."""
    sends = child.BASE_CHUNKS
    if name.startswith("chunks "):
        sends = int(name.split()[1])
    elif name.startswith("sessions "):
        sends = child.BASE_CHUNKS * int(name.split()[1])
    return 20_000 + 1_000 * sends if name != instructions.REFERENCE else 5_000


def test_instructions_report_per_room_spread_and_growth() -> None:
    preset = instructions.Preset(rooms=10, runs=2)
    run1 = _windows(_linear_ir)
    run2 = [(n, r, c + (100 if n == "send" else 0)) for n, r, c in run1]
    result = instructions.report(preset, [run1, run2])
    _check_structure(result)
    rows = {row["window"]: row for row in result.rows}
    assert rows["sender"]["run 1"] == 28_000 and rows["sender"]["rooms"] == 10
    assert rows["sender"]["spread %"] == "0.0000"
    assert rows["send"]["spread %"] != "0.0000"  # a planted difference between the runs
    assert rows["reference"]["/reference"] == 1.0
    (growth,) = result.tables
    assert [r["curve"] for r in growth.rows] == list(instructions.CURVES)
    assert [g.met for g in result.goals] == [None, True]
    assert all(r["flag"] == "-" for r in growth.rows)


def test_instructions_flag_superlinear_growth() -> None:
    """Planted: per-room instructions quadratic in chunks, and growing with rooms in flight
    (a per-room cost that scans every room in flight): both flagged, sessions not."""

    def planted(name: str) -> int:
        base = _linear_ir(name)
        if name.startswith("chunks "):
            base += 10 * int(name.split()[1]) ** 2
        if name.startswith("in flight "):
            base += 50 * int(name.split()[2])
        return base

    result = instructions.report(instructions.Preset(rooms=10, runs=1), [_windows(planted)])
    assert result.goals[1].met is False
    detail = result.goals[1].detail
    assert "chunks:" in detail and "rooms in flight:" in detail and "sessions" not in detail


def test_instructions_parse_windows_line() -> None:
    line = "WINDOWS " + ",".join(f"{w.name}:{w.rooms(4)}" for w in child.windows(4))
    assert [n for n, _ in instructions.parse_windows(line)] == list(child.WINDOW_NAMES)
    with pytest.raises(instructions.CallgrindError, match="unexpected"):
        instructions.parse_windows("WINDOWS empty:1,sender:4")
    with pytest.raises(instructions.CallgrindError, match="malformed"):
        instructions.parse_windows("WINDOWS empty:x")


@pytest.mark.slow  # 17 s at load 12
def test_callgrind_child_runs_natively() -> None:
    """The counted program, without valgrind: every window runs on the current API."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED="0")
    proc = subprocess.run(
        [sys.executable, "-m", "bench._callgrind_child", "--rooms", "2", "--pages", "2"],
        cwd=ROOT,
        env=env,
        input="go\n",
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    ready, windows = proc.stdout.splitlines()
    assert ready == "READY"
    plan = instructions.parse_windows(windows)
    assert plan == [(w.name, w.rooms(2)) for w in child.windows(2)]


def test_a_plain_run_leaves_the_host_network_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m bench`` (and ``--quick``) with no name leaves ``two-hosts`` out and says
    so; ``--two-hosts`` or its name runs it (``make bench-quick`` passes the flag)."""
    import bench.cli as cli
    from bench._harness import BenchResult

    ran: list[str] = []

    def fake_run_one(spec: Any, quick: bool, out: Any) -> BenchResult:
        ran.append(spec.name)
        return BenchResult(name=spec.name, title=spec.summary, status="pending")

    monkeypatch.setattr(cli, "_run_one", fake_run_one)
    everything = [s.name for s in BENCHMARKS if s.name != "two-hosts"]
    for args, want in (
        (["--quick"], everything),
        ([], everything),
        (["--quick", "--two-hosts"], [*everything, "two-hosts"]),
        (["two-hosts"], ["two-hosts"]),
        (["purge-scaling", "--two-hosts"], ["purge-scaling", "two-hosts"]),
    ):
        ran.clear()
        out = io.StringIO()
        assert main(args, out=out) == 0
        assert ran == want, args
        noted = "not running 'two-hosts': it changes this host's network" in out.getvalue()
        assert noted is ("two-hosts" not in want), args


# ---------------------------------------------------------------- goal lines (issue 34)


def test_a_goal_open_by_design_says_so_and_where_it_is_explained() -> None:
    """`make bench-quick` printed nine `[NOT MET]` lines with nothing telling the goals open
    by design (documented, not met there either) from a miss of this run."""
    detail = "worst 18.1 %: " + ", ".join(f"layout/path {i} 17.{i}%" for i in range(12))
    open_goal = Goal("bookkeeping <= 5 % of a room", False, detail, "the sender's Python calls")
    lines = open_goal.render("transfer-share")
    assert lines[0].startswith("goal [NOT MET] bookkeeping <= 5 % of a room: worst 18.1 %")
    text = " ".join(ln.strip() for ln in lines)
    assert "open by design (the sender's Python calls)" in text and OPEN_GOALS_DOC in text
    assert all(len(ln) <= REPORT_WIDTH for ln in lines)  # wrapped, not one 250-character line
    missed = Goal("checked pages >= 0.9x", False, "1 MiB: 0.77x").render("throughput")
    said = " ".join(ln.strip() for ln in missed)
    assert "not a known gap" in said and "python -m bench throughput" in said
    assert Goal("flat", True, "ok", "why").render("x") == ["goal [MET] flat: ok"]
    assert Goal("flat", None, "not measured", "why").render("x") == [
        "goal [N/A] flat: not measured"
    ]
    doc = (ROOT / "docs" / "PERFORMANCE.md").read_text(encoding="utf-8")
    assert "\n## Open goals\n" in doc and OPEN_GOALS_DOC.startswith("docs/PERFORMANCE.md")
    assert Goal("g", False, "d", "w").to_json()["open_by_design"] is True
