"""Key types (docs/THREADING.md, "Key types"): numpy integers at every staging entry point,
what is not an index refused with the bad value named, one validator for the native and compat
contexts, and a staging core that never imports numpy."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from staging import CompatStagingContext, StagingContext

np = pytest.importorskip("numpy")


INTEGER_LIKES = [np.int64(3), np.int32(3), np.uint64(3), np.uint8(3), np.int16(3), np.array(3)]


@pytest.mark.parametrize("value", INTEGER_LIKES, ids=lambda v: type(v).__name__)
def test_every_staging_entry_point_takes_numpy_integers(value: Any) -> None:
    """Found by issue 25, section 2 (what a new user trips on)."""
    ctx = StagingContext()
    handle = ctx.open_room(value)
    assert type(handle.room) is int and handle.room == 3
    assert ctx.request_prefetches(handle, np.array([10, 11]), "s") == {10, 11}
    assert ctx.request_prefetches(value, np.array([12], dtype=np.uint32), "s") == {12}
    assert ctx.request_prefetch(value, value, "s") is True
    assert ctx.is_requested(value, np.int64(10), "s")
    assert ctx.cancel_prefetch(handle, np.int8(10), "s") is True
    assert ctx.mark_prefetched(value) is True
    assert ctx.is_prefetched(np.uint16(3)) and ctx.is_open(value)
    # Stored as exact ints (numpy's __eq__/__hash__ never run under the lock later).
    assert all(type(c) is int for c, _ in ctx.room_requests(handle))
    assert ctx.purge_room(value).was_open


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (np.bool_(True), TypeError),
        (True, TypeError),
        (np.float64(3.0), TypeError),
        (3.0, TypeError),
        ("3", TypeError),
        (np.int64(-1), ValueError),
    ],
    ids=repr,
)
def test_what_is_not_an_index_is_still_refused(value: Any, error: type[Exception]) -> None:
    """Found by issue 25, section 2 (what a new user trips on)."""
    from staging.validate import check_index

    with pytest.raises(error, match="room"):
        StagingContext().open_room(value)
    with pytest.raises(error):
        check_index(value, "x")


def test_chunk_arrays_name_the_bad_element_and_its_position() -> None:
    """Found by issue 25, section 2 (what a new user trips on)."""
    from staging.validate import check_indices

    ctx = StagingContext()
    h = ctx.open_room(1)
    with pytest.raises(ValueError, match=r"-2 \(at position 1\)"):
        ctx.request_prefetches(h, np.array([1, -2]), "s")
    with pytest.raises(TypeError, match=r"float .*at position 0"):
        ctx.request_prefetches(h, np.array([1.0]), "s")
    with pytest.raises(TypeError, match="iterable"):
        ctx.request_prefetches(h, "12", "s")  # type: ignore[arg-type]
    assert ctx.room_requests(h) == frozenset()  # nothing recorded by a refused batch
    assert check_indices(range(3), "x") == (0, 1, 2)
    assert check_indices((np.int64(4), 5), "x") == (4, 5)


def test_compat_and_native_share_one_validator() -> None:
    """CompatStagingContext's leniency is the shared validator's (bools only where the
    compat view of a set must take them).

    Found by issue 25, section 2 (what a new user trips on).
    """
    compat = CompatStagingContext()
    compat.prefetched_rooms.add(np.int64(5))
    assert 5 in compat.prefetched_rooms
    with pytest.raises(TypeError):
        compat.prefetched_rooms.add(np.float64(5))


def test_the_staging_core_does_not_import_numpy() -> None:
    """Found by issue 25, section 2 (what a new user trips on)."""
    code = (
        "import sys\n"
        "class I:\n"
        "    def __index__(self): return 7\n"
        "import staging\n"
        "ctx = staging.StagingContext()\n"
        "h = ctx.open_room(I())\n"
        "assert ctx.request_prefetches(h, [I()], 's') == {7}\n"
        "assert 'numpy' not in sys.modules, 'numpy imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
