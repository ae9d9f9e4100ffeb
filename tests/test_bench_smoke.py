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

import pytest

import staging.context as staging_context
import staging.validate as staging_validate
from bench import lifecycle, purge_scaling, stress_rooms, throughput, transfer_share
from bench import lifecycle_profile as prof
from bench._harness import BenchResult, Goal, interleave, median_ratio
from bench._registry import BENCHMARKS, BY_NAME
from bench.cli import main
from sender import _nixl
from tests.fixtures_nixl import requires_nixl

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
NIXL_BENCHES = ("transfer-share", "throughput", "stress-rooms")


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
        *NIXL_BENCHES,
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
    assert [(row["layout"], row["path"]) for row in result.rows] == [
        (layout, path) for layout in transfer_share.LAYOUTS for path in transfer_share.PATHS
    ]
    assert len(result.samples) == len(result.rows) * len(transfer_share.WAYS)
    assert "bookkeeping" in result.goals[0].text
    by_call = result.extra["bookkeeping_us_by_call"]
    assert isinstance(by_call, dict)
    calls = by_call["contiguous/direct"]
    assert isinstance(calls, dict) and set(calls) == set(transfer_share.CALLS)


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
    assert "torch copy_" in result.goals[0].text
    # Every goal case measured: the torch goal, then three for ours and three for checked.
    assert [g.met is not None for g in result.goals] == [True] * 7


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
