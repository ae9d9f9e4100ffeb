"""Transfer infos: where one decode session wants a room's pages, checked once when made.

:func:`make_transfer_info` checks and freezes an info; :func:`checked_info` takes those as
they are and checks any other info again.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from sender.errors import TransportParamError
from sender.pages import CheckedPages
from staging.validate import check_index, check_session_id

__all__ = ["PageArray", "TransferInfo", "checked_info", "make_transfer_info"]

PageArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True, weakref_slot=True)
class TransferInfo:
    """Where one decode session (``session_id``) wants a room's pages: ``dst_pages[i]``
    receives the room's KV page ``i``, except the first ``decode_prefix_len`` (already
    held); ``byte_range`` ``(start, length)`` sends only those bytes of each page (a TP
    rank's heads; needs a staging pool), ``None`` whole pages, into region ``dst_region``."""

    session_id: str
    dst_pages: PageArray
    decode_prefix_len: int = 0
    byte_range: tuple[int, int] | None = None
    dst_region: str = "kv"
    dst_checked: CheckedPages | None = field(default=None, compare=False, repr=False)
    """``dst_pages`` checked once (:mod:`sender.pages`), sliced per chunk; ``None`` when
    ``dst_pages`` is empty."""


_MADE_INFOS: weakref.WeakValueDictionary[int, TransferInfo] = weakref.WeakValueDictionary()
"""Live infos made by :func:`make_transfer_info`, by ``id`` (weak: a reused ``id`` of a
dead info is never mistaken for it)."""


def make_transfer_info(
    session_id: str, dst_pages: Sequence[int] | PageArray, *, decode_prefix_len: int = 0,
    byte_range: tuple[int, int] | None = None, dst_region: str = "kv",
) -> TransferInfo:
    """Validate and freeze a :class:`TransferInfo`.

    Raises:
        TypeError: a page list that does not hold ints (floats and bools are refused), a bad
            session id, prefix length or byte range type.
        ValueError: a page list that is not 1-D, has a negative page, a page of ``2**31`` or
            more, or a page that repeats (anywhere in the list: whatever the chunking, two
            room pages would land on one decode page); a bad prefix length or byte range.
    """
    session_id = check_session_id(session_id)
    raw = np.asarray(dst_pages)
    # float or bool pages would be cast silently: KV pages would land in wrong slots.
    if raw.dtype.kind == "b" or (raw.size and raw.dtype.kind not in "iu"):
        raise TypeError(f"dst_pages must hold ints, got dtype {raw.dtype}")
    try:
        arr = np.array(raw, dtype=np.int64, copy=True)
    except OverflowError:
        raise ValueError("dst_pages holds a page index beyond int64") from None
    if arr.ndim != 1:
        raise ValueError("dst_pages must be a 1-D sequence of page indices")
    checked = _checked_dst(arr)
    arr.setflags(write=False)
    check_index(decode_prefix_len, "decode_prefix_len")
    if decode_prefix_len > arr.size:
        raise ValueError(f"decode_prefix_len {decode_prefix_len} > {arr.size} dst pages")
    if byte_range is not None:
        start, length = byte_range
        check_index(start, "byte_range start")
        if check_index(length, "byte_range length") < 1:
            raise ValueError("byte_range length must be >= 1")
    info = TransferInfo(session_id, arr, decode_prefix_len, byte_range, dst_region, checked)
    _MADE_INFOS[id(info)] = info
    return info


def _checked_dst(pages: PageArray) -> CheckedPages | None:
    """``pages`` as distinct :class:`CheckedPages` (``None`` if empty); ValueError if not."""
    if pages.size == 0:
        return None
    try:
        return CheckedPages(pages, unique=True)
    except TransportParamError:
        pass
    if int(pages.min()) < 0:
        raise ValueError("dst_pages must be >= 0")
    if int(pages.max()) >= 1 << 31:
        raise ValueError(f"dst_pages holds page {int(pages.max())}: NIXL page indices are < 2**31")
    ordered = np.sort(pages)
    repeated = int(ordered[1:][ordered[1:] == ordered[:-1]][0])
    raise ValueError(f"dst_pages repeats page {repeated}: each decode page receives one room page")


def checked_info(info: TransferInfo) -> TransferInfo:
    """``info`` as it is if :func:`make_transfer_info` made it, else checked and normalised
    by it (a directly built or ``dataclasses.replace``-d info bypassed the checks).

    Raises:
        TypeError, ValueError: as :func:`make_transfer_info`.
    """
    if _MADE_INFOS.get(id(info)) is info:
        return info
    return make_transfer_info(
        info.session_id, info.dst_pages, decode_prefix_len=info.decode_prefix_len,
        byte_range=info.byte_range, dst_region=info.dst_region,
    )
