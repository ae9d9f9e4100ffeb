"""``python -m bench [NAMES ...] [--quick] [--two-hosts] [--json PATH] [--plot DIR] [--list]``.

A benchmark that changes this host's network (``two-hosts``: network namespaces, veth pairs,
``tc`` shaping; needs root) runs only when it is named or ``--two-hosts`` is given; ``make
bench`` and ``make bench-quick`` pass it.

Prints the environment once, then each benchmark's table of medians, its ratios and its goal
lines, then a one-line-per-benchmark summary. ``--plot DIR`` draws the pictures of
:mod:`bench.plots` (the ``plots`` extra: without matplotlib it fails at once, in one line).
Exit status: 0 when every selected benchmark ran (whether or not its goals were met: speed
is reported, never asserted), 1 when one raised, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from bench import plots as bench_plots
from bench._harness import BenchResult, JSONValue
from bench._registry import BENCHMARKS, BY_NAME, BenchSpec
from stress import plots
from stress.environment import environment, format_environment


def _parser() -> argparse.ArgumentParser:
    names = ", ".join(spec.name for spec in BENCHMARKS)
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="nixl-staging benchmarks: medians of interleaved rounds; report only.",
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run ({names})")
    parser.add_argument("--quick", action="store_true", help="short preset (< 1 min in all)")
    parser.add_argument(
        "--two-hosts", action="store_true",
        help="also run the benchmarks that change this host's network (two-hosts: network "
        "namespaces, veth pairs, tc shaping; needs root); naming one runs it too",
    )  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="also write all results as JSON here")
    parser.add_argument(
        "--plot", metavar="DIR",
        help="also draw PNG pictures into DIR (curves: per-room cost curves; throughput: "
        "GB/s and CPU per GB by way of writing); needs the 'plots' extra (matplotlib)",
    )  # fmt: skip
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    return parser


def _select(
    parser: argparse.ArgumentParser, names: Sequence[str], two_hosts: bool = False
) -> list[BenchSpec]:
    """The benchmarks to run, in registry order for none named. One that changes the host's
    network is left out unless named or ``two_hosts``."""
    if not names:
        return [spec for spec in BENCHMARKS if two_hosts or not spec.host_network]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; known: {list(BY_NAME)}")
    chosen = [BY_NAME[n] for n in dict.fromkeys(names)]
    if two_hosts:
        chosen += [s for s in BENCHMARKS if s.host_network and s not in chosen]
    return chosen


def _run_one(spec: BenchSpec, quick: bool, out: TextIO) -> BenchResult:
    print(f"\n=== {spec.name}: {spec.summary}", file=out, flush=True)
    started = time.perf_counter()
    try:
        result = spec.load()(quick)
    except Exception:
        text = traceback.format_exc()
        print(text, file=out, flush=True)
        result = BenchResult(
            name=spec.name, title=spec.summary, status="error", notes=[text.strip()]
        )
    result.elapsed_s = time.perf_counter() - started
    if result.status != "error":
        rendered = result.render()
        if rendered:
            print(rendered, file=out)
    print(f"({spec.name}: {result.status}, {result.elapsed_s:.1f} s)", file=out, flush=True)
    return result


def _summary(results: Sequence[BenchResult]) -> str:
    lines = ["=== summary"]
    width = max(len(r.name) for r in results)
    for r in results:
        if r.status != "ok":
            lines.append(f"  {r.name:<{width}}  {r.status}")
            continue
        verdicts = ", ".join(g.verdict for g in r.goals) or "no goal"
        lines.append(f"  {r.name:<{width}}  goals: {verdicts}  ({r.elapsed_s:.1f} s)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the selected benchmarks; see the module docstring for the exit status."""
    stream = sys.stdout if out is None else out
    # NIXL prints INFO lines to stdout on import; the pending benchmarks will import it.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list:
        for spec in BENCHMARKS:
            print(f"{spec.name:<16} {spec.summary}", file=stream)
        return 0
    specs = _select(parser, args.names, args.two_hosts)
    if args.plot is not None:
        why_not = plots.unavailable()
        if why_not is not None:
            parser.exit(2, f"{parser.prog}: error: {why_not}\n")
    quick = bool(args.quick)
    env = environment()
    mode = "quick" if quick else "full"
    print(
        f"nixl-staging benchmarks ({mode}): tables show medians of interleaved rounds; "
        "speed is reported, never asserted",
        file=stream,
    )
    for spec in BENCHMARKS:
        if spec.host_network and spec not in specs and not args.names:
            print(
                f"note: not running {spec.name!r}: it changes this host's network (network "
                "namespaces, veth pairs, tc); name it or pass --two-hosts",
                file=stream,
            )
    print(format_environment(env), file=stream, flush=True)
    started = time.perf_counter()
    results = [_run_one(spec, quick, stream) for spec in specs]
    total = time.perf_counter() - started
    print("", file=stream)
    print(_summary(results), file=stream)
    print(f"total {total:.1f} s", file=stream, flush=True)
    if args.json:
        env_json: dict[str, JSONValue] = dict(env)
        doc: dict[str, JSONValue] = {
            "mode": mode,
            "environment": env_json,
            "total_s": round(total, 3),
            "results": [r.to_json() for r in results],
        }
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
        print(f"wrote {args.json}", file=stream)
    if args.plot is not None:
        for path in bench_plots.plot_results(results, Path(args.plot)):
            print(f"plot: {path}", file=stream)
    return 1 if any(r.status == "error" for r in results) else 0
