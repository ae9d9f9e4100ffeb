"""Upstream's failure-cleanup scenario, on upstream's real sender and manager code.

The scenario of SGLang's own unit test (``failure_exception()`` purges the failed room's
per-room tables and its staging state before it raises, and leaves other rooms alone),
written here in our own words against the installed release, with the plugin off (the
released code on bare sets) and on (what SGLang's ``load_plugins()`` left). The rooms' staging
state is made by upstream's own prefetch path, not by hand.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from tools.sglang import drive

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("scheduled")]

ADOPTING = Path(__file__).resolve().parents[2] / "docs" / "ADOPTING.md"

ROOM, OTHER = 7, 8
# The per-room tables of the prefill manager that the failed room's failure_exception() must
# empty; only those the release has (0.5.23 has no `exceptions` table: it keeps reasons).
TABLES = ("request_status", "req_to_decode_prefix_len", "transfer_infos", "failure_records")

CONFIGS = {"plugin off": False, "plugin on": True}


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
    how = drive.adoption(up, plugin=CONFIGS[config])
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


def test_released_clear_on_our_context_needs_the_hook(
    up: drive.Upstream, sink: drive.StagingRequests, figures: list[str]
) -> None:
    """Our context under the released clear() (the plugin's class applied without its
    clear() hook): 0.5.21 rebinds prefetch_requested, which the context refuses with a
    TypeError naming purge_room (so the hook is needed, and the plugin registers all of its
    hooks or none); 0.5.23's clear() only discards (it works, but leaves no tombstone)."""
    how = drive.adoption(up, plugin=False, staging_class=up.staging_class)
    with drive.installed(up, how):
        side = drive.Prefill(up, how, sink)
        sender, _, _ = _failed_room(up, side)
        rebinds = any(
            n == "clear" and "prefetch_requested =" in inspect.getsource(fn)
            for _, n, fn in up.released
        )
        if rebinds:
            with pytest.raises(TypeError, match="purge_room"):
                sender.clear()  # type: ignore[attr-defined]
            verdict = "released clear() rebinds: refused with TypeError -> the hook is needed"
        else:
            sender.clear()  # type: ignore[attr-defined]
            assert {k[0] for k in side.staged()} == {OTHER}
            assert side.compat.stats().tombstones == 0  # no purge_room: no tombstone
            verdict = "released clear() only discards: works unhooked, no tombstone"
    sink.drain(0.05)
    figures.append(f"our context under the released clear(): {verdict}")


def test_plugin_targets_are_what_the_docs_say(up: drive.Upstream, figures: list[str]) -> None:
    """docs/ADOPTING.md names, for this release, every target the plugin hooks, with its
    hook type, and the line the plugin logs; and load_plugins() logged exactly that line."""
    from staging.sglang.releases import RELEASES

    doc = " ".join(ADOPTING.read_text(encoding="utf-8").split())
    for target in RELEASES[up.version]:
        if target.hook is not None:
            row = f"| {up.version} | `{target.path}` | {target.hook_type} |"
            assert row in doc, f"docs/ADOPTING.md has no row {row!r}"
    infos = [r.getMessage() for r in up.plugin_log if r.levelname == "INFO"]
    assert len(infos) == 1 and infos[0].startswith(
        f"nixl-staging plugin applied to sglang {up.version}"
    )
    assert "nixl-staging plugin applied to sglang <release>: " in doc
