"""Sentences of the decode peer's contract (``stress.harness.peer.DecodePeer``; docs/PROTOCOL.md
section 3, docs/THREADING.md's guarantee table) that an outside set of planted bugs got past
(issue 23, section 3), each over real NIXL (an in-process decode peer, a sender transport
sending real room notices to it); the planted violations are ``make mutants`` ids in
``tools/mutants_sentences.py``:

* a notice is de-duplicated by ``(room, generation)``, never by room id alone: the notice of
  a room's second opening is learnt (and frees that opening's pages) after the first's;
* page assignment checks a room's failed state under the peer's lock: ``assign_pages``
  stopped at every line and return of the library's code it passes while the notice of
  that opening arrives and is learnt; whichever comes first, the pages end up free.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from sender.notices import RoomNotice
from tests.fixtures_nixl import SenderPool, make_sender_pool, requires_nixl
from tests.interleave import explore

pytestmark = [requires_nixl, pytest.mark.timeout(180)]

JOIN_S = 30.0
"""A bound for one room notice over loopback to be learnt (milliseconds when it works):
past it, the notice was not learnt."""


@pytest.fixture
def linked(nixl_required: None) -> Iterator[tuple[Any, SenderPool]]:
    """An in-process DecodePeer and a sender transport linked to it as session ``"d"``."""
    from stress.harness.peer import DecodePeer

    peer = DecodePeer("decode-sentences", 16, 64)
    sp = make_sender_pool(16, 64)
    try:
        sp.transport.add_peer("d", peer.metadata())
        yield peer, sp
    finally:
        sp.transport.close()
        peer.close()


def _tell(sp: SenderPool, room: int, gen: int) -> None:
    sp.transport.send_notif("d", RoomNotice(room, gen, "failed", "aborted").encode())


def test_a_notice_is_deduplicated_by_room_and_generation(
    linked: tuple[Any, SenderPool],
) -> None:
    peer, sp = linked
    assert peer.assign_pages(7, 4, [1, 2]) is True  # the room's second opening
    _tell(sp, 7, 3)
    assert peer.wait_room_failed(7, 3, JOIN_S) is not None
    assert peer.free_pages() == [], "the first opening's notice freed the second's pages"
    _tell(sp, 7, 4)
    learnt = peer.wait_room_failed(7, 4, JOIN_S)
    assert learnt is not None, (
        f"the second opening's notice was not learnt: {peer.notice_stats()} (de-duplicated "
        "by room id?)"
    )
    assert peer.free_pages() == [1, 2]
    _tell(sp, 7, 4)  # a true duplicate
    _tell(sp, 8, 1)
    assert peer.wait_room_failed(8, 1, JOIN_S) is not None
    stats = peer.notice_stats()
    assert stats.learnt == 3, stats
    assert list(peer.failed_rooms()) == [(7, 3), (7, 4), (8, 1)]


class AssignVsNotice:
    """One fresh opening per schedule (the peer and sender are shared): thread 1 assigns it
    two pages, thread 2 sends its notice and waits until the peer learnt it."""

    rooms = itertools.count(100)
    peer: Any = None
    sp: Any = None

    def __init__(self) -> None:
        self.room = next(self.rooms)
        self.pages = [self.room % 16, (self.room + 1) % 16]
        self.learnt: Any = None

    def assign(self) -> None:
        self.peer.assign_pages(self.room, 1, self.pages)

    def notice(self) -> None:
        _tell(self.sp, self.room, 1)
        self.learnt = self.peer.wait_room_failed(self.room, 1, JOIN_S)

    def check(self) -> str | None:
        if self.learnt is None:
            return f"the notice of room {self.room} was not learnt within {JOIN_S:g} s"
        still = self.peer.release_pages(self.room, 1)
        free = set(self.peer.free_pages())
        if still or not set(self.pages) <= free:
            return (
                f"room {self.room}: its notice was learnt, yet pages {list(still)} stayed "
                f"assigned (free: {sorted(free)}): the failed state was read outside the lock"
            )
        return None


def test_page_assignment_checks_the_failed_state_under_the_lock(
    linked: tuple[Any, SenderPool],
) -> None:
    peer, sp = linked
    rig = type("Rig", (AssignVsNotice,), {"peer": peer, "sp": sp, "rooms": itertools.count(100)})
    result = explore(rig, rig.assign, rig.notice, rig.check, block_s=0.1)
    print(f"assign_pages vs notice: {result.schedules} schedules, {result.blocked} blocked")
    assert result.schedules > 1
    assert not result.failures, result.failures[:3]
