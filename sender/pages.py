"""Page indices: validated per write (:func:`as_pages`), or once (:class:`CheckedPages`).

NIXL 1.5.1 casts page indices to 32-bit ints unchecked (``2**32 + 1`` becomes page 1), so
``NixlTransport.write_pages`` checks every index list first. A :class:`CheckedPages` is
checked once when built (ints in ``[0, 2**31)``, distinct if asked, a read-only int32 copy,
its largest value kept): a write given two of them only compares that bound with the
regions. Slices stay checked. Immutable: safe to share between threads.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from sender.errors import TransportParamError

__all__ = ["CheckedPages", "as_pages", "scan_pages"]

_INDEX_LIMIT = 1 << 31
"""NIXL takes page indices as 32-bit ints."""
_SMALL = 32
"""Up to this many pages :func:`scan_pages` works on a Python list."""


def as_pages(pages: Any, what: str) -> npt.NDArray[np.int64]:
    """Page indices (1-D int array, sequence of ints, or :class:`CheckedPages`) as a 1-D
    int64 array. Ranges and duplicates are not checked.

    Raises:
        TransportParamError: Not 1-D, not integers, a bool, or a value beyond int64.
    """
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
        # bool is an int and np.bool_ converts silently: refuse both.
        if isinstance(p, bool | np.bool_) or not isinstance(p, int | np.integer):
            raise TransportParamError(f"{what} must contain ints only, got {p!r}")
    try:
        return np.asarray(pages, dtype=np.int64)
    except OverflowError:
        raise TransportParamError(f"{what} contains an out-of-range page index") from None


def scan_pages(pages: npt.NDArray[np.int64], *, unique: bool) -> tuple[int, int, bool]:
    """``(lo, hi, repeats)`` of non-empty 1-D int64 ``pages``, in few numpy calls: the
    smallest and largest page and (looked for only with ``unique``) whether one repeats."""
    n = pages.shape[0]
    if n <= _SMALL:
        # Python on a short list beats numpy's per-call cost.
        values: list[int] = pages.tolist()
        # mutant-site: scan-pages-return
        return min(values), max(values), unique and len(set(values)) != n
    # Strictly increasing (the common case): distinct, bounded by its ends.
    # mutant-site: scan-pages-if
    if np.count_nonzero(pages[1:] > pages[:-1]) == n - 1:
        return pages.item(0), pages.item(-1), False
    if unique:
        ordered = np.sort(pages)  # its ends are the bounds
        repeats = bool(np.count_nonzero(ordered[1:] == ordered[:-1]))
        return ordered.item(0), ordered.item(-1), repeats
    return int(pages.min()), int(pages.max()), False


class CheckedPages:
    """Page indices checked once: non-empty, ``0 <= index < 2**31``, distinct if
    ``unique``; a private read-only int32 copy. Immutable: safe to share between threads.

    Given as both ``write_pages`` lists (the destination ``unique``), the write only
    compares :attr:`max_page` with each region's size. Slices stay checked, uncopied.
    Array-like (``len``, iteration, ``np.asarray``, ``tolist``).

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
        """Pages ``first .. first + count - 1``.

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
