"""Benchmark ``throughput``: cross-process NIXL writes through our transport vs torch copies.

Every case moves the same bytes (16 KiB pages; GB/s = 1e9 B/s) and is timed per operation:

* ``ours`` -- :meth:`sender.transport.NixlTransport.write_pages` to a decode peer in its own
  process (:class:`sender.peer.PeerProcess`, UCX over CMA), then ``wait()`` and
  ``release()``. ``notif=None``: a notification costs a message on the control path and
  measures delivery, not throughput; the sender's rooms (``transfer-share``) do use them.
* ``staged`` (scattered cases) -- :meth:`staging.buffers.StagingBufferPool.gather` of the
  pages into one slot, then ONE write from the slot (the sender's staged path).
* ``torch 1t`` / ``torch Nt`` -- the same bytes copied inside this process by torch on 1
  and on the default number of intra-op threads: ``copy_`` for contiguous bytes,
  ``index_copy_`` of ``index_select``-ed pages for scattered -> scattered (torch has no
  single-pass op for that), ``index_select(out=)`` for scattered -> contiguous. Ratios use
  the faster of the two torch cells of each round.
* diagnostics, to explain the ratios: ``raw tx-cfg`` -- the same write through NIXL's own
  API (descriptor lists built per write, ``initialize_xfer``, ``transfer``, polls,
  ``release_xfer_handle``) on a separate agent configured as our transport's (progress
  thread with a sleep, ``NIXL_THREAD_SYNC_STRICT``): NIXL without our transport's per-write
  Python work; ``raw NIXL`` -- the same calls on a plain agent with no progress thread; and
  ``CMA`` -- one ``process_vm_writev`` system call with the same iovecs into the peer's
  pool, the kernel mechanism UCX uses here (Linux only; ``-`` where unavailable).

Cases: 1 MiB and 16 MiB contiguous (one descriptor); 1024 x 16 KiB contiguous pages sent
with ``coalesce=False`` (1024 descriptors, unless NIXL merges them itself); 1024 x 16 KiB
scattered -> scattered (random pages on both sides: the staged write still has 1024
remote descriptors); 1024 x 16 KiB scattered -> contiguous (the staged write is one
descriptor). All cells of all cases are interleaved round by round.

The goal (our transfer >= 0.8x torch ``copy_`` for >= 1 MiB) is judged on the 1 MiB and
16 MiB cases (one descriptor each) against the faster torch cell of each round. Torch's
default two threads are not always the faster here: on this 2-core machine, shared with
NIXL's threads and the peer process, a two-thread copy can stall on a descheduled worker.
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
    gc_paused,
    interleave,
    median,
    median_ratio,
    pending_result,
)
from sender import _nixl

if TYPE_CHECKING:
    import torch

    from sender.peer import PeerProcess
    from sender.transport import NixlTransport
    from staging.buffers import StagingBufferPool

NAME = "throughput"
TITLE = "Cross-process NIXL (our transport) vs torch copy_ of the same bytes, GB/s"

PAGE_BYTES = 16 * 1024
PAGES = 4096  # local KV pool and peer pool: 64 MiB each
BIG = 1024  # pages of the 16 MiB cases
SMALL = 64  # pages of the 1 MiB case
SESSION = "decode-0"
RAW = "raw NIXL"
RAW_TX = "raw tx-cfg"
GOAL_RATIO = 0.8
GOAL_CASES = ("1 MiB", "16 MiB")
"""Cases the goal is judged on: contiguous bytes >= 1 MiB, one descriptor, vs ``copy_``."""

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Preset:
    """Effort: ``rounds``; ops per cell = ``big_ops`` (16 MiB) or ``small_ops`` (1 MiB)."""

    rounds: int
    big_ops: int
    small_ops: int
    warmup: int = 1


FULL = Preset(rounds=11, big_ops=4, small_ops=24)
QUICK = Preset(rounds=4, big_ops=2, small_ops=12)


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
    """The five cases, with fixed random pages."""
    rng = np.random.default_rng(seed)
    small = np.arange(SMALL, dtype=np.int64)
    big = np.arange(BIG, dtype=np.int64)
    scattered_src = rng.choice(PAGES, BIG, replace=False).astype(np.int64)
    scattered_dst = rng.choice(PAGES, BIG, replace=False).astype(np.int64)
    return [
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
    """

    def __init__(self, kv: torch.Tensor, peer_meta: bytes, *, like_transport: bool) -> None:
        from sender.transport import DEFAULT_PROGRESS_DELAY_US, decode_metadata

        meta = decode_metadata(peer_meta)
        self.remote = meta.regions["kv"]
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
            state = self.agent.transfer(handle, b"")
            while state == "PROC":
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL write ended in {state!r}")
        finally:
            self.agent.release_xfer_handle(handle)

    def close(self) -> None:
        """Forget the peer and the memory, then drop the agent (its thread stops with it)."""
        try:
            self.agent.remove_remote_agent(self.peer_name)
        finally:
            self.agent.deregister_memory(self.reg, ["UCX"])
            self.agent = None


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
        from sender.driver import page_digests

        for case in cases:
            want = page_digests(self.kv[case.src.tolist()])
            ways: list[tuple[str, Callable[[], None] | None]] = [
                ("ours", self.ours(case)),
                (RAW, self.raw_op(case, RAW)),
                (RAW_TX, self.raw_op(case, RAW_TX)),
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
        self, op: Callable[[], None], ops: int, nbytes: int, threads: int
    ) -> Callable[[], float]:
        """GB/s over ``ops`` back-to-back operations, torch on ``threads`` threads."""
        import torch

        def measure() -> float:
            torch.set_num_threads(threads)
            clock = time.perf_counter_ns
            with gc_paused():
                t0 = clock()
                for _ in range(ops):
                    op()
                elapsed = clock() - t0
            return nbytes * ops / elapsed  # bytes per ns == GB/s

        return measure


def _label(case: Case, way: str) -> str:
    return f"{case.name} | {way} GB/s"


def _cells(rig: _Rig, cases: list[Case], preset: Preset) -> list[tuple[str, Callable[[], float]]]:
    cells: list[tuple[str, Callable[[], float]]] = []
    torch_done: set[tuple[str, int, int]] = set()
    for case in cases:
        ops = preset.small_ops if case.nbytes < BIG * PAGE_BYTES else preset.big_ops
        key = (case.torch_op, int(case.src[0]), int(case.src.shape[0]))
        ways: dict[str, tuple[Callable[[], None] | None, int]] = {
            "ours": (rig.ours(case), 1),
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
                cells.append((_label(case, way), rig.cell(op, ops, case.nbytes, threads)))
    return cells


# ---------------------------------------------------------------------------- run


def measure(preset: Preset) -> BenchResult:
    """Run the benchmark with an explicit preset (tests use tiny ones)."""
    if not _nixl.AVAILABLE:
        return pending_result(NAME, TITLE, f"NIXL not importable: {_nixl.IMPORT_ERROR!r}")
    import torch

    from sender.peer import PeerProcess

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
    return _report(preset, cases, samples, default_threads, cma)


def _torch_samples(
    case: Case, cases: list[Case], samples: dict[str, list[float]], way: str
) -> list[float]:
    """The torch cell of a case, or of the case whose torch op moves the same bytes."""
    label = _label(case, way)
    if label in samples:
        return samples[label]
    for other in cases:
        same = other.torch_op == case.torch_op and np.array_equal(other.src, case.src)
        if same and _label(other, way) in samples:
            return samples[_label(other, way)]
    raise KeyError(label)


def _report(
    preset: Preset,
    cases: list[Case],
    samples: dict[str, list[float]],
    default_threads: int,
    cma: bool,
) -> BenchResult:
    nt = f"torch {default_threads}t"
    columns = [
        "case",
        "torch op",
        "torch 1t",
        nt,
        "ours",
        "ours/torch",
        "staged",
        "staged/ours",
        RAW_TX,
        RAW,
        "CMA",
    ]
    rows: list[dict[str, Cell]] = []
    ratios: list[Ratio] = []
    goal_ratios: dict[str, float] = {}
    for case in cases:
        t1 = _torch_samples(case, cases, samples, "torch 1t")
        tn = _torch_samples(case, cases, samples, "torch Nt")
        best = [max(a, b) for a, b in zip(t1, tn, strict=True)]
        ours = samples[_label(case, "ours")]
        staged = samples.get(_label(case, "staged"))
        raw = samples[_label(case, RAW)]
        raw_tx = samples[_label(case, RAW_TX)]
        cma_s = samples.get(_label(case, "CMA"))
        ours_torch = median_ratio(ours, best)
        staged_ours = median_ratio(staged, ours) if staged else None
        rows.append(
            {
                "case": case.name,
                "torch op": case.torch_op,
                "torch 1t": median(t1),
                nt: median(tn),
                "ours": median(ours),
                "ours/torch": ours_torch,
                "staged": median(staged) if staged else None,
                "staged/ours": staged_ours,
                RAW_TX: median(raw_tx),
                RAW: median(raw),
                "CMA": median(cma_s) if cma_s else None,
            }
        )
        name = case.name
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
        if name in GOAL_CASES:
            goal_ratios[name] = ours_torch or 0.0

    detail = ", ".join(f"{k}: ours/torch {v:.2f}x" for k, v in goal_ratios.items())
    goals = [
        Goal(
            f"transfer >= {GOAL_RATIO:g}x torch copy_ for >= 1 MiB (ours, one descriptor)",
            all(v >= GOAL_RATIO for v in goal_ratios.values()),
            detail,
        )
    ]

    def per_write_us(case: Case) -> str:
        ways = ["ours", RAW_TX, RAW] + (["CMA"] if cma else []) + ["torch 1t"]
        parts = []
        for way in ways:
            got = (
                _torch_samples(case, cases, samples, way)
                if way.startswith("torch")
                else (samples[_label(case, way)])
            )
            parts.append(f"{way} {case.nbytes / median(got) / 1e3:.0f}")
        return f"{case.name}: " + ", ".join(parts)

    goal_cases = [c for c in cases if c.name in GOAL_CASES]
    notes = [
        f"GB/s (1e9 B/s) medians of {preset.rounds} rounds, all cells interleaved; "
        f"{preset.big_ops} ops per 16 MiB cell, {preset.small_ops} per 1 MiB cell; one op = "
        "write_pages + wait + release (notif=None) for ours/staged; peer = PeerProcess",
        f"ratios use the faster torch cell of each round (1 or {default_threads} intra-op "
        "threads); the torch cells of '1024x16K contig' are those of '16 MiB' (same bytes, "
        "same op)",
        f"{RAW_TX}: NIXL API calls on an agent configured as our transport's; {RAW}: the same "
        "calls on a plain agent (no progress thread); CMA: one process_vm_writev with the "
        "same iovecs" + ("" if cma else " (unavailable here)"),
        "µs per write (from the medians): " + "; ".join(per_write_us(c) for c in goal_cases),
        "every way of writing was checked byte-exact at the peer before timing",
    ]
    params: dict[str, JSONValue] = {
        "rounds": preset.rounds,
        "warmup_rounds": preset.warmup,
        "ops_per_16MiB_cell": preset.big_ops,
        "ops_per_1MiB_cell": preset.small_ops,
        "page_bytes": PAGE_BYTES,
        "default_torch_threads": default_threads,
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
    )


def run(quick: bool) -> BenchResult:
    """The ``--quick`` preset (4 rounds) or the full one (11 rounds)."""
    return measure(QUICK if quick else FULL)
