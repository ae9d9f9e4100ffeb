"""``--plot DIR`` of ``python -m stress`` and ``python -m bench``: PNGs from small synthetic
results (fast, no NIXL), the one-line error without the ``plots`` extra, and no matplotlib
import where no picture is drawn."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from bench._harness import BenchResult
from stress.framework import Monitor, ScenarioResult, StressConfig, skipped_result
from stress.scenarios._sender_rig import NoticeTracker

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def _png(path: Path) -> None:
    assert path.is_file() and path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000


def _result(name: str, groups: dict[str, tuple[float, ...]]) -> ScenarioResult:
    base = skipped_result(name, "", StressConfig(seed=5))
    return ScenarioResult(
        **{**base.__dict__, "skipped": None, "latency_groups": groups, "rooms": 10}
    )


def test_stress_latency_picture_from_a_synthetic_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from stress import plots

    healthy = tuple(0.02 + 0.001 * i for i in range(300))
    faulted = tuple(0.05 + 0.01 * i for i in range(40))
    results = [
        _result(
            "peer-faults",
            {"no peer fault, succeeded": healthy, "during a peer fault, failed": faulted},
        ),
        _result("staging-race", {"": tuple(1e-4 * (i + 1) for i in range(5000))}),
        _result("nothing-recorded", {}),
        skipped_result("two-hosts", "needs root", StressConfig()),
    ]
    (path,) = plots.stress_latencies(results, tmp_path / "out", title="seed 5")
    assert path == tmp_path / "out" / "stress-latency.png"
    _png(path)
    assert plots.stress_latencies(results[2:], tmp_path / "none") == []


def test_monitor_keeps_latencies_by_group_and_json_summarises_them() -> None:
    mon = Monitor("x", (), duration_s=1.0, watchdog_s=5.0)
    mon.latency(0.010, "healthy")
    mon.latency(0.500, "faulted")
    mon.latency(0.020, "healthy")
    assert mon.latencies() == [0.010, 0.500, 0.020]
    assert mon.latency_groups() == {"healthy": (0.010, 0.020), "faulted": (0.500,)}
    doc = _result("s", mon.latency_groups()).to_json()
    assert doc["latency_groups"] == {
        "healthy": {"n": 2, "p50_ms": 10.0, "p99_ms": 20.0, "max_ms": 20.0},
        "faulted": {"n": 1, "p50_ms": 500.0, "p99_ms": 500.0, "max_ms": 500.0},
    }


def test_a_room_overlapping_a_peer_fault_is_told_apart() -> None:
    notices = NoticeTracker()
    window = notices.fault("decode-a", 10.0)
    assert notices.overlaps_fault("decode-a", 12.0, 13.0)  # still on
    notices.fault_end(window, 11.0)
    assert notices.overlaps_fault("decode-a", 9.0, 10.5)
    assert notices.overlaps_fault("decode-a", 10.9, 20.0)
    assert not notices.overlaps_fault("decode-a", 11.5, 12.0)
    assert not notices.overlaps_fault("decode-b", 10.0, 11.0)


def _curves_result() -> BenchResult:
    rows = []
    for curve, c, s, r, w in (
        ("chunks", 1, 1, 1, 0),
        ("chunks", 8, 1, 1, 0),
        ("chunks", 32, 1, 1, 0),
        ("sessions", 8, 4, 1, 0),
        ("rooms", 8, 1, 16, 0),
        ("rooms", 8, 1, 1, 2),
        ("rooms", 8, 1, 16, 2),
    ):
        writes = c * s
        row = {"curve": curve, "chunks": c, "sessions": s, "rooms": r, "workers": w}
        for way, cost in (("sender", 300.0), ("no-op", 40.0), ("bare", 150.0)):
            row[f"{way} µs"] = cost * writes / (1 + 0.1 * r) + 10 * w
            row[f"{way} cpu"] = 0.8 * cost * writes
        rows.append(row)
    return BenchResult(name="curves", title="t", columns=list(rows[0]), rows=rows, params={})


def _throughput_result() -> BenchResult:
    ways = ("ours", "ours checked", "raw prepped", "raw NIXL", "CMA", "torch 1t")
    rows = [
        {"case": case, "unit": unit, **{w: (i + 1.0) * (j + 1) for j, w in enumerate(ways)}}
        for i, case in enumerate(("64 KiB (4 pages)", "1 MiB", "16 MiB"))
        for unit in ("GB/s", "cpu ms/GB")
    ]
    return BenchResult(
        name="throughput", title="t", columns=["case", "unit", *ways], rows=rows, params={}
    )


@pytest.mark.slow
def test_bench_pictures_from_synthetic_results(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from bench import plots

    other = BenchResult(name="lifecycle", title="t", columns=["a"], rows=[{"a": 1}])
    failed = BenchResult(name="curves", title="t", status="error")
    paths = plots.plot_results([_curves_result(), _throughput_result(), other, failed], tmp_path)
    assert [p.name for p in paths] == ["bench-curves.png", "bench-throughput.png"]
    for path in paths:
        _png(path)
    again = plots.result_from_json(_curves_result().to_json())
    assert plots.plot_results([again], tmp_path / "json")[0].name == "bench-curves.png"


EXPECTED = (
    "--plot needs the 'plots' extra (no module 'matplotlib'): "
    "pip install 'nixl-staging[plots]' (from a clone: pip install '.[plots]')"
)


def test_without_matplotlib_plot_fails_in_one_line_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import bench.cli
    import stress.cli
    from stress import plots

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    assert plots.unavailable() == EXPECTED
    with pytest.raises(ModuleNotFoundError, match="'plots' extra"):
        plots.pyplot()

    def never(*_: object, **__: object) -> None:
        raise AssertionError("ran a scenario although --plot cannot work")

    monkeypatch.setattr(stress.cli, "run_scenario", never)
    with pytest.raises(SystemExit) as exc:
        stress.cli.main(["staging-race", "--quick", "--plot", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err == f"python -m stress: error: {EXPECTED}\n"

    out = io.StringIO()
    with pytest.raises(SystemExit) as exc:
        bench.cli.main(["purge-scaling", "--plot", str(tmp_path)], out=out)
    assert exc.value.code == 2 and out.getvalue() == ""  # nothing ran, no header
    assert capsys.readouterr().err == f"python -m bench: error: {EXPECTED}\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_no_matplotlib_import_without_a_picture() -> None:
    code = (
        "import sys\n"
        "import stress, stress.cli, stress.plots, stress.environment, bench.cli, bench.plots\n"
        "stress.cli.build_parser().format_help()\n"
        "stress.cli.version_text()\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib was imported'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50
    )
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "stress", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0 and "--plot DIR" in proc.stdout
    assert "matplotlib" not in proc.stderr
