"""Bad input to the sender, manager, transport and decode peer (issue: adoptable by an
engine, section 4): each gets a clear TypeError/ValueError (TransportParamError for
metadata), before any state changes. Real NIXL agents on loopback."""

from __future__ import annotations

import json
import math
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from sender.errors import KVTransferError, TransportParamError
from sender.manager import KVManager, make_transfer_info
from sender.nixl_sender import NixlKVSender
from sender.poll import KVPoll
from sender.transport import NixlTransport, decode_metadata
from tests.fixtures_nixl import NUM_PAGES, PAGE_BYTES, requires_nixl

pytestmark = [pytest.mark.nixl, requires_nixl, pytest.mark.timeout(60)]

SESSION = "d0"


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[NixlTransport, NixlTransport, torch.Tensor]]:
    kv = torch.randint(0, 256, (NUM_PAGES, PAGE_BYTES), dtype=torch.uint8)
    dst = torch.zeros((NUM_PAGES, PAGE_BYTES), dtype=torch.uint8)
    with NixlTransport("bad-input-tx") as tx, NixlTransport("bad-input-rx") as rx:
        tx.register_region("kv", kv, PAGE_BYTES)
        rx.register_region("kv", dst, PAGE_BYTES)
        tx.add_peer(SESSION, rx.metadata())
        yield tx, rx, kv


@pytest.fixture
def mgr(pair: tuple[NixlTransport, NixlTransport, torch.Tensor]) -> Iterator[KVManager]:
    tx, _, kv = pair
    with KVManager(tx, kv, num_workers=1) as m:
        yield m


def _wait(s: NixlKVSender, timeout_s: float = 10.0) -> KVPoll:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = s.poll()
        if st in (KVPoll.Success, KVPoll.Failed):
            return st
        time.sleep(0.001)
    raise AssertionError("room did not conclude")


def test_float_and_bool_destination_pages_are_refused() -> None:
    for pages in ([1.7, 2.2], [True, False], torch.tensor([1.0, 2.0]).numpy()):
        with pytest.raises(TypeError, match="dst_pages must hold ints"):
            make_transfer_info(SESSION, pages)  # type: ignore[arg-type]
    assert list(make_transfer_info(SESSION, [3, 4]).dst_pages) == [3, 4]


def test_infos_not_made_by_make_transfer_info_are_checked_again(mgr: KVManager) -> None:
    """add_transfer_info takes an info made by make_transfer_info as it is (no second
    check), but one built directly or copied with dataclasses.replace is checked again."""
    import dataclasses

    import numpy as np

    from sender.manager import TransferInfo

    good = make_transfer_info(SESSION, [1, 2, 3])
    forged = [
        dataclasses.replace(good, dst_pages=np.array([-1, 2, 3])),
        TransferInfo(SESSION, np.array([1.5, 2.0])),  # type: ignore[arg-type]
        dataclasses.replace(good, decode_prefix_len=-1),
    ]
    for i, info in enumerate(forged):
        s = NixlKVSender(mgr, 100 + i, [SESSION])
        with pytest.raises((TypeError, ValueError)):
            s.kv_mgr.add_transfer_info(s._handle, info)
        s.clear()
    s = NixlKVSender(mgr, 110, [SESSION], [good])
    s.init(3)
    s.send([4, 5, 6])
    assert _wait(s) is KVPoll.Success
    s.clear()


def test_a_str_as_session_ids_is_refused(mgr: KVManager) -> None:
    for bad in ("ab", "decode-0", b"d0"):
        with pytest.raises(TypeError, match="sequence of session id strings"):
            NixlKVSender(mgr, 1, bad)  # type: ignore[arg-type]
    assert mgr.stats().open_rooms == 0 and mgr.footprint(1) == ()


def test_failure_exception_on_a_success_room_says_so(mgr: KVManager) -> None:
    s = NixlKVSender(mgr, 2, [SESSION], [make_transfer_info(SESSION, range(2))])
    s.init(2)
    s.send([0, 1])
    assert _wait(s) is KVPoll.Success
    with pytest.raises(KVTransferError, match="succeeded") as info:
        s.failure_exception()
    assert not info.value.is_from_another_rank
    assert s.poll() is KVPoll.Success  # what poll() reported is not rewritten
    assert mgr.wait_drained(None, 5) and mgr.footprint(2) == ()


def test_failure_exception_after_an_early_clear_says_so(mgr: KVManager) -> None:
    s = NixlKVSender(mgr, 3, [SESSION], [make_transfer_info(SESSION, range(2))])
    s.clear()
    with pytest.raises(KVTransferError, match="cleared before") as info:
        s.failure_exception()
    assert not info.value.is_from_another_rank


def test_an_empty_chunk_is_refused_unless_it_is_the_last(mgr: KVManager) -> None:
    s = NixlKVSender(mgr, 4, [SESSION], [make_transfer_info(SESSION, range(2))])
    s.init(2)
    with pytest.raises(ValueError, match="empty chunk"):
        s.send([])
    assert mgr.stats().chunks_submitted == 0  # no chunk index used up, nothing queued
    s.send([0, 1])
    assert _wait(s) is KVPoll.Success
    s.clear()
    empty = NixlKVSender(mgr, 5, [SESSION], [make_transfer_info(SESSION, range(2))])
    empty.init(0)
    empty.send([])  # a room of 0 pages: the empty chunk is its last
    assert _wait(empty) is KVPoll.Success
    empty.clear()


@pytest.mark.parametrize(
    ("kw", "exc"),
    [
        ({"transfer_timeout_s": 0}, ValueError),
        ({"transfer_timeout_s": math.nan}, ValueError),
        ({"transfer_timeout_s": 10**400}, ValueError),
        ({"transfer_timeout_s": "5"}, TypeError),
        ({"slot_timeout_s": -1}, ValueError),
        ({"poll_interval_s": True}, TypeError),
    ],
)
def test_manager_arguments_are_named_in_errors(
    pair: tuple[NixlTransport, NixlTransport, torch.Tensor], kw: dict[str, Any], exc: type
) -> None:
    tx, _, kv = pair
    with pytest.raises(exc, match=next(iter(kw))):
        KVManager(tx, kv, num_workers=0, **kw)


def _metadata(header: bytes, blob: bytes = b"x") -> bytes:
    return b"NXSTG\x01" + struct.pack(">I", len(header)) + header + blob


def _region(**over: Any) -> dict[str, Any]:
    r = {"name": "kv", "base_addr": 4096, "nbytes": 8192, "page_bytes": 4096,
         "num_pages": 2, "mem_type": "DRAM", "device_id": 0}
    r.update(over)
    return r


def test_hostile_metadata_gives_transport_param_errors() -> None:
    deep = b'{"agent":"a","regions":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    huge = b'{"agent":"a","regions":[],"n":' + b"9" * 5000 + b"}"
    two = json.dumps({"agent": "a", "regions": [_region(), _region()]}).encode()
    for header, match in [
        (deep, "bad metadata header"),
        (huge, "bad metadata header"),
        (two, "twice"),
        (json.dumps({"agent": "a", "regions": [_region(base_addr=2**63)]}).encode(), "range"),
        (json.dumps({"agent": "a", "regions": [_region(base_addr=2**63 - 4096)]}).encode(),
         "range"),
        (json.dumps({"agent": "a", "regions": [_region(device_id=2**63)]}).encode(), "range"),
    ]:
        with pytest.raises(TransportParamError, match=match):
            decode_metadata(_metadata(header))
    ok = json.dumps({"agent": "a", "regions": [_region()]}).encode()
    assert decode_metadata(_metadata(ok)).regions["kv"].num_pages == 2


def test_add_peer_with_a_mismatched_agent_name_unloads_the_agent(
    pair: tuple[NixlTransport, NixlTransport, torch.Tensor],
) -> None:
    _, rx, _ = pair
    real = decode_metadata(rx.metadata())
    lying = json.dumps(
        {"agent": "someone-else", "regions": [r.to_json() for r in real.regions.values()]}
    ).encode()
    with NixlTransport("bad-input-tx2") as tx2:
        with pytest.raises(TransportParamError, match="NIXL loaded"):
            tx2.add_peer("s", _metadata(lying, real.agent_blob))
        # The remote agent NIXL loaded for the failed call is unloaded again.
        assert not tx2._agent.check_remote_metadata(real.agent_name)
        tx2.add_peer("s", rx.metadata())
        assert tx2._agent.check_remote_metadata(real.agent_name)
        assert tx2.has_peer("s")


def test_write_and_wait_arguments(pair: tuple[NixlTransport, NixlTransport, torch.Tensor]) -> None:
    tx, _, _ = pair
    with pytest.raises(TransportParamError, match="too large"):
        tx.write_pages(SESSION, [0], [0], timeout_s=10**400)
    x = tx.write_pages(SESSION, [0], [0])
    try:
        with pytest.raises(ValueError, match="timeout_s"):
            x.wait(timeout_s=math.nan)
        with pytest.raises(ValueError, match="interval_s"):
            x.wait(5, interval_s=-1)
        with pytest.raises(TypeError, match="timeout_s"):
            x.wait(timeout_s="1")  # type: ignore[arg-type]
        x.wait(5)
    finally:
        x.release()


def _peer_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run ``python -m stress.harness.peer``'s entry point in-process (argument errors exit before
    anything starts); returns (exit status, stdout, stderr)."""
    from stress.harness.peer import main

    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


def test_peer_cli_bad_arguments_give_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for args, match in [
        (("--pages", "0", "--page-bytes", "4096"), "--pages: must be >= 1"),
        (("--pages", "4", "--page-bytes", "x"), "--page-bytes: not an integer"),
        (("--pages", "4", "--page-bytes", "4096", "--listen", "127.0.0.1:x"), "bad port"),
    ]:
        code, _, err = _peer_cli(capsys, *args)
        assert code == 2 and "Traceback" not in err and match in err, err
    if not torch.cuda.is_available():
        code, _, err = _peer_cli(capsys, "--pages", "4", "--page-bytes", "4096", "--device", "cuda")
        assert code == 2 and "--device 'cuda' is not usable here" in err, err
    code, out, _ = _peer_cli(capsys, "--help")
    help_text = " ".join(out.split())
    assert code == 0
    assert "LISTENING 127.0.0.1:<port>" in help_text and "(default: cpu)" in help_text


def test_integer_like_room_ids_are_accepted_as_plain_ints(mgr: KVManager) -> None:
    """THREADING.md, "Key types": KVManager and NixlKVSender take what ``operator.index``
    takes (``numpy.int64``), as StagingContext does, and use the plain ``int``; never a
    ``bool``, never 2**63 or more."""
    import numpy as np

    s = NixlKVSender(mgr, np.int64(120), [SESSION], [make_transfer_info(SESSION, range(2))])
    assert s.handle.room == 120 and type(s.handle.room) is int
    assert mgr.status(np.int64(120)) is not None and mgr.footprint(np.int32(120))
    s.init(np.int64(2))
    s.send([7, 8])
    assert _wait(s) is KVPoll.Success
    s.clear()
    for bad, exc in ((True, TypeError), (np.uint64(2**63), ValueError)):
        with pytest.raises(exc):
            NixlKVSender(mgr, bad, [SESSION])
