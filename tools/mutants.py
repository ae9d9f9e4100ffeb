"""``make mutants``: apply curated concurrency and lifecycle mutants and see what kills them.

For each mutant (every ``tools/mutants_*.py`` data module, e.g. ``tools/mutants_sender.py``; see
:class:`tools.mutants_spec.Mutant`) the runner

1. copies the repository (tracked and untracked files git does not ignore; no ``.venv``, no
   caches) into a scratch directory under a temporary directory,
2. replaces the mutant's site -- the statement(s) at its ``# mutant-site: NAME`` tag, which
   must occur exactly once in its file (:mod:`tools.mutant_sites`) -- with its replacement
   (else: "stale mutant", exit 2, before anything runs),
3. runs the mutant's fast targeted tests with this interpreter (the project venv under
   ``make``), cwd and ``PYTHONPATH`` = the copy, through the :mod:`tools.mutants_guard`
   plugin, which checks that ``staging``/``sender``/``stress`` and the mutated module were
   imported from the copy (exit 2 if not) and records per test whether it is a concurrency
   check (lowered GIL switch interval, threads started by the test, DPOR, stress; minus
   :data:`~tools.mutants_spec.NOT_CONCURRENCY_CHECKS`, e.g. a lock-acquisition counter),
4. runs ``python -m stress --quick SCENARIO --seed N`` for its scenarios (every stress
   invariant is a concurrency check),
5. records every check that failed: a pytest node id or ``stress:SCENARIO:INVARIANT``.

A baseline run of the unmutated copy comes first; checks that fail there are reported and
never count as killers. Mutants run one after another, each phase under a timeout.

Exit status: 0 when every mutant was killed and every ``race`` mutant by at least one
concurrency check; 1 otherwise; 2 for a stale mutant, a copy that was not what got imported,
or bad arguments.

Usage: ``python -m tools.mutants [--list] [--only ID,ID] [--json PATH] [--timeout S] ...``
(``make mutants``, ``make mutants MUTANTS=id1,id2``, ``make mutants MUTANTS_ARGS=--list``).
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.mutant_sites import SiteError, locate, mutate
from tools.mutants_spec import NOT_CONCURRENCY_CHECKS, Mutant

REPO = Path(__file__).resolve().parents[1]
_NOT_DATA = frozenset({"mutants", "mutants_spec", "mutants_guard"})
DATA_MODULES = tuple(
    f"tools.{p.stem}"
    for p in sorted(Path(__file__).parent.glob("mutants_*.py"))
    if p.stem not in _NOT_DATA
)
"""Every ``tools/mutants_*.py`` that defines ``MUTANTS`` (the runner, spec and guard excluded):
one data module per mechanism family, so that mutants of different areas live apart."""
EXCLUDED_PARTS = frozenset(
    {
        ".venv",
        ".git",
        "__pycache__",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        ".hypothesis",
        "build",
    }
)
DEFAULT_JSON = REPO / "build" / "mutants" / "report.json"
CONCURRENCY_SIGNALS = frozenset({"fast_switch", "threads", "dpor", "stress"})


class StaleMutantError(Exception):
    """A mutant's site tag is not found exactly once in its file, or is not at a statement."""


class ImportCheckError(Exception):
    """A child run imported the code under test from outside its scratch copy."""


@dataclass
class Killer:
    """One check that failed on a mutant."""

    check: str
    concurrency: bool
    signals: tuple[str, ...] = ()
    message: str = ""


@dataclass
class Outcome:
    """What one run (baseline or mutant) produced."""

    killers: list[Killer] = field(default_factory=list)
    tests_run: int = 0
    timeouts: list[str] = field(default_factory=list)
    module_loaded: bool = True
    wall_s: float = 0.0


# ---------------------------------------------------------------------------- mutant list


def load_mutants(modules: Sequence[str] = DATA_MODULES) -> tuple[list[Mutant], list[str]]:
    """All mutants of the data modules; and a note per module skipped for an empty list.

    Raises:
        ValueError: a duplicate id, or a module without a ``MUTANTS`` tuple of Mutant.
    """
    mutants: list[Mutant] = []
    notes: list[str] = []
    for name in modules:
        found = getattr(importlib.import_module(name), "MUTANTS", None)
        if not isinstance(found, tuple) or not all(isinstance(m, Mutant) for m in found):
            raise ValueError(f"{name}.MUTANTS must be a tuple of Mutant")
        if not found:
            notes.append(f"{name}: no mutants defined, skipped")
        mutants.extend(found)
    ids = [m.id for m in mutants]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ValueError(f"duplicate mutant ids: {dupes}")
    return mutants, notes


def select(mutants: Sequence[Mutant], only: str | None) -> list[Mutant]:
    """The mutants named in ``only`` (comma-separated ids), in list order; all if empty.

    Raises:
        ValueError: an unknown id.
    """
    wanted = [w.strip() for w in (only or "").split(",") if w.strip()]
    if not wanted:
        return list(mutants)
    known = {m.id for m in mutants}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise ValueError(f"unknown mutant ids {unknown}; see --list")
    return [m for m in mutants if m.id in wanted]


def site_problem(mutant: Mutant, root: Path) -> str | None:
    """Why the mutant cannot be applied to the copy at ``root`` (``None``: it can)."""
    path = root / mutant.file
    if not path.is_file():
        return f"{mutant.file}: no such file"
    text = path.read_text(encoding="utf-8")
    try:
        for site, _, statements in mutant.edits:
            locate(text, site, statements)
    except SiteError as exc:
        return f"{mutant.file}: {exc}"
    return None


def apply(mutant: Mutant, root: Path) -> None:
    """Apply ``mutant`` to the copy at ``root``.

    Raises:
        StaleMutantError: a site tag is not found exactly once or is not at a statement (also
            after the edits before it), the replacement is the site's code, or the mutated
            file does not parse.
    """
    path = root / mutant.file
    problem = site_problem(mutant, root)
    if problem is not None:
        raise StaleMutantError(f"mutant {mutant.id}: {problem}: update the tag or the mutant")
    original = path.read_text(encoding="utf-8")
    text = original
    try:
        for site, replacement, statements in mutant.edits:
            text = mutate(text, site, replacement, statements)
    except SiteError as exc:  # a later site inside an earlier edit's statements
        raise StaleMutantError(f"mutant {mutant.id}: {mutant.file}: {exc}") from exc
    if text == original:
        raise StaleMutantError(f"mutant {mutant.id}: its replacement is its site's code (no-op)")
    try:
        compile(text, str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise StaleMutantError(
            f"mutant {mutant.id}: the mutated file does not parse: {exc}"
        ) from exc
    path.write_text(text, encoding="utf-8")


# ---------------------------------------------------------------------------- scratch copy


def repo_files(repo: Path) -> list[Path]:
    """Tracked and untracked-not-ignored files (relative), minus venv and caches."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=repo,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
        names = [Path(n) for n in out.decode().split("\0") if n]
    except (OSError, subprocess.SubprocessError):
        names = [p.relative_to(repo) for p in repo.rglob("*") if p.is_file()]
    return sorted(
        n for n in names if not EXCLUDED_PARTS.intersection(n.parts) and (repo / n).is_file()
    )


def snapshot(repo: Path, dest: Path) -> int:
    """Copy the repository's files into ``dest``; returns how many."""
    files = repo_files(repo)
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, target)
    return len(files)


# ---------------------------------------------------------------------------- child runs


def _child_env(scratch: Path, module: str, result: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONHOME", None)
    env["PYTHONPATH"] = str(scratch)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["MUTANTS_SCRATCH"] = str(scratch)
    env["MUTANTS_MODULE"] = module
    env["MUTANTS_RESULT"] = str(result)
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], log: Path, timeout_s: float) -> bool:
    """Run ``cmd`` in its own process group, output to ``log``; ``False`` on timeout."""
    log.unlink(missing_ok=True)
    with log.open("wb") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            out.write(f"\n[mutants] killed after {timeout_s:g} s\n".encode())
            return False
        except BaseException:  # Ctrl-C / SIGTERM: the child is in its own session, stop it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            raise


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def is_concurrency_check(nodeid: str, signals: Iterable[str]) -> bool:
    """A test is a concurrency check when its body lowered the GIL switch interval, started
    threads itself, ran under DPOR or ran a stress scenario -- unless it is listed in
    :data:`~tools.mutants_spec.NOT_CONCURRENCY_CHECKS`."""
    if any(fnmatch.fnmatchcase(nodeid, pattern) for pattern in NOT_CONCURRENCY_CHECKS):
        return False
    return bool(CONCURRENCY_SIGNALS.intersection(signals))


def _check_imports(records: Iterable[dict[str, Any]], what: str) -> bool:
    """Raise on any import problem; return whether the mutated module was imported."""
    loaded = False
    seen = False
    for rec in records:
        if rec.get("event") in ("imports", "imports-at-end"):
            seen = True
            if rec["problems"]:
                raise ImportCheckError(f"{what}: " + "; ".join(rec["problems"]))
            loaded = loaded or bool(rec["module_loaded"])
    if not seen:
        raise ImportCheckError(f"{what}: the child never reported its imports (see its log)")
    return loaded


def run_checks(
    mutant_like: Mutant,
    scratch: Path,
    logs: Path,
    *,
    python: str,
    timeout_s: float,
    seed: int,
    stress: bool,
    tests: Sequence[str] | None = None,
    scenarios: Sequence[str] | None = None,
    tag: str | None = None,
) -> Outcome:
    """Run the targeted tests and stress scenarios in ``scratch``; collect what failed."""
    tag = tag or mutant_like.id
    tests = list(mutant_like.tests if tests is None else tests)
    scenarios = list(mutant_like.stress if scenarios is None else scenarios) if stress else []
    outcome = Outcome()
    started = time.monotonic()
    loaded = False
    if tests:
        result = logs / f"{tag}.pytest.jsonl"
        result.unlink(missing_ok=True)
        cmd = [
            python,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tools.mutants_guard",
            "-o",
            "addopts=",
            "--tb=line",
            *tests,
        ]
        env = _child_env(scratch, mutant_like.module, result)
        if not _run(cmd, scratch, env, logs / f"{tag}.pytest.log", timeout_s):
            outcome.timeouts.append("pytest")
        records = _records(result)
        loaded = _check_imports(records, f"{tag} pytest") or loaded
        for rec in records:
            if rec.get("event") != "test":
                continue
            outcome.tests_run += rec["when"] == "call"
            if rec["outcome"] == "failed":
                signals = tuple(rec["signals"])
                check = rec["nodeid"] if rec["when"] == "call" else f"{rec['nodeid']}@{rec['when']}"
                outcome.killers.append(
                    Killer(
                        check, is_concurrency_check(rec["nodeid"], signals), signals, rec["message"]
                    )
                )
    for scenario in scenarios:
        result = logs / f"{tag}.stress-{scenario}.jsonl"
        report = logs / f"{tag}.stress-{scenario}.json"
        result.unlink(missing_ok=True)
        report.unlink(missing_ok=True)
        cmd = [
            python,
            "-m",
            "tools.mutants_guard",
            scenario,
            "--quick",
            "--seed",
            str(seed),
            "--progress",
            "off",
            "--json",
            str(report),
        ]
        env = _child_env(scratch, mutant_like.module, result)
        log = logs / f"{tag}.stress-{scenario}.log"
        if not _run(cmd, scratch, env, log, timeout_s):
            outcome.timeouts.append(f"stress:{scenario}")
        loaded = _check_imports(_records(result), f"{tag} stress {scenario}") or loaded
        if report.exists():
            doc = json.loads(report.read_text(encoding="utf-8"))
            for sc in doc.get("scenarios", []):
                for name, inv in sc.get("invariants", {}).items():
                    if inv.get("violations", 0):
                        examples = inv.get("examples") or [""]
                        outcome.killers.append(
                            Killer(
                                f"stress:{scenario}:{name}",
                                True,
                                ("stress",),
                                f"{inv['violations']} violations; {examples[0]}"[:300],
                            )
                        )
        elif f"stress:{scenario}" not in outcome.timeouts:
            outcome.killers.append(
                Killer(f"stress:{scenario}:crashed", False, (), f"no report; see {log.name}")
            )
    outcome.module_loaded = loaded
    outcome.wall_s = round(time.monotonic() - started, 1)
    return outcome


# ---------------------------------------------------------------------------- verdicts


def verdict(mutant: Mutant, killers: Sequence[Killer]) -> str:
    """``killed``, ``SURVIVED``, or ``RACE NOT BY CONCURRENCY CHECK``."""
    if not killers:
        return "SURVIVED"
    if mutant.kind == "race" and not any(k.concurrency for k in killers):
        return "RACE NOT BY CONCURRENCY CHECK"
    return "killed"


def _short(check: str, width: int = 64) -> str:
    short = check.removeprefix("tests/").replace(".py::", "::")
    return short if len(short) <= width else short[: width - 3] + "..."


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The summary table: mutant, kind, killed?, by what, concurrency check?, verdict."""
    header = ("mutant", "kind", "killed", "killed by (first of each kind)", "conc.", "verdict")
    lines: list[tuple[str, ...]] = [header]
    for row in rows:
        killers = row["killers"]
        conc = [k for k in killers if k["concurrency"]]
        other = [k for k in killers if not k["concurrency"]]
        shown = [_short(k["check"]) for k in (conc[:1] + other[:1])]
        more = len(killers) - len(shown)
        by = ", ".join(shown) + (f" (+{more})" if more > 0 else "") if shown else "-"
        lines.append(
            (
                row["id"],
                row["kind"],
                "yes" if killers else "NO",
                by,
                "yes" if conc else "no",
                row["verdict"],
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for n, line in enumerate(lines):
        out.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def list_table(mutants: Sequence[Mutant]) -> str:
    """``--list``: one line per mutant."""
    lines = [f"{'id':40s} {'kind':10s} {'file':22s} description"]
    for m in mutants:
        lines.append(f"{m.id:40s} {m.kind:10s} {m.file:22s} {m.description}")
        count = f" ({m.statements} statements)" if m.statements > 1 else ""
        more = "".join(f", {site}" for site, _ in m.also)
        lines.append(f"{'':74s}site: {m.site}{count}{more}")
        lines.append(
            f"{'':74s}runs: {' '.join(m.tests)}" + "".join(f" stress:{s}" for s in m.stress)
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m tools.mutants", description=__doc__.split("\n")[0])
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--only", default=os.environ.get("MUTANTS", ""), help="ids, comma-separated")
    default_json = DEFAULT_JSON.relative_to(REPO)
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"default {default_json}")
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds per phase (pytest, each stress run)"
    )
    p.add_argument("--seed", type=int, default=1, help="stress --seed")
    p.add_argument("--no-stress", action="store_true", help="skip the stress runs")
    p.add_argument("--tests", default="", help="pytest targets instead of each mutant's (a,b)")
    p.add_argument("--no-baseline", action="store_true", help="skip the unmutated baseline run")
    p.add_argument("--keep", action="store_true", help="keep the scratch copies")
    p.add_argument("--python", default=sys.executable, help="interpreter (default: this one)")
    return p


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args = build_parser().parse_args(argv)
    args.json = Path(args.json).resolve()  # children run in the scratch copy: no relative path
    try:
        mutants, notes = load_mutants()
        chosen = select(mutants, args.only)
    except ValueError as exc:
        print(f"mutants: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}")
    if args.list:
        print(list_table(mutants))
        return 0
    if not chosen:
        print("mutants: nothing to run")
        return 0
    signal.signal(signal.SIGTERM, _interrupt)
    tmp = Path(tempfile.mkdtemp(prefix="nixl-mutants-"))
    logs = args.json.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        return _run_all(args, chosen, tmp, logs, started)
    except (StaleMutantError, ImportCheckError) as exc:
        print(f"\nmutants: ERROR: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nmutants: interrupted", file=sys.stderr)
        return 130
    finally:
        if args.keep:
            print(f"scratch copies kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _run_all(
    args: argparse.Namespace, chosen: list[Mutant], tmp: Path, logs: Path, started: float
) -> int:
    base = tmp / "base"
    copied = snapshot(REPO, base)
    override = [t for t in args.tests.split(",") if t] or None
    stale = [  # every site is checked before anything runs
        f"{m.id} ({problem})" for m in chosen if (problem := site_problem(m, base)) is not None
    ]
    if stale:
        raise StaleMutantError("stale mutants: " + "; ".join(stale))
    print(f"{len(chosen)} mutants; copy of {copied} files in {base}; python {args.python}")
    print(f"logs and report: {args.json.parent}")

    baseline_failed: set[str] = set()
    baseline: dict[str, Any] = {"skipped": bool(args.no_baseline)}
    if not args.no_baseline:
        tests = override or list(dict.fromkeys(t for m in chosen for t in m.tests))
        scenarios = list(dict.fromkeys(s for m in chosen for s in m.stress))
        print(
            f"baseline (unmutated): {len(tests)} test targets, stress {scenarios or '-'} ...",
            flush=True,
        )
        out = run_checks(
            chosen[0],
            base,
            logs,
            python=args.python,
            timeout_s=args.timeout,
            seed=args.seed,
            stress=not args.no_stress,
            tests=tests,
            scenarios=scenarios,
            tag="baseline",
        )
        baseline_failed = {k.check for k in out.killers}
        baseline = {
            "failed": sorted(baseline_failed),
            "timeouts": out.timeouts,
            "tests_run": out.tests_run,
            "wall_s": out.wall_s,
        }
        print(
            f"  {out.tests_run} tests, {out.wall_s:g} s; failing unmutated "
            f"(never counted as killers): {sorted(baseline_failed) or 'none'}"
        )

    rows: list[dict[str, Any]] = []
    for n, mutant in enumerate(chosen, 1):
        print(f"[{n}/{len(chosen)}] {mutant.id} ({mutant.kind}) ...", flush=True)
        scratch = tmp / f"m-{mutant.id}"
        shutil.copytree(base, scratch)
        apply(mutant, scratch)
        out = run_checks(
            mutant,
            scratch,
            logs,
            python=args.python,
            timeout_s=args.timeout,
            seed=args.seed,
            stress=not args.no_stress,
            tests=override,
        )
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
        killers = [k for k in out.killers if k.check not in baseline_failed]
        killers.sort(key=lambda k: not k.concurrency)
        killers += [Killer(f"timeout:{t}", False) for t in out.timeouts]
        row: dict[str, Any] = {
            "id": mutant.id,
            "kind": mutant.kind,
            "file": mutant.file,
            "description": mutant.description,
            "killed": bool(killers),
            "killed_by_concurrency_check": any(k.concurrency for k in killers),
            "killers": [k.__dict__ | {"signals": list(k.signals)} for k in killers],
            "tests_run": out.tests_run,
            "module_imported": out.module_loaded,
            "wall_s": out.wall_s,
        }
        row["verdict"] = verdict(mutant, killers)
        if not out.module_loaded:
            row["verdict"] += " (mutated module never imported)"
        rows.append(row)
        conc = sum(k.concurrency for k in killers)
        print(
            f"    {row['verdict']}: {len(killers)} failing checks ({conc} concurrency), "
            f"{out.wall_s:g} s",
            flush=True,
        )

    wall = round(time.monotonic() - started, 1)
    ok = all(r["verdict"] == "killed" for r in rows)
    print()
    print(table(rows))
    print()
    killed = sum(r["killed"] for r in rows)
    races = [r for r in rows if r["kind"] == "race"]
    print(
        f"killed {killed}/{len(rows)}; race mutants killed by a concurrency check "
        f"{sum(r['killed_by_concurrency_check'] for r in races)}/{len(races)}; "
        f"wall {wall:g} s; {'PASS' if ok else 'FAIL'}"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "ok": ok,
        "wall_s": wall,
        "seed": args.seed,
        "python": args.python,
        "stress": not args.no_stress,
        "baseline": baseline,
        "mutants": rows,
    }
    args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(f"report: {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
