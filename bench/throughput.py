"""Benchmark ``throughput``: cross-process NIXL writes through our transport vs torch copies.

Every case moves the same bytes (16 KiB pages; GB/s = 1e9 B/s) and is timed per operation:

* ``ours`` -- :meth:`sender.transport.NixlTransport.write_pages` to a decode peer in its own
  process (:class:`stress.harness.peer.PeerProcess`, UCX over CMA), then ``wait()`` and
  ``release()``. ``notif=None``: a notification costs a message on the control path and
  measures delivery, not throughput; the sender's rooms (``transfer-share``) do use them.
* ``staged`` (scattered cases) -- :meth:`staging.buffers.StagingBufferPool.gather` of the
  pages into one slot, then ONE write from the slot (the sender's staged path).
* ``torch 1t`` / ``torch Nt`` -- the same bytes copied inside this process by torch on 1
  and on the default number of intra-op threads: ``copy_`` for contiguous bytes,
  ``index_copy_`` of ``index_select``-ed pages for scattered -> scattered (torch has no
  single-pass op for that), ``index_select(out=)`` for scattered -> contiguous. Ratios use
  the faster of the two torch cells of each round.
* anchors -- NIXL's own API on a separate agent configured as our transport's (progress
  thread with a sleep, ``NIXL_THREAD_SYNC_STRICT``): ``raw prepped`` -- ``prep_xfer_dlist``
  once per side (local ``"NIXL_INIT_AGENT"`` and the peer's agent, one descriptor per page
  of each pool), then per write ``make_prepped_xfer`` with page indices, ``transfer``, a
  busy poll of ``check_xfer_state`` and ``release_xfer_handle``; ``raw re-posted`` -- one
  such handle made once per case and posted again (``transfer``) each write after it
  reached DONE; ``raw prepped plain`` -- ``raw prepped`` on a plain agent (no progress
  thread). ``raw prepped`` is what ours is judged against: a cross-process copy cannot
  reach an in-process ``copy_``.
* diagnostics, to explain the ratios: ``raw tx-cfg`` -- the same write through NIXL's own
  API with descriptor lists built per write (``initialize_xfer``, ``transfer``, polls,
  ``release_xfer_handle``) on the transport-configured agent: NIXL without our transport's
  per-write Python work; ``raw NIXL`` -- the same calls on the plain agent; and
  ``CMA`` -- one ``process_vm_writev`` system call with the same iovecs into the peer's
  pool, the kernel mechanism UCX uses here (Linux only; ``-`` where unavailable).

CPU: every cell also measures the process CPU time (``time.process_time``: all threads of
this process, NIXL's progress threads included; not the peer's) over its timed operations,
reported as CPU ms per GB moved. Busy-polling cells spend a core while they wait; the idle
progress threads of the three agents add the same small background to every cell.

Cases: 64 KiB (4 contiguous pages: the fixed per-write cost), 1 MiB and 16 MiB contiguous
(one descriptor); 1024 x 16 KiB contiguous pages sent with ``coalesce=False`` (1024
descriptors, unless NIXL merges them itself); 1024 x 16 KiB scattered -> scattered (random
pages on both sides: the staged write still has 1024 remote descriptors); 1024 x 16 KiB
scattered -> contiguous (the staged write is one descriptor). All cells of all cases are
interleaved round by round.

Goals (reported, never asserted), issue 19's first: a 64 KiB write of ours (plain index
arrays) within 1.25x raw prepped's time, and ours >= 0.9x raw prepped GB/s at 1 MiB; then
docs/PERFORMANCE.md's: ours >= 0.9x raw prepped at 16 MiB and for the two scattered cases, ours' CPU
per GB <= 1.2x raw prepped's on those cases and at 64 KiB, and the same three for
``checked``. The torch ratios are reported, no longer judged (the goal of >= 0.8x torch
``copy_`` for >= 1 MiB gave way to the raw prepped anchor); they use the faster torch cell
of each round. Torch's default two threads are not always the faster here: on this 2-core
machine, shared with NIXL's threads and the peer process, a two-thread copy can stall on a
descheduled worker.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from bench._harness import (
    BenchResult,
    Cell,
    Goal,
    JSONValue,
    Ratio,
    Table,
    gc_paused,
    interleave,
    median,
    median_ratio,
    pending_result,
)
from sender import _nixl

if TYPE_CHECKING:
    import torch

    from sender.transport import NixlTransport
    from staging.buffers import StagingBufferPool
    from stress.harness.peer import PeerProcess

NAME = "throughput"
TITLE = "Cross-process NIXL (our transport) vs torch copy_ of the same bytes, GB/s"

PAGE_BYTES = 16 * 1024
PAGES = 4096  # local KV pool and peer pool: 64 MiB each
BIG = 1024  # pages of the 16 MiB cases
SMALL = 64  # pages of the 1 MiB case
TINY = 4  # pages of the 64 KiB case
RAW_TIMEOUT_S = 30.0
"""A raw write still in progress after this long fails the run instead of hanging it."""
GBPS = "GB/s"
CPU_UNIT = "cpu ms/GB"
SESSION = "decode-0"
RAW = "raw NIXL"
RAW_TX = "raw tx-cfg"
PREPPED = "raw prepped"
REPOSTED = "raw re-posted"
PREPPED_PLAIN = "raw prepped plain"
CHECKED = "ours checked"
"""``ours`` with page lists checked once (:class:`sender.pages.CheckedPages`), as raw
prepped builds its int32 index arrays once: the per-write index checks are skipped."""
GOAL_CASES = ("1 MiB", "16 MiB")
"""Contiguous cases whose µs per write the notes show (with the 64 KiB case)."""
TINY_CASE = "64 KiB (4 pages)"
ANCHOR_RATIO = 0.9
"""Goal: ours >= this x raw prepped's GB/s on :data:`ANCHOR_CASES`."""
ANCHOR_CASES = (
    "1 MiB",
    "16 MiB",
    "1024x16K scattered->scattered",
    "1024x16K scattered->contig",
)
TINY_TIME_RATIO = 1.25
"""Goal: a 64 KiB write of ours takes <= this x raw prepped's time."""
CPU_RATIO = 1.2
"""Goal: ours' CPU per GB <= this x raw prepped's, on the anchor cases and 64 KiB."""

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Preset:
    """Effort: ``rounds``; ops per cell = ``big_ops`` (16 MiB), ``small_ops`` (1 MiB) or
    ``tiny_ops`` (64 KiB)."""

    rounds: int
    big_ops: int
    small_ops: int
    warmup: int = 1
    tiny_ops: int = 64

    def ops(self, case: Case) -> int:
        """Operations per cell of ``case``."""
        if case.nbytes >= BIG * PAGE_BYTES:
            return self.big_ops
        if case.nbytes >= SMALL * PAGE_BYTES:
            return self.small_ops
        return self.tiny_ops


FULL = Preset(rounds=15, big_ops=6, small_ops=32, tiny_ops=256)
QUICK = Preset(rounds=4, big_ops=2, small_ops=12, tiny_ops=32)


@dataclass(frozen=True)
class Case:
    """One row: which pages move (indices into 16 KiB pages on both sides)."""

    name: str
    src: IntArray
    dst: IntArray
    torch_op: str
    coalesce: bool = True
    staged: bool = False

    @property
    def nbytes(self) -> int:
        return int(self.src.shape[0]) * PAGE_BYTES


def make_cases(seed: int = 5) -> list[Case]:
    """The six cases, with fixed random pages."""
    rng = np.random.default_rng(seed)
    small = np.arange(SMALL, dtype=np.int64)
    big = np.arange(BIG, dtype=np.int64)
    scattered_src = rng.choice(PAGES, BIG, replace=False).astype(np.int64)
    scattered_dst = rng.choice(PAGES, BIG, replace=False).astype(np.int64)
    return [
        Case(TINY_CASE, small[:TINY], small[:TINY] + BIG, "copy_"),
        Case("1 MiB", small, small + BIG, "copy_"),
        Case("16 MiB", big, big + BIG, "copy_"),
        Case("1024x16K contig, 1024 descs", big, big + BIG, "copy_", coalesce=False),
        Case(
            "1024x16K scattered->scattered",
            scattered_src,
            scattered_dst,
            "index_copy_",
            staged=True,
        ),
        Case("1024x16K scattered->contig", scattered_src, big + BIG, "index_select", staged=True),
    ]


# ---------------------------------------------------------------------------- CMA


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _Cma:
    """``process_vm_writev`` into another process (Linux); ``None`` from :meth:`load` if the
    call is unavailable here."""

    def __init__(self, fn: Any) -> None:
        self._fn = fn

    @classmethod
    def load(cls) -> _Cma | None:
        if not sys.platform.startswith("linux"):
            return None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.process_vm_writev
        except (OSError, AttributeError):
            return None
        vec = ctypes.POINTER(_IoVec)
        fn.argtypes = [ctypes.c_int, vec, ctypes.c_ulong, vec, ctypes.c_ulong, ctypes.c_ulong]
        fn.restype = ctypes.c_ssize_t
        return cls(fn)

    @staticmethod
    def iovecs(rows: npt.NDArray[np.uint64]) -> ctypes.Array[_IoVec]:
        """iovecs of Nx3 ``(address, length, device)`` descriptor rows."""
        arr = (_IoVec * int(rows.shape[0]))()
        for i, (addr, length, _) in enumerate(rows.tolist()):
            arr[i].iov_base = addr
            arr[i].iov_len = length
        return arr

    def write(
        self, pid: int, local: ctypes.Array[_IoVec], remote: ctypes.Array[_IoVec], nbytes: int
    ) -> None:
        got = self._fn(pid, local, len(local), remote, len(remote), 0)
        if got != nbytes:
            err = ctypes.get_errno()
            raise OSError(
                err, f"process_vm_writev moved {got} of {nbytes} bytes: {os.strerror(err)}"
            )


# ---------------------------------------------------------------------------- raw NIXL


class _RawNixl:
    """NIXL's own API on a separate agent: a write without our transport's per-write work.

    ``like_transport=False``: a plain agent with no progress thread (the floor).
    ``like_transport=True``: the agent configuration :class:`NixlTransport` uses (see its
    module doc): NIXL's progress thread sleeping ``DEFAULT_PROGRESS_DELAY_US`` between
    iterations and ``NIXL_THREAD_SYNC_STRICT``.

    Both sides are also prepared once (``prep_xfer_dlist``: one descriptor per page of the
    local pool and of the peer's pool) for the prepped writes; re-posted handles made by
    :meth:`reposted` live until :meth:`close`.
    """

    def __init__(self, kv: torch.Tensor, peer_meta: bytes, *, like_transport: bool) -> None:
        from sender.transport import DEFAULT_PROGRESS_DELAY_US, decode_metadata

        meta = decode_metadata(peer_meta)
        self.remote = meta.regions["kv"]
        if self.remote.page_bytes != PAGE_BYTES or self.remote.mem_type != "DRAM":
            raise RuntimeError(f"benchmark bug: unexpected peer pool {self.remote}")
        self.local_base = int(kv.data_ptr())
        self.bindings: Any = _nixl.require()
        name = f"bench-raw-{int(like_transport)}-{os.getpid()}"
        if like_transport:
            strict = _nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
            self.agent: Any = _nixl.nixl_agent(
                name,
                _nixl.nixl_agent_config(
                    enable_prog_thread=False,
                    enable_listen_thread=False,
                    backends=[],
                    sync_mode=strict,
                ),
            )
            config = self.bindings.nixlAgentConfig()
            config.useProgThread = True
            config.useListenThread = False
            config.syncMode = strict.value
            config.pthrDelay = DEFAULT_PROGRESS_DELAY_US
            config.captureTelemetry = False
            self.agent.agent = self.bindings.nixlAgent(name, config)
            self.agent.create_backend("UCX")
        else:
            self.agent = _nixl.nixl_agent(
                name,
                _nixl.nixl_agent_config(
                    enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]
                ),
            )
        rows = np.array([[self.local_base, kv.numel(), 0]], dtype=np.uint64)
        self.reg: Any = self.agent.register_memory(rows, "DRAM", ["UCX"])
        loaded = self.agent.add_remote_agent(meta.agent_blob)
        self.peer_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        self.handles: list[Any] = []  # re-posted handles, released by close()
        self.prepped: list[Any] = []  # [local, remote] prepared lists, released by close()
        for agent_name, base, pages in (
            ("NIXL_INIT_AGENT", self.local_base, int(kv.shape[0])),
            (self.peer_name, self.remote.base_addr, self.remote.num_pages),
        ):
            self.prepped.append(
                self.agent.prep_xfer_dlist(agent_name, _page_rows(base, pages), "DRAM", ["UCX"])
            )

    def rows(self, case: Case) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        """Nx3 descriptor rows of a case (merged runs when the case coalesces)."""
        src, dst = case.src, case.dst
        if case.coalesce:
            brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
            starts = np.concatenate((np.zeros(1, dtype=np.int64), brk))
            counts = np.diff(np.append(starts, src.shape[0]))
        else:
            starts = np.arange(src.shape[0], dtype=np.int64)
            counts = np.ones(src.shape[0], dtype=np.int64)

        def build(base: int, pages: IntArray) -> npt.NDArray[np.uint64]:
            out = np.zeros((starts.shape[0], 3), dtype=np.uint64)
            out[:, 0] = base + pages[starts] * PAGE_BYTES
            out[:, 1] = counts * PAGE_BYTES
            return out

        return build(self.local_base, src), build(self.remote.base_addr, dst)

    def write(
        self, local_rows: npt.NDArray[np.uint64], remote_rows: npt.NDArray[np.uint64]
    ) -> None:
        b = self.bindings
        local = b.nixlXferDList(b.DRAM_SEG, local_rows)
        remote = b.nixlXferDList(b.DRAM_SEG, remote_rows)
        handle = self.agent.initialize_xfer("WRITE", local, remote, self.peer_name, b"")
        try:
            _post_and_spin(self.agent, handle)
        finally:
            self.agent.release_xfer_handle(handle)

    def prepped_write(self, case: Case) -> Callable[[], None]:
        """One write of ``case`` from the prepared lists: ``make_prepped_xfer`` by page index,
        ``transfer``, busy poll, ``release_xfer_handle``."""
        agent = self.agent
        local, remote = self.prepped
        src, dst = case.src.astype(np.int32), case.dst.astype(np.int32)
        # As our transport: no descriptor merging when the case asks for one per page.
        extra = {} if case.coalesce else {"skip_desc_merge": True}

        def op() -> None:
            handle = agent.make_prepped_xfer("WRITE", local, src, remote, dst, b"", **extra)
            try:
                _post_and_spin(agent, handle)
            finally:
                agent.release_xfer_handle(handle)

        return op

    def reposted(self, case: Case) -> Callable[[], None]:
        """Make ONE prepared handle for ``case`` now; each call posts it again and busy-polls
        it to DONE (NIXL allows re-posting a handle once it is no longer active)."""
        extra = {} if case.coalesce else {"skip_desc_merge": True}
        local, remote = self.prepped
        src, dst = case.src.astype(np.int32), case.dst.astype(np.int32)
        agent = self.agent
        handle = agent.make_prepped_xfer("WRITE", local, src, remote, dst, b"", **extra)
        self.handles.append(handle)

        def op() -> None:
            _post_and_spin(agent, handle)

        return op

    def close(self) -> None:
        """Release the handles and prepared lists, forget the peer and the memory, then drop
        the agent (its thread stops with it)."""
        try:
            while self.handles:
                self.agent.release_xfer_handle(self.handles.pop())
            while self.prepped:
                self.agent.release_dlist_handle(self.prepped.pop())
        finally:
            try:
                self.agent.remove_remote_agent(self.peer_name)
            finally:
                self.agent.deregister_memory(self.reg, ["UCX"])
                self.agent = None


def _page_rows(base: int, pages: int) -> npt.NDArray[np.uint64]:
    """Nx3 descriptor rows, one per 16 KiB page of a pool starting at ``base``."""
    rows = np.zeros((pages, 3), dtype=np.uint64)
    rows[:, 0] = base + np.arange(pages, dtype=np.uint64) * PAGE_BYTES
    rows[:, 1] = PAGE_BYTES
    return rows


def _post_and_spin(agent: Any, handle: Any) -> None:
    """``transfer`` then busy-poll ``check_xfer_state`` until the write is no longer active.

    Raises:
        RuntimeError: NIXL reported anything but DONE.
        TimeoutError: still in progress after about :data:`RAW_TIMEOUT_S`.
    """
    state = agent.transfer(handle, b"")
    spins = 0
    deadline = 0.0
    while state == "PROC":
        state = agent.check_xfer_state(handle)
        spins += 1
        if not spins & 0xFFF:  # look at the clock every 4096 polls only
            now = time.monotonic()
            if not deadline:
                deadline = now + RAW_TIMEOUT_S
            elif now > deadline:
                raise TimeoutError(f"raw NIXL write still in progress after {RAW_TIMEOUT_S} s")
    if state != "DONE":
        raise RuntimeError(f"raw NIXL write ended in {state!r}")


# ---------------------------------------------------------------------------- the rig


class _Rig:
    """Sender transport + KV pool + one 1024-page staging slot + the diagnostics."""

    def __init__(self, peer: PeerProcess, default_threads: int) -> None:
        import torch

        from sender.transport import NixlTransport
        from staging.buffers import StagingBufferPool

        self.peer = peer
        self.default_threads = default_threads
        gen = torch.Generator().manual_seed(17)
        self.kv = torch.randint(0, 256, (PAGES, PAGE_BYTES), dtype=torch.uint8, generator=gen)
        self.local_dst = torch.zeros((PAGES, PAGE_BYTES), dtype=torch.uint8)
        self.local_dst.fill_(1)  # touch every page now, not inside a timed copy
        self.pool: StagingBufferPool = StagingBufferPool(1, BIG, PAGE_BYTES, debug=False)
        self.pool.tensor.fill_(1)
        self.slot = self.pool.acquire("bench")
        self.tx: NixlTransport = NixlTransport("bench-throughput")
        self.raws: dict[str, _RawNixl] = {}
        self.cpu: dict[str, list[float]] = {}
        """CPU ms per GB of each cell's every call (warm-up rounds included), by label."""
        try:
            self.tx.register_region("kv", self.kv, PAGE_BYTES)
            self.tx.register_region("staging", self.pool.tensor, PAGE_BYTES)
            self.tx.add_peer(SESSION, peer.metadata)
            for way, like in ((RAW, False), (RAW_TX, True)):
                self.raws[way] = _RawNixl(self.kv, peer.metadata, like_transport=like)
        except BaseException:
            self.close()
            raise
        self.cma = _Cma.load()
        self.slot_pages = np.arange(
            self.slot.first_page, self.slot.first_page + BIG, dtype=np.int64
        )

    def close(self) -> None:
        try:
            for raw in self.raws.values():
                raw.close()
        finally:
            self.pool.close()
            self.tx.close()

    # -------------------------------------------------------------- one op of each kind

    def ours(self, case: Case) -> Callable[[], None]:
        def op() -> None:
            x = self.tx.write_pages(SESSION, case.src, case.dst, None, coalesce=case.coalesce)
            x.wait()
            x.release()

        return op

    def ours_checked(self, case: Case) -> Callable[[], None]:
        from sender.pages import CheckedPages

        src, dst = CheckedPages(case.src, unique=False), CheckedPages(case.dst)

        def op() -> None:
            x = self.tx.write_pages(SESSION, src, dst, None, coalesce=case.coalesce)
            x.wait()
            x.release()

        return op

    def staged(self, case: Case) -> Callable[[], None]:
        slot_src = self.slot_pages[: case.src.shape[0]]

        def op() -> None:
            self.pool.gather(self.slot, self.kv, case.src)
            x = self.tx.write_pages(SESSION, slot_src, case.dst, None, src_region="staging")
            x.wait()
            x.release()

        return op

    def torch_op(self, case: Case) -> Callable[[], None]:
        import torch

        kv, dst = self.kv, self.local_dst
        src_idx = torch.as_tensor(case.src)
        dst_idx = torch.as_tensor(case.dst)
        n = int(case.src.shape[0])
        src_view = kv.narrow(0, int(case.src[0]), n)
        dst_view = dst.narrow(0, int(case.dst[0]), n)

        def copy() -> None:
            dst_view.copy_(src_view)

        def scatter() -> None:
            dst.index_copy_(0, dst_idx, kv.index_select(0, src_idx))

        def gather() -> None:
            torch.index_select(kv, 0, src_idx, out=dst_view)

        return {"copy_": copy, "index_copy_": scatter, "index_select": gather}[case.torch_op]

    def raw_op(self, case: Case, way: str) -> Callable[[], None]:
        raw = self.raws[way]
        local_rows, remote_rows = raw.rows(case)

        def op() -> None:
            raw.write(local_rows, remote_rows)

        return op

    def prepped_op(self, case: Case, way: str) -> Callable[[], None]:
        """``raw prepped`` (on the transport-configured agent) or ``raw prepped plain``."""
        return self.raws[RAW if way == PREPPED_PLAIN else RAW_TX].prepped_write(case)

    def reposted_op(self, case: Case) -> Callable[[], None]:
        """``raw re-posted``: a handle of its own, made now, posted again by every call."""
        return self.raws[RAW_TX].reposted(case)

    def cma_op(self, case: Case) -> Callable[[], None] | None:
        """The same descriptors as the raw NIXL write, as iovecs of one system call."""
        cma = self.cma
        if cma is None:
            return None
        local_rows, remote_rows = self.raws[RAW].rows(case)
        local, remote = _Cma.iovecs(local_rows), _Cma.iovecs(remote_rows)
        pid, nbytes = self.peer.pid, case.nbytes

        def op() -> None:
            cma.write(pid, local, remote, nbytes)

        return op

    # -------------------------------------------------------------- checks and cells

    def verify(self, cases: list[Case]) -> None:
        """Every NIXL/CMA way of writing lands the right bytes at the peer (untimed).

        Drops the CMA diagnostic if the kernel refuses it (e.g. ptrace restrictions).

        Raises:
            RuntimeError: bytes differ at the peer.
        """
        from stress.harness.driver import page_digests

        for case in cases:
            want = page_digests(self.kv[case.src.tolist()])
            reposted = self.reposted_op(case)
            ways: list[tuple[str, Callable[[], None] | None]] = [
                ("ours", self.ours(case)),
                (CHECKED, self.ours_checked(case)),
                (RAW, self.raw_op(case, RAW)),
                (RAW_TX, self.raw_op(case, RAW_TX)),
                (PREPPED, self.prepped_op(case, PREPPED)),
                (PREPPED_PLAIN, self.prepped_op(case, PREPPED_PLAIN)),
                (REPOSTED, reposted),
                (f"{REPOSTED} (again)", reposted),  # the same handle, posted a second time
                ("CMA", self.cma_op(case)),
            ]
            if case.staged:
                ways.append(("staged", self.staged(case)))
            for way, op in ways:
                if op is None:
                    continue
                self.peer.zero_pages(case.dst.tolist())
                try:
                    op()
                except OSError:
                    if way != "CMA":
                        raise
                    self.cma = None
                    continue
                if self.peer.page_digest(case.dst.tolist()) != want:
                    raise RuntimeError(
                        f"benchmark bug: {way} bytes differ at the peer ({case.name})"
                    )

    def cell(
        self, label: str, op: Callable[[], None], ops: int, nbytes: int, threads: int
    ) -> Callable[[], float]:
        """GB/s over ``ops`` back-to-back operations, torch on ``threads`` threads; appends the
        process CPU ms per GB of the same span to ``self.cpu[label]``."""
        import torch

        cpu = self.cpu.setdefault(label, [])

        def measure() -> float:
            torch.set_num_threads(threads)
            clock, cpu_clock = time.perf_counter_ns, time.process_time_ns
            with gc_paused():
                c0 = cpu_clock()
                t0 = clock()
                try:
                    for _ in range(ops):
                        op()
                except BaseException as exc:
                    if sys.version_info >= (3, 11):
                        exc.add_note(f"in benchmark cell {label!r}")
                    raise
                elapsed = clock() - t0
                used = cpu_clock() - c0
            moved = nbytes * ops
            cpu.append(used * 1e3 / moved)  # CPU ns per byte == s per GB; x 1e3: ms per GB
            return moved / elapsed  # bytes per ns == GB/s

        return measure


def _label(case: Case, way: str) -> str:
    return f"{case.name} | {way} GB/s"


def _cpu_label(case: Case, way: str) -> str:
    return f"{case.name} | {way} CPU ms/GB"


def _cells(rig: _Rig, cases: list[Case], preset: Preset) -> list[tuple[str, Callable[[], float]]]:
    cells: list[tuple[str, Callable[[], float]]] = []
    torch_done: set[tuple[str, int, int]] = set()
    for case in cases:
        ops = preset.ops(case)
        key = (case.torch_op, int(case.src[0]), int(case.src.shape[0]))
        ways: dict[str, tuple[Callable[[], None] | None, int]] = {
            "ours": (rig.ours(case), 1),
            CHECKED: (rig.ours_checked(case), 1),
            PREPPED: (rig.prepped_op(case, PREPPED), 1),
            REPOSTED: (rig.reposted_op(case), 1),
            PREPPED_PLAIN: (rig.prepped_op(case, PREPPED_PLAIN), 1),
            RAW: (rig.raw_op(case, RAW), 1),
            RAW_TX: (rig.raw_op(case, RAW_TX), 1),
            "CMA": (rig.cma_op(case), 1),
        }
        if case.staged:
            ways["staged"] = (rig.staged(case), 1)
        if key not in torch_done:
            ways["torch 1t"] = (rig.torch_op(case), 1)
            ways["torch Nt"] = (rig.torch_op(case), rig.default_threads)
        torch_done.add(key)
        for way, (op, threads) in ways.items():
            if op is not None:
                label = _label(case, way)
                cells.append((label, rig.cell(label, op, ops, case.nbytes, threads)))
    return cells


# ---------------------------------------------------------------------------- run


def measure(preset: Preset) -> BenchResult:
    """Run the benchmark with an explicit preset (tests use tiny ones)."""
    if not _nixl.AVAILABLE:
        return pending_result(NAME, TITLE, f"NIXL not importable: {_nixl.IMPORT_ERROR!r}")
    import torch

    from stress.harness.peer import PeerProcess

    default_threads = torch.get_num_threads()
    cases = make_cases()
    try:
        with PeerProcess(PAGES, PAGE_BYTES, name="bench-tput", stderr=subprocess.DEVNULL) as peer:
            rig = _Rig(peer, default_threads)
            try:
                torch.set_num_threads(1)
                rig.verify(cases)
                cma = rig.cma is not None
                samples = interleave(
                    _cells(rig, cases, preset), preset.rounds, warmup=preset.warmup
                )
            finally:
                rig.close()
    finally:
        torch.set_num_threads(default_threads)
    for label, cpu in rig.cpu.items():  # every cell ran warmup + rounds times
        case_way = label.removesuffix(" GB/s")
        samples[f"{case_way} CPU ms/GB"] = cpu[preset.warmup :]
    return _report(preset, cases, samples, default_threads, cma)


def _torch_samples(
    case: Case, cases: list[Case], samples: dict[str, list[float]], way: str, *, cpu: bool = False
) -> list[float]:
    """The torch cell of a case, or of the case whose torch op moves the same bytes (its GB/s,
    or with ``cpu`` its CPU ms/GB)."""
    label_of = _cpu_label if cpu else _label
    label = label_of(case, way)
    if label in samples:
        return samples[label]
    for other in cases:
        same = other.torch_op == case.torch_op and np.array_equal(other.src, case.src)
        if same and label_of(other, way) in samples:
            return samples[label_of(other, way)]
    raise KeyError(label)


def _report(
    preset: Preset,
    cases: list[Case],
    samples: dict[str, list[float]],
    default_threads: int,
    cma: bool,
) -> BenchResult:
    nt = f"torch {default_threads}t"
    # column -> way; each case has a GB/s row and a CPU ms/GB row under it
    way_columns = {
        "ours": "ours",
        CHECKED: CHECKED,
        PREPPED: PREPPED,
        "re-posted": REPOSTED,
        "prepped plain": PREPPED_PLAIN,
        RAW_TX: RAW_TX,
        RAW: RAW,
        "CMA": "CMA",
        "staged": "staged",
        "torch 1t": "torch 1t",
        nt: "torch Nt",
    }
    columns = [
        "case",
        "unit",
        "ours",
        CHECKED,
        PREPPED,
        "ours/prepped",
        "checked/prepped",
        "re-posted",
        "prepped plain",
        RAW_TX,
        RAW,
        "CMA",
        "staged",
        "staged/ours",
        "torch op",
        "torch 1t",
        nt,
        "ours/torch",
    ]
    rows: list[dict[str, Cell]] = []
    ratios: list[Ratio] = []
    vs_prepped: dict[str, float | None] = {}  # ours / raw prepped, GB/s
    time_vs_prepped: dict[str, float | None] = {}  # ours' time / raw prepped's
    cpu_vs_prepped: dict[str, float | None] = {}  # ours' CPU per GB / raw prepped's
    # The same three for ours with page lists checked once.
    ck_vs_prepped: dict[str, float | None] = {}
    ck_time_vs_prepped: dict[str, float | None] = {}
    ck_cpu_vs_prepped: dict[str, float | None] = {}
    for case in cases:
        t1 = _torch_samples(case, cases, samples, "torch 1t")
        tn = _torch_samples(case, cases, samples, "torch Nt")
        best = [max(a, b) for a, b in zip(t1, tn, strict=True)]
        ours = samples[_label(case, "ours")]
        staged = samples.get(_label(case, "staged"))
        raw = samples[_label(case, RAW)]
        raw_tx = samples[_label(case, RAW_TX)]
        prepped = samples[_label(case, PREPPED)]
        reposted = samples[_label(case, REPOSTED)]
        plain = samples[_label(case, PREPPED_PLAIN)]
        cma_s = samples.get(_label(case, "CMA"))
        cpu_ours = samples[_cpu_label(case, "ours")]
        cpu_prepped = samples[_cpu_label(case, PREPPED)]
        ours_torch = median_ratio(ours, best)
        staged_ours = median_ratio(staged, ours) if staged else None
        name = case.name
        vs_prepped[name] = median_ratio(ours, prepped)
        time_vs_prepped[name] = median_ratio(prepped, ours)
        cpu_vs_prepped[name] = median_ratio(cpu_ours, cpu_prepped)
        checked = samples[_label(case, CHECKED)]
        ck_vs_prepped[name] = median_ratio(checked, prepped)
        ck_time_vs_prepped[name] = median_ratio(prepped, checked)
        ck_cpu_vs_prepped[name] = median_ratio(samples[_cpu_label(case, CHECKED)], cpu_prepped)
        gbps: dict[str, Cell] = {"case": name, "unit": GBPS, "torch op": case.torch_op}
        cpu: dict[str, Cell] = {"case": name, "unit": CPU_UNIT, "torch op": case.torch_op}
        for column, way in way_columns.items():
            if way.startswith("torch"):
                got = _torch_samples(case, cases, samples, way)
                spent = _torch_samples(case, cases, samples, way, cpu=True)
            else:
                got = samples.get(_label(case, way), [])
                spent = samples.get(_cpu_label(case, way), [])
            gbps[column] = median(got) if got else None
            cpu[column] = median(spent) if spent else None
        cpu_staged = samples.get(_cpu_label(case, "staged"))
        gbps.update(
            {
                "ours/prepped": vs_prepped[name],
                "checked/prepped": ck_vs_prepped[name],
                "staged/ours": staged_ours,
                "ours/torch": ours_torch,
            }
        )
        cpu.update(
            {
                "ours/prepped": cpu_vs_prepped[name],
                "checked/prepped": ck_cpu_vs_prepped[name],
                "staged/ours": median_ratio(cpu_staged, cpu_ours) if cpu_staged else None,
                "ours/torch": None,
            }
        )
        rows.extend((gbps, cpu))
        ratios.append(
            Ratio(
                f"ours/{PREPPED} {name}",
                vs_prepped[name],
                f"GB/s; goal >= {ANCHOR_RATIO:g} on the anchor cases",
            )
        )
        ratios.append(
            Ratio(
                f"checked/{PREPPED} {name}",
                ck_vs_prepped[name],
                f"GB/s of ours with page lists checked once; goal >= {ANCHOR_RATIO:g}",
            )
        )
        if name == TINY_CASE:
            ratios.append(
                Ratio(
                    f"ours/{PREPPED} time {name}",
                    time_vs_prepped[name],
                    f"time per write; goal <= {TINY_TIME_RATIO:g}",
                )
            )
            ratios.append(
                Ratio(
                    f"checked/{PREPPED} time {name}",
                    ck_time_vs_prepped[name],
                    f"time per write; goal <= {TINY_TIME_RATIO:g}",
                )
            )
        ratios.append(
            Ratio(
                f"cpu ours/{PREPPED} {name}",
                cpu_vs_prepped[name],
                f"CPU per GB; goal <= {CPU_RATIO:g}",
            )
        )
        ratios.append(
            Ratio(
                f"cpu checked/{PREPPED} {name}",
                ck_cpu_vs_prepped[name],
                f"CPU per GB; goal <= {CPU_RATIO:g}",
            )
        )
        ratios.append(
            Ratio(
                f"{REPOSTED}/{PREPPED} {name}",
                median_ratio(reposted, prepped),
                "> 1: what making a handle per write costs NIXL",
            )
        )
        ratios.append(
            Ratio(
                f"{PREPPED}/{RAW_TX} {name}",
                median_ratio(prepped, raw_tx),
                "> 1: what prepared lists save over initialize_xfer per write",
            )
        )
        ratios.append(
            Ratio(
                f"{PREPPED_PLAIN}/{PREPPED} {name}",
                median_ratio(plain, prepped),
                "> 1: what the agent config (progress thread, STRICT) costs a prepped write",
            )
        )
        ratios.append(Ratio(f"ours/torch {name}", ours_torch, "ours / faster torch of the round"))
        ratios.append(
            Ratio(
                f"{RAW_TX}/ours {name}",
                median_ratio(raw_tx, ours),
                "> 1: what our transport's per-write Python work costs",
            )
        )
        ratios.append(
            Ratio(
                f"{RAW}/{RAW_TX} {name}",
                median_ratio(raw, raw_tx),
                "> 1: what the agent config (progress thread, STRICT) costs",
            )
        )
        if cma_s:
            ratios.append(
                Ratio(
                    f"CMA/torch {name}",
                    median_ratio(cma_s, best),
                    "the kernel's cross-process copy vs torch in-process",
                )
            )
        if staged:
            ratios.append(
                Ratio(
                    f"staged/ours {name}",
                    staged_ours,
                    "> 1: gather + one write beats the many-descriptor write",
                )
            )

    cpu_cases = (*ANCHOR_CASES, TINY_CASE)
    rest = tuple(k for k in ANCHOR_CASES if k != "1 MiB")
    goals = [
        # Issue 19's two goals for one write, on plain index arrays (ours) ...
        _goal(
            f"a 64 KiB write (4 pages, plain index arrays) <= {TINY_TIME_RATIO:g}x "
            f"{PREPPED} NIXL's time",
            {TINY_CASE: time_vs_prepped.get(TINY_CASE)},
            lambda v: v <= TINY_TIME_RATIO,
            "ours/prepped time",
            "a write's fixed Python cost, about 1.5-3 µs over raw prepped's 10 µs",
        ),
        _goal(
            f"plain index arrays >= {ANCHOR_RATIO:g}x {PREPPED} GB/s at 1 MiB",
            {"1 MiB": vs_prepped.get("1 MiB")},
            lambda v: v >= ANCHOR_RATIO,
            "ours/prepped",
            "plain index arrays are checked on every write; CheckedPages checks them once",
        ),
        # ... then docs/PERFORMANCE.md's: the larger cases and CPU, for ours and for checked pages.
        _goal(
            f"plain index arrays >= {ANCHOR_RATIO:g}x {PREPPED} GB/s at 16 MiB and 1024 "
            "scattered 16 KiB pages",
            {k: vs_prepped.get(k) for k in rest},
            lambda v: v >= ANCHOR_RATIO,
            "ours/prepped",
        ),
        _goal(
            f"CPU per GB of plain index arrays <= {CPU_RATIO:g}x {PREPPED}'s",
            {k: cpu_vs_prepped.get(k) for k in cpu_cases},
            lambda v: v <= CPU_RATIO,
            "cpu ours/prepped",
            "at 64 KiB and 1 MiB, the same per-write checks and fixed cost",
        ),
        _goal(
            f"checked pages >= {ANCHOR_RATIO:g}x {PREPPED} GB/s at 1 MiB, 16 MiB and 1024 "
            "scattered 16 KiB pages",
            {k: ck_vs_prepped.get(k) for k in ANCHOR_CASES},
            lambda v: v >= ANCHOR_RATIO,
            "checked/prepped",
        ),
        _goal(
            f"a 64 KiB write (4 pages) of checked pages <= {TINY_TIME_RATIO:g}x {PREPPED}'s time",
            {TINY_CASE: ck_time_vs_prepped.get(TINY_CASE)},
            lambda v: v <= TINY_TIME_RATIO,
            "checked/prepped time",
        ),
        _goal(
            f"CPU per GB of checked pages <= {CPU_RATIO:g}x {PREPPED}'s",
            {k: ck_cpu_vs_prepped.get(k) for k in cpu_cases},
            lambda v: v <= CPU_RATIO,
            "cpu checked/prepped",
        ),
    ]

    layout = _layout(rows, nt)

    def per_write_us(case: Case) -> str:
        ways = ["ours", CHECKED, PREPPED, REPOSTED, RAW_TX, *(["CMA"] if cma else []), "torch 1t"]
        parts = []
        for way in ways:
            got = (
                _torch_samples(case, cases, samples, way)
                if way.startswith("torch")
                else (samples[_label(case, way)])
            )
            parts.append(f"{way} {case.nbytes / median(got) / 1e3:.0f}")
        return f"{case.name}: " + ", ".join(parts)

    us_cases = [c for c in cases if c.name in (TINY_CASE, *GOAL_CASES)]
    notes = [
        f"GB/s (1e9 B/s) medians of {preset.rounds} rounds, all cells interleaved; "
        f"{preset.big_ops} ops per 16 MiB cell, {preset.small_ops} per 1 MiB cell, "
        f"{preset.tiny_ops} per 64 KiB cell; one op = write_pages + wait + release "
        "(notif=None) for ours/staged; peer = PeerProcess",
        f"{CHECKED}: ours with both page lists as sender.pages.CheckedPages built once per "
        "case (as raw prepped builds its int32 index arrays once), so write_pages skips its "
        "per-write index checks",
        f"{PREPPED}: prep_xfer_dlist once per side (one descriptor per page of each pool), "
        "make_prepped_xfer + transfer + busy poll + release_xfer_handle per write, on an agent "
        f"configured as our transport's; {REPOSTED}: one prepped handle per case posted again "
        f"each write; {PREPPED_PLAIN}: {PREPPED} on a plain agent (no progress thread)",
        f"{RAW_TX}: descriptor lists + initialize_xfer per write on the transport-configured "
        f"agent; {RAW}: the same calls on the plain agent; CMA: one process_vm_writev with "
        "the same iovecs" + ("" if cma else " (unavailable here)"),
        f"each case has a {GBPS} row and a {CPU_UNIT} row: process CPU ms per GB moved "
        "(time.process_time over a cell's timed ops: every thread of this process, NIXL "
        "progress threads included, not the peer's); in that row ours/prepped and "
        "staged/ours are ratios of CPU per GB (lower is cheaper); per-round samples of every "
        "cell are in --json",
        f"ratios use the faster torch cell of each round (1 or {default_threads} intra-op "
        "threads); the torch cells of '1024x16K contig' are those of '16 MiB' (same bytes, "
        "same op)",
        "µs per write (from the medians): " + "; ".join(per_write_us(c) for c in us_cases),
        "torch op (the in-process copy of the same bytes): "
        + ", ".join(f"{c.name} {c.torch_op}" for c in cases),
        "every way of writing was checked byte-exact at the peer before timing (the re-posted "
        "handle twice)",
    ]
    params: dict[str, JSONValue] = {
        "rounds": preset.rounds,
        "warmup_rounds": preset.warmup,
        "ops_per_16MiB_cell": preset.big_ops,
        "ops_per_1MiB_cell": preset.small_ops,
        "ops_per_64KiB_cell": preset.tiny_ops,
        "page_bytes": PAGE_BYTES,
        "default_torch_threads": default_threads,
        "cpu_unit": "process CPU ms per GB moved (time.process_time)",
    }
    return BenchResult(
        name=NAME,
        title=TITLE,
        columns=columns,
        rows=rows,
        ratios=ratios,
        goals=goals,
        notes=notes,
        params=params,
        samples=samples,
        layout=layout,
    )


def _layout(rows: list[dict[str, Cell]], nt: str) -> list[Table]:
    """The table as printed: its 18 columns (about 230 characters) in four tables of at most
    about 100, the goals' anchor first. Raises: nothing."""
    anchor = ["case", "ours", CHECKED, PREPPED, "ours/prepped", "checked/prepped"]
    by_unit = {unit: [r for r in rows if r["unit"] == unit] for unit in (GBPS, CPU_UNIT)}
    return [
        Table(
            f"{GBPS}, higher is faster: the goals' anchor (ours and checked vs prepped)",
            anchor,
            by_unit[GBPS],
        ),
        Table(
            f"{CPU_UNIT} (process CPU per GB moved), lower is cheaper: the same",
            anchor,
            by_unit[CPU_UNIT],
        ),
        Table(
            f"other ways of writing (each case: a {GBPS} row, then a {CPU_UNIT} row)",
            ["case", "unit", "re-posted", "prepped plain", RAW_TX, RAW, "CMA"],
            rows,
        ),
        Table(
            "gather + one write (staged); torch copying the same bytes in-process",
            ["case", "unit", "staged", "staged/ours", "torch 1t", nt, "ours/torch"],
            rows,
        ),
    ]


def _goal(
    text: str,
    values: dict[str, float | None],
    ok: Callable[[float], bool],
    what: str,
    open_why: str = "",
) -> Goal:
    """A goal judged on every case of ``values``; ``met`` is None if one was not measured.
    ``open_why``: why the goal is open by design (docs/PERFORMANCE.md, "Open goals")."""
    measured = {k: v for k, v in values.items() if v is not None}
    met = all(ok(v) for v in measured.values()) if len(measured) == len(values) else None
    detail = ", ".join(
        f"{k}: {what} {'-' if v is None else f'{v:.2f}x'}" for k, v in values.items()
    )
    return Goal(text, met, detail, open_why)


def run(quick: bool) -> BenchResult:
    """The ``--quick`` preset (4 rounds, ~15 s here) or the full one (15 rounds, ~1 min)."""
    return measure(QUICK if quick else FULL)
