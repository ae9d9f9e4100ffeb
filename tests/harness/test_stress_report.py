"""Truthful, replayable stress reports (issue 18, item 5), one test per report item:

* a skipped scenario (two-hosts without root, simulated) is ``SKIP`` with its reason, never
  ``PASS`` with invariants at 0; exit 0 unless ``--require-all`` (then 3);
* an escaped exception's traceback is in the report and the JSON (one planted);
* a FAIL prints the exact command line that replays it, and that line parses back to the
  same configuration;
* ``--seed`` says what it fixes (the plan, not the schedule);
* the progress line is sane during set-up (no bar with nothing counted) and never shows
  more time than the run's duration;
* the stress default lock is the library default;
* every rate states its time base (the run window), and rates are computed on it;
* the two-hosts fault table's columns add up (``in flight`` = ``failed`` + ``ok`` [+
  ``other``]).
"""

from __future__ import annotations

import inspect
import json
import shlex
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from staging.context import StagingContext
from stress.cli import build_parser, config_from_args, main
from stress.framework import (
    InvariantReport,
    Monitor,
    ScenarioMetrics,
    ScenarioResult,
    StressConfig,
    run_scenario,
)
from stress.invariants import NO_ESCAPED_EXCEPTION, NO_THREAD_LEFT
from stress.report import (
    RATE_NOTE,
    document,
    invariant_table,
    replay_argv,
    replay_command,
    summary_table,
)

pytestmark = pytest.mark.timeout(60)


def _two_hosts_available() -> None:
    pytest.importorskip("numpy", reason="two-hosts needs the 'sender' extra")
    pytest.importorskip("torch", reason="two-hosts needs the 'sender' extra")


# --------------------------------------------------------------------------- SKIP


@pytest.mark.parametrize("require_all", [False, True])
def test_two_hosts_without_root_is_skip_with_its_reason(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    require_all: bool,
) -> None:
    _two_hosts_available()
    from stress import netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)  # not root
    monkeypatch.setattr(netns, "_reason_cache", {})
    out = tmp_path / "run.json"
    argv = ["two-hosts", "--quick", "--seed", "5", "--progress", "off", "--json", str(out)]
    code = main([*argv, *(["--require-all"] if require_all else [])])
    text = capsys.readouterr().out
    assert code == (3 if require_all else 0), text
    row = next(line for line in text.splitlines() if line.startswith("two-hosts "))
    assert row.split()[-1] == "SKIP" and "PASS" not in row, row
    assert "SKIP two-hosts: network namespaces need root (euid is 1000)" in text
    assert "result: PASS (1 skipped: two-hosts)" in text
    inv_header = next(line for line in text.splitlines() if line.startswith("invariant"))
    assert "two-hosts" in inv_header
    assert not [ln for ln in text.splitlines() if ln.startswith("fault-to-failed")
                and ln.split()[1] == "0"]  # fmt: skip
    doc = json.loads(out.read_text())
    (scenario,) = doc["scenarios"]
    assert scenario["status"] == "SKIP" and scenario["invariants"] == {}
    assert doc["skipped"] == {"two-hosts": "network namespaces need root (euid is 1000)"}
    assert doc["ok"] is True and doc["replay"] is None


# --------------------------------------------------------------------------- tracebacks


@dataclass
class _Fake:
    body: Any
    name: str = "fake-report"
    description: str = "test double"
    default_duration: float = 0.2
    invariants: tuple[str, ...] = (NO_ESCAPED_EXCEPTION, NO_THREAD_LEFT)

    def run(self, config: StressConfig, monitor: Monitor) -> ScenarioMetrics:
        self.body(config, monitor)
        return ScenarioMetrics()


def _planted_worker_bug() -> None:
    table: dict[int, int] = {}
    table[14] += 1  # KeyError: 14, as in the issue


def _raw_thread_bug() -> None:
    raise ValueError("escaped past the spawn wrapper")


def test_escaped_exceptions_carry_their_tracebacks_into_report_and_json() -> None:
    def body(config: StressConfig, monitor: Monitor) -> None:
        monitor.spawn(_planted_worker_bug, "worker-3")
        raw = threading.Thread(target=_raw_thread_bug, daemon=True)  # via the excepthook
        raw.start()
        raw.join(5)
        monitor.join_all(timeout=5)

    result = run_scenario(_Fake(body), StressConfig(), progress=False)
    inv = next(i for i in result.invariants if i.name == NO_ESCAPED_EXCEPTION)
    assert inv.violations == 2 and len(inv.tracebacks) == 2
    joined = "\n".join(inv.tracebacks)
    for needle in ("Traceback (most recent call last)", "_planted_worker_bug",
                   "table[14] += 1", "KeyError: 14", "_raw_thread_bug", "ValueError"):  # fmt: skip
        assert needle in joined, needle
    table = invariant_table([result])
    assert "no-escaped-exception: worker-3: KeyError: 14" in table
    assert "traceback 1:" in table and "table[14] += 1" in table
    doc = json.loads(json.dumps(result.to_json()))
    tbs = doc["invariants"][NO_ESCAPED_EXCEPTION]["tracebacks"]
    assert any("_planted_worker_bug" in tb for tb in tbs)


# --------------------------------------------------------------------------- replay


def test_replay_argv_parses_back_to_the_same_config() -> None:
    parser = build_parser(list_scenarios=False)
    for config in (
        StressConfig(seed=7),
        StressConfig(
            threads=3,
            rooms=5,
            chunks=2,
            fault_rate=0.125,
            peer_kill=True,
            peer_stop=True,
            duration=1.5,
            seed=99,
            switch_interval=1e-05,
            lock="rw",
            quick=True,
            watchdog_s=7.5,
            plant_bug="resurrect",
        ),
    ):
        argv = replay_argv(config, ["staging-race"])
        args = parser.parse_args(argv)
        assert args.scenarios == ["staging-race"]
        assert config_from_args(args, args.seed) == config
        assert shlex.split(replay_command(config, ["staging-race"]))[3:] == argv


def test_a_fail_prints_the_command_that_replays_it(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["staging-race", "--duration", "0.4", "--seed", "3", "--threads", "2"]
    assert main([*argv, "--plant-bug", "resurrect", "--progress", "off"]) == 1
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("replay: "))
    cmd = shlex.split(line.removeprefix("replay: "))
    assert cmd[:3] == ["python", "-m", "stress"]
    args = build_parser(list_scenarios=False).parse_args(cmd[3:])
    want = StressConfig(threads=2, duration=0.4, seed=3, plant_bug="resurrect")
    assert args.scenarios == ["staging-race"] and config_from_args(args, args.seed) == want


def test_seed_help_says_it_fixes_the_plan_not_the_schedule() -> None:
    text = " ".join(build_parser(list_scenarios=False).format_help().split())
    assert "fixes each worker's plan" in text and "not the thread schedule" in text
    import stress.cli

    assert "does not fix the thread schedule" in " ".join((stress.cli.__doc__ or "").split())


# --------------------------------------------------------------------------- progress line


def test_progress_line_during_set_up_and_past_the_duration() -> None:
    m = Monitor("peer-faults", (), duration_s=2.0, watchdog_s=10.0)
    start = m.started
    line = m.progress_line(now=start + 3.2)  # peers still starting: nothing counted
    assert "setting up 3.2s" in line and "#" not in line and "/2.0s" not in line, line
    c = m.counters()
    c.ops, c.rooms = 500, 40
    line = m.progress_line(now=start + 1.0)
    assert " 1.0/2.0s " in line and "[##########..........]" in line, line
    assert "500 ops/s" in line and "40 rooms/s" in line  # per second of the run so far
    line = m.progress_line(now=start + 3.2)  # past the deadline: joins and checks
    assert " 2.0/2.0s +1.2s finishing" in line and "3.2/2.0" not in line, line
    assert "[####################]" in line and "250 ops/s" in line, line


# --------------------------------------------------------------------------- lock default


def test_stress_default_lock_is_the_library_default() -> None:
    from sender.manager import KVManager

    library = inspect.signature(StagingContext).parameters["lock"].default
    assert library == "mutex"
    assert inspect.signature(KVManager).parameters["lock"].default == library
    assert StressConfig().lock == library
    assert build_parser(list_scenarios=False).parse_args([]).lock == library


# --------------------------------------------------------------------------- time base


def _result(**kw: Any) -> ScenarioResult:
    base: dict[str, Any] = dict(
        name="two-hosts", seed=1, threads=4, duration_s=30.0, elapsed_s=41.2, ops=61056,
        rooms=7632, faults=10, latency_p50_ms=None, latency_p99_ms=None, lock=None,
        invariants=(InvariantReport(NO_ESCAPED_EXCEPTION, 0),), run_s=30.0,
    )  # fmt: skip
    base.update(kw)
    return ScenarioResult(**base)


def test_rates_are_per_second_of_the_run_window_and_say_so() -> None:
    r = _result()
    assert r.rooms_per_s == pytest.approx(7632 / 30.0)  # 254/s, not 185/s (wall)
    text = summary_table([r])
    header, _, row = text.splitlines()[:3]
    cols = dict(zip(header.split("  "), row.split("  "), strict=False))
    cells = row.split()
    assert cells[5:9] == ["30.0", "41.2", "254", "2,035"], cells
    assert "run s" in header and "wall s" in header and cols
    assert RATE_NOTE in text
    doc = r.to_json()
    assert doc["rates_per"] == "run_s" and doc["run_s"] == 30.0 and doc["rooms_per_s"] == 254.4
    legacy = _result(run_s=None)  # no run window known: the wall time, said so
    assert legacy.rooms_per_s == pytest.approx(7632 / 41.2)
    assert legacy.to_json()["rates_per"] == "elapsed_s"


def test_run_window_starts_after_a_slow_set_up() -> None:
    def body(config: StressConfig, monitor: Monitor) -> None:
        threading.Event().wait(0.3)  # set-up (e.g. peer processes)
        monitor.restart_clock()
        counters = monitor.counters()
        while monitor.running():
            counters.ops += 1

    result = run_scenario(_Fake(body), StressConfig(duration=0.2), progress=False)
    assert result.run_s is not None and result.run_s < result.elapsed_s
    assert result.ops_per_s == pytest.approx(result.ops / result.run_s)


# --------------------------------------------------------------------------- fault table


def _phase(kind: str, rate: int, in_flight: int, failed: int, ok: int) -> dict[str, Any]:
    return {
        "kind": kind, "rate_bit": rate, "in_flight": in_flight, "in_flight_failed": failed,
        "in_flight_succeeded": ok, "fault_to_failed_ms_max": 540.0, "goal_ms": 600.0,
        "goal_met": True, "opened_after": 3, "opened_after_ms_max": 900.0, "leaks": 0,
        "corruption": 0, "early_reuse": 0, "recovered": True,
        "first_success_after_repair_ms": 12.0, "canary": {},
    }  # fmt: skip


def test_fault_table_columns_add_up() -> None:
    _two_hosts_available()
    from stress.scenarios.two_hosts import format_phases

    def rows(phases: list[dict[str, Any]]) -> list[dict[str, str]]:
        lines = format_phases({"phases": phases}).splitlines()
        head = [h.strip() for h in _split(lines[0])]
        body = lines[1 : 1 + len(phases)]  # the legend follows
        return [dict(zip(head, _split(ln, len(head)), strict=True)) for ln in body]

    got = rows([_phase("stop", 10_000_000_000, 11, 9, 2), _phase("kill", 10**9, 4, 4, 0)])
    stop = got[0]
    assert (stop["fault"], stop["rate"]) == ("stop", "10G")
    assert (stop["in flight"], stop["failed"], stop["ok"]) == ("11", "9", "2")
    assert "other" not in stop  # nothing unaccounted: no column for it
    for r in got:
        assert int(r["in flight"]) == int(r["failed"]) + int(r["ok"])
    odd = rows([_phase("stop", 10**9, 5, 3, 1)])[0]
    assert odd["other"] == "1"
    assert int(odd["in flight"]) == int(odd["failed"]) + int(odd["ok"]) + int(odd["other"])


def test_fault_table_has_a_legend_and_the_readme_explains_every_column() -> None:
    """The columns `in flight`, `opened after`, `their max ms`, `1st ok ms`, `goal` and
    `canary` were explained nowhere: a legend is printed under the table, and the README's
    stress section has a row for every column."""
    _two_hosts_available()
    from stress.scenarios.two_hosts import FAULT_TABLE_LEGEND, format_phases

    lines = format_phases({"phases": [_phase("stop", 10**9, 5, 4, 1)]}).splitlines()
    head = [h.strip() for h in _split(lines[0])]
    assert lines[2:] == list(FAULT_TABLE_LEGEND) and all(len(ln) <= 100 for ln in lines[2:])
    legend = " ".join(FAULT_TABLE_LEGEND)
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("`two-hosts` prints one row per fault") :]
    section = section[: section.index("\n\n", section.index("| column | meaning |"))]
    explained = {
        c.strip("` ") for row in section.splitlines()[3:] for c in row.split("|")[1].split(",")
    }
    for column in [*head, "other"]:
        assert column in explained, column
    for column in ("in flight", "opened after", "their max ms", "1st ok ms", "goal", "canary"):
        assert column in legend, column
    assert format_phases({"phases": []}).splitlines()[1:] == []  # no rows: no legend


def _split(line: str, n: int | None = None) -> list[str]:
    """Cells of a table line whose columns are separated by two spaces or more."""
    import re

    cells = [c for c in re.split(r"\s{2,}", line.strip())]
    if n is not None:
        cells += [""] * (n - len(cells))
    return cells


def test_document_of_a_failed_run_names_the_replay() -> None:
    bad = _result(
        name="staging-race",
        invariants=(InvariantReport(NO_ESCAPED_EXCEPTION, 1, ("w: KeyError: 14",), ("tb",)),),
    )
    config = replace(StressConfig(), seed=1, quick=True)
    doc = document(config, [bad, _result(skipped="needs root", invariants=(), run_s=None)])
    assert doc["replay"] == "python -m stress staging-race --seed 1 --quick"
    assert doc["skipped"] == {"two-hosts": "needs root"} and doc["ok"] is False
