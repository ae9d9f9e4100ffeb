"""The stress suite's capture of the library's own log records (``stress.sender_log``).

A stress run fails rooms on purpose; the sender logs one WARNING per failed room. The capture
counts them by kind instead of printing them, and gives logging back as it was.
"""

from __future__ import annotations

import logging
import threading

import pytest

from stress.framework import ScenarioResult, StressConfig
from stress.report import document, sender_log_table
from stress.sender_log import EXAMPLES_PER_KIND, LOGGERS, SenderLog

pytestmark = pytest.mark.timeout(30)

FAILED = "room %d generation %d failed (sessions %s): %s: %s"


def _result(name: str, log: SenderLog | None) -> ScenarioResult:
    return ScenarioResult(
        name=name, seed=1, threads=1, duration_s=1.0, elapsed_s=1.0, ops=1, rooms=1,
        faults=0, latency_p50_ms=None, latency_p99_ms=None, lock=None, invariants=(),
        sender_log=None if log is None else log.take(),
    )  # fmt: skip


def test_records_are_counted_by_kind_and_not_printed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = SenderLog()
    log.start()
    try:
        manager = logging.getLogger("sender.manager")
        for room in range(5):
            manager.warning(FAILED, room, 1, "d1", "transport", "boom")
        logging.getLogger("staging.compat").warning("refused %s", "x")
        logging.getLogger("sender.transport").error("NIXL refused %s", "it")
        counts = log.take()
    finally:
        log.stop()
    out = capsys.readouterr()
    assert "boom" not in out.err and "boom" not in out.out
    assert counts.counts == {
        f"sender.manager WARNING: {FAILED}": 5,
        "staging.compat WARNING: refused %s": 1,
        "sender.transport ERROR: NIXL refused %s": 1,
    }
    kept = counts.examples[f"sender.manager WARNING: {FAILED}"]
    assert len(kept) == EXAMPLES_PER_KIND
    assert kept[0] == "room 0 generation 1 failed (sessions d1): transport: boom"
    assert counts.total == 7


def test_take_resets_and_stop_gives_logging_back(caplog: pytest.LogCaptureFixture) -> None:
    before = {name: (logging.getLogger(name).propagate, list(logging.getLogger(name).handlers))
              for name in LOGGERS}  # fmt: skip
    log = SenderLog()
    log.start()
    assert log.active
    logging.getLogger("sender").warning("one")
    assert "one" not in caplog.messages  # not propagated while counted
    assert log.take().total == 1
    assert log.take().total == 0
    log.stop()
    log.stop()  # idempotent
    assert not log.active
    after = {name: (logging.getLogger(name).propagate, list(logging.getLogger(name).handlers))
             for name in LOGGERS}  # fmt: skip
    assert after == before
    logging.getLogger("sender").warning("propagated again")
    assert "propagated again" in caplog.messages


def test_records_from_many_threads_are_all_counted() -> None:
    log = SenderLog()
    log.start()
    try:
        def burst() -> None:
            for i in range(500):
                logging.getLogger("sender.manager").warning(FAILED, i, 1, "d", "c", "r")

        threads = [threading.Thread(target=burst) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)
        assert log.take().counts == {f"sender.manager WARNING: {FAILED}": 2000}
    finally:
        log.stop()


def test_report_table_and_json_show_the_counts() -> None:
    log = SenderLog()
    log.start()
    try:
        logging.getLogger("sender.manager").warning(FAILED, 3, 4, "d", "peer-failed", "gone")
        first = _result("peer-faults", log)
        logging.getLogger("stress.harness.peer").error("control channel: %s", "accept loop failed")
        second = _result("two-hosts", log)
    finally:
        log.stop()
    text = sender_log_table([first, second, _result("skipped", None)])
    assert "sender log records (counted, not printed; --sender-log show prints them): 2" in text
    assert FAILED in text
    assert "ERROR in two-hosts: control channel: accept loop failed" in text
    doc = document(StressConfig(seed=1), [first, second])
    assert doc["sender_log"] == {
        f"sender.manager WARNING: {FAILED}": 1,
        "stress.harness.peer ERROR: control channel: %s": 1,
    }
    scenario = first.to_json()["sender_log"]
    assert isinstance(scenario, dict) and scenario["counts"] == {
        f"sender.manager WARNING: {FAILED}": 1
    }
    assert sender_log_table([_result("x", None)]) == ""


def test_a_kinds_level_is_read_back_from_it() -> None:
    from stress.sender_log import kind_of, level_of

    record = logging.LogRecord(
        "stress.harness.peer", logging.ERROR, "f.py", 1, "boom: %s", ("x",), None
    )
    assert level_of(kind_of(record)) == "ERROR"
    assert level_of("no level here") == ""
