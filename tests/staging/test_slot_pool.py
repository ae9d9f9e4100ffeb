"""The staging pool's shares (no NIXL): a group never leases more than its cap, and a
retired lease is never reused before its release while a spare stands in for it
(THREADING.md, "Peer isolation"; ``staging/buffers.py``)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from staging.buffers import PoolExhaustedError, StagingBufferPool
from tests.interleave import explore
from tests.sender.test_dpor_clear import PAGE_BYTES as MEM_PAGE_BYTES

pytestmark = pytest.mark.timeout(30)


def test_a_group_never_leases_more_than_its_cap() -> None:
    pool = StagingBufferPool(4, 1, 8)
    a = [pool.try_acquire(("room", i), group="a", group_cap=2) for i in range(3)]
    assert a[2] is None and all(s is not None for s in a[:2])
    assert pool.group_slots("a") == 2
    b = [pool.try_acquire(("room", 9), group="b", group_cap=2) for _ in range(2)]
    assert all(s is not None for s in b)
    with pytest.raises(PoolExhaustedError):
        pool.acquire("x", 0.0, group="a", group_cap=2)
    first = a[0]
    assert first is not None and pool.release(first)
    assert pool.group_slots("a") == 1
    assert pool.try_acquire("again", group="a", group_cap=2) is not None
    assert pool.stats().in_use == 4


def test_a_capped_wait_takes_the_groups_next_free_slot() -> None:
    pool = StagingBufferPool(3, 1, 8)
    held = pool.try_acquire("r1", group="a", group_cap=1)
    assert held is not None
    got: list[object] = []
    waiter = threading.Thread(
        target=lambda: got.append(pool.acquire("r2", 10.0, group="a", group_cap=1)),
        daemon=True,
    )
    waiter.start()
    other = pool.try_acquire("r3", group="b", group_cap=1)  # free slots are not the cap's
    assert other is not None
    assert got == []
    pool.release(held)
    waiter.join(10)
    assert not waiter.is_alive()
    assert len(got) == 1 and pool.group_slots("a") == 1


@pytest.mark.parametrize("spare", [0, 1])
def test_a_retired_lease_is_not_reused_before_its_release(spare: int) -> None:
    pool = StagingBufferPool(2, 1, 8, spare_slots=spare)
    hung = pool.try_acquire("room-1", group="hung", group_cap=1)
    assert hung is not None
    assert pool.retire(hung) and not pool.retire(hung)
    st = pool.stats()
    assert (st.in_use, st.retired, st.free, st.spare) == (0, 1, 1 + spare, 0)
    assert pool.group_slots("hung") == 0 and pool.owner_slots("room-1") == 0
    assert pool.release_owner("room-1") == 0  # a purge does not free the retired memory
    leased = [pool.try_acquire("other") for _ in range(3)]
    got = [s for s in leased if s is not None]
    assert len(got) == 1 + spare
    assert hung.index not in {s.index for s in got}, "the retired slot was leased again"
    for s in got:
        pool.release(s)
    assert pool.release(hung) and not pool.release(hung)
    st = pool.stats()
    assert (st.in_use, st.retired, st.free, st.spare) == (0, 0, 2, spare)


def test_spare_slots_cost_memory_only_in_the_one_tensor() -> None:
    pool = StagingBufferPool(2, 3, 8, spare_slots=1)
    assert tuple(pool.tensor.shape) == (9, 8)
    assert pool.num_slots == 2
    with pytest.raises(ValueError):
        StagingBufferPool(2, 1, 8, spare_slots=-1)


BLOCK_S = 0.05


def _ran(result: Any, label: str) -> None:
    print(f"{label}: {result.schedules} schedules, {result.blocked} blocked")
    assert result.schedules > 1, "the explorer ran no preempted schedule"
    assert not result.failures, result.failures[:3]


class StaleReleaseVsAcquire:
    """One slot. Holder A leases it and releases it twice (the second release is stale);
    B acquires meanwhile and keeps what it got."""

    def __init__(self) -> None:
        self.pool = StagingBufferPool(1, 1, MEM_PAGE_BYTES)
        self.b: Any = None

    def holder(self) -> None:
        slot = self.pool.try_acquire("A")
        if slot is None:
            return
        self.pool.release(slot)
        self.pool.release(slot)  # stale: the lease was returned already

    def acquirer(self) -> None:
        self.b = self.pool.try_acquire("B")

    def check(self) -> str | None:
        if self.b is None:
            return None
        held = self.pool.owner_slots("B")
        st = self.pool.stats()
        if held != 1 or st.in_use != 1 or st.free != 0:
            return f"B's slot was freed by A's stale release: owner_slots(B)={held}, {st}"
        return None


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stale_release_never_frees_a_slot_someone_else_holds() -> None:
    """Found by issue 23, section 3 (planted bugs an outside set got past)."""
    result = explore(StaleReleaseVsAcquire, StaleReleaseVsAcquire.holder,
                     StaleReleaseVsAcquire.acquirer, StaleReleaseVsAcquire.check,
                     block_s=BLOCK_S)  # fmt: skip
    _ran(result, "pool stale release vs acquire")


class RepeatedReleaseVsAcquire:
    """One slot, leased by A. Two threads release A's lease at once (one release is then a
    repeated one); the second thread then acquires for B and keeps what it got."""

    def __init__(self) -> None:
        self.pool = StagingBufferPool(1, 1, MEM_PAGE_BYTES)
        slot = self.pool.try_acquire("A")
        assert slot is not None
        self.slot = slot
        self.b: Any = None

    def releaser(self) -> None:
        self.pool.release(self.slot)

    def release_then_acquire(self) -> None:
        self.pool.release(self.slot)
        self.b = self.pool.try_acquire("B")

    def check(self) -> str | None:
        st = self.pool.stats()
        if self.b is None:
            return f"B got no slot after A's lease was released: {st}"
        held = self.pool.owner_slots("B")
        if held != 1 or st.in_use != 1 or st.free != 0:
            return f"a repeated release of A's lease freed B's slot: owner_slots(B)={held}, {st}"
        return None


def test_a_repeated_release_racing_another_never_frees_a_slot_someone_else_holds() -> None:
    """*The staging slot pool*, ``release``: 'every lease has its own id, so a release names
    its lease: a stale or repeated one is a no-op, never freeing a slot someone else holds'.
    Two threads release the same lease concurrently (the first stopped at every point of
    the pool's code, ``tests/interleave.py``) while the slot is leased again to B: B's lease
    survives whichever release comes second."""
    result = explore(
        RepeatedReleaseVsAcquire, RepeatedReleaseVsAcquire.releaser,
        RepeatedReleaseVsAcquire.release_then_acquire, RepeatedReleaseVsAcquire.check,
        block_s=BLOCK_S,
    )
    _ran(result, "pool repeated release vs release and acquire")
