"""PNG pictures of benchmark results (``python -m bench ... --plot DIR``).

Drawn from a result's table (:class:`~bench._harness.BenchResult` rows), with
:mod:`stress.plots`'s matplotlib loader (the ``plots`` extra, Agg backend):

* ``curves`` -> ``bench-curves.png``: per-room cost against the room's size on each curve
  (chunks per room, sessions per room, rooms in flight), the sender, the no-op transport and
  bare NIXL; wall time on top, process CPU time below; log-log, so a slope of 1 is linear.
* ``throughput`` -> ``bench-throughput.png``: GB/s (left) and CPU ms per GB (right) of each
  case, one bar per way of writing.

Other benchmarks have no picture (:func:`plot_results` skips them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench._harness import BenchResult, Cell
from stress.plots import pyplot, save

BASE_CHUNKS = 8
"""The base room's chunks (``bench.curves.BASE_CHUNKS``; the sessions and rooms curves vary
from it). Repeated here so that drawing does not import the benchmark (torch, NIXL)."""

CURVE_AXES = (
    ("chunks", "chunks per room (1 session, 1 room in flight)"),
    ("sessions", f"sessions per room ({BASE_CHUNKS} chunks, 1 room in flight)"),
    ("rooms", f"rooms in flight ({BASE_CHUNKS} chunks, 1 session)"),
)
CURVE_WAYS = (
    ("sender", "sender", "#1f77b4"),
    ("no-op", "no-op transport", "#2ca02c"),
    ("bare", "bare NIXL", "#d62728"),
)
THROUGHPUT_WAYS = ("ours", "ours checked", "raw prepped", "raw NIXL", "CMA", "torch 1t")
THROUGHPUT_COLORS = ("#1f77b4", "#17becf", "#d62728", "#ff7f0e", "#7f7f7f", "#2ca02c")
THROUGHPUT_NAMES = {
    "ours": "ours (sender transport)",
    "ours checked": "ours, checked pages",
    "raw prepped": "bare NIXL, prepped",
    "raw NIXL": "bare NIXL, per-write lists",
    "CMA": "CMA (process_vm_writev)",
    "torch 1t": "torch copy_ in-process (1 thread)",
}


def _num(value: Cell) -> float | None:
    return float(value) if isinstance(value, int | float) and value > 0 else None


def _points(rows: Sequence[dict[str, Cell]], axis: str, workers: int) -> list[dict[str, Cell]]:
    """The rows on curve ``axis`` (with ``workers`` transfer workers), in size order."""

    def on(row: dict[str, Cell]) -> bool:
        if row.get("workers") != workers:
            return False
        if axis == "chunks":
            return row.get("sessions") == 1 and row.get("rooms") == 1
        if axis == "sessions":
            return row.get("chunks") == BASE_CHUNKS and row.get("rooms") == 1
        return row.get("chunks") == BASE_CHUNKS and row.get("sessions") == 1

    picked = [row for row in rows if on(row)]
    return sorted(picked, key=lambda row: _num(row.get(axis)) or 0.0)


def curves_png(result: BenchResult, directory: Path) -> Path:
    """Draw ``bench-curves.png`` from a ``curves`` result.

    Raises:
        ModuleNotFoundError: no matplotlib (the ``plots`` extra).
        OSError: the picture cannot be written.
    """
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(17.5, 8.5))
    workers = sorted({w for w in (r.get("workers") for r in result.rows) if isinstance(w, int)})
    for col, (axis, xlabel) in enumerate(CURVE_AXES):
        for row_i, (suffix, what) in enumerate(((" µs", "wall"), (" cpu", "process CPU"))):
            ax = axes[row_i][col]
            for way, name, color in CURVE_WAYS:
                ways_workers = workers if axis == "rooms" and way != "bare" else [0]
                for index, w in enumerate(ways_workers):
                    pts = _points(result.rows, axis, w)
                    xs = [_num(p.get(axis)) for p in pts]
                    ys = [_num(p.get(way + suffix)) for p in pts]
                    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if x and y]
                    if not pairs:
                        continue
                    label = name if len(ways_workers) == 1 else f"{name}, {w} workers"
                    style = ("-", "--", ":", "-.")[index % 4]
                    ax.plot(
                        [p[0] for p in pairs], [p[1] for p in pairs],
                        marker=("o", "s", "^", "D")[index % 4],
                        linestyle=style, color=color, label=label,
                    )  # fmt: skip
            ax.set_xscale("log", base=2)
            sizes = sorted({int(x) for r in result.rows if (x := _num(r.get(axis)))})
            ax.set_xticks(sizes, [str(x) for x in sizes])
            ax.set_xticks([], minor=True)
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"{what} time per room (µs, log scale)")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{axis}: {what} µs per room", fontsize=11)
            if axis == "rooms":  # many lines: the legend goes beside the panel
                ax.legend(fontsize=8, handlelength=3.5, loc="upper left", bbox_to_anchor=(1.01, 1))
            else:
                ax.legend(fontsize=8, handlelength=3.5)
    rounds = result.params.get("rounds")
    fig.suptitle(
        "curves: per-room cost of the sender vs bare NIXL as a room grows "
        f"(medians of {rounds} rounds; lower is cheaper)",
        fontsize=13,
    )
    fig.tight_layout()
    return save(fig, directory / "bench-curves.png")


def throughput_png(result: BenchResult, directory: Path) -> Path:
    """Draw ``bench-throughput.png`` from a ``throughput`` result.

    Raises:
        ModuleNotFoundError: no matplotlib (the ``plots`` extra).
        OSError: the picture cannot be written.
    """
    plt = pyplot()
    units = (("GB/s", "throughput (GB/s, higher is faster)"),
             ("cpu ms/GB", "process CPU per GB moved (ms/GB, lower is cheaper)"))  # fmt: skip
    cases = list(dict.fromkeys(str(r.get("case")) for r in result.rows))
    ways = [w for w in THROUGHPUT_WAYS if w in result.columns]
    fig, axes = plt.subplots(1, 2, figsize=(15, 1.2 + 0.9 * len(cases)))
    height = 0.8 / max(1, len(ways))
    for ax, (unit, xlabel) in zip(axes, units, strict=True):
        by_case = {str(r.get("case")): r for r in result.rows if r.get("unit") == unit}
        for wi, way in enumerate(ways):
            ys = [i + (wi - (len(ways) - 1) / 2) * height for i in range(len(cases))]
            values = [_num(by_case.get(c, {}).get(way)) or 0.0 for c in cases]
            name = THROUGHPUT_NAMES.get(way, way)
            ax.barh(ys, values, height=height, label=name, color=THROUGHPUT_COLORS[wi])
        ax.set_yticks(range(len(cases)), cases)
        ax.invert_yaxis()
        ax.set_xlabel(xlabel)
        ax.grid(True, axis="x", alpha=0.3)
        ax.set_title(unit, fontsize=11)
    axes[0].legend(fontsize=8, loc="lower right")
    rounds = result.params.get("rounds")
    fig.suptitle(
        f"throughput: one process writing to a decode peer over NIXL, by way of writing "
        f"(medians of {rounds} rounds)",
        fontsize=13,
    )
    fig.tight_layout()
    return save(fig, directory / "bench-throughput.png")


PLOTTERS: dict[str, Callable[[BenchResult, Path], Path]] = {
    "curves": curves_png,
    "throughput": throughput_png,
}


def plot_results(results: Sequence[BenchResult], directory: Path) -> list[Path]:
    """Draw the picture of every ``ok`` result that has one; returns the paths written.

    Raises:
        ModuleNotFoundError: no matplotlib (the ``plots`` extra).
        OSError: a picture cannot be written.
    """
    written: list[Path] = []
    for result in results:
        draw = PLOTTERS.get(result.name)
        if draw is not None and result.status == "ok" and result.rows:
            written.append(draw(result, directory))
    return written


def result_from_json(doc: dict[str, Any]) -> BenchResult:
    """A :class:`BenchResult` with the table of one ``--json`` result (enough to draw it).
    Raises ``KeyError`` when ``doc`` lacks ``name`` or ``title``."""
    return BenchResult(
        name=doc["name"],
        title=doc["title"],
        columns=list(doc.get("columns", [])),
        rows=[dict(r) for r in doc.get("rows", [])],
        params=dict(doc.get("params", {})),
        status=doc.get("status", "ok"),
    )
