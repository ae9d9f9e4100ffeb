"""Upstream's failure-cleanup scenario, on upstream's real sender and manager code.

The scenario of SGLang's own unit test (``failure_exception()`` purges the failed room's
per-room tables and its staging state before it raises, and leaves other rooms alone),
written here in our own words against the installed release, for the released code on
bare sets and for the adopter change on ours (both dataclass routes). The rooms' staging
state is made by upstream's own prefetch path, not by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.sglang import drive

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("scheduled")]

ADOPTING = Path(__file__).resolve().parents[2] / "docs" / "ADOPTING.md"

ROOM, OTHER = 7, 8
# The per-room tables of the prefill manager that the failed room's failure_exception() must
# empty; only those the release has (0.5.23 has no `exceptions` table: it keeps reasons).
TABLES = ("request_status", "req_to_decode_prefix_len", "transfer_infos", "failure_records")

CONFIGS = {
    "released, bare sets": {"context": "bare", "clear": False, "worker": False},
    "adopted, subclass": {"context": "compat", "clear": True, "worker": True},
    "adopted, composition": {
        "context": "compat",
        "clear": True,
        "worker": True,
        "route": "composition",
    },
}


def _failed_room(up: drive.Upstream, side: drive.Prefill) -> tuple[object, object, Exception]:
    senders = {}
    for room in (ROOM, OTHER):
        senders[room] = side.admit(room)
        side.prefetch(room)
    error = RuntimeError("transfer failed")
    side.mgr.failure_records[ROOM] = "transfer failed"
    side.mgr.failure_records[OTHER] = "other room's reason"
    side.mgr.exceptions[ROOM] = error
    keys = side.staged()
    assert {k[0] for k in keys} == {ROOM, OTHER} and side.marked() == {ROOM, OTHER}
    assert len(keys) == 2 * drive.CHUNKS
    return senders[ROOM], senders[OTHER], error


@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_failure_exception_purges_the_room_and_only_it(
    up: drive.Upstream, sink: drive.StagingRequests, figures: list[str], config: str
) -> None:
    how = drive.adoption(up, **CONFIGS[config])  # type: ignore[arg-type]
    with drive.installed(up, how):
        side = drive.Prefill(up, how, sink)
        sender, _, error = _failed_room(up, side)
        with pytest.raises(Exception) as raised:
            sender.failure_exception()  # type: ignore[attr-defined]
        # Everything below was true when it raised: nothing runs after the raise.
        if _raises_stored_error(up):  # 0.5.21: the worker's exception object itself
            assert raised.value is error
            assert ROOM not in side.mgr.exceptions
        else:  # 0.5.23: a KVTransferError carrying the recorded reason
            assert type(raised.value).__name__ == "KVTransferError"
            assert "transfer failed" in str(raised.value)
        assert sender.conclude_state == up.kv_poll.Failed  # type: ignore[attr-defined]
        for table in TABLES:
            assert ROOM not in getattr(side.mgr, table), table
            assert OTHER in getattr(side.mgr, table), table
        keys = side.staged()
        assert {k[0] for k in keys} == {OTHER} and len(keys) == drive.CHUNKS
        assert side.marked() == {OTHER}
        if side.compat is not None:
            s = side.compat.stats()
            assert (s.purges, s.tombstones, s.open_rooms) == (1, 1, 1)
    sink.drain(0.05)
    figures.append(f"failure cleanup [{config}]: room purged, other room intact")


def _raises_stored_error(up: drive.Upstream) -> bool:
    """Whether the released failure_exception() raises the worker's stored exception (it
    reads the manager's ``exceptions`` table; 0.5.21) rather than a KVTransferError."""
    import inspect

    owner = next(c for c in up.conn.NixlKVSender.__mro__ if "failure_exception" in c.__dict__)
    return "kv_mgr.exceptions" in inspect.getsource(owner.__dict__["failure_exception"])


def test_released_clear_on_our_context_needs_the_change(
    up: drive.Upstream, sink: drive.StagingRequests, figures: list[str]
) -> None:
    """Our dataclass under the released clear(): 0.5.21 rebinds prefetch_requested, which
    the context refuses with a TypeError naming purge_room (so the clear() change is needed);
    0.5.23's clear() only discards (it works unchanged, but leaves no tombstone)."""
    how = drive.adoption(up, context="compat", clear=False, worker=False)
    with drive.installed(up, how):
        side = drive.Prefill(up, how, sink)
        sender, _, _ = _failed_room(up, side)
        rebinds = "prefetch_requested =" in _clear_source(how)
        if rebinds:
            with pytest.raises(TypeError, match="purge_room"):
                sender.clear()  # type: ignore[attr-defined]
            verdict = "released clear() rebinds: refused with TypeError -> clear() must change"
        else:
            sender.clear()  # type: ignore[attr-defined]
            assert {k[0] for k in side.staged()} == {OTHER}
            assert side.compat.stats().tombstones == 0  # no purge_room: no tombstone
            verdict = "released clear() only discards: works unchanged, no tombstone"
    sink.drain(0.05)
    figures.append(f"our context under the released clear(): {verdict}")


def _clear_source(how: drive.Adoption) -> str:
    import inspect

    return inspect.getsource(how.clear_owner.__dict__["clear"])


def test_adopter_change_is_what_the_docs_say(up: drive.Upstream, figures: list[str]) -> None:
    """The replaced statements, as CI applies them to this release, are the ones
    docs/ADOPTING.md lists for it (file, function, line range), and so are the dataclass
    lines: the doc is checked against the installed code, statement for statement."""
    doc = " ".join(ADOPTING.read_text(encoding="utf-8").split())
    how = drive.adoption(up, context="compat", clear=True, worker=True)
    clear_rec, worker_rec = how.replacements
    assert clear_rec.function.endswith(".clear") and worker_rec.function.endswith(
        ".transfer_worker"
    )
    row = (
        f"| {up.version} | `{clear_rec.file}` | `{clear_rec.function}` | "
        f"{clear_rec.first_line}\u2013{clear_rec.last_line}:"
    )
    assert row in doc, f"docs/ADOPTING.md has no row {row!r}"
    worker = f"{up.version} lines {worker_rec.first_line}\u2013{worker_rec.last_line}"
    assert (
        worker in doc
        and "`NixlKVManager.transfer_worker` in `sglang/srt/disaggregation/nixl/conn.py`" in doc
    )
    class_line, first, last = _dataclass_lines(up)
    assert f"{up.version} line {class_line}" in doc
    assert f"{up.version} lines {first}\u2013{last}" in doc
    for rec in how.replacements:
        assert rec.lines_added == 1 and rec.lines_removed >= 2
        figures.append(f"adopter change: {rec.describe()}")
    fields = list(how.staging_class.__dataclass_fields__)
    assert "prefetched_rooms" not in fields and "prefetch_requested" not in fields
    figures.append(
        f"adopter change: sglang/srt/disaggregation/common/staging_handler.py line {class_line} "
        f"(class PrefillStagingContext gets the base CompatStagingContext), lines {first}-{last} "
        f"(the two set fields and their comments) deleted; kept fields {fields}"
    )


def _dataclass_lines(up: drive.Upstream) -> tuple[int, int, int]:
    """The line of ``class PrefillStagingContext``, and the range from the comment above its
    ``prefetch_requested`` field to its ``prefetched_rooms`` field, in the installed file."""
    import inspect

    lines, start = inspect.getsourcelines(up.staging_class)
    numbered = list(enumerate(lines, start))
    class_line = next(n for n, text in numbered if text.startswith("class "))
    first = next(n for n, text in numbered if text.strip().startswith("prefetch_requested:"))
    while lines[first - 1 - start].strip().startswith("#"):
        first -= 1
    last = next(n for n, text in numbered if text.strip().startswith("prefetched_rooms:"))
    return class_line, first, last
