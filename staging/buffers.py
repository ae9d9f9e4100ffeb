"""``StagingBufferPool``: fixed staging slots carved from one tensor.

A chunk bound for one decode peer is gathered into a slot, so the transport moves it in
one bulk transfer from memory registered once. A slot is leased to an owner, each lease
with its own id (a stale or repeated release does nothing), and returns to the pool only
when its transfer has ended. One POOL lock guards the free list, leases and indexes; see
docs/THREADING.md, 'The staging slot pool'.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from staging._version import install_extra_hint

try:
    import numpy as np
    import numpy.typing as npt
    import torch
except ModuleNotFoundError as _exc:  # the core install has neither: name the extra
    raise ModuleNotFoundError(
        f"staging.buffers (the staging slot pool) needs torch and numpy, from the 'sender' "
        f"extra (missing: {_exc.name}): {install_extra_hint('sender')}",
        name=_exc.name,
    ) from None

from staging.errors import StagingError
from staging.locks import LockLevel, make_lock
from staging.validate import bounded_wait, check_index


class PoolExhaustedError(StagingError):
    """No slot became free within ``acquire``'s timeout."""

    def __init__(self, num_slots: int, timeout: float | None) -> None:
        super().__init__(
            f"all {num_slots} staging slots are in use and none was freed within "
            f"{timeout if timeout is not None else 0:g} s; raise num_slots or release "
            "slots of finished rooms"
        )
        self.num_slots = num_slots
        self.timeout = timeout


class PoolClosedError(StagingError):
    """The pool was closed; no slot can be acquired any more."""


@dataclass(frozen=True, slots=True)
class StagingSlot:
    """One lease of one slot: pages ``[first_page, first_page + slot_pages)`` of the pool."""

    index: int
    lease: int
    owner: Hashable
    first_page: int
    slot_pages: int
    group: Hashable = None
    """The lease's group (the sender's decode session), capped by ``group_cap``."""


@dataclass(frozen=True, slots=True)
class PoolStats:
    """Counters of one pool, taken under its lock."""

    num_slots: int
    free: int
    in_use: int
    owners: int
    acquired: int
    released: int
    exhausted: int
    retired: int = 0
    """Retired leases not yet released (:meth:`StagingBufferPool.retire`)."""
    spare: int = 0
    """Spare slots left to stand in for retired ones."""


class StagingBufferPool:
    """Fixed staging slots over one ``[num_slots * slot_pages, page_bytes]`` uint8 tensor.

    Args:
        num_slots: number of slots (>= 1).
        slot_pages: pages per slot (>= 1): the largest chunk one slot holds.
        page_bytes: bytes per staged page (>= 1): what one decode page holds.
        device: torch device of the buffer (``"cpu"`` here; ``"cuda"`` where a GPU exists).
        lock: ``"mutex"`` (default) or ``"rw"``; the lock has level ``LockLevel.POOL``.
        debug: lock debug mode (``None`` reads env ``NIXL_STAGING_DEBUG_LOCKS``).
        spare_slots: extra slots (>= 0) in the same tensor that stand in for *retired*
            ones (:meth:`retire`), so the pool keeps ``num_slots`` usable slots.

    Raises:
        TypeError, ValueError: a size that is not an ``int`` >= 1 (``spare_slots``: >= 0).
    """

    def __init__(
        self,
        num_slots: int,
        slot_pages: int,
        page_bytes: int,
        *,
        device: str | torch.device = "cpu",
        lock: str = "mutex",
        debug: bool | None = None,
        spare_slots: int = 0,
    ) -> None:
        """Make a :class:`StagingBufferPool`: every argument and what it raises are in the
        class docstring (``help(StagingBufferPool)``)."""
        check_index(spare_slots, "spare_slots")
        for name, value in (
            ("num_slots", num_slots),
            ("slot_pages", slot_pages),
            ("page_bytes", page_bytes),
        ):
            if check_index(value, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self._num_slots = num_slots
        self._slot_pages = slot_pages
        self._page_bytes = page_bytes
        self._buffer = torch.zeros(
            ((num_slots + spare_slots) * slot_pages, page_bytes), dtype=torch.uint8,
            device=device,
        )
        self._lock = make_lock(lock, "staging-pool", LockLevel.POOL, debug=debug)
        # Notified when a slot is freed or the pool closes; waiters never hold _lock.
        self._cond = threading.Condition(threading.Lock())
        # --- Guarded by _lock; mutate only under write(). ---
        # _by_owner / _by_group store no empty sets / zeros. _retired: leases not reused
        # until released; _spare: stand-ins for them; _short: retired with no stand-in.
        # Invariants: set(_leases), _free, set(_retired) and _spare partition
        # range(num_slots + spare_slots); len(_leases) + len(_free) + _short == num_slots.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._retired: dict[int, StagingSlot] = {}
        self._spare: list[int] = list(range(num_slots + spare_slots - 1, num_slots - 1, -1))
        self._short = 0
        self._leases: dict[int, StagingSlot] = {}
        self._by_owner: dict[Hashable, set[int]] = {}
        self._by_group: dict[Hashable, int] = {}
        self._lease_ids = itertools.count(1)
        self._closed = False
        self._acquired = 0
        self._released = 0
        self._exhausted = 0

    @property
    def tensor(self) -> torch.Tensor:
        """The whole buffer, to register with the transport once."""
        return self._buffer

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def slot_pages(self) -> int:
        return self._slot_pages

    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    def view(self, slot: StagingSlot, num_pages: int | None = None) -> torch.Tensor:
        """The slot's pages as a ``[num_pages, page_bytes]`` view. Thread-safe (no lock);
        never raises."""
        n = self._slot_pages if num_pages is None else num_pages
        return self._buffer.narrow(0, slot.first_page, n)

    # ------------------------------------------------------------------ leasing

    def try_acquire(
        self, owner: Hashable, *, group: Hashable = None, group_cap: int | None = None
    ) -> StagingSlot | None:
        """Lease a free slot to ``owner`` now, or ``None`` (also when ``group`` already
        holds ``group_cap`` slots). Thread-safe; write lock; no wait.

        Raises: PoolClosedError (the pool is closed).
        """
        with self._lock.write():
            if self._closed:
                raise PoolClosedError("staging pool is closed")
            if not self._free:
                return None
            if group is not None:
                held = self._by_group.get(group, 0)
                if group_cap is not None and held >= group_cap:
                    return None
                self._by_group[group] = held + 1
            index = self._free.pop()
            slot = StagingSlot(
                index, next(self._lease_ids), owner, index * self._slot_pages, self._slot_pages,
                group,
            )
            self._leases[index] = slot
            self._by_owner.setdefault(owner, set()).add(index)
            self._acquired += 1
            return slot

    def acquire(
        self,
        owner: Hashable,
        timeout: float | None = 1.0,
        *,
        on_wake: Callable[[], None] | None = None,
        wake_s: float = 0.05,
        group: Hashable = None,
        group_cap: int | None = None,
    ) -> StagingSlot:
        """Lease a slot to ``owner``, waiting up to ``timeout`` s (``None``: until a slot is
        freed or the pool closes) as :meth:`try_acquire` allows. With ``on_wake``, it is
        called every ``wake_s`` of waiting, holding no lock; what it raises propagates.
        Thread-safe; the wait holds no lock of the model.

        Raises:
            PoolExhaustedError: no slot was freed in time.
            PoolClosedError: the pool is (or becomes) closed.
            ValueError: negative or NaN ``timeout``, ``wake_s`` not > 0.
        """
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
        if not wake_s > 0:
            raise ValueError(f"wake_s must be > 0, got {wake_s}")
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                slot = self.try_acquire(owner, group=group, group_cap=group_cap)
                if slot is not None:
                    return slot
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.note_exhausted()
                    raise PoolExhaustedError(self._num_slots, timeout)
                piece = remaining if on_wake is None else min(remaining, wake_s)
                self._cond.wait(bounded_wait(piece))
            if on_wake is not None:
                on_wake()

    def retire(self, slot: StagingSlot) -> bool:
        """Stop counting a live lease against the pool, owner and group without freeing
        its memory until release; a spare, if left, takes its place. ``True`` if the lease
        was live. Thread-safe; write lock; never raises."""
        return self._end_lease(slot, retire=True)

    def release(self, slot: StagingSlot) -> bool:
        """Return a lease (live or retired); ``True`` if it was. A stale or repeated release
        does nothing. Thread-safe; write lock; never raises."""
        return self._end_lease(slot, retire=False)

    def release_owner(self, owner: Hashable) -> int:
        """Return every slot leased to ``owner``; the number freed. Thread-safe;
        atomic; never raises."""
        with self._lock.write():
            indices = list(self._by_owner.get(owner, ()))
            freed = sum(self._release_unlocked(i, self._leases[i].lease) for i in indices)
        if freed:
            self._notify()
        return freed

    def note_exhausted(self) -> None:
        """Count one exhaustion seen by a caller retrying :meth:`try_acquire` outside
        :meth:`acquire`. Thread-safe; write lock; never raises."""
        with self._lock.write():
            self._exhausted += 1

    def group_slots(self, group: Hashable) -> int:
        """How many slots ``group`` holds now. Thread-safe; read lock; never raises."""
        with self._lock.read():
            return self._by_group.get(group, 0)

    def owner_slots(self, owner: Hashable) -> int:
        """How many slots ``owner`` holds now. Thread-safe; read lock; never raises."""
        with self._lock.read():
            return len(self._by_owner.get(owner, ()))

    def owners(self) -> frozenset[Hashable]:
        """Snapshot of the owners holding at least one slot. Thread-safe; read lock; never
        raises."""
        with self._lock.read():
            return frozenset(self._by_owner)

    def close(self) -> None:
        """Refuse further acquisitions and wake every waiter. Idempotent; thread-safe; never
        raises."""
        with self._lock.write():
            self._closed = True
        self._notify()

    def stats(self) -> PoolStats:
        """Frozen counters. Thread-safe; read lock; never raises."""
        with self._lock.read():
            return PoolStats(
                num_slots=self._num_slots,
                free=len(self._free),
                in_use=len(self._leases),
                owners=len(self._by_owner),
                acquired=self._acquired,
                released=self._released,
                exhausted=self._exhausted,
                retired=len(self._retired),
                spare=len(self._spare),
            )

    def gather(
        self,
        slot: StagingSlot,
        source: torch.Tensor,
        pages: Sequence[int] | torch.Tensor | npt.NDArray[np.integer[Any]],
        byte_range: tuple[int, int] | None = None,
    ) -> int:
        """Copy ``source[pages]`` (with ``byte_range=(start, length)``, only those bytes of
        each page) into the slot; return the number of pages. The caller holds the lease.
        Thread-safe for distinct slots (no lock).

        Raises:
            ValueError: too many pages, page size not ``page_bytes``, or out-of-range bytes
                or page index.
            TypeError: ``source`` is not a 2-D uint8 tensor.
        """
        if source.dim() != 2 or source.dtype != torch.uint8:
            raise TypeError("source must be a 2-D uint8 tensor [num_pages, page_bytes]")
        index = torch.as_tensor(pages, dtype=torch.long, device=source.device)
        n = int(index.numel())
        if n > self._slot_pages:
            raise ValueError(f"{n} pages do not fit a slot of {self._slot_pages} pages")
        if n and (int(index.min()) < 0 or int(index.max()) >= source.shape[0]):
            raise ValueError(f"page index out of range [0, {source.shape[0]})")
        start, length = (0, source.shape[1]) if byte_range is None else byte_range
        if start < 0 or length <= 0 or start + length > source.shape[1]:
            raise ValueError(f"byte range {byte_range} outside a page of {source.shape[1]} B")
        if length != self._page_bytes:
            raise ValueError(
                f"staged page is {length} B but the pool's page_bytes is {self._page_bytes}"
            )
        rows = source.index_select(0, index)
        self.view(slot, n).copy_(rows.narrow(1, start, length))
        return n

    # ------------------------------------------------------------------ internals

    def _end_lease(self, slot: StagingSlot, retire: bool) -> bool:
        # mutant-site: end-lease-with
        with self._lock.write():
            # mutant-site: release
            freed = self._release_unlocked(slot.index, slot.lease, retire=retire)
        if freed:
            self._notify()
        return bool(freed)

    def _release_unlocked(self, index: int, lease: int, *, retire: bool = False) -> int:
        """Free ``index`` if ``lease`` holds it, live or retired (``retire``: retire it if
        live); 1 if so, else 0. Caller holds ``_lock`` (write)."""
        live = self._leases.get(index)
        if live is None or live.lease != lease:
            retired = self._retired.get(index)
            if retire or retired is None or retired.lease != lease:
                return 0
            del self._retired[index]
            if self._short:  # it stands in for the capacity it took
                self._short -= 1
                self._free.append(index)
            else:
                self._spare.append(index)
            self._released += 1
            return 1
        del self._leases[index]
        owned = self._by_owner[live.owner]
        owned.discard(index)
        if not owned:
            del self._by_owner[live.owner]
        if live.group is not None:
            left = self._by_group.pop(live.group) - 1
            if left:
                self._by_group[live.group] = left
        if not retire:
            self._free.append(index)
            self._released += 1
            return 1
        self._retired[index] = live
        if self._spare:
            self._free.append(self._spare.pop())
        else:
            self._short += 1
        return 1

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()
