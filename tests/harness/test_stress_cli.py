"""``python -m stress`` end to end, as a subprocess with a bounded timeout.

The planted-violation tests use the hidden, test-only ``--plant-bug`` option: ``resurrect``
(a context that re-opens a purged room for a late writer) must fail ``no-resurrection``, and
``racy-request`` (a check-then-act ``request_prefetch``) must fail ``linearizable``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stress.cli import main

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
RUN_S = 40.0


def stress(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "stress", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_S,
        check=False,
    )
    print(proc.stdout[-4000:])
    print(proc.stderr[-4000:], file=sys.stderr)
    return proc


@pytest.mark.slow
def test_quick_staging_race_holds_every_invariant(tmp_path: Path) -> None:
    out = tmp_path / "stress.json"
    proc = stress("staging-race", "--quick", "--seed", "1", "--json", str(out))
    assert proc.returncode == 0
    assert proc.stdout.splitlines()[0] == "seed: 1"
    doc = json.loads(out.read_text())
    assert doc["seed"] == 1 and doc["ok"] is True
    (scenario,) = doc["scenarios"]
    assert scenario["name"] == "staging-race" and scenario["ops"] > 0 and scenario["rooms"] > 0
    invariants = scenario["invariants"]
    assert set(invariants) >= {
        "no-escaped-exception",
        "no-resurrection",
        "no-leak",
        "counters-consistent",
        "linearizable",
        "no-deadlock",
        "no-thread-left",
        "lock-order",
    }
    assert {name: inv["violations"] for name, inv in invariants.items()} == dict.fromkeys(
        invariants, 0
    )
    assert scenario["extra"]["epochs"] > 0  # the quiescent checks did run
    assert scenario["extra"]["linearizability_rounds"] > 0  # and the probe rounds


@pytest.mark.nixl
@pytest.mark.slow  # every sender scenario --quick as a subprocess: 25 s at load 12
@pytest.mark.timeout(120)
def test_quick_sender_scenarios_hold_every_invariant(tmp_path: Path) -> None:
    """The two NIXL scenarios (real peer processes, injected faults, SIGKILL/SIGSTOP)."""
    out = tmp_path / "stress.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "stress",
            "sender-lifecycle",
            "peer-faults",
            "--quick",
            "--seed",
            "3",
            "--fault-rate",
            "0.05",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["ok"] is True
    by_name = {s["name"]: s for s in doc["scenarios"]}
    assert set(by_name) == {"sender-lifecycle", "peer-faults"}
    for scenario in by_name.values():
        assert scenario["rooms"] > 0
        assert {
            "no-leak", "rooms-concluded", "bytes-verified", "no-resurrection",
            "decode-page-audit", "failure-contract", "chunks-once",
        } <= set(scenario["invariants"])  # fmt: skip
        assert all(inv["violations"] == 0 for inv in scenario["invariants"].values())
        assert scenario["extra"]["verified"] > 0
        assert scenario["extra"]["pages_audited"] > 0  # the page audit did judge pages
    assert by_name["sender-lifecycle"]["extra"]["faults_injected"] > 0
    peer = by_name["peer-faults"]["extra"]
    assert peer["peer_kills"] + peer["peer_stops"] > 0
    # The sender's WARNING per failed room is counted in the report, not printed (rooms fail
    # on purpose here: a printed line each would bury the report).
    failed_kind = "sender.manager WARNING: room %d generation %d failed (sessions %s): %s: %s"
    assert doc["sender_log"].get(failed_kind, 0) > 0, doc["sender_log"]
    assert by_name["peer-faults"]["sender_log"]["counts"].get(failed_kind, 0) > 0
    assert "sender log records (counted, not printed" in proc.stdout
    for stream in (proc.stdout, proc.stderr):  # the table shows the format, not lines
        assert re.search(r"room \d+ generation \d+ failed", stream) is None


@pytest.mark.parametrize(
    "args",
    [
        ("--threads", "0"),
        ("--rooms", "0"),
        ("--fault-rate", "1.5"),
        ("--fault-rate", "-0.1"),
        ("--duration", "0"),
        ("--duration", "nan"),
        ("--lock", "spin"),
        ("no-such-scenario",),
    ],
)
def test_bad_arguments_exit_2(args: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    assert exited.value.code == 2
    assert "error" in capsys.readouterr().err


def test_bad_arguments_exit_2_as_a_process() -> None:
    proc = stress("--threads", "-3")
    assert proc.returncode == 2
    assert "--threads" in proc.stderr


@pytest.mark.parametrize(
    ("bug", "invariant"),
    [("resurrect", "no-resurrection"), ("racy-request", "linearizable")],
)
def test_planted_violation_exits_1(tmp_path: Path, bug: str, invariant: str) -> None:
    out = tmp_path / "stress.json"
    proc = stress(
        "staging-race", "--duration", "1", "--seed", "7", "--plant-bug", bug, "--json", str(out)
    )
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[0] == "seed: 7"
    doc = json.loads(out.read_text())
    assert doc["ok"] is False
    assert doc["invariants"][invariant] > 0


@pytest.mark.timeout(30)
def test_help_documents_every_option_and_its_default() -> None:
    """Every option has help text, and every option with a value shows its default."""
    from stress.cli import build_parser

    parser = build_parser(list_scenarios=False)
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or not action.option_strings:
            continue
        assert action.help, f"{action.option_strings} has no help"
        if action.default not in (None, False, argparse.SUPPRESS):
            assert f"(default: {action.default})" in text, action.option_strings
    assert "--lock {rw,mutex} lock kind" in text and "--progress {auto,on,off} live" in text


def _ran_by_main(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[list[str], str]:
    """The scenarios ``main(args)`` would run (each stubbed to an instant SKIP: nothing of a
    scenario runs, so no namespace, veth or tc rule is made), and what it printed."""
    import stress.cli as cli
    from stress.framework import skipped_result

    ran: list[str] = []

    def fake_run(scenario: Any, config: Any, **_: Any) -> Any:
        ran.append(scenario.name)
        return skipped_result(scenario.name, "stubbed by the test", config)

    monkeypatch.setattr(cli, "run_scenario", fake_run)
    assert cli.main([*args, "--native-stderr", "pass", "--sender-log", "show"]) == 0
    return ran, capsys.readouterr().out


def test_a_plain_run_leaves_the_host_network_alone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m stress`` with no scenario named runs every scenario but ``two-hosts`` (it
    creates network namespaces, veths and tc shaping as root) and says so; the flag or the
    name brings it back (``make stress`` passes the flag)."""
    from stress.framework import registered

    everything = [n for n in registered() if n != "two-hosts"]
    ran, out = _ran_by_main(monkeypatch, capsys)
    assert ran == everything and "two-hosts" not in ran
    assert "not running scenario 'two-hosts': it changes this host's network" in out
    ran, out = _ran_by_main(monkeypatch, capsys, "--two-hosts")
    # In registration order, which is import order: another test file may import the two-hosts
    # scenario first (tests/e2e/test_two_hosts.py is collected before this file).
    assert ran == list(registered()) and "not running" not in out
    ran, _ = _ran_by_main(monkeypatch, capsys, "two-hosts")
    assert ran == ["two-hosts"]
    ran, _ = _ran_by_main(monkeypatch, capsys, "staging-race", "--two-hosts")
    assert ran == ["staging-race", "two-hosts"]


def test_make_stress_asks_for_two_hosts() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    for target in ("stress", "stress-quick", "bench", "bench-quick"):
        recipe = re.search(rf"^{target}: .*\n\t(.*)$", makefile, re.MULTILINE)
        assert recipe is not None and "--two-hosts" in recipe.group(1), target


def test_quick_says_what_its_two_seconds_are() -> None:
    """``--quick`` bounds the load window, not the wall time (peer-faults --quick took 10 s
    on a quiet 2-core machine, 17 s on a loaded one): the help says so."""
    from stress.cli import build_parser

    text = " ".join(build_parser(list_scenarios=False).format_help().split())
    assert "2 s of load per scenario" in text and "~2 s per scenario" not in text
