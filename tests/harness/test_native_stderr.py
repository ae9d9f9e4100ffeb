"""NIXL/UCX lines on fd 2 in ``python -m stress`` (issue 18, item 4): counted by class and
labelled in the report instead of printed, other lines forwarded, and the TTY progress line
redrawn after anything printed while it is shown.

The lines are written the way native code writes them: straight to fd 2 (``os.write``), by
a child process that inherited fd 2, and by a real NIXL agent sending a notification to a
SIGKILLed peer. The samples are lines seen in ``python -m stress peer-faults --quick``.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stress.console import Console, ConsoleStream
from stress.framework import Monitor, ScenarioMetrics, StressConfig, run_scenario
from stress.invariants import NO_ESCAPED_EXCEPTION
from stress.native_stderr import CLASSES, NativeStderr, classify
from stress.report import document, native_table, summary_table
from tests.fixtures_nixl import requires_nixl

pytestmark = pytest.mark.timeout(60)

SAMPLES = {
    "E1201 22:25:42.263944   27610 nixl_agent.cpp:1437] genNotif: backend 'UCX' returned error "
    "status NIXL_ERR_REMOTE_DISCONNECT while sending notification to agent 'decode-b-63b2'": (
        "nixl-notif-to-dead-peer"
    ),
    "E1201 22:25:42.258585   27615 nixl_agent.cpp:1198] postXferReq: remote agent "
    "'decode-b-63b2' was disconnected after transfer request creation": "nixl-post-to-dead-peer",
    "W1201 22:25:42.049587   27615 ucx_enums.cpp:58] Unexpected UCX error: Input/output error": (
        "ucx-unexpected-error"
    ),
    "[1764628000.123456] [host:1234:0]          mpool.c:269  UCX  WARN  object 0x55d0 "
    "{flags:0x20080} was not returned to mpool ucp_requests": "ucx-mpool-not-returned",
    "E1201 22:25:42.1 27610 nixl_agent.cpp:900] loadRemoteMD: something else": "nixl-agent-error",
    "W1201 22:25:42.1 27610 ucx_backend.cpp:77] some backend warning": "nixl-other",
    "[1764628000.1] [host:1:0]  ucp_worker.c:1 UCX  ERROR  whatever": "ucx-other",
}


def test_classify_the_lines_seen_in_stress_runs() -> None:
    for line, want in SAMPLES.items():
        assert classify(line) == want, line
    for other in ("Traceback (most recent call last):", "note: two-hosts skipped", "", "E1201"):
        assert classify(other) is None
    assert len({c.name for c in CLASSES}) == len(CLASSES)


def _write_lines_like_native_code(lines: list[str]) -> None:
    os.write(2, "".join(f"{ln}\n" for ln in lines).encode())  # bypasses sys.stderr


def test_capture_counts_classified_lines_and_forwards_the_rest(
    capfd: pytest.CaptureFixture[str],
) -> None:
    native = NativeStderr()
    native.start()
    try:
        _write_lines_like_native_code([*SAMPLES, "plain line from native code"])
        # A child process inheriting fd 2 (as decode peers do), one line split in two writes.
        code = (
            "import os,time; os.write(2, b'E1201 22:25:42.2 1 nixl_agent.cpp:1437] genNotif: x ')"
            "; time.sleep(0.05); os.write(2, b'NIXL_ERR_REMOTE_DISCONNECT y\\nchild says hi\\n')"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
        assert native.sync(5.0)
        got = native.take()
    finally:
        native.stop()
    want: dict[str, int] = {}
    for name in SAMPLES.values():
        want[name] = want.get(name, 0) + 1
    want["nixl-notif-to-dead-peer"] += 1  # the child's line
    assert got.counts == want
    assert got.examples["ucx-mpool-not-returned"][0].endswith("mpool ucp_requests")
    err = capfd.readouterr().err
    assert "plain line from native code" in err and "child says hi" in err
    assert "genNotif" not in err and "mpool" not in err  # counted, not printed
    assert native.take().total == 0  # take() resets


def test_show_prints_classified_lines_labelled(capfd: pytest.CaptureFixture[str]) -> None:
    with NativeStderr(show=True) as native:
        _write_lines_like_native_code(list(SAMPLES)[:1])
        assert native.sync(5.0)
        assert native.take().counts == {"nixl-notif-to-dead-peer": 1}
    assert "[native:nixl-notif-to-dead-peer] E1201" in capfd.readouterr().err


def test_fd2_and_sys_stderr_are_restored() -> None:
    before = os.fstat(2)
    old = sys.stderr
    native = NativeStderr()
    native.start()
    assert os.fstat(2).st_ino != before.st_ino  # the pipe
    native.stop()
    native.stop()  # idempotent
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
    assert sys.stderr is old


# --------------------------------------------------------------------------- progress line


def test_console_redraws_the_status_line_after_other_output() -> None:
    tty = io.StringIO()
    console = Console(tty)
    console.status("[run] 1.0/2.0s")
    console.line("E1201 native line")
    ConsoleStream(console, tty).write("python line\n")
    console.status("[run] 1.2/2.0s")
    console.end_status()
    assert tty.getvalue() == (
        "\r[run] 1.0/2.0s\x1b[K"
        "\r\x1b[KE1201 native line\n[run] 1.0/2.0s\x1b[K"
        "\r\x1b[Kpython line\n[run] 1.0/2.0s\x1b[K"
        "\r[run] 1.2/2.0s\x1b[K"
        "\r[run] 1.2/2.0s\x1b[K\n"
    )
    # Unfinished text is never drawn over: the next status starts on a new line.
    tty2 = io.StringIO()
    c2 = Console(tty2)
    c2.status("S")
    c2.write("partial")
    c2.status("S2")
    assert tty2.getvalue() == "\rS\x1b[K\r\x1b[Kpartial\n\rS2\x1b[K"


class _Noisy:
    """A scenario whose worker thread writes native lines to fd 2 while the bar is shown."""

    name = "noisy"
    description = "test double"
    default_duration = 0.3
    invariants = (NO_ESCAPED_EXCEPTION,)

    def __init__(self, ready: Callable[[], bool] | None = None) -> None:
        self.ready = ready

    def run(self, config: StressConfig, monitor: Monitor) -> ScenarioMetrics:
        counters = monitor.counters()

        def work() -> None:
            counters.ops += 1
            end = time.monotonic() + 20
            while self.ready is not None and not self.ready() and time.monotonic() < end:
                time.sleep(0.01)  # until the bar is on screen (bounded; asserted after)
            for i in range(20):
                counters.ops += 1
                line = next(iter(SAMPLES)) if i % 2 else f"native stray line {i}"
                _write_lines_like_native_code([line])
                time.sleep(0.01)

        monitor.spawn(work, "w")
        monitor.join_all(timeout=10)
        return ScenarioMetrics()


class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_run_scenario_counts_lines_and_the_progress_line_survives() -> None:
    tty = _FakeTTY()
    native = NativeStderr()
    native.start()
    try:
        result = run_scenario(_Noisy(), StressConfig(), progress=True, native=native)
        native.sync(5.0)
        console_out = tty.getvalue()
        # the same run, its bar on a fake terminal (the stream), lines forwarded through it
        noisy = _Noisy(ready=lambda: "[noisy] [" in tty.getvalue())
        result2 = run_scenario(noisy, StressConfig(), progress=True, stream=tty, native=native)
    finally:
        native.stop()
    assert result.native is not None and result.native.counts == {"nixl-notif-to-dead-peer": 10}
    assert result2.native is not None and result2.native.total == 10
    out = tty.getvalue()[len(console_out) :]
    assert out.index("[noisy] ") < out.index("native stray line 0"), out
    for i in range(0, 20, 2):
        # printed while the bar is shown: the bar erased before it, redrawn right after it
        seg = f"\r\x1b[Knative stray line {i}\n[noisy] "
        assert seg in out, (i, out[-500:])
    assert out.endswith("\n") and "genNotif" not in out
    text = native_table([result, result2])
    assert "nixl-notif-to-dead-peer" in text and "10" in text and "room notice" in text
    doc = json.loads(json.dumps(document(StressConfig(), [result, result2])))
    assert doc["native_stderr"] == {"nixl-notif-to-dead-peer": 20}
    assert doc["scenarios"][0]["native_stderr"]["counts"] == {"nixl-notif-to-dead-peer": 10}
    assert "noisy" in summary_table([result])


# --------------------------------------------------------------------------- real NIXL


@requires_nixl
@pytest.mark.nixl
@pytest.mark.timeout(90)
def test_a_real_agents_notification_to_a_killed_peer_is_counted(
    peer_factory: Callable[..., Any], capfd: pytest.CaptureFixture[str]
) -> None:
    from sender.transport import NixlTransport

    peer = peer_factory(8, 4096)
    native = NativeStderr()
    with NixlTransport("native-stderr-prefill") as tx:
        tx.add_peer("d", peer.metadata)
        tx.send_notif("d", b"hello")  # connects
        peer.kill()
        native.start()
        try:
            errors = 0
            end = time.monotonic() + 10
            while time.monotonic() < end and errors < 3:
                try:
                    tx.send_notif("d", b"to a dead peer")
                except Exception:
                    errors += 1
                time.sleep(0.01)
            assert native.sync(5.0)
            got = native.take()
        finally:
            native.stop()
    print(got)
    assert errors >= 1
    assert got.counts.get("nixl-notif-to-dead-peer", 0) >= 1, got
    assert "genNotif" not in capfd.readouterr().err


def test_cli_reports_native_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--native-stderr pass leaves fd 2 alone: no native section, nothing counted."""
    from stress.cli import main

    out = tmp_path / "r.json"
    argv = ["staging-race", "--duration", "0.3", "--threads", "2", "--progress", "off"]
    assert main([*argv, "--json", str(out), "--native-stderr", "pass"]) == 0
    doc = json.loads(out.read_text())
    assert doc["scenarios"][0]["native_stderr"] is None and doc["native_stderr"] == {}
    assert main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "native stderr: no NIXL/UCX line on fd 2" in text
    assert json.loads(out.read_text())["scenarios"][0]["native_stderr"]["counts"] == {}


def test_lines_of_a_childs_own_stderr_file_are_counted_too() -> None:
    """two-hosts' sender child writes its stderr to a file: its lines are classified from
    the file and added to the scenario's counts (with or without a capture)."""
    from stress.native_stderr import count_lines, merge

    text = "\n".join([*SAMPLES, "Traceback (most recent call last):", *list(SAMPLES)[:2]])
    counted = count_lines(text)
    assert counted.counts["nixl-notif-to-dead-peer"] == 2 and counted.total == len(SAMPLES) + 2

    class _Child(_Noisy):
        def run(self, config: StressConfig, monitor: Monitor) -> ScenarioMetrics:
            monitor.counters().ops += 1
            monitor.native_lines(counted)
            monitor.native_lines(count_lines(next(iter(SAMPLES))))
            return ScenarioMetrics()

    result = run_scenario(_Child(), StressConfig(), progress=False)
    assert result.native is not None
    merged = merge(counted, count_lines(next(iter(SAMPLES))))
    assert merged is not None and result.native.counts == merged.counts
    assert result.native.counts["nixl-notif-to-dead-peer"] == 3
    assert len(result.native.examples["nixl-notif-to-dead-peer"]) == 3
