"""Benchmark ``two-hosts``: throughput over a shaped link vs the link's rate.

The decode peer runs in its own network namespace behind a veth pair (:mod:`stress.netns`),
UCX is restricted to TCP on the veth on both sides, and the link is shaped with ``tc tbf``
to each rate in turn (``unshaped`` = the veth as it is). Each cell is one
:meth:`sender.transport.NixlTransport.write_pages` of ``size`` bytes (64 KiB pages, one
contiguous descriptor), ``wait()`` and ``release()``, timed end to end; GB/s = 1e9 B/s.
Besides the median GB/s the table gives the link's rate in GB/s, their ratio, and the bytes
the host's veth end sent per payload byte (>= 1: the bytes really crossed the link;
headers make it a few per cent more).

The sender cannot switch its own UCX transports once NIXL is loaded, so the measurement
runs in a child process started with the link's environment; this process makes the
topology, always tears it down, and builds the report. Where a namespace cannot be made
(not root, no ``ip``/``tc``) the result is ``pending`` with the reason.

Goal (reported, never asserted): >= 0.8x the link's rate over a 1 Gbit/s link. At
10 Gbit/s the link is faster than UCX's TCP transport on this machine; the ratio says how
much of it is used.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench._harness import BenchResult, Cell, Goal, JSONValue, Ratio, median, pending_result
from sender import _nixl

NAME = "two-hosts"
TITLE = "GB/s of our writes over a tbf-shaped veth link (UCX over TCP) vs the link's rate"
PAGE_BYTES = 64 * 1024
GOAL_RATE_BIT = 1_000_000_000
GOAL_SHARE = 0.8
_ROOT = str(Path(__file__).resolve().parent.parent)
_CHILD_ENTRY = (
    "import sys; from bench.two_hosts import child_main; sys.exit(child_main(sys.argv[1:]))"
)
_RESULT_TAG = "TWO-HOSTS-BENCH "


@dataclass(frozen=True)
class Preset:
    """Effort: link rates (``None`` = unshaped), write sizes in bytes, timed rounds."""

    rates_bit: tuple[int | None, ...]
    sizes: tuple[int, ...]
    rounds: int
    warmup: int = 1

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Preset:
        data = json.loads(text)
        return cls(
            rates_bit=tuple(data["rates_bit"]),
            sizes=tuple(data["sizes"]),
            rounds=int(data["rounds"]),
            warmup=int(data["warmup"]),
        )


FULL = Preset(rates_bit=(1_000_000_000, 10_000_000_000, None), sizes=(1 << 20, 16 << 20), rounds=7)
QUICK = Preset(rates_bit=(1_000_000_000,), sizes=(4 << 20,), rounds=3)


def _rate_label(rate: int | None) -> str:
    if rate is None:
        return "unshaped"
    return f"{rate / 1e9:g} Gbit/s" if rate >= 1e9 else f"{rate / 1e6:g} Mbit/s"


def _label(rate: int | None, size: int) -> str:
    return f"{_rate_label(rate)} {size >> 20} MiB GB/s"


def measure(preset: Preset, timeout_s: float = 300.0) -> BenchResult:
    """Run the benchmark with an explicit preset (tests use tiny ones).

    Raises:
        RuntimeError: the child process failed (its stderr tail is in the message).
    """
    if not _nixl.AVAILABLE:
        return pending_result(NAME, TITLE, f"NIXL not importable: {_nixl.IMPORT_ERROR!r}")
    from stress.netns import child_env, two_host_link, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        return pending_result(NAME, TITLE, f"no two-host topology here: {reason}")
    with two_host_link() as link:
        cmd = [
            sys.executable,
            "-c",
            _CHILD_ENTRY,
            "--link",
            link.to_json(),
            "--preset",
            preset.to_json(),
        ]
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=child_env(link, path=[_ROOT]),
            stdin=subprocess.DEVNULL,
            check=False,
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"two-hosts bench child exited {proc.returncode}: {proc.stderr[-3000:]}")
    data: dict[str, Any] = json.loads(lines[-1][len(_RESULT_TAG) :])
    return _report(preset, data)


def _report(preset: Preset, data: dict[str, Any]) -> BenchResult:
    samples: dict[str, list[float]] = {k: list(v) for k, v in data["samples"].items()}
    wire: dict[str, float] = data["wire_per_payload"]
    columns = ["link", "size", "GB/s", "link GB/s", "of link", "wire/payload"]
    rows: list[dict[str, Cell]] = []
    ratios: list[Ratio] = []
    goal_share: float | None = None
    for rate in preset.rates_bit:
        for size in preset.sizes:
            label = _label(rate, size)
            gbps = median(samples[label])
            link_gbps = None if rate is None else rate / 8e9
            share = None if link_gbps is None else gbps / link_gbps
            rows.append(
                {
                    "link": _rate_label(rate),
                    "size": f"{size >> 20} MiB",
                    "GB/s": gbps,
                    "link GB/s": link_gbps,
                    "of link": share,
                    "wire/payload": wire.get(label),
                }
            )
            if share is not None:
                ratios.append(
                    Ratio(
                        f"{_rate_label(rate)} {size >> 20} MiB",
                        share,
                        "our GB/s / the link's rate (1.0 = the whole link)",
                    )
                )
            if rate == GOAL_RATE_BIT and share is not None:
                goal_share = share if goal_share is None else min(goal_share, share)
    goals = [
        Goal(
            f"throughput over a {_rate_label(GOAL_RATE_BIT)} link >= {GOAL_SHARE:g}x its rate",
            None if goal_share is None else goal_share >= GOAL_SHARE,
            "not measured"
            if goal_share is None
            else f"{goal_share:.2f}x (smallest over the sizes)",
        )
    ]
    notes = [
        "UCX_TLS=tcp on both sides, UCX_NET_DEVICES = each side's veth end; the peer is in "
        f"namespace {data.get('netns')}; bytes checked at the peer before timing "
        f"({data.get('verified')})",
    ]
    params: dict[str, JSONValue] = {
        "rates_bit": list(preset.rates_bit),
        "sizes": list(preset.sizes),
        "rounds": preset.rounds,
        "warmup": preset.warmup,
        "page_bytes": PAGE_BYTES,
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
        extra={"wire_per_payload": dict(wire)},
        ratios_in_table=True,
    )


def run(quick: bool) -> BenchResult:
    """The ``--quick`` preset (1 Gbit/s, 4 MiB, 3 rounds) or the full one."""
    return measure(QUICK if quick else FULL)


# --------------------------------------------------------------------------- child side


def child_main(argv: Sequence[str]) -> int:
    """The sender child: time writes over the link at each rate; prints one result line."""
    ap = argparse.ArgumentParser(prog="two-hosts bench child")
    ap.add_argument("--link", required=True)
    ap.add_argument("--preset", required=True)
    args = ap.parse_args(list(argv))
    import numpy as np
    import torch

    from sender.transport import NixlTransport
    from stress.harness.peer import PeerProcess, page_digest_bytes
    from stress.netns import TwoHostLink

    link = TwoHostLink.from_json(args.link)
    preset = Preset.from_json(args.preset)
    pages = max(preset.sizes) // PAGE_BYTES
    gen = torch.Generator().manual_seed(11)
    kv = torch.randint(0, 256, (pages, PAGE_BYTES), dtype=torch.uint8, generator=gen)
    samples: dict[str, list[float]] = {}
    wire: dict[str, float] = {}
    with (
        PeerProcess(
            pages,
            PAGE_BYTES,
            name="bench-2h",
            stderr=subprocess.DEVNULL,
            netns=link.netns,
            host=link.peer_addr,
            env=link.peer_env(),
        ) as peer,
        NixlTransport("bench-2h-prefill") as tx,
    ):
        tx.register_region("kv", kv, PAGE_BYTES)
        tx.add_peer("peer", peer.metadata)
        x = tx.write_pages("peer", np.arange(pages), np.arange(pages), timeout_s=120)
        x.wait(120)
        x.release()
        want = [page_digest_bytes(kv[p].numpy().tobytes()) for p in range(pages)]
        verified = peer.page_digest(range(pages)) == want
        if not verified:
            raise RuntimeError("the bytes at the peer differ from the ones sent")
        for rate in preset.rates_bit:
            if rate is None:
                link.unshape()
            else:
                link.shape(rate)
            for size in preset.sizes:
                n = size // PAGE_BYTES
                label = _label(rate, size)
                got: list[float] = []
                sent = 0
                for r in range(preset.warmup + preset.rounds):
                    before = link.counters()
                    t0 = time.perf_counter()
                    x = tx.write_pages("peer", np.arange(n), np.arange(n), timeout_s=120)
                    x.wait(120)
                    x.release()
                    dt = time.perf_counter() - t0
                    if r >= preset.warmup:
                        got.append(size / dt / 1e9)
                        sent += link.counters().minus(before).tx_bytes
                samples[label] = got
                wire[label] = round(sent / (size * preset.rounds), 4)
    result = {
        "samples": samples,
        "wire_per_payload": wire,
        "netns": link.netns,
        "verified": verified,
    }
    sys.stdout.write(_RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0
