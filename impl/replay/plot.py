"""The replay's PNG plot (matplotlib, Agg: no display needed, no global pyplot state).

Left: the cumulative hit ratio per tier over the replay (stacked L1, L2, L3) with the trace's
theoretical maximum as a dashed line. Right, when the run was a sweep: the final hit ratio per tier
against L1 capacity, stacked, with the maximum.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstrata.impl.replay.result import ReplayResult

__all__ = ["write_plot"]

_COLOURS = {"l1": "#2b6cb0", "l2": "#38a169", "l3": "#d69e2e"}


def _ratios(counts: list[int], totals: list[int]) -> list[float]:
    return [count / total if total else 0.0 for count, total in zip(counts, totals, strict=True)]


def _timeline(axes: Any, result: ReplayResult) -> None:
    line = result.timeline
    layers = [_ratios(getattr(line, tier), line.input_tokens) for tier in ("l1", "l2", "l3")]
    axes.stackplot(
        line.requests,
        layers,
        labels=["L1", "L2", "L3"],
        colors=[_COLOURS["l1"], _COLOURS["l2"], _COLOURS["l3"]],
        alpha=0.85,
    )
    axes.plot(
        line.requests,
        _ratios(line.max_hit_tokens, line.input_tokens),
        "k--",
        label="max (unbounded)",
    )
    axes.set_xlabel("requests replayed")
    axes.set_ylabel("cumulative hit ratio")
    axes.set_ylim(0, 1)
    axes.set_title("Hit ratio over the replay")
    axes.legend(loc="upper left")


def _sweep(axes: Any, result: ReplayResult) -> None:
    assert result.sweep is not None
    labels = [str(point["l1"]) for point in result.sweep]
    positions = list(range(len(labels)))
    bottom = [0.0] * len(labels)
    for tier in ("l1", "l2", "l3"):
        heights = [point["hit_ratio"][tier] for point in result.sweep]
        axes.bar(positions, heights, bottom=bottom, color=_COLOURS[tier], label=tier.upper())
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    axes.plot(
        positions,
        [point["max_hit_ratio"] for point in result.sweep],
        "k--",
        marker="o",
        label="max (unbounded)",
    )
    axes.set_xticks(positions, labels)
    axes.set_xlabel("L1 capacity")
    axes.set_ylabel("hit ratio")
    axes.set_ylim(0, 1)
    axes.set_title("Hit ratio against L1 capacity")
    axes.legend(loc="upper left")


def write_plot(result: ReplayResult, path: str | Path) -> None:
    """Write the plot of ``result`` to ``path`` as PNG (whatever the file's suffix)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415 (slow import)
    from matplotlib.figure import Figure  # noqa: PLC0415

    panels = 2 if result.sweep else 1
    figure = Figure(figsize=(6.5 * panels, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, panels, squeeze=False)[0]
    _timeline(axes[0], result)
    if result.sweep:
        _sweep(axes[1], result)
    figure.suptitle(f"kvstrata replay: {Path(result.trace).name}, {result.requests:,} requests")
    figure.savefig(Path(path), format="png", dpi=100)
