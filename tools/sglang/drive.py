"""Drive upstream SGLang's own staging code with threads, as its prefill side runs it.

What runs is upstream's, from the installed wheel, with or without our plugin:

* :func:`load` imports the disaggregation modules, records the released objects the plugin
  hooks (so that "plugin off" can be put back for a run, side by side), and then calls
  SGLang's own ``load_plugins()``, which finds our installed wheel's entry point and applies
  its hooks ("plugin on" is what that leaves; nothing of ours patches upstream code);
* the scheduler's prefetch, ``NixlKVManager._prefetch_staging_reqs(room)`` (which calls the
  shared helper ``prefetch_staging_reqs`` and sends real ``STAGING_REQ`` messages over a real
  ZeroMQ PUSH socket that upstream opens itself, to a PULL socket of ours on loopback);
* the sender's constructor, ``clear()`` and ``failure_exception()`` (``NixlKVSender``, or
  ``CommonKVSender`` where the release moved them);
* the transfer worker's room clean-up: the ``if`` block of ``NixlKVManager.transfer_worker``
  that drops a finished room from the two sets, lifted out of that function as released by
  :func:`tools.sglang.adopt.purge_block` (the plugin does not change it; the rest of
  ``transfer_worker`` -- NIXL posting, status bookkeeping -- is not run: it needs GPUs and a
  decode peer).

What is ours: the managers are made with ``__new__`` and given only the attributes that
code reads (as upstream's own unit test does), request ids, the threads and queues that play
scheduler and workers, and the runtime configuration: ``get_schedule()`` in the NIXL module
is replaced by one that answers ``chunked_prefill_size`` and ``get_parallel()`` in the common
module by one with a single data-parallel rank (SGLang publishes both from its server
arguments at launch; nothing else of them is read here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import logging
import queue
import random
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

from tools.sglang import adopt

SESSION = "decode-0"  # the decode agent's name: the session id of every staging key
PAGE_SIZE = 16
CHUNK_TOKENS = 64  # chunked_prefill_size: 4 pages per staging chunk
CHUNKS = 4
PAGES = CHUNKS * CHUNK_TOKENS // PAGE_SIZE
JOIN_S = 60.0


@dataclasses.dataclass
class Upstream:
    """The installed release's modules and classes, after SGLang's ``load_plugins()``."""

    version: str
    conn: types.ModuleType  # sglang.srt.disaggregation.nixl.conn
    common: types.ModuleType  # sglang.srt.disaggregation.common.conn
    handler: types.ModuleType  # sglang.srt.disaggregation.common.staging_handler
    kv_poll: Any
    # (owner, attribute, released value) of every object the plugin's table hooks for this
    # release, recorded before load_plugins() ran; empty for a release the plugin lacks.
    released: list[tuple[Any, str, Any]] = dataclasses.field(default_factory=list)
    released_staging_class: type | None = None
    released_decode_class: type | None = None  # the decode staging dataclass as released
    plugin_log: list[logging.LogRecord] = dataclasses.field(default_factory=list)

    @property
    def staging_class(self) -> type:
        """The prefill staging class in effect (the plugin's, once it applied)."""
        return self.handler.PrefillStagingContext  # type: ignore[no-any-return]

    @property
    def decode_class(self) -> type:
        """The decode staging class in effect (the plugin's, once it applied)."""
        return self.handler.DecodeStagingContext  # type: ignore[no-any-return]


class _Collect(logging.Handler):
    def __init__(self, into: list[logging.LogRecord]) -> None:
        super().__init__(logging.DEBUG)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record)


def load(*, plugins: bool = True) -> Upstream:
    """Import the installed SGLang's disaggregation modules (20-60 s on 2 cores), record
    the released objects the plugin hooks, then (``plugins``) run SGLang's own
    ``load_plugins()``, collecting what the ``staging.sglang`` logger says.

    Raises:
        ImportError: SGLang (or a package of its import chain) is not installed.
    """
    from staging.sglang import plugin as ours
    from staging.sglang.releases import RELEASES

    sglang = importlib.import_module("sglang")
    conn = importlib.import_module("sglang.srt.disaggregation.nixl.conn")
    common = importlib.import_module("sglang.srt.disaggregation.common.conn")
    handler = importlib.import_module("sglang.srt.disaggregation.common.staging_handler")
    base = importlib.import_module("sglang.srt.disaggregation.base.conn")
    up = Upstream(sglang.__version__, conn, common, handler, base.KVPoll)
    up.released_staging_class = handler.PrefillStagingContext
    up.released_decode_class = handler.DecodeStagingContext
    for target in RELEASES.get(up.version, ()):
        if target.hook is None or target.hook_type == "REPLACE":
            continue
        owner_path, attr = target.path.rsplit(".", 1)
        owner = importlib.import_module(owner_path.rsplit(".", 1)[0])
        owner = getattr(owner, owner_path.rsplit(".", 1)[1])
        up.released.append((owner, attr, owner.__dict__[attr]))
    if plugins:
        logger = logging.getLogger(ours.LOG.name)
        handler_ = _Collect(up.plugin_log)
        logger.addHandler(handler_)
        level = logger.level
        logger.setLevel(logging.DEBUG)
        try:
            importlib.import_module("sglang.srt.plugins").load_plugins()
        finally:
            logger.removeHandler(handler_)
            logger.setLevel(level)
    return up


# ---------------------------------------------------------------------- plugin on / off


@dataclasses.dataclass
class Adoption:
    """One configuration: the plugin on (what ``load_plugins()`` left) or off (the released
    objects put back for the run by :func:`installed`)."""

    name: str
    staging_class: type
    clear: Callable[[Any], Any]  # clears a sender as the configuration's code does
    worker_block: Callable[[Any, int], None]
    restore: list[tuple[Any, str, Any]]  # what installed() puts in place

    @property
    def plugin(self) -> bool:
        return not self.restore


def adoption(up: Upstream, *, plugin: bool, staging_class: type | None = None) -> Adoption:
    """The configuration ``plugin`` on or off (``staging_class``: another class to make the
    contexts with, e.g. the plugin's class under the released ``clear()``).

    Raises:
        AdoptionError: the release's worker has not the expected clean-up block.
    """
    block, _ = adopt.purge_block(
        up.conn.NixlKVManager.transfer_worker, ("self", "room"), adopted=False
    )
    if plugin:
        return Adoption("plugin on", staging_class or up.staging_class, _clear, block, [])
    assert up.released_staging_class is not None
    restore = list(up.released)
    for module in (up.handler, up.conn, up.common):
        if getattr(module, "PrefillStagingContext", None) is not None:
            restore.append((module, "PrefillStagingContext", up.released_staging_class))
    cls = staging_class or up.released_staging_class
    return Adoption("plugin off", cls, _clear, block, restore)


def _clear(sender: Any) -> Any:
    return sender.clear()


@contextlib.contextmanager
def installed(up: Upstream, how: Adoption) -> Iterator[None]:
    """Put ``how.restore`` in place (the released objects, for "plugin off"); restore on
    exit. Nothing for "plugin on"."""
    missing = object()
    saved: list[tuple[Any, str, Any]] = []
    try:
        for obj, name, value in how.restore:
            vars_ = obj.__dict__ if isinstance(obj, type) else vars(obj)
            saved.append((obj, name, vars_.get(name, missing)))
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            if value is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


@contextlib.contextmanager
def schedule_config(up: Upstream) -> Iterator[None]:
    """``get_schedule()`` of the NIXL module answers ``chunked_prefill_size``, and
    ``get_parallel()`` of the common module one data-parallel rank (restored)."""
    module: Any = up.conn
    common: Any = up.common
    original = module.get_schedule
    original_parallel = getattr(common, "get_parallel", None)
    config = types.SimpleNamespace(chunked_prefill_size=CHUNK_TOKENS)
    parallel = types.SimpleNamespace(num_dp_ranks=1, dp_size=1)
    module.get_schedule = lambda: config
    if original_parallel is not None:
        common.get_parallel = lambda: parallel
    try:
        yield
    finally:
        module.get_schedule = original
        if original_parallel is not None:
            common.get_parallel = original_parallel


# ---------------------------------------------------------------------- the decode side's socket


class StagingRequests:
    """A ZeroMQ PULL socket on loopback standing in for the decode side's staging listener:
    counts the ``STAGING_REQ`` messages upstream sends, per room."""

    def __init__(self) -> None:
        zmq = importlib.import_module("zmq")
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port: int = self._sock.bind_to_random_port("tcp://127.0.0.1")
        # Upstream opens its PUSH socket into this dict on first use; it is shared by every
        # run so that one socket (and one ZeroMQ context of upstream's) serves them all.
        self.sockets: dict[str, Any] = {}

    def drain(self, settle_s: float = 2.0) -> dict[int, int]:
        """Receive everything sent so far (waiting up to ``settle_s`` for a quiet socket);
        messages per room."""
        per_room: dict[int, int] = {}
        deadline = time.monotonic() + settle_s
        while True:
            if self._sock.poll(20):
                frames = self._sock.recv_multipart()
                if frames[0] == b"STAGING_REQ":
                    room = int(frames[1])
                    per_room[room] = per_room.get(room, 0) + 1
                deadline = time.monotonic() + 0.05  # keep draining while messages come
            elif time.monotonic() >= deadline:
                return per_room

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(linger=0)
            sock.context.term()
        self.sockets.clear()
        self._sock.close(linger=0)
        self._ctx.term()


# ---------------------------------------------------------------------- one prefill side


class Prefill:
    """One prefill manager over one staging context, with upstream's methods."""

    def __init__(self, up: Upstream, how: Adoption, sink: StagingRequests) -> None:
        self.up, self.how, self.sink = up, how, sink
        conn = up.conn
        mgr = conn.NixlKVManager.__new__(conn.NixlKVManager)
        staging = how.staging_class()
        staging.prefetch_sockets = sink.sockets
        attrs: dict[str, Any] = {
            "enable_staging": True,
            "_staging_ctx": staging,
            "kv_buffer_tensors": {"page_size": PAGE_SIZE},
            "transfer_infos": {},
            "decode_kv_args_table": {SESSION: _register_info(conn, decode_tp_size=2)},
            "attn_tp_size": 1,
            "request_status": {},
            "req_to_decode_prefix_len": {},
            "exceptions": {},
            "failure_records": {},
            "failure_lock": threading.Lock(),
            "_staging_outstanding": {},
            "_deferred_ack_targets": {},
            "_deferred_ack_poisoned_rooms": set(),
            "deferred_bootstrap": None,
            "disaggregation_mode": _prefill_mode(up),
            "is_dummy_cp_rank": False,
            "sender_trace_module": None,
            "attn_dp_rank": 0,
        }
        for name, value in attrs.items():
            setattr(mgr, name, value)
        self.mgr = mgr
        self.staging = staging

    def admit(self, room: int) -> Any:
        """A new request, its sender made with ``__new__`` (its constructor skipped; see
        :meth:`construct` for the real one): the decode side's transfer info arrives (the
        bootstrap thread's part) and the scheduler's sender exists. Returns the sender."""
        conn = self.up.conn
        self._transfer_info(room)
        self.mgr.request_status[room] = self.up.kv_poll.WaitingForInput
        self.mgr.req_to_decode_prefix_len[room] = 0
        sender = conn.NixlKVSender.__new__(conn.NixlKVSender)
        for name, value in {
            "kv_mgr": self.mgr,
            "bootstrap_room": room,
            "bootstrap_server_url": "127.0.0.1:0",
            "conclude_state": None,
            "_send_failed": False,
            "_send_error": None,
            "_owns_bootstrap_room": True,
        }.items():
            setattr(sender, name, value)
        trace = getattr(self.up.common, "TraceNullContext", None)
        if trace is not None:
            sender.trace_ctx = trace()
        return sender

    def construct(self, room: int) -> Any:
        """A sender made by upstream's own constructor (``NixlKVSender(mgr, ...)``, through
        ``CommonKVSender.__init__`` and whatever the plugin hooked there), as the scheduler
        makes one for a new request; the decode side's transfer info is then registered as
        :meth:`admit` does. Call with :func:`schedule_config` in effect."""
        conn = self.up.conn
        params = inspect.signature(conn.NixlKVSender.__init__).parameters
        kwargs: dict[str, Any] = {}
        if "dest_tp_ranks" in params:
            kwargs["dest_tp_ranks"] = [0]
        if "pp_rank" in params:
            kwargs["pp_rank"] = 0
        sender = conn.NixlKVSender(self.mgr, "127.0.0.1:0", room, **kwargs)
        self._transfer_info(room)
        return sender

    def _transfer_info(self, room: int) -> None:
        import numpy as np

        self.mgr.transfer_infos[room] = {
            SESSION: self.up.conn.TransferInfo(
                room=room,
                endpoint="127.0.0.1",
                dst_port=self.sink.port,
                agent_name=SESSION,
                dst_kv_indices=np.arange(PAGES, dtype=np.int32),
                dst_aux_index=0,
                required_dst_info_num=1,
                dst_state_indices=[],
            )
        }

    def prefetch(self, room: int) -> None:
        """Upstream's scheduler prefetch for the room."""
        self.mgr._prefetch_staging_reqs(room)

    def send_chunk(self, room: int) -> Any:
        """Upstream's ``add_transfer_request`` for a (non-last) chunk of the room, as the
        sender's ``send()`` makes it: its first act is the staging prefetch; for a room
        that is no longer in ``transfer_infos`` it then returns without queueing."""
        import numpy as np

        fn = self.mgr.add_transfer_request
        kwargs: dict[str, Any] = {
            "bootstrap_room": room,
            "kv_indices": np.arange(PAGES, dtype=np.int32),
            "index_slice": slice(0, PAGES),
            "is_last_chunk": False,
        }
        if "chunk_id" in inspect.signature(fn).parameters:
            kwargs["chunk_id"] = 0
        return fn(**kwargs)

    def worker_cleanup(self, room: int) -> None:
        """Upstream's worker clean-up block for a finished room (as configured)."""
        self.how.worker_block(self.mgr, room)

    @property
    def compat(self) -> Any:
        """The :class:`~staging.compat.CompatStagingContext` behind the staging object
        (itself, for the subclass route; its ``staging`` field, for composition), or
        ``None`` for upstream's bare sets."""
        from staging.compat import CompatStagingContext

        for ctx in (self.staging, getattr(self.staging, "staging", None)):
            if isinstance(ctx, CompatStagingContext):
                return ctx
        return None

    def staged(self) -> frozenset[tuple[int, int, str]]:
        return frozenset(self.staging.prefetch_requested)

    def marked(self) -> frozenset[int]:
        return frozenset(self.staging.prefetched_rooms)


def _prefill_mode(up: Upstream) -> Any:
    utils = importlib.import_module("sglang.srt.disaggregation.utils")
    return utils.DisaggregationMode.PREFILL


def _register_info(conn: types.ModuleType, **values: Any) -> Any:
    """A ``KVArgsRegisterInfo`` with ``values`` and every other required field ``None``
    (only ``decode_tp_size`` is read by the code driven here)."""
    cls = conn.KVArgsRegisterInfo
    required = {
        f.name: None
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    return cls(**{**required, **values})


# ---------------------------------------------------------------------- the threaded run


@dataclasses.dataclass
class RaceCounts:
    """What one configuration showed over all its runs."""

    runs: int = 0
    runs_with_changed_size: int = 0
    clear_calls_raised: int = 0
    runs_with_resurrected: int = 0
    resurrected_rooms: int = 0
    runs_with_lost_keys: int = 0
    lost_keys: int = 0
    other_errors: list[str] = dataclasses.field(default_factory=list)

    def merge(self, changed: int, resurrected: int, lost: int, errors: list[str]) -> None:
        self.runs += 1
        self.clear_calls_raised += changed
        self.runs_with_changed_size += changed > 0
        self.resurrected_rooms += resurrected
        self.runs_with_resurrected += resurrected > 0
        self.lost_keys += lost
        self.runs_with_lost_keys += lost > 0
        self.other_errors.extend(errors)

    def line(self) -> str:
        return (
            f"{self.runs} runs (seeds 0..{self.runs - 1}): 'Set changed size' in "
            f"{self.runs_with_changed_size} runs "
            f"({self.clear_calls_raised} clear() calls raised); resurrected rooms in "
            f"{self.runs_with_resurrected} runs ({self.resurrected_rooms} rooms); lost keys in "
            f"{self.runs_with_lost_keys} runs ({self.lost_keys} keys); other errors "
            f"{len(self.other_errors)}"
        )


def race_run(
    up: Upstream,
    how: Adoption,
    sink: StagingRequests,
    seed: int,
    *,
    rooms: int = 64,
    background: int = 256,
    workers: int = 4,
) -> tuple[int, int, int, list[str]]:
    """One run: ``background`` live rooms prefetched first; then a scheduler thread admits
    and prefetches ``rooms`` requests (upstream's ``_prefetch_staging_reqs``) and hands
    their chunks to ``workers`` worker threads (each room to one worker, as upstream shards
    by destination); the worker that finishes a room's last chunk runs upstream's clean-up
    block and reports the room done; the scheduler calls upstream's ``clear()`` on every
    done room as it learns of it, while it keeps admitting.

    Returns ``(clear() calls that raised "Set changed size", finished rooms with state left
    at the end, background keys missing at the end, other errors)``. Call with
    :func:`installed` and :func:`schedule_config` in effect.
    """
    rng = random.Random(seed)
    side = Prefill(up, how, sink)
    ids = rng.sample(range(1, 2**63), rooms + background)
    live, doomed = ids[:background], ids[background:]
    for room in live:
        side.admit(room)
        side.prefetch(room)
    live_keys = side.staged()
    work: list[queue.SimpleQueue[int | None]] = [queue.SimpleQueue() for _ in range(workers)]
    done: queue.SimpleQueue[int] = queue.SimpleQueue()
    errors: list[str] = []
    changed = 0
    senders: dict[int, Any] = {}

    def scheduler() -> None:
        nonlocal changed

        def clear_done(block: bool) -> None:
            nonlocal changed
            while True:
                try:
                    room = done.get(timeout=JOIN_S) if block else done.get_nowait()
                except queue.Empty:
                    return
                try:
                    senders.pop(room).clear()
                except RuntimeError as exc:
                    if "changed size during iteration" not in str(exc):
                        raise
                    changed += 1
                if block:
                    return

        for room in doomed:
            senders[room] = side.admit(room)
            side.prefetch(room)
            for chunk in range(CHUNKS):
                work[room % workers].put(room if chunk == CHUNKS - 1 else -1)
            clear_done(block=False)
        while senders:
            clear_done(block=True)

    def worker(index: int) -> None:
        while True:
            room = work[index].get(timeout=JOIN_S)
            if room is None:
                return
            if room >= 0:  # the room's last chunk
                side.worker_cleanup(room)
                done.put(room)

    def guarded(fn: Callable[..., None], *args: Any) -> Callable[[], None]:
        def run() -> None:
            try:
                fn(*args)
            except BaseException as exc:  # reported by the caller
                errors.append(f"{threading.current_thread().name}: {exc!r}")

        return run

    threads = [threading.Thread(target=guarded(scheduler), name="scheduler", daemon=True)]
    threads += [
        threading.Thread(target=guarded(worker, i), name=f"worker-{i}", daemon=True)
        for i in range(workers)
    ]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        threads[0].join(JOIN_S)
    finally:
        for q in work:
            q.put(None)
        deadline = time.monotonic() + JOIN_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        sys.setswitchinterval(old)
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        errors.append(f"threads still alive after {JOIN_S} s: {alive}")
    keys, marked = side.staged(), side.marked()
    finished = set(doomed)
    left = {k[0] for k in keys if k[0] in finished} | (marked & finished)
    lost = len(live_keys - keys)
    return changed, len(left), lost, errors
