"""Page indices: validated per write (:func:`as_pages`), or once (:class:`CheckedPages`).

A write names its pages by index. :meth:`sender.transport.NixlTransport.write_pages` checks
every index list it gets (ints, in range, destination pages distinct) before NIXL sees it,
because NIXL 1.5.1 does not: it converts indices to 32-bit ints without an overflow check
(an int64 index ``2**32 + 1`` silently becomes page 1). On these VMs each numpy call of that
check costs 1-4 µs, about 9 µs for a 1 MiB write of 64 pages -- a tenth of the write.

A :class:`CheckedPages` is checked once when built: its indices are non-negative ints that
fit NIXL's 32-bit indices, distinct if asked, copied into a read-only int32 array, and their
largest value is kept. A write given two of them only compares that largest value with the
region's size (O(1)) and hands the array to NIXL as is -- what a caller of raw NIXL does with
its own pre-built index arrays. Slices of one stay checked (a slice of distinct indices is
distinct, and the parent's largest index bounds the slice's). This is the "validate once
per room, not per chunk" path: a room's destination pages do not change between chunks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from sender.errors import TransportParamError

__all__ = ["CheckedPages", "as_pages", "scan_pages"]

_INT64 = np.dtype(np.int64)
_INDEX_LIMIT = 1 << 31
"""NIXL takes page indices as 32-bit ints."""
_SMALL = 32
"""Up to this many pages :func:`scan_pages` works on a Python list."""


def as_pages(pages: Any, what: str) -> npt.NDArray[np.int64]:
    """Validate page indices and return them as a 1-D int64 array (no NIXL involved).

    Accepts a 1-D integer numpy array, a sequence of ints (``bool`` refused), or a
    :class:`CheckedPages`. Does not check ranges or duplicates (the caller knows the region).

    Raises:
        TransportParamError: Not 1-D, not integers, a bool, or a value beyond int64.
    """
    if type(pages) is np.ndarray and pages.dtype is _INT64 and pages.ndim == 1:
        return pages  # the common case: three cheap checks
    if type(pages) is CheckedPages:
        return pages.indices.astype(np.int64)
    if isinstance(pages, np.ndarray):
        if pages.ndim != 1:
            raise TransportParamError(f"{what} must be 1-D, got shape {pages.shape}")
        if pages.dtype.kind not in "iu":
            raise TransportParamError(f"{what} must be integers, got dtype {pages.dtype}")
        if pages.dtype.kind == "u" and pages.size and int(pages.max()) > np.iinfo(np.int64).max:
            raise TransportParamError(f"{what} contains an out-of-range page index")
        return pages.astype(np.int64, copy=False)
    if isinstance(pages, str | bytes | bytearray) or not isinstance(pages, Sequence):
        raise TransportParamError(f"{what} must be a sequence of ints or an integer array")
    for p in pages:
        # bool is an int subclass and np.bool_ converts silently: reject both explicitly.
        if isinstance(p, bool | np.bool_) or not isinstance(p, int | np.integer):
            raise TransportParamError(f"{what} must contain ints only, got {p!r}")
    try:
        return np.asarray(pages, dtype=np.int64)
    except OverflowError:
        raise TransportParamError(f"{what} contains an out-of-range page index") from None


def scan_pages(pages: npt.NDArray[np.int64], *, unique: bool) -> tuple[int, int, bool]:
    """``(lo, hi, repeats)`` of non-empty 1-D int64 ``pages``, in few numpy calls (a
    reduction costs 3-4 us on these VMs, more than the Python around it).

    ``hi`` is the largest page. ``lo`` is the smallest page when one is negative, else a
    lower bound >= 0 (up to 32 pages: the smallest page). ``repeats`` (only looked for with
    ``unique``; else ``False``): a page occurs twice. Up to 32 pages the list is scanned in
    Python. Otherwise, strictly increasing pages (the common case) need one comparison and one
    count: they are distinct and their ends bound them. Otherwise one reduction of an
    unsigned view finds the largest (a negative page becomes a huge one), and ``unique``
    sorts; the exact smallest and largest are computed only when a page is negative.
    """
    n = pages.shape[0]
    if n <= _SMALL:
        # A few pages: Python on the list beats numpy's per-call cost (each numpy call is
        # 1-4 us here; tolist + min + max + a set of 16 ints is ~1 us).
        values: list[int] = pages.tolist()
        # mutant-site: scan-pages-return
        return min(values), max(values), unique and len(set(values)) != n
    # mutant-site: scan-pages-if
    if np.count_nonzero(pages[1:] > pages[:-1]) == n - 1:
        return pages.item(0), pages.item(-1), False
    repeats = False
    if unique:
        ordered = np.sort(pages)
        repeats = bool(np.count_nonzero(ordered[1:] == ordered[:-1]))
    hi = int(pages.view(np.uint64).max())
    if hi > np.iinfo(np.int64).max:  # a negative page
        return int(pages.min()), int(pages.max()), repeats
    return 0, hi, repeats


class CheckedPages:
    """Page indices checked once: non-empty, ``0 <= index < 2**31``, distinct if
    ``unique``; held as a read-only int32 array (a private copy: later changes to the input
    cannot reach it).

    Pass two of them (source and destination) to ``write_pages`` to skip its per-write
    index checks: it then only compares :attr:`max_page` with each region's size, and needs
    ``unique`` on the destination (otherwise it checks per write as usual). Slicing
    (``pages[a:b]``) gives a checked view without copying or re-checking.

    Array-like (``len``, iteration, ``np.asarray``, ``tolist``), so code written for index
    arrays takes one too. Immutable, hence safe to share between threads.

    Raises (constructor):
        TransportParamError: Malformed indices (see :func:`as_pages`), an empty list, a
            negative index or one of ``2**31`` or more, or (with ``unique``) a repeated one.
    """

    __slots__ = ("_indices", "_max", "_unique")

    def __init__(self, pages: Any, *, unique: bool = True) -> None:
        arr = as_pages(pages, "pages")
        if arr.shape[0] == 0:
            raise TransportParamError("no pages")
        lo, hi, repeats = scan_pages(arr, unique=unique)
        if repeats:
            raise TransportParamError("pages contain duplicates")
        if lo < 0 or hi >= _INDEX_LIMIT:
            raise TransportParamError(
                f"page {lo if lo < 0 else hi} out of range (0 <= page < 2**31)"
            )
        indices = arr.astype(np.int32)  # always a copy
        indices.flags.writeable = False
        self._indices: npt.NDArray[np.int32] = indices
        self._max = hi
        self._unique = bool(unique)

    @classmethod
    def span(cls, first: int, count: int) -> CheckedPages:
        """Pages ``first, first + 1, ..., first + count - 1`` (distinct by construction).

        Raises:
            TransportParamError: ``count < 1``, ``first < 0``, or past ``2**31``.
        """
        if count < 1 or first < 0 or first + count > _INDEX_LIMIT:
            raise TransportParamError(f"bad page span: {count} pages from {first}")
        indices = np.arange(first, first + count, dtype=np.int32)
        indices.flags.writeable = False
        out = object.__new__(cls)
        out._indices, out._max, out._unique = indices, first + count - 1, True
        return out

    @property
    def indices(self) -> npt.NDArray[np.int32]:
        """The indices (read-only int32 array)."""
        return self._indices

    @property
    def max_page(self) -> int:
        """No index is larger (exact when built; a slice keeps its parent's bound)."""
        return self._max

    @property
    def unique(self) -> bool:
        """Whether the indices were checked to be distinct."""
        return self._unique

    def __len__(self) -> int:
        return int(self._indices.shape[0])

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices.tolist())

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> npt.NDArray[Any]:
        """``np.asarray(pages)``: the indices (a copy when ``dtype`` differs or asked)."""
        if dtype is None and not copy:
            return self._indices
        return np.array(self._indices, dtype=dtype, copy=True)

    def tolist(self) -> list[int]:
        """The indices as a list of ints."""
        out: list[int] = self._indices.tolist()
        return out

    def __getitem__(self, key: slice) -> CheckedPages:
        """A slice, still checked (any step: a subset of distinct indices is distinct).

        Raises:
            TypeError: ``key`` is not a slice (an index array could repeat indices).
            ValueError: An empty slice.
        """
        if not isinstance(key, slice):
            raise TypeError(f"CheckedPages takes slices only, got {type(key).__name__}")
        view = self._indices[key]
        if view.shape[0] == 0:
            raise ValueError(f"empty slice {key} of {self!r}")
        out = object.__new__(CheckedPages)
        # mutant-site: getitem
        out._indices, out._max, out._unique = view, self._max, self._unique
        return out

    def __repr__(self) -> str:
        return f"<CheckedPages n={len(self)} max<={self._max} unique={self._unique}>"
