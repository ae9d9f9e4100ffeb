"""``python -m stress``: run the registered stress scenarios and report every invariant.

Exit status: 0 if every invariant of every scenario that ran held, 1 otherwise, 2 for bad
arguments, 3 with ``--require-all`` when a scenario was skipped (it could not run here, e.g.
``two-hosts`` without root, or a missing extra). Without ``--require-all`` a skipped scenario
is reported ``SKIP`` with its reason and does not change the exit status.

The first line printed is always ``seed: N``. ``--seed N`` replays the same *plan*: every
worker's random choices (``StressConfig.rng``). It does not fix the thread schedule, which
the OS and the GIL decide, so two runs with one seed do different numbers of operations
(e.g. 97,280 and 68,342) and may interleave differently. On a FAIL the report ends with the
exact command line that replays the failed scenarios with the same seed and options.
The environment follows it (versions of nixl-staging, Python, torch, nixl and the machine:
:mod:`stress.environment`, as ``python -m bench`` prints it), and ``--json`` records it;
``--version`` prints the versions alone, on a core install too.

Nothing touches the host's network unless asked: a scenario that creates network namespaces,
veth pairs and ``tc`` shaping (``two-hosts``, which also needs root) runs only when it is
named or ``--two-hosts`` is given; a plain ``python -m stress`` says it left it out.
``make stress`` and ``make stress-quick`` pass ``--two-hosts``.

Test-only: the hidden option ``--plant-bug NAME`` asks scenarios to swap in a deliberate bug
(``staging-race`` knows ``resurrect``; ``peer-isolation`` knows
``worker-waits-on-its-chunk``) so that tests can check a violation makes the exit
status 1. It is not for normal use and is not shown by ``--help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from collections.abc import Sequence
from pathlib import Path

from stress import metrics_sink, plots
from stress.environment import environment, format_environment, versions
from stress.framework import (
    QUICK_DURATION_S,
    Scenario,
    ScenarioResult,
    StressConfig,
    find_scenario,
    missing_extra,
    registered,
    run_scenario,
    skipped_result,
    skipped_scenarios,
)
from stress.native_stderr import NativeStderr
from stress.report import (
    invariant_table,
    native_table,
    replay_command,
    sender_log_table,
    summary_table,
    write_json,
)
from stress.sender_log import SenderLog

EXIT_SKIPPED = 3
"""Exit status under ``--require-all`` when a scenario was skipped (and none failed)."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within [0, 1], got {text}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the scenario list as written and shows every option's default (except flags
    and options whose default is "none")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in text:
            return text
        return f"{text} (default: %(default)s)"


def build_parser(*, list_scenarios: bool = True) -> argparse.ArgumentParser:
    """The argument parser (scenario names are checked against the registry in ``main``).

    ``list_scenarios`` loads the registry to list the scenarios in ``--help``; scenario
    modules may import heavy dependencies, so ``main`` does that only when help is asked for.
    """
    epilog = None
    if list_scenarios:
        lines = [f"  {name:18s} {s.description}" for name, s in registered().items()]
        skipped = skipped_scenarios().items()
        lines += [f"  {name:18s} (not available: {why})" for name, why in skipped]
        epilog = "scenarios:\n" + "\n".join(lines)
    parser = argparse.ArgumentParser(
        prog="python -m stress",
        description="Concurrency stress scenarios with named invariants.",
        epilog=epilog,
        formatter_class=_HelpFormatter,
    )
    d = StressConfig()
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO", help="default: all")
    parser.add_argument("--threads", type=_positive_int, default=d.threads, help="workers")
    parser.add_argument("--rooms", type=_positive_int, default=d.rooms, help="room ids")
    parser.add_argument("--chunks", type=_positive_int, default=d.chunks, help="per room")
    parser.add_argument("--fault-rate", type=_rate, default=d.fault_rate, help="0..1")
    parser.add_argument("--peer-kill", action="store_true", help="SIGKILL decode peers")
    parser.add_argument("--peer-stop", action="store_true", help="SIGSTOP decode peers")
    parser.add_argument(
        "--duration", type=_positive_float, default=None, help="seconds per scenario"
    )
    parser.add_argument(
        "--seed", type=_seed, default=None,
        help="fixes each worker's plan (its random choices), not the thread schedule: a run "
        "with the same seed makes the same choices but its op counts and interleavings "
        "differ (default: a random seed, printed first)",
    )  # fmt: skip
    parser.add_argument(
        "--switch-interval", type=_positive_float, default=d.switch_interval,
        help="sys.setswitchinterval during runs",
    )  # fmt: skip
    parser.add_argument(
        "--lock", choices=("rw", "mutex"), default=d.lock,
        help="lock kind of the staging contexts under test",
    )  # fmt: skip
    parser.add_argument(
        "--watchdog", type=_positive_float, default=d.watchdog_s,
        help="seconds without progress that count as a deadlock",
    )  # fmt: skip
    parser.add_argument("--json", metavar="PATH", default=None, help="write results as JSON")
    parser.add_argument(
        "--plot", metavar="DIR", default=None,
        help="write PNG pictures of the run to DIR (stress-latency.png: each scenario's "
        "per-room latency distribution, healthy and faulted rooms or phases apart); needs "
        "the 'plots' extra (matplotlib)",
    )  # fmt: skip
    parser.add_argument(
        "--metrics", metavar="PATH", default=None,
        help="write the sender scenarios' Prometheus metrics (text exposition: rooms by "
        "outcome and reason, latency histograms, the last manager's counters) to PATH at the "
        "end; needs the 'metrics' extra",
    )  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true",
        help=f"{QUICK_DURATION_S:g} s of load per scenario (its 'run s'); set-up and checks "
        "add to it: a sender scenario starts and reaps decode peer processes, 5-20 s of wall "
        "time each on 2 cores",
    )  # fmt: skip
    parser.add_argument(
        "--progress", choices=("auto", "on", "off"), default="auto",
        help="live progress line on stderr (auto: only on a terminal)",
    )  # fmt: skip
    parser.add_argument(
        "--native-stderr", choices=("count", "show", "pass"), default="count",
        help="NIXL/UCX lines written to fd 2: count them by class in the report (count), "
        "count and print them labelled (show), or leave fd 2 alone (pass)",
    )  # fmt: skip
    parser.add_argument(
        "--sender-log", choices=("count", "show"), default="count",
        help="the sender's and staging layer's own log records (one WARNING per failed "
        "room: thousands in a run that fails rooms on purpose): count them by kind in the "
        "report (count), or leave logging as configured (show)",
    )  # fmt: skip
    parser.add_argument(
        "--require-all", action="store_true",
        help=f"exit with status {EXIT_SKIPPED} when a scenario is skipped (cannot run here)",
    )  # fmt: skip
    parser.add_argument(
        "--two-hosts", action="store_true",
        help="also run the scenarios that change this host's network (two-hosts: network "
        "namespaces, veth pairs, tc shaping; needs root); naming one runs it too",
    )  # fmt: skip
    parser.add_argument(
        "--version", action="version", version=version_text(),
        help="print the versions of nixl-staging, Python, torch and nixl and exit",
    )  # fmt: skip
    parser.add_argument("--plant-bug", default=None, help=argparse.SUPPRESS)
    return parser


def version_text() -> str:
    """What ``--version`` prints: ``nixl-staging X`` then one line per dependency version
    (``not installed`` for one that is missing, e.g. torch and nixl without the ``sender``
    extra). Imports none of them. Raises nothing."""
    found = versions()
    own = found.pop("nixl-staging")
    return f"nixl-staging {own}\n{format_environment(found)}"


def config_from_args(args: argparse.Namespace, seed: int) -> StressConfig:
    """The :class:`StressConfig` of parsed arguments (``seed`` already chosen)."""
    return StressConfig(
        threads=args.threads,
        rooms=args.rooms,
        chunks=args.chunks,
        fault_rate=args.fault_rate,
        peer_kill=args.peer_kill,
        peer_stop=args.peer_stop,
        duration=args.duration,
        seed=seed,
        switch_interval=args.switch_interval,
        lock=args.lock,
        quick=args.quick,
        watchdog_s=args.watchdog,
        plant_bug=args.plant_bug,
    )


def touches_host_network(scenario: Scenario) -> bool:
    """``True`` for a scenario that changes this host's network (its ``host_network``
    attribute): run only when named or with ``--two-hosts``. Raises: nothing."""
    return getattr(scenario, "host_network", False) is True


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (argparse exits 2 itself on bad arguments)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    wants_help = any(a in ("-h", "--help") for a in argv)
    parser = build_parser(list_scenarios=wants_help)
    args = parser.parse_args(argv)
    chosen: dict[str, Scenario] = {}
    for name in dict.fromkeys(args.scenarios):  # only the named ones get imported
        try:
            found = find_scenario(name)
        except ModuleNotFoundError as exc:
            reason = missing_extra(exc)
            if reason is None:
                raise
            parser.exit(2, f"{parser.prog}: error: scenario {name!r} {reason}\n")
        if found is None:
            parser.error(f"unknown scenario {name!r}; choose from {sorted(registered())}")
        chosen[name] = found
    skipped: dict[str, str] = {}
    left_out: list[str] = []
    if not chosen:
        chosen, skipped = registered(), skipped_scenarios()
        if not args.two_hosts:
            left_out = [n for n, s in chosen.items() if touches_host_network(s)]
            chosen = {n: s for n, s in chosen.items() if n not in left_out}
    elif args.two_hosts:
        chosen |= {n: s for n, s in registered().items() if touches_host_network(s)}
    if args.plot is not None:
        why_not = plots.unavailable()
        if why_not is not None:
            parser.exit(2, f"{parser.prog}: error: {why_not}\n")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    config = config_from_args(args, seed)
    print(f"seed: {seed}", flush=True)
    env = environment()
    print("environment:\n" + format_environment(env), flush=True)
    for name, why in skipped.items():
        print(f"note: skipping scenario {name!r}: it {why}", flush=True)
    for name in left_out:
        print(
            f"note: not running scenario {name!r}: it changes this host's network (network "
            "namespaces, veth pairs, tc); name it or pass --two-hosts",
            flush=True,
        )
    if args.metrics:
        why_not = metrics_sink.enable()
        if why_not is not None:
            parser.exit(2, f"{parser.prog}: error: {why_not}\n")
    progress = {"auto": None, "on": True, "off": False}[args.progress]
    results: list[ScenarioResult] = [
        skipped_result(name, why, config) for name, why in skipped.items()
    ]
    native = (
        None if args.native_stderr == "pass" else NativeStderr(show=args.native_stderr == "show")
    )
    if native is not None:
        try:
            native.start()
        except OSError as exc:  # e.g. no fd 2: run without the capture
            print(f"note: NIXL/UCX lines are not counted ({exc})", flush=True)
            native = None
    sender_log = SenderLog() if args.sender_log == "count" else None
    if sender_log is not None:
        sender_log.start()
    try:
        for name, scenario in chosen.items():
            print(
                f"== {name}: {config.duration_for(scenario):g} s, {config.threads} threads, "
                f"lock={config.lock}",
                flush=True,
            )
            result = run_scenario(
                scenario, config, progress=progress, hard_exit=True, native=native
            )
            if sender_log is not None:
                result = dataclasses.replace(result, sender_log=sender_log.take())
            results.append(result)
    finally:
        if sender_log is not None:
            sender_log.stop()
        if native is not None:
            native.stop()
    print()
    print(summary_table(results))
    native_text = native_table(results)
    if native_text:
        print()
        print(native_text)
    log_text = sender_log_table(results)
    if log_text:
        print()
        print(log_text)
    print()
    print(invariant_table(results))
    failed = [r.name for r in results if not r.ok]
    skips = [r.name for r in results if r.ok and r.skipped is not None]
    verdict = "FAIL" if failed else "PASS"
    if skips:
        verdict += f" ({len(skips)} skipped: {', '.join(skips)})"
    print()
    print(f"seed: {seed}  result: {verdict}", flush=True)
    if failed:
        print(f"replay: {replay_command(config, failed)}", flush=True)
    elif skips and args.require_all:
        print(f"--require-all: {len(skips)} scenario(s) skipped: exit {EXIT_SKIPPED}", flush=True)
    if args.json:
        write_json(args.json, config, results, env)
    if args.plot is not None:
        mode = "--quick, " if config.quick else ""
        heading = f"{mode}seed {seed}, nixl-staging {env['nixl-staging']}"
        for path in plots.stress_latencies(results, Path(args.plot), title=heading):
            print(f"plot: {path}", flush=True)
    if args.metrics:
        exposition = metrics_sink.exposition()
        if exposition is not None:
            with open(args.metrics, "wb") as out:
                out.write(exposition)
            print(f"metrics: {args.metrics}", flush=True)
    if failed:
        return 1
    return EXIT_SKIPPED if skips and args.require_all else 0


if __name__ == "__main__":
    sys.exit(main())
