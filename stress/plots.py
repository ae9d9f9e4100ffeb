"""PNG pictures of results: ``--plot DIR`` of ``python -m stress`` and ``python -m bench``.

Needs the optional ``plots`` extra (matplotlib); nothing else imports matplotlib, and this
module imports it only when a picture is drawn, so ``import stress`` and ``python -m stress
--help`` never do. Without it, :func:`unavailable` gives the one line both CLIs print
before running anything. Pictures are drawn with the non-interactive Agg backend (no
display needed) and written as PNG.

The stress picture (:func:`stress_latencies`) shows, per scenario, the distribution of the
room latencies the scenario recorded (``Monitor.latency``), one line per group: the
fraction of rooms that concluded within a given time, so a faulted phase's tail sits to the
right of the healthy one. ``bench/plots.py`` draws the benchmarks' pictures with
:func:`pyplot` and :func:`save`.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stress.framework import ScenarioResult, percentile

if TYPE_CHECKING:
    from matplotlib.figure import Figure

EXTRA = "plots"
INSTALL_HINT = "pip install 'nixl-staging[plots]' (from a clone: pip install '.[plots]')"
MAX_POINTS = 2000
"""At most this many points per distribution line (quantiles of the sorted latencies)."""

LATENCY_MEANING = {
    "staging-race": "open_room to the purge_room that closed it",
}
"""What a scenario's room latency spans, when not the sender's admission to conclusion."""
SENDER_MEANING = "admission to conclusion"


def unavailable() -> str | None:
    """``None`` when matplotlib imports; else the one-line reason ``--plot`` cannot work,
    naming the ``plots`` extra and how to install it. Raises: nothing (any import error is
    the reason)."""
    try:
        importlib.import_module("matplotlib")
    except ImportError as exc:
        missing = exc.name or "matplotlib"
        return f"--plot needs the '{EXTRA}' extra (no module {missing!r}): {INSTALL_HINT}"
    return None


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display).

    Raises:
        ModuleNotFoundError: matplotlib is not installed; the message is
            :func:`unavailable`'s line.
    """
    why = unavailable()
    if why is not None:
        raise ModuleNotFoundError(why, name="matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Figure, path: Path) -> Path:
    """Write ``fig`` to ``path`` as PNG (its folder made if missing), close it, return
    ``path``. Raises ``OSError`` when it cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, dpi=110)
    finally:
        pyplot().close(fig)
    return path


def _quantiles(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """The empirical distribution of ``values``: sorted values and the percentage of values
    at or below each, thinned to :data:`MAX_POINTS` points (always ending at 100 %)."""
    ordered = sorted(values)
    n = len(ordered)
    step = max(1, n // MAX_POINTS)
    picks = list(range(step - 1, n, step))
    if picks[-1] != n - 1:
        picks.append(n - 1)
    return [ordered[i] for i in picks], [100.0 * (i + 1) / n for i in picks]


def _ms(seconds: float) -> str:
    """Milliseconds without an exponent: ``0.0123``, ``4.56``, ``78.9``, ``1,370``."""
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.3g}"


def _tick(value: float, _pos: object = None) -> str:
    """A log axis label in plain numbers: every power of ten, and 2 and 5 between them."""
    if value <= 0:
        return ""
    lead = value / 10 ** math.floor(math.log10(value) + 1e-9)
    if round(lead) not in (1, 2, 5) or abs(lead - round(lead)) > 1e-6:
        return ""
    return f"{value:,.0f}" if value >= 1 else f"{value:g}"


def _label(group: str, values: Sequence[float]) -> str:
    p50 = percentile(values, 50) or 0.0
    p99 = percentile(values, 99) or 0.0
    name = group or "all rooms"
    return f"{name}: n={len(values):,}, p50 {_ms(p50)} ms, p99 {_ms(p99)} ms"


def _style(group: str, index: int) -> dict[str, Any]:
    """Rooms around a peer fault red, the others blue (succeeded solid, failed dashed);
    groups of another kind (phases) one colour each."""
    dashed = "--" if group.endswith("failed") else "-"
    if "during a peer fault" in group:
        return {"color": "#d62728", "linestyle": dashed}
    if "no peer fault" in group:
        return {"color": "#1f77b4", "linestyle": dashed}
    palette = _colors()
    return {"color": palette[index % len(palette)], "linestyle": ("-", "--")[index // 10 % 2]}


def _colors() -> tuple[str, ...]:
    """Ten distinct colours (matplotlib's ``tab10``)."""
    return (
        "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
        "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    )  # fmt: skip


def stress_latencies(
    results: Sequence[ScenarioResult], directory: Path, *, title: str = ""
) -> list[Path]:
    """Draw ``stress-latency.png`` in ``directory``: one panel per scenario that recorded
    room latencies, one distribution line per group (:attr:`ScenarioResult.latency_groups`).
    Returns the paths written (none when no scenario recorded a latency). ``title`` is
    added to the picture's title (e.g. the seed).

    Raises:
        ModuleNotFoundError: no matplotlib (:func:`pyplot`).
        OSError: the picture cannot be written.
    """
    shown = [
        r for r in results if r.skipped is None and any(len(v) for v in r.latency_groups.values())
    ]
    if not shown:
        return []
    plt = pyplot()
    from matplotlib import ticker

    fig, axes = plt.subplots(
        len(shown), 1, figsize=(10, 3.6 * len(shown) + 0.8), squeeze=False, layout="constrained"
    )
    for ax, result in zip(axes[:, 0], shown, strict=True):
        groups: Mapping[str, Sequence[float]] = {
            g: v for g, v in result.latency_groups.items() if v
        }
        # Healthy first, then faulted; succeeded before failed within each.
        order = sorted(groups, key=lambda g: ("during a peer fault" in g, g.endswith("failed"), g))
        for index, group in enumerate(order):
            xs, ys = _quantiles(groups[group])
            ax.step(
                [x * 1e3 for x in xs], ys, where="post", label=_label(group, groups[group]),
                linewidth=1.6, **_style(group, index),
            )  # fmt: skip
        meaning = LATENCY_MEANING.get(result.name, SENDER_MEANING)
        ax.set_title(f"{result.name} ({result.status}): room latency, {meaning}", fontsize=11)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(_tick))
        ax.xaxis.set_minor_formatter(ticker.FuncFormatter(_tick))
        ax.set_xlabel("room latency (ms, log scale)")
        ax.set_ylabel("rooms concluded within (%)")
        ax.set_ylim(0, 101)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    heading = "Stress: distribution of per-room latency by scenario and phase"
    fig.suptitle(f"{heading}\n{title}" if title else heading, fontsize=12)
    return [save(fig, directory / "stress-latency.png")]
